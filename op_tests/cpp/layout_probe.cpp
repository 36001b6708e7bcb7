// Host probe of csrc/include/sage/layout.h and quant.h for op_tests/test_layout.py.
#include "sage/layout.h"
#include "sage/module_abi.h"
#include "sage/quant.h"

SAGE_DEFINE_MODULE_ABI("layout_probe target=cpu")

// offsets[i] for coordinates (head, s_pad, a, b) per kind: 0 qk8 (s, d), 1 qk scale (s, -),
// 2 v8 (d, s), 3 v scale (d, -).
SAGE_EXPORT int sage_layout_offset(int kind, int64_t head, int64_t s_pad, int64_t a, int64_t b,
                                   int64_t* out) {
  switch (kind) {
    case 0: *out = sage::qk8_offset(head, s_pad, a, b); return 0;
    case 1: *out = sage::qk_scale_offset(head, s_pad, a); return 0;
    case 2: *out = sage::v8_offset(head, s_pad, a, b); return 0;
    case 3: *out = sage::v_scale_offset(head, a); return 0;
  }
  return 1;
}
SAGE_EXPORT int64_t sage_padded_len(int64_t n) { return sage::padded_len(n); }
SAGE_EXPORT uint8_t sage_e4m3(float x) { return sage::f32_to_e4m3_sat(x); }
SAGE_EXPORT float sage_e4m3_decode(uint8_t b) { return sage::e4m3_to_f32(b); }
SAGE_EXPORT int8_t sage_quant_i8(float x, float s) { return sage::quant_i8(x, s); }
SAGE_EXPORT uint16_t sage_f32_to_bf16(float x) { return sage::f32_to_bf16(x); }
