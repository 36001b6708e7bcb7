// aiter_sage cpu backend: ISA tier selection, thread count and shared launch checks.
#include "cpu/cpu_runtime.h"

#include <stdlib.h>
#include <string.h>

#include "sage/layout.h"
#include "sage/module_abi.h"

namespace sage_cpu {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

static bool cpu_has(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  switch (isa) {
    case Isa::kScalar: return true;
    case Isa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kAvx512:
      // The avx512 tier uses VNNI for Q.K^T and AVX512_BF16 for P.V (Zen 4+, Sapphire Rapids+).
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
             __builtin_cpu_supports("avx512bf16");
  }
  return false;
#else
  return isa == Isa::kScalar;
#endif
}

bool select_isa(Isa* out) {
  const char* env = getenv("AITER_SAGE_CPU_ISA");
  if (env && *env) {
    Isa want;
    if (!strcmp(env, "scalar")) want = Isa::kScalar;
    else if (!strcmp(env, "avx2")) want = Isa::kAvx2;
    else if (!strcmp(env, "avx512")) want = Isa::kAvx512;
    else {
      sage::set_error("AITER_SAGE_CPU_ISA=%s: expected scalar, avx2 or avx512", env);
      return false;
    }
    if (!cpu_has(want)) {
      sage::set_error("AITER_SAGE_CPU_ISA=%s: this CPU lacks the %s tier's instructions", env,
                      env);
      return false;
    }
    *out = want;
    return true;
  }
  *out = cpu_has(Isa::kAvx512) ? Isa::kAvx512 : cpu_has(Isa::kAvx2) ? Isa::kAvx2 : Isa::kScalar;
  return true;
}

int resolve_threads(int32_t requested, int64_t work_items) {
  int64_t t = requested > 0 ? requested : int64_t(std::thread::hardware_concurrency());
  if (t < 1) t = 1;
  if (t > work_items) t = work_items < 1 ? 1 : work_items;
  return int(t);
}

}  // namespace sage_cpu
