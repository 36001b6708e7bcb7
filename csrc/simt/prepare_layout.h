// aiter_sage: lane bookkeeping of the SIMT prepare (csrc/simt/prepare.hip, built for gfx12, for
// NVIDIA through csrc/cuda/prepare.cu and for the wave emulator): which lane holds which
// channels of a row, and the LDS tile V is transposed through. Pure integer functions, usable
// on host and device, unit-tested on the host by op_tests/backends/test_gfx12_layout.py. The
// namespace is the one prepare.hip's kernels live in.
#pragma once
#include "sage/arch/gfx12_wmma.h"  // kWaveSize: 32 lanes, a gfx12 wave and a CUDA warp
#include "sage/params.h"
#include "sage/platform.h"

namespace sage {
namespace gfx12 {

// ------------------------------------------------------------------ prepare: Q / K ------
// A row of head_dim_pad Dp channels is held by Dp / 8 lanes (16 for Dp 128, 8 for Dp 64):
// lane chunk c holds channels 8c .. 8c + 7 (one 16-byte load of 16-bit inputs), so the
// RMSNorm partial sums of the pinned order (quant.h) are per lane and the cross-lane steps are
// shfl_xor within the row's lanes. A 32-row block is handled by a 128-thread workgroup.
constexpr int kPrepChunk = SAGE_HEAD_DIM_ALIGN;  // 8 channels per lane
SAGE_HD constexpr int prep_lanes_per_row(int head_dim_pad) { return head_dim_pad / kPrepChunk; }
SAGE_HD constexpr int prep_chunk(int tid, int lanes = prep_lanes_per_row(SAGE_HEAD_DIM_LARGE)) {
  return tid % lanes;
}
SAGE_HD constexpr int prep_row(int tid, int pass, int threads,
                               int lanes = prep_lanes_per_row(SAGE_HEAD_DIM_LARGE)) {
  return tid / lanes + pass * (threads / lanes);
}
// The 16-row half (0 or 1) of its 32-row block that every row of pass `pass` lies in: with
// q_scale_rows 16 each half of a Q block has a scale of its own. A pass covers threads / lanes
// consecutive rows (8 at Dp 128, 16 at Dp 64), so no pass straddles the two halves.
SAGE_HD constexpr int prep_half(int pass, int threads,
                                int lanes = prep_lanes_per_row(SAGE_HEAD_DIM_LARGE)) {
  return pass * (threads / lanes) / SAGE_Q_SCALE_ROWS_FINE;
}
// The qk grid: each workgroup quantizes `per` consecutive 32-row scale blocks of one role
// (PrepTraits::qk_blocks_per_workgroup), so that its setup (head and length lookups, the group's
// integer divisions, row addresses: about a quarter of the plain kernel's instructions with one
// block, on an H100) is paid once for them. x < qk_q_workgroups: Q blocks x * per + rep of query
// head hq; beyond, the K blocks of key/value head hq / group dealt round robin to the group's
// query heads: block ((x - qk_q_workgroups) * per + rep) * group + hq % group. A block past
// the last is skipped.
SAGE_HD constexpr int qk_q_workgroups(int q_blocks, int per) { return (q_blocks + per - 1) / per; }
SAGE_HD constexpr int qk_workgroups(int q_blocks, int kv_blocks, int group, int per) {
  return qk_q_workgroups(q_blocks, per) + ((kv_blocks + group - 1) / group + per - 1) / per;
}
SAGE_HD constexpr int qk_block(int x, int hq, int rep, int q_blocks, int group, int per) {
  return x < qk_q_workgroups(q_blocks, per)
             ? x * per + rep
             : ((x - qk_q_workgroups(q_blocks, per)) * per + rep) * group + hq % group;
}
// RoPE partner chunk of chunk c (c < rope_dim / 8): channels c*8 +- rope_dim/2.
SAGE_HD constexpr int rope_partner_chunk(int c, int rope_dim) {
  return c < rope_dim / 16 ? c + rope_dim / 16 : c - rope_dim / 16;
}

// K mean (smooth_k): a head's Dp / 8 chunks over SAGE_K_MEAN_SLICES workgroups,
// km_slice_lanes lanes of a row each (4 at Dp 128: 64 bytes of a 16-bit row). Thread tid of
// slice z adds chunk km_chunk of rows g, g + 32, g + 64, ... in turn (g = km_group < 32): each
// (group, channel) is still partial g of quant.h's pinned order, whichever slice holds it, so
// the mean's bits do not depend on the split.
SAGE_HD constexpr int km_slice_lanes(int head_dim_pad) {
  return prep_lanes_per_row(head_dim_pad) / SAGE_K_MEAN_SLICES;
}
SAGE_HD constexpr int km_group(int tid, int lanes) { return tid / lanes; }
SAGE_HD constexpr int km_chunk(int tid, int slice, int lanes) {
  return slice * lanes + tid % lanes;
}

// ------------------------------------------------------------------ prepare: V --------
// V is transposed through LDS: a [Dp channel][128 key] byte tile with rows padded by one
// 4-byte word, so that the column writes (16 lanes = 16 channel rows 8 apart, 4 keys each)
// and the 16-byte row reads spread over the banks.
constexpr int kVtKeys = 128;
// `code_bytes`: 1 (e4m3 codes) or 2 (pv_dtype FP16: FP16 codes, rows of 2 x 128 + 4 bytes).
SAGE_HD constexpr int vt_row_bytes(int code_bytes) { return kVtKeys * code_bytes + 4; }
SAGE_HD constexpr int vt_lds_offset(int channel, int key, int code_bytes = 1) {
  return channel * vt_row_bytes(code_bytes) + key * code_bytes;
}

}  // namespace gfx12
}  // namespace sage
