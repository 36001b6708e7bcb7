// Stress probe of the cpu backend's worker pool (csrc/cpu/cpu_runtime.cpp: run_workers):
// many launches in a row whose thread counts alternate between small and large, so that pool
// threads sit out one launch and are needed by the next. After each launch every worker index
// must have run exactly once, and none may still be running. Prints the first violation and
// exits 1; prints "ok" and exits 0 otherwise. Usage: worker_pool_probe LAUNCHES MAX_THREADS
#include <stdio.h>
#include <stdlib.h>

#include <atomic>

#include "cpu/cpu_runtime.h"

namespace {

constexpr int kMaxThreads = 64;

struct Launch {
  std::atomic<int> runs[kMaxThreads];
  std::atomic<int> running{0};
};

void body(void* ctx, int worker) {
  auto* launch = static_cast<Launch*>(ctx);
  launch->running.fetch_add(1);
  launch->runs[worker].fetch_add(1);
  for (volatile int spin = 0; spin < 200 * (worker % 3); spin = spin + 1) {
  }
  launch->running.fetch_sub(1);
}

}  // namespace

int main(int argc, char** argv) {
  const long launches = argc > 1 ? atol(argv[1]) : 20000;
  int max_threads = argc > 2 ? atoi(argv[2]) : 16;
  if (max_threads > kMaxThreads) max_threads = kMaxThreads;
  for (long i = 0; i < launches; ++i) {
    // 2, max, 3, max - 1, ...: the small launches leave most pool threads out
    int threads = i % 2 ? max_threads - int(i / 2 % 4) : 2 + int(i / 2 % 3);
    threads = threads < 1 ? 1 : threads > max_threads ? max_threads : threads;
    Launch launch;
    for (auto& r : launch.runs) r.store(0);
    sage_cpu::run_workers(threads, body, &launch);
    for (int w = 0; w < kMaxThreads; ++w) {
      const int want = w < threads ? 1 : 0;
      if (launch.runs[w].load() != want) {
        printf("launch %ld (%d threads): worker %d ran %d times\n", i, threads, w,
               launch.runs[w].load());
        return 1;
      }
    }
    if (launch.running.load() != 0) {
      printf("launch %ld: returned with %d workers still running\n", i, launch.running.load());
      return 1;
    }
  }
  printf("ok\n");
  return 0;
}
