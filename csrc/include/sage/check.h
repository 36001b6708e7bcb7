// aiter_sage: the one validation of a SageParams. The torch binding runs it once per op call, on
// the params it filled, before it allocates (and, with placeholder pointers, in the fake
// implementations), then calls the modules' *_run functions. Every module's C ABI launch
// (sage_prepare_launch / sage_attention_launch, for callers other than the binding) runs the
// same function first, so a bad value gets the same message whichever way it arrives. The
// binding itself checks only what is torch's business: dtypes, ranks, shapes, devices, strides.
// Host-only: empty in a hiprtc device build.
#pragma once
#if !defined(SAGE_HIPRTC)
#include "sage/layout.h"
#include "sage/module_abi.h"
#include "sage/params.h"
#include "sage/quant.h"

namespace sage {

enum class Launch { kPrepare, kAttention };

// Checks shared by both launches; returns false with the module error set.
inline bool check_problem(const SageParams* p, const char* what) {
  if (!p) return !set_error("%s: null SageParams", what);
  if (p->batch < 1 || p->heads_q < 1 || p->heads_kv < 1 || p->q_len < 1 || p->kv_len < 1)
    return !set_error("%s: empty problem (batch=%d heads_q=%d heads_kv=%d q_len=%d kv_len=%d)",
                      what, p->batch, p->heads_q, p->heads_kv, p->q_len, p->kv_len);
  if (p->batch > SAGE_MAX_GRID_DIM || p->heads_q > SAGE_MAX_GRID_DIM)
    return !set_error("%s: batch and heads must be <= %d (got batch=%d heads=%d)", what,
                      SAGE_MAX_GRID_DIM, p->batch, p->heads_q);
  if (p->heads_q % p->heads_kv != 0)
    return !set_error(
        "%s: the query heads (%d) must be a multiple of the key/value heads (%d) for "
        "grouped-query attention",
        what, p->heads_q, p->heads_kv);
  if (!head_dim_supported(p->head_dim))
    return !set_error("%s: head dim %d is not supported: it must be a multiple of %d and <= %d",
                      what, p->head_dim, SAGE_HEAD_DIM_ALIGN, SAGE_MAX_HEAD_DIM);
  if (p->head_dim_pad != padded_head_dim(p->head_dim))
    return !set_error("%s: head_dim_pad %d must be %d for head dim %d", what, p->head_dim_pad,
                      padded_head_dim(p->head_dim), p->head_dim);
  if (p->q_len > SAGE_MAX_SEQ_LEN || p->kv_len > SAGE_MAX_SEQ_LEN)
    return !set_error("%s: sequence lengths must be <= %d (got q_len=%d kv_len=%d)", what,
                      SAGE_MAX_SEQ_LEN, p->q_len, p->kv_len);
  if (p->q_len_pad < p->q_len || p->q_len_pad % SAGE_SEQ_ALIGN != 0 || p->kv_len_pad < p->kv_len ||
      p->kv_len_pad % SAGE_SEQ_ALIGN != 0 || p->q_len_pad > padded_len(SAGE_MAX_SEQ_LEN) ||
      p->kv_len_pad > padded_len(SAGE_MAX_SEQ_LEN))
    return !set_error(
        "%s: q_len_pad/kv_len_pad (%d/%d) must be multiples of %d covering "
        "q_len/kv_len (%d/%d)",
        what, p->q_len_pad, p->kv_len_pad, SAGE_SEQ_ALIGN, p->q_len, p->kv_len);
  if (p->pv_dtype != SAGE_PV_FP8 && p->pv_dtype != SAGE_PV_FP16)
    return !set_error("%s: unknown P.V mode %d (0: fp8, 1: fp16)", what, p->pv_dtype);
  if (p->q_scale_rows != 0 && p->q_scale_rows != SAGE_SCALE_BLOCK &&
      p->q_scale_rows != SAGE_Q_SCALE_ROWS_FINE)
    return !set_error("%s: q_scale_rows must be %d or %d (0: %d), got %d", what, SAGE_SCALE_BLOCK,
                      SAGE_Q_SCALE_ROWS_FINE, SAGE_SCALE_BLOCK, p->q_scale_rows);
  const bool v_ok = p->pv_dtype == SAGE_PV_FP16 ? p->v16 != nullptr : p->v8 != nullptr;
  if (!p->q8 || !p->q_scale || !p->k8 || !p->k_scale || !v_ok || !p->v_scale)
    return !set_error("%s: null prepared tensor pointer", what);
  // The lengths themselves may live in GPU memory, which a host check cannot read: the binding
  // checks their values where they are on the host (check_entry_lengths), and the kernels
  // clamp them to [0, q_len] / [0, kv_len] (layout.h entry_q_len) whatever they hold.
  if (reinterpret_cast<uintptr_t>(p->q_lens) % alignof(int32_t) != 0 ||
      reinterpret_cast<uintptr_t>(p->kv_lens) % alignof(int32_t) != 0)
    return !set_error("%s: q_lens / kv_lens must point to aligned int32 values", what);
  return true;
}

// Per-entry lengths in host memory (SageParams::q_lens / kv_lens): `batch` values in [0, full].
inline bool check_entry_lengths(const int32_t* lens, int batch, int full, const char* name,
                                const char* what) {
  for (int b = 0; b < batch; ++b)
    if (lens[b] < 0 || lens[b] > full)
      return !set_error("%s: %s[%d] = %d lies outside [0, %d]", what, name, b, lens[b], full);
  return true;
}

inline bool dtype_supported(int dtype) {
  return dtype == SAGE_DTYPE_BF16 || dtype == SAGE_DTYPE_FP16;
}

inline bool check_prepare_params(const SageParams* p) {
  const char* what = "sage_prepare_launch";
  if (!check_problem(p, what)) return false;
  if (p->q_len_pad != padded_len(p->q_len) || p->kv_len_pad != padded_len(p->kv_len))
    return !set_error("%s: q_len_pad/kv_len_pad must be q_len/kv_len rounded up to %d", what,
                      SAGE_SEQ_ALIGN);
  if (!p->q || !p->k || !p->v) return !set_error("%s: null q/k/v input pointer", what);
  if (!dtype_supported(p->in_dtype))
    return !set_error("%s: input dtype code %d is neither BF16 nor FP16", what, p->in_dtype);
  if (!__builtin_isfinite(p->q_prescale))
    return !set_error("%s: the Q factor softmax_scale*log2(e) must be a finite float32", what);
  if (p->smooth_k != 0 && p->smooth_k != 1)
    return !set_error("%s: smooth_k must be 0 or 1, got %d", what, p->smooth_k);
  if (p->smooth_k && (!p->k_mean || !p->lse_corr))
    return !set_error("%s: smooth_k needs the k_mean and lse_corr output buffers", what);
  if (!p->q_norm_weight != !p->k_norm_weight)
    return !set_error("%s: q and k norm weights must be given together", what);
  if (p->q_norm_weight) {
    if (p->head_dim % kNormChannelsPerRound != 0)
      return !set_error("%s: QK RMSNorm needs a head dim that is a multiple of %d, got %d", what,
                        kNormChannelsPerRound, p->head_dim);
    if (!(__builtin_isfinite(p->norm_eps) && p->norm_eps >= 0.0f))
      return !set_error("%s: norm eps must be a finite float32 >= 0", what);
  }
  if (!p->rope_cos != !p->rope_sin) return !set_error("%s: cos and sin go together", what);
  if (p->rope_cos) {
    if (!rope_dim_supported(p->rope_dim, p->head_dim))
      return !set_error("%s: rope_dim %d must be a multiple of 32 and at most the head dim %d",
                        what, p->rope_dim, p->head_dim);
    if (p->q_len != p->kv_len)
      return !set_error("%s: RoPE needs q_len == kv_len (got %d and %d)", what, p->q_len,
                        p->kv_len);
  }
  return true;
}

inline bool check_attention_params(const SageParams* p) {
  const char* what = "sage_attention_launch";
  if (!check_problem(p, what)) return false;
  if (!p->out) return !set_error("%s: null output pointer", what);
  if (!dtype_supported(p->out_dtype))
    return !set_error("%s: output dtype code %d is neither BF16 nor FP16", what, p->out_dtype);
  if (p->mask != SAGE_MASK_NONE && p->mask != SAGE_MASK_CAUSAL)
    return !set_error("%s: unknown mask mode %d", what, p->mask);
  if (p->out_rows < p->q_len || p->out_rows > p->q_len_pad)
    return !set_error("%s: out_rows %d must lie in [q_len, q_len_pad] = [%d, %d]", what,
                      p->out_rows, p->q_len, p->q_len_pad);
  return true;
}

// The contract-v2 features a backend implements. A launch that asks for one its backend lacks
// is refused with a message naming it (a backend grows into the contract feature by feature).
struct Features {
  bool head_dim_small;  // head_dim_pad 64 (head dims <= 64)
  bool fp16;            // FP16 inputs / output
  bool gqa;             // heads_q != heads_kv
  bool causal;          // mask == SAGE_MASK_CAUSAL
  bool lse;             // an LSE output
  bool smooth_k;        // K smoothing (prepare) and its LSE correction (attention)
  bool pv_fp16;         // pv_dtype FP16: FP16 V (prepare) and FP16 P.V (attention)
  bool q_scale16;       // q_scale_rows 16: 16-row Q scales (prepare writes, attention reads)
};
constexpr Features kV1Features = {false, false, false, false, false, false, false, false};
constexpr Features kAllFeatures = {true, true, true, true, true, true, true, true};
// Every backend (cpu, gfx12 and its emulator, cuda) implements all of them today; a new one
// starts from kV1Features (op_tests/ops/test_layout.py checks the refusals).

inline bool check_features(const SageParams* p, Launch launch, Features f, const char* backend) {
  const char* what = launch == Launch::kPrepare ? "sage_prepare_launch" : "sage_attention_launch";
  const char* missing = nullptr;
  if (!f.head_dim_small && p->head_dim_pad == SAGE_HEAD_DIM_SMALL) missing = "head dims <= 64";
  const bool fp16 =
      launch == Launch::kPrepare ? p->in_dtype == SAGE_DTYPE_FP16 : p->out_dtype == SAGE_DTYPE_FP16;
  if (!f.fp16 && fp16) missing = "float16 tensors";
  if (!f.gqa && p->heads_q != p->heads_kv) missing = "grouped-query attention";
  if (!f.pv_fp16 && p->pv_dtype == SAGE_PV_FP16) missing = "pv_dtype=\"fp16\" (FP16 P.V)";
  if (!f.q_scale16 && q_scale_rows(*p) == SAGE_Q_SCALE_ROWS_FINE)
    missing = "q_scale_rows=16 (16-row Q scales)";
  if (launch == Launch::kAttention) {
    if (!f.causal && p->mask == SAGE_MASK_CAUSAL) missing = "causal attention";
    if (!f.lse && p->lse) missing = "return_lse";
    if (!f.smooth_k && p->lse_corr) missing = "the LSE of smoothed K";
  } else if (!f.smooth_k && p->smooth_k) {
    missing = "smooth_k";
  }
  if (missing)
    return !set_error("%s: the %s backend does not support %s yet", what, backend, missing);
  return true;
}

// The one entry point: what a launch of kind `launch` needs.
inline bool check_params(const SageParams* p, Launch launch) {
  check_calls().fetch_add(1, std::memory_order_relaxed);
  return launch == Launch::kPrepare ? check_prepare_params(p) : check_attention_params(p);
}

// One SageParams that serves a prepare launch and then an attention launch on its outputs (the
// torch binding's attention op fills both launches' fields before it allocates): both rule
// sets, as one validation.
inline bool check_prepare_then_attention(const SageParams* p) {
  check_calls().fetch_add(1, std::memory_order_relaxed);
  return check_prepare_params(p) && check_attention_params(p);
}

}  // namespace sage

// A module's C ABI launch `sage_<op>_launch`: check_params, then the module's own
// `sage_<op>_run` (declared before this, with the same signature). The torch binding calls
// *_run directly on params it has validated; any other caller of the C ABI gets the check.
#define SAGE_DEFINE_CHECKED_LAUNCH(OP, LAUNCH)                                 \
  SAGE_EXPORT int sage_##OP##_launch(const SageParams* params, void* stream) { \
    if (!sage::check_params(params, sage::Launch::LAUNCH)) return 1;           \
    return sage_##OP##_run(params, stream);                                    \
  }
#endif  // !SAGE_HIPRTC
