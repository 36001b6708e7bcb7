// aiter_sage cpu backend: open/close a "compile the following for ISA X" region.
//
//   #include every header first (see below), then
//   #define SAGE_CPU_TARGET "avx2,fma"   (the GCC/clang target string)
//   #include "cpu/isa_region_begin.h"  ...tier code in an anonymous namespace...
//   #include "cpu/isa_region_end.h"
//
// Why headers must come first: an inline function (quant.h, <algorithm>, ...) defined inside
// the region would be compiled for the wide ISA, and the linker may keep that copy for the
// whole module — then the portable tier executes AVX-512 on a CPU without it. Tier code lives
// in anonymous namespaces for the same reason (no shared symbols between tiers).
#pragma once
