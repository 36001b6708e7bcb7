// aiter_sage cpu attention, AVX2 tier.
#define SAGE_CPU_TARGET "avx2,fma"
#define SAGE_CPU_SIMD_HEADER "cpu/simd_avx2.h"
#define SAGE_CPU_TIER_TABLE kAttentionAvx2
// Register tiles for 16 ymm registers (the 4 x 4 default assumes AVX-512's 32: with 16
// accumulators the operands spilled): Q.K^T 2 keys x 4 row vectors (8 accumulators + 4 Q
// vectors + a broadcast), P.V 4 channels x 2 row vectors. Same arithmetic, same bits; measured
// with op_benchmarks/cpu/bench_cpu_phases.cpp on a 2-core AVX2 EPYC, S=4096 H=8: attention
// 1372 -> 1110 ms (2x4 / 4x2 beat 4x2 / 4x2, 2x2 / 4x2, 4x1 / 4x2 and 2x4 / 8x1).
#define SAGE_CPU_QK_KEYS 2
#define SAGE_CPU_QK_VECS 4
#define SAGE_CPU_PV_CHANS 4
#define SAGE_CPU_PV_VECS 2
#include "cpu/attention_tier.inc"
