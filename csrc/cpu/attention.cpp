// aiter_sage cpu backend, module module_gfx1201_sage_attention: attention on prepared tensors
// (INT8 Q/K with block scales, transposed FP8 V with channel scales) -> BF16 [B, q_len, H, 128].
// The kernel is attention_kernel.inc, compiled per ISA tier; this file validates, picks the
// tier and spreads (head, query block) items over std::threads in contiguous slices, each
// worker with its own scratch (which caches the K/V of the head it is on).
#include <stdlib.h>

#include <new>
#include <vector>

#include "cpu/attention_kernels.h"
#include "cpu/cpu_runtime.h"
#include "sage/check.h"
#include "sage/layout.h"
#include "sage/module_abi.h"

SAGE_DEFINE_MODULE_ABI("module_gfx1201_sage_attention target=cpu")

namespace sage_cpu {
namespace {

const AttentionKernels& kernels_for(Isa isa) {
  switch (isa) {
    case Isa::kAmx:
      return kAttentionAmx;
    case Isa::kAmxModel:
      return kAttentionAmxModel;
    case Isa::kAvx512:
      return kAttentionAvx512;
    case Isa::kAvx2:
      return kAttentionAvx2;
    case Isa::kScalar:
      break;
  }
  return kAttentionScalar;
}

struct AlignedBuffer {
  void* ptr = nullptr;
  explicit AlignedBuffer(size_t bytes) {
    if (posix_memalign(&ptr, 64, bytes ? bytes : 64) != 0) throw std::bad_alloc();
  }
  ~AlignedBuffer() { free(ptr); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
};

void run_attention(const SageParams& p, const AttentionKernels& k) {
  const int64_t items = k.work_items(p);
  const int threads = resolve_threads(p.num_threads, items);
  parallel_slices(items, threads, [&](int64_t lo, int64_t hi, int) {
    AlignedBuffer scratch(k.workspace_bytes(p));
    k.run_items(p, lo, hi, scratch.ptr);
  });
}

}  // namespace
}  // namespace sage_cpu

SAGE_EXPORT int sage_attention_launch(const SageParams* p, void* /*stream: unused on the cpu*/) {
  using namespace sage_cpu;
  return guarded_launch(p, sage::Launch::kAttention, [](const SageParams& params, Isa isa) {
    run_attention(params, kernels_for(isa));
  });
}
