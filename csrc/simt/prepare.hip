// module_gfx1201_sage_prepare: BF16/FP16 Q/K/V (head dim D <= 128) -> the prepared tensors of
// the op contract (Dp = 64 or 128 channels), bit-identical to aiter_sage/ref.py prepare().
//
// Three kernels per (Dp, input dtype), launched in this order on the stream:
//   1. v_scale  one workgroup per (kv head, batch, key range): the per-channel |V| maximum
//               of SAGE_V_AMAX_SPLITS key ranges -> v_amax_part (scratch), folded by kernel 3;
//               with smooth_k, SAGE_K_MEAN_SLICES more workgroups per (kv head, batch), a
//               slice of the channels each, take the per-channel K mean over the whole sequence
//               -> k_mean in the pinned order (32 row groups = the 32 partial sums), beside the
//               V ranges. (One workgroup per head streamed V at ~1 TB/s on an H200: 24 of its
//               132 SMs at B1 H24.)
//   2. qk       one workgroup per 32-row block of Q (query heads) and of K (kv heads), 2 (4
//               at Dp 64) consecutive blocks in the plain BF16 build (qk_blocks_per_workgroup):
//               optional fused RMSNorm + RoPE, K - mean, block amax, INT8 quantization,
//               scale (Q with q_scale_rows 16: an amax, scale and codes per 16-row half). Rows
//               past the sequence are written as zeros (outputs come from torch.empty). With
//               smooth_k, Q blocks also write lse_corr = Q'·k_mean per row (Q' the FP32
//               scaled query), the LSE term the smoothing takes out of the row's scores.
//               Three builds (QkBuild): qk with every fused step, qk_smooth with smoothing and
//               q_scale_rows 16 but no norm / RoPE (the DiT call with smooth_k), and qk_plain
//               with none (upstream's default); each carries none of the others' registers.
//   3. v_quant  one workgroup per (128-key tile, kv head, batch): folds the head's partial
//               maxima into v_scale (tile 0 writes it out), then V / v_scale -> e4m3,
//               transposed through LDS to [B, Hkv, Dp, S_pad]; padded keys are +0, and the last
//               tile stores only the keys below S_pad (a multiple of 32). pv_dtype FP16 runs
//               v_quant16 instead: the same with FP16 codes fp16(V / v_scale) (quant_v16).
// V is read twice (amax, then quantize) — a two-pass V; both passes are memory bound and the
// second is fully parallel. Every step is a single correctly rounded IEEE operation in
// quant.h's order, so no FMA contraction is allowed in this file:
#pragma clang fp contract(off)

#include "sage/check.h"
#include "simt/prepare_layout.h"
#include "sage/layout.h"
#include "sage/module_abi.h"
#include "sage/params.h"
#include "sage/platform.h"
#include "sage/quant.h"
#include "sage/static_switch.h"

namespace sage {
namespace gfx12 {

// Tile sizes of one kernel head dim Dp (SageParams::head_dim_pad: 64 or 128). The real head
// dim D <= Dp is a runtime value: lanes whose 8-channel chunk lies at or past D load nothing
// and hold zeros (input rows are D * 2 bytes).
template <int kDp, int kInDtype>
struct PrepTraits {
  static constexpr int kHeadDim = kDp;
  static constexpr int kDtype = kInDtype;    // SageDtype of q, k, v and the norm weights
  static constexpr int kChunk = kPrepChunk;  // channels per lane = one 16-byte load
  static constexpr int kLanesPerRow = kHeadDim / kChunk;                // 16 / 8
  static constexpr int kNormRounds = kHeadDim / kNormChannelsPerRound;  // 4 / 2
  // qk: 128 threads = 8 (16) rows per pass, 4 (2) passes cover one 32-row scale block.
  static constexpr int kQkThreads = 128;
  static constexpr int kQkRowsPerPass = kQkThreads / kLanesPerRow;
  static constexpr int kQkPasses = SAGE_SCALE_BLOCK / kQkRowsPerPass;
  // NVIDIA only: resident qk_plain blocks per SM, a register cap (the more blocks, the more
  // loads in flight). Measured when one build served every call: left free, ptxas took 127
  // registers, 4 blocks fit, and the kernel streamed ~1 TB/s on an H200 (302 us at B1 H24
  // S16384); at 8 blocks 210 us, 6 blocks 222 us. The plain build alone: 9 blocks (56
  // registers, no spill with BF16 input) 112.3 -> 107.5 us at Dp 128; FP16 input spills at 9
  // and keeps 8; Dp 64 fits 10 (48 registers; 69.3 -> 68.8 us) with one scale block per
  // workgroup, 9 with BF16's two (qk_blocks_per_workgroup; 10 spilled 16 bytes).
  static constexpr int kQkNvBlocks = kInDtype == SAGE_DTYPE_BF16 ? 9 : kDp == 64 ? 10 : 8;
  // The fused qk build (RMSNorm / RoPE / smoothing) holds the norm weights too: at 8 blocks it
  // spilled the most; 6 blocks (80 registers, fewer spills) gave the best fused prepare on an
  // H200 (B1 H24 S16384, norm + RoPE 128: 594 us at 8 blocks, 546 at 6, 563 at 4 with no
  // spills; same bits).
  static constexpr int kQkFusedNvBlocks = 6;
  // The smooth build (K - mean, lse_corr, 16-row Q scales; no norm weights): 7 blocks, 72
  // registers, no spill (8 blocks spilled 16 bytes). H100, B1 H24 S16384 DiT-like with
  // smooth_k: 134 us, where the fused build at 6 blocks took 189.
  static constexpr int kQkSmoothNvBlocks = 7;
  // qk scale blocks per workgroup (prepare_layout.h qk_block): the plain BF16 build 2 at Dp 128
  // and 4 at Dp 64, its setup paid once for them (H100 B1 H24, qk_plain with 2: S 4096 31.4 ->
  // 30.0 us, S 16384 115.3 -> 108.6, D 64 70.7 -> 68.9; 9 blocks per SM, no spill; at Dp 64 10
  // spilled 16 bytes). The others 1: under their caps 2 spilled (FP16 plain, smooth) or the norm
  // weights already do (fused).
  SAGE_HD static constexpr int qk_blocks_per_workgroup(bool plain) {
    return plain && kInDtype == SAGE_DTYPE_BF16 ? (kDp == 64 ? 4 : 2) : 1;
  }
  // Whether qk_body issues the loads of a workgroup's next block before it reduces and
  // quantizes the current one, so that a workgroup's loads are not all waited for at once per
  // block: at Dp 64 (a block is 2 rows of loads per thread, 8 more registers: 56, no spill).
  // H100 B1 H24 S16384 D64, the whole prepare in one process each, two passes: 128.0 / 129.3 us
  // without, 121.8 / 122.0 with it at 2 blocks per workgroup, 120.8 / 121.2 at 4. At Dp 128
  // (16 more registers) the 9-block cap spilled.
  SAGE_HD static constexpr bool qk_prefetch(bool plain) {
    return kDp == 64 && qk_blocks_per_workgroup(plain) > 1;
  }
  // v_scale (+ K mean): 32 row groups, group g streams rows g, g + 32, ... — the K-mean
  // partial g of quant.h's pinned order. 512 (256) threads; 8 rows of loads in flight per
  // thread = 64 (32) KiB per workgroup, each streaming one of SAGE_V_AMAX_SPLITS key ranges
  // of a kv head (with one workgroup per head, 32 KiB in flight streamed 38 GB/s on an H200
  // SM). (16 rows at Dp 64 cost gfx12 occupancy: 8 waves, not 10.)
  static constexpr int kVsGroups = kMeanPartials;
  static constexpr int kVsThreads = kVsGroups * kLanesPerRow;
  static constexpr int kVsRowsPerStep = kVsGroups;
  static constexpr int kVsUnroll = 8;
  // NVIDIA only: resident plain v_scale blocks per SM, a register cap. Dp 128 (512 threads):
  // 2 (58 registers, no spill) where the uncapped build's 79 let one block hold an SM; H100, B1
  // H24: 14.9 -> 12.5 us at S 4096, where a V range is one pass of loads, 41.0 -> 40.0 at S
  // 16384. Dp 64 (256 threads, 75 registers) fits 3 (unchanged: 23.0 us at S 16384). The
  // smooth build keeps one: its K mean slices' 16 rows of loads alone take 64 registers.
  static constexpr int kVsNvBlocks = kDp == 128 ? 2 : 3;
  // K mean with the fused norm / RoPE (k_mean_body, one workgroup per head): rows of loads in
  // flight per thread group (platform.h: 6 on NVIDIA, 2 elsewhere). Its rows carry a RoPE
  // partner chunk and the norm: on gfx1201 4 cost the smooth
  // build's V workgroups 2 waves per SIMD (12 -> 10 at BF16, 9 -> 7 at FP16), 2 none at BF16.
  static constexpr int kKmUnroll = SAGE_K_MEAN_ROWS_IN_FLIGHT;
  // K mean slices (K without the fused norm / RoPE, k_mean_slice_body): 32 groups x 4 (2)
  // lanes of a SAGE_K_MEAN_SLICES-th of the row, 128 (64) threads of the workgroup. A lane's
  // rows are a sequential sum (the pinned order), so its rows of loads in flight set the
  // slice's speed; raw 16-byte loads, 4 registers a row.
  static constexpr int kKmSliceLanes = km_slice_lanes(kHeadDim);
  static constexpr int kKmSliceThreads = kMeanPartials * kKmSliceLanes;
  static constexpr int kKmSliceChannels = kKmSliceLanes * kChunk;
  static constexpr int kKmSliceUnroll = 16;
  // v_quant: 256 threads; a thread converts 4 keys x 8 channels per pass, 2 (1) passes = 128 keys.
  static constexpr int kVqThreads = 256;
  // NVIDIA only: resident v_quant blocks per SM, a register cap: 4 (64 registers; the raw
  // loads hold 32) at Dp 128 instead of 3 at 71 registers, 65.4 -> 63.8 us at B1 H24 S16384 on
  // an H200; Dp 64 5 (48 registers; 31.9 -> 32.3 us, no change).
  static constexpr int kVqNvBlocks = kDp == 128 ? 4 : 5;
  static constexpr int kVqKeysPerThread = 4;  // one 32-bit LDS word per channel
  static constexpr int kVqPasses = kVtKeys / (kVqThreads / kLanesPerRow * kVqKeysPerThread);
  static_assert(kHeadDim == SAGE_HEAD_DIM_SMALL || kHeadDim == SAGE_HEAD_DIM_LARGE, "");
  static_assert(kQkPasses * kQkRowsPerPass == SAGE_SCALE_BLOCK, "qk covers a scale block");
  static_assert(SAGE_Q_SCALE_ROWS_FINE % kQkRowsPerPass == 0,
                "q_scale_rows 16: no pass straddles the block's two 16-row halves (prep_half)");
  static_assert(kChunk == kNormLanes && kHeadDim % kNormChannelsPerRound == 0,
                "RMSNorm: a lane's 8 channels are the 8 lanes of quant.h's pinned order");
  static_assert(kVsThreads <= 512 && kWaveSize % kLanesPerRow == 0, "rows never straddle waves");
  static_assert(kKmSliceLanes >= 1 && kKmSliceLanes * SAGE_K_MEAN_SLICES == kLanesPerRow &&
                    kKmSliceThreads % kWaveSize == 0 && kKmSliceChannels <= kKmSliceThreads,
                "K mean slices: whole waves, every chunk of the row in one slice");
  static_assert(kVqPasses >= 1 &&
                    kVqPasses * (kVqThreads / kLanesPerRow) * kVqKeysPerThread == kVtKeys,
                "");
  static_assert(kVtKeys % SAGE_SEQ_ALIGN == 0 && (kVtKeys / 16) * 16 == kVtKeys,
                "v_quant stores 16-key pieces; the padded length ends on a piece boundary");
};

// 8 16-bit inputs (BF16 or FP16 per `dtype`, uniform) -> exact FP32.
SAGE_DEVICE void unpack_halfx8(u32x4 u, int dtype, float* x) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
  if (dtype == SAGE_DTYPE_FP16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = fp16_to_f32(uint16_t(w[i] & 0xffffu));
      x[2 * i + 1] = fp16_to_f32(uint16_t(w[i] >> 16));
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = bits_f32(w[i] << 16);
      x[2 * i + 1] = bits_f32(w[i] & 0xffff0000u);
    }
  }
}

// 8 FP32 values (two 16-byte loads) at byte offset `off` of `base`.
SAGE_DEVICE void unpack_f32x8(const float* base, int64_t off, float* x) {
  const u32x4 a = sage_gload<u32x4>(base, off), b = sage_gload<u32x4>(base, off + 16);
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = bits_f32(w[i]);
}

// ============================================================ Q/K rows: RMSNorm + RoPE =====
// 1 / rms of a row whose Dp / 8 lanes (chunk c = lane % (Dp / 8)) hold channels 8c .. 8c+7, in
// quant.h's pinned order (rms_sum_squares over D = head_dim channels): channel 8a + l + 32i is
// element l of chunk a + 4i, so
//   1. lanes c < 4 sum their element l with those of chunks c+4, c+8, ... in turn (xor 4, 8,
//      12 reach exactly those lanes): accumulator a = c, lane l. The kernel always runs
//      Dp / 32 rounds; the rounds at or past D / 32 add squares of channels >= D, which are
//      +0 (nothing loaded), and acc + (+0) = acc exactly for the non-negative acc;
//   2. lane 0 adds accumulators 1, 2, 3 in turn (xor 1, 2, 3), per element l;
//   3. lane 0 sums its 8 elements in turn;
//   4. a butterfly of additions in which only lane 0 contributes a non-zero value gives every
//      lane of the row that exact total (x + 0 = x).
// The other lanes compute values they then ignore; every lane takes part in each shuffle.
template <class T>
SAGE_DEVICE float row_rms_inv(const float* x, int chunk, float eps, int head_dim) {
  float acc[kNormLanes];
#pragma unroll
  for (int l = 0; l < kNormLanes; ++l) {
    const float sq = x[l] * x[l];
    float a = sq;
#pragma unroll
    for (int i = 1; i < T::kNormRounds; ++i) a = a + sage_shfl_xor(sq, kNormAccs * i);
    acc[l] = a;
  }
  float total = 0.0f;
#pragma unroll
  for (int l = 0; l < kNormLanes; ++l) {
    float lane_sum = acc[l];
#pragma unroll
    for (int a = 1; a < kNormAccs; ++a) lane_sum = lane_sum + sage_shfl_xor(acc[l], a);
    total = l == 0 ? lane_sum : total + lane_sum;
  }
  float v = chunk == 0 ? total : 0.0f;
#pragma unroll
  for (int n = T::kLanesPerRow / 2; n >= 1; n /= 2) v = v + sage_shfl_xor(v, n);
  return rms_inv(v, eps, head_dim);
}

// The per-lane constants of the fused norm + RoPE of one input (Q or K).
struct RowFn {
  const uint16_t* src;  // row 0 of this (batch, head)
  int64_t stride_s;     // elements
  int c, pc;            // chunk, RoPE partner chunk
  bool in_d;            // chunk c lies below the head dim (the lane loads)
  bool norm, rope_lane;
  float w[kPrepChunk], wp[kPrepChunk];  // norm weights of chunks c and pc
};

// kNormRope false (qk's plain and smooth builds): f.norm and f.rope_lane are constant false, so
// fetch_row and finish_row fold their norm / RoPE branches away.
template <class T, bool kNormRope = true>
SAGE_DEVICE RowFn make_row_fn(const SageParams& p, const void* base, int64_t stride_b,
                              int64_t stride_s, int64_t stride_h, int b, int h,
                              const void* norm_weight, int tid) {
  RowFn f;
  f.src = halves(base) + bshd_offset(stride_b, stride_s, stride_h, b, 0, h);
  f.stride_s = stride_s;
  f.c = prep_chunk(tid, T::kLanesPerRow);
  f.in_d = T::kChunk * f.c < p.head_dim;
  f.norm = kNormRope && norm_weight != nullptr;
  f.rope_lane =
      kNormRope && p.rope_cos != nullptr && T::kChunk * f.c < p.rope_dim;  // rope_dim <= D
  f.pc = f.rope_lane ? rope_partner_chunk(f.c, p.rope_dim) : f.c;
#pragma unroll
  for (int i = 0; i < T::kChunk; ++i) f.w[i] = f.wp[i] = 0.0f;
  if (f.norm && f.in_d) {  // weights: in_dtype [D]
    unpack_halfx8(sage_gload<u32x4>(norm_weight, 2 * T::kChunk * f.c), T::kDtype, f.w);
    unpack_halfx8(sage_gload<u32x4>(norm_weight, 2 * T::kChunk * f.pc), T::kDtype, f.wp);
  }
  return f;
}

// The raw input of one lane's chunk of a row: chunk c and, on RoPE lanes, its partner chunk.
struct RawRow {
  u32x4 raw, partner;
};

// Loads row s's chunks for finish_row (zeros past the sequence and for channels >= D). Split
// from finish_row so that a kernel can issue the loads of several rows before it waits for
// the first (qk_body: one round trip to memory per 32-row block instead of one per row pass).
template <class T>
SAGE_DEVICE RawRow fetch_row(const RowFn& f, int s, bool in_seq) {
  RawRow r{{0, 0, 0, 0}, {0, 0, 0, 0}};
  if (in_seq && f.in_d) {
    r.raw = sage_gload<u32x4>(f.src, 2 * (int64_t(s) * f.stride_s + T::kChunk * f.c));
    // The RoPE partner chunk belongs to another lane of this row; reloading it (a cache
    // hit) is cheaper than a non-xor cross-lane move and keeps its rounding identical.
    if (f.rope_lane)
      r.partner = sage_gload<u32x4>(f.src, 2 * (int64_t(s) * f.stride_s + T::kChunk * f.pc));
  }
  return r;
}

// Channels 8c .. 8c+7 of row s (fetched by fetch_row) after the optional RMSNorm and RoPE,
// each rounded to in_dtype as ref.py's qk_norm_rope does, as FP32; zeros for channels >= D and
// for rows past the sequence (in_seq false; uniform over the row's lanes). Every lane of the
// row must call it (the norm's shuffles stay within the row's lanes).
template <class T>
SAGE_DEVICE void finish_row(const RowFn& f, const SageParams& p, int s, bool in_seq,
                            const RawRow& r, float* v) {
  float vp[T::kChunk];
  unpack_halfx8(r.raw, T::kDtype, v);
  unpack_halfx8(r.partner, T::kDtype, vp);
  // Every lane of the row takes part in the norm's butterfly (rows past len: zeros).
  if (f.norm) {
    const float inv = row_rms_inv<T>(v, f.c, p.norm_eps, p.head_dim);
#pragma unroll
    for (int i = 0; i < T::kChunk; ++i) {
      v[i] = rms_apply(v[i], inv, f.w[i], T::kDtype);
      vp[i] = rms_apply(vp[i], inv, f.wp[i], T::kDtype);
    }
  }
  if (f.rope_lane && in_seq) {
    const int64_t cs = int64_t(s) * p.rope_stride_s + T::kChunk * f.c;
    float cosv[T::kChunk], sinv[T::kChunk];
    unpack_f32x8(p.rope_cos, 4 * cs, cosv);
    unpack_f32x8(p.rope_sin, 4 * cs, sinv);
#pragma unroll
    for (int i = 0; i < T::kChunk; ++i)
      v[i] = rope_apply(v[i], vp[i], T::kChunk * f.c + i, p.rope_dim, cosv[i], sinv[i], T::kDtype);
  }
  // Channels >= D are +0 whatever the norm made of them (0 * inf with eps = 0 is NaN). Without
  // the norm they are +0 already (fetch_row loads nothing there; RoPE lanes lie below D), so
  // the builds without it carry no select.
  if (f.norm && !f.in_d) {
#pragma unroll
    for (int i = 0; i < T::kChunk; ++i) v[i] = 0.0f;
  }
}

// ============================================================================ kernel 1 =====
// Channel ch of the K mean from the 32 partials the row groups parked in LDS (`part`, one row
// of Dp floats per group), added in turn (k_mean_from_partials) -> k_mean.
template <class T, class L>
SAGE_DEVICE void store_k_mean(const SageParams& p, L* part, int ch, int64_t head, int kv_len) {
  float partials[kMeanPartials];
#pragma unroll
  for (int g = 0; g < kMeanPartials; ++g)
    partials[g] = sage_lds_load<float>(part, 4 * (g * T::kHeadDim + ch));
  sage_gstore<float>(p.k_mean, 4 * channel_offset(head, T::kHeadDim, ch),
                     kv_len > 0 ? k_mean_from_partials(partials, kv_len) : 0.0f);
}

// With smooth_k and the fused RMSNorm or RoPE on K: the per-channel mean of K after them of one
// (batch, key/value head) -> k_mean, in a workgroup of its own (slice 0 of v_scale_split's K
// mean workgroups; without norm and RoPE the slices share the head: k_mean_slice_body), so
// that the head's stream of K runs beside the V maximum workgroups instead of after one of them.
// Thread group g = tid / (Dp/8) (32 groups) adds rows g, g + 32, g + 64, ... in turn, so its
// running sum per channel is exactly partial g of quant.h's pinned order; the partials meet in LDS
// and one thread per channel adds them in turn (k_mean_from_partials). The loads of kKmUnroll rows
// per group are issued before the first is added (the additions stay in row order): one row in
// flight per thread streamed a head's K at a fraction of the V amax loop's rate. The loop bound is
// uniform, so every lane of a row takes part in the norm's shuffles; rows past kv_len add nothing.
template <class T, class L>
SAGE_DEVICE void k_mean_body(const SageParams& p, L* part, int tid, int c, int grp, int b, int hd,
                             int64_t head, int kv_len) {
  const RowFn f =
      make_row_fn<T>(p, p.k, p.k_stride_b, p.k_stride_s, p.k_stride_h, b, hd, p.k_norm_weight, tid);
  float sum[T::kChunk];
#pragma unroll
  for (int i = 0; i < T::kChunk; ++i) sum[i] = 0.0f;
  constexpr int kRowsPerPass = T::kVsRowsPerStep * T::kKmUnroll;
  for (int s0 = 0; s0 < kv_len; s0 += kRowsPerPass) {
    RawRow raw[T::kKmUnroll];
#pragma unroll
    for (int u = 0; u < T::kKmUnroll; ++u) {  // issue all loads first
      const int s = s0 + u * T::kVsRowsPerStep + grp;
      raw[u] = fetch_row<T>(f, s, s < kv_len);
    }
#pragma unroll
    for (int u = 0; u < T::kKmUnroll; ++u) {
      const int s = s0 + u * T::kVsRowsPerStep + grp;
      const bool in_seq = s < kv_len;  // uniform over the lanes of the row
      float x[T::kChunk];
      finish_row<T>(f, p, s, in_seq, raw[u], x);
      if (in_seq) {
#pragma unroll
        for (int i = 0; i < T::kChunk; ++i) sum[i] = sum[i] + x[i];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < T::kChunk; ++i)
    sage_lds_store(part, 4 * (grp * T::kHeadDim + T::kChunk * c + i), sum[i]);
  sage_barrier();
  if (tid < T::kHeadDim) store_k_mean<T>(p, part, tid, head, kv_len);
}

// The K mean of one channel slice of a (batch, key/value head) -> k_mean, for K without the
// fused RMSNorm or RoPE (the norm's sum of squares needs the whole row, and RoPE's partner
// chunks would double the rows' registers; those calls take k_mean_body in slice 0). Thread
// group g = km_group(tid) adds its chunk of rows g, g + 32, g + 64, ... in turn: partial g of
// quant.h's pinned order, as in k_mean_body, over a quarter of the channels, so the head's K
// streams through SAGE_K_MEAN_SLICES SMs (H100, B1 H24 S16384 DiT-like: v_scale_smooth 151 ->
// 79 us; one workgroup per head streamed ~27 GB/s per SM). kKmSliceUnroll rows of loads are
// issued before the first is added. Threads past kKmSliceThreads only meet the barrier.
template <class T, class L>
SAGE_DEVICE void k_mean_slice_body(const SageParams& p, L* part, int tid, int slice, int b, int hd,
                                   int64_t head, int kv_len) {
  constexpr int kLanes = T::kKmSliceLanes;
  const int grp = km_group(tid, kLanes), c = km_chunk(tid, slice, kLanes);
  const bool active = tid < T::kKmSliceThreads;  // whole waves
  const bool in_d = T::kChunk * c < p.head_dim;
  const uint16_t* k = halves(p.k) + bshd_offset(p.k_stride_b, p.k_stride_s, p.k_stride_h, b, 0, hd);
  float sum[T::kChunk];
#pragma unroll
  for (int i = 0; i < T::kChunk; ++i) sum[i] = 0.0f;
  constexpr int kRowsPerPass = kMeanPartials * T::kKmSliceUnroll;
  for (int s0 = active ? grp : kv_len; s0 < kv_len; s0 += kRowsPerPass) {
    u32x4 raw[T::kKmSliceUnroll];
#pragma unroll
    for (int u = 0; u < T::kKmSliceUnroll; ++u) {  // issue all loads first
      const int s = s0 + u * kMeanPartials;
      raw[u] = s < kv_len && in_d
                   ? sage_gload<u32x4>(k, 2 * (int64_t(s) * p.k_stride_s + T::kChunk * c))
                   : u32x4{0, 0, 0, 0};
    }
#pragma unroll
    for (int u = 0; u < T::kKmSliceUnroll; ++u) {
      if (s0 + u * kMeanPartials < kv_len) {  // rows in turn; none past the sequence
        float x[T::kChunk];
        unpack_halfx8(raw[u], T::kDtype, x);
#pragma unroll
        for (int i = 0; i < T::kChunk; ++i) sum[i] = sum[i] + x[i];
      }
    }
  }
  if (active) {
#pragma unroll
    for (int i = 0; i < T::kChunk; ++i)
      sage_lds_store(part, 4 * (grp * T::kHeadDim + T::kChunk * c + i), sum[i]);
  }
  sage_barrier();
  if (tid < T::kKmSliceChannels)
    store_k_mean<T>(p, part, slice * T::kKmSliceChannels + tid, head, kv_len);
}

// One workgroup per (batch, key/value head, key range): the per-channel amax of V over one of
// SAGE_V_AMAX_SPLITS key ranges -> v_amax_part. The smooth build (kSmooth, calls with smooth_k)
// has SAGE_K_MEAN_SLICES more workgroups per head, grid z < slices, for the head's K mean
// (k_mean_slice_body, or k_mean_body with the fused norm / RoPE; v_scale_split); the plain build
// has none of its code, whose norm / RoPE registers would cost every V workgroup occupancy (gfx1201
// BF16 / FP16: 51 / 83 VGPRs without it, 101 / 164 with). Thread group g = tid / (Dp/8) streams
// rows g, g + 32, ... of its range, kVsUnroll rows of loads in flight.
template <class T, bool kSmooth>
SAGE_DEVICE void v_scale_body(const SageParams& p) {
  SAGE_LDS(float, part, T::kVsGroups* T::kHeadDim);  // 16 KiB (8 KiB for Dp 64)
  const int tid = sage_thread_id();
  const int hd = sage_block_id_x(), b = sage_block_id_y();
  const int c = prep_chunk(tid, T::kLanesPerRow), grp = tid / T::kLanesPerRow;
  const int64_t head = head_index(p.heads_kv, b, hd);
  const int kv_len = entry_kv_len(p, b);  // the entry's real keys (uniform: one per workgroup)
  const int split = v_scale_split(sage_block_id_z(), kSmooth);
  if constexpr (kSmooth) {
    if (split < 0) {  // uniform: K mean slice z
      const int slice = sage_block_id_z();
      if (!p.k_norm_weight && !p.rope_cos)
        k_mean_slice_body<T>(p, part, tid, slice, b, hd, head, kv_len);
      else if (slice == 0)  // the norm needs whole rows: one workgroup per head
        k_mean_body<T>(p, part, tid, c, grp, b, hd, head, kv_len);
      return;
    }
  }
  const bool in_d = T::kChunk * c < p.head_dim;
  const uint16_t* v = halves(p.v) + bshd_offset(p.v_stride_b, p.v_stride_s, p.v_stride_h, b, 0, hd);

  float amax[T::kChunk];
#pragma unroll
  for (int i = 0; i < T::kChunk; ++i) amax[i] = 0.0f;
  constexpr int kRowsPerPass = T::kVsRowsPerStep * T::kVsUnroll;
  const int split_keys = int(v_amax_split_keys(kv_len, kRowsPerPass));
  const int s_begin = split * split_keys;
  const int s_end = kv_len - s_begin < split_keys ? kv_len : s_begin + split_keys;
  for (int s0 = s_begin + grp; s0 < s_end; s0 += kRowsPerPass) {
    u32x4 raw[T::kVsUnroll];
#pragma unroll
    for (int u = 0; u < T::kVsUnroll; ++u) {  // issue all loads first
      const int s = s0 + u * T::kVsRowsPerStep;
      raw[u] = s < s_end && in_d
                   ? sage_gload<u32x4>(v, 2 * (int64_t(s) * p.v_stride_s + T::kChunk * c))
                   : u32x4{0, 0, 0, 0};
    }
#pragma unroll
    for (int u = 0; u < T::kVsUnroll; ++u) {
      float x[T::kChunk];
      unpack_halfx8(raw[u], T::kDtype, x);
#pragma unroll
      for (int i = 0; i < T::kChunk; ++i) amax[i] = nan_max(amax[i], sage_fabsf(x[i]));
    }
  }
  // Every thread parks its 8 partial maxima in LDS (one row of partials per group), then one
  // thread per channel folds the groups.
#pragma unroll
  for (int i = 0; i < T::kChunk; ++i)
    sage_lds_store(part, 4 * (grp * T::kHeadDim + T::kChunk * c + i), amax[i]);
  sage_barrier();
  if (tid < T::kHeadDim) {  // whole waves: LDS traffic stays wave-uniform
    float m = 0.0f;
    for (int g = 0; g < T::kVsGroups; ++g)
      m = nan_max(m, sage_lds_load<float>(part, 4 * (g * T::kHeadDim + tid)));
    sage_gstore<float>(p.v_amax_part, 4 * v_amax_part_offset(head, T::kHeadDim, split, tid), m);
  }
}

// The maxima of amax[j] (j < N) over the qk workgroup's lanes: a wave butterfly, then the
// waves through `lds` (N x kQkThreads floats; every lane stores its copy, so the LDS traffic
// stays convergent and race free). Every thread of the workgroup calls it (one barrier).
template <class T, int N, class L>
SAGE_DEVICE void workgroup_amax(float (&amax)[N], L* lds, int tid, int wave) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
#pragma unroll
    for (int n = kWaveSize / 2; n >= 1; n /= 2)
      amax[j] = nan_max(amax[j], sage_shfl_xor(amax[j], n));
    sage_lds_store(lds, 4 * (j * T::kQkThreads + tid), amax[j]);
  }
  sage_barrier();
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int wv = 0; wv < T::kQkThreads / kWaveSize; ++wv)
      if (wv != wave)
        amax[j] =
            nan_max(amax[j], sage_lds_load<float>(lds, 4 * (j * T::kQkThreads + wv * kWaveSize)));
}

// ============================================================================ kernel 2 =====
// One workgroup per N consecutive 32-row scale blocks of Q or K (N = qk_blocks_per_workgroup:
// 2 (4 at Dp 64) for the plain BF16 build, else 1). Grid (ceil((Sq_pad/32) / N) +
// ceil(ceil((Skv_pad/32) / G) / N), Hq, B) with G = Hq / Hkv: the first workgroups hold the Q
// blocks of query head y; beyond, the K blocks of key/value head y / G are dealt round robin to
// the G query heads of its group (prepare_layout.h qk_block; a workgroup whose first block is
// past the last exits at once, a later block past it is skipped).
// Three builds (QkBuild): what a call does not ask for costs the kernel no registers.
enum class QkBuild {
  kPlain,   // upstream's call: no norm, no RoPE, no smoothing, 32-row Q scales
  kSmooth,  // + K smoothing and 16-row Q scales (no norm weights or RoPE partner loads)
  kFused,   // + RMSNorm and RoPE
};
template <class T, QkBuild kBuild>
SAGE_DEVICE void qk_body(const SageParams& p) {
  constexpr bool kNormRope = kBuild == QkBuild::kFused;
  constexpr bool kOptions = kBuild != QkBuild::kPlain;  // smoothing, 16-row Q scales
  SAGE_LDS(float, block_max, T::kQkThreads);
  const int tid = sage_thread_id(), wave = sage_wave_id();
  const int hq = sage_block_id_y(), b = sage_block_id_z();
  const int q_blocks = int(scale_blocks(p.q_len_pad));
  const int x_id = sage_block_id_x();
  constexpr int kPer = T::qk_blocks_per_workgroup(kBuild == QkBuild::kPlain);
  const bool is_q = x_id < qk_q_workgroups(q_blocks, kPer);
  const int group = group_size(p);
  const int blocks = is_q ? q_blocks : int(scale_blocks(p.kv_len_pad));
  if (qk_block(x_id, hq, 0, q_blocks, group, kPer) >= blocks) return;  // uniform over the workgroup
  const int hd = is_q ? hq : hq / group;
  const int heads = is_q ? p.heads_q : p.heads_kv;
  const int64_t head = head_index(heads, b, hd);
  const int len = is_q ? entry_q_len(p, b) : entry_kv_len(p, b);  // the entry's real rows
  const int len_pad = is_q ? p.q_len_pad : p.kv_len_pad;
  int8_t* const out8 = is_q ? p.q8 : p.k8;
  float* const out_scale = is_q ? p.q_scale : p.k_scale;
  const float factor = p.q_prescale;  // Q only
  const RowFn f = is_q ? make_row_fn<T, kNormRope>(p, p.q, p.q_stride_b, p.q_stride_s, p.q_stride_h,
                                                   b, hd, p.q_norm_weight, tid)
                       : make_row_fn<T, kNormRope>(p, p.k, p.k_stride_b, p.k_stride_s, p.k_stride_h,
                                                   b, hd, p.k_norm_weight, tid);
  // Smoothing: `mean` is the K mean of the block's key/value head (kernel 1). K blocks
  // subtract it (otherwise x - (+0) = x exactly); Q blocks write each row's LSE term
  // lse_corr = Σ_c Q'[c]·mean[c] (a per-lane partial dot, then the row's butterfly).
  const bool smooth = kOptions && p.smooth_k;
  const bool q_corr = is_q && smooth;  // uniform over the workgroup
  float mean[T::kChunk];
#pragma unroll
  for (int i = 0; i < T::kChunk; ++i) mean[i] = 0.0f;
  if (smooth)
    unpack_f32x8(
        p.k_mean,
        4 * channel_offset(head_index(p.heads_kv, b, hq / group), T::kHeadDim, T::kChunk * f.c),
        mean);

  // The block row this lane works on in each pass of scale block blk.
  const auto row_of_block = [&](int blk, int pass) {
    return blk * SAGE_SCALE_BLOCK + prep_row(tid, pass, T::kQkThreads, T::kLanesPerRow);
  };
  // Every pass's loads of block blk, issued together (one round trip to memory per block).
  const auto fetch_block = [&](int blk, RawRow(&raw)[T::kQkPasses]) {
#pragma unroll
    for (int pass = 0; pass < T::kQkPasses; ++pass) {
      const int s = row_of_block(blk, pass);
      raw[pass] = fetch_row<T>(f, s, s < len);
    }
  };
  // Scale block blk of this workgroup's role, from its rows to its codes and scale. rows(raw)
  // fills the block's loaded rows: its own loads (fetch_block), or ones issued earlier
  // (kPrefetch), copied into this call's array (an array taken by reference from outside left
  // the fused FP16 kernel 864 bytes of scratch in the hiprtc build for gfx1030).
  const auto quantize_block = [&](int blk, auto rows) {
    const auto row_of = [&](int pass) { return row_of_block(blk, pass); };
    RawRow raw[T::kQkPasses];
    rows(raw);
    // x[pass][i]: the FP32 value to quantize (Q' or K') of row row_of(pass), channel 8c+i; 0 past
    // the sequence. The plain build skips that select: there a row past it loads +0, so its
    // value is +0 (K) or +-0 (Q: the factor is finite), and x only meets |x| and the code, to
    // which -0 is +0 (the smooth build subtracts the mean and dots Q with it: it selects).
    float x[T::kQkPasses][T::kChunk];
    // |x| maxima of the block's two 16-row halves (passes [0, kQkPasses / 2) and the rest): a
    // scale each for Q with q_scale_rows 16, else combined into the block's one.
    float amax[2] = {0.0f, 0.0f};
    const auto half_of = [](int pass) { return prep_half(pass, T::kQkThreads, T::kLanesPerRow); };
#pragma unroll
    for (int pass = 0; pass < T::kQkPasses; ++pass) {
      const int s = row_of(pass);
      const bool in_seq = s < len;  // uniform over the lanes of the row
      float v[T::kChunk];
      finish_row<T>(f, p, s, in_seq, raw[pass], v);
#pragma unroll
      for (int i = 0; i < T::kChunk; ++i) {
        if constexpr (kBuild == QkBuild::kPlain)
          x[pass][i] = is_q ? v[i] * factor : v[i] - mean[i];
        else
          x[pass][i] = in_seq ? (is_q ? v[i] * factor : v[i] - mean[i]) : 0.0f;
        amax[half_of(pass)] = nan_max(amax[half_of(pass)], sage_fabsf(x[pass][i]));
      }
    }
    if (q_corr) {  // every lane of a row takes part in its butterfly; padded rows get 0
#pragma unroll
      for (int pass = 0; pass < T::kQkPasses; ++pass) {
        const int s = row_of(pass);
        float corr = 0.0f;
#pragma unroll
        for (int i = 0; i < T::kChunk; ++i) corr = corr + x[pass][i] * mean[i];
#pragma unroll
        for (int n = T::kLanesPerRow / 2; n >= 1; n /= 2) corr = corr + sage_shfl_xor(corr, n);
        if (f.c == 0)
          sage_gstore<float>(p.lse_corr, 4 * lse_corr_offset(head, p.q_len_pad, s),
                             s < len ? corr : 0.0f);
      }
    }
    // The scales: Q with q_scale_rows 16 one per half, each over the workgroup; otherwise one
    // per block (the halves combined first: nan_max(lo, hi) keeps the first NaN in pass order,
    // as one running maximum over the passes does). Uniform over the workgroup.
    // (The plain build never: q_scale_rows 16 is an option of the smooth and fused builds.)
    const bool halves = kOptions && is_q && q_scale_rows(p) == SAGE_Q_SCALE_ROWS_FINE;
    float scale[2];
    if (halves) {
      SAGE_LDS(float, half_max, 2 * T::kQkThreads);
      workgroup_amax<T>(amax, half_max, tid, wave);
      scale[0] = int8_block_scale(amax[0]);
      scale[1] = int8_block_scale(amax[1]);
    } else {
      float block[1] = {nan_max(amax[0], amax[1])};
      workgroup_amax<T>(block, block_max, tid, wave);
      scale[0] = scale[1] = int8_block_scale(block[0]);
    }

    // The 8 codes of a pass, packed (quant: value, the pass's scale -> int8 code).
    const auto pack_codes = [&](int pass, auto quant, uint32_t(&word)[2]) {
      const float sc = scale[half_of(pass)];
      word[0] = word[1] = 0;
#pragma unroll
      for (int i = 0; i < T::kChunk; ++i)
        word[i / 4] |= uint32_t(uint8_t(quant(x[pass][i], sc))) << (8 * (i % 4));
    };
    // codes(pass, word): fills the pass's packed codes.
    const auto store_codes = [&](auto codes) {
#pragma unroll
      for (int pass = 0; pass < T::kQkPasses; ++pass) {
        const int s = row_of(pass);
        uint32_t word[2];
        codes(pass, word);
        sage_gstore<v2i32>(out8, qk8_offset(heads, T::kHeadDim, len_pad, b, s, hd, T::kChunk * f.c),
                           v2i32{int(word[0]), int(word[1])});
      }
    };
    const auto normal = [](float v, float sc) { return quant_i8_normal(v, sc); };
    const bool all_normal = int8_scale_is_normal(scale[0]) && int8_scale_is_normal(scale[1]);
    // Nearly every block has a normal scale, where quant_i8's NaN and range checks cannot fire
    // (quant_i8_normal); the branch is uniform over the workgroup. The cuda build goes further
    // (SAGE_QUANT_I8_RECIP): a multiply by the scale's 1/s where quant.h's proof vouches for the
    // code, the division for a pass with a value it does not (rare: near the k + 1/2 boundaries).
#if defined(SAGE_QUANT_I8_RECIP)
    if (all_normal && int8_recip_ok(scale[0]) && int8_recip_ok(scale[1])) {
      const float recip[2] = {sage_rcpf(scale[0]), sage_rcpf(scale[1])};
      store_codes([&](int pass, uint32_t(&word)[2]) {
        bool unsure = false;
        const float r = recip[half_of(pass)];
        pack_codes(pass, [&](float v, float) { return quant_i8_recip(v, r, unsure); }, word);
        if (unsure) pack_codes(pass, normal, word);
      });
    } else
#endif
        if (all_normal)
      store_codes([&](int pass, uint32_t(&word)[2]) { pack_codes(pass, normal, word); });
    else
      store_codes([&](int pass, uint32_t(&word)[2]) {
        pack_codes(pass, [](float v, float sc) { return quant_i8(v, sc); }, word);
      });
    if (tid == 0) {
      const int s = blk * SAGE_SCALE_BLOCK;
      const auto scale_at = [&](int row) {
        return is_q ? q_scale_offset(p, head, row) : qk_scale_offset(head, len_pad, row);
      };
      sage_gstore<float>(out_scale, 4 * scale_at(s), scale[0]);
      if (halves) sage_gstore<float>(out_scale, 4 * scale_at(s + SAGE_Q_SCALE_ROWS_FINE), scale[1]);
    }
  };
  // kPer consecutive blocks, the setup above once for all of them, the next block's loads in
  // flight while this one is reduced and quantized (T::qk_prefetch). The barrier keeps a
  // block's LDS stores (workgroup_amax) behind the last one's loads.
  constexpr bool kPrefetch = T::qk_prefetch(kBuild == QkBuild::kPlain);
  RawRow raw[T::kQkPasses];
  if constexpr (kPrefetch) fetch_block(qk_block(x_id, hq, 0, q_blocks, group, kPer), raw);
#pragma unroll 1
  for (int rep = 0; rep < kPer; ++rep) {
    const int blk = qk_block(x_id, hq, rep, q_blocks, group, kPer);
    if (blk >= blocks) break;  // uniform over the workgroup
    if (rep > 0) sage_barrier();
    if constexpr (kPrefetch) {
      RawRow next[T::kQkPasses] = {};
      const int next_blk = qk_block(x_id, hq, rep + 1, q_blocks, group, kPer);
      if (rep + 1 < kPer && next_blk < blocks) fetch_block(next_blk, next);  // uniform
      quantize_block(blk, [&](RawRow(&rows)[T::kQkPasses]) {
#pragma unroll
        for (int pass = 0; pass < T::kQkPasses; ++pass) rows[pass] = raw[pass];
      });
#pragma unroll
      for (int pass = 0; pass < T::kQkPasses; ++pass) raw[pass] = next[pass];
    } else {
      quantize_block(blk, [&](RawRow(&rows)[T::kQkPasses]) { fetch_block(blk, rows); });
    }
  }
}

// ============================================================================ kernel 3 =====
// One workgroup per (128-key tile, key/value head, batch). kV16 (pv_dtype FP16): FP16 codes
// (quant_v16), 2 bytes per key, same tile and transpose; otherwise e4m3 codes (quant_v).
template <class T, bool kV16>
SAGE_DEVICE void v_quant_body(const SageParams& p) {
  constexpr int kCodeBytes = kV16 ? 2 : 1;
  // A thread's 4 keys of one channel: one 32-bit LDS word of e4m3 codes, two of FP16 codes.
  constexpr int kWords = T::kVqKeysPerThread * kCodeBytes / 4;
  SAGE_LDS(uint32_t, vt, T::kHeadDim* vt_row_bytes(kCodeBytes) / 4);
  SAGE_LDS(float, channel_scale, T::kHeadDim);
#if defined(SAGE_QUANT_V_RECIP)
  SAGE_LDS(float, channel_recip, T::kHeadDim);  // 1/s where v_recip_ok, else 0
#endif
  const int tid = sage_thread_id();
  const int tile = sage_block_id_x(), hd = sage_block_id_y(), b = sage_block_id_z();
  const int64_t head = head_index(p.heads_kv, b, hd);
  const int c = prep_chunk(tid, T::kLanesPerRow), g = tid / T::kLanesPerRow;
  const bool in_d = T::kChunk * c < p.head_dim;
  const uint16_t* v = halves(p.v) + bshd_offset(p.v_stride_b, p.v_stride_s, p.v_stride_h, b, 0, hd);
  const int kv_len = entry_kv_len(p, b);  // keys past it are zero codes

  // Every load of the thread first (4 keys x 8 channels per pass), so that they are all in
  // flight at once: the encoding below branches per value, and loads placed between those
  // branches went to memory one after another.
  // The first of the thread's keys in pass `pass`, within the tile; key_of: key k's index.
  const auto key0_of = [&](int pass) {
    return pass * (kVtKeys / T::kVqPasses) + T::kVqKeysPerThread * g;
  };
  const auto key_of = [&](int pass, int k) { return tile * kVtKeys + key0_of(pass) + k; };
  u32x4 raw[T::kVqPasses][T::kVqKeysPerThread];
#pragma unroll
  for (int pass = 0; pass < T::kVqPasses; ++pass)
#pragma unroll
    for (int k = 0; k < T::kVqKeysPerThread; ++k) {
      const int s = key_of(pass, k);
      raw[pass][k] = s < kv_len && in_d  // padded keys and channels stay +0
                         ? sage_gload<u32x4>(v, 2 * (int64_t(s) * p.v_stride_s + T::kChunk * c))
                         : u32x4{0, 0, 0, 0};
    }
  // v_amax_part is v_scale's (through qk: sage_launch_after_prior); V is the caller's.
  sage_wait_for_prior_grid();
  // The head's channel scales while the loads are in flight: thread d folds channel d's
  // partial maxima (the same maximum as one pass over the keys: nan_max is order-free).
  if (tid < T::kHeadDim) {  // whole waves
    float m = 0.0f;
    for (int split = 0; split < SAGE_V_AMAX_SPLITS; ++split)
      m = nan_max(m, sage_gload<float>(p.v_amax_part,
                                       4 * v_amax_part_offset(head, T::kHeadDim, split, tid)));
    const float s = v_channel_scale(m);
    sage_lds_store(channel_scale, 4 * tid, s);
#if defined(SAGE_QUANT_V_RECIP)
    sage_lds_store(channel_recip, 4 * tid, v_recip_ok(s) ? sage_rcpf(s) : 0.0f);
#endif
    if (tile == 0) sage_gstore<float>(p.v_scale, 4 * channel_offset(head, T::kHeadDim, tid), s);
  }
  sage_barrier();
#if defined(SAGE_QUANT_V_RECIP)
  if constexpr (!kV16) {
    // The cuda e4m3 build: quant.h's quant_v_recip_arg (a multiply by the channel's 1/s and
    // an FMA residual at one midpoint, no division) and two values per conversion. The words
    // with a value it leaves to the division (e4m3 subnormal codes, zeros, padded keys), and the
    // channels whose scale is outside v_recip_ok (zero, tiny, huge, NaN; D < Dp's empty ones), are
    // redone by the division in a rolled loop afterwards: unrolled beside the fast path, the
    // division outgrew the instruction cache (H200 Nsight Compute: "no instruction" stalls).
    static_assert(T::kVqKeysPerThread == 4 && kWords == 1, "two e4m3 pairs per LDS word");
    static_assert(T::kVqPasses * T::kChunk < 32, "one bit per (pass, channel) in `redo`");
    uint32_t redo = 0;  // bit pass * kChunk + i: channel i's word of the pass
#pragma unroll
    for (int i = 0; i < T::kChunk; ++i) {  // a channel at a time: its s and 1/s alone live
      const int ch = T::kChunk * c + i;
      const float sc = sage_lds_load<float>(channel_scale, 4 * ch);
      const float r = sage_lds_load<float>(channel_recip, 4 * ch);
#pragma unroll
      for (int pass = 0; pass < T::kVqPasses; ++pass) {
        bool unsure = !(r > 0.0f);
        float t[T::kVqKeysPerThread];
#pragma unroll
        for (int k = 0; k < T::kVqKeysPerThread; ++k) {
          float x[T::kChunk];
          unpack_halfx8(raw[pass][k], T::kDtype, x);  // only x[i] is used
          t[k] = quant_v_recip_arg(x[i], sc, r, unsure);
        }
        const uint32_t word = uint32_t(sage_e4m3x2_finite(t[0], t[1])) |
                              uint32_t(sage_e4m3x2_finite(t[2], t[3])) << 16;
        redo |= uint32_t(unsure) << (pass * T::kChunk + i);
        const int key0 = key0_of(pass);
        sage_lds_store(vt, vt_lds_offset(ch, key0, 1), word);  // rewritten below if redone
      }
    }
#pragma unroll 1
    for (int bit = 0; redo >> bit; ++bit) {
      if (!((redo >> bit) & 1u)) continue;
      const int pass = bit / T::kChunk, i = bit % T::kChunk, ch = T::kChunk * c + i;
      const float sc = sage_lds_load<float>(channel_scale, 4 * ch);
      uint32_t word = 0;
#pragma unroll
      for (int k = 0; k < T::kVqKeysPerThread; ++k) {
        // Channel i of key k by selects (a dynamic index into raw would go to local memory).
        u32x4 r = raw[0][k];
#pragma unroll
        for (int q = 1; q < T::kVqPasses; ++q)
          if (pass == q) r = raw[q][k];
        const uint32_t pair = i < 4 ? (i < 2 ? r.x : r.y) : (i < 6 ? r.z : r.w);
        const float x = half_to_f32(uint16_t(i & 1 ? pair >> 16 : pair & 0xffffu), T::kDtype);
        if (key_of(pass, k) < kv_len && in_d) word |= uint32_t(quant_v(x, sc)) << (8 * k);
      }
      const int key0 = key0_of(pass);
      sage_lds_store(vt, vt_lds_offset(ch, key0, 1), word);
    }
  } else
#endif
  {
    float scale[T::kChunk];  // channels >= D: amax 0, scale 0, so their codes are +0
#pragma unroll
    for (int i = 0; i < T::kChunk; ++i)
      scale[i] = sage_lds_load<float>(channel_scale, 4 * (T::kChunk * c + i));
    // Quantize, a channel at a time: its 4 key codes are kWords LDS words, stored before the
    // next channel's (one channel's words live, not all 8: at 4 workgroups per SM the NVIDIA
    // build has 64 registers, and the raw loads hold 32 of them).
#pragma unroll
    for (int pass = 0; pass < T::kVqPasses; ++pass) {
      const int key0 = key0_of(pass);
#pragma unroll
      for (int i = 0; i < T::kChunk; ++i) {
        uint32_t word[kWords];
#pragma unroll
        for (int w = 0; w < kWords; ++w) word[w] = 0;
#pragma unroll
        for (int k = 0; k < T::kVqKeysPerThread; ++k) {
          if (key_of(pass, k) < kv_len && in_d) {
            float x[T::kChunk];
            unpack_halfx8(raw[pass][k], T::kDtype, x);  // only x[i] is used
            constexpr int kBits = 8 * kCodeBytes;
            const uint32_t code =
                kV16 ? uint32_t(quant_v16(x[i], scale[i])) : uint32_t(quant_v(x[i], scale[i]));
            word[k * kBits / 32] |= code << (k * kBits % 32);
          }
        }
#pragma unroll
        for (int w = 0; w < kWords; ++w)
          sage_lds_store(vt, vt_lds_offset(T::kChunk * c + i, key0, kCodeBytes) + 4 * w, word[w]);
      }
    }
  }
  sage_barrier();
  // Write the transposed tile: Dp channel rows x 128 keys, 16 bytes (16 / kCodeBytes keys) per
  // store. The padded length is a multiple of 32 keys, so a store is all in or all out.
  constexpr int kKeysPerPiece = 16 / kCodeBytes;
  constexpr int kPiecesPerRow = kVtKeys / kKeysPerPiece;
  constexpr int kRowsPerStep = T::kVqThreads / kPiecesPerRow;
  static_assert(SAGE_SEQ_ALIGN % kKeysPerPiece == 0, "stores end on the padded length");
#pragma unroll
  for (int step = 0; step < T::kHeadDim / kRowsPerStep; ++step) {
    const int ch = tid / kPiecesPerRow + step * kRowsPerStep;
    const int k0 = kKeysPerPiece * (tid % kPiecesPerRow);
    if (int64_t(tile) * kVtKeys + k0 >= p.kv_len_pad) continue;  // past the padded length
    const int at = vt_lds_offset(ch, k0, kCodeBytes);
    const u32x4 out{sage_lds_load<uint32_t>(vt, at), sage_lds_load<uint32_t>(vt, at + 4),
                    sage_lds_load<uint32_t>(vt, at + 8), sage_lds_load<uint32_t>(vt, at + 12)};
    const int64_t dst =
        v8_offset(head, T::kHeadDim, p.kv_len_pad, ch, int64_t(tile) * kVtKeys + k0);
    if (kV16)
      sage_gstore<u32x4>(p.v16, 2 * dst, out);
    else
      sage_gstore<u32x4>(p.v8, dst, out);
  }
}

// The kernels of one (head dim, input dtype): extern "C" names (the hiprtc host and the
// emulator find kernels by name), bodies shared through PrepTraits. Dp 128 with BF16 keeps the
// original names. The dtype is a template argument: as a runtime value the compiler kept both
// decodings live (twice the VGPRs).
#define SAGE_PREPARE_KERNELS(TRAITS, SUFFIX)                                              \
  SAGE_KERNEL_NV_BLOCKS(sage_prepare_v_scale##SUFFIX##kernel, TRAITS::kVsThreads,         \
                        TRAITS::kVsNvBlocks)(SageParams p) {                              \
    sage_dependents_may_start();                                                          \
    v_scale_body<TRAITS, false>(p);                                                       \
  }                                                                                       \
  SAGE_KERNEL(sage_prepare_v_scale_smooth##SUFFIX##kernel, TRAITS::kVsThreads)            \
  (SageParams p) {                                                                        \
    sage_dependents_may_start();                                                          \
    v_scale_body<TRAITS, true>(p);                                                        \
  }                                                                                       \
  SAGE_KERNEL_NV_BLOCKS(sage_prepare_qk##SUFFIX##kernel, TRAITS::kQkThreads,              \
                        TRAITS::kQkFusedNvBlocks)(SageParams p) {                         \
    sage_wait_for_prior_grid(); /* k_mean */                                              \
    sage_dependents_may_start();                                                          \
    qk_body<TRAITS, QkBuild::kFused>(p);                                                  \
  }                                                                                       \
  SAGE_KERNEL_NV_BLOCKS(sage_prepare_qk_smooth##SUFFIX##kernel, TRAITS::kQkThreads,       \
                        TRAITS::kQkSmoothNvBlocks)(SageParams p) {                        \
    sage_wait_for_prior_grid(); /* k_mean */                                              \
    sage_dependents_may_start();                                                          \
    qk_body<TRAITS, QkBuild::kSmooth>(p);                                                 \
  }                                                                                       \
  SAGE_KERNEL_NV_BLOCKS(sage_prepare_qk_plain##SUFFIX##kernel, TRAITS::kQkThreads,        \
                        TRAITS::kQkNvBlocks)(SageParams p) {                              \
    sage_dependents_may_start();                                                          \
    qk_body<TRAITS, QkBuild::kPlain>(p);                                                  \
    sage_wait_for_prior_grid(); /* done only once v_scale is: v_quant waits for this */   \
  }                                                                                       \
  SAGE_KERNEL_NV_BLOCKS(sage_prepare_v_quant##SUFFIX##kernel, TRAITS::kVqThreads,         \
                        TRAITS::kVqNvBlocks)(SageParams p) {                              \
    sage_dependents_may_start();                                                          \
    v_quant_body<TRAITS, false>(p);                                                       \
  }                                                                                       \
  SAGE_KERNEL(sage_prepare_v_quant16##SUFFIX##kernel, TRAITS::kVqThreads)(SageParams p) { \
    sage_dependents_may_start();                                                          \
    v_quant_body<TRAITS, true>(p);                                                        \
  }

using PrepBf16D128 = PrepTraits<SAGE_HEAD_DIM_LARGE, SAGE_DTYPE_BF16>;
using PrepBf16D64 = PrepTraits<SAGE_HEAD_DIM_SMALL, SAGE_DTYPE_BF16>;
using PrepFp16D128 = PrepTraits<SAGE_HEAD_DIM_LARGE, SAGE_DTYPE_FP16>;
using PrepFp16D64 = PrepTraits<SAGE_HEAD_DIM_SMALL, SAGE_DTYPE_FP16>;
// Every prepare variant, once: traits, name suffix, head dim, FP16 input. The kernels are
// defined from this table and the launcher picks from it (sage_prepare_run).
#define SAGE_PREPARE_VARIANTS(X)                    \
  X(PrepBf16D128, _, SAGE_HEAD_DIM_LARGE, false)    \
  X(PrepBf16D64, _d64_, SAGE_HEAD_DIM_SMALL, false) \
  X(PrepFp16D128, _f16_, SAGE_HEAD_DIM_LARGE, true) \
  X(PrepFp16D64, _d64_f16_, SAGE_HEAD_DIM_SMALL, true)
#define SAGE_DEFINE_PREPARE(TRAITS, SUFFIX, DIM, FP16) SAGE_PREPARE_KERNELS(TRAITS, SUFFIX)
SAGE_PREPARE_VARIANTS(SAGE_DEFINE_PREPARE)
#undef SAGE_DEFINE_PREPARE
#undef SAGE_PREPARE_KERNELS

}  // namespace gfx12
}  // namespace sage

#if SAGE_HOST_LAUNCH  // host launch section (not in a hiprtc device build)
#include <type_traits>
// The backend this file is built for (csrc/cuda/prepare.cu builds it as CUDA).
#ifndef SAGE_PREPARE_BACKEND
#define SAGE_PREPARE_BACKEND "gfx12"
#endif
SAGE_DEFINE_MODULE_ABI("module_gfx1201_sage_prepare target=" SAGE_PREPARE_BACKEND)

namespace {
int check_launch(int rc, const char* kernel) {
#if defined(SAGE_EMU)
  (void)kernel;
  return rc;  // the emulator already set a report summary
#else
  return rc ? sage::set_error("sage_prepare_launch: %s launch failed (%s error %d)", kernel,
                              SAGE_PREPARE_BACKEND, rc)
            : 0;
#endif
}

// Which qk build a call runs: the fused one (RMSNorm or RoPE asked for), the smooth one (K
// smoothing or 16-row Q scales, neither norm nor RoPE: the DiT call with smooth_k) or the plain
// one (upstream's default call). Each has none of the later builds' code or registers: the
// fused kernel's norm weights spill under the NVIDIA register cap, and its instruction count
// per element was about 54 on an H200 (issue-bound at 210 us, B1 H24 S16384). With the 16-row
// scales' second maximum and reciprocal, the plain kernel spilled at its 64-register cap and
// ran 122 us instead of 109 (H200, B1 H24 S16384, 9 blocks per SM).
sage::gfx12::QkBuild qk_build(const SageParams& p) {
  using sage::gfx12::QkBuild;
  if (p.q_norm_weight || p.k_norm_weight || p.rope_cos) return QkBuild::kFused;
  if (p.smooth_k || sage::q_scale_rows(p) == SAGE_Q_SCALE_ROWS_FINE) return QkBuild::kSmooth;
  return QkBuild::kPlain;
}

// The kernels of one variant, by build (K: the kernels' common type, a function pointer or,
// in the hiprtc host, sage_kernel).
template <class K>
struct PrepareKernels {
  K v_scale, v_scale_smooth;  // v_scale_body's plain and smooth builds
  K qk_plain, qk_smooth, qk;  // QkBuild
  K v_quant, v_quant16;       // pv_dtype FP8, FP16
};

// The three launches of one head dim, in stream order: kernel 1 writes v_amax_part (and
// k_mean), which kernels 3 (and 2: K blocks and Q's lse_corr with smoothing) read.
// v_quant16 replaces v_quant with pv_dtype FP16 (FP16 V codes).
template <class T, class K>
int launch_prepare(const SageParams& p, void* stream, const PrepareKernels<K>& k) {
  const unsigned B = unsigned(p.batch), Hq = unsigned(p.heads_q), Hkv = unsigned(p.heads_kv);
  if (!p.v_amax_part)
    return sage::set_error("%s: null v_amax_part (the GPU prepare's scratch)",
                           "sage_prepare_launch");
  const unsigned v_scale_z = unsigned(sage::v_scale_workgroups(p.smooth_k != 0));
  int rc = sage_launch(p.smooth_k ? k.v_scale_smooth : k.v_scale, sage_dim3{Hkv, B, v_scale_z},
                       T::kVsThreads, stream, p);
  if (rc) return check_launch(rc, "v_scale");
  const sage::gfx12::QkBuild build = qk_build(p);
  const unsigned qk_blocks = unsigned(sage::gfx12::qk_workgroups(
      int(sage::scale_blocks(p.q_len_pad)), int(sage::scale_blocks(p.kv_len_pad)),
      int(sage::group_size(p)), T::qk_blocks_per_workgroup(build == sage::gfx12::QkBuild::kPlain)));
  const K qk_kernel = build == sage::gfx12::QkBuild::kFused    ? k.qk
                      : build == sage::gfx12::QkBuild::kSmooth ? k.qk_smooth
                                                               : k.qk_plain;
  rc = sage_launch_after_prior(qk_kernel, sage_dim3{qk_blocks, Hq, B}, T::kQkThreads, stream, p);
  if (rc) return check_launch(rc, "qk");
  const unsigned tiles = unsigned((p.kv_len_pad + sage::gfx12::kVtKeys - 1) / sage::gfx12::kVtKeys);
  rc = sage_launch_after_prior(p.pv_dtype == SAGE_PV_FP16 ? k.v_quant16 : k.v_quant,
                               sage_dim3{tiles, Hkv, B}, T::kVqThreads, stream, p);
  return rc ? check_launch(rc, "v_quant") : 0;
}
}  // namespace

// The kernels of variant (kD, kFp16), from SAGE_PREPARE_VARIANTS.
template <int kD, bool kFp16>
int launch_prepare_variant(const SageParams& p, void* stream) {
  namespace g = sage::gfx12;
#define SAGE_PICK_PREPARE(TRAITS, SUFFIX, DIM, FP16)                                             \
  if constexpr (kD == (DIM) && kFp16 == (FP16))                                                  \
    return launch_prepare<g::TRAITS>(                                                            \
        p, stream,                                                                               \
        PrepareKernels<std::decay_t<decltype(g::sage_prepare_qk##SUFFIX##kernel)>>{              \
            g::sage_prepare_v_scale##SUFFIX##kernel,                                             \
            g::sage_prepare_v_scale_smooth##SUFFIX##kernel,                                      \
            g::sage_prepare_qk_plain##SUFFIX##kernel, g::sage_prepare_qk_smooth##SUFFIX##kernel, \
            g::sage_prepare_qk##SUFFIX##kernel, g::sage_prepare_v_quant##SUFFIX##kernel,         \
            g::sage_prepare_v_quant16##SUFFIX##kernel});                                         \
  else
  SAGE_PREPARE_VARIANTS(SAGE_PICK_PREPARE)
  static_assert(sage::kNoSuchVariant<kD, kFp16>, "no prepare kernels of this variant");
#undef SAGE_PICK_PREPARE
}

SAGE_EXPORT int sage_prepare_run(const SageParams* params, void* stream) {
  if (!sage::check_features(params, sage::Launch::kPrepare, sage::kAllFeatures,
                            SAGE_PREPARE_BACKEND))
    return 1;
  const SageParams& p = *params;
  // The one place where the head dim and the input dtype become template arguments.
  return SAGE_HEAD_DIM_SWITCH(p.head_dim_pad, kD, [&] {
    return SAGE_BOOL_SWITCH(p.in_dtype == SAGE_DTYPE_FP16, kFp16,
                            [&] { return launch_prepare_variant<kD, kFp16>(p, stream); });
  });
}
SAGE_DEFINE_CHECKED_LAUNCH(prepare, kPrepare)
#endif  // SAGE_HOST_LAUNCH
