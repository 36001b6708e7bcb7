// aiter_sage cpu attention, avx512 tier: simd_avx512.h + attention_kernel.inc compiled for this ISA.
// Every header is included before the target region (see isa_region.h). Off x86 the tier is
// an empty table that select_isa never picks.
#include <math.h>
#include <string.h>

#include "cpu/attention_kernels.h"
#include "cpu/cpu_runtime.h"
#include "cpu/isa_region.h"
#include "sage/layout.h"
#include "sage/quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define SAGE_CPU_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16"
#include "cpu/isa_region_begin.h"
namespace {
#include "cpu/simd_avx512.h"
#include "cpu/attention_kernel.inc"
}  // namespace
#include "cpu/isa_region_end.h"

namespace sage_cpu {
const AttentionKernels kAttentionAvx512 = {work_items, workspace_bytes, run_items};
}  // namespace sage_cpu
#else
namespace sage_cpu {
const AttentionKernels kAttentionAvx512 = {nullptr, nullptr, nullptr};
}  // namespace sage_cpu
#endif
