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
  // Per-channel |v| maximum (float32 bits, NaN above inf; 0 in channels >= head_dim) of one
  // K/V head over keys [group * kPrepareVAmaxKeys, +kPrepareVAmaxKeys) below kv_len, into
  // partial[0 .. head_dim_pad).
  void (*v_amax)(const SageParams& p, int64_t head, int64_t group, uint32_t* partial);
  // One chunk of kPrepareVChunk keys of V: quantize and transpose (needs p.v_scale of its
  // head).
  void (*v_chunk)(const SageParams& p, int64_t head, int64_t chunk);
};
constexpr int kPrepareVChunk = 64;      // must equal kVChunk in prepare_kernel.inc
constexpr int kPrepareVAmaxKeys = 256;  // must equal kVAmaxKeys in prepare_kernel.inc

extern const PrepareKernels kPrepareScalar;
extern const PrepareKernels kPrepareAvx2;
extern const PrepareKernels kPrepareAvx512;

}  // namespace sage_cpu
