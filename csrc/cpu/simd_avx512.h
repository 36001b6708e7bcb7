// aiter_sage cpu attention, avx512 tier operand layer (AVX-512 F/BW/VL + VNNI + BF16).
// Included inside an anonymous namespace and a target region by attention_avx512.cpp; the
// kernel (attention_kernel.inc) sees only the names below. One vector = 16 query rows.
//
//   Q.K^T: vpdpbusd multiplies unsigned by signed bytes, so Q is stored offset by +128
//          (q ^ 0x80) and 128 * sum_c k[c] is subtracted per key afterwards; K words are
//          4 signed channels broadcast from the key's row.
//   P.V:   vdpbf16ps on pairs of keys: a P word holds (P[key 2i], P[key 2i+1]) of one row in
//          BF16, a V word the same two keys of one channel (V e4m3 values are exact in BF16).

constexpr int kLanes = 16;
using VF = __m512;
using VI = __m512i;

constexpr int kQkChansPerWord = 4;
constexpr int kPvKeysPerWord = 2;
using VElem = uint16_t;  // decoded V element: BF16 bits

inline VF vf_zero() { return _mm512_setzero_ps(); }
inline VF vf_set1(float x) { return _mm512_set1_ps(x); }
inline VF vf_load(const float* p) { return _mm512_load_ps(p); }
inline void vf_store(float* p, VF x) { _mm512_store_ps(p, x); }
inline VF vf_add(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF vf_sub(VF a, VF b) { return _mm512_sub_ps(a, b); }
inline VF vf_mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
// max that keeps a NaN of either operand (vmaxps alone returns b when either is NaN): a NaN
// score must make its row non-finite, as in ref.py, not vanish from the row max.
inline VF vf_max(VF a, VF b) {
  return _mm512_mask_mov_ps(_mm512_max_ps(a, b), _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), a);
}
inline VI vi_zero() { return _mm512_setzero_si512(); }
inline VI vi_load(const uint32_t* p) { return _mm512_load_si512(p); }
inline void vi_store(uint32_t* p, VI x) { _mm512_store_si512(p, x); }
// float(acc - correction): exact integers below 2^24 in magnitude (|dot| <= 128*255*127).
inline VF vi_dot_to_f32(VI acc, int32_t correction) {
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_set1_epi32(correction)));
}

// 2^x to ~1e-7 relative: x = n + f with n = rint(x), |f| <= 1/2, 2^f by its degree-6 Taylor
// polynomial, then vscalefps applies 2^n (underflowing to exact 0). Clamping at -200 first
// makes exp2(-inf) (masked keys, the first tile's m = -inf) an exact 0 instead of NaN; the
// clamp constant is the first operand so that a NaN x passes through (vmaxps returns its
// second operand when either is NaN) and its row stays non-finite.
inline VF vf_exp2(VF x) {
  x = _mm512_max_ps(_mm512_set1_ps(-200.0f), x);
  VF n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  VF f = _mm512_sub_ps(x, n);
  VF p = _mm512_set1_ps(1.5403530393381606e-4f);                      // ln2^6 / 6!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));  // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));  // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));  // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));  // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// max for values whose NaNs need no propagation here (vmaxps: the second operand when either
// is NaN).
inline VF vf_max_fast(VF a, VF b) { return _mm512_max_ps(a, b); }

// 2^n * c(f) with n = rint(x), f = x - n (|f| <= 1/2): c's coefficients highest degree first,
// evaluated by Horner's rule in fmas; vscalefps applies 2^n (underflowing to exact 0).
template <int kTerms>
inline VF exp2_by_poly(VF x, const float (&c)[kTerms]) {
  const VF n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const VF f = _mm512_sub_ps(x, n);
  VF p = _mm512_set1_ps(c[0]);
  for (int i = 1; i < kTerms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
}

// 2^x for P (exp2_poly.h): the clamp as in vf_exp2, the degree-4 polynomial.
inline VF vf_exp2_p(VF x) {
  return exp2_by_poly(_mm512_max_ps(_mm512_set1_ps(-200.0f), x), sage_cpu::kExp2PolyP);
}

// Q word `word` of one row: channels 4w..4w+3, offset to unsigned for vpdpbusd. The amx tier
// (simd_amx.h) sets SAGE_CPU_SIGNED_Q_WORDS: tdpbssd takes signed bytes as they are.
#ifdef SAGE_CPU_SIGNED_Q_WORDS
constexpr uint32_t kQWordOffset = 0;
#else
constexpr uint32_t kQWordOffset = 0x80808080u;
#endif
inline uint32_t pack_q_word(const int8_t* q_row, int word) {
  uint32_t w;
  memcpy(&w, q_row + word * kQkChansPerWord, 4);
  return w ^ kQWordOffset;
}
// K words of one key (its kDim bytes as kDim / 4 words) and the offset correction
// 128 * sum(k).
template <int kDim>
inline int32_t pack_k_row(const int8_t* k_row, uint32_t* words) {
  constexpr int kBytesPerVector = 64;
  static_assert(kDim % kBytesPerVector == 0, "K rows are whole 64-byte vectors");
  memcpy(words, k_row, kDim);
  // sum of signed bytes via vpdpbusd with all-ones unsigned bytes
  __m512i s = _mm512_setzero_si512();
  for (int c = 0; c < kDim; c += kBytesPerVector)
    s = _mm512_dpbusd_epi32(s, _mm512_set1_epi8(1), _mm512_loadu_si512(k_row + c));
  return 128 * _mm512_reduce_add_epi32(s);
}
// GCC 12 fails to coalesce the tied accumulator of the VNNI/BF16 dot-product builtins inside
// the register-tiled loops (it copies every accumulator twice per step, ~10% slower); the same
// instruction through inline asm with an in-out operand allocates cleanly. Clang is fine.
#if defined(__GNUC__) && !defined(__clang__)
#define SAGE_CPU_DOT_ASM 1
#endif
inline VI qk_fma(VI acc, VI q_words, uint32_t k_word) {
  const VI k = _mm512_set1_epi32(int32_t(k_word));
#ifdef SAGE_CPU_DOT_ASM
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(q_words), "v"(k));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, q_words, k);
#endif
}

// Two keys' P vectors -> one P word vector: lane r = (bf16 p0[r], bf16 p1[r]).
inline VI pack_p_words(const VF* p) {
  __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]);  // [p0 rows 0..15 | p1 rows 0..15]
  const __m512i interleave =
      _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, both);
}
inline VF pv_fma(VF acc, VI p_words, uint32_t v_word) {
  const VI v = _mm512_set1_epi32(int32_t(v_word));
#ifdef SAGE_CPU_DOT_ASM
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(p_words), "v"(v));
  return acc;
#else
  return _mm512_dpbf16_ps(acc, (__m512bh)p_words, (__m512bh)v);
#endif
}
// ---- the amx tier's int8 P.V (attention_tiles.inc) ----
inline VF vi_to_f32(VI x) { return _mm512_cvtepi32_ps(x); }
inline VI vi_max(VI a, VI b) { return _mm512_max_epi32(a, b); }
inline VF vf_fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
// x, with fallback in the lanes where x is -inf.
inline VF vf_where_neg_inf(VF x, VF fallback) {
  return _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, vf_set1(-__builtin_inff()), _CMP_EQ_OQ),
                            fallback);
}
// 2^x for P codes (exp2_poly.h's degree-3 fit) with no clamp: x is finite or NaN here (a
// -inf x, masked keys, gives NaN: the kernel clamps those first). Very negative x underflows
// to 0 in vscalefps.
inline VF vf_exp2_code(VF x) { return exp2_by_poly(x, sage_cpu::kExp2PolyCode); }
// Four keys' P code values x (each in [0, 255.5) or NaN) -> one word vector of uint8 P codes:
// lane r = rint(x[0][r]) | rint(x[1][r]) << 8 | ... (round to nearest even, as vcvtps2dq does
// by default; a NaN x gives INT_MIN, which the unsigned saturation of the packs makes 0). Per
// 128-bit lane the two packs give the bytes [x0 rows 0-3 | x1 rows 0-3 | x2 .. | x3 ..]; the
// byte shuffle gathers each row's 4 keys into its dword (one instruction fewer than shifts and
// ors: Xeon VM, S 4096 H 16, 16 threads, median of 12 interleaved rounds 16.7 -> 16.3 ms).
inline VI pack_p_codes(const VF* x) {
  const VI x01 = _mm512_packus_epi32(_mm512_cvtps_epi32(x[0]), _mm512_cvtps_epi32(x[1]));
  const VI x23 = _mm512_packus_epi32(_mm512_cvtps_epi32(x[2]), _mm512_cvtps_epi32(x[3]));
  const VI rows_by_key = _mm512_packus_epi16(x01, x23);
  const VI keys_by_row =
      _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  return _mm512_shuffle_epi8(rows_by_key, keys_by_row);
}
// e4m3 bits -> decoded V element (BF16 bits; exact).
inline VElem decode_v(uint8_t b) {
  return VElem(__builtin_bit_cast(uint32_t, sage::e4m3_to_f32(b)) >> 16);
}
// FP16 V code (pv_dtype FP16) -> BF16 bits, rounded to nearest even (BF16 keeps 8 of FP16's 11
// significant bits: the tier's P.V type).
inline VElem decode_v16(uint16_t h) { return VElem(sage::f32_to_bf16(sage::fp16_to_f32(h))); }
