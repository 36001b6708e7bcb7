// aiter_sage cpu attention, AVX-512 tier (VNNI + BF16).
#define SAGE_CPU_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16"
#define SAGE_CPU_SIMD_HEADER "cpu/simd_avx512.h"
#define SAGE_CPU_TIER_TABLE kAttentionAvx512
#include "cpu/attention_tier.inc"
