// aiter_sage cpu attention, avx2 tier operand layer (AVX2 + FMA). Included inside an
// anonymous namespace and a target region by attention_avx2.cpp. One vector = 8 query rows.
//
//   Q.K^T: vpmaddwd on 16-bit integers (no u8 x s8 VNNI here, and vpmaddubsw would saturate):
//          a word is 2 channels of one row / one key, sign-extended to int16; exact int32 sums.
//   P.V:   FP32 FMA, one key per word (P as float, V decoded to float).

constexpr int kLanes = 8;
using VF = __m256;
using VI = __m256i;

constexpr int kQkChansPerWord = 2;
constexpr int kPvKeysPerWord = 1;
using VElem = float;

inline VF vf_zero() { return _mm256_setzero_ps(); }
inline VF vf_set1(float x) { return _mm256_set1_ps(x); }
inline VF vf_load(const float* p) { return _mm256_load_ps(p); }
inline void vf_store(float* p, VF x) { _mm256_store_ps(p, x); }
inline VF vf_add(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF vf_sub(VF a, VF b) { return _mm256_sub_ps(a, b); }
inline VF vf_mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
// max that keeps a NaN of either operand (vmaxps alone returns b when either is NaN): a NaN
// score must make its row non-finite, as in ref.py, not vanish from the row max.
inline VF vf_max(VF a, VF b) {
  return _mm256_blendv_ps(_mm256_max_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
}
inline VI vi_zero() { return _mm256_setzero_si256(); }
inline VI vi_load(const uint32_t* p) { return _mm256_load_si256((const __m256i*)p); }
inline void vi_store(uint32_t* p, VI x) { _mm256_store_si256((__m256i*)p, x); }
inline VF vi_dot_to_f32(VI acc, int32_t correction) {
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(acc, _mm256_set1_epi32(correction)));
}

// 2^x to ~1e-7 relative (see simd_avx512.h); without vscalefps 2^n is built in the exponent
// field, so x is clamped to >= -125 where that stays a normal float, and lanes below -125
// (masked keys: -inf, and the first tile's m = -inf) are set to an exact 0 afterwards: a
// causally masked key must add nothing to l or O (a row that sees no key of a tile stays
// untouched). Their true weight is below 2^-125, invisible next to the row max's weight 1.
// The clamp constants are the first operands so that a NaN x passes through (vmaxps/vminps
// return their second operand when either is NaN), and the underflow test is "not less than"
// (true for NaN), so its row stays non-finite.
inline VF vf_exp2(VF x) {
  const VF kMinExponent = _mm256_set1_ps(-125.0f);
  const VF keep = _mm256_cmp_ps(x, kMinExponent, _CMP_NLT_UQ);
  x = _mm256_max_ps(kMinExponent, x);
  x = _mm256_min_ps(_mm256_set1_ps(127.0f), x);
  VF n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  VF f = _mm256_sub_ps(x, n);
  VF p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_and_ps(keep, _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e)));
}

inline uint32_t pack_pair_i16(int8_t a, int8_t b) {
  return uint32_t(uint16_t(int16_t(a))) | (uint32_t(uint16_t(int16_t(b))) << 16);
}
inline uint32_t pack_q_word(const int8_t* q_row, int word) {
  return pack_pair_i16(q_row[2 * word], q_row[2 * word + 1]);
}
template <int kDim>
inline int32_t pack_k_row(const int8_t* k_row, uint32_t* words) {
  for (int w = 0; w < kDim / kQkChansPerWord; ++w)
    words[w] = pack_pair_i16(k_row[2 * w], k_row[2 * w + 1]);
  return 0;
}
inline VI qk_fma(VI acc, VI q_words, uint32_t k_word) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(q_words, _mm256_set1_epi32(int32_t(k_word))));
}

inline VI pack_p_words(const VF* p) { return _mm256_castps_si256(p[0]); }
inline VF pv_fma(VF acc, VI p_words, uint32_t v_word) {
  return _mm256_fmadd_ps(_mm256_castsi256_ps(p_words),
                         _mm256_set1_ps(__builtin_bit_cast(float, v_word)), acc);
}
inline VElem decode_v(uint8_t b) { return sage::e4m3_to_f32(b); }
// FP16 V code (pv_dtype FP16) -> float, exact.
inline VElem decode_v16(uint16_t h) { return sage::fp16_to_f32(h); }
