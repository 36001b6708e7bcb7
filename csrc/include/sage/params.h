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
// 2: upstream's prepared layouts (Q/K [B, S_pad, H, 128], S_pad a multiple of 32), FP32 RoPE
//    tables, the host-rounded Q factor, padded output rows.
#define SAGE_ABI_VERSION 2

// Fixed by the v1 op contract.
#define SAGE_HEAD_DIM 128
// Rows of Q (or K) that share one FP32 quantization scale.
#define SAGE_SCALE_BLOCK 32
// Prepared sequence axes are padded to a multiple of this (upstream's layout): one scale
// block. Kernels with larger tiles bound-check against the padded length.
#define SAGE_SEQ_ALIGN 32
// Longest sequence: keeps every per-head offset of the prepared tensors (128 * S_pad bytes
// of transposed V) inside 32 bits, which the gfx12 kernels' lane offsets rely on.
#define SAGE_MAX_SEQ_LEN (1 << 24)

typedef uint16_t sage_bf16_t;  // raw BF16 bits
typedef uint8_t sage_fp8_t;    // raw OCP e4m3fn bits

typedef struct SageParams {
  // ---- problem size ----
  int32_t batch;
  int32_t heads;
  int32_t q_len;       // real query rows
  int32_t kv_len;      // real key/value rows
  int32_t q_len_pad;   // rows of the prepared Q tensors: a multiple of SAGE_SEQ_ALIGN >= q_len
  int32_t kv_len_pad;  // rows of the prepared K/V tensors: same rule for kv_len
  // float32(softmax_scale * log2 e) with the product formed in double on the host (upstream's
  // rounding); Q is multiplied by it before quantization so the kernels use exp2.
  float q_prescale;

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
  // ---- optional rotate-half RoPE on channels [0, rope_dim): cos/sin FP32 [q_len, rope_dim],
  //      row stride rope_stride_s (elements); null = off. Applied to Q and K (q_len == kv_len).
  const float* rope_cos;
  const float* rope_sin;
  int32_t rope_dim;
  int64_t rope_stride_s;

  // ---- prepared tensors (contiguous; see layout.h) ----
  int8_t* q8;      // [B, q_len_pad, H, 128]
  float* q_scale;  // [B, H, q_len_pad / 32]
  int8_t* k8;      // [B, kv_len_pad, H, 128]
  float* k_scale;  // [B, H, kv_len_pad / 32]
  sage_fp8_t* v8;  // [B, H, 128, kv_len_pad]  (V transposed)
  float* v_scale;  // [B, H, 128]

  // ---- attention output: BF16 [B, out_rows, H, 128], last dim contiguous. Rows < q_len hold
  //      the attention, rows in [q_len, out_rows) are zero (out_rows <= q_len_pad). ----
  sage_bf16_t* out;
  int32_t out_rows;
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
