// Host probe of csrc/include/sage/layout.h and quant.h for op_tests/ops/test_layout.py.
#include "sage/check.h"
#include "sage/layout.h"
#include "sage/module_abi.h"
#include "sage/quant.h"

SAGE_DEFINE_MODULE_ABI("layout_probe target=cpu")

SAGE_EXPORT int64_t sage_qk8_offset(int64_t heads, int64_t dim, int64_t s_pad, int64_t b, int64_t s,
                                    int64_t h, int64_t d) {
  return sage::qk8_offset(heads, dim, s_pad, b, s, h, d);
}
SAGE_EXPORT int64_t sage_qk_scale_offset(int64_t head, int64_t s_pad, int64_t s) {
  return sage::qk_scale_offset(head, s_pad, s);
}
SAGE_EXPORT int64_t sage_qk_scale_offset_rows(int64_t head, int64_t s_pad, int64_t s,
                                              int64_t rows) {
  return sage::qk_scale_offset(head, s_pad, s, rows);
}
SAGE_EXPORT int64_t sage_scale_blocks(int64_t padded, int64_t rows) {
  return sage::scale_blocks(padded, rows);
}
// The Q-scale helpers of a SageParams whose q_scale_rows field holds `field` (0, 32 or 16).
SAGE_EXPORT int sage_q_scale_rows(int field) {
  SageParams p{};
  p.q_scale_rows = field;
  return sage::q_scale_rows(p);
}
SAGE_EXPORT int64_t sage_q_scale_blocks(int field, int64_t q_len_pad) {
  SageParams p{};
  p.q_scale_rows = field;
  p.q_len_pad = int32_t(q_len_pad);
  return sage::q_scale_blocks(p);
}
SAGE_EXPORT int64_t sage_q_scale_offset(int field, int64_t q_len_pad, int64_t head, int64_t s) {
  SageParams p{};
  p.q_scale_rows = field;
  p.q_len_pad = int32_t(q_len_pad);
  return sage::q_scale_offset(p, head, s);
}
SAGE_EXPORT int64_t sage_v8_offset(int64_t head, int64_t dim, int64_t s_pad, int64_t d, int64_t s) {
  return sage::v8_offset(head, dim, s_pad, d, s);
}
SAGE_EXPORT int64_t sage_channel_offset(int64_t head, int64_t dim, int64_t d) {
  return sage::channel_offset(head, dim, d);
}
SAGE_EXPORT int64_t sage_v_amax_part_offset(int64_t head, int64_t dim, int64_t split, int64_t d) {
  return sage::v_amax_part_offset(head, dim, split, d);
}
SAGE_EXPORT int64_t sage_v_amax_split_keys(int64_t kv_len, int64_t step) {
  return sage::v_amax_split_keys(kv_len, step);
}
SAGE_EXPORT int sage_v_amax_splits() { return SAGE_V_AMAX_SPLITS; }
SAGE_EXPORT int sage_v_scale_workgroups(int smooth_k) { return sage::v_scale_workgroups(smooth_k); }
SAGE_EXPORT int sage_v_scale_split(int z, int smooth_k) { return sage::v_scale_split(z, smooth_k); }
SAGE_EXPORT int sage_k_mean_slices() { return SAGE_K_MEAN_SLICES; }
SAGE_EXPORT int sage_padded_head_dim(int d) { return sage::padded_head_dim(d); }
SAGE_EXPORT int64_t sage_padded_len(int64_t n) { return sage::padded_len(n); }
SAGE_EXPORT uint8_t sage_e4m3(float x) { return sage::f32_to_e4m3_sat(x); }
SAGE_EXPORT float sage_e4m3_decode(uint8_t b) { return sage::e4m3_to_f32(b); }
SAGE_EXPORT int8_t sage_quant_i8(float x, float s) { return sage::quant_i8(x, s); }
SAGE_EXPORT uint8_t sage_quant_v(float x, float s) { return sage::quant_v(x, s); }
// A block's int8 scale from its |x| maximum, as prepare takes it.
static float block_scale_of(const float* xb, int64_t block) {
  float amax = 0.0f;
  for (int64_t i = 0; i < block; ++i) amax = sage::nan_max(amax, __builtin_fabsf(xb[i]));
  return sage::int8_block_scale(amax);
}
// quant_i8_normal against quant_i8 over n_blocks blocks of `block` values (block_scale_of);
// blocks whose scale is not normal do not use the fast form and are not compared. Returns the
// mismatches; *compared counts the values compared.
SAGE_EXPORT int64_t sage_quant_i8_normal_mismatches(const float* x, int64_t n_blocks, int64_t block,
                                                    int64_t* compared) {
  int64_t bad = 0;
  *compared = 0;
  for (int64_t blk = 0; blk < n_blocks; ++blk) {
    const float* xb = x + blk * block;
    const float scale = block_scale_of(xb, block);
    if (!sage::int8_scale_is_normal(scale)) continue;
    for (int64_t i = 0; i < block; ++i)
      bad += sage::quant_i8_normal(xb[i], scale) != sage::quant_i8(xb[i], scale);
    *compared += block;
  }
  return bad;
}
// quant_i8_recip (with its quant_i8_normal fallback where unsure, as the cuda qk kernel does)
// against quant_i8, over blocks like sage_quant_i8_normal_mismatches' whose scale is also
// int8_recip_ok. *compared counts the values compared, *unsure those that fell back.
SAGE_EXPORT int64_t sage_quant_i8_recip_mismatches(const float* x, int64_t n_blocks, int64_t block,
                                                   int64_t* compared, int64_t* unsure) {
  int64_t bad = 0;
  *compared = *unsure = 0;
  for (int64_t blk = 0; blk < n_blocks; ++blk) {
    const float* xb = x + blk * block;
    const float scale = block_scale_of(xb, block);
    if (!sage::int8_scale_is_normal(scale) || !sage::int8_recip_ok(scale)) continue;
    const float recip = 1.0f / scale;
    for (int64_t i = 0; i < block; ++i) {
      bool u = false;
      int8_t code = sage::quant_i8_recip(xb[i], recip, u);
      if (u) code = sage::quant_i8_normal(xb[i], scale);
      *unsure += u;
      bad += code != sage::quant_i8(xb[i], scale);
    }
    *compared += block;
  }
  return bad;
}
// quant_v_recip (with its quant_v fallback where unsure, as the cuda v_quant kernel does)
// against quant_v over every finite 16-bit value of `dtype` (SageDtype) up to each channel
// maximum amaxes[j] (the kernel's domain; scale v_channel_scale(amax), 1/s correctly rounded);
// channels whose scale is not v_recip_ok are skipped. *compared counts the values compared,
// *unsure those that fell back.
SAGE_EXPORT int64_t sage_quant_v_recip_mismatches(const float* amaxes, int64_t n, int dtype,
                                                  int64_t* compared, int64_t* unsure) {
  int64_t bad = 0;
  *compared = *unsure = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float amax = amaxes[j], scale = sage::v_channel_scale(amax);
    if (!sage::v_recip_ok(scale)) continue;
    const float recip = 1.0f / scale;
    for (uint32_t h = 0; h < 0x10000u; ++h) {
      const float v = sage::half_to_f32(uint16_t(h), dtype);
      if (!(__builtin_fabsf(v) <= amax)) continue;  // NaN and inf too
      bool u = false;
      sage_fp8_t code = sage::quant_v_recip(v, scale, recip, u);
      if (u) code = sage::quant_v(v, scale);
      *unsure += u;
      bad += code != sage::quant_v(v, scale);
      ++*compared;
    }
  }
  return bad;
}
SAGE_EXPORT uint16_t sage_f32_to_bf16(float x) { return sage::f32_to_bf16(x); }
SAGE_EXPORT uint16_t sage_f32_to_fp16(float x) { return sage::f32_to_fp16(x); }
SAGE_EXPORT float sage_fp16_to_f32(uint16_t h) { return sage::fp16_to_f32(h); }
SAGE_EXPORT float sage_rms_sum_squares(const float* x, int head_dim) {
  return sage::rms_sum_squares(x, head_dim);
}
// check_problem (check.h) on a valid one-block problem whose q_scale_rows field holds `field`:
// 1 if refused (the message: sage_module_last_error), 0 if accepted.
SAGE_EXPORT int sage_problem_refuses_q_scale_rows(int field) {
  SageParams p{};
  p.batch = p.heads_q = p.heads_kv = 1;
  p.head_dim = p.head_dim_pad = SAGE_HEAD_DIM_LARGE;
  p.q_len = p.kv_len = p.q_len_pad = p.kv_len_pad = SAGE_SEQ_ALIGN;
  p.q_scale_rows = field;
  static char buffer[16];
  p.q8 = p.k8 = reinterpret_cast<int8_t*>(buffer);
  p.q_scale = p.k_scale = p.v_scale = reinterpret_cast<float*>(buffer);
  p.v8 = reinterpret_cast<sage_fp8_t*>(buffer);
  return sage::check_problem(&p, "probe") ? 0 : 1;
}
// check_features of a backend with only contract v1 (kV1Features) on a launch that asks for
// one feature: 1 if refused (the message: sage_module_last_error), 0 if accepted.
SAGE_EXPORT int sage_v1_refuses(int prepare, int head_dim_pad, int fp16, int heads_q, int heads_kv,
                                int causal, int lse, int smooth_k, int pv16, int q_scale_rows) {
  SageParams p{};
  p.head_dim_pad = head_dim_pad;
  p.in_dtype = p.out_dtype = fp16 ? SAGE_DTYPE_FP16 : SAGE_DTYPE_BF16;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.mask = causal ? SAGE_MASK_CAUSAL : SAGE_MASK_NONE;
  float dummy = 0.0f;
  p.lse = lse ? &dummy : nullptr;
  p.smooth_k = smooth_k;
  p.lse_corr = smooth_k ? &dummy : nullptr;
  p.pv_dtype = pv16 ? SAGE_PV_FP16 : SAGE_PV_FP8;
  p.q_scale_rows = q_scale_rows;
  const auto launch = prepare ? sage::Launch::kPrepare : sage::Launch::kAttention;
  return sage::check_features(&p, launch, sage::kV1Features, "v1") ? 0 : 1;
}
