// aiter_sage cpu backend: ISA tier selection, thread count and shared launch checks.
#include "cpu/cpu_runtime.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>

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

namespace {

// How long an idle worker (or a launcher waiting for its workers) polls before it sleeps on a
// condition variable: long enough to bridge the gap between the parallel phases of one launch
// and between prepare and attention, short enough not to steal cores from the next phase.
constexpr auto kSpin = std::chrono::microseconds(50);
constexpr int kPollsPerClockRead = 64;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Polls until done() holds or kSpin has passed; returns done().
template <class Done>
bool spin_until(const Done& done) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < kPollsPerClockRead; ++i) {
      if (done()) return true;
      cpu_relax();
    }
    if (std::chrono::steady_clock::now() >= deadline) return done();
  }
}

// Worker threads that persist between launches. One launch at a time owns the pool (the
// launch mutex); workers 1 .. n-1 of a launch are pool threads 0 .. n-2, woken through a
// generation counter (job_). The pool is never destroyed (its threads sleep through process
// exit; destroying a condition variable that threads wait on is undefined), and a forked
// child starts a new one (the parent's threads do not exist there).
class WorkerPool {
 public:
  // Runs body(ctx, w) for w in [0, threads); false (nothing run) if another launch owns the
  // pool.
  bool try_run(int threads, void (*body)(void*, int), void* ctx) {
    std::unique_lock<std::mutex> owner(launch_, std::try_to_lock);
    if (!owner.owns_lock()) return false;
    grow(threads - 1);
    const int pooled = threads - 1 < int(threads_.size()) ? threads - 1 : int(threads_.size());
    body_ = body;
    ctx_ = ctx;
    pending_.store(pooled, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(m_);
      const uint64_t generation = (job_.load(std::memory_order_relaxed) >> 32) + 1;
      job_.store(generation << 32 | uint32_t(pooled), std::memory_order_release);
    }
    wake_.notify_all();
    body(ctx, 0);
    // Workers the pool could not start (thread limits) run here, after worker 0.
    for (int w = pooled + 1; w < threads; ++w) body(ctx, w);
    const auto finished = [&] { return pending_.load(std::memory_order_acquire) == 0; };
    if (!spin_until(finished)) {
      std::unique_lock<std::mutex> lock(m_);
      done_.wait(lock, finished);
    }
    return true;
  }

 private:
  void grow(int wanted) {
    try {
      while (int(threads_.size()) < wanted) {
        const int index = int(threads_.size());
        const uint64_t seen = job_.load(std::memory_order_relaxed);
        threads_.emplace_back([this, index, seen] { work(index, seen); });
      }
    } catch (const std::system_error&) {
      // Could not start another thread: the launch runs the missing workers itself.
    }
  }

  // A worker acts on the job word it loaded, never on a later launch's fields: if that job
  // counts it in, its launch cannot finish (nor the next one write body_ and ctx_) before it
  // has run; if not, it skips that generation. (With the worker count in a separate field, a
  // worker that loaded generation G and was preempted could read generation G + 1's count,
  // run G + 1's body, then see G + 1 as new and run it again: pending_ went out of step and a
  // launch could wait forever, or return while a worker still ran. The worker-pool probe
  // reproduced that hang within seconds on 2 cores.)
  void work(int index, uint64_t seen) {
    for (;;) {
      uint64_t now = seen;
      const auto posted = [&] {
        now = job_.load(std::memory_order_acquire);
        return now >> 32 != seen >> 32;
      };
      if (!spin_until(posted)) {
        std::unique_lock<std::mutex> lock(m_);
        wake_.wait(lock, posted);
      }
      seen = now;
      if (index >= int(uint32_t(now))) continue;  // not counted in this launch
      body_(ctx_, index + 1);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(m_);
        done_.notify_one();
      }
    }
  }

  std::mutex launch_;  // held by the launch that owns the pool
  std::mutex m_;       // guards the sleeps on wake_ and done_
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  // The posted job: body_ and ctx_ are written by the owning launch before job_ moves
  // (release), and read by the workers it counts in after they see it move (acquire). job_ is
  // the launch's generation (high 32 bits) and its pooled worker count (low 32 bits) in one
  // word, so that a worker reads both from the same launch.
  void (*body_)(void*, int) = nullptr;
  void* ctx_ = nullptr;
  std::atomic<uint64_t> job_{0};
  std::atomic<int> pending_{0};
};

std::atomic<WorkerPool*> g_pool{nullptr};
std::once_flag g_pool_once;

void new_pool_after_fork() { g_pool.store(new WorkerPool, std::memory_order_release); }

WorkerPool& pool() {
  std::call_once(g_pool_once, [] {
    g_pool.store(new WorkerPool, std::memory_order_release);
    pthread_atfork(nullptr, nullptr, new_pool_after_fork);
  });
  return *g_pool.load(std::memory_order_acquire);
}

// Concurrent launches (several Python threads): the ones that find the pool owned start
// their own threads, as before the pool existed.
void run_on_new_threads(int threads, void (*body)(void*, int), void* ctx) {
  std::vector<std::thread> started;
  started.reserve(threads - 1);
  int next = 1;
  try {
    for (; next < threads; ++next) started.emplace_back(body, ctx, next);
  } catch (const std::system_error&) {
    // Could not start a thread: its worker runs on this thread instead.
  }
  body(ctx, 0);
  for (int w = next; w < threads; ++w) body(ctx, w);
  for (auto& t : started) t.join();
}

}  // namespace

thread_local const SageCpuExecutor* t_executor = nullptr;

ExecutorScope::ExecutorScope(const SageCpuExecutor* executor) : outer_(t_executor) {
  t_executor = executor;
}
ExecutorScope::~ExecutorScope() { t_executor = outer_; }

void run_workers(int threads, void (*body)(void* ctx, int worker), void* ctx) {
  if (threads <= 1) {
    body(ctx, 0);
    return;
  }
  if (t_executor) {
    t_executor->run(t_executor->self, threads, body, ctx);
    return;
  }
  if (!pool().try_run(threads, body, ctx)) run_on_new_threads(threads, body, ctx);
}

int resolve_threads(int32_t requested, int64_t work_items) {
  int64_t t = requested > 0 ? requested : int64_t(std::thread::hardware_concurrency());
  if (t < 1) t = 1;
  if (t > work_items) t = work_items < 1 ? 1 : work_items;
  return int(t);
}

}  // namespace sage_cpu
