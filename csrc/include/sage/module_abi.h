// aiter_sage: the C ABI every kernel module exports. Include from exactly one translation unit
// of a module and invoke SAGE_DEFINE_MODULE_ABI(...) once; launch functions report failures
// through sage::set_error() and return non-zero.
//
// Exported symbols (resolved by the torch binding with dlsym):
//   int         sage_abi_version(void);          == SAGE_ABI_VERSION of the build
//   const char* sage_module_info(void);           "<module> target=<target>" (for messages)
//   const char* sage_module_last_error(void);     message of this thread's last failure
//   long long   sage_module_check_count(void);    sage::check_params calls in this module
//   int         sage_prepare_launch(const SageParams*, void* stream);    prepare modules
//   int         sage_attention_launch(const SageParams*, void* stream);  attention modules
//   int         sage_prepare_run(const SageParams*, void* stream);       the same launches
//   int         sage_attention_run(const SageParams*, void* stream);     without check_params
// The *_launch functions are the C ABI: they validate the params (sage/check.h) and then run.
// The *_run functions skip that validation, for a caller that has run sage::check_params on
// these very params: the torch binding validates each op call once, before it allocates, and
// then calls *_run (SAGE_DEFINE_CHECKED_LAUNCH in sage/check.h derives *_launch from *_run).
// A GPU module's stream is the HIP/CUDA stream to launch on. A cpu module's stream is null (it
// runs its parallel phases on its own worker pool) or points at a SageCpuExecutor.
#pragma once
#include "sage/params.h"

// The caller's threads for a cpu launch. The torch binding passes one that runs the workers on
// torch's intra-op threads: after a torch op, those threads still spin (OpenMP's wait policy)
// for a while, and a pool of our own beside them would share the cores with them (a cpu
// attention call right after torch's SDPA took 23 ms instead of 19 on a 16-core Xeon).
// run(self, workers, body, ctx) must call body(ctx, w) exactly once for each w in
// [0, workers) and return after all of them have returned; the calls may run on any threads,
// in any order, concurrently or one after another (the bodies never wait for each other), and
// never throw.
#define SAGE_CPU_EXECUTOR_MAGIC 0x53414745u  // "SAGE": catches a stray pointer passed as stream
struct SageCpuExecutor {
  uint32_t magic;  // SAGE_CPU_EXECUTOR_MAGIC
  void (*run)(void* self, int workers, void (*body)(void* ctx, int worker), void* ctx);
  void* self;
};
// The device half of a hiprtc build has no host launch section and no <stdio.h>.
#if !defined(SAGE_HIPRTC)
#include <stdio.h>

#include <atomic>

namespace sage {
inline char* last_error_buffer() {
  static thread_local char buf[1024] = {0};
  return buf;
}
// printf-style; returns 1 so callers can `return sage::set_error(...)`.
template <class... Args>
inline int set_error(const char* fmt, Args... args) {
  snprintf(last_error_buffer(), 1024, fmt, args...);
  return 1;
}
inline int set_error(const char* msg) {
  snprintf(last_error_buffer(), 1024, "%s", msg);
  return 1;
}
// How many times sage::check_params ran in this shared object (each module and the binding
// have their own count; hidden visibility keeps them apart): the tests read it to show that
// one op call is validated once.
inline std::atomic<long long>& check_calls() {
  static std::atomic<long long> count{0};
  return count;
}
}  // namespace sage

#define SAGE_EXPORT extern "C" __attribute__((visibility("default")))

#define SAGE_DEFINE_MODULE_ABI(info)                                                         \
  SAGE_EXPORT int sage_abi_version(void) { return SAGE_ABI_VERSION; }                        \
  SAGE_EXPORT const char* sage_module_info(void) { return info; }                            \
  SAGE_EXPORT const char* sage_module_last_error(void) { return sage::last_error_buffer(); } \
  SAGE_EXPORT long long sage_module_check_count(void) { return sage::check_calls().load(); }
#endif  // !SAGE_HIPRTC
