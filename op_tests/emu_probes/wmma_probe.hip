// Emulator probe: one wave loads 16x16 tiles in the gfx12 WMMA lane layout (csrc/gfx12/README.md,
// "gfx12 WMMA facts"), runs one WMMA and stores D. The host test compares with a scalar matmul.
//   A: [16][16] row-major (M x K), Bt: [16][16] row-major (N x K, i.e. B transposed),
//   C, D: [16][16] row-major (M x N).
#include "sage/platform.h"

// Lane layout: h = lane / 16, r = lane % 16. A/B: 8 consecutive K values 8h..8h+7 of row r
// (of A, or of Bt = column r of B); C/D: rows 8h + j of column r.
SAGE_DEVICE v2i32 load_ab(const void* m, int lane) {
  return sage_gload<v2i32>(m, (lane % 16) * 16 + 8 * (lane / 16));
}
template <class V, class E>
SAGE_DEVICE V load_cd(const E* c, int lane) {
  V v;
  for (int j = 0; j < 8; ++j)
    v[j] = sage_gload<E>(c, int64_t(((8 * (lane / 16) + j) * 16 + lane % 16) * sizeof(E)));
  return v;
}
template <class V, class E>
SAGE_DEVICE void store_cd(E* d, int lane, V v) {
  for (int j = 0; j < 8; ++j)
    sage_gstore<E>(d, int64_t(((8 * (lane / 16) + j) * 16 + lane % 16) * sizeof(E)), E(v[j]));
}

#define IU8_PROBE(name, sa, sb, cl)                                                   \
  SAGE_KERNEL(name, 32)(const int8_t* a, const int8_t* bt, const int* c, int* d) {    \
    const int lane = sage_lane_id();                                                  \
    v8i32 acc = load_cd<v8i32, int>(c, lane);                                         \
    acc = sage_wmma_i32_iu8_ex<sa, sb, cl>(load_ab(a, lane), load_ab(bt, lane), acc); \
    store_cd<v8i32, int>(d, lane, acc);                                               \
  }
IU8_PROBE(probe_wmma_iu8_ss, true, true, false)
IU8_PROBE(probe_wmma_iu8_su, true, false, false)
IU8_PROBE(probe_wmma_iu8_us, false, true, false)
IU8_PROBE(probe_wmma_iu8_uu, false, false, false)
IU8_PROBE(probe_wmma_iu8_ss_clamp, true, true, true)
IU8_PROBE(probe_wmma_iu8_su_clamp, true, false, true)
IU8_PROBE(probe_wmma_iu8_us_clamp, false, true, true)
IU8_PROBE(probe_wmma_iu8_uu_clamp, false, false, true)

// The plain entry point: signed x signed, no clamp.
SAGE_KERNEL(probe_wmma_iu8_default, 32)(const int8_t* a, const int8_t* bt, const int* c, int* d) {
  const int lane = sage_lane_id();
  v8i32 acc = load_cd<v8i32, int>(c, lane);
  acc = sage_wmma_i32_iu8(load_ab(a, lane), load_ab(bt, lane), acc);
  store_cd<v8i32, int>(d, lane, acc);
}

SAGE_KERNEL(probe_wmma_fp8, 32)(const uint8_t* a, const uint8_t* bt, const float* c, float* d) {
  const int lane = sage_lane_id();
  v8f32 acc = load_cd<v8f32, float>(c, lane);
  acc = sage_wmma_f32_fp8(load_ab(a, lane), load_ab(bt, lane), acc);
  store_cd<v8f32, float>(d, lane, acc);
}

// v_cvt_pk_fp8_f32 in both halves: thread i converts x[4i..4i+3] into
//   out[2i]   = cvt(x0, x1, old = 0xCAFEBABE, low half)   (0xCAFE must survive)
//   out[2i+1] = cvt(x2, x3, old = out[2i], high half)     (the low half must survive)
SAGE_KERNEL(probe_cvt_pk_fp8, 256)(const float* x, int* out, int n) {
  const int i = sage_block_id_x() * 256 + sage_thread_id();
  if (i >= n) return;
  const float* p = x + 4 * i;
  const int lo =
      sage_cvt_pk_fp8(sage_gload<float>(p, 0), sage_gload<float>(p, 4), int(0xCAFEBABEu), false);
  const int both = sage_cvt_pk_fp8(sage_gload<float>(p, 8), sage_gload<float>(p, 12), lo, true);
  sage_gstore<int>(out, 8 * int64_t(i), lo);
  sage_gstore<int>(out, 8 * int64_t(i) + 4, both);
}

// Cross-lane and math builtins; one workgroup of 64 threads (2 waves), lanes 28..31 of wave 1
// return early to exercise partial waves. out: [64][8] floats.
SAGE_KERNEL(probe_lanes, 64)(const float* x, float* out) {
  const int t = sage_thread_id(), lane = sage_lane_id();
  if (sage_wave_id() == 1 && lane >= 28) return;
  const float v = sage_gload<float>(x, 4 * t);
  float* o = out + 8 * t;
  sage_gstore<float>(o, 0, sage_shfl_xor(v, 1));
  sage_gstore<float>(o, 4, sage_shfl_xor(v, 16));
  sage_gstore<float>(o, 8, float(sage_shfl_xor(t, 5)));
  sage_gstore<float>(o, 12, sage_readlane(v, 3));
  sage_gstore<float>(o, 16, sage_exp2f(v));
  sage_gstore<float>(o, 20, sage_rcpf(v));
  sage_gstore<float>(o, 24, sage_sqrtf(sage_fabsf(v)));
  sage_gstore<float>(o, 28, sage_fmaxf(sage_rintf(v), sage_fminf(v, 0.5f)));
}
