// aiter_sage: the quantization arithmetic of the op contract, usable on host and device.
// Every backend's prepare is bit-identical to aiter_sage/ref.py because each step here is a
// single correctly rounded IEEE operation (mul, div, sqrt, rint) in a fixed order.
#pragma once
#include <stdint.h>
#include "sage/params.h"
#include "sage/platform.h"

namespace sage {

// float32(log2(e)): Q is pre-multiplied by softmax_scale * log2(e) so the kernel uses exp2.
constexpr float kLog2e = 1.44269504088896340736f;
constexpr float kInt8Max = 127.0f;
constexpr float kFp8Max = 448.0f;  // largest finite OCP e4m3fn value
// RMSNorm reduction order (see rms_sum_squares): 16 partial sums of 8 consecutive channels.
constexpr int kNormPartials = 16;
constexpr int kNormChunk = SAGE_HEAD_DIM / kNormPartials;

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

// Q' = q * float32(float32(softmax_scale) * float32(log2 e)).
SAGE_HD float q_prescale(float softmax_scale) { return softmax_scale * kLog2e; }

// One scale for a block from its absolute maximum; a block whose scale would be zero
// (all-zero, or so small that amax/qmax underflows) gets scale 1 and quantizes to zeros.
SAGE_HD float block_scale(float amax, float qmax) {
  float s = amax / qmax;
  return s > 0.0f ? s : 1.0f;
}
// INT8: clamp(rne(x / s), -127, 127). A NaN quotient (non-finite input) maps to -127.
SAGE_HD int8_t quant_i8(float x, float scale) {
  float r = __builtin_rintf(x / scale);
  r = __builtin_fminf(__builtin_fmaxf(r, -kInt8Max), kInt8Max);
  return int8_t(r);
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
  if (keep == 8u) { keep = 0; ++e; }
  return sage_fp8_t(sign | uint8_t((e + 7) << 3) | uint8_t(keep));
}
SAGE_HD float e4m3_to_f32(sage_fp8_t b) {
  uint32_t e = (b >> 3) & 15u, m = b & 7u;
  float mag = (e == 15u && m == 7u) ? __builtin_nanf("")
              : e == 0u             ? float(m) * (1.0f / 512.0f)
                                    : bits_f32(((e + 120u) << 23) | (m << 20));
  return (b & 0x80u) ? -mag : mag;
}

// ---- fused QK RMSNorm + RoPE, rounded like the eager BF16 PyTorch sequence ----
// Sum of squares in a pinned order: partial p[j] = sequential sum of channels 8j..8j+7,
// then halving p[j] + p[j + n/2] for n = 16, 8, 4, 2 (a butterfly over 16 lanes gives
// exactly this). ref.py spells the same order with torch ops.
SAGE_HD float rms_tree_reduce(float* p) {
  for (int n = kNormPartials / 2; n >= 1; n /= 2)
    for (int j = 0; j < n; ++j) p[j] = p[j] + p[j + n];
  return p[0];
}
SAGE_HD float rms_chunk_sum(const float* x8) {
  float s = x8[0] * x8[0];
  for (int i = 1; i < kNormChunk; ++i) s = s + x8[i] * x8[i];
  return s;
}
// 1 / sqrt(mean + eps) with each step correctly rounded.
SAGE_HD float rms_inv(float sum_squares, float eps) {
  float mean = sum_squares / float(SAGE_HEAD_DIM);
  return 1.0f / __builtin_sqrtf(mean + eps);
}
// y = bf16(x * inv) * w (BF16 * BF16 -> BF16).
SAGE_HD float rms_apply(float x, float inv, float w) {
  return bf16_round(bf16_round(x * inv) * w);
}
// Rotate-half RoPE of channel c < rope_dim: x*cos + rotate_half(x)*sin, where
// rotate_half(x)[c] = -x[c + rd/2] for c < rd/2 and x[c - rd/2] otherwise; each product and
// the sum rounded to BF16. `partner` is x[c +- rd/2].
SAGE_HD float rope_apply(float x, float partner, int c, int rope_dim, float cos_c,
                                float sin_c) {
  float rot = c < rope_dim / 2 ? -partner : partner;
  return bf16_round(bf16_round(x * cos_c) + bf16_round(rot * sin_c));
}
SAGE_HD bool rope_dim_supported(int rope_dim) {
  return rope_dim == 32 || rope_dim == 64 || rope_dim == 96 || rope_dim == 128;
}

}  // namespace sage
