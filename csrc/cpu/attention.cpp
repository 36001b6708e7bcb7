// aiter_sage cpu backend, module module_gfx1201_sage_attention: attention on prepared tensors
// (INT8 Q/K with block scales, transposed FP8 V with channel scales) -> out_dtype
// [B, out_rows, Hq, head_dim] (and optionally the LSE). The kernel is attention_kernel.inc,
// compiled per ISA tier and head dim; this file validates, picks the tier and the head-dim
// variant and spreads (query head, query block) items over the worker threads in contiguous
// ranges that idle workers help with, each worker with its own scratch (which caches the K/V
// of the K/V head it is on).
#include <stdlib.h>

#include <atomic>
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

// The one place where the runtime head dim becomes the compile-time kernel variant.
const AttentionKernel& kernel_for_head_dim(const SageParams& p, const AttentionKernels& tier) {
  return p.head_dim_pad == SAGE_HEAD_DIM_SMALL ? tier.head_dim_small : tier.head_dim_large;
}

// One worker's share of the items: a contiguous range (head-major, so the worker rebuilds its
// head cache only where the range crosses a head), taken one item at a time through an atomic
// cursor so that other workers can take items from it too.
struct alignas(64) ItemRange {
  std::atomic<int64_t> next{0};
  int64_t end = 0;
  int64_t left() const { return end - next.load(std::memory_order_relaxed); }
};

// Runs the items of `own`, then helps the worker with the most items left: equal shares of
// equal items still finish at different times on a shared machine (a vCPU that the host
// preempts, a core at a lower clock) and causal items differ in cost, so a static split waits
// for the slowest worker. A taken item of another head costs one head-cache rebuild.
template <class RunItem>
void run_and_help(std::vector<ItemRange>& ranges, int own, const RunItem& run_item) {
  for (int64_t i; (i = ranges[own].next.fetch_add(1, std::memory_order_relaxed)) < ranges[own].end;)
    run_item(i);
  for (;;) {
    int victim = -1;
    int64_t most = 0;
    for (int v = 0; v < int(ranges.size()); ++v)
      if (ranges[v].left() > most) most = ranges[v].left(), victim = v;
    if (victim < 0) return;
    const int64_t i = ranges[victim].next.fetch_add(1, std::memory_order_relaxed);
    if (i < ranges[victim].end) run_item(i);
  }
}

void run_attention(const SageParams& p, const AttentionKernels& tier) {
  const AttentionKernel& k = kernel_for_head_dim(p, tier);
  const int64_t items = k.work_items(p);
  const int threads = resolve_threads(p.num_threads, items);
  std::vector<ItemRange> ranges(threads);
  for (int w = 0; w < threads; ++w) {
    ranges[w].next.store(items * w / threads, std::memory_order_relaxed);
    ranges[w].end = items * (w + 1) / threads;
  }
  run_workers_catching(threads, [&](int w) {
    AlignedBuffer scratch(k.workspace_bytes(p));
    k.init_workspace(p, scratch.ptr);
    run_and_help(ranges, w, [&](int64_t i) { k.run_items(p, i, i + 1, scratch.ptr); });
  });
}

}  // namespace
}  // namespace sage_cpu

SAGE_EXPORT int sage_attention_run(const SageParams* p, void* stream) {
  using namespace sage_cpu;
  return guarded_run(p, stream, sage::Launch::kAttention, [](const SageParams& params, Isa isa) {
    run_attention(params, kernels_for(isa));
  });
}
SAGE_DEFINE_CHECKED_LAUNCH(attention, kAttention)
