// aiter_sage cpu attention, portable tier operand layer: plain C++ on 4-row "vectors" (the
// compiler may map them onto SSE2). Same data flow as the SIMD tiers: Q.K^T on words of four
// signed channels, P.V in FP32 one key per word, exp2 from libm.
//
// With SAGE_CPU_SCALAR_TILE_OPERANDS (the amx_model tier, simd_amx_model.h) the operands take
// the amx tier's shapes instead: 16-row vectors (one tile row) and P.V on BF16 key pairs, P and
// V as BF16 like the amx tier; Q/K words are already signed int8 x 4, as tdpbssd wants.

#ifdef SAGE_CPU_SCALAR_TILE_OPERANDS
constexpr int kLanes = 16;
constexpr int kPvKeysPerWord = 2;
using VElem = uint16_t;  // decoded V element: BF16 bits
#else
constexpr int kLanes = 4;
constexpr int kPvKeysPerWord = 1;
using VElem = float;
#endif
struct VF {
  float v[kLanes];
};
struct VI {
  int32_t v[kLanes];
};

constexpr int kQkChansPerWord = 4;

#define SAGE_LANEWISE(expr)              \
  for (int i = 0; i < kLanes; ++i) expr; \
  return r
inline VF vf_zero() {
  VF r;
  SAGE_LANEWISE(r.v[i] = 0.0f);
}
inline VF vf_set1(float x) {
  VF r;
  SAGE_LANEWISE(r.v[i] = x);
}
inline VF vf_load(const float* p) {
  VF r;
  SAGE_LANEWISE(r.v[i] = p[i]);
}
inline void vf_store(float* p, VF x) {
  for (int i = 0; i < kLanes; ++i) p[i] = x.v[i];
}
inline VF vf_add(VF a, VF b) {
  VF r;
  SAGE_LANEWISE(r.v[i] = a.v[i] + b.v[i]);
}
inline VF vf_sub(VF a, VF b) {
  VF r;
  SAGE_LANEWISE(r.v[i] = a.v[i] - b.v[i]);
}
inline VF vf_mul(VF a, VF b) {
  VF r;
  SAGE_LANEWISE(r.v[i] = a.v[i] * b.v[i]);
}
// NaN in either operand wins (a NaN score makes its row non-finite, as in ref.py).
inline VF vf_max(VF a, VF b) {
  VF r;
  SAGE_LANEWISE(r.v[i] = (a.v[i] != a.v[i] || a.v[i] > b.v[i]) ? a.v[i] : b.v[i]);
}
inline VI vi_zero() {
  VI r;
  SAGE_LANEWISE(r.v[i] = 0);
}
inline VI vi_load(const uint32_t* p) {
  VI r;
  SAGE_LANEWISE(r.v[i] = int32_t(p[i]));
}
inline void vi_store(uint32_t* p, VI x) {
  for (int i = 0; i < kLanes; ++i) p[i] = uint32_t(x.v[i]);
}
inline VF vi_dot_to_f32(VI acc, int32_t correction) {
  VF r;
  SAGE_LANEWISE(r.v[i] = float(acc.v[i] - correction));
}
inline VF vf_exp2(VF x) {
  VF r;
  SAGE_LANEWISE(r.v[i] = exp2f(x.v[i]));
}
// vmaxps: the second operand when either is NaN.
inline VF vf_max_fast(VF a, VF b) {
  VF r;
  SAGE_LANEWISE(r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]);
}
// 2^x as simd_avx512.h's exp2_by_poly computes it, one lane: n = rint(x), Horner's rule on
// f = x - n (coefficients highest degree first), times 2^n; NaN stays NaN.
template <int kTerms>
inline float exp2_by_poly_lane(float x, const float (&c)[kTerms]) {
  if (x != x) return x;
  const float n = rintf(x), f = x - n;
  float p = c[0];
  for (int i = 1; i < kTerms; ++i) p = p * f + c[i];
  return n < -300.0f ? 0.0f : ldexpf(p, int(n));
}
// 2^x for P as the amx tier computes it (simd_avx512.h: clamp at -200, exp2_poly.h's
// polynomial).
inline float exp2_p_lane(float x) {
  return exp2_by_poly_lane(x < -200.0f ? -200.0f : x, sage_cpu::kExp2PolyP);
}
inline VF vf_exp2_p(VF x) {
  VF r;
  SAGE_LANEWISE(r.v[i] = exp2_p_lane(x.v[i]));
}

inline uint32_t pack_q_word(const int8_t* q_row, int word) {
  uint32_t w;
  memcpy(&w, q_row + word * kQkChansPerWord, 4);
  return w;
}
template <int kDim>
inline int32_t pack_k_row(const int8_t* k_row, uint32_t* words) {
  memcpy(words, k_row, kDim);
  return 0;
}
inline int32_t dot4_i8(uint32_t a, uint32_t b) {
  int32_t s = 0;
  for (int j = 0; j < 4; ++j) s += int32_t(int8_t(a >> (8 * j))) * int32_t(int8_t(b >> (8 * j)));
  return s;
}
inline VI qk_fma(VI acc, VI q_words, uint32_t k_word) {
  VI r;
  SAGE_LANEWISE(r.v[i] = acc.v[i] + dot4_i8(uint32_t(q_words.v[i]), k_word));
}
#ifdef SAGE_CPU_SCALAR_TILE_OPERANDS
// Lane r = (bf16 p0[r], bf16 p1[r]), rounded to nearest even.
inline VI pack_p_words(const VF* p) {
  VI r;
  SAGE_LANEWISE(r.v[i] = int32_t(uint32_t(sage::f32_to_bf16(p[0].v[i])) |
                                 (uint32_t(sage::f32_to_bf16(p[1].v[i])) << 16)));
}
inline VF pv_fma(VF acc, VI p_words, uint32_t v_word) {
  VF r;
  SAGE_LANEWISE(r.v[i] = acc.v[i] +
                         sage::bf16_to_f32(sage_bf16_t(uint32_t(p_words.v[i]) & 0xffffu)) *
                             sage::bf16_to_f32(sage_bf16_t(v_word & 0xffffu)) +
                         sage::bf16_to_f32(sage_bf16_t(uint32_t(p_words.v[i]) >> 16)) *
                             sage::bf16_to_f32(sage_bf16_t(v_word >> 16)));
}
// The amx tier's int8 P.V operands (simd_avx512.h), lane by lane.
inline VF vi_to_f32(VI x) {
  VF r;
  SAGE_LANEWISE(r.v[i] = float(x.v[i]));
}
inline VI vi_max(VI a, VI b) {
  VI r;
  SAGE_LANEWISE(r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]);
}
inline VF vf_fma(VF a, VF b, VF c) {
  VF r;
  SAGE_LANEWISE(r.v[i] = fmaf(a.v[i], b.v[i], c.v[i]));
}
inline VF vf_where_neg_inf(VF x, VF fallback) {
  VF r;
  SAGE_LANEWISE(r.v[i] = x.v[i] == -__builtin_inff() ? fallback.v[i] : x.v[i]);
}
inline float exp2_code_lane(float x) {  // == simd_avx512.h's vf_exp2_code, lane by lane
  return exp2_by_poly_lane(x, sage_cpu::kExp2PolyCode);
}
inline VF vf_exp2_code(VF x) {
  VF r;
  SAGE_LANEWISE(r.v[i] = exp2_code_lane(x.v[i]));
}
inline uint32_t p_code(float x) {  // rint(x), NaN -> 0
  return x == x && x > 0.0f ? uint32_t(rintf(x)) : 0u;
}
inline VI pack_p_codes(const VF* e) {
  VI r;
  SAGE_LANEWISE(r.v[i] = int32_t(p_code(e[0].v[i]) | p_code(e[1].v[i]) << 8 |
                                 p_code(e[2].v[i]) << 16 | p_code(e[3].v[i]) << 24));
}
#undef SAGE_LANEWISE
// e4m3 bits -> BF16 bits (exact: e4m3 values fit BF16).
inline VElem decode_v(uint8_t b) {
  return VElem(__builtin_bit_cast(uint32_t, sage::e4m3_to_f32(b)) >> 16);
}
// FP16 V code (pv_dtype FP16) -> BF16 bits, rounded to nearest even (BF16 keeps 8 of FP16's 11
// significant bits: the tier's P.V type).
inline VElem decode_v16(uint16_t h) { return VElem(sage::f32_to_bf16(sage::fp16_to_f32(h))); }
#else
inline VI pack_p_words(const VF* p) {
  VI r;
  SAGE_LANEWISE(r.v[i] = __builtin_bit_cast(int32_t, p[0].v[i]));
}
inline VF pv_fma(VF acc, VI p_words, uint32_t v_word) {
  const float vv = __builtin_bit_cast(float, v_word);
  VF r;
  SAGE_LANEWISE(r.v[i] = acc.v[i] + __builtin_bit_cast(float, p_words.v[i]) * vv);
}
#undef SAGE_LANEWISE
inline VElem decode_v(uint8_t b) { return sage::e4m3_to_f32(b); }
// FP16 V code (pv_dtype FP16) -> float, exact.
inline VElem decode_v16(uint16_t h) { return sage::fp16_to_f32(h); }
#endif
