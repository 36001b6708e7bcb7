// aiter_sage cpu attention: the per-tier entry points (attention_kernel.inc compiled per ISA).
#pragma once
#include <stddef.h>
#include <stdint.h>
#include "sage/params.h"

namespace sage_cpu {

// The kernel of one head dim (head_dim_pad).
struct AttentionKernel {
  // Independent work items (query heads x query blocks), in head-major order (the query heads
  // of one GQA group are consecutive, so they share a worker's K/V head cache).
  int64_t (*work_items)(const SageParams& p);
  // Scratch bytes one worker needs (64-byte aligned base).
  size_t (*workspace_bytes)(const SageParams& p);
  // Prepares one worker's scratch (once, before its first run_items).
  void (*init_workspace)(const SageParams& p, void* scratch);
  // Runs items [begin, end) with one worker's scratch.
  void (*run_items)(const SageParams& p, int64_t begin, int64_t end, void* scratch);
};

// One tier: its kernel per head dim.
struct AttentionKernels {
  AttentionKernel head_dim_small;  // head_dim_pad == SAGE_HEAD_DIM_SMALL (64)
  AttentionKernel head_dim_large;  // head_dim_pad == SAGE_HEAD_DIM_LARGE (128)
};

extern const AttentionKernels kAttentionScalar;
extern const AttentionKernels kAttentionAvx2;
extern const AttentionKernels kAttentionAvx512;
extern const AttentionKernels kAttentionAmx;
extern const AttentionKernels kAttentionAmxModel;

}  // namespace sage_cpu
