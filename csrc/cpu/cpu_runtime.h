// aiter_sage cpu backend: what every cpu translation unit shares — the ISA tiers and their
// run-time selection, and a small parallel-for over a persistent std::thread pool (no OpenMP:
// torch ships its own runtime, and two OpenMP runtimes in one process fight over threads).
//
// Exactness note: prepare must be bit-identical to aiter_sage/ref.py, so no a*b+c may be
// contracted into an FMA in the arithmetic it shares with quant.h. GCC with -std=c++17 (ISO
// mode) already uses -ffp-contract=off; clang contracts within an expression by default, so
// we turn that off for every cpu source here. (With -std=gnu++17, GCC would contract: keep
// the ISO -std flag, or add -ffp-contract=off, for this module.)
#pragma once
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#include <stdint.h>
#include <atomic>
#include <exception>
#include <string>
#include <vector>

#include "sage/check.h"
#include "sage/module_abi.h"
#include "sage/params.h"

namespace sage_cpu {

// Code tiers, from portable to widest. Each tier computes bit-identical prepare outputs; the
// attention of every tier is inside ref.BAND (they differ in P's rounding: BF16 vs FP32).
// kAmx: AMX-INT8/BF16 tiles (Sapphire Rapids+), where the OS grants the tile data permission.
// kAmxModel: the amx tier's kernel code on a C++ model of the tile instructions (any CPU, slow;
// only by request, for testing).
enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3, kAmxModel = 4 };

const char* isa_name(Isa isa);
// The tier to run: AITER_SAGE_CPU_ISA=scalar|avx2|avx512|amx|amx_model if set (an error if this
// CPU or OS lacks it), else the widest one the CPU supports (amx, avx512, avx2, scalar; never
// amx_model). Returns false and sets the module error on a bad request.
bool select_isa(Isa* out);

// Worker threads for a launch: p.num_threads, or the hardware concurrency when <= 0, never
// more than there are work items.
int resolve_threads(int32_t requested, int64_t work_items);

// Runs body(worker) for worker = 0 .. threads - 1 in parallel and returns when all are done
// (the calling thread is worker 0). The other workers come from a pool of threads that lives
// as long as the process: starting and joining 15 std::threads per parallel phase cost
// 0.3-4 ms on the VMs we measure on, as much as the whole prepare should take. A launch that
// finds the pool busy (another thread of the process is launching) starts its own threads.
// Exceptions must not leave body (the wrappers below catch them per worker).
// Within a launch given an executor (guarded_launch), the executor runs the workers instead.
void run_workers(int threads, void (*body)(void* ctx, int worker), void* ctx);

// The executor of the launch on this thread (null: the pool), for the scope's lifetime.
class ExecutorScope {
 public:
  explicit ExecutorScope(const SageCpuExecutor* executor);
  ~ExecutorScope();
  ExecutorScope(const ExecutorScope&) = delete;
  ExecutorScope& operator=(const ExecutorScope&) = delete;

 private:
  const SageCpuExecutor* outer_;
};

// Catches what body(worker) throws, per worker, and rethrows the first after all workers
// have finished.
template <class Body>
void run_workers_catching(int threads, const Body& body) {
  if (threads <= 1) {
    body(0);
    return;
  }
  std::vector<std::exception_ptr> errors(threads);
  struct Ctx {
    const Body* body;
    std::exception_ptr* errors;
  } ctx{&body, errors.data()};
  run_workers(
      threads,
      [](void* c, int w) {
        Ctx* x = static_cast<Ctx*>(c);
        try {
          (*x->body)(w);
        } catch (...) {
          x->errors[w] = std::current_exception();
        }
      },
      &ctx);
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// Runs body(begin, end, worker) over [0, n) in `threads` contiguous, near-equal slices (slice
// w goes to worker w). Contiguous slices keep each worker on as few heads as possible, which
// is what the attention's per-head caches rely on. An exception thrown by any worker is
// rethrown here after all workers have finished.
template <class Body>
void parallel_slices(int64_t n, int threads, const Body& body) {
  if (n <= 0) return;
  if (threads <= 1 || n == 1) {
    body(int64_t(0), n, 0);
    return;
  }
  run_workers_catching(threads, [&](int w) {
    const int64_t begin = n * w / threads, end = n * (w + 1) / threads;
    if (begin < end) body(begin, end, w);
  });
}

// Runs body(i, worker) for every i in [0, n), handing items to whichever worker is free
// (in increasing order, `grain` at a time): for items of unequal cost whose results do not
// depend on which worker runs them.
template <class Body>
void parallel_dynamic(int64_t n, int threads, int64_t grain, const Body& body) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  std::atomic<int64_t> next{0};
  run_workers_catching(threads, [&](int w) {
    for (;;) {
      const int64_t begin = next.fetch_add(grain, std::memory_order_relaxed);
      if (begin >= n) return;
      const int64_t end = begin + grain < n ? begin + grain : n;
      for (int64_t i = begin; i < end; ++i) body(i, w);
    }
  });
}

// What the cpu backend implements of contract v2 (sage/check.h): all of it, on every tier.
constexpr sage::Features kCpuFeatures = sage::kAllFeatures;

// The body of both cpu run functions (sage_*_run: params already validated by check_params,
// sage/module_abi.h): refuse a feature the cpu lacks, pick the ISA tier, run, and turn an
// exception (allocation failure, thread creation) into an error message instead of a crash.

// `stream`: the launch's stream argument, null or a SageCpuExecutor (sage/module_abi.h).
template <class Run>
int guarded_run(const SageParams* p, void* stream, sage::Launch launch, Run run) {
  if (!sage::check_features(p, launch, kCpuFeatures, "cpu")) return 1;
  const char* what = launch == sage::Launch::kPrepare ? "prepare" : "attention";
  const auto* executor = static_cast<const SageCpuExecutor*>(stream);
  if (executor && (executor->magic != SAGE_CPU_EXECUTOR_MAGIC || !executor->run))
    return sage::set_error("cpu %s: the stream argument is not a SageCpuExecutor", what);
  Isa isa;
  if (!select_isa(&isa)) return 1;
  ExecutorScope scope(executor);
  try {
    run(*p, isa);
  } catch (const std::exception& e) {
    return sage::set_error("cpu %s failed: %s", what, e.what());
  }
  return 0;
}

}  // namespace sage_cpu
