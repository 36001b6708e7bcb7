// aiter_sage: the one parameter block every module (cpu, emu, gfx12) receives, and the C ABI
// each kernel module exports. Plain C so that the torch binding, the emulator and device code
// agree on the layout without sharing any C++ type.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Bump whenever SageParams or the exported functions change: the binding refuses a module
// built against another version (a stale cached .so is rebuilt instead of misread).
#define SAGE_ABI_VERSION 1

// Fixed by the v1 op contract.
#define SAGE_HEAD_DIM 128
// Rows of Q (or K) that share one FP32 quantization scale.
#define SAGE_SCALE_BLOCK 32
// Prepared sequence axes are padded to a multiple of this, so kernels may use any KV/Q tile
// that divides it without bounds checks; padded rows are zero and padded keys are masked.
#define SAGE_SEQ_ALIGN 128

typedef uint16_t sage_bf16_t;  // raw BF16 bits
typedef uint8_t sage_fp8_t;    // raw OCP e4m3fn bits

typedef struct SageParams {
  // ---- problem size ----
  int32_t batch;
  int32_t heads;
  int32_t q_len;       // real query rows
  int32_t kv_len;      // real key/value rows
  int32_t q_len_pad;   // round_up(q_len, SAGE_SEQ_ALIGN)
  int32_t kv_len_pad;  // round_up(kv_len, SAGE_SEQ_ALIGN)
  float softmax_scale;

  // ---- prepare inputs: BF16 [B, S, H, 128], last dim contiguous, strides in elements ----
  const sage_bf16_t* q;
  const sage_bf16_t* k;
  const sage_bf16_t* v;
  int64_t q_stride_b, q_stride_s, q_stride_h;
  int64_t k_stride_b, k_stride_s, k_stride_h;
  int64_t v_stride_b, v_stride_s, v_stride_h;

  // ---- optional fused QK RMSNorm (weights BF16 [128]; both null = off) ----
  const sage_bf16_t* q_norm_weight;
  const sage_bf16_t* k_norm_weight;
  float norm_eps;
  // ---- optional rotate-half RoPE on channels [0, rope_dim): cos/sin BF16 [q_len, rope_dim],
  //      row stride rope_stride_s; null = off. Applied to Q and K (requires q_len == kv_len). ----
  const sage_bf16_t* rope_cos;
  const sage_bf16_t* rope_sin;
  int32_t rope_dim;
  int64_t rope_stride_s;

  // ---- prepared tensors (contiguous; see layout.h) ----
  int8_t* q8;          // [B, H, q_len_pad, 128]
  float* q_scale;      // [B, H, q_len_pad / 32]
  int8_t* k8;          // [B, H, kv_len_pad, 128]
  float* k_scale;      // [B, H, kv_len_pad / 32]
  sage_fp8_t* v8;      // [B, H, 128, kv_len_pad]  (V transposed)
  float* v_scale;      // [B, H, 128]

  // ---- attention output: BF16 [B, q_len, H, 128], last dim contiguous ----
  sage_bf16_t* out;
  int64_t out_stride_b, out_stride_s, out_stride_h;

  // ---- host backends only: worker threads (<= 0: all hardware threads) ----
  int32_t num_threads;
} SageParams;

// Every kernel module exports these. Launch functions return 0 on success; otherwise
// sage_module_last_error() describes the failure (thread-local).
typedef int (*sage_abi_version_fn)(void);
typedef const char* (*sage_module_info_fn)(void);
typedef int (*sage_launch_fn)(const SageParams* params, void* stream);
typedef const char* (*sage_last_error_fn)(void);

#ifdef __cplusplus
}  // extern "C"
#endif
