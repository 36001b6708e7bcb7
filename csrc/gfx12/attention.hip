// module_gfx1201_sage_attention: SageAttention forward on prepared tensors (contract v2: head
// dims 64 / 128, causal, GQA, BF16/FP16 output, LSE with the K-smoothing correction).
//
//   Sᵀ = K8·Q8ᵀ      v_wmma_i32_16x16x16_iu8      (lane = one query, 8 consecutive keys)
//   online softmax   exp2 domain, FP32, row max across the two half-waves with one shfl_xor 16
//   Oᵀ += V8ᵀ·P8ᵀ    v_wmma_f32_16x16x16_fp8_fp8  (P converted to e4m3 in registers: the Sᵀ
//                    accumulator layout is the B-operand layout, so P never leaves the VGPRs)
//   O = acc / l · v_scale → out_dtype (BF16/FP16), saturated, only the head_dim real channels
//
// pv_dtype FP16 (AttnTraits<D, true>, the _pv16 kernels): P and V as FP16 and
//   Oᵀ += V16ᵀ·P16ᵀ  v_wmma_f32_16x16x16_f16 (P packed to FP16 in registers, same lanes)
//
// Variants: AttnTraits<kHeadDim, kPv16> (64 or 128, FP8 or FP16 P·V) x kCausal are template
// arguments, set in ONE place (dispatch_attention at the bottom) from head_dim_pad, pv_dtype
// and mask; everything else (GQA's
// kv head, out_dtype, head_dim, LSE, lse_corr) is read at run time outside the main loop. Work
// split (AttnTraits): a 128-thread workgroup owns 128 queries of one (batch, head); each
// of its 4 waves owns 32 queries (one Q scale block; with q_scale_rows 16 each of its two
// 16-query WMMA blocks has its own Q scale). K and V tiles of 32 keys are staged in
// LDS, shared by the 4 waves, double-buffered, with one barrier per tile. The padded lengths
// are multiples of 32 (upstream's layout), so a wave whose 32 queries lie past the real
// queries only helps stage K/V, and the last KV tile's V bytes past kv_len are zeroed when
// staged (P is 0 there, but 0 times a NaN left in the padding would not be). Lane layouts live in
// gfx12/fragments.h; csrc/gfx12/README.md explains the budget.
#include "sage/check.h"
#include "gfx12/fragments.h"
#include "sage/layout.h"
#include "sage/module_abi.h"
#include "sage/params.h"
#include "sage/platform.h"
#include "sage/quant.h"
#include "sage/static_switch.h"

// A scheduling fence for the HIP compiler (instructions are not moved across it); it has no
// effect on results, so the emulator build (plain C++) defines it away.
#if defined(__HIP__) && !defined(SAGE_EMU)
#define SAGE_ATTN_SCHED_FENCE() __builtin_amdgcn_sched_barrier(0)
#else
#define SAGE_ATTN_SCHED_FENCE() ((void)0)
#endif

namespace sage {
namespace gfx12 {

typedef float v2f32 __attribute__((ext_vector_type(2)));

// Holds two floats in one 64-bit VGPR pair (an empty inline asm with a 64-bit "v" operand), so
// x and y sit in consecutive VGPRs, i.e. in different VGPR banks (bank = VGPR index % 4). Two
// v_mul_f32 dual-issue as one VOPD instruction only when their first sources lie in different
// banks (and their destinations have different parity): with the rescale factor in both halves
// of a pair, the even accumulator VGPRs take .x and the odd ones .y, and all 128 rescale
// multiplies pair. As separate floats the allocator is free to (and did) put both copies in
// the same bank. No effect on values; the emulator build is plain C++.
SAGE_DEVICE v2f32 pin_vgpr_pair(v2f32 x) {
#if defined(__HIP__) && !defined(SAGE_EMU)
  asm("" : "+v"(x));
#endif
  return x;
}

// Tiling of one kernel variant. The WMMA lane facts (gfx12/fragments.h) do not depend on it;
// the head dim sets the number of WMMA K-steps (Q·Kᵀ) and of accumulator tiles (P·V), the LDS
// tile sizes and how many 16-byte pieces each thread stages.
template <int D, bool kFp16Pv = false>
struct AttnTraits {
  static_assert(D == SAGE_HEAD_DIM_SMALL || D == SAGE_HEAD_DIM_LARGE, "kernel head dims");
  static constexpr int kHeadDim = D;
  // pv_dtype FP16: P and V as FP16 (v_wmma_f32_16x16x16_f16) instead of e4m3; V tiles twice
  // the bytes (layout v16_lds_offset), P twice the VGPRs. Everything else is the same kernel.
  static constexpr bool kPv16 = kFp16Pv;
  static constexpr int kVCodeBytes = kPv16 ? 2 : 1;
  static constexpr int kWaves = 4;
  static constexpr int kThreads = kWaves * kWaveSize;
  // 32 queries per wave = two 16-query WMMA column blocks. Each K/V fragment read from LDS then
  // feeds two WMMAs: 16 queries per wave would need 128 B/clk of LDS per WGP at the WMMA peak
  // (the whole LDS bandwidth); 32 needs half. 64 would not fit at D = 128: the FP32
  // accumulator alone is 128 VGPRs at 32 queries.
  static constexpr int kQueriesPerWave = 32;
  static constexpr int kQBlocks = kQueriesPerWave / kWmmaDim;        // 2
  static constexpr int kQueriesPerGroup = kWaves * kQueriesPerWave;  // 128
  // 32 keys per tile: the Sᵀ tile is 32 VGPRs and the per-thread staging of the next tile 16
  // VGPRs (D = 128), which keeps the kernel under 256 VGPRs with no scratch (a 64-key tile
  // would need ~50 more). One tile = one K scale block, and one 16-query block = one Q scale
  // at either granularity (32 rows: both blocks of a wave share it; q_scale_rows 16: one
  // each), so the score scale q_scale·k_scale is a wave-uniform float per tile and block.
  static constexpr int kTileKeys = kKTileKeys;             // 32
  static constexpr int kKeyChunks = kTileKeys / kWmmaDim;  // 2
  static constexpr int kQkSteps = D / kWmmaDim;            // 8 / 4 WMMA K-steps over channels
  static constexpr int kChannelBlocks = D / kWmmaDim;      // 8 / 4 accumulator tiles
  static constexpr int kKTileBytes = kTileKeys * D;        // 4 / 2 KiB of K codes
  static constexpr int kVTileBytes = D * kTileKeys * kVCodeBytes;  // 4 / 2 KiB (FP16: 8 / 4)
  // In LDS the K tile is padded (k_lds_padded_offset: 4400 / 2192 B) so that every LDS address
  // of a tile is a per-lane base plus an immediate; V is not padded.
  static constexpr int kKLdsBytes = k_lds_padded_bytes(D);
  static constexpr int kVLdsBytes = kPv16 ? v16_lds_bytes(D) : kVTileBytes;  // V16 padded
  static constexpr int kStageBytes = kKLdsBytes + kVLdsBytes;  // 8496 / 4240 B (FP16 13104 / 6544)
  static constexpr int kStages = 2;                            // double buffer
  static constexpr int kLdsBytes = kStages * kStageBytes;      // 16992 / 8480 B (26208 / 13088)
  // Immediate strides of the LDS layouts (test_gfx12_layout.py): K chunk kc + 1 of the
  // reads, the next K staging slot; the next 16-channel block of the V reads, the next V
  // staging slot (64 channels further).
  static constexpr int kKLdsChunkStride = k_lds_chunk_stride(D);           // 1088 / 544
  static constexpr int kKLdsStageSlotStride = k_lds_stage_slot_stride(D);  // 2240 / -
  static constexpr int kVLdsBlockStride =
      kPv16 ? v16_lds_offset(kWmmaDim, 0) : v_lds_offset(kWmmaDim, 0);  // 1088 / 512
  // A staging slot moves 128 x 16 bytes = 64 V rows of e4m3 codes, 32 of FP16 codes.
  static constexpr int kVRowsPerSlot = kThreads * 16 / (kTileKeys * kVCodeBytes);
  static constexpr int kVLdsStageSlotStride =
      kPv16 ? v16_lds_offset(kVRowsPerSlot, 0) : v_lds_offset(kVRowsPerSlot, 0);  // 2176 / 2048
  static constexpr int kKPiecesPerThread = kKTileBytes / 16 / kThreads;           // 2 / 1 x 16 B
  static constexpr int kVPiecesPerThread = kVTileBytes / 16 / kThreads;  // 2 / 1 (FP16 4 / 2)

  static_assert(kQueriesPerWave == SAGE_SCALE_BLOCK && kTileKeys == SAGE_SCALE_BLOCK &&
                    kWmmaDim == SAGE_Q_SCALE_ROWS_FINE,
                "one Q scale per 16-query block (32-row scales: one per wave) and one K scale "
                "per tile");
  static_assert(SAGE_SEQ_ALIGN % kTileKeys == 0 && SAGE_SEQ_ALIGN % kQueriesPerWave == 0,
                "KV tiles and wave query blocks divide the padded sequence: in-bounds loads");
  static_assert(kStageBytes % 16 == 0, "16-byte aligned LDS accesses in both stages");
  static_assert(kKPiecesPerThread >= 1 && kKPiecesPerThread * 16 * kThreads == kKTileBytes &&
                    kVPiecesPerThread >= 1 && kVPiecesPerThread * 16 * kThreads == kVTileBytes,
                "staging covers each tile exactly");
  static_assert(kQueriesPerWave == kTileKeys,
                "causal: the diagonal tile of a wave is one tile, and its key 0 is seen by all "
                "32 rows (every processed tile has a valid key per row)");
};

// The e4m3 scale folded into the exponent: P·448 is computed as exp2(u + kExpOffset) with
// u = t - m <= 0, so no multiply and no clamp are needed. Derivation of the constant:
//  * log2 448 = 8.8073549220576...; the float just below it is 8.807353973388672 (float
//    spacing here is 2^-20). kExpOffset is 4 floats lower: 8.807350158691406, and
//    2^kExpOffset = 447.99852 = 448 - 48.5 ulps (one float ulp in [256, 512) is 2^-15).
//  * u + kExpOffset <= kExpOffset exactly: u is formed as fma(d, score_scale, bias) with d <= 0
//    and bias <= kExpOffset (see score_tile), and round-to-nearest is monotone, so a value
//    whose exact form is <= kExpOffset (a float) rounds to <= kExpOffset.
//  * v_exp_f32 is accurate to 1 ulp (LLVM AMDGPUUsage, csrc/emu/models.cpp [LLVM-exp2]), so
//    its result is <= 447.99852 + 2^-15 < 448 whatever its rounding: P·448 never exceeds the
//    e4m3 maximum, with 47 ulps to spare. NaN scores stay NaN (nothing clamps them).
//  * The factor 2^kExpOffset / 448 = 1 - 3.3e-6 scales P8 and l alike and cancels in acc / l.
// kExpOffset itself: sage/constants.h.
// The Sᵀ accumulators start at the bits of 1.5·2^23 (kScoreBiasBits): since |dot| <= 128·128·128
// = 2^21 < 2^22, the int32 sum kScoreBiasBits + dot is the bit pattern of the float
// 1.5·2^23 + dot (same exponent, the mantissa carries the dot). The WMMA thus delivers the dots
// as exact floats — no v_cvt_f32_i32 — and their order as int32 bits is their order as floats.
constexpr int32_t kScoreBiasBits = 0x4B400000;
constexpr float kScoreBias = 12582912.0f;  // 1.5·2^23
constexpr float kNegInf = -__builtin_inff();

// An opaque use and redefinition of x in VGPRs: the value must exist at this point (no
// instruction computing it sinks below) and is not known to be any constant afterwards. No
// effect on values; the emulator build is plain C++.
template <class V>
SAGE_DEVICE void pin_vgprs(V& x) {
#if defined(__HIP__) && !defined(SAGE_EMU)
  asm volatile("" : "+v"(x));
#else
  (void)x;
#endif
}

// The K and V bytes of one tile in flight from global memory to LDS.
template <class T>
struct TileStage {
  u32x4 k[T::kKPiecesPerThread];
  u32x4 v[T::kVPiecesPerThread];
};

// Per-wave state: Q fragments, accumulators and softmax statistics of 32 queries.
template <class T>
struct WaveState {
  v2i32 q[T::kQBlocks][T::kQkSteps];          // 32 / 16 VGPRs
  v8f32 acc[T::kQBlocks][T::kChannelBlocks];  // 128 / 64 VGPRs: Oᵀ tiles
  float m[T::kQBlocks];                       // running max of t (log2 domain), same in both halves
  float l[T::kQBlocks];                       // running sum of P·448 over this half-wave's keys
};

// Global addressing: a wave-uniform base pointer per tile (SGPRs) plus a per-lane 32-bit
// offset that is the same for every tile, so the loads use the SADDR form and the loop keeps
// one VGPR per load instead of a 64-bit address pair.
template <class T>
struct HeadView {
  const int8_t* k8;       // key 0 of this (batch, head); keys are k_row_stride bytes apart
  const uint8_t* v;       // V codes (e4m3 or FP16 bytes): channel 0, key 0 of this head
  int64_t k_tile_stride;  // bytes from one K tile to the next
  uint32_t k_lane_off[T::kKPiecesPerThread];
  // V: staging slot i is slot 0 moved by i whole V rows-per-slot (wave-uniform), so one lane
  // offset and a scalar stride cover all slots (FP16 has 4 slots: 3 VGPRs fewer).
  uint32_t v_lane_off;
  int64_t v_slot_stride;  // bytes from staging slot i to i + 1 (kVRowsPerSlot V rows)
};

// `hd`: the key/value head (GQA: kv_head_of the query head; K/V are never copied).
template <class T>
SAGE_DEVICE HeadView<T> make_head_view(const SageParams& p, int b, int hd) {
  HeadView<T> hv;
  const int64_t k_row_stride = qk8_row_stride(p.heads_kv, T::kHeadDim);
  hv.k8 = p.k8 + qk8_offset(p.heads_kv, T::kHeadDim, p.kv_len_pad, b, 0, hd, 0);
  const int64_t v_head = v8_offset(head_index(p.heads_kv, b, hd), T::kHeadDim, p.kv_len_pad, 0, 0);
  hv.v = T::kPv16 ? reinterpret_cast<const uint8_t*>(p.v16) + 2 * v_head
                  : reinterpret_cast<const uint8_t*>(p.v8) + v_head;
  hv.k_tile_stride = T::kTileKeys * k_row_stride;
  const int tid = sage_thread_id();
#pragma unroll
  for (int i = 0; i < T::kKPiecesPerThread; ++i) {
    const int piece = stage_piece(tid, i, T::kThreads);
    // < 32 * 65535 * 128 < 2^28.
    hv.k_lane_off[i] = uint32_t(k_piece_row(piece, T::kHeadDim) * k_row_stride +
                                16 * k_piece_chunk(piece, T::kHeadDim));
  }
  // < 32 * 2 * kv_len_pad + 48 <= 2^30 (SAGE_MAX_SEQ_LEN): fits the 32-bit offset.
  const int piece = stage_piece(tid, 0, T::kThreads);
  const uint32_t v_row_bytes = uint32_t(p.kv_len_pad) * uint32_t(T::kVCodeBytes);
  hv.v_lane_off =
      T::kPv16 ? uint32_t(v16_piece_channel(piece)) * v_row_bytes + 16u * v16_piece_slot(piece)
               : uint32_t(v_piece_channel(piece)) * v_row_bytes + 16u * v_piece_half(piece);
  hv.v_slot_stride = int64_t(T::kVRowsPerSlot) * v_row_bytes;
  return hv;
}

// The first n bytes of a 16-byte piece, the rest +0 (layout: first_bytes_mask).
SAGE_DEVICE u32x4 keep_first_bytes(u32x4 x, int n) {
  return u32x4{x.x & first_bytes_mask(0, n), x.y & first_bytes_mask(1, n),
               x.z & first_bytes_mask(2, n), x.w & first_bytes_mask(3, n)};
}

template <class T>
SAGE_DEVICE TileStage<T> load_tile(const HeadView<T>& hv, int tile) {
  TileStage<T> st;
  const int8_t* k_tile = hv.k8 + int64_t(tile) * hv.k_tile_stride;
  const uint8_t* v_tile = hv.v + int64_t(tile) * (T::kTileKeys * T::kVCodeBytes);
#pragma unroll
  for (int i = 0; i < T::kKPiecesPerThread; ++i)
    st.k[i] = sage_gload<u32x4>(k_tile, int64_t(hv.k_lane_off[i]));
#pragma unroll
  for (int i = 0; i < T::kVPiecesPerThread; ++i)
    st.v[i] = sage_gload<u32x4>(v_tile + i * hv.v_slot_stride, int64_t(hv.v_lane_off));
  return st;
}

// Per-lane LDS byte offsets within a stage, computed once: inside the loop an access is
// stage base + one of these + an immediate (the layouts are affine in the loop indices,
// test_gfx12_layout.py), so each tile costs one VALU add per lane base instead of
// one per access.
struct LdsLanes {
  int k_read;   // K row tile_key(0, r), chunk 4h (chunk kc: + kc·kKLdsChunkStride, kk: + 8kk)
  int v_read;   // V channel r, keys 16h.. (channel block cb: + cb·kVLdsBlockStride; FP16:
                // key chunk kc + 16·kc)
  int k_store;  // staging slot 0 of K (slot i: + i·kKLdsStageSlotStride)
  int v_store;  // staging slot 0 of V (slot i: + i·kVLdsStageSlotStride)
};

template <class T>
SAGE_DEVICE LdsLanes make_lds_lanes() {
  const int lane = sage_lane_id(), tid = sage_thread_id();
  const int r = lane_idx(lane), h = lane_half(lane);
  const int piece = stage_piece(tid, 0, T::kThreads);
  constexpr int D = T::kHeadDim;
  // lane half h reads channels (D/2)h.. = 16-byte chunk (D/32)h
  const int v_read = T::kPv16 ? v16_lds_offset(r, 2 * h) : v_lds_offset(r, h);
  const int v_store = T::kPv16 ? v16_lds_offset(v16_piece_channel(piece), v16_piece_slot(piece))
                               : v_lds_offset(v_piece_channel(piece), v_piece_half(piece));
  return LdsLanes{k_lds_padded_offset(tile_key(0, r), (D / 32) * h, D), T::kKLdsBytes + v_read,
                  k_lds_padded_offset(k_piece_row(piece, D), k_piece_chunk(piece, D), D),
                  T::kKLdsBytes + v_store};
}

template <class T>
SAGE_DEVICE int stage_base(int stage) {
  return stage * T::kStageBytes;
}

template <class T, class L>
SAGE_DEVICE void store_tile(L* lds, int stage, const LdsLanes& ll, const TileStage<T>& st) {
  const int kb = stage_base<T>(stage) + ll.k_store, vb = stage_base<T>(stage) + ll.v_store;
#pragma unroll
  for (int i = 0; i < T::kKPiecesPerThread; ++i)
    sage_lds_store(lds, kb + i * T::kKLdsStageSlotStride, st.k[i]);
#pragma unroll
  for (int i = 0; i < T::kVPiecesPerThread; ++i)
    sage_lds_store(lds, vb + i * T::kVLdsStageSlotStride, st.v[i]);
}

SAGE_DEVICE v2i32 lo64(u32x4 x) { return v2i32{int(x.x), int(x.y)}; }
SAGE_DEVICE v2i32 hi64(u32x4 x) { return v2i32{int(x.z), int(x.w)}; }

SAGE_DEVICE int imax(int a, int b) { return a > b ? a : b; }

// P·448 of one tile as B operands of Pᵀ: [key chunk][query block]; e4m3 (8 bytes per
// operand) or, pv_dtype FP16, FP16 (16 bytes: element j in half j % 2 of word j / 2).
template <bool kPv16>
struct TilePOperand {
  using type = v2i32;  // 8 e4m3 bytes
};
template <>
struct TilePOperand<true> {
  using type = u32x4;  // 8 FP16 halves
};
template <bool kPv16>
struct TileP {
  typename TilePOperand<kPv16>::type p[2][2];  // [kKeyChunks][kQBlocks]
};

// First half of a tile: Sᵀ = K·Qᵀ from the K stage, then the online-softmax update.
// Query block qb's score scale is q_scale[qb]·k_scale (wave-uniform; one product per tile and
// block: with 32-row Q scales both blocks hold the same q_scale, and the FP8 kernels' loop is
// the one of a single product but for one SALU multiply). kMasked: the lane's query of block
// qb sees only the tile keys < keys_valid[qb] (beyond kv_len, or causally masked). Tile key 0
// is always seen.
template <bool kMasked, class T, class L>
SAGE_DEVICE TileP<T::kPv16> score_tile(const L* lds, int stage, const LdsLanes& ll,
                                       const float (&q_scale)[T::kQBlocks], float k_scale,
                                       const int (&keys_valid)[T::kQBlocks], WaveState<T>& ws) {
  static_assert(T::kKeyChunks == 2 && T::kQBlocks == 2, "TileP");
  const int lane = sage_lane_id();
  const int kbase = stage_base<T>(stage) + ll.k_read;

  // Sᵀ[kc][qb]: 16 keys x 16 queries, int32; lane = query r, keys tile_key(kc, 8h + j).
  v8i32 s[T::kKeyChunks][T::kQBlocks];
#pragma unroll
  for (int kc = 0; kc < T::kKeyChunks; ++kc) {
#pragma unroll
    for (int qb = 0; qb < T::kQBlocks; ++qb)
      s[kc][qb] = v8i32{kScoreBiasBits, kScoreBiasBits, kScoreBiasBits, kScoreBiasBits,
                        kScoreBiasBits, kScoreBiasBits, kScoreBiasBits, kScoreBiasBits};
#pragma unroll
    for (int kk = 0; kk < T::kQkSteps; kk += 2) {
      // Two K-steps per 16-byte read: channels qk_channel(kk, h, 0..15).
      const u32x4 kfrag =
          sage_lds_load<u32x4>(lds, kbase + kc * T::kKLdsChunkStride + 16 * (kk / 2));
#pragma unroll
      for (int qb = 0; qb < T::kQBlocks; ++qb) {
        s[kc][qb] = sage_wmma_i32_iu8(lo64(kfrag), ws.q[qb][kk], s[kc][qb]);
        s[kc][qb] = sage_wmma_i32_iu8(hi64(kfrag), ws.q[qb][kk + 1], s[kc][qb]);
      }
    }
    // Keep chunk 1's four K fragments (16 VGPRs) from being hoisted above chunk 0's WMMAs:
    // with all eight in flight the kernel needs more than 256 VGPRs and spills.
    SAGE_ATTN_SCHED_FENCE();
  }

  if constexpr (T::kPv16) {
    // FP16 P·V: all of Sᵀ is computed here, before the softmax. Left alone, clang sinks the
    // second query block's Q·Kᵀ WMMAs past the first block's rescale branch, keeping all eight
    // K fragments (32 VGPRs) live across it: beyond 256 VGPRs with FP16 P at D = 128.
#pragma unroll
    for (int kc = 0; kc < T::kKeyChunks; ++kc)
#pragma unroll
      for (int qb = 0; qb < T::kQBlocks; ++qb) pin_vgprs(s[kc][qb]);
  }
  TileP<T::kPv16> tp;
#pragma unroll
  for (int qb = 0; qb < T::kQBlocks; ++qb) {
    // Row max on the exact biased dots (int32 order = float order, see kScoreBiasBits; masked
    // keys out), then across the two half-waves of this query.
    int fbits = -0x7fffffff - 1;
#pragma unroll
    for (int kc = 0; kc < T::kKeyChunks; ++kc)
#pragma unroll
      for (int j = 0; j < kFragElems; ++j) {
        const bool valid = !kMasked || tile_key(kc, c_row(lane, j)) < keys_valid[qb];
        if (valid) fbits = imax(fbits, s[kc][qb][j]);
      }
    // The loop's shuffle is a ds_bpermute (an LDS op, not VALU issue); the masked tile's, after
    // the loop, a permlanex16, which keeps no lane-id address VGPR live across the loop.
    fbits = imax(fbits, kMasked ? sage_swap_halves(fbits) : sage_shfl_xor(fbits, 16));
    // Key 0 of a processed tile is always valid, so fmax_b is 1.5·2^23 + a real dot.
    const float fmax_b = bits_f32(uint32_t(fbits));
    // The tile's row max of t = dot · score_scale (score_scale > 0 keeps the order).
    const float score_scale = q_scale[qb] * k_scale;
    const float m_tile = (fmax_b - kScoreBias) * score_scale;
    const float m_new = sage_fmaxf(ws.m[qb], m_tile);
    const float alpha = sage_exp2f(ws.m[qb] - m_new);  // first tile: exp2(-inf) = 0
    // m_tile - m_new <= 0 (m_new >= m_tile, rounding monotone), so bias <= kExpOffset.
    const float bias = (m_tile - m_new) + kExpOffset;
    // Row sum as a pairwise tree (independent adds can pair into dual-issue VOPD
    // instructions; a running sum would be a 16-long dependency chain).
    float part[T::kKeyChunks];
#pragma unroll
    for (int kc = 0; kc < T::kKeyChunks; ++kc) {
      float p[kFragElems];
#pragma unroll
      for (int j = 0; j < kFragElems; ++j) {
        // d = dot - dot_max exactly (two floats in [2^23, 2^24): an exact difference), <= 0.
        const float d = bits_f32(uint32_t(s[kc][qb][j])) - fmax_b;
        float x = sage_exp2f(__builtin_fmaf(d, score_scale, bias));  // P·448 < 448 (above)
        if (kMasked && tile_key(kc, c_row(lane, j)) >= keys_valid[qb]) x = 0.0f;
        p[j] = x;
      }
      part[kc] = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
      if constexpr (T::kPv16) {
        // FP16 (RNE) keeps 11 significant bits down to 2^-14: the long-row accuracy mode.
        tp.p[kc][qb] = u32x4{sage_cvt_pk_f16(p[0], p[1]), sage_cvt_pk_f16(p[2], p[3]),
                             sage_cvt_pk_f16(p[4], p[5]), sage_cvt_pk_f16(p[6], p[7])};
      } else {
        // Both halves of each packed word are written, so the `old` operand (the register the
        // v_cvt_pk_fp8_f32 writes in place) never reaches the result: p[0] / p[4], whose last
        // use this is, instead of a zero that costs a v_mov per word.
        int w0 = sage_cvt_pk_fp8(p[0], p[1], int(f32_bits(p[0])), false);
        w0 = sage_cvt_pk_fp8(p[2], p[3], w0, true);
        int w1 = sage_cvt_pk_fp8(p[4], p[5], int(f32_bits(p[4])), false);
        w1 = sage_cvt_pk_fp8(p[6], p[7], w1, true);
        tp.p[kc][qb] = v2i32{w0, w1};
      }
    }
    const float psum = part[0] + part[1];
    ws.l[qb] = ws.l[qb] * alpha + psum;
    ws.m[qb] = m_new;
    // An EXEC-masked branch: lanes whose max did not move skip it, and the whole block is
    // skipped when no lane of the wave needs it (the common case after the first tiles).
    if (alpha != 1.0f) {
      // alpha in both VGPRs of a pair (different banks): even/odd multiplies pair into VOPD.
      const v2f32 a2 = pin_vgpr_pair(v2f32{alpha, alpha});
#pragma unroll
      for (int cb = 0; cb < T::kChannelBlocks; ++cb)
#pragma unroll
        for (int j = 0; j < kFragElems; j += 2) {
          ws.acc[qb][cb][j] *= a2.x;
          ws.acc[qb][cb][j + 1] *= a2.y;
        }
    }
  }
  return tp;
}

// Second half of a tile: Oᵀ[qb][cb] += Vᵀ(channels 16cb.., keys)·Pᵀ from the V stage. The
// lane reads channel 16cb + r, tile keys 16h .. 16h + 15 = chunk 0 (low 8 bytes) and chunk 1
// (high 8 bytes), exactly the keys its P bytes stand for. kMasked (the last tile): V bytes of
// keys >= keys_valid (= kv_len - tile start, wave-uniform) become +0 — their P is 0, but 0
// times a NaN left in the padding is not. (Causally masked keys < kv_len hold real V codes,
// never NaN: prepare's e4m3 conversion saturates.)
template <bool kMasked, class T, class L>
SAGE_DEVICE void accumulate_pv(const L* lds, int stage, const LdsLanes& ll,
                               const TileP<T::kPv16>& tp, int keys_valid, WaveState<T>& ws) {
  const int h = lane_half(sage_lane_id());
  const int vbase = stage_base<T>(stage) + ll.v_read;
  if constexpr (T::kPv16) {
    // FP16: the lane's keys 16h + 8kc .. +7 of channel 16cb + r are slot 2h + kc, one 16-byte
    // read per key chunk (8 halves = the A operand matching P's elements j of chunk kc).
#pragma unroll
    for (int cb = 0; cb < T::kChannelBlocks; ++cb) {
      u32x4 vfrag[T::kKeyChunks];
#pragma unroll
      for (int kc = 0; kc < T::kKeyChunks; ++kc) {
        vfrag[kc] = sage_lds_load<u32x4>(lds, vbase + cb * T::kVLdsBlockStride + 16 * kc);
        if (kMasked) vfrag[kc] = keep_first_bytes(vfrag[kc], 2 * (keys_valid - 16 * h - 8 * kc));
      }
#pragma unroll
      for (int qb = 0; qb < T::kQBlocks; ++qb)
#pragma unroll
        for (int kc = 0; kc < T::kKeyChunks; ++kc)
          ws.acc[qb][cb] = sage_wmma_f32_f16(vfrag[kc], tp.p[kc][qb], ws.acc[qb][cb]);
    }
  } else {
#pragma unroll
    for (int cb = 0; cb < T::kChannelBlocks; ++cb) {
      u32x4 vfrag = sage_lds_load<u32x4>(lds, vbase + cb * T::kVLdsBlockStride);
      if (kMasked) vfrag = keep_first_bytes(vfrag, keys_valid - 16 * h);
#pragma unroll
      for (int qb = 0; qb < T::kQBlocks; ++qb) {
        ws.acc[qb][cb] = sage_wmma_f32_fp8(lo64(vfrag), tp.p[0][qb], ws.acc[qb][cb]);
        ws.acc[qb][cb] = sage_wmma_f32_fp8(hi64(vfrag), tp.p[1][qb], ws.acc[qb][cb]);
      }
    }
  }
}

// The end of every main-loop iteration, for waves with and without queries alike: store the
// next tile's staged K/V and wait for the whole workgroup (one barrier call site).
template <class T, class L>
SAGE_DEVICE void stage_tile(L* lds, int stage, const LdsLanes& ll, const TileStage<T>& st) {
  store_tile(lds, stage, ll, st);
  sage_barrier();
}

// Two output values as a packed pair of out_dtype halves (RNE, as torch's .to()).
template <bool kFp16>
SAGE_DEVICE uint32_t pack_halves(float a, float b) {
  return kFp16 ? uint32_t(f32_to_fp16(a)) | (uint32_t(f32_to_fp16(b)) << 16)
               : uint32_t(f32_to_bf16(a)) | (uint32_t(f32_to_bf16(b)) << 16);
}

// The output rows of the wave, O[q][c] = acc / l · v_scale[c], saturated (output_value: the
// code mean acc / l clamped to ±448 with e4m3 V, the product to ±out_dtype's maximum where
// finite): the lane holds query 16qb + r, channels 16cb + 8h + j = one 16-byte store of 8
// halves. Only the head_dim real channels are written (a multiple of 8: a store is all in or
// all out); rows in [q_len, out_rows) are zeros (q_len: the entry's); rows >= out_rows are not
// written. kZero: a wave without queries (all its rows zero).
template <class T, bool kFp16, bool kZero>
SAGE_DEVICE void store_rows(const SageParams& p, const WaveState<T>& ws, const float (&inv_l)[2],
                            const float* v_scale, int b, int hd, int q0, int q_len) {
  const int lane = sage_lane_id();
  const int r = lane_idx(lane), h = lane_half(lane);
  const float mean_bound = code_mean_bound(T::kPv16);
  const float out_max = kFp16 ? kFp16Max : kBf16Max;
#pragma unroll
  for (int qb = 0; qb < T::kQBlocks; ++qb) {
    const int q = q0 + 16 * qb + r;
    if (q >= p.out_rows) continue;
    const bool real = !kZero && q < q_len;
    const int64_t orow = bshd_offset(p.out_stride_b, p.out_stride_s, p.out_stride_h, b, q, hd);
#pragma unroll
    for (int cb = 0; cb < T::kChannelBlocks; ++cb) {
      const int c0 = 16 * cb + 8 * h;
      if (c0 >= p.head_dim) continue;
      uint32_t packed[4] = {0u, 0u, 0u, 0u};
      if (!kZero) {
        const u32x4 s0 = sage_gload<u32x4>(v_scale, 4 * c0);
        const u32x4 s1 = sage_gload<u32x4>(v_scale, 4 * (c0 + 4));
        const uint32_t sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
        for (int j = 0; j < kFragElems; j += 2) {
          const float o0 =
              output_value(ws.acc[qb][cb][j] * inv_l[qb], bits_f32(sv[j]), mean_bound, out_max);
          const float o1 = output_value(ws.acc[qb][cb][j + 1] * inv_l[qb], bits_f32(sv[j + 1]),
                                        mean_bound, out_max);
          packed[j / 2] = real ? pack_halves<kFp16>(o0, o1) : 0u;
        }
      }
      sage_gstore<u32x4>(halves(p.out), 2 * (orow + c0),
                         u32x4{packed[0], packed[1], packed[2], packed[3]});
    }
  }
}

// LSE rows of the wave (p.lse non-null): ln2·(m + log2 l − kExpOffset + corr), l summed over
// both half-waves; corr = p.lse_corr[row] (log2 units, written by prepare with K smoothing)
// when given, else 0. Rows in [q_len, out_rows) get -inf (q_len: the entry's). kZero: a wave
// without queries.
template <class T, bool kZero>
SAGE_DEVICE void store_lse(const SageParams& p, const WaveState<T>& ws, const float (&l)[2],
                           const float* lse_corr, int b, int hd, int q0, int q_len) {
  const int lane = sage_lane_id();
  const int r = lane_idx(lane), h = lane_half(lane);
#pragma unroll
  for (int qb = 0; qb < T::kQBlocks; ++qb) {
    float lse = kNegInf;
    const int q = q0 + 16 * qb + r;
    if (!kZero && q < q_len) {
      const float corr = lse_corr ? sage_gload<float>(lse_corr, 4 * q) : 0.0f;
      lse = kLn2 * (((ws.m[qb] + sage_log2f(l[qb])) - kExpOffset) + corr);
    }
    if (h == 0 && q < p.out_rows) sage_gstore<float>(p.lse, 4 * lse_offset(p, b, hd, q), lse);
  }
}

// Tiles [0, n) a block of query rows [row0, row0 + rows) of an entry with q_len rows and kv_len
// keys sees (rows clipped to q_len): causal, up to its last real row's keys; otherwise all
// kv_len keys; none for a block past q_len (the entry's padding rows). At least one, the tile
// staged before the main loop: an entry without keys runs it masked with no key valid (P = 0,
// so l = 0: its rows come out NaN with LSE -inf, SDPA's all-masked row), which needs no branch
// around the accumulators.
template <class T, bool kCausal>
SAGE_DEVICE int tiles_for_rows(int row0, int rows, int q_len, int kv_len) {
  const int last = row0 + rows < q_len ? row0 + rows : q_len;  // one past the last row
  const int keys = kCausal ? int(causal_keys_seen(last - 1, kv_len)) : kv_len;
  return imax((keys + T::kTileKeys - 1) / T::kTileKeys, 1);
}

// The kernel body of variant (D, kCausal). Every wave of a workgroup takes part in staging the
// tiles any of its waves sees (group_tiles, one barrier per tile at one call site); a wave
// computes only its own wave_tiles: causal, the tiles before its diagonal tile full, the
// diagonal tile masked per row, the rest (fully masked for all its 32 rows) skipped — the wave
// only keeps staging them for the waves below it in the sequence.
template <int D, bool kCausal, bool kPv16, class L>
SAGE_DEVICE void attention_fwd(L* lds, const SageParams& p) {
  using T = AttnTraits<D, kPv16>;
  // The wave index through a readlane: the compiler then knows it (and q0, the wave's tile
  // count, every loop bound) to be wave-uniform. Without it the causal kernel's loop exit
  // was EXEC-masked (a divergent loop) and clang spilled.
  const int lane = sage_lane_id(), wave = sage_readlane(sage_wave_id(), 0);
  const int r = lane_idx(lane), h = lane_half(lane);
  const int b = sage_block_id_z(), hd = sage_block_id_y();
  const int kvh = kv_head_of(p, hd);  // GQA: the key/value head this query head reads
  const int64_t head = head_index(p.heads_q, b, hd);
  const int64_t kv_head = head_index(p.heads_kv, b, kvh);
  // The entry's real rows and keys (SageParams::q_lens / kv_lens), through readlanes: loop
  // bounds stay scalar.
  const int q_len = sage_readlane(entry_q_len(p, b), 0);
  const int kv_len = sage_readlane(entry_kv_len(p, b), 0);
  // Causal: the last query groups see the most tiles; block x = 0 takes the last group, so
  // the heaviest workgroups of a head are dispatched first and the light ones fill the tail.
  const int n_groups = (p.q_len_pad + T::kQueriesPerGroup - 1) / T::kQueriesPerGroup;
  const int group = kCausal ? n_groups - 1 - sage_block_id_x() : sage_block_id_x();
  const int g0 = group * T::kQueriesPerGroup;  // a multiple of 32 below q_len_pad
  const int q0 = g0 + wave * T::kQueriesPerWave;
  const float* v_scale = p.v_scale + channel_offset(kv_head, D, 0);
  // A wave past the real queries (q0 >= q_len: padding or past q_len_pad) only helps stage
  // K/V (same loads, stores and barriers) and writes its padding rows as zeros: it runs no
  // WMMA, so its SIMD's issue slots go to the other waves there (the sequence tail: at
  // S = 513 three of the last group's four waves are such waves). Wave-uniform (one Q block
  // per wave), made explicit with a readlane so that the branch is scalar, not EXEC-masked.
  const bool has_queries = sage_readlane(int(q0 < q_len), 0) != 0;

  const HeadView<T> hv = make_head_view<T>(p, b, kvh);
  const LdsLanes ll = make_lds_lanes<T>();
  const int group_tiles =
      g0 < q_len ? tiles_for_rows<T, kCausal>(g0, T::kQueriesPerGroup, q_len, kv_len) : 1;
  const int wave_tiles =
      kCausal ? tiles_for_rows<T, kCausal>(q0, T::kQueriesPerWave, q_len, kv_len) : group_tiles;

  // Start the first tile's loads before touching Q so their latencies overlap.
  TileStage<T> st = load_tile(hv, 0);

  WaveState<T> ws;
#pragma unroll
  for (int qb = 0; qb < T::kQBlocks; ++qb) {
    const int64_t row = qk8_offset(p.heads_q, D, p.q_len_pad, b, q0 + 16 * qb + r, hd, 0);
#pragma unroll
    for (int kk = 0; kk < T::kQkSteps; kk += 2) {
      const u32x4 x =
          has_queries ? sage_gload<u32x4>(p.q8, row + qk_channel(kk, h, 0, D)) : u32x4{0, 0, 0, 0};
      ws.q[qb][kk] = lo64(x);
      ws.q[qb][kk + 1] = hi64(x);
    }
    ws.m[qb] = kNegInf;
    ws.l[qb] = 0.0f;
#pragma unroll
    for (int cb = 0; cb < T::kChannelBlocks; ++cb) ws.acc[qb][cb] = v8f32{0, 0, 0, 0, 0, 0, 0, 0};
  }
  // The Q scales of the wave's two query blocks: at upstream's 32-row granularity both read
  // the wave's one scale, with q_scale_rows 16 each its own (q_scale_offset).
  float q_scale[T::kQBlocks];
#pragma unroll
  for (int qb = 0; qb < T::kQBlocks; ++qb)
    q_scale[qb] = has_queries
                      ? sage_gload<float>(p.q_scale, 4 * q_scale_offset(p, head, q0 + 16 * qb))
                      : 0.0f;
  const float* k_scales = p.k_scale + qk_scale_offset(kv_head, p.kv_len_pad, 0);

  store_tile(lds, 0, ll, st);
  sage_barrier();
  // Main loop over the wave's tiles before its last one. The next tile's global loads are
  // issued after the scores, so they are in flight during the P·V WMMAs without their staging
  // VGPRs being live during Q·Kᵀ (where the Sᵀ tile is); one barrier per tile, reached by
  // every wave at the same point (a wave without queries skips only the compute).
  if (has_queries) {
    for (int t = 0; t + 1 < wave_tiles; ++t) {
      const float k_scale = sage_gload<float>(k_scales, 4 * t);
      const int full[T::kQBlocks] = {T::kTileKeys, T::kTileKeys};
      const TileP<kPv16> tp = score_tile<false>(lds, t & 1, ll, q_scale, k_scale, full, ws);
      st = load_tile(hv, t + 1);
      accumulate_pv<false>(lds, t & 1, ll, tp, T::kTileKeys, ws);
      // The other stage was last read in iteration t - 1, before the barrier that ended it.
      stage_tile(lds, (t + 1) & 1, ll, st);
    }
  } else {
    for (int t = 0; t + 1 < group_tiles; ++t)
      stage_tile(lds, (t + 1) & 1, ll, load_tile(hv, t + 1));
  }
  if (!has_queries) {
    const float none[2] = {0.0f, 0.0f};
    store_rows<T, false, true>(p, ws, none, v_scale, b, hd, q0, q_len);
    if (p.lse) store_lse<T, true>(p, ws, none, nullptr, b, hd, q0, q_len);
    return;
  }
  {
    // The wave's last tile always takes the masked path (full or not): choosing between two
    // instantiations here put a phi over all 128 accumulator VGPRs and made clang spill.
    // Keys >= kv_len are masked for P and V; causal, the lane's row also sees only keys <= row
    // (the diagonal tile: tile key 0 is seen by all 32 rows, as the wave's first row is the
    // tile's first key or later).
    const int t = wave_tiles - 1;
    const int keys_valid = kv_len - t * T::kTileKeys;
    int row_keys[T::kQBlocks];
#pragma unroll
    for (int qb = 0; qb < T::kQBlocks; ++qb)
      row_keys[qb] =
          kCausal ? int(causal_keys_seen(q0 + 16 * qb + r, kv_len)) - t * T::kTileKeys : keys_valid;
    const float k_scale = sage_gload<float>(k_scales, 4 * t);
    const TileP<kPv16> tp = score_tile<true>(lds, t & 1, ll, q_scale, k_scale, row_keys, ws);
    accumulate_pv<true>(lds, t & 1, ll, tp, keys_valid, ws);
  }
  if (kCausal) {
    // Tiles past this wave's diagonal: fully masked for its rows, staged for the others.
    for (int t = wave_tiles - 1; t + 1 < group_tiles; ++t)
      stage_tile(lds, (t + 1) & 1, ll, load_tile(hv, t + 1));
  }

  // ---- epilogue. Each half-wave summed its own keys: combine the two halves of l.
  float l[T::kQBlocks], inv_l[T::kQBlocks];
#pragma unroll
  for (int qb = 0; qb < T::kQBlocks; ++qb) {
    l[qb] = ws.l[qb] + sage_swap_halves(ws.l[qb]);
    inv_l[qb] = sage_rcpf(l[qb]);
  }
  if (p.out_dtype == SAGE_DTYPE_FP16)
    store_rows<T, true, false>(p, ws, inv_l, v_scale, b, hd, q0, q_len);
  else
    store_rows<T, false, false>(p, ws, inv_l, v_scale, b, hd, q0, q_len);
  if (p.lse) {
    const float* lse_corr =
        p.lse_corr ? p.lse_corr + lse_corr_offset(head, p.q_len_pad, 0) : nullptr;
    store_lse<T, false>(p, ws, l, lse_corr, b, hd, q0, q_len);
  }
}

// The kernels: one per variant (head dim x causal). GQA, out_dtype, head_dim, LSE and lse_corr
// are run-time fields read outside the main loop (csrc/gfx12/README.md says why).
#define SAGE_ATTENTION_KERNEL(name, D, CAUSAL, PV16)                 \
  SAGE_KERNEL(name, (AttnTraits<D, PV16>::kThreads))(SageParams p) { \
    SAGE_LDS(u32x4, lds, (AttnTraits<D, PV16>::kLdsBytes / 16));     \
    attention_fwd<D, CAUSAL, PV16>(lds, p);                          \
  }
// Every attention kernel, once: name, head dim, causal, FP16 P·V. The kernels are defined
// from this table and the launcher picks from it (attention_kernel below).
#define SAGE_ATTENTION_VARIANTS(X)                                          \
  X(sage_attention_fwd_kernel, SAGE_HEAD_DIM_LARGE, false, false)           \
  X(sage_attention_fwd_kernel_causal, SAGE_HEAD_DIM_LARGE, true, false)     \
  X(sage_attention_fwd_kernel_d64, SAGE_HEAD_DIM_SMALL, false, false)       \
  X(sage_attention_fwd_kernel_d64_causal, SAGE_HEAD_DIM_SMALL, true, false) \
  X(sage_attention_fwd_kernel_pv16, SAGE_HEAD_DIM_LARGE, false, true)       \
  X(sage_attention_fwd_kernel_causal_pv16, SAGE_HEAD_DIM_LARGE, true, true) \
  X(sage_attention_fwd_kernel_d64_pv16, SAGE_HEAD_DIM_SMALL, false, true)   \
  X(sage_attention_fwd_kernel_d64_causal_pv16, SAGE_HEAD_DIM_SMALL, true, true)
SAGE_ATTENTION_VARIANTS(SAGE_ATTENTION_KERNEL)
#undef SAGE_ATTENTION_KERNEL

}  // namespace gfx12
}  // namespace sage

#if SAGE_HOST_LAUNCH  // host launch section (not in a hiprtc device build)
SAGE_DEFINE_MODULE_ABI("module_gfx1201_sage_attention target=gfx12")

namespace sage {
namespace gfx12 {
// The kernel of variant (D, kCausal, kPv16), from SAGE_ATTENTION_VARIANTS.
template <int D, bool kCausal, bool kPv16>
inline auto attention_kernel() {
#define SAGE_PICK_ATTENTION(name, DIM, CAUSAL, PV16)                  \
  if constexpr (D == (DIM) && kCausal == (CAUSAL) && kPv16 == (PV16)) \
    return name;                                                      \
  else
  SAGE_ATTENTION_VARIANTS(SAGE_PICK_ATTENTION)
  static_assert(kNoSuchVariant<D, kCausal, kPv16>, "no attention kernel of this variant");
#undef SAGE_PICK_ATTENTION
}

template <int D, bool kCausal, bool kPv16>
int launch_attention(const SageParams& p, void* stream) {
  using T = AttnTraits<D, kPv16>;
  const unsigned q_groups = unsigned((p.q_len_pad + T::kQueriesPerGroup - 1) / T::kQueriesPerGroup);
  const sage_dim3 grid{q_groups, unsigned(p.heads_q), unsigned(p.batch)};
  return sage_launch(attention_kernel<D, kCausal, kPv16>(), grid, T::kThreads, stream, p);
}

// The ONE place where run-time fields become template arguments: head_dim_pad -> the traits'
// head dim, mask -> kCausal, pv_dtype -> kPv16. (check_params has already limited them to
// their known values.)
inline int dispatch_attention(const SageParams& p, void* stream) {
  return SAGE_HEAD_DIM_SWITCH(p.head_dim_pad, kHeadDim, [&] {
    return SAGE_BOOL_SWITCH(p.mask == SAGE_MASK_CAUSAL, kCausal, [&] {
      return SAGE_BOOL_SWITCH(p.pv_dtype == SAGE_PV_FP16, kPv16, [&] {
        return launch_attention<kHeadDim, kCausal, kPv16>(p, stream);
      });
    });
  });
}
}  // namespace gfx12
}  // namespace sage

SAGE_EXPORT int sage_attention_run(const SageParams* params, void* stream) {
  if (!sage::check_features(params, sage::Launch::kAttention, sage::kAllFeatures, "gfx12"))
    return 1;
  const int rc = sage::gfx12::dispatch_attention(*params, stream);
  if (rc != 0) {
#if !defined(SAGE_EMU)
    return sage::set_error("sage_attention_launch: kernel launch failed (hip error %d)", rc);
#else
    return rc;  // the emulator already set a report summary
#endif
  }
  return 0;
}
SAGE_DEFINE_CHECKED_LAUNCH(attention, kAttention)
#endif  // SAGE_HOST_LAUNCH
