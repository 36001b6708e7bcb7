// aiter_sage cpu backend, module module_gfx1201_sage_prepare: BF16/FP16 Q/K/V -> INT8 Q/K
// with per-32-row scales and transposed FP8 V with per-channel scales (head_dim channels read,
// zero-filled to head_dim_pad), bit-identical to aiter_sage/ref.py prepare (the arithmetic is in
// prepare_kernel.inc, compiled per ISA tier).
//
// Work is split in phases over std::threads, each needing the one before:
//   0. smooth_k only: the K mean's partial sums (K heads x 32 partials), then per head their
//      pinned-order total into p.k_mean — K blocks are quantized minus this mean;
//   1. every 32-row block of Q (heads_q; with smooth_k also its rows' p.lse_corr = Q'.k_mean)
//      and of K (heads_kv), and every K/V head's V channel scales;
//   2. every 64-key chunk of V (needs its head's scales from phase 1).
// Every byte of the prepared tensors is written, padding included (the binding allocates them
// with torch.empty).
#include <new>
#include <vector>

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

// Phase 0: p.k_mean[b, h, :] = the per-channel mean of K in sage::k_mean_from_partials' order.
void compute_k_mean(const SageParams& p, const PrepareKernels& k, int64_t kv_heads) {
  const int dp = p.head_dim_pad;
  const int64_t n = kv_heads * sage::kMeanPartials;
  std::vector<float> partials(size_t(n) * dp);  // [head][partial][channel]
  parallel_slices(n, resolve_threads(p.num_threads, n), [&](int64_t lo, int64_t hi, int) {
    for (int64_t i = lo; i < hi; ++i)
      k.k_mean_partial(p, i / sage::kMeanPartials, int(i % sage::kMeanPartials),
                       partials.data() + i * dp);
  });
  float column[sage::kMeanPartials];
  for (int64_t head = 0; head < kv_heads; ++head) {
    const float* head_partials = partials.data() + head * sage::kMeanPartials * dp;
    float* mean = p.k_mean + sage::channel_offset(head, dp, 0);
    for (int c = 0; c < dp; ++c) {
      for (int g = 0; g < sage::kMeanPartials; ++g) column[g] = head_partials[g * dp + c];
      mean[c] = c < p.head_dim ? sage::k_mean_from_partials(column, p.kv_len) : 0.0f;
    }
  }
}

void run_prepare(const SageParams& p, const PrepareKernels& k) {
  const int64_t q_heads = int64_t(p.batch) * p.heads_q;
  const int64_t kv_heads = int64_t(p.batch) * p.heads_kv;
  const int64_t q_blocks = sage::scale_blocks(p.q_len_pad);
  const int64_t k_blocks = sage::scale_blocks(p.kv_len_pad);
  const int64_t v_chunks = (p.kv_len_pad + kPrepareVChunk - 1) / kPrepareVChunk;

  if (p.smooth_k) compute_k_mean(p, k, kv_heads);

  // Phase 1 items: the Q blocks, then the K blocks, then the V scales, each head-major.
  const int64_t n_q = q_heads * q_blocks, n_k = kv_heads * k_blocks;
  const int64_t n1 = n_q + n_k + kv_heads;
  parallel_slices(n1, resolve_threads(p.num_threads, n1), [&](int64_t lo, int64_t hi, int) {
    for (int64_t i = lo; i < hi; ++i) {
      if (i < n_q)
        k.qk_block(p, true, i / q_blocks, i % q_blocks);
      else if (i < n_q + n_k)
        k.qk_block(p, false, (i - n_q) / k_blocks, (i - n_q) % k_blocks);
      else
        k.v_scales(p, i - n_q - n_k);
    }
  });
  const int64_t n2 = kv_heads * v_chunks;
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
