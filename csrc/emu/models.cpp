// aiter_sage gfx12 emulator: value models of the gfx12 instructions behind the kernel API.
//
// Sources (public; read, not copied):
//  [GPUOpen-RDNA4] AMD GPUOpen, "Using the Matrix Cores of AMD RDNA 4 architecture GPUs"
//      (gpuopen.com/learn/using_matrix_core_amd_rdna4/): RDNA4 changed the WMMA VGPR layout
//      relative to RDNA3; 16x16x16 tiles, wave32.
//  [RDNA4-ISA] AMD "RDNA4 Instruction Set Architecture Reference Guide", WMMA section (matrix
//      layouts, CLAMP for integer WMMA, EXEC must be all ones), V_CVT_PK_FP8_F32, V_EXP_F32.
//  [cubecl-amd] docs.rs cubecl-ir 0.11.1 src/amd.rs: "RDNA4 ... dropped RDNA3's duplication of
//      the A/B fragments across lane halves ... RDNA4 splits k between the two halves".
//  [Mojo-RDNA] docs.modular.com mma_amd_rdna / buffers_rdna (RDNA3 C/D layout with interleaved
//      rows, which gfx12 replaced by rows 8h + j; see csrc/emu/README.md, "What is modelled").
//  [LLVM-W32] llvm-project clang/test/CodeGenOpenCL/builtins-amdgcn-gfx12-wmma-w32.cl and
//      cross-project-tests/amdgpu/builtins-amdgcn-gfx12-wmma-w*.cl: builtin signatures
//      (iu8: sgn_a, A v2i32, sgn_b, B v2i32, C v8i32, clamp; fp8_fp8: v2i32, v2i32, v8f32).
//  [OCP-FP8] OCP 8-bit Floating Point Specification (OFP8) rev 1.0: e4m3 bias 7, no infinity,
//      NaN = S.1111.111, max normal 448; non-saturating conversion maps overflow to NaN.
//  [rocjitsu-8800] github.com/ROCm/rocm-systems PR #8800 "[rocjitsu] Return NaN for E4M3
//      overflow": AMD's own emulator models v_cvt_pk_fp8_f32 overflow/inf as signed NaN 0x7f/0xff.
//  [ml_dtypes-400] github.com/jax-ml/ml_dtypes issue #400: e4m3fn RNE boundary 464 -> 448,
//      465 -> NaN for the non-saturating cast.
//  [LLVM-exp2] llvm/docs/AMDGPUUsage.rst and reviews.llvm.org/D153024, D157867: v_exp_f32 has
//      1 ULP accuracy for float and no native denormal support; accurate llvm.exp2 lowering
//      rescales inputs below -126 because the raw instruction cannot produce denormals.
//  [LLVM-log2] llvm/lib/Target/AMDGPU/AMDGPUISelLowering.cpp (LowerFLOG2 / lowerFEXP2 and the
//      "needsDenormHandlingF32" scaling): llvm.log2.f32 lowers to v_log_f32 with only a denormal
//      input rescale, i.e. the instruction is accurate on normal inputs.
#include "emu/models.h"

#include <math.h>
#include <string.h>

#include "emu/sage_emu.h"

namespace sage_emu {

// ---------------------------------------------------------------- FP8 (OCP e4m3fn) ------
float fp8_e4m3_to_f32(uint8_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  float mag;
  if (e == 15u && m == 7u) {
    mag = __builtin_nanf("");
  } else if (e == 0u) {
    mag = float(m) * (1.0f / 512.0f);  // subnormal: m * 2^-9
  } else {
    uint32_t bits = ((e + 120u) << 23) | (m << 20);  // rebias 7 -> 127
    memcpy(&mag, &bits, 4);
  }
  return (b & 0x80u) ? -mag : mag;
}

// Round-to-nearest-even right shift of a non-negative integer.
static uint32_t rne_shift_right(uint32_t m, int s) {
  if (s <= 0) return m;
  if (s >= 32) return 0;
  uint32_t q = m >> s, rem = m & ((1u << s) - 1u), half = 1u << (s - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return q;
}

// One element of v_cvt_pk_fp8_f32 without the clamp modifier [RDNA4-ISA, OCP-FP8,
// rocjitsu-8800]: round to nearest even; subnormals kept; a result that rounds beyond 448
// (|x| > 464), +-inf and NaN give the signed NaN code S.1111.111. Bit arithmetic only, so the
// result does not depend on the host rounding mode.
uint8_t cvt_f32_to_fp8_e4m3(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t exp_field = (u >> 23) & 0xffu;
  if (exp_field == 0xffu) return uint8_t(sign | 0x7f);  // inf or NaN: no e4m3fn infinity
  if (exp_field == 0u) return sign;                     // f32 subnormal: far below 2^-10
  const uint32_t m24 = (u & 0x7fffffu) | 0x800000u;     // value = m24 * 2^(e - 23)
  int e = int(exp_field) - 127;
  if (e < -6) {
    // e4m3 subnormal range: count units of 2^-9, i.e. m24 * 2^(e - 23 + 9).
    uint32_t q = rne_shift_right(m24, 14 - e);  // 0..8; 8 is the smallest normal (code 0x08)
    return uint8_t(sign | q);
  }
  uint32_t q = rne_shift_right(m24, 20);  // 1.mmm in 8..16
  if (q == 16u) {
    q = 8u;
    ++e;
  }
  if (e > 8) return uint8_t(sign | 0x7f);
  const uint8_t code = uint8_t(((e + 7) << 3) | int(q & 7u));
  if (code == 0x7f) return uint8_t(sign | 0x7f);  // 480 is not representable: NaN slot
  return uint8_t(sign | code);
}

// v_exp_f32 [LLVM-exp2]: the hardware is accurate to 1 ULP, the host exp2f (glibc) to about
// 0.5 ULP, so results may differ from the GPU in the last bit. The instruction cannot produce
// denormals, so results below 2^-126 are flushed to +0 (a difference of < 2^-126 from IEEE).
float exp2_v_exp_f32(float x) {
  float r = exp2f(x);
  if (r < 1.17549435e-38f) r = 0.0f;  // FLT_MIN
  return r;
}

// v_log_f32 [LLVM-exp2, LLVM-log2]: log2 of an f32. LLVM lowers an accurate llvm.log2.f32 to
// the bare instruction plus a rescale of denormal inputs only, i.e. it treats v_log_f32 as
// accurate to 1 ULP on normal inputs, which flush to +-0 when denormal (the instruction has
// no native denormal support). Host log2f (glibc: < 1 ULP, correctly rounded in most cases)
// stands in for it, so results may differ from the GPU in the last bit: for the LSE (the
// only user, |log2 l| < 2^6 + 24) that is < 2^-17 absolute. Inputs below 2^-126 (denormals)
// are flushed: log2(+0) = -inf; negative inputs and NaN give NaN; log2(+inf) = +inf.
float log2_v_log_f32(float x) {
  if (x > 0.0f && x < 1.17549435e-38f) x = 0.0f;  // FLT_MIN: denormal input flushed
  return log2f(x);
}

// ---------------------------------------------------------------- WMMA -----------------
// Gathers 16x16 A, B and C from the per-lane registers using the layout of models.h
// [GPUOpen-RDNA4, cubecl-amd; csrc/emu/README.md "What is modelled"], computes D, scatters it back.

void wmma_iu8_model(const WmmaIu8Operands& in, bool sign_a, bool sign_b, bool clamp,
                    int32_t d[kWaveSize][8]) {
  int32_t A[kTile][kTile], B[kTile][kTile];
  int64_t acc[kTile][kTile];
  for (int lane = 0; lane < kWaveSize; ++lane) {
    const int r = wmma_rc(lane);
    for (int j = 0; j < 8; ++j) {
      const int k = wmma_k_of(lane, j);
      A[r][k] = sign_a ? int32_t(int8_t(in.a[lane][j])) : int32_t(in.a[lane][j]);
      B[k][r] = sign_b ? int32_t(int8_t(in.b[lane][j])) : int32_t(in.b[lane][j]);
      acc[wmma_m_of_cd(lane, j)][r] = in.c[lane][j];
    }
  }
  // Exact: |sum| <= 16 * 255 * 255 + 2^31 fits int64 with room to spare.
  for (int m = 0; m < kTile; ++m)
    for (int n = 0; n < kTile; ++n) {
      int64_t s = acc[m][n];
      for (int k = 0; k < kTile; ++k) s += int64_t(A[m][k]) * B[k][n];
      acc[m][n] = s;
    }
  // CLAMP on integer WMMA saturates the result to the int32 range [RDNA4-ISA]; without it the
  // accumulator wraps modulo 2^32 like any 32-bit integer add.
  for (int lane = 0; lane < kWaveSize; ++lane)
    for (int j = 0; j < 8; ++j) {
      int64_t s = acc[wmma_m_of_cd(lane, j)][wmma_rc(lane)];
      if (clamp) {
        s = s > INT32_MAX ? INT32_MAX : (s < INT32_MIN ? INT32_MIN : s);
        d[lane][j] = int32_t(s);
      } else {
        d[lane][j] = int32_t(uint32_t(uint64_t(s)));
      }
    }
}

// Rounds the exact value hi + lo (|lo| <= ulp(hi)/2, hi = fl64(hi + lo)) to f32 once, with
// round-to-nearest-even, avoiding the double rounding of (float)hi when hi sits exactly on an
// f32 midpoint but the exact value does not.
static float round_pair_to_f32(double hi, double lo) {
  float f = float(hi);
  if (lo != 0.0 && isfinite(hi)) {
    const float other = nextafterf(f, hi > double(f) ? INFINITY : -INFINITY);
    const double mid = (double(f) + double(other)) * 0.5;
    if (hi == mid) f = float(nextafter(hi, lo > 0 ? INFINITY : -INFINITY));
  }
  return f;
}

// The A, B (decoded to double) and C tiles of a float WMMA from the lanes' registers; `k_of`:
// the operands' K map (8-bit or 16-bit, models.h).
template <class Operands, class KOf, class Decode>
static void gather_float_tiles(const Operands& in, KOf k_of, Decode decode,
                               double (&A)[kTile][kTile], double (&B)[kTile][kTile],
                               float (&C)[kTile][kTile]) {
  for (int lane = 0; lane < kWaveSize; ++lane) {
    const int r = wmma_rc(lane);
    for (int j = 0; j < 8; ++j) {
      const int k = k_of(lane, j);
      A[r][k] = decode(in.a[lane][j]);
      B[k][r] = decode(in.b[lane][j]);
      C[wmma_m_of_cd(lane, j)][r] = in.c[lane][j];
    }
  }
}

// FP8 WMMA internal precision: the ISA does not spell it out, so we model an ideal unit. Every
// e4m3 x e4m3 product is exact in double (4 x 4 significant bits); the 16-term sum is exact in
// double too (all terms are multiples of 2^-18 and |sum| < 2^22, i.e. < 41 significant bits);
// then C is added and the total is rounded once to f32 (RNE). NaN operands give NaN. Real
// hardware may round or truncate differently in the last bit; tests allow for that.
void wmma_fp8_model(const WmmaFp8Operands& in, float d[kWaveSize][8]) {
  static double decode[256];
  static const bool init = [] {
    for (int i = 0; i < 256; ++i) decode[i] = double(fp8_e4m3_to_f32(uint8_t(i)));
    return true;
  }();
  (void)init;
  double A[kTile][kTile], B[kTile][kTile];
  float C[kTile][kTile];
  gather_float_tiles(in, wmma_k_of, [](uint8_t x) { return decode[x]; }, A, B, C);
  float D[kTile][kTile];
  for (int m = 0; m < kTile; ++m)
    for (int n = 0; n < kTile; ++n) {
      double s = 0.0;
      for (int k = 0; k < kTile; ++k) s += A[m][k] * B[k][n];  // exact (see above)
      const double c = double(C[m][n]);
      const double hi = s + c;
      // TwoSum error term of hi = fl(s + c): the exact total is hi + lo.
      const double bv = hi - s, av = hi - bv;
      const double lo = (s - av) + (c - bv);
      D[m][n] = isnan(hi) ? __builtin_nanf("") : round_pair_to_f32(hi, isfinite(hi) ? lo : 0.0);
    }
  for (int lane = 0; lane < kWaveSize; ++lane)
    for (int j = 0; j < 8; ++j) d[lane][j] = D[wmma_m_of_cd(lane, j)][wmma_rc(lane)];
}

// v_cvt_f16_f32 under the kernels' default mode: round to nearest even, FP16 denormals kept
// (the FP16/64 denormal mode is "preserve" by default), overflow to inf, NaN stays NaN. The
// host's IEEE _Float16 conversion is exactly that.
uint16_t cvt_f32_to_f16(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  uint16_t bits;
  memcpy(&bits, &h, 2);
  return bits;
}

static double f16_to_f64(uint16_t bits) {
  _Float16 h;
  memcpy(&h, &bits, 2);
  return double(h);
}

// FP16 WMMA, an ideal unit like the FP8 one: every FP16 x FP16 product is exact in double
// (11 x 11 significant bits); the 16 products and C are summed with TwoSum compensation
// (sum + error exact to far below an f32 ulp) and rounded once to f32 (RNE). NaN in, NaN out;
// inf products give inf (or NaN for inf - inf). The operand K map is wmma_k16_of (models.h).
void wmma_f16_model(const WmmaF16Operands& in, float d[kWaveSize][8]) {
  double A[kTile][kTile], B[kTile][kTile];
  float C[kTile][kTile];
  gather_float_tiles(in, wmma_k16_of, f16_to_f64, A, B, C);
  for (int m = 0; m < kTile; ++m)
    for (int n = 0; n < kTile; ++n) {
      double hi = double(C[m][n]), lo = 0.0;
      for (int k = 0; k < kTile; ++k) {
        const double x = A[m][k] * B[k][n];  // exact
        const double t = hi + x;
        const double bv = t - hi, av = t - bv;
        lo += (hi - av) + (x - bv);  // TwoSum error of t = fl(hi + x)
        hi = t;
      }
      const double total = hi + lo;
      const double rest = isfinite(total) ? (hi - total) + lo : 0.0;
      C[m][n] = isnan(total) ? __builtin_nanf("") : round_pair_to_f32(total, rest);
    }
  for (int lane = 0; lane < kWaveSize; ++lane)
    for (int j = 0; j < 8; ++j) d[lane][j] = C[wmma_m_of_cd(lane, j)][wmma_rc(lane)];
}

}  // namespace sage_emu
