// aiter_sage: the quantization arithmetic of the op contract, usable on host and device.
// Every backend's prepare is bit-identical to aiter_sage/ref.py because each step here is a
// single correctly rounded IEEE operation (mul, div, sqrt, rint) in a fixed order.
#pragma once
#include <stdint.h>
#include "sage/constants.h"
#include "sage/params.h"
#include "sage/platform.h"

namespace sage {

SAGE_HD uint32_t f32_bits(float x) { return __builtin_bit_cast(uint32_t, x); }
SAGE_HD float bits_f32(uint32_t u) { return __builtin_bit_cast(float, u); }

SAGE_HD float bf16_to_f32(sage_bf16_t h) { return bits_f32(uint32_t(h) << 16); }
// Round to nearest even, NaN stays (quiet) NaN: what torch's .to(torch.bfloat16) does.
SAGE_HD sage_bf16_t f32_to_bf16(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return sage_bf16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return sage_bf16_t(u >> 16);
}
// Products and sums of BF16 tensors in eager PyTorch: computed in FP32, rounded to BF16.
SAGE_HD float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// IEEE binary16, exactly as torch converts (NaN keeps its payload on the way in and becomes
// the canonical quiet NaN 0x7e00 with its sign on the way out; overflow rounds to +-inf).
SAGE_HD float fp16_to_f32(sage_fp16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact
    const float mag = float(m) * 5.9604644775390625e-08f;
    return bits_f32(f32_bits(mag) | sign);
  }
  if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u));
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}
SAGE_HD sage_fp16_t f32_to_fp16(float x) {
  const uint32_t u = f32_bits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t ua = u & 0x7fffffffu;
  if (ua > 0x7f800000u) return sage_fp16_t(sign | 0x7e00u);
  if (ua >= 0x477ff000u) return sage_fp16_t(sign | 0x7c00u);  // >= 65520 (the tie) -> inf
  if (ua < 0x38800000u)  // below 2^-14: subnormal, multiples of 2^-24 (1024 = smallest normal)
    return sage_fp16_t(sign | uint32_t(__builtin_rintf(bits_f32(ua) * 16777216.0f)));
  const uint32_t r = (ua + 0xfffu + ((ua >> 13) & 1u)) >> 13;  // RNE to 10 mantissa bits
  return sage_fp16_t(sign | (r - (112u << 10)));
}
SAGE_HD float fp16_round(float x) { return fp16_to_f32(f32_to_fp16(x)); }

// The 16-bit formats of SageDtype: decode raw bits, round a float32 to the format, encode.
SAGE_HD float half_to_f32(uint16_t raw, int dtype) {
  return dtype == SAGE_DTYPE_FP16 ? fp16_to_f32(raw) : bf16_to_f32(raw);
}
SAGE_HD float round_to_dtype(float x, int dtype) {
  return dtype == SAGE_DTYPE_FP16 ? fp16_round(x) : bf16_round(x);
}
SAGE_HD uint16_t f32_to_half(float x, int dtype) {
  return dtype == SAGE_DTYPE_FP16 ? f32_to_fp16(x) : f32_to_bf16(x);
}

// ---- the attention output (aiter_sage/ref.py, "Finite input": finite in, finite out) ----
constexpr float kFp16Max = 65504.0f;     // largest finite binary16
constexpr float kBf16Max = 0x1.fep127f;  // largest finite bfloat16 (bits 0x7f7f)
constexpr float kFloatMax = 3.40282347e+38f;
SAGE_HD float half_max(int dtype) { return dtype == SAGE_DTYPE_FP16 ? kFp16Max : kBf16Max; }
// x clamped to [-bound, bound] where it is finite; +-inf and NaN pass unchanged. (The two
// compares are joined by & so that a compiler may if-convert and vectorize it.)
SAGE_HD float saturate_finite(float x, float bound) {
  const float a = __builtin_fabsf(x);
  return ((a > bound) & (a <= kFloatMax)) ? __builtin_copysignf(bound, x) : x;
}
// The bound of r = acc / l, the P-weighted mean of the V codes: e4m3 codes are at most 448 in
// magnitude and so is their mean, but P's rounding (which l does not see) carries r up to ~0.8 %
// past it, and with BF16 V at its maximum r * v_scale then overflows FP32. Clamping r to the
// bound projects it onto an interval that holds the exact mean (it never adds error). FP16
// codes (pv_dtype FP16) get no bound (inf): |code| <= 448 only for a normal v_scale, and their
// P's 0.05 % cannot overflow FP32.
SAGE_HD float code_mean_bound(bool fp16_codes) { return fp16_codes ? __builtin_inff() : kFp8Max; }
// An output value before its rounding to out_dtype: r = acc / l clamped to `mean_bound`, times
// the V channel scale, then clamped to +-out_max (half_max) where finite, where RNE would give
// +-inf. An inf or NaN comes only from a non-finite V scale or score (non-finite input).
SAGE_HD float output_value(float code_mean, float v_scale, float mean_bound, float out_max) {
  return saturate_finite(saturate_finite(code_mean, mean_bound) * v_scale, out_max);
}

// Q factor float32(softmax_scale * log2 e), the product in double (host side: the binding
// fills SageParams::q_prescale with it; the kernels then use exp2).
inline float q_prescale_from(double softmax_scale) { return float(softmax_scale * kLog2e); }

// |x| maximum that propagates NaN like torch.amax (fmaxf would drop it). A CUDA device has it
// as one instruction (max.NaN; its NaN is the canonical one, and NaN payloads are not part of
// the contract: torch's own amax gives another).
SAGE_HD float nan_max(float a, float b) {
#if defined(SAGE_HAS_FMAX_NAN) && defined(__CUDA_ARCH__)
  return sage_fmax_nan(a, b);
#else
  return (a > b || a != a) ? a : b;
#endif
}
// INT8 block scale: amax / 127. A block whose scale is not > 0 (all zero, underflowing, NaN)
// gets zero codes and keeps that scale.
SAGE_HD float int8_block_scale(float amax) { return amax / kInt8Max; }
// An integral float -> int8 as torch's .to(torch.int8) does: through int32 (NaN and values
// out of int32 range give INT32_MIN), then the low byte. Quotients beyond +-127.5 need a
// subnormal block scale; they wrap here exactly as in upstream's reference.
SAGE_HD int8_t int8_like_torch(float t) {
  const int32_t i = (t == t && __builtin_fabsf(t) < 2147483648.0f) ? int32_t(t) : (-2147483647 - 1);
  return int8_t(uint8_t(uint32_t(i) & 0xffu));
}
// INT8 code of x in a block of scale s: t = x / s, then trunc(t +- 0.5) (ties away from zero,
// the addition rounded to float32 first, as upstream); int32(t) truncates toward zero.
SAGE_HD int8_t quant_i8(float x, float scale) {
  if (!(scale > 0.0f)) return 0;
  float t = x / scale;
  t = t + (t >= 0.0f ? 0.5f : -0.5f);
  return int8_like_torch(t);
}
// A block scale that is a positive normal float: the block's amax is finite (so are all its
// values: amax propagates NaN and inf) and every quotient is |x / s| <= 127 + 1 ulp.
SAGE_HD bool int8_scale_is_normal(float scale) {
  return scale >= 1.17549435e-38f && scale <= 3.40282347e+38f;  // FLT_MIN .. FLT_MAX
}
// quant_i8 in a block whose scale is normal: t is finite and |t| < 128, so int8_like_torch's
// NaN and int32-range checks cannot fire, and t + copysign(0.5, t) is quant_i8's
// t + (t >= 0 ? 0.5 : -0.5) except at t = -0, where both truncate to 0. Same codes, fewer
// instructions (prepare's qk kernel is issue-bound on an H200).
SAGE_HD int8_t quant_i8_normal(float x, float scale) {
  const float t = x / scale;
  return int8_t(int32_t(t + __builtin_copysignf(0.5f, t)));
}

// ---- quant_i8_normal without a division per value (the cuda prepare: SAGE_QUANT_I8_RECIP) ----
// t' = x * r with r = 1/s rounded once per block stands in for t = x / s when that provably
// gives the same code; the caller falls back to quant_i8_normal for a value it cannot vouch
// for. The division was ~12 of the qk kernel's instructions per value on an H200 (MUFU.RCP,
// Newton FFMAs, FCHK and its slow-path branch); without it qk_plain ran 113 -> 109 us at B1 H24
// S16384 (the kernel waits on its loads more than on issue).
//   * r normal (int8_recip_ok): r = (1/s)(1 + e), |e| <= 2^-24. Every |x / s| <= 127 (1 + 2^-23)
//     in a block of normal scale, so |x r - x/s| <= 2^-17, t' = RN(x r) adds <= 2^-18 and t adds
//     <= 2^-18: |t' - t| <= 2^-16.
//   * code(t) = trunc(RN(|t| + 1/2)) (signed) steps only within ulp(128) = 2^-16 of the
//     half-integers k + 1/2 and is constant between. So where |t'| lies more than
//     kQuantRecipMargin = 2^-14 inside (c - 1/2, c + 1/2), c = code(t'), so does t and the
//     codes agree.
//   * code(t') without F2I (which shares the quarter-rate unit with MUFU): for u = RN(|t'| +
//     1/2) in [1/2, 128), RZ(u + 2^23) = 2^23 + floor(u) exactly, whose bits are 0x4B000000 +
//     floor(u); |t'| - floor(u) is exact (Sterbenz, or floor(u) = 0).
constexpr float kQuantRecipMargin = 0.5f - 0x1p-14f;
SAGE_HD bool int8_recip_ok(float scale) { return scale >= 0x1p-125f && scale <= 0x1p125f; }
// a + b rounded toward zero, for a, b >= 0 finite (the host form: the double sum is exact for
// the operands quant_i8_recip passes, then truncated to float).
SAGE_HD float fadd_rz_nonneg(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rz(a, b);
#else
  const double d = double(a) + double(b);
  const float f = float(d);
  return double(f) > d ? bits_f32(f32_bits(f) - 1u) : f;
#endif
}
// code(x * recip); `unsure` is set where the code might differ from quant_i8_normal's.
SAGE_HD int8_t quant_i8_recip(float x, float recip, bool& unsure) {
  const float t = x * recip;
  const float a = __builtin_fabsf(t);
  const float n = fadd_rz_nonneg(a + 0.5f, 0x1p23f);
  unsure |= !(__builtin_fabsf(a - (n - 0x1p23f)) < kQuantRecipMargin);
  const int32_t m = int32_t(f32_bits(n) - 0x4B000000u);
  return int8_t(t < 0.0f ? -m : m);
}

// OCP e4m3fn with round-to-nearest-even and saturation to +-448 (NaN -> 0x7f | sign).
// Bit-level so host and device agree exactly; the GPU may instead clamp and use the
// hardware converter, which the tests prove equal.
SAGE_HD sage_fp8_t f32_to_e4m3_sat(float x) {
  uint32_t u = f32_bits(x);
  uint8_t sign = uint8_t((u >> 24) & 0x80u);
  uint32_t ua = u & 0x7fffffffu;
  if (ua > 0x7f800000u) return sage_fp8_t(sign | 0x7f);
  float a = bits_f32(ua);
  if (a >= kFp8Max) return sage_fp8_t(sign | 0x7e);
  if (a < 0.015625f) {  // below 2^-6: subnormal step 2^-9; rint(8) = 8 is the smallest normal
    return sage_fp8_t(sign | uint8_t(__builtin_rintf(a * 512.0f)));
  }
  int e = int(ua >> 23) - 127;  // -6 .. 8
  uint32_t keep = (ua >> 20) & 7u, rem = ua & 0xfffffu;
  if (rem > 0x80000u || (rem == 0x80000u && (keep & 1u))) ++keep;
  if (keep == 8u) {
    keep = 0;
    ++e;
  }
  return sage_fp8_t(sign | uint8_t((e + 7) << 3) | uint8_t(keep));
}
SAGE_HD float e4m3_to_f32(sage_fp8_t b) {
  uint32_t e = (b >> 3) & 15u, m = b & 7u;
  float mag = (e == 15u && m == 7u) ? __builtin_nanf("")
              : e == 0u             ? float(m) * (1.0f / 512.0f)
                                    : bits_f32(((e + 120u) << 23) | (m << 20));
  return (b & 0x80u) ? -mag : mag;
}

// V channel scale: amax * float32(1/448) (a multiplication by the rounded constant).
constexpr float kInvFp8Max = 1.0f / 448.0f;
SAGE_HD float v_channel_scale(float amax) { return amax * kInvFp8Max; }
// e4m3 code of v in a channel of scale s (0 where s is not > 0).
// On a CUDA device the encoding runs on the hardware converter (same bits, sage_e4m3_sat).
SAGE_HD sage_fp8_t quant_v(float v, float scale) {
  const float t = scale > 0.0f ? v / scale : 0.0f;
#if defined(SAGE_HAS_E4M3_SAT) && defined(__CUDA_ARCH__)
  return sage_fp8_t(sage_e4m3_sat(t));
#else
  return f32_to_e4m3_sat(t);
#endif
}
// ---- quant_v without a division (the cuda v_quant: SAGE_QUANT_V_RECIP) ----
// quant_v's code is E(t), t = RN(v / s), E = f32_to_e4m3_sat. With r = RN(1/s) once per channel,
// t' = RN(|v| r) lies within 3 ulp of |t| (|e_r| <= 2^-24 twice, and t's own rounding). E steps
// only at the midpoints between e4m3 magnitudes; for t' in e4m3's normal range (>= 2^-6) let m
// be the midpoint of the e4m3 interval holding t' (its 3 kept bits, then a 1): m is within a
// few ulp of every step t could cross, so one comparison decides. With x = |v| - m s and
// h = s ulp(m) / 2 (m is no power of two, and its last bit is 0, so ties go to m):
//   * RN(|v| / s) = m iff |x| <= h; otherwise |t| lies on x's side of m, in the e4m3 interval
//     below or above it (or at its edge value, which encodes alike);
//   * x = fma_exact(-m, s, |v|) is exact wherever |x| is near h (m is then within an ulp of
//     |v| / s, and x needs about 23 bits), so the comparisons are exact.
// The code is E of m, or of m's neighbour float on x's side, with v's sign: no division and no
// branch. Left to the division (`unsure`): t' < 2^-6, e4m3's subnormal steps and zero (rare in
// a channel whose maximum is not 0; the kernel's padded keys take it too). Preconditions: s in
// [2^-90, 2^90] (v_recip_ok: r, m s and h are normal) and |v| <= 448 s (1 + 2^-22), which the
// channel's own maximum gives (amax = 448 s up to s's rounding). H200, B1 H24 S16384: v_quant
// 63.8 -> 56.7 us (the division and its branch were ~12 of ~31 instructions a value; the
// kernel is issue-bound).
SAGE_HD bool v_recip_ok(float scale) { return scale >= 0x1p-90f && scale <= 0x1p90f; }
// a * b + c rounded once, on purpose in a file built without contraction: on a CUDA device in
// an asm block that op_tests/backends/test_cuda.py (no contraction in prepare) recognises.
SAGE_HD float fma_exact(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("{ // sage: fma_exact\n\tfma.rn.f32 %0, %1, %2, %3;\n\t}" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
#else
  return __builtin_fmaf(a, b, c);
#endif
}
// The float whose e4m3 code is quant_v(v, scale)'s (recip = RN(1 / scale)), unless `unsure`.
SAGE_HD float quant_v_recip_arg(float v, float scale, float recip, bool& unsure) {
  const float a = __builtin_fabsf(v);
  const uint32_t u = f32_bits(a * recip);
  unsure = unsure | (u < f32_bits(0x1p-6f));
  const uint32_t mb = (u & 0xfff00000u) | 0x80000u;
  const float x = fma_exact(-bits_f32(mb), scale, a);
  const float h = bits_f32(f32_bits(scale) + (mb & 0x7f800000u) - (151u << 23));  // s 2^(E_m-24)
  const uint32_t side = x > h ? 1u : x < -h ? 0xffffffffu : 0u;                   // +1, -1, 0
  return bits_f32((mb + side) | (f32_bits(v) & 0x80000000u));
}
SAGE_HD sage_fp8_t quant_v_recip(float v, float scale, float recip, bool& unsure) {
  return f32_to_e4m3_sat(quant_v_recip_arg(v, scale, recip, unsure));
}

// FP16 code of v (pv_dtype FP16): fp16(v / s) with RNE, 0 where s is not > 0. |v / s| <= 448
// (as for e4m3; a little more only with a subnormal s), far inside FP16's range.
SAGE_HD sage_fp16_t quant_v16(float v, float scale) {
  return f32_to_fp16(scale > 0.0f ? v / scale : 0.0f);
}

// ---- K smoothing: the per-channel mean of K over the real keys, in a pinned order ----
// 32 partial sums per channel, partial g summing keys g, g + 32, g + 64, ... in turn (from
// +0); then the partials in turn, ((p0 + p1) + p2) + ... + p31; then one division by kv_len.
// Every addition is a float32 rounding; smoothed K is float32(k) - mean, one rounding.
constexpr int kMeanPartials = 32;
SAGE_HD float k_mean_from_partials(const float* partials, int kv_len) {
  float total = partials[0];
  for (int g = 1; g < kMeanPartials; ++g) total = total + partials[g];
  return total / float(kv_len);
}

// ---- fused QK RMSNorm + RoPE (upstream: F.rms_norm, then RoPE in FP32) ----
// Sum of squares of a row of head_dim channels (a multiple of 32) in the pinned order of
// aiter_sage/ref.py rms_sum_squares: 4 accumulators x 8 lanes, accumulator a lane l summing
// channels 8a + l + 32i for i = 0..head_dim/32 - 1 in turn; then ((a0 + a1) + a2) + a3 per
// lane; then lanes 0..7 in turn (torch's CPU reduction order at its AVX2 capability for 128).
constexpr int kNormLanes = 8;
constexpr int kNormAccs = 4;
constexpr int kNormChannelsPerRound = kNormLanes * kNormAccs;  // 32
SAGE_HD int norm_rounds(int head_dim) { return head_dim / kNormChannelsPerRound; }
SAGE_HD float rms_sum_squares(const float* x, int head_dim) {
  const int rounds = norm_rounds(head_dim);
  float total = 0.0f;
  for (int l = 0; l < kNormLanes; ++l) {
    float lane = 0.0f;
    for (int a = 0; a < kNormAccs; ++a) {
      const int c0 = kNormLanes * a + l;
      float acc = x[c0] * x[c0];
      for (int i = 1; i < rounds; ++i) {
        const int c = c0 + kNormChannelsPerRound * i;
        acc = acc + x[c] * x[c];
      }
      lane = a == 0 ? acc : lane + acc;
    }
    total = l == 0 ? lane : total + lane;
  }
  return total;
}
// 1 / sqrt(sum / head_dim + eps) with each step correctly rounded.
SAGE_HD float rms_inv(float sum_squares, float eps, int head_dim) {
  float mean = sum_squares / float(head_dim);
  return 1.0f / __builtin_sqrtf(mean + eps);
}
// y = round((x * inv) * w) to the input format: FP32 inside, one rounding.
SAGE_HD float rms_apply(float x, float inv, float w, int dtype) {
  return round_to_dtype((x * inv) * w, dtype);
}
// Rotate-half RoPE of channel c < rope_dim in FP32 with one rounding to the input format:
// x*cos + rot*sin, rot = -x[c + rd/2] for c < rd/2 and x[c - rd/2] otherwise; `partner` is
// x[c +- rd/2]. Each product and the sum are separate float32 roundings (callers compile with
// contraction off).
SAGE_HD float rope_apply(float x, float partner, int c, int rope_dim, float cos_c, float sin_c,
                         int dtype) {
  const float rot = c < rope_dim / 2 ? -partner : partner;
  const float a = x * cos_c;
  const float b = rot * sin_c;
  return round_to_dtype(a + b, dtype);
}
// Upstream's rope dims are 32, 64, 96, 128; with smaller heads, the multiples of 32 up to D.
SAGE_HD bool rope_dim_supported(int rope_dim, int head_dim) {
  return rope_dim >= 32 && rope_dim % 32 == 0 && rope_dim <= head_dim;
}

}  // namespace sage
