// aiter_sage cpu prepare, portable tier: prepare_kernel.inc with no target attributes (runs on
// any x86-64 or other host; the compiler may still use the baseline SIMD, e.g. SSE2).
#include <string.h>

#include "cpu/cpu_runtime.h"
#include "cpu/prepare_kernels.h"
#include "sage/layout.h"
#include "sage/quant.h"

namespace {
#include "cpu/prepare_kernel.inc"
}  // namespace

namespace sage_cpu {
static_assert(kPrepareVChunk == kVChunk, "prepare_kernels.h and prepare_kernel.inc disagree");
const PrepareKernels kPrepareScalar = {quantize_qk_block, v_channel_scales, quantize_v_chunk};
}  // namespace sage_cpu
