// aiter_sage cpu prepare: the per-tier entry points (prepare_kernel.inc compiled per ISA).
#pragma once
#include <stdint.h>
#include "cpu/cpu_runtime.h"
#include "sage/params.h"

namespace sage_cpu {

struct PrepareKernels {
  // K smoothing: partial sum `g` (< sage::kMeanPartials) of K head `head` per channel, into
  // partial[0 .. head_dim_pad).
  void (*k_mean_partial)(const SageParams& p, int64_t head, int g, float* partial);
  // One 32-row scale block of Q (is_q) or K of linear head `head` (= b * heads + h; heads_q
  // for Q, heads_kv for K). With smooth_k, p.k_mean must be complete first: K blocks subtract
  // it, Q blocks write their rows' p.lse_corr from it.
  void (*qk_block)(const SageParams& p, bool is_q, int64_t head, int64_t block);
  // Per-channel V scales of one K/V head (run before that head's v_chunk items).
  void (*v_scales)(const SageParams& p, int64_t head);
  // One chunk of kPrepareVChunk keys of V: quantize and transpose.
  void (*v_chunk)(const SageParams& p, int64_t head, int64_t chunk);
};
constexpr int kPrepareVChunk = 64;  // must equal kVChunk in prepare_kernel.inc

extern const PrepareKernels kPrepareScalar;
extern const PrepareKernels kPrepareAvx2;
extern const PrepareKernels kPrepareAvx512;

}  // namespace sage_cpu
