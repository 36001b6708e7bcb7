// module_gfx1201_sage_prepare: BF16 Q/K/V -> the prepared tensors of the op contract,
// bit-identical to aiter_sage/ref.py prepare().
//
// Three kernels, launched in this order on the stream:
//   1. v_scale  one workgroup per (batch, head): per-channel amax of V over the whole sequence
//               -> v_scale. A channel's scale depends on every row, and the module has no
//               scratch buffer or atomics to combine partial maxima across workgroups, so one
//               wide workgroup (512 threads, 4 x 16-byte loads in flight each) streams the
//               head once.
//   2. qk       one workgroup per (32-row block, head, batch) of Q and of K: optional fused
//               RMSNorm + RoPE, block amax, INT8 quantization, scale. Rows past the sequence
//               are written as zeros (outputs come from torch.empty).
//   3. v_quant  one workgroup per (128-key tile, head, batch): V / v_scale -> e4m3, transposed
//               through LDS to [B, H, 128, S_pad]; padded keys are +0, and the last tile
//               stores only the keys below S_pad (a multiple of 32).
// V is read twice (amax, then quantize) — a two-pass V; both passes are memory bound and the
// second is fully parallel. Every step is a single correctly rounded IEEE operation in
// quant.h's order, so no FMA contraction is allowed in this file:
#pragma clang fp contract(off)

#include "sage/check.h"
#include "sage/gfx12_fragments.h"
#include "sage/layout.h"
#include "sage/module_abi.h"
#include "sage/params.h"
#include "sage/platform.h"
#include "sage/quant.h"

namespace sage {
namespace gfx12 {

struct PrepTraits {
  static constexpr int kHeadDim = SAGE_HEAD_DIM_LARGE;
  static constexpr int kChunk = 8;  // BF16 channels per lane = one 16-byte load
  static constexpr int kLanesPerRow = kHeadDim / kChunk;  // 16 = the RMSNorm partials
  // qk: 128 threads = 8 rows per pass, 4 passes cover one 32-row scale block.
  static constexpr int kQkThreads = 128;
  static constexpr int kQkRowsPerPass = kQkThreads / kLanesPerRow;
  static constexpr int kQkPasses = SAGE_SCALE_BLOCK / kQkRowsPerPass;
  // v_scale: 512 threads = 32 rows per step, 4 steps unrolled = 64 KiB of loads in flight.
  static constexpr int kVsThreads = 512;
  static constexpr int kVsRowsPerStep = kVsThreads / kLanesPerRow;
  static constexpr int kVsUnroll = 4;
  // v_quant: 256 threads; a thread converts 4 keys x 8 channels per pass, 2 passes = 128 keys.
  static constexpr int kVqThreads = 256;
  static constexpr int kVqKeysPerThread = 4;  // one 32-bit LDS word per channel
  static constexpr int kVqPasses = kVtKeys / (kVqThreads / kLanesPerRow * kVqKeysPerThread);
  static_assert(kQkPasses * kQkRowsPerPass == SAGE_SCALE_BLOCK, "qk covers a scale block");
  static_assert(kChunk == kNormLanes &&
                    kLanesPerRow == kNormAccs * kHeadDim / kNormChannelsPerRound,
                "RMSNorm: a lane's 8 channels are the 8 lanes of quant.h's pinned order");
  static_assert(kVqPasses * (kVqThreads / kLanesPerRow) * kVqKeysPerThread == kVtKeys, "");
  static_assert(kVtKeys % SAGE_SEQ_ALIGN == 0 && (kVtKeys / 16) * 16 == kVtKeys,
                "v_quant stores 16-key pieces; the padded length ends on a piece boundary");
};

// |x| maximum that propagates NaN like torch.amax (fmaxf would drop it).
SAGE_DEVICE float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

SAGE_DEVICE void unpack_bf16x8(u32x4 u, float* x) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = bits_f32(w[i] << 16);
    x[2 * i + 1] = bits_f32(w[i] & 0xffff0000u);
  }
}

// 8 FP32 values (two 16-byte loads) at byte offset `off` of `base`.
SAGE_DEVICE void unpack_f32x8(const float* base, int64_t off, float* x) {
  const u32x4 a = sage_gload<u32x4>(base, off), b = sage_gload<u32x4>(base, off + 16);
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = bits_f32(w[i]);
}

// ============================================================================ kernel 1 =====
SAGE_KERNEL(sage_prepare_v_scale_kernel, PrepTraits::kVsThreads)(SageParams p) {
  using T = PrepTraits;
  SAGE_LDS(float, part_max, T::kVsThreads / T::kLanesPerRow * T::kHeadDim);  // 16 KiB
  const int tid = sage_thread_id();
  const int hd = sage_block_id_x(), b = sage_block_id_y();
  const int c = prep_chunk(tid), row0 = tid / T::kLanesPerRow;
  const sage_bf16_t* v =
      halves(p.v) + bshd_offset(p.v_stride_b, p.v_stride_s, p.v_stride_h, b, 0, hd);

  float amax[T::kChunk];
#pragma unroll
  for (int i = 0; i < T::kChunk; ++i) amax[i] = 0.0f;
  const int kv_len = p.kv_len;
  for (int s0 = row0; s0 < kv_len; s0 += T::kVsRowsPerStep * T::kVsUnroll) {
    u32x4 raw[T::kVsUnroll];
#pragma unroll
    for (int u = 0; u < T::kVsUnroll; ++u) {  // issue all loads first
      const int s = s0 + u * T::kVsRowsPerStep;
      raw[u] = s < kv_len ? sage_gload<u32x4>(v, 2 * (int64_t(s) * p.v_stride_s + T::kChunk * c))
                          : u32x4{0, 0, 0, 0};
    }
#pragma unroll
    for (int u = 0; u < T::kVsUnroll; ++u) {
      float x[T::kChunk];
      unpack_bf16x8(raw[u], x);
#pragma unroll
      for (int i = 0; i < T::kChunk; ++i) amax[i] = nan_max(amax[i], sage_fabsf(x[i]));
    }
  }
  // Every thread parks its 8 partial maxima in LDS (one row of partials per 16-lane group),
  // then one thread per channel folds the groups.
  constexpr int kGroups = T::kVsThreads / T::kLanesPerRow;
#pragma unroll
  for (int i = 0; i < T::kChunk; ++i)
    sage_lds_store(part_max, 4 * (row0 * T::kHeadDim + T::kChunk * c + i), amax[i]);
  sage_barrier();
  if (tid < T::kHeadDim) {  // whole waves: LDS traffic stays wave-uniform
    float m = 0.0f;
    for (int grp = 0; grp < kGroups; ++grp)
      m = nan_max(m, sage_lds_load<float>(part_max, 4 * (grp * T::kHeadDim + tid)));
    const int64_t head = head_index(p.heads_kv, b, hd);
    sage_gstore<float>(p.v_scale, 4 * channel_offset(head, T::kHeadDim, tid), v_channel_scale(m));
  }
}

// ============================================================================ kernel 2 =====
// 1 / rms of a row whose 16 lanes (chunk c = lane % 16) hold channels 8c .. 8c+7, in quant.h's
// pinned order (rms_sum_squares): channel 8a + l + 32i is element l of chunk a + 4i, so
//   1. lanes c < 4 sum their element l with those of chunks c+4, c+8, c+12 in turn (xor 4, 8,
//      12 reach exactly those lanes): accumulator a = c, lane l;
//   2. lane 0 adds accumulators 1, 2, 3 in turn (xor 1, 2, 3), per element l;
//   3. lane 0 sums its 8 elements in turn;
//   4. a butterfly of additions in which only lane 0 contributes a non-zero value gives every
//      lane of the row that exact total (x + 0 = x).
// The other lanes compute values they then ignore; every lane takes part in each shuffle.
SAGE_DEVICE float row_rms_inv(const float* x, int chunk, float eps) {
  float acc[kNormLanes];
#pragma unroll
  for (int l = 0; l < kNormLanes; ++l) {
    const float sq = x[l] * x[l];
    float a = sq;
#pragma unroll
    for (int i = 1; i < PrepTraits::kHeadDim / kNormChannelsPerRound; ++i)
      a = a + sage_shfl_xor(sq, kNormAccs * i);
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
  for (int n = PrepTraits::kLanesPerRow / 2; n >= 1; n /= 2) v = v + sage_shfl_xor(v, n);
  return rms_inv(v, eps, PrepTraits::kHeadDim);
}

struct QkSide {
  const sage_bf16_t* src;  // row 0 of this (batch, head)
  int64_t stride_s;
  int len, len_pad;
  const sage_bf16_t* norm_weight;
  float factor;  // Q: softmax_scale * log2 e; K: 1
  int8_t* out8;
  float* out_scale;
};

SAGE_KERNEL(sage_prepare_qk_kernel, PrepTraits::kQkThreads)(SageParams p) {
  using T = PrepTraits;
  SAGE_LDS(float, block_max, T::kQkThreads);
  const int tid = sage_thread_id(), wave = sage_wave_id();
  const int hd = sage_block_id_y(), b = sage_block_id_z();
  const int q_blocks = p.q_len_pad / SAGE_SCALE_BLOCK;
  const bool is_q = sage_block_id_x() < q_blocks;
  const int heads = is_q ? p.heads_q : p.heads_kv;
  const int64_t head = head_index(heads, b, hd);
  const int blk = is_q ? sage_block_id_x() : sage_block_id_x() - q_blocks;

  QkSide sd;
  if (is_q) {
    sd = QkSide{halves(p.q) + bshd_offset(p.q_stride_b, p.q_stride_s, p.q_stride_h, b, 0, hd),
                p.q_stride_s,
                p.q_len,
                p.q_len_pad,
                halves(p.q_norm_weight),
                p.q_prescale,
                p.q8,
                p.q_scale};
  } else {
    sd = QkSide{halves(p.k) + bshd_offset(p.k_stride_b, p.k_stride_s, p.k_stride_h, b, 0, hd),
                p.k_stride_s,
                p.kv_len,
                p.kv_len_pad,
                halves(p.k_norm_weight),
                1.0f,
                p.k8,
                p.k_scale};
  }
  const int c = prep_chunk(tid);
  const bool norm = sd.norm_weight != nullptr;
  const bool rope = p.rope_cos != nullptr;
  const int rope_dim = p.rope_dim;
  const bool rope_lane = rope && T::kChunk * c < rope_dim;
  const int pc = rope_lane ? rope_partner_chunk(c, rope_dim) : c;

  float w[T::kChunk], wp[T::kChunk];
  if (norm) {
    unpack_bf16x8(sage_gload<u32x4>(sd.norm_weight, 2 * T::kChunk * c), w);
    unpack_bf16x8(sage_gload<u32x4>(sd.norm_weight, 2 * T::kChunk * pc), wp);
  }

  // x[pass][i]: the FP32 value to quantize (Q' or K') of row prep_row(tid, pass), channel 8c+i.
  float x[T::kQkPasses][T::kChunk];
  float amax = 0.0f;
#pragma unroll
  for (int pass = 0; pass < T::kQkPasses; ++pass) {
    const int s = blk * SAGE_SCALE_BLOCK + prep_row(tid, pass, T::kQkThreads);
    const bool in_seq = s < sd.len;  // uniform over the 16 lanes of the row
    float v[T::kChunk], vp[T::kChunk];
    u32x4 raw{0, 0, 0, 0}, raw_p{0, 0, 0, 0};
    if (in_seq) {
      raw = sage_gload<u32x4>(sd.src, 2 * (int64_t(s) * sd.stride_s + T::kChunk * c));
      // The RoPE partner chunk belongs to another lane of this row; reloading it (a cache
      // hit) is cheaper than a non-xor cross-lane move and keeps its rounding identical.
      if (rope_lane)
        raw_p = sage_gload<u32x4>(sd.src, 2 * (int64_t(s) * sd.stride_s + T::kChunk * pc));
    }
    unpack_bf16x8(raw, v);
    unpack_bf16x8(raw_p, vp);
    if (norm) {  // every lane of the wave takes part in the butterfly (rows past len: zeros)
      const float inv = row_rms_inv(v, c, p.norm_eps);
#pragma unroll
      for (int i = 0; i < T::kChunk; ++i) {
        v[i] = rms_apply(v[i], inv, w[i], SAGE_DTYPE_BF16);
        vp[i] = rms_apply(vp[i], inv, wp[i], SAGE_DTYPE_BF16);
      }
    }
    if (rope_lane && in_seq) {
      const int64_t cs = int64_t(s) * p.rope_stride_s + T::kChunk * c;
      float cosv[T::kChunk], sinv[T::kChunk];
      unpack_f32x8(p.rope_cos, 4 * cs, cosv);
      unpack_f32x8(p.rope_sin, 4 * cs, sinv);
#pragma unroll
      for (int i = 0; i < T::kChunk; ++i)
        v[i] =
            rope_apply(v[i], vp[i], T::kChunk * c + i, rope_dim, cosv[i], sinv[i], SAGE_DTYPE_BF16);
    }
#pragma unroll
    for (int i = 0; i < T::kChunk; ++i) {
      x[pass][i] = in_seq ? v[i] * sd.factor : 0.0f;
      amax = nan_max(amax, sage_fabsf(x[pass][i]));
    }
  }
  // Block amax: wave butterfly, then the 4 waves through LDS (every lane stores its copy, so
  // the LDS traffic stays convergent and race free).
#pragma unroll
  for (int n = kWaveSize / 2; n >= 1; n /= 2) amax = nan_max(amax, sage_shfl_xor(amax, n));
  sage_lds_store(block_max, 4 * tid, amax);
  sage_barrier();
#pragma unroll
  for (int wv = 0; wv < T::kQkThreads / kWaveSize; ++wv)
    if (wv != wave) amax = nan_max(amax, sage_lds_load<float>(block_max, 4 * wv * kWaveSize));
  const float scale = int8_block_scale(amax);

#pragma unroll
  for (int pass = 0; pass < T::kQkPasses; ++pass) {
    const int s = blk * SAGE_SCALE_BLOCK + prep_row(tid, pass, T::kQkThreads);
    uint32_t word[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < T::kChunk; ++i)
      word[i / 4] |= uint32_t(uint8_t(quant_i8(x[pass][i], scale))) << (8 * (i % 4));
    sage_gstore<v2i32>(sd.out8, qk8_offset(heads, T::kHeadDim, sd.len_pad, b, s, hd, T::kChunk * c),
                       v2i32{int(word[0]), int(word[1])});
  }
  if (tid == 0)
    sage_gstore<float>(sd.out_scale, 4 * qk_scale_offset(head, sd.len_pad, blk * SAGE_SCALE_BLOCK),
                       scale);
}

// ============================================================================ kernel 3 =====
SAGE_KERNEL(sage_prepare_v_quant_kernel, PrepTraits::kVqThreads)(SageParams p) {
  using T = PrepTraits;
  SAGE_LDS(uint32_t, vt, T::kHeadDim* kVtRowBytes / 4);
  const int tid = sage_thread_id();
  const int tile = sage_block_id_x(), hd = sage_block_id_y(), b = sage_block_id_z();
  const int64_t head = head_index(p.heads_kv, b, hd);
  const int c = prep_chunk(tid), g = tid / T::kLanesPerRow;
  const sage_bf16_t* v =
      halves(p.v) + bshd_offset(p.v_stride_b, p.v_stride_s, p.v_stride_h, b, 0, hd);

  float scale[T::kChunk];
  {
    const float* vs = p.v_scale + channel_offset(head, T::kHeadDim, T::kChunk * c);
    const u32x4 s0 = sage_gload<u32x4>(vs, 0), s1 = sage_gload<u32x4>(vs, 16);
    const uint32_t u[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
    for (int i = 0; i < T::kChunk; ++i) scale[i] = bits_f32(u[i]);
  }

  // Quantize 4 keys x 8 channels per pass; each channel's 4 key bytes are one LDS word.
#pragma unroll
  for (int pass = 0; pass < T::kVqPasses; ++pass) {
    const int key0 = pass * (kVtKeys / T::kVqPasses) + T::kVqKeysPerThread * g;
    uint32_t word[T::kChunk];
#pragma unroll
    for (int i = 0; i < T::kChunk; ++i) word[i] = 0;
#pragma unroll
    for (int k = 0; k < T::kVqKeysPerThread; ++k) {
      const int s = tile * kVtKeys + key0 + k;
      if (s < p.kv_len) {  // padded keys stay +0
        float x[T::kChunk];
        unpack_bf16x8(sage_gload<u32x4>(v, 2 * (int64_t(s) * p.v_stride_s + T::kChunk * c)), x);
#pragma unroll
        for (int i = 0; i < T::kChunk; ++i) word[i] |= uint32_t(quant_v(x[i], scale[i])) << (8 * k);
      }
    }
#pragma unroll
    for (int i = 0; i < T::kChunk; ++i)
      sage_lds_store(vt, vt_lds_offset(T::kChunk * c + i, key0), word[i]);
  }
  sage_barrier();
  // Write the transposed tile: 128 channel rows x 128 key bytes, 16 bytes per store.
  constexpr int kPiecesPerRow = kVtKeys / 16;
  constexpr int kRowsPerStep = T::kVqThreads / kPiecesPerRow;
#pragma unroll
  for (int step = 0; step < T::kHeadDim / kRowsPerStep; ++step) {
    const int ch = tid / kPiecesPerRow + step * kRowsPerStep;
    const int k16 = 16 * (tid % kPiecesPerRow);
    if (int64_t(tile) * kVtKeys + k16 >= p.kv_len_pad) continue;  // past the padded length
    u32x4 out;
    out.x = sage_lds_load<uint32_t>(vt, vt_lds_offset(ch, k16));
    out.y = sage_lds_load<uint32_t>(vt, vt_lds_offset(ch, k16 + 4));
    out.z = sage_lds_load<uint32_t>(vt, vt_lds_offset(ch, k16 + 8));
    out.w = sage_lds_load<uint32_t>(vt, vt_lds_offset(ch, k16 + 12));
    sage_gstore<u32x4>(
        p.v8, v8_offset(head, T::kHeadDim, p.kv_len_pad, ch, int64_t(tile) * kVtKeys + k16), out);
  }
}

}  // namespace gfx12
}  // namespace sage

#if SAGE_HOST_LAUNCH  // host launch section (not in a hiprtc device build)
SAGE_DEFINE_MODULE_ABI("module_gfx1201_sage_prepare target=gfx12")

namespace {
int check_launch(int rc, const char* kernel) {
#if defined(SAGE_EMU)
  (void)kernel;
  return rc;  // the emulator already set a report summary
#else
  return rc ? sage::set_error("sage_prepare_launch: %s launch failed (hip error %d)", kernel, rc)
            : 0;
#endif
}
}  // namespace

SAGE_EXPORT int sage_prepare_launch(const SageParams* params, void* stream) {
  using sage::gfx12::PrepTraits;
  namespace g = sage::gfx12;
  if (!sage::check_params(params, sage::Launch::kPrepare)) return 1;
  if (!sage::check_features(params, sage::Launch::kPrepare, sage::kV1Features, "gfx12")) return 1;
  const SageParams& p = *params;
  const unsigned B = unsigned(p.batch), H = unsigned(p.heads_q);

  int rc = sage_launch(g::sage_prepare_v_scale_kernel, sage_dim3{H, B, 1}, PrepTraits::kVsThreads,
                       stream, p);
  if (rc) return check_launch(rc, "v_scale");
  const unsigned qk_blocks = unsigned((p.q_len_pad + p.kv_len_pad) / SAGE_SCALE_BLOCK);
  rc = sage_launch(g::sage_prepare_qk_kernel, sage_dim3{qk_blocks, H, B}, PrepTraits::kQkThreads,
                   stream, p);
  if (rc) return check_launch(rc, "qk");
  rc = sage_launch(g::sage_prepare_v_quant_kernel,
                   sage_dim3{unsigned((p.kv_len_pad + g::kVtKeys - 1) / g::kVtKeys), H, B},
                   PrepTraits::kVqThreads, stream, p);
  return rc ? check_launch(rc, "v_quant") : 0;
}
#endif  // SAGE_HOST_LAUNCH
