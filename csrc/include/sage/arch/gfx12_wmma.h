// aiter_sage: hardware facts of gfx12 (RDNA4) wave32 WMMA 16x16x16, and nothing else — which
// lane holds which element of each operand, the wave and LDS geometry. Kernel choices (tile
// sizes, channel permutations, LDS layouts) live in gfx12/fragments.h on top of these.
// Sources: csrc/gfx12/README.md, "gfx12 WMMA facts". Tested on the host by
// op_tests/backends/test_gfx12_layout.py and against the emulator's WMMA by
// op_tests/backends/test_emu.py.
//
// h = lane / 16, r = lane % 16, element j = 0..7 of a lane's register vector (byte j of the
// v2i32 for 8-bit operands, VGPR j of C/D):
//   A (M x K): row r,      column 8h + j
//   B (K x N): row 8h + j, column r
//   C/D (M x N): row 8h + j, column r
// 16-bit operands (v_wmma_f32_16x16x16_f16: 8 halves per lane, element j in VGPR j / 2) hold
// the same row / column r, and K index k16(h, j) below. Which of two readings is the
// hardware's, public sources disagree (AMD GPUOpen's RDNA4 article and Composable-Kernel-style
// tables: 8h + j, as for 8-bit; other RDNA4 ports: K interleaved in groups of 4 between the
// half-waves). The kernels do not depend on it: a WMMA multiplies A's element j of half h
// with B's element j of half h whenever both operands use the same map, so a contraction is
// right for ANY map shared by A and B — op_tests/backends/test_gfx12_layout.py proves the FP16 P·V
// for both readings, and the emulator models the interleaved one (the less convenient case).
#pragma once
#include "sage/platform.h"

namespace sage {
namespace gfx12 {

constexpr int kWaveSize = 32;
constexpr int kWmmaDim = 16;   // M = N = K = 16
constexpr int kFragElems = 8;  // elements per lane per operand / accumulator
constexpr int kLdsBankBytes = 4;
// Bytes one LDS pass serves: 64 banks x 4 B. A 128-bit access by 32 lanes takes at least two
// passes of 16 lanes; an access pattern is conflict free when each 16-lane group touches 16
// distinct 16-byte slots modulo this size.
constexpr int kLdsPassBytes = 256;

// ---------------------------------------------------------------- WMMA lane layout ------
SAGE_HD constexpr int lane_half(int lane) { return lane >> 4; }  // h
SAGE_HD constexpr int lane_idx(int lane) { return lane & 15; }   // r
// A operand: element j of `lane` is A[a_row(lane)][a_col(lane, j)].
SAGE_HD constexpr int a_row(int lane) { return lane_idx(lane); }
SAGE_HD constexpr int a_col(int lane, int j) { return 8 * lane_half(lane) + j; }
// B operand: element j of `lane` is B[b_row(lane, j)][b_col(lane)].
SAGE_HD constexpr int b_row(int lane, int j) { return 8 * lane_half(lane) + j; }
SAGE_HD constexpr int b_col(int lane) { return lane_idx(lane); }
// C/D accumulator: element j of `lane` is C[c_row(lane, j)][c_col(lane)].
SAGE_HD constexpr int c_row(int lane, int j) { return 8 * lane_half(lane) + j; }
SAGE_HD constexpr int c_col(int lane) { return lane_idx(lane); }
// 16-bit A / B operands, the interleaved reading: K = 4h + j for j < 4, 8 + 4h + (j - 4) after.
SAGE_HD constexpr int k16_interleaved(int lane, int j) {
  return 4 * lane_half(lane) + (j & 3) + 8 * (j >> 2);
}

}  // namespace gfx12
}  // namespace sage
