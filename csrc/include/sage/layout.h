// aiter_sage: index math of the prepared tensors, in one place. Host- and device-usable;
// tested on the host (op_tests/test_layout.py through a probe module, and by every backend's
// bit-exact prepare test). The layouts are upstream ROCm aiter's.
#pragma once
#include "sage/params.h"
#include "sage/platform.h"

namespace sage {

SAGE_HD constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
SAGE_HD constexpr int64_t padded_len(int64_t len) { return round_up(len, SAGE_SEQ_ALIGN); }
SAGE_HD constexpr int64_t scale_blocks(int64_t padded) { return padded / SAGE_SCALE_BLOCK; }

// (b, h) -> linear head index (scales and transposed V are head-major).
SAGE_HD constexpr int64_t head_index(const SageParams& p, int64_t b, int64_t h) {
  return b * p.heads + h;
}
// INT8 Q/K: [B, S_pad, H, 128]. Consecutive rows of one head are `qk8_row_stride` apart.
SAGE_HD constexpr int64_t qk8_row_stride(int64_t heads) { return heads * SAGE_HEAD_DIM; }
// Element offset of (b, s, h, d).
SAGE_HD constexpr int64_t qk8_offset(int64_t heads, int64_t s_pad, int64_t b, int64_t s, int64_t h,
                                     int64_t d) {
  return ((b * s_pad + s) * heads + h) * SAGE_HEAD_DIM + d;
}
// Q/K scales: [B, H, S_pad / 32]; offset of the scale of row s of linear head `head`.
SAGE_HD constexpr int64_t qk_scale_offset(int64_t head, int64_t s_pad, int64_t s) {
  return head * scale_blocks(s_pad) + s / SAGE_SCALE_BLOCK;
}
// FP8 V transposed: [B, H, 128, S_pad]; offset of (linear head, channel d, key s).
SAGE_HD constexpr int64_t v8_offset(int64_t head, int64_t s_pad, int64_t d, int64_t s) {
  return (head * SAGE_HEAD_DIM + d) * s_pad + s;
}
// V scales: [B, H, 128].
SAGE_HD constexpr int64_t v_scale_offset(int64_t head, int64_t d) {
  return head * SAGE_HEAD_DIM + d;
}
// BF16 [B, S, H, 128] with arbitrary b/s/h strides (elements).
SAGE_HD constexpr int64_t bshd_offset(int64_t sb, int64_t ss, int64_t sh, int64_t b, int64_t s,
                                      int64_t h) {
  return b * sb + s * ss + h * sh;
}

}  // namespace sage
