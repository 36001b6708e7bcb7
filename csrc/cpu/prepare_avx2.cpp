// aiter_sage cpu prepare, avx2 tier: prepare_kernel.inc compiled for this ISA.
// Every header is included before the target region (see isa_region.h). Off x86 the tier is
// an empty table that select_isa never picks.
#include <string.h>

#include "cpu/prepare_kernels.h"
#include "cpu/cpu_runtime.h"
#include "cpu/isa_region.h"
#include "sage/layout.h"
#include "sage/quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define SAGE_CPU_TARGET "avx2,fma"
#include "cpu/isa_region_begin.h"
namespace {
#include "cpu/prepare_kernel.inc"
}  // namespace
#include "cpu/isa_region_end.h"

namespace sage_cpu {
static_assert(kPrepareVChunk == kVChunk, "prepare_kernels.h and prepare_kernel.inc disagree");
const PrepareKernels kPrepareAvx2 = {quantize_qk_block, v_channel_scales, quantize_v_chunk};
}  // namespace sage_cpu
#else
namespace sage_cpu {
const PrepareKernels kPrepareAvx2 = {nullptr, nullptr, nullptr};
}  // namespace sage_cpu
#endif
