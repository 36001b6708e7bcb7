// aiter_sage: the one validation of a SageParams, called by every module's launch function
// (cpu, emu, gfx12) before any work. The torch binding checks tensors (dtype, shape, device)
// and fills the struct; these checks guard the C ABI itself, so a caller other than the
// binding gets the same clear errors. Host-only: empty in a hiprtc device build.
#pragma once
#if !defined(SAGE_HIPRTC)
#include "sage/layout.h"
#include "sage/module_abi.h"
#include "sage/params.h"
#include "sage/quant.h"

namespace sage {

// Checks shared by both launches; returns false with the module error set.
inline bool check_problem(const SageParams* p, const char* what) {
  if (!p) return !set_error("%s: null SageParams", what);
  if (p->batch < 1 || p->heads < 1 || p->q_len < 1 || p->kv_len < 1)
    return !set_error("%s: empty problem (batch=%d heads=%d q_len=%d kv_len=%d)", what, p->batch,
                      p->heads, p->q_len, p->kv_len);
  if (p->batch > 65535 || p->heads > 65535)
    return !set_error("%s: batch and heads must be <= 65535 (got %d and %d)", what, p->batch,
                      p->heads);
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
  if (!p->q8 || !p->q_scale || !p->k8 || !p->k_scale || !p->v8 || !p->v_scale)
    return !set_error("%s: null prepared tensor pointer", what);
  return true;
}

inline bool check_prepare_params(const SageParams* p) {
  const char* what = "sage_prepare_launch";
  if (!check_problem(p, what)) return false;
  if (p->q_len_pad != padded_len(p->q_len) || p->kv_len_pad != padded_len(p->kv_len))
    return !set_error("%s: q_len_pad/kv_len_pad must be q_len/kv_len rounded up to %d", what,
                      SAGE_SEQ_ALIGN);
  if (!p->q || !p->k || !p->v) return !set_error("%s: null q/k/v input pointer", what);
  if (!__builtin_isfinite(p->q_prescale))
    return !set_error("%s: the Q factor softmax_scale*log2(e) must be a finite float32", what);
  if (!p->q_norm_weight != !p->k_norm_weight)
    return !set_error("%s: q and k norm weights must be given together", what);
  if (p->q_norm_weight && !(__builtin_isfinite(p->norm_eps) && p->norm_eps >= 0.0f))
    return !set_error("%s: norm eps must be a finite float32 >= 0", what);
  if (!p->rope_cos != !p->rope_sin) return !set_error("%s: cos and sin go together", what);
  if (p->rope_cos) {
    if (!rope_dim_supported(p->rope_dim))
      return !set_error("%s: rope_dim %d is not 32, 64, 96 or 128", what, p->rope_dim);
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
  if (p->out_rows < p->q_len || p->out_rows > p->q_len_pad)
    return !set_error("%s: out_rows %d must lie in [q_len, q_len_pad] = [%d, %d]", what,
                      p->out_rows, p->q_len, p->q_len_pad);
  return true;
}

}  // namespace sage
#endif  // !SAGE_HIPRTC
