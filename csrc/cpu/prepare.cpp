// aiter_sage cpu backend, module module_gfx1201_sage_prepare: BF16/FP16 Q/K/V -> INT8 Q/K
// with per-32-row scales and transposed FP8 V with per-channel scales (head_dim channels read,
// zero-filled to head_dim_pad), bit-identical to aiter_sage/ref.py prepare (the arithmetic is in
// prepare_kernel.inc, compiled per ISA tier).
//
// Work is split in phases over the worker threads, each needing the one before; within a
// phase, items go to whichever worker is free (they differ in cost, and no result depends on
// which worker computes it):
//   0. smooth_k only: the K mean's partial sums (K heads x 32 partials), then per head their
//      pinned-order total into p.k_mean — K blocks are quantized minus this mean;
//   1. every 32-row block of Q (heads_q; with smooth_k also its rows' p.lse_corr = Q'.k_mean)
//      and of K (heads_kv), and the per-channel |V| maxima of every 256-key group, then per
//      K/V head the V channel scales from its groups' maxima;
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

// Consecutive items a worker takes at once (neighbouring heads of the same rows).
constexpr int64_t kItemsPerGrab = 4;

// Item i of a kind whose items are (batch, index along the sequence, head) in memory order,
// heads fastest: its linear head (b * heads + h) and its index along the sequence.
struct ItemOf {
  int64_t head, index;
};
inline ItemOf split_item(int64_t i, int heads, int64_t per_head) {
  const int64_t h = i % heads, rest = i / heads;
  return {rest / per_head * heads + h, rest % per_head};
}

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

// Phase 0: p.k_mean[b, h, :] = the per-channel mean of the entry's real keys of K in
// sage::k_mean_from_partials' order (0 for an entry without keys).
void compute_k_mean(const SageParams& p, const PrepareKernels& k, int64_t kv_heads) {
  const int dp = p.head_dim_pad;
  const int64_t n = kv_heads * sage::kMeanPartials;
  std::vector<float> partials(size_t(n) * dp);  // [head][partial][channel]
  parallel_dynamic(n, resolve_threads(p.num_threads, n), 1, [&](int64_t i, int) {
    k.k_mean_partial(p, i / sage::kMeanPartials, int(i % sage::kMeanPartials),
                     partials.data() + i * dp);
  });
  float column[sage::kMeanPartials];
  for (int64_t head = 0; head < kv_heads; ++head) {
    const float* head_partials = partials.data() + head * sage::kMeanPartials * dp;
    float* mean = p.k_mean + sage::channel_offset(head, dp, 0);
    const int keys = sage::entry_kv_len(p, head / p.heads_kv);
    for (int c = 0; c < dp; ++c) {
      for (int g = 0; g < sage::kMeanPartials; ++g) column[g] = head_partials[g * dp + c];
      mean[c] = c < p.head_dim && keys > 0 ? sage::k_mean_from_partials(column, keys) : 0.0f;
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

  // Phase 1 items: the Q blocks, then the K blocks, then the V amax groups. Each kind is in
  // memory order, heads fastest: an input row holds every head's channels, so consecutive
  // items (kItemsPerGrab go to one worker at a time) read neighbouring pieces of the same
  // rows. (Head-major order read one 256-byte piece per 4 KiB row: every row a new page,
  // which the hardware prefetchers do not follow, so half of prepare waited on memory.)
  const int64_t v_groups = (p.kv_len + kPrepareVAmaxKeys - 1) / kPrepareVAmaxKeys;
  const int64_t n_q = q_heads * q_blocks, n_k = kv_heads * k_blocks, n_v = kv_heads * v_groups;
  const int64_t n1 = n_q + n_k + n_v;
  const int dp = p.head_dim_pad;
  std::vector<uint32_t> v_amax(size_t(n_v) * dp);  // [head][group][channel]
  parallel_dynamic(n1, resolve_threads(p.num_threads, n1), kItemsPerGrab, [&](int64_t i, int) {
    if (i < n_q) {
      const ItemOf q = split_item(i, p.heads_q, q_blocks);
      k.qk_block(p, true, q.head, q.index);
    } else if (i < n_q + n_k) {
      const ItemOf kb = split_item(i - n_q, p.heads_kv, k_blocks);
      k.qk_block(p, false, kb.head, kb.index);
    } else {
      const ItemOf g = split_item(i - n_q - n_k, p.heads_kv, v_groups);
      k.v_amax(p, g.head, g.index, v_amax.data() + (g.head * v_groups + g.index) * dp);
    }
  });
  for (int64_t head = 0; head < kv_heads; ++head) {
    const uint32_t* groups = v_amax.data() + head * v_groups * dp;
    float* scale = p.v_scale + sage::channel_offset(head, dp, 0);
    for (int c = 0; c < dp; ++c) {
      uint32_t amax = 0;  // |v| bits: the unsigned maximum propagates NaN (see v_amax)
      for (int64_t g = 0; g < v_groups; ++g)
        amax = groups[g * dp + c] > amax ? groups[g * dp + c] : amax;
      scale[c] = sage::v_channel_scale(__builtin_bit_cast(float, amax));
    }
  }
  const int64_t n2 = kv_heads * v_chunks;
  parallel_dynamic(n2, resolve_threads(p.num_threads, n2), kItemsPerGrab, [&](int64_t i, int) {
    const ItemOf c = split_item(i, p.heads_kv, v_chunks);
    k.v_chunk(p, c.head, c.index);
  });
}

}  // namespace
}  // namespace sage_cpu

SAGE_EXPORT int sage_prepare_run(const SageParams* p, void* stream) {
  using namespace sage_cpu;
  return guarded_run(p, stream, sage::Launch::kPrepare, [](const SageParams& params, Isa isa) {
    run_prepare(params, kernels_for(isa));
  });
}
SAGE_DEFINE_CHECKED_LAUNCH(prepare, kPrepare)
