// aiter_sage cpu backend: ISA tier selection, thread count and shared launch checks.
#include "cpu/cpu_runtime.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "sage/layout.h"
#include "sage/module_abi.h"

namespace sage_cpu {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAmx:
      return "amx";
    case Isa::kAmxModel:
      return "amx_model";
  }
  return "?";
}

namespace {

// CPUID.(EAX=7, ECX=0):EDX bits 22 (AMX-BF16), 24 (AMX-TILE) and 25 (AMX-INT8).
bool cpuid_has_amx() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const unsigned amx = (1u << 22) | (1u << 24) | (1u << 25);
  return (edx & amx) == amx;
#else
  return false;
#endif
}

// Linux hands out the AMX tile data state (8 KiB per thread) only to a process that asks for
// it; without it the first tile instruction raises SIGILL. The grant covers every thread of
// the process, present and future. Returns whether the permission is held.
bool request_amx_permission() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr int kArchReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM (asm/prctl.h)
  constexpr int kXfeatureXtiledata = 18;     // XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;  // other OSes: not wired up, the next tier runs
#endif
}

// AMX present and usable: asked once per process (static init is thread-safe).
bool amx_usable() {
  static const bool usable = cpuid_has_amx() && request_amx_permission();
  return usable;
}

}  // namespace

static bool cpu_has(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAmxModel:
      return true;
    case Isa::kAmx:
      return cpu_has(Isa::kAvx512) && amx_usable();
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kAvx512:
      // The avx512 tier uses VNNI for Q.K^T and AVX512_BF16 for P.V (Zen 4+, Sapphire Rapids+).
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
             __builtin_cpu_supports("avx512bf16");
  }
  return false;
#else
  return isa == Isa::kScalar || isa == Isa::kAmxModel;
#endif
}

bool select_isa(Isa* out) {
  const char* env = getenv("AITER_SAGE_CPU_ISA");
  if (env && *env) {
    Isa want;
    if (!strcmp(env, "scalar"))
      want = Isa::kScalar;
    else if (!strcmp(env, "avx2"))
      want = Isa::kAvx2;
    else if (!strcmp(env, "avx512"))
      want = Isa::kAvx512;
    else if (!strcmp(env, "amx"))
      want = Isa::kAmx;
    else if (!strcmp(env, "amx_model"))
      want = Isa::kAmxModel;
    else {
      sage::set_error("AITER_SAGE_CPU_ISA=%s: expected scalar, avx2, avx512, amx or amx_model",
                      env);
      return false;
    }
    if (!cpu_has(want)) {
      if (want == Isa::kAmx && cpu_has(Isa::kAvx512) && cpuid_has_amx())
        sage::set_error(
            "AITER_SAGE_CPU_ISA=amx: this CPU has AMX but the OS refused the tile "
            "data permission (arch_prctl ARCH_REQ_XCOMP_PERM): this process lacks "
            "the amx tier");
      else
        sage::set_error("AITER_SAGE_CPU_ISA=%s: this CPU lacks the %s tier's instructions", env,
                        env);
      return false;
    }
    *out = want;
    return true;
  }
  *out = cpu_has(Isa::kAmx)      ? Isa::kAmx
         : cpu_has(Isa::kAvx512) ? Isa::kAvx512
         : cpu_has(Isa::kAvx2)   ? Isa::kAvx2
                                 : Isa::kScalar;
  return true;
}

int resolve_threads(int32_t requested, int64_t work_items) {
  int64_t t = requested > 0 ? requested : int64_t(std::thread::hardware_concurrency());
  if (t < 1) t = 1;
  if (t > work_items) t = work_items < 1 ? 1 : work_items;
  return int(t);
}

}  // namespace sage_cpu
