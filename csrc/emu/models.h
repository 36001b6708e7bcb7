// aiter_sage gfx12 emulator: value models of the matrix instructions, on whole 16x16 tiles in
// the wave register layout. Pure functions, independent of the fiber runtime, so the
// scheduler calls them once per wave and tests can reason about them in isolation.
#pragma once
#include <stdint.h>

#pragma GCC visibility push(hidden)
namespace sage_emu {

constexpr int kWaveSize = 32;
constexpr int kTile = 16;  // WMMA M = N = K = 16 on gfx12 (wave32)

// Per-lane operands of one wave, indexed by lane (0..31). A lane that does not take part
// contributes zeros (the runtime reports that case: WMMA requires EXEC to be all ones).
struct WmmaIu8Operands {
  uint8_t a[kWaveSize][8];  // bytes of the v2i32, little endian
  uint8_t b[kWaveSize][8];
  int32_t c[kWaveSize][8];
};
struct WmmaFp8Operands {
  uint8_t a[kWaveSize][8];
  uint8_t b[kWaveSize][8];
  float c[kWaveSize][8];
};

struct WmmaF16Operands {
  uint16_t a[kWaveSize][8];  // FP16 bits, element j = half j of the lane's 4 VGPRs
  uint16_t b[kWaveSize][8];
  float c[kWaveSize][8];
};

// v_wmma_i32_16x16x16_iu8 (gfx12, wave32): D = A x B + C with int32 accumulation.
void wmma_iu8_model(const WmmaIu8Operands& in, bool sign_a, bool sign_b, bool clamp,
                    int32_t d[kWaveSize][8]);
// v_wmma_f32_16x16x16_fp8_fp8 (gfx12, wave32): OCP e4m3fn x e4m3fn -> f32.
void wmma_fp8_model(const WmmaFp8Operands& in, float d[kWaveSize][8]);
// v_wmma_f32_16x16x16_f16 (gfx12, wave32): FP16 x FP16 -> f32.
void wmma_f16_model(const WmmaF16Operands& in, float d[kWaveSize][8]);

// Lane layout of gfx12 wave32 WMMA (one place, used by both models):
// h = lane / 16, r = lane % 16; element j (0..7) of lane's register vector is
//   A: row r, column 8h + j;   B: row 8h + j, column r;   C/D: row 8h + j, column r.
inline int wmma_half(int lane) { return lane / 16; }
inline int wmma_rc(int lane) { return lane % 16; }
inline int wmma_k_of(int lane, int j) { return 8 * wmma_half(lane) + j; }
inline int wmma_m_of_cd(int lane, int j) { return 8 * wmma_half(lane) + j; }
// 16-bit A / B operands: K of element j. Public sources disagree between 8h + j (as for 8-bit)
// and K interleaved in groups of 4 between the half-waves (sage/arch/gfx12_wmma.h); the model
// takes the interleaved reading. Kernels must not depend on which (a contraction pairs A's and
// B's element j of the same half either way), and running them here under the less
// convenient reading checks that they do not.
inline int wmma_k16_of(int lane, int j) { return 4 * wmma_half(lane) + (j & 3) + 8 * (j >> 2); }

}  // namespace sage_emu
#pragma GCC visibility pop
