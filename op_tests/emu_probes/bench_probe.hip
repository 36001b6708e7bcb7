// Emulator speed probe shaped like the product attention kernel (not its math): per 64-key
// tile and lane, 32 INT8 WMMAs (S = K Q^T over d = 128), 32 FP8 WMMAs (O += P V), K/V staged
// through LDS by the whole workgroup between two barriers, ~100 other API calls (LDS loads,
// shuffles, exp2, conversions). Grid: (q_len / 64, heads); 4 waves of 16 queries each.
#include "sage/platform.h"

constexpr int kKeys = 64, kDim = 128, kThreads = 128;

SAGE_KERNEL(bench_attention_like, 128)(const int8_t* q8, const int8_t* k8, const uint8_t* v8,
                                       float* out, int kv_len) {
  SAGE_LDS(int8_t, k_tile, kKeys* kDim);   // [key][dim]
  SAGE_LDS(uint8_t, v_tile, kDim* kKeys);  // [dim][key]
  const int t = sage_thread_id(), lane = sage_lane_id(), wave = sage_wave_id();
  const int head = sage_block_id_y(), q0 = sage_block_id_x() * 64 + wave * 16;
  const int h = lane / 16, r = lane % 16;
  const int64_t qbase = (int64_t(head) * 512 + q0 + r) * kDim;
  v2i32 qa[8];
  for (int s = 0; s < 8; ++s) qa[s] = sage_gload<v2i32>(q8, qbase + s * 16 + 8 * h);
  v8f32 o[8] = {};
  float m = -1e30f, l = 0.0f;
  for (int kt = 0; kt < kv_len; kt += kKeys) {
    for (int i = 0; i < 4; ++i) {  // stage K and V: 128 threads x 16 B x 4
      const int off = (i * kThreads + t) * 16;
      sage_lds_store<u32x4>(k_tile, off,
                            sage_gload<u32x4>(k8, (int64_t(head) * kv_len + kt) * kDim + off));
      const int d = off / kKeys, k = off % kKeys;
      sage_lds_store<u32x4>(v_tile, off,
                            sage_gload<u32x4>(v8, (int64_t(head) * kDim + d) * kv_len + kt + k));
    }
    sage_barrier();
    v8i32 s[4];
    for (int j = 0; j < 4; ++j) {  // S^T = K Q^T: A = K rows (keys), B = Q columns
      s[j] = v8i32{};
      for (int st = 0; st < 8; ++st) {
        v2i32 ka = sage_lds_load<v2i32>(k_tile, (j * 16 + r) * kDim + st * 16 + 8 * h);
        s[j] = sage_wmma_i32_iu8(ka, qa[st], s[j]);
      }
    }
    float mx = m;
    for (int j = 0; j < 4; ++j)
      for (int e = 0; e < 8; ++e) mx = sage_fmaxf(mx, float(s[j][e]) * 0.01f);
    mx = sage_fmaxf(mx, sage_shfl_xor(mx, 16));
    const float alpha = sage_exp2f(m - mx);
    m = mx;
    v2i32 p[4];
    for (int j = 0; j < 4; ++j) {
      float e8[8];
      for (int e = 0; e < 8; ++e) {
        e8[e] = sage_exp2f(float(s[j][e]) * 0.01f - mx);
        l += e8[e];
      }
      p[j].x = sage_cvt_pk_fp8(e8[2] * 448.f, e8[3] * 448.f,
                               sage_cvt_pk_fp8(e8[0] * 448.f, e8[1] * 448.f, 0, false), true);
      p[j].y = sage_cvt_pk_fp8(e8[6] * 448.f, e8[7] * 448.f,
                               sage_cvt_pk_fp8(e8[4] * 448.f, e8[5] * 448.f, 0, false), true);
    }
    for (int c = 0; c < 8; ++c) {  // O^T += V^T P^T
      for (int e = 0; e < 8; ++e) o[c][e] *= alpha;
      for (int j = 0; j < 4; ++j) {
        v2i32 va = sage_lds_load<v2i32>(v_tile, (c * 16 + r) * kKeys + j * 16 + 8 * h);
        o[c] = sage_wmma_f32_fp8(va, p[j], o[c]);
      }
    }
    sage_barrier();
  }
  l += sage_shfl_xor(l, 16);
  for (int c = 0; c < 8; ++c)
    for (int e = 0; e < 8; ++e)
      sage_gstore<float>(out, ((int64_t(head) * 512 + q0 + r) * kDim + c * 16 + 8 * h + e) * 4,
                         o[c][e] / l);
}
