// aiter_sage cpu backend, module module_gfx1201_sage_prepare: BF16 Q/K/V -> INT8 Q/K with
// per-32-row scales and transposed FP8 V with per-channel scales, bit-identical to
// aiter_sage/ref.py prepare (the arithmetic is in prepare_kernel.inc, compiled per ISA tier).
//
// Work is split in two phases over std::threads:
//   1. every 32-row block of Q and of K, and every head's V channel scales;
//   2. every 64-key chunk of V (needs its head's scales from phase 1).
// Every byte of the prepared tensors is written, padding included (the binding allocates them
// with torch.empty).
#include <new>

#include "cpu/cpu_runtime.h"
#include "cpu/prepare_kernels.h"
#include "sage/check.h"
#include "sage/layout.h"
#include "sage/module_abi.h"
#include "sage/quant.h"

SAGE_DEFINE_MODULE_ABI("module_gfx1201_sage_prepare target=cpu")

namespace sage_cpu {
namespace {

const PrepareKernels& kernels_for(Isa isa) {
  switch (isa) {
    case Isa::kAmx:  // prepare has no matrix products: the amx tier runs the avx512 prepare
    case Isa::kAvx512:
      return kPrepareAvx512;
    case Isa::kAvx2:
      return kPrepareAvx2;
    case Isa::kAmxModel:  // the model tier must run anywhere: the portable prepare
    case Isa::kScalar:
      break;
  }
  return kPrepareScalar;
}

void run_prepare(const SageParams& p, const PrepareKernels& k) {
  const int64_t heads = int64_t(p.batch) * p.heads_q;
  const int64_t q_blocks = sage::scale_blocks(p.q_len_pad);
  const int64_t k_blocks = sage::scale_blocks(p.kv_len_pad);
  const int64_t v_chunks = (p.kv_len_pad + kPrepareVChunk - 1) / kPrepareVChunk;

  // Phase 1 items, head by head: that head's Q blocks, its K blocks, then its V scales, so
  // contiguous slices get a similar mix of work.
  const int64_t per_head = q_blocks + k_blocks + 1, n1 = heads * per_head;
  parallel_slices(n1, resolve_threads(p.num_threads, n1), [&](int64_t lo, int64_t hi, int) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t head = i / per_head, j = i % per_head;
      if (j < q_blocks)
        k.qk_block(p, true, head, j);
      else if (j < q_blocks + k_blocks)
        k.qk_block(p, false, head, j - q_blocks);
      else
        k.v_scales(p, head);
    }
  });
  const int64_t n2 = heads * v_chunks;
  parallel_slices(n2, resolve_threads(p.num_threads, n2), [&](int64_t lo, int64_t hi, int) {
    for (int64_t i = lo; i < hi; ++i) k.v_chunk(p, i / v_chunks, i % v_chunks);
  });
}

}  // namespace
}  // namespace sage_cpu

SAGE_EXPORT int sage_prepare_launch(const SageParams* p, void* /*stream: unused on the cpu*/) {
  using namespace sage_cpu;
  return guarded_launch(p, sage::Launch::kPrepare, [](const SageParams& params, Isa isa) {
    run_prepare(params, kernels_for(isa));
  });
}
