// aiter_sage cpu prepare, AVX-512 tier (VNNI + BF16).
#define SAGE_CPU_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16"
#define SAGE_CPU_TIER_TABLE kPrepareAvx512
#include "cpu/prepare_tier.inc"
