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
// 3: contract v2: head dim (64 / 128 kernels, other D <= 128 zero-padded), heads_q/heads_kv
//    (GQA/MQA), input/output dtype (BF16/FP16), mask mode (causal), LSE output, K smoothing.
// 4: the P.V mode (pv_dtype: FP8 or FP16 operands) and the FP16 prepared V (v16).
// 6: sage_prepare_run / sage_attention_run (the launches without the validation the binding
//    has already done) and sage_module_check_count.
// 7: per-entry lengths q_lens / kv_lens (key-padding masks, varlen as padded batches).
// 8: q_scale_rows (16-row Q scales). It fills the 4 bytes of padding after q_prescale, so
//    every other field keeps its offset and the struct its size.
#define SAGE_ABI_VERSION 8

// Head dims the kernels are built for (SageParams::head_dim_pad); any head_dim <= the largest
// that is a multiple of SAGE_HEAD_DIM_ALIGN is zero-padded by prepare to the next of these.
#define SAGE_HEAD_DIM_SMALL 64
#define SAGE_HEAD_DIM_LARGE 128
#define SAGE_MAX_HEAD_DIM SAGE_HEAD_DIM_LARGE
// Input rows are read in 16-byte pieces (8 16-bit channels).
#define SAGE_HEAD_DIM_ALIGN 8
// Rows of Q (or K) that share one FP32 quantization scale.
#define SAGE_SCALE_BLOCK 32
// SageParams::q_scale_rows of the opt-in fine Q granularity: one Q scale per 16 query rows
// (K keeps SAGE_SCALE_BLOCK). Half a scale block, so a 32-row Q block holds two of them.
#define SAGE_Q_SCALE_ROWS_FINE 16
// Prepared sequence axes are padded to a multiple of this (upstream's layout): one scale
// block. Kernels with larger tiles bound-check against the padded length.
#define SAGE_SEQ_ALIGN 32
// Key ranges ("splits") of a kv head over which the GPU prepare takes V's per-channel |max|
// in parallel (v_amax_part): one workgroup per head left most of a GPU idle.
#define SAGE_V_AMAX_SPLITS 16
// Workgroups per kv head of the GPU prepare's K mean (smooth_k), each a slice of the head's
// channels: the mean's pinned order leaves 32 sequential sums per channel, so one workgroup per
// head kept the whole head's stream of K on one SM (simt/prepare_layout.h km_slice_lanes).
#define SAGE_K_MEAN_SLICES 4
// Longest sequence: keeps every per-head offset of the prepared tensors (128 * S_pad bytes
// of transposed V) inside 32 bits, which the gfx12 kernels' lane offsets rely on.
#define SAGE_MAX_SEQ_LEN (1 << 24)
// Batch and head counts: grid dimensions of the GPU launches.
#define SAGE_MAX_GRID_DIM 65535

typedef uint16_t sage_bf16_t;  // raw BF16 bits
typedef uint16_t sage_fp16_t;  // raw IEEE binary16 bits
typedef uint8_t sage_fp8_t;    // raw OCP e4m3fn bits

// 16-bit floating-point formats of the inputs (q, k, v, norm weights) and of the output.
enum SageDtype { SAGE_DTYPE_BF16 = 0, SAGE_DTYPE_FP16 = 1 };
// Which keys a query sees. CAUSAL: query i sees keys j <= i (top-left aligned, as
// torch.nn.functional.scaled_dot_product_attention(is_causal=True), also when q_len != kv_len).
enum SageMask { SAGE_MASK_NONE = 0, SAGE_MASK_CAUSAL = 1 };
// Operand format of P.V (FP32 accumulation either way). FP8: V as e4m3 codes (v8), P rounded
// to e4m3 on the GPU. FP16: V as IEEE binary16 codes fp16(v / v_scale) (v16), P rounded to
// FP16 on the GPU. The V channel scale v_scale = amax * float32(1/448) is the same in both.
enum SagePvDtype { SAGE_PV_FP8 = 0, SAGE_PV_FP16 = 1 };

typedef struct SageParams {
  // ---- problem size ----
  int32_t batch;
  int32_t heads_q;       // query heads (and output heads)
  int32_t heads_kv;      // key/value heads; heads_q is a multiple (GQA/MQA: query head h reads
                         // key/value head h / (heads_q / heads_kv))
  int32_t head_dim;      // channels of q, k, v and the output: a multiple of 8, <= 128
  int32_t head_dim_pad;  // channels of the prepared tensors: 64 or 128 (the kernel variant);
                         // channels >= head_dim are zero
  int32_t q_len;         // real query rows
  int32_t kv_len;        // real key/value rows
  int32_t q_len_pad;     // rows of the prepared Q tensors: a multiple of SAGE_SEQ_ALIGN >= q_len
  int32_t kv_len_pad;    // rows of the prepared K/V tensors: same rule for kv_len
  int32_t in_dtype;      // SageDtype of q, k, v and the norm weights (prepare)
  int32_t out_dtype;     // SageDtype of out (attention)
  int32_t mask;          // SageMask (attention)
  int32_t smooth_k;      // prepare: quantize K minus its per-channel mean over the keys (k_mean)
  int32_t pv_dtype;      // SagePvDtype: which prepared V prepare writes / attention reads
  // float32(softmax_scale * log2 e) with the product formed in double on the host (upstream's
  // rounding); Q is multiplied by it before quantization so the kernels use exp2.
  float q_prescale;
  // Query rows per Q scale (prepare writes, attention reads q_scale at this granularity):
  // 0 or SAGE_SCALE_BLOCK (32) = upstream's one scale per 32-row block, the default (a
  // zero-initialised SageParams keeps it); SAGE_Q_SCALE_ROWS_FINE (16) = one per 16 rows,
  // q_scale [B, heads_q, q_len_pad / 16]. Any other value is refused (check.h). K scales are
  // per 32 keys either way. Read it through layout.h q_scale_rows().
  int32_t q_scale_rows;
  // Per-entry lengths, int32 [batch] in the tensors' memory (null: q_len / kv_len for every
  // entry). Entry b has q_lens[b] real query rows and kv_lens[b] real keys; the rows and keys
  // past them are padding whatever the inputs hold there. Prepare gives them zero codes and
  // keeps them out of every scale, the K mean and lse_corr; attention lets entry b's rows see
  // its first kv_lens[b] keys only (tiles past them are not computed), writes its rows at or
  // past q_lens[b] as zero with LSE -inf, and gives NaN rows (LSE -inf) where kv_lens[b] == 0.
  // Values are clamped to [0, q_len] / [0, kv_len] where read (layout.h entry_q_len): the
  // binding checks host tensors, but a GPU cannot report a bad device value.
  const int32_t* q_lens;
  const int32_t* kv_lens;

  // ---- prepare inputs: in_dtype [B, S, H, head_dim], last dim contiguous, strides in
  //      elements; q has heads_q heads, k and v heads_kv ----
  const void* q;
  const void* k;
  const void* v;
  int64_t q_stride_b, q_stride_s, q_stride_h;
  int64_t k_stride_b, k_stride_s, k_stride_h;
  int64_t v_stride_b, v_stride_s, v_stride_h;

  // ---- optional fused QK RMSNorm (weights in_dtype [head_dim]; both null = off) ----
  const void* q_norm_weight;
  const void* k_norm_weight;
  float norm_eps;
  // ---- optional rotate-half RoPE on channels [0, rope_dim): cos/sin FP32 [q_len, rope_dim],
  //      row stride rope_stride_s (elements); null = off. Applied to Q and K (q_len == kv_len).
  const float* rope_cos;
  const float* rope_sin;
  int32_t rope_dim;
  int64_t rope_stride_s;

  // ---- prepared tensors (contiguous; see layout.h). D = head_dim_pad ----
  int8_t* q8;        // [B, q_len_pad, heads_q, D]
  float* q_scale;    // [B, heads_q, q_len_pad / q_scale_rows (32 or 16)]
  int8_t* k8;        // [B, kv_len_pad, heads_kv, D]
  float* k_scale;    // [B, heads_kv, kv_len_pad / 32]
  sage_fp8_t* v8;    // [B, heads_kv, D, kv_len_pad]  (V transposed; pv_dtype FP8, else null)
  sage_fp16_t* v16;  // same layout, FP16 codes (pv_dtype FP16, else null); offsets: v8_offset
  float* v_scale;    // [B, heads_kv, D]
  // GPU prepare scratch, FP32 [B, heads_kv, SAGE_V_AMAX_SPLITS, D] (layout.h
  // v_amax_part_offset): each key range's per-channel |V| maximum, folded into v_scale by
  // the V quantize kernel. Host backends ignore it (may be null there).
  float* v_amax_part;
  // K smoothing (prepare, smooth_k; both null otherwise):
  //  k_mean   [B, heads_kv, D] FP32 mean of K over the real keys (after norm/RoPE); K is
  //           quantized minus it.
  //  lse_corr [B, heads_q, q_len_pad] FP32: sum_c Q'[row][c] * k_mean[kv head][c], Q' the
  //           scaled FP32 query before quantization (log2 units; 0 for padded rows): the term
  //           the smoothing took out of every score of the row.
  // Attention reads lse_corr when non-null and adds it to the LSE, which is then that of the
  // unsmoothed scores.
  float* k_mean;
  float* lse_corr;

  // ---- attention output: out_dtype [B, out_rows, heads_q, head_dim], last dim contiguous.
  //      Rows < q_len hold the attention, rows in [q_len, out_rows) are zero
  //      (out_rows <= q_len_pad). ----
  void* out;
  int32_t out_rows;
  int64_t out_stride_b, out_stride_s, out_stride_h;
  // ---- optional log-sum-exp, FP32 [B, heads_q, out_rows] (natural log of the sum of
  //      exp(softmax_scale * q.k) over the keys a row sees); rows >= q_len get -inf. Null: off.
  float* lse;
  int64_t lse_stride_b, lse_stride_h;

  // ---- host backends only: worker threads (<= 0: all hardware threads) ----
  int32_t num_threads;
} SageParams;

// Every kernel module exports these. Launch functions return 0 on success; otherwise
// sage_module_last_error() describes the failure (thread-local).
typedef int (*sage_abi_version_fn)(void);
typedef const char* (*sage_module_info_fn)(void);
typedef int (*sage_launch_fn)(const SageParams* params, void* stream);
typedef const char* (*sage_last_error_fn)(void);
typedef long long (*sage_check_count_fn)(void);

#ifdef __cplusplus
}  // extern "C"
#endif
