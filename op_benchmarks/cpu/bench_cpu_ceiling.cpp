// The thread-scaling ceiling of this CPU's arithmetic units: each thread runs a loop of one
// instruction kind on registers only (no memory traffic, no synchronization), and the
// aggregate rate at T threads over the rate at 1 thread is the most any kernel built on that
// instruction can scale by here. Where all-core clocks are lower than the one-core clock (AMX
// and AVX-512 frequency licences, shared turbo budgets, a VM's co-scheduled neighbours) this
// ceiling is below T, and a kernel's own scaling (bench_cpu_phases) is judged against it.
//
// Kinds: amx (tdpbssd, the amx tier's Q.K^T), avx512 (vpdpbusd zmm, the avx512 tier's),
// avx2 (vpmaddwd + vpaddd ymm, the avx2 tier's).
// Build (from the repository root):
//   g++ -std=c++17 -O2 -pthread -o /tmp/bench_cpu_ceiling op_benchmarks/cpu/bench_cpu_ceiling.cpp
// Run: /tmp/bench_cpu_ceiling KIND THREADS [THREADS ...]   (e.g. amx 1 16 8)
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Four independent tdpbssd per trip (tmm0..3 accumulate tmm4/5 x tmm6/7): 4 x 16x16x64 MACs.
constexpr double kAmxOpsPerTrip = 4.0 * 16 * 16 * 64 * 2;
void amx_loop(int64_t iters) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  } cfg;
  asm volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
  asm volatile("tilezero %%tmm4\n\ttilezero %%tmm5\n\ttilezero %%tmm6\n\ttilezero %%tmm7" ::);
  for (int64_t i = 0; i < iters; ++i)
    asm volatile(
        "tdpbssd %%tmm6, %%tmm4, %%tmm0\n\ttdpbssd %%tmm7, %%tmm4, %%tmm1\n\t"
        "tdpbssd %%tmm6, %%tmm5, %%tmm2\n\ttdpbssd %%tmm7, %%tmm5, %%tmm3" ::);
  asm volatile("tilerelease" ::: "memory");
}

// Eight independent vpdpbusd zmm chains per trip: 8 x 64 MACs. (The registers' values do not
// matter: integer instructions take the same time on any.)
constexpr double kAvx512OpsPerTrip = 8.0 * 64 * 2;
__attribute__((target("avx512f,avx512vnni"))) void avx512_loop(int64_t iters) {
  for (int64_t i = 0; i < iters; ++i)
    asm volatile(
        "vpdpbusd %%zmm8, %%zmm8, %%zmm0\n\tvpdpbusd %%zmm8, %%zmm8, %%zmm1\n\t"
        "vpdpbusd %%zmm8, %%zmm8, %%zmm2\n\tvpdpbusd %%zmm8, %%zmm8, %%zmm3\n\t"
        "vpdpbusd %%zmm8, %%zmm8, %%zmm4\n\tvpdpbusd %%zmm8, %%zmm8, %%zmm5\n\t"
        "vpdpbusd %%zmm8, %%zmm8, %%zmm6\n\tvpdpbusd %%zmm8, %%zmm8, %%zmm7" ::
            : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7");
}

// Eight independent vpmaddwd + vpaddd ymm chains per trip: 8 x 16 MACs.
constexpr double kAvx2OpsPerTrip = 8.0 * 16 * 2;
__attribute__((target("avx2"))) void avx2_loop(int64_t iters) {
  for (int64_t i = 0; i < iters; ++i)
    asm volatile(
        "vpmaddwd %%ymm15, %%ymm15, %%ymm8\n\tvpaddd %%ymm8, %%ymm0, %%ymm0\n\t"
        "vpmaddwd %%ymm15, %%ymm15, %%ymm9\n\tvpaddd %%ymm9, %%ymm1, %%ymm1\n\t"
        "vpmaddwd %%ymm15, %%ymm15, %%ymm10\n\tvpaddd %%ymm10, %%ymm2, %%ymm2\n\t"
        "vpmaddwd %%ymm15, %%ymm15, %%ymm11\n\tvpaddd %%ymm11, %%ymm3, %%ymm3\n\t"
        "vpmaddwd %%ymm15, %%ymm15, %%ymm12\n\tvpaddd %%ymm12, %%ymm4, %%ymm4\n\t"
        "vpmaddwd %%ymm15, %%ymm15, %%ymm13\n\tvpaddd %%ymm13, %%ymm5, %%ymm5\n\t"
        "vpmaddwd %%ymm15, %%ymm15, %%ymm14\n\tvpaddd %%ymm14, %%ymm6, %%ymm6\n\t"
        "vpmaddwd %%ymm15, %%ymm15, %%ymm8\n\tvpaddd %%ymm8, %%ymm7, %%ymm7" ::
            : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
              "xmm10", "xmm11", "xmm12", "xmm13", "xmm14");
}

bool request_amx() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Aggregate operations per second of `threads` threads, each running `loop` once; the
// threads start together and the slowest one's time counts.
// Loop trips per thread: each kind runs about 0.3 s at 2-3 GHz.
struct Kind {
  void (*loop)(int64_t trips);
  double ops_per_trip;
  int64_t trips;
};

double aggregate_rate(const Kind& k, int threads) {
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<double> seconds(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load()) {
      }
      const double t0 = now_s();
      k.loop(k.trips);
      seconds[t] = now_s() - t0;
    });
  while (ready.load() < threads) {
  }
  go.store(true);
  for (auto& th : pool) th.join();
  return k.ops_per_trip * double(k.trips) * threads /
         *std::max_element(seconds.begin(), seconds.end());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s amx|avx512|avx2 THREADS [THREADS ...]\n", argv[0]);
    return 2;
  }
  const std::string kind = argv[1];
  // Each kind runs where the cpu backend would run its tier (the same CPU features; for amx
  // also the OS's tile-data permission), and otherwise says what is missing.
  Kind k{};
  const char* missing = nullptr;
  if (kind == "amx") {
    if (!request_amx()) missing = "AMX (CPU feature or the OS's tile-data permission)";
    k = {amx_loop, kAmxOpsPerTrip, 12000000};  // 4 x 16 cycles a trip
  } else if (kind == "avx512") {
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
          __builtin_cpu_supports("avx512bf16")))
      missing = "AVX-512 F/BW/VL/VNNI/BF16";
    k = {avx512_loop, kAvx512OpsPerTrip, 200000000};
  } else if (kind == "avx2") {
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) missing = "AVX2/FMA";
    k = {avx2_loop, kAvx2OpsPerTrip, 200000000};
  } else {
    fprintf(stderr, "unknown kind %s\n", kind.c_str());
    return 2;
  }
  if (missing) {
    fprintf(stderr, "this CPU lacks %s\n", missing);
    return 1;
  }
  for (int i = 2; i < argc; ++i) {
    const int threads = atoi(argv[i]);
    const double rate = aggregate_rate(k, threads);
    printf("%s threads=%d aggregate %.3f TOPS per-thread %.3f TOPS\n", kind.c_str(), threads,
           rate * 1e-12, rate * 1e-12 / threads);
  }
  return 0;
}
