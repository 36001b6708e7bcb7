// aiter_sage cpu prepare, portable tier: no target attributes
// (runs on any host; the compiler may still use the baseline SIMD, e.g. SSE2).
#define SAGE_CPU_TIER_TABLE kPrepareScalar
#include "cpu/prepare_tier.inc"
