// Times the cpu backend's prepare and attention modules through their C ABI, without torch:
// no binding to build (the modules build in seconds), and no tensor allocation in the timed
// region, so the two phases and the thread scaling of one tier show alone. The torch benchmark
// (op_benchmarks/bench_gfx1201_sage_attention.py) is the one to quote against SDPA.
//
// Build (from the repository root; F = the cpu toolchain's flags, jit_driver.py):
//   F="-std=c++17 -O3 -fPIC -pthread -ffp-contract=off -fvisibility=hidden -Icsrc -Icsrc/include"
//   g++ $F -shared -o /tmp/prepare.so csrc/cpu/prepare*.cpp csrc/cpu/cpu_runtime.cpp
//   g++ $F -shared -o /tmp/attention.so csrc/cpu/attention*.cpp csrc/cpu/cpu_runtime.cpp
//   g++ -std=c++17 -O2 -pthread -Icsrc/include -o /tmp/bench_cpu_phases
//       op_benchmarks/cpu/bench_cpu_phases.cpp -ldl   (one command)
// Run: [AITER_SAGE_CPU_ISA=amx] /tmp/bench_cpu_phases /tmp/prepare.so /tmp/attention.so
//        SEQ HEADS THREADS ITERS [EXECUTOR]   (one command)
// (B = 1, D = 128, BF16, non-causal; median and minimum of ITERS calls after one warm-up; a
// checksum of the output so that variants can be compared, and a hash of every prepared and
// output byte.) EXECUTOR: `pool` (default: the modules' own worker pool), `serial` (a
// SageCpuExecutor that runs the workers one after another in reverse order on this thread) or
// `threads` (one that starts a thread per worker); each launch must call every worker once.
// `bad` passes a pointer that is not an executor: the launch must refuse it.
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "sage/module_abi.h"
#include "sage/params.h"

namespace {

using LaunchFn = int (*)(const SageParams*, void*);
using ErrorFn = const char* (*)();

constexpr int kHeadDim = 128;
constexpr int kSeqAlign = SAGE_SEQ_ALIGN;
constexpr double kLog2e = 1.4426950408889634;
constexpr int kChecksumStride = 97;  // output elements between checksum samples

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint16_t bf16_of(float f) {  // RNE (the inputs are finite)
  uint32_t u;
  memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Uniform values in (-1.7, 1.7) from a fixed LCG: the same inputs on every machine.
struct Lcg {
  uint32_t state = 12345;
  float next() {
    state = state * 1664525u + 1013904223u;
    return (float(state >> 8) / 16777216.0f - 0.5f) * 3.4f;
  }
};

template <class T>
T symbol(void* lib, const char* name) {
  void* s = dlsym(lib, name);
  if (!s) {
    fprintf(stderr, "missing symbol %s\n", name);
    exit(1);
  }
  return reinterpret_cast<T>(s);
}

// Executors (sage/module_abi.h) that check each launch's worker calls: every worker once.
struct CheckedExecutor {
  bool threaded = false;
  std::vector<int> calls;
  bool ok = true;
  long launches = 0;
};
void run_checked(void* self, int workers, void (*body)(void*, int), void* ctx) {
  auto* e = static_cast<CheckedExecutor*>(self);
  ++e->launches;
  e->calls.assign(workers, 0);
  if (e->threaded) {
    std::vector<std::thread> started;
    for (int w = 1; w < workers; ++w)
      started.emplace_back([=] {
        body(ctx, w);
        ++e->calls[w];  // each thread writes its own element
      });
    body(ctx, 0);
    ++e->calls[0];
    for (auto& t : started) t.join();
  } else {
    for (int w = workers - 1; w >= 0; --w) {
      body(ctx, w);
      ++e->calls[w];
    }
  }
  for (int c : e->calls) e->ok = e->ok && c == 1;
}

uint64_t fnv1a(uint64_t h, const void* data, size_t bytes) {
  const uint8_t* b = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}
template <class T>
uint64_t fnv1a(uint64_t h, const std::vector<T>& v) {
  return fnv1a(h, v.data(), v.size() * sizeof(T));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7 && argc != 8) {
    fprintf(stderr, "usage: %s prepare.so attention.so SEQ HEADS THREADS ITERS [EXECUTOR]\n",
            argv[0]);
    return 2;
  }
  const std::string mode = argc == 8 ? argv[7] : "pool";
  if (mode != "pool" && mode != "serial" && mode != "threads" && mode != "bad") {
    fprintf(stderr, "EXECUTOR: pool, serial, threads or bad, not %s\n", mode.c_str());
    return 2;
  }
  CheckedExecutor checked;
  checked.threaded = mode == "threads";
  SageCpuExecutor executor{mode == "bad" ? 0u : SAGE_CPU_EXECUTOR_MAGIC, run_checked, &checked};
  void* stream = mode == "pool" ? nullptr : &executor;
  void* prep_lib = dlopen(argv[1], RTLD_NOW);
  void* attn_lib = dlopen(argv[2], RTLD_NOW);
  if (!prep_lib || !attn_lib) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  const auto prepare = symbol<LaunchFn>(prep_lib, "sage_prepare_launch");
  const auto attention = symbol<LaunchFn>(attn_lib, "sage_attention_launch");
  const auto prepare_error = symbol<ErrorFn>(prep_lib, "sage_module_last_error");
  const auto attention_error = symbol<ErrorFn>(attn_lib, "sage_module_last_error");
  const int seq = atoi(argv[3]), heads = atoi(argv[4]), threads = atoi(argv[5]);
  const int iters = std::max(1, atoi(argv[6]));
  const int seq_pad = (seq + kSeqAlign - 1) / kSeqAlign * kSeqAlign;

  const size_t n = size_t(seq) * heads * kHeadDim;
  std::vector<uint16_t> q(n), k(n), v(n), out(size_t(seq_pad) * heads * kHeadDim);
  Lcg lcg;
  for (size_t i = 0; i < n; ++i) {
    q[i] = bf16_of(lcg.next());
    k[i] = bf16_of(lcg.next());
    v[i] = bf16_of(lcg.next());
  }
  const size_t n_pad = size_t(seq_pad) * heads * kHeadDim;
  std::vector<int8_t> q8(n_pad), k8(n_pad);
  std::vector<uint8_t> v8(n_pad);
  std::vector<float> q_scale(size_t(heads) * seq_pad / kSeqAlign);
  std::vector<float> k_scale(q_scale.size()), v_scale(size_t(heads) * kHeadDim);

  SageParams p;
  memset(&p, 0, sizeof p);
  p.batch = 1;
  p.heads_q = p.heads_kv = heads;
  p.head_dim = p.head_dim_pad = kHeadDim;
  p.q_len = p.kv_len = seq;
  p.q_len_pad = p.kv_len_pad = seq_pad;
  p.in_dtype = p.out_dtype = SAGE_DTYPE_BF16;
  p.mask = SAGE_MASK_NONE;
  p.pv_dtype = SAGE_PV_FP8;
  p.q_prescale = float(kLog2e / sqrt(double(kHeadDim)));
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.q_stride_b = p.k_stride_b = p.v_stride_b = int64_t(seq) * heads * kHeadDim;
  p.q_stride_s = p.k_stride_s = p.v_stride_s = int64_t(heads) * kHeadDim;
  p.q_stride_h = p.k_stride_h = p.v_stride_h = kHeadDim;
  p.q8 = q8.data();
  p.k8 = k8.data();
  p.v8 = v8.data();
  p.q_scale = q_scale.data();
  p.k_scale = k_scale.data();
  p.v_scale = v_scale.data();
  p.out = out.data();
  p.out_rows = seq;
  p.out_stride_b = int64_t(seq_pad) * heads * kHeadDim;
  p.out_stride_s = int64_t(heads) * kHeadDim;
  p.out_stride_h = kHeadDim;
  p.num_threads = threads;

  std::vector<double> prep_s, attn_s;
  for (int it = 0; it <= iters; ++it) {  // call 0 warms up
    const double t0 = now_s();
    if (prepare(&p, stream)) {
      fprintf(stderr, "prepare: %s\n", prepare_error());
      return 1;
    }
    const double t1 = now_s();
    if (attention(&p, stream)) {
      fprintf(stderr, "attention: %s\n", attention_error());
      return 1;
    }
    const double t2 = now_s();
    if (it > 0) {
      prep_s.push_back(t1 - t0);
      attn_s.push_back(t2 - t1);
    }
  }
  const double flops = 4.0 * heads * double(seq) * seq * kHeadDim;
  const char* isa = getenv("AITER_SAGE_CPU_ISA");
  printf(
      "S=%d H=%d threads=%d isa=%s prepare %.2f ms (min %.2f) attention %.2f ms (min %.2f) "
      "attention TFLOPS %.3f\n",
      seq, heads, threads, isa ? isa : "auto", median(prep_s) * 1e3,
      *std::min_element(prep_s.begin(), prep_s.end()) * 1e3, median(attn_s) * 1e3,
      *std::min_element(attn_s.begin(), attn_s.end()) * 1e3, flops / median(attn_s) * 1e-12);
  double checksum = 0;
  for (size_t i = 0; i < out.size(); i += kChecksumStride) {
    const uint32_t u = uint32_t(out[i]) << 16;
    float f;
    memcpy(&f, &u, 4);
    checksum += f;
  }
  printf("checksum %.6f\n", checksum);
  uint64_t h = 14695981039346656037ull;
  h = fnv1a(fnv1a(fnv1a(fnv1a(h, q8), k8), v8), out);
  h = fnv1a(fnv1a(fnv1a(h, q_scale), k_scale), v_scale);
  printf("hash %016llx\n", (unsigned long long)h);
  if (mode != "pool") {
    printf("executor launches %ld\n", checked.launches);
    if (!checked.ok) {
      fprintf(stderr, "the executor saw a worker called other than once in a launch\n");
      return 1;
    }
  }
  return 0;
}
