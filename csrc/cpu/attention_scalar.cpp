// aiter_sage cpu attention, portable tier: simd_scalar.h + attention_kernel.inc with no target
// attributes (runs on any x86-64 or other host).
#include <math.h>
#include <string.h>

#include "cpu/attention_kernels.h"
#include "cpu/cpu_runtime.h"
#include "sage/layout.h"
#include "sage/quant.h"

namespace {
#include "cpu/simd_scalar.h"
#include "cpu/attention_kernel.inc"
}  // namespace

namespace sage_cpu {
const AttentionKernels kAttentionScalar = {work_items, workspace_bytes, run_items};
}  // namespace sage_cpu
