// aiter_sage cpu attention: the degree-4 polynomial for 2^f, |f| <= 1/2, that the tile tiers
// use for P (vf_exp2_p). P is rounded to BF16 (8 significant bits) before P.V, so the
// degree-6 Taylor polynomial of vf_exp2 (~1e-7) was more than P needs; this one is a
// relative-error fit (iteratively reweighted least squares on Chebyshev nodes) with a maximum
// relative error of 2.6e-6 on [-1/2, 1/2], 700 times below BF16's half ulp. alpha keeps
// vf_exp2: exp2(0) must be exactly 1 there (the O^T rescale is skipped when alpha == 1).
//
// The amx tiers' int8 P.V rounds 255 * P to 8-bit codes, so its exp2 (vf_exp2_code) takes the
// degree-3 fit of the same kind: maximum relative error 7.5e-5 on [-1/2, 1/2], under 0.02 of
// a code at 255.
#pragma once

namespace sage_cpu {
constexpr float kExp2PolyC0 = 0.9999992847442627f;
constexpr float kExp2PolyC1 = 0.6931217908859253f;
constexpr float kExp2PolyC2 = 0.240247443318367f;
constexpr float kExp2PolyC3 = 0.05591786280274391f;
constexpr float kExp2PolyC4 = 0.009570099413394928f;
constexpr float kExp2CodeC0 = 0.9999281167984009f;
constexpr float kExp2CodeC1 = 0.6932609677314758f;
constexpr float kExp2CodeC2 = 0.24261054396629333f;
constexpr float kExp2CodeC3 = 0.05517132207751274f;
// The same coefficients highest degree first, for the Horner loops of the operand layers.
constexpr float kExp2PolyP[] = {kExp2PolyC4, kExp2PolyC3, kExp2PolyC2, kExp2PolyC1, kExp2PolyC0};
constexpr float kExp2PolyCode[] = {kExp2CodeC3, kExp2CodeC2, kExp2CodeC1, kExp2CodeC0};
}  // namespace sage_cpu
