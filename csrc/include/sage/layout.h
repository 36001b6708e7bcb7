// aiter_sage: index math of the prepared tensors, in one place. Host- and device-usable;
// tested on the host (op_tests/ops/test_layout.py through a probe module, and by every backend's
// bit-exact prepare test). The layouts are upstream ROCm aiter's, with the head dim D
// (SageParams::head_dim_pad: 64 or 128) and the head counts (heads_q for Q and the output,
// heads_kv for K and V) as parameters.
#pragma once
#include "sage/params.h"
#include "sage/platform.h"

namespace sage {

// The 16-bit elements behind SageParams' void* data pointers (in_dtype / out_dtype say which
// format they hold).
SAGE_HD const uint16_t* halves(const void* p) { return static_cast<const uint16_t*>(p); }
SAGE_HD uint16_t* halves(void* p) { return static_cast<uint16_t*>(p); }

SAGE_HD constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
SAGE_HD constexpr int64_t padded_len(int64_t len) { return round_up(len, SAGE_SEQ_ALIGN); }
// Scales along a padded sequence axis of `rows` rows each (K: always SAGE_SCALE_BLOCK; Q:
// q_scale_rows(p), 32 or 16).
SAGE_HD constexpr int64_t scale_blocks(int64_t padded, int64_t rows = SAGE_SCALE_BLOCK) {
  return padded / rows;
}
// The kernel head dim that serves `head_dim` channels (prepare zero-pads the rest).
SAGE_HD constexpr int padded_head_dim(int head_dim) {
  return head_dim <= SAGE_HEAD_DIM_SMALL ? SAGE_HEAD_DIM_SMALL : SAGE_HEAD_DIM_LARGE;
}
SAGE_HD constexpr bool head_dim_supported(int head_dim) {
  return head_dim >= SAGE_HEAD_DIM_ALIGN && head_dim <= SAGE_MAX_HEAD_DIM &&
         head_dim % SAGE_HEAD_DIM_ALIGN == 0;
}

// (b, h) -> linear head index among `heads` heads (scales and transposed V are head-major).
SAGE_HD constexpr int64_t head_index(int64_t heads, int64_t b, int64_t h) { return b * heads + h; }
// Query heads per key/value head (GQA group size; 1 without GQA).
SAGE_HD constexpr int group_size(const SageParams& p) { return p.heads_q / p.heads_kv; }
// The key/value head that query head hq reads (torch's enable_gqa: repeat_interleave).
SAGE_HD constexpr int kv_head_of(const SageParams& p, int hq) { return hq / group_size(p); }
// INT8 Q/K: [B, S_pad, H, D]. Consecutive rows of one head are `qk8_row_stride` apart.
SAGE_HD constexpr int64_t qk8_row_stride(int64_t heads, int64_t dim) { return heads * dim; }
// Element offset of (b, s, h, d).
SAGE_HD constexpr int64_t qk8_offset(int64_t heads, int64_t dim, int64_t s_pad, int64_t b,
                                     int64_t s, int64_t h, int64_t d) {
  return ((b * s_pad + s) * heads + h) * dim + d;
}
// Q/K scales: [B, H, S_pad / rows]; offset of the scale of row s of linear head `head`.
SAGE_HD constexpr int64_t qk_scale_offset(int64_t head, int64_t s_pad, int64_t s,
                                          int64_t rows = SAGE_SCALE_BLOCK) {
  return head * scale_blocks(s_pad, rows) + s / rows;
}
// Query rows per Q scale of a call: SageParams::q_scale_rows, 0 meaning SAGE_SCALE_BLOCK
// (check_params admits only 0, 32 and 16).
SAGE_HD constexpr int q_scale_rows(const SageParams& p) {
  return p.q_scale_rows == SAGE_Q_SCALE_ROWS_FINE ? SAGE_Q_SCALE_ROWS_FINE : SAGE_SCALE_BLOCK;
}
// The Q scales of `p`, per linear query head: [B, heads_q, q_len_pad / q_scale_rows(p)].
SAGE_HD constexpr int64_t q_scale_blocks(const SageParams& p) {
  return scale_blocks(p.q_len_pad, q_scale_rows(p));
}
// Offset of the Q scale of row s of linear query head `head`. One branch per granularity, so
// each division is by a constant (a shift) on a GPU.
SAGE_HD constexpr int64_t q_scale_offset(const SageParams& p, int64_t head, int64_t s) {
  return q_scale_rows(p) == SAGE_Q_SCALE_ROWS_FINE
             ? qk_scale_offset(head, p.q_len_pad, s, SAGE_Q_SCALE_ROWS_FINE)
             : qk_scale_offset(head, p.q_len_pad, s, SAGE_SCALE_BLOCK);
}
// FP8 V transposed: [B, H, D, S_pad]; offset of (linear head, channel d, key s).
SAGE_HD constexpr int64_t v8_offset(int64_t head, int64_t dim, int64_t s_pad, int64_t d,
                                    int64_t s) {
  return (head * dim + d) * s_pad + s;
}
// Per-channel vectors of a key/value head — V scales and the K mean: [B, H, D].
SAGE_HD constexpr int64_t channel_offset(int64_t head, int64_t dim, int64_t d) {
  return head * dim + d;
}
// V amax partials (GPU prepare scratch): [B, heads_kv, SAGE_V_AMAX_SPLITS, D]; offset of
// (linear kv head, split, channel d).
SAGE_HD constexpr int64_t v_amax_part_offset(int64_t head, int64_t dim, int64_t split, int64_t d) {
  return (head * SAGE_V_AMAX_SPLITS + split) * dim + d;
}
// The v_scale kernel's grid z: SAGE_V_AMAX_SPLITS key ranges of V and, with smooth_k, the K
// mean's SAGE_K_MEAN_SLICES channel slices first (z < slices: dispatched first, so the longest
// streams of the kernel start at once). v_scale_split(z): the V key range of grid z, or < 0
// for a K mean slice (its slice is z).
SAGE_HD constexpr int v_scale_workgroups(bool smooth_k) {
  return SAGE_V_AMAX_SPLITS + (smooth_k ? SAGE_K_MEAN_SLICES : 0);
}
SAGE_HD constexpr int v_scale_split(int z, bool smooth_k) {
  return smooth_k ? z - SAGE_K_MEAN_SLICES : z;
}
// Keys per split: kv_len over SAGE_V_AMAX_SPLITS, rounded up to `step` (the keys one pass of
// the kernel covers). Split i covers [i * keys, min((i + 1) * keys, kv_len)); late splits of a
// short sequence cover nothing.
SAGE_HD constexpr int64_t v_amax_split_keys(int64_t kv_len, int64_t step) {
  return round_up((kv_len + SAGE_V_AMAX_SPLITS - 1) / SAGE_V_AMAX_SPLITS, step);
}
// K smoothing's LSE term: [B, heads_q, q_len_pad]; offset of row s of linear query head `head`.
SAGE_HD constexpr int64_t lse_corr_offset(int64_t head, int64_t s_pad, int64_t s) {
  return head * s_pad + s;
}
// [B, S, H, D] inputs and outputs with arbitrary b/s/h strides (elements).
SAGE_HD constexpr int64_t bshd_offset(int64_t sb, int64_t ss, int64_t sh, int64_t b, int64_t s,
                                      int64_t h) {
  return b * sb + s * ss + h * sh;
}
// LSE: [B, heads_q, out_rows] with b/h strides, rows contiguous.
SAGE_HD constexpr int64_t lse_offset(const SageParams& p, int64_t b, int64_t h, int64_t s) {
  return b * p.lse_stride_b + h * p.lse_stride_h + s;
}

// Entry b's real query rows and keys (SageParams::q_lens / kv_lens; null: the full lengths),
// clamped to [0, q_len] / [0, kv_len] so that a bad device value cannot reach past the
// tensors (nobody on a GPU can report it).
SAGE_HD constexpr int32_t clamp_len(int32_t n, int32_t full) {
  return n < 0 ? 0 : (n > full ? full : n);
}
SAGE_HD constexpr int32_t entry_q_len(const SageParams& p, int64_t b) {
  return p.q_lens ? clamp_len(p.q_lens[b], p.q_len) : p.q_len;
}
SAGE_HD constexpr int32_t entry_kv_len(const SageParams& p, int64_t b) {
  return p.kv_lens ? clamp_len(p.kv_lens[b], p.kv_len) : p.kv_len;
}

// Causal masking (top-left aligned): the keys query row `row` sees are [0, keys_seen).
SAGE_HD constexpr int64_t causal_keys_seen(int64_t row, int64_t kv_len) {
  return row + 1 < kv_len ? row + 1 : kv_len;
}
// Keys that any of the query rows [row0, row0 + rows) of an entry with kv_len keys sees: a KV
// tile starting at or beyond this is fully masked for the whole block and is skipped.
SAGE_HD constexpr int64_t keys_for_rows(const SageParams& p, int64_t row0, int64_t rows,
                                        int64_t kv_len) {
  return p.mask == SAGE_MASK_CAUSAL ? causal_keys_seen(row0 + rows - 1, kv_len) : kv_len;
}
SAGE_HD constexpr int64_t keys_for_rows(const SageParams& p, int64_t row0, int64_t rows) {
  return keys_for_rows(p, row0, rows, p.kv_len);
}

}  // namespace sage
