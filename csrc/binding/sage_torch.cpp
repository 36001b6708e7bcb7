// aiter_sage torch binding: validates tensors, allocates outputs, fills the one SageParams and
// calls the kernel module for the tensor's device and the selected backend through its C ABI.
//
// Ops are registered from register_ops() (called by aiter_sage/ops.py after it has checked
// that no other library owns the names), not from static initialisers, so that any
// registration error reaches Python as an exception instead of aborting the process.
// Each op call asks aiter_sage/backends.py:resolve for its backend record (the one reading of
// the `backend` argument and of $AITER_SAGE_BACKEND) and uses it as it is: which modules to
// load, whether they run on the host, the alignment their loads need. The binding reads no
// backend from the environment and compares no backend name.
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "sage/check.h"
#include "binding/host_blocks.h"
#include "sage/layout.h"
#include "sage/module_abi.h"
#include "sage/params.h"
#include "sage/quant.h"

#ifdef SAGE_TORCH_GPU
#include <ATen/cuda/CUDAContext.h>
#endif

namespace py = pybind11;

namespace {

// ---------------------------------------------------------------------------------------------
// Host memory of large CPU tensors (see binding/host_blocks.h: why, and the cache's rules)
// ---------------------------------------------------------------------------------------------
sage::HostBlockCache& host_blocks() {
  // Leaked on purpose: tensors freed during interpreter teardown still give their blocks back.
  static sage::HostBlockCache* cache = [] {
    auto* c = new sage::HostBlockCache(sage::HostBlockCache::limit_from_env());
    pthread_atfork([] { host_blocks().lock_for_fork(); }, [] { host_blocks().unlock_after_fork(); },
                   [] { host_blocks().unlock_after_fork(); });
    return c;
  }();
  return *cache;
}

// at::empty for the binding's outputs and temporaries: a CPU tensor of HostBlockCache::kMinBytes
// or more lives in a cached host block, anything else comes from torch's allocator.
at::Tensor new_tensor(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (!options.device().is_cpu()) return at::empty(sizes, options);
  const size_t bytes = size_t(c10::multiply_integers(sizes)) *
                       c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  if (bytes < sage::HostBlockCache::kMinBytes) return at::empty(sizes, options);
  size_t capacity = 0;
  void* data = host_blocks().take(bytes, &capacity);
  if (!data) return at::empty(sizes, options);  // out of memory: torch's allocator says so
  return at::from_blob(
      data, sizes, [capacity](void* d) { host_blocks().give(d, capacity); }, options);
}

// ---------------------------------------------------------------------------------------------
// Backends and their kernel modules
// ---------------------------------------------------------------------------------------------
struct KernelModule {
  sage_launch_fn run = nullptr;  // sage_*_run: the launch on params this binding validated
  sage_last_error_fn last_error = nullptr;
  sage_check_count_fn check_count = nullptr;
  std::string info;  // sage_module_info, for messages only
};

enum ModuleKind { kPrepareKind = 0, kAttentionKind = 1, kModuleKinds = 2 };
struct ModuleName {
  const char* module;      // jit/modules.py name
  const char* run_symbol;  // its entry for this binding (sage/module_abi.h)
};
constexpr ModuleName kModules[kModuleKinds] = {
    {"module_gfx1201_sage_prepare", "sage_prepare_run"},
    {"module_gfx1201_sage_attention", "sage_attention_run"},
};

// A backends.Resolved record, as the binding uses it. Python keeps one record per (device,
// requested name), so "EMU", " emu" and $AITER_SAGE_BACKEND=emu all reach the same one.
struct Backend {
  py::object record;  // keeps the Python record alive: its address keys g_backends
  std::string name, device;
  bool host = false;        // takes a SageCpuExecutor as its stream, not a device stream
  int64_t align_bytes = 0;  // row alignment the kernels' loads need (0: any layout)
  mutable const KernelModule* modules[kModuleKinds] = {};  // loaded on first use (g_mutex)
};

// Guards g_backends and each Backend's modules. Taken with or without the GIL, but never held
// while waiting for it (module_of lets go of it before it builds).
std::mutex g_mutex;
// Leaked on purpose (as g_resolver): Python objects must not be released at process exit.
auto* g_backends = new std::unordered_map<PyObject*, std::unique_ptr<Backend>>();
py::object* g_resolver = nullptr;  // leaked on purpose: must outlive interpreter teardown order

// The record for this call: backends.resolve(device, backend) (a ValueError of Python's for an
// unknown name or one the device cannot serve reaches the caller as it is). Asked on every call,
// not memoised here: a call without `backend` follows $AITER_SAGE_BACKEND as it is now, and only
// Python reads it. The cost is the GIL and a dict lookup (about 1-2 us on a tiny prepare).
const Backend& backend_for(const at::Device& device, const std::optional<std::string>& backend) {
  TORCH_CHECK(g_resolver, "aiter_sage: the binding was used before `import aiter_sage`");
  py::gil_scoped_acquire gil;
  py::object record = (*g_resolver)(device.str(), backend);
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_backends->find(record.ptr());
  if (it != g_backends->end()) return *it->second;
  auto b = std::make_unique<Backend>();
  b->name = record.attr("backend").cast<std::string>();
  b->device = record.attr("device").cast<std::string>();
  b->host = record.attr("host").cast<bool>();
  b->align_bytes = record.attr("align_bytes").cast<int64_t>();
  b->record = std::move(record);
  PyObject* key = b->record.ptr();
  return *g_backends->emplace(key, std::move(b)).first->second;
}

template <class F>
F symbol(void* handle, const char* name, const std::string& path) {
  void* s = dlsym(handle, name);
  TORCH_CHECK(s, "aiter_sage: ", path, " does not export ", name);
  return reinterpret_cast<F>(s);
}

KernelModule load_module(const std::string& path, const char* entry) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(h, "aiter_sage: cannot load ", path, ": ", dlerror());
  int abi = symbol<sage_abi_version_fn>(h, "sage_abi_version", path)();
  TORCH_CHECK(abi == SAGE_ABI_VERSION, "aiter_sage: ", path, " has ABI ", abi, ", binding expects ",
              SAGE_ABI_VERSION);
  KernelModule m;
  m.run = symbol<sage_launch_fn>(h, entry, path);
  m.last_error = symbol<sage_last_error_fn>(h, "sage_module_last_error", path);
  m.check_count = symbol<sage_check_count_fn>(h, "sage_module_check_count", path);
  m.info = symbol<sage_module_info_fn>(h, "sage_module_info", path)();
  return m;
}

// The record's module_path may build (minutes) and needs the GIL: never called under g_mutex.
const KernelModule& module_of(const Backend& b, ModuleKind kind) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (b.modules[kind]) return *b.modules[kind];
  }
  std::string path;
  {
    py::gil_scoped_acquire gil;
    path = b.record.attr("module_path")(kModules[kind].module).cast<std::string>();
  }
  auto m = std::make_unique<KernelModule>(load_module(path, kModules[kind].run_symbol));
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& slot = b.modules[kind];
  if (!slot) slot = m.release();  // leaked with its Backend; a racing load keeps the first
  return *slot;
}

// (key "module|device|backend", module info) of every module loaded, for the tests.
std::vector<std::pair<std::string, std::string>> loaded_modules() {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [record, b] : *g_backends)
    for (int kind = 0; kind < kModuleKinds; ++kind)
      if (b->modules[kind])
        out.emplace_back(std::string(kModules[kind].module) + "|" + b->device + "|" + b->name,
                         b->modules[kind]->info);
  return out;
}

// sage::check_params calls so far in this binding and in every module it loaded (each shared
// object loaded once, however many records use it), for the tests: one op call, one check.
int64_t check_params_calls() {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::set<sage_check_count_fn> counted;
  int64_t calls = sage::check_calls().load();
  for (const auto& [record, b] : *g_backends)
    for (const KernelModule* m : b->modules)
      if (m && counted.insert(m->check_count).second) calls += m->check_count();
  return calls;
}

void* stream_for(const at::Device& device) {
#ifdef SAGE_TORCH_GPU
  if (device.is_cuda()) return at::cuda::getCurrentCUDAStream(device.index()).stream();
#endif
  (void)device;
  return nullptr;
}

// The cpu modules' workers run on torch's intra-op threads (at::parallel_for, one worker per
// index): torch's OpenMP threads keep spinning after each torch op, so threads of the module's
// own beside them would compete for the same cores (sage/module_abi.h, SageCpuExecutor).
// Nested in a torch parallel region, at::parallel_for runs the workers one after another,
// which the modules allow.
void run_on_torch_threads(void* /*self*/, int workers, void (*body)(void*, int), void* ctx) {
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) body(ctx, int(w));
  });
}
const SageCpuExecutor kTorchThreads{SAGE_CPU_EXECUTOR_MAGIC, run_on_torch_threads, nullptr};

// The OpenMP runtimes loaded in this process (GNU, Intel, LLVM), by file name.
int openmp_runtimes_loaded() {
  int found = 0;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        const char* base = info->dlpi_name ? std::strrchr(info->dlpi_name, '/') : nullptr;
        base = base ? base + 1 : info->dlpi_name;
        if (base && (!std::strncmp(base, "libgomp", 7) || !std::strncmp(base, "libiomp", 7) ||
                     !std::strncmp(base, "libomp", 6)))
          ++*static_cast<int*>(data);
        return 0;
      },
      &found);
  return found;
}

// Set in a child forked from this process: GNU OpenMP's threads do not survive a fork, and a
// parallel region in the child waits for them forever (torch's own ops too). Registered when
// the binding loads (PYBIND11_MODULE), before any fork that matters.
std::atomic<bool> g_forked_child{false};
void note_forks() {
  pthread_atfork(nullptr, nullptr, [] { g_forked_child.store(true); });
}

// torch's threads where this binding shares torch's OpenMP runtime: built with -fopenmp
// (jit_driver, where torch uses OpenMP), and one runtime in the process, so the binding's
// at::parallel_for reaches torch's threads (torch wheels ship libgomp.so.1, which the loader
// then gives the binding too). Otherwise null: the modules use their own pool, as a binding
// without OpenMP would run the workers one after another; so does a forked child, where the
// pool starts threads of its own.
const SageCpuExecutor* cpu_executor() {
#ifdef _OPENMP
  static const bool shared = openmp_runtimes_loaded() == 1;
  return shared && !g_forked_child.load() ? &kTorchThreads : nullptr;
#else
  return nullptr;
#endif
}

// How many distinct threads the cpu executor in effect uses for `workers` workers that each
// take 20 ms (tests: the workers must run in parallel, not one after another).
int64_t cpu_executor_threads(int64_t workers) {
  const SageCpuExecutor* e = cpu_executor();
  if (!e) return -1;  // no executor: the modules use their own pool
  struct Seen {
    std::mutex m;
    std::set<pthread_t> threads;
  } seen;
  e->run(
      e->self, int(workers),
      [](void* ctx, int) {
        auto* s = static_cast<Seen*>(ctx);
        {
          std::lock_guard<std::mutex> lock(s->m);
          s->threads.insert(pthread_self());
        }
        struct timespec pause{0, 20 * 1000 * 1000};
        nanosleep(&pause, nullptr);
      },
      &seen);
  return int64_t(seen.threads.size());
}

// Runs a module on params that validate() accepted (its *_run entry skips the C ABI's check).
void launch(const Backend& b, ModuleKind kind, const at::Device& device, const SageParams& p) {
  const KernelModule& m = module_of(b, kind);
  void* stream = b.host ? const_cast<SageCpuExecutor*>(cpu_executor()) : stream_for(device);
  int rc = m.run(&p, stream);
  TORCH_CHECK(rc == 0, "aiter_sage: ", m.info, " failed: ", m.last_error());
}

// Raw e4m3fn bits as uint8 at the op level: torch's CPU tooling (opcheck's checks, comparisons)
// does not support float8 tensors; the Python API returns them viewed as float8_e4m3fn, and
// every entry point takes either dtype.
constexpr at::ScalarType kFp8Storage = at::kByte;

// ---------------------------------------------------------------------------------------------
// Torch-level checks: dtypes, ranks, shapes, devices, strides. Every message names the argument.
// The values themselves (head dim, head counts, sequence lengths, eps, rope_dim, ...) are
// checked once, by sage::check_params (sage/check.h) on the filled SageParams — the same
// function every module runs at launch. These checks read only metadata, so the fake
// implementations run them too (check_*_meta below, on stand-ins with concrete sizes).
// ---------------------------------------------------------------------------------------------
void check_device(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, "aiter_sage: ", name, " is on ", t.device(),
                    " but query is on ", device, " (all tensors must be on one device)");
}

void check_supported_device(const at::Device& device, bool shapes_only) {
  if (shapes_only && device.is_meta()) return;
#ifdef SAGE_TORCH_GPU
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(), "aiter_sage: unsupported device ", device,
                    " (supported: cpu, and ROCm/CUDA GPUs)");
#else
  TORCH_CHECK_VALUE(device.is_cpu(), "aiter_sage: unsupported device ", device,
                    ": this torch build has no GPU support (supported: cpu)");
#endif
}

// The 16-bit input/output formats.
int sage_dtype_of(at::ScalarType t) { return t == at::kHalf ? SAGE_DTYPE_FP16 : SAGE_DTYPE_BF16; }
bool is_half_type(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// query, key, value: BF16 or FP16 [B, S, H, D], non-empty, last dim contiguous.
void check_bshd(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(is_half_type(t.scalar_type()), "aiter_sage: ", name,
                   " must be torch.bfloat16 or torch.float16, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 4, "aiter_sage: ", name,
                    " must be 4-D [batch, seq, heads, head_dim], got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.numel() > 0, "aiter_sage: ", name, " is empty (shape ", t.sizes(), ")");
  TORCH_CHECK_VALUE(t.stride(3) == 1, "aiter_sage: ", name,
                    "'s last dimension must be contiguous (stride 1), got strides ", t.strides());
}

// Sizes beyond int32 cannot reach SageParams; check_params bounds the rest.
void check_int32(int64_t v, const char* what) {
  TORCH_CHECK_VALUE(v <= INT32_MAX, "aiter_sage: ", what, " ", v, " is too large");
}

// GPU kernels and the gfx12 emulator use 128-bit loads: copy a tensor whose base or rows miss
// the backend's alignment (Backend::align_bytes; a fresh contiguous allocation meets it), as a
// GPU path must. The cpu kernels (align_bytes 0) take any layout with a contiguous last dim.
bool meets_alignment(const at::Tensor& t, int64_t align_bytes) {
  if (align_bytes == 0) return true;
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % align_bytes == 0 && t.stride(-1) == 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    ok = ok && (t.size(d) == 1 || (t.stride(d) * t.element_size()) % align_bytes == 0);
  return ok;
}

at::Tensor aligned_for(const at::Tensor& t, int64_t align_bytes) {
  return meets_alignment(t, align_bytes) ? t : t.clone(at::MemoryFormat::Contiguous);
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_bshd(q, "query");
  check_bshd(k, "key");
  check_bshd(v, "value");
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                   "aiter_sage: query, key and value must have one dtype, got ", q.scalar_type(),
                   ", ", k.scalar_type(), " and ", v.scalar_type());
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(),
                    "aiter_sage: key and value must have the same shape, got ", k.sizes(), " and ",
                    v.sizes());
  TORCH_CHECK_VALUE(q.size(0) == k.size(0),
                    "aiter_sage: query and key must have the same batch, got ", q.size(0), " and ",
                    k.size(0));
  TORCH_CHECK_VALUE(q.size(3) == k.size(3),
                    "aiter_sage: query and key must have the same head dim, ", "got ", q.size(3),
                    " and ", k.size(3));
  for (int64_t d = 0; d < 4; ++d) {
    check_int32(q.size(d), "query size");
    check_int32(k.size(d), "key size");
  }
}

void check_norm_weight(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), "aiter_sage: ", name,
                   " must have query's dtype ", q.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == q.size(3), "aiter_sage: ", name,
                    " must have shape [", q.size(3), "] (the head dim), got ", t.sizes());
  check_device(t, name, q.device());
}

// cosine/sine: FP32 [S, rope_dim] (upstream); BF16 tables are accepted and upcast exactly.
void check_rope_table(const at::Tensor& t, const char* name, int64_t seq,
                      const at::Device& device) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
                   "aiter_sage: ", name, " must be torch.float32 (or torch.bfloat16), got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == seq, "aiter_sage: ", name,
                    " must have shape [seq, rope_dim] with seq = ", seq, ", got ", t.sizes());
  check_device(t, name, device);
}

template <class T>
const T* ptr_of(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}

struct NormRope {
  std::optional<at::Tensor> q_weight, k_weight, cos, sin;
  double eps = 1e-6;
};

// softmax_scale=None means 1/sqrt(head_dim) (the real head dim, before any padding).
double resolve_scale(std::optional<double> softmax_scale, int64_t head_dim) {
  return softmax_scale ? *softmax_scale : 1.0 / std::sqrt(double(head_dim));
}

// The float32 values the kernels use must be finite (1e39 is a finite double but not a float).
float checked_q_prescale(double softmax_scale) {
  const float c = sage::q_prescale_from(softmax_scale);
  TORCH_CHECK_VALUE(
      std::isfinite(float(softmax_scale)) && std::isfinite(c),
      "aiter_sage: softmax_scale must be a finite float32 (and softmax_scale*log2(e) ",
      "too), got ", softmax_scale);
  return c;
}

// pv_dtype: "fp8" (FP8 V and P.V, upstream's) or "fp16" (FP16 V and P.V).
int pv_dtype_code(const std::string& pv_dtype) {
  TORCH_CHECK_VALUE(pv_dtype == "fp8" || pv_dtype == "fp16",
                    "aiter_sage: pv_dtype must be \"fp8\" or \"fp16\", got \"", pv_dtype, "\"");
  return pv_dtype == "fp16" ? SAGE_PV_FP16 : SAGE_PV_FP8;
}

// q_scale_rows: query rows per Q scale, 32 (upstream's) or 16 (SageParams::q_scale_rows).
int32_t q_scale_rows_code(int64_t q_scale_rows) {
  TORCH_CHECK_VALUE(q_scale_rows == SAGE_SCALE_BLOCK || q_scale_rows == SAGE_Q_SCALE_ROWS_FINE,
                    "aiter_sage: q_scale_rows must be ", SAGE_SCALE_BLOCK, " or ",
                    SAGE_Q_SCALE_ROWS_FINE, " (query rows per Q scale), got ", q_scale_rows);
  return int32_t(q_scale_rows);
}

// ---------------------------------------------------------------------------------------------
// Per-entry lengths (SageParams::q_lens / kv_lens): optional int32/int64 [batch] tensors on the
// inputs' device or on the CPU. Their values are checked where they are already on the host;
// device values are not read back (that would wait for the GPU): the kernels clamp them.
// ---------------------------------------------------------------------------------------------
struct Lengths {
  const std::optional<at::Tensor>& q;
  const std::optional<at::Tensor>& kv;
};

// The int32 copy on `device` of one length tensor (undefined when absent), after the checks.
at::Tensor entry_lengths(const std::optional<at::Tensor>& lens, const char* name, int64_t batch,
                         int64_t full, const at::Device& device, bool shapes_only) {
  if (!lens) return at::Tensor();
  const at::Tensor& t = *lens;
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong,
                   "aiter_sage: ", name, " must be torch.int32 or torch.int64, got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == batch, "aiter_sage: ", name, " must have shape [",
                    batch, "] (one length per batch entry), got ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == device || t.device().is_cpu(), "aiter_sage: ", name, " is on ",
                    t.device(), " but query is on ", device, " (pass it there or on the cpu)");
  if (shapes_only) return at::Tensor();
  at::Tensor host32 = t.device().is_cpu() ? t.to(at::kInt).contiguous() : at::Tensor();
  if (host32.defined()) {
    const bool ok =
        sage::check_entry_lengths(host32.data_ptr<int32_t>(), int(batch), int(full), name, "");
    TORCH_CHECK_VALUE(ok, "aiter_sage", sage::last_error_buffer());
  }
  return (host32.defined() ? host32 : t).to(device, at::kInt).contiguous();
}

// Fills p.q_lens / p.kv_lens (p's batch and lengths set); the returned tensors hold the values
// until the launch is queued.
std::pair<at::Tensor, at::Tensor> set_lengths(SageParams& p, const Lengths& lens,
                                              const at::Device& device, bool shapes_only) {
  at::Tensor q = entry_lengths(lens.q, "q_lens", p.batch, p.q_len, device, shapes_only);
  at::Tensor kv = entry_lengths(lens.kv, "kv_lens", p.batch, p.kv_len, device, shapes_only);
  p.q_lens = q.defined() ? q.data_ptr<int32_t>() : nullptr;
  p.kv_lens = kv.defined() ? kv.data_ptr<int32_t>() : nullptr;
  return {q, kv};
}

// ---------------------------------------------------------------------------------------------
// The one place a SageParams is filled from tensors (FlashAttention's set_params_fprop), and the
// one place it is validated before a launch.
// ---------------------------------------------------------------------------------------------
struct Shape {
  int64_t B, Hq, Hkv, D, q_len, kv_len;
};

SageParams params_for(const Shape& sh) {
  SageParams p{};
  p.batch = int32_t(sh.B);
  p.heads_q = int32_t(sh.Hq);
  p.heads_kv = int32_t(sh.Hkv);
  p.head_dim = int32_t(sh.D);
  p.head_dim_pad = sage::padded_head_dim(p.head_dim);
  p.q_len = int32_t(sh.q_len);
  p.kv_len = int32_t(sh.kv_len);
  p.q_len_pad = int32_t(sage::padded_len(sh.q_len));
  p.kv_len_pad = int32_t(sage::padded_len(sh.kv_len));
  p.in_dtype = SAGE_DTYPE_BF16;
  p.out_dtype = SAGE_DTYPE_BF16;
  p.mask = SAGE_MASK_NONE;
  p.num_threads = at::get_num_threads();
  return p;
}

// An address that check_params reads as "present" (it only tests pointers for null); never
// dereferenced: a launch gets the real buffer in its place.
char g_stand_in[16];

// The launches one validation covers: the prepare op's, the forward op's, or the attention op's
// two launches on one SageParams.
enum class Check { kPrepare, kAttention, kPrepareThenAttention };

// The op call's one sage/check.h validation of `p`, before the binding allocates anything: a
// stand-in address in every buffer allocated only after it passes (in all of them for the
// fakes). A failure is a ValueError carrying check.h's message. The modules' *_run entries
// run on the params it accepted without checking them again (sage/module_abi.h).
void validate(SageParams p, Check check) {
  auto fill = [](auto*& ptr) {
    if (!ptr) ptr = reinterpret_cast<std::remove_reference_t<decltype(ptr)>>(g_stand_in);
  };
  fill(p.q8), fill(p.q_scale), fill(p.k8), fill(p.k_scale), fill(p.v_scale);
  if (p.pv_dtype == SAGE_PV_FP16)
    fill(p.v16);
  else
    fill(p.v8);
  if (check != Check::kAttention) {
    fill(p.q), fill(p.k), fill(p.v);
    if (p.smooth_k) fill(p.k_mean), fill(p.lse_corr);
  }
  if (check != Check::kPrepare) fill(p.out);
  const bool ok = check == Check::kPrepare     ? sage::check_params(&p, sage::Launch::kPrepare)
                  : check == Check::kAttention ? sage::check_params(&p, sage::Launch::kAttention)
                                               : sage::check_prepare_then_attention(&p);
  const std::string msg = sage::last_error_buffer();
  // "sage_prepare_launch: head dim 200 ..." -> "aiter_sage: head dim 200 ..."
  const size_t colon = msg.find(": ");
  TORCH_CHECK_VALUE(ok, "aiter_sage: ", colon == std::string::npos ? msg : msg.substr(colon + 2));
}

// Prepare's arguments after the torch-level checks, as SageParams, not yet validated. No data
// pointers yet, except g_stand_in for the norm weights and RoPE tables that are given (all
// check_params reads of them); run_prepare puts the real ones in.
SageParams prepare_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          std::optional<double> softmax_scale, const NormRope& nr, bool smooth_k,
                          const std::string& pv_dtype, int64_t q_scale_rows, bool shapes_only) {
  check_qkv(q, k, v);
  const at::Device device = q.device();
  check_supported_device(device, shapes_only);
  check_device(k, "key", device);
  check_device(v, "value", device);
  const Shape sh{q.size(0), q.size(2), k.size(2), q.size(3), q.size(1), k.size(1)};
  SageParams p = params_for(sh);
  p.in_dtype = sage_dtype_of(q.scalar_type());
  p.q_prescale = checked_q_prescale(resolve_scale(softmax_scale, sh.D));
  p.smooth_k = smooth_k ? 1 : 0;
  p.pv_dtype = pv_dtype_code(pv_dtype);
  p.q_scale_rows = q_scale_rows_code(q_scale_rows);
  TORCH_CHECK_VALUE(nr.q_weight.has_value() == nr.k_weight.has_value(),
                    "aiter_sage: pass both query_weight and key_weight, or neither");
  TORCH_CHECK_VALUE(nr.cos.has_value() == nr.sin.has_value(),
                    "aiter_sage: pass both cosine and sine, or neither");
  TORCH_CHECK_VALUE(std::isfinite(float(nr.eps)) && nr.eps >= 0,
                    "aiter_sage: eps must be a finite float32 >= 0, got ", nr.eps);
  p.norm_eps = float(nr.eps);
  if (nr.q_weight) {
    check_norm_weight(*nr.q_weight, "query_weight", q);
    check_norm_weight(*nr.k_weight, "key_weight", q);
    p.q_norm_weight = p.k_norm_weight = g_stand_in;
  }
  if (nr.cos) {
    TORCH_CHECK_VALUE(sh.q_len == sh.kv_len, "aiter_sage: RoPE (cosine/sine) needs query and key ",
                      "of the same length, got ", sh.q_len, " and ", sh.kv_len);
    check_rope_table(*nr.cos, "cosine", sh.q_len, device);
    check_rope_table(*nr.sin, "sine", sh.q_len, device);
    TORCH_CHECK_VALUE(
        nr.cos->sizes() == nr.sin->sizes() && nr.cos->scalar_type() == nr.sin->scalar_type(),
        "aiter_sage: cosine and sine must have the same shape and dtype, got ", nr.cos->sizes(),
        " ", nr.cos->scalar_type(), " and ", nr.sin->sizes(), " ", nr.sin->scalar_type());
    p.rope_cos = p.rope_sin = reinterpret_cast<const float*>(g_stand_in);
    p.rope_dim = int32_t(nr.cos->size(1));
  }
  return p;
}

// The attention op's fields of its one SageParams (prepare_params filled the rest): the
// output is the inputs' shape and dtype.
void set_attention_fields(SageParams& p, bool is_causal) {
  p.mask = is_causal ? SAGE_MASK_CAUSAL : SAGE_MASK_NONE;
  p.out_dtype = p.in_dtype;
  p.out_rows = p.q_len;
}

// The forward's arguments (prepared tensors) after the torch-level checks, as SageParams (not
// yet validated).
void check_prepared(const at::Tensor& t, const char* name, at::ScalarType dtype,
                    at::IntArrayRef shape, const at::Device& device) {
  // v_fp8 may come as float8_e4m3fn or as its uint8 bits.
  const bool ok =
      t.scalar_type() == dtype || (dtype == kFp8Storage && t.scalar_type() == at::kFloat8_e4m3fn);
  TORCH_CHECK_TYPE(ok, "aiter_sage: prepared ", name, " must be ",
                   dtype == kFp8Storage ? "torch.float8_e4m3fn" : c10::toString(dtype), ", got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == shape, "aiter_sage: prepared ", name, " must have shape ", shape,
                    ", got ", t.sizes(), " (pass the tensors gfx1201_sage_prepare returned)");
  TORCH_CHECK_VALUE(t.is_contiguous(), "aiter_sage: prepared ", name, " must be contiguous");
  check_device(t, name, device);
}

at::ScalarType resolve_out_dtype(std::optional<at::ScalarType> out_dtype) {
  const at::ScalarType t = out_dtype.value_or(at::kBFloat16);
  TORCH_CHECK_TYPE(is_half_type(t), "aiter_sage: out_dtype must be torch.bfloat16 or ",
                   "torch.float16, got ", t);
  return t;
}

struct Prepared6 {
  const at::Tensor &q8, &q_scale, &k8, &k_scale, &v8, &v_scale;
};

SageParams fwd_params(const Prepared6& in, int64_t seq_len, std::optional<int64_t> kv_len_arg,
                      bool is_causal, at::ScalarType out_dtype, bool shapes_only) {
  TORCH_CHECK_VALUE(in.q8.dim() == 4 && in.k8.dim() == 4, "aiter_sage: prepared q_int8/k_int8 ",
                    "must be 4-D [batch, seq_pad, heads, head_dim], got ", in.q8.sizes(), " and ",
                    in.k8.sizes());
  const at::Device device = in.q8.device();
  check_supported_device(device, shapes_only);
  const int64_t B = in.q8.size(0), Sq_pad = in.q8.size(1), Hq = in.q8.size(2), D = in.q8.size(3);
  const int64_t Skv_pad = in.k8.size(1), Hkv = in.k8.size(2);
  TORCH_CHECK_VALUE(D == SAGE_HEAD_DIM_SMALL || D == SAGE_HEAD_DIM_LARGE, "aiter_sage: prepared ",
                    "q_int8 must have head dim ", SAGE_HEAD_DIM_SMALL, " or ", SAGE_HEAD_DIM_LARGE,
                    " (prepare pads to them), got ", D);
  TORCH_CHECK_VALUE(Sq_pad % SAGE_SEQ_ALIGN == 0 && Skv_pad % SAGE_SEQ_ALIGN == 0,
                    "aiter_sage: prepared sequence lengths must be multiples of ", SAGE_SEQ_ALIGN,
                    ", got ", Sq_pad, " and ", Skv_pad);
  for (int64_t x : {B, Sq_pad, Hq, Skv_pad, Hkv}) check_int32(x, "prepared size");
  const int64_t kv_len = kv_len_arg.value_or(seq_len);
  TORCH_CHECK_VALUE(seq_len >= 1 && seq_len <= Sq_pad, "aiter_sage: seq_len ", seq_len,
                    " does not fit the padded length ", Sq_pad, " of q_int8");
  TORCH_CHECK_VALUE(kv_len >= 1 && kv_len <= Skv_pad, "aiter_sage: ",
                    kv_len_arg ? "kv_len " : "seq_len (the key length unless kv_len is given) ",
                    kv_len, " does not fit the padded length ", Skv_pad, " of k_int8");
  check_prepared(in.q8, "q_int8", at::kChar, {B, Sq_pad, Hq, D}, device);
  // The Q granularity follows q_scale's shape: Sq_pad / 32 scales (upstream's) or Sq_pad / 16
  // (prepare's q_scale_rows=16). Sq_pad is a multiple of 32, so the two never coincide.
  const std::vector<int64_t> qs32{B, Hq, sage::scale_blocks(Sq_pad)},
      qs16{B, Hq, sage::scale_blocks(Sq_pad, SAGE_Q_SCALE_ROWS_FINE)};
  const bool q16 = in.q_scale.sizes() == at::IntArrayRef(qs16);
  TORCH_CHECK_VALUE(q16 || in.q_scale.sizes() == at::IntArrayRef(qs32),
                    "aiter_sage: prepared q_scale must have shape ", at::IntArrayRef(qs32),
                    " (one scale per 32 query rows) or ", at::IntArrayRef(qs16),
                    " (q_scale_rows=16), got ", in.q_scale.sizes(),
                    " (pass the tensors gfx1201_sage_prepare returned)");
  check_prepared(in.q_scale, "q_scale", at::kFloat, q16 ? qs16 : qs32, device);
  check_prepared(in.k8, "k_int8", at::kChar, {B, Skv_pad, Hkv, D}, device);
  check_prepared(in.k_scale, "k_scale", at::kFloat, {B, Hkv, sage::scale_blocks(Skv_pad)}, device);
  // The P.V mode comes from the prepared V's dtype: e4m3 (or its uint8 bits) or float16.
  const at::ScalarType vt = in.v8.scalar_type();
  TORCH_CHECK_TYPE(vt == kFp8Storage || vt == at::kFloat8_e4m3fn || vt == at::kHalf,
                   "aiter_sage: prepared v_fp8 must be torch.float8_e4m3fn (or its uint8 bits) ",
                   "or torch.float16 (pv_dtype=\"fp16\"), got ", vt);
  const bool pv_fp16 = vt == at::kHalf;
  check_prepared(in.v8, "v_fp8", pv_fp16 ? at::kHalf : kFp8Storage, {B, Hkv, D, Skv_pad}, device);
  check_prepared(in.v_scale, "v_scale", at::kFloat, {B, Hkv, D}, device);
  SageParams p = params_for(Shape{B, Hq, Hkv, D, seq_len, kv_len});
  p.q_len_pad = int32_t(Sq_pad);
  p.kv_len_pad = int32_t(Skv_pad);
  p.out_dtype = sage_dtype_of(out_dtype);
  p.mask = is_causal ? SAGE_MASK_CAUSAL : SAGE_MASK_NONE;
  p.pv_dtype = pv_fp16 ? SAGE_PV_FP16 : SAGE_PV_FP8;
  p.q_scale_rows = q16 ? SAGE_Q_SCALE_ROWS_FINE : SAGE_SCALE_BLOCK;
  p.out_rows = p.q_len_pad;
  return p;
}

// ---------------------------------------------------------------------------------------------
// prepare
// ---------------------------------------------------------------------------------------------
using PreparedTuple =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct PrepareResult {
  PreparedTuple prepared;
  at::Tensor lse_corr;  // defined with smooth_k: the LSE term of the smoothing
};

// ---------------------------------------------------------------------------------------------
// Refusing a call that cannot fit. Before the first allocation the bytes a validated call will
// allocate go to aiter_sage.guards.check_bytes, which compares them with the device's free
// memory and raises MemoryError naming both (an expanded [1, 2^24, 8, 128] key is 32 GiB of
// prepared tensors: without the check they filled the machine until the OOM killer came). The
// counts follow run_prepare's and run_attention's allocations; op_tests/test_guards.py compares
// them with the tensors a call returns.
// ---------------------------------------------------------------------------------------------
struct Budget {
  int64_t prepared = 0;  // prepared tensors, their scales and the prepare's scratch
  int64_t output = 0;    // the attention output and its LSE
  int64_t copies = 0;    // inputs copied to meet the backend's alignment or dtype
};

int64_t copy_bytes(const at::Tensor& t, int64_t align_bytes) {
  return meets_alignment(t, align_bytes) ? 0 : t.numel() * t.element_size();
}

void add_prepare(Budget& b, const SageParams& p, const at::Tensor& q, const at::Tensor& k,
                 const at::Tensor& v, const NormRope& nr, int64_t align) {
  const int64_t B = p.batch, Hq = p.heads_q, Hkv = p.heads_kv, Dp = p.head_dim_pad;
  const int64_t v_code = p.pv_dtype == SAGE_PV_FP16 ? 2 : 1, f32 = 4;
  b.prepared += B * p.q_len_pad * Hq * Dp + B * Hq * sage::q_scale_blocks(p) * f32;
  b.prepared += B * p.kv_len_pad * Hkv * Dp + B * Hkv * sage::scale_blocks(p.kv_len_pad) * f32;
  b.prepared += B * Hkv * Dp * p.kv_len_pad * v_code + B * Hkv * Dp * f32;
  b.prepared += B * Hkv * SAGE_V_AMAX_SPLITS * Dp * f32;
  if (p.smooth_k) b.prepared += B * Hkv * Dp * f32 + B * Hq * p.q_len_pad * f32;
  b.copies += copy_bytes(q, align) + copy_bytes(k, align) + copy_bytes(v, align);
  for (const auto* t : {&nr.cos, &nr.sin})  // converted to FP32 and made contiguous
    if (*t) b.copies += (*t)->numel() * f32;
}

void add_attention(Budget& b, const SageParams& p, bool return_lse) {
  const int64_t out_bytes = 2;  // BF16 or FP16 (SageDtype)
  b.output += int64_t(p.batch) * p.out_rows * p.heads_q * p.head_dim * out_bytes;
  if (return_lse) b.output += int64_t(p.batch) * p.heads_q * p.out_rows * 4;
}

py::object* g_memory_guard = nullptr;  // leaked on purpose, as g_resolver

void check_fits(const Budget& b, const at::Device& device, const char* op) {
  if (!g_memory_guard) return;
  py::gil_scoped_acquire gil;
  (*g_memory_guard)(op, b.prepared, b.output, b.copies, device.str());
}

// Allocates prepare's outputs for the validated `p`, fills their pointers into it, launches.
PrepareResult run_prepare(SageParams& p, const at::Tensor& q_in, const at::Tensor& k_in,
                          const at::Tensor& v_in, const NormRope& nr, const Backend& be) {
  const at::Device device = q_in.device();
  const int64_t align = be.align_bytes;
  at::Tensor q = aligned_for(q_in, align), k = aligned_for(k_in, align),
             v = aligned_for(v_in, align);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_stride_b = q.stride(0), p.q_stride_s = q.stride(1), p.q_stride_h = q.stride(2);
  p.k_stride_b = k.stride(0), p.k_stride_s = k.stride(1), p.k_stride_h = k.stride(2);
  p.v_stride_b = v.stride(0), p.v_stride_s = v.stride(1), p.v_stride_h = v.stride(2);

  at::Tensor qw, kw, cos, sin;  // keep any copies alive until the launch returns
  if (nr.q_weight) {
    qw = aligned_for(nr.q_weight->contiguous(), align);
    kw = aligned_for(nr.k_weight->contiguous(), align);
    p.q_norm_weight = qw.data_ptr();
    p.k_norm_weight = kw.data_ptr();
  }
  if (nr.cos) {
    cos = aligned_for(nr.cos->to(at::kFloat).contiguous(), align);  // BF16 -> FP32 is exact
    sin = aligned_for(nr.sin->to(at::kFloat).contiguous(), align);
    p.rope_cos = ptr_of<float>(cos);
    p.rope_sin = ptr_of<float>(sin);
    p.rope_stride_s = cos.stride(0);
  }

  const int64_t B = p.batch, Hq = p.heads_q, Hkv = p.heads_kv, Dp = p.head_dim_pad;
  auto i8 = q.options().dtype(at::kChar);
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor q8 = new_tensor({B, p.q_len_pad, Hq, Dp}, i8);
  at::Tensor q_scale = new_tensor({B, Hq, sage::q_scale_blocks(p)}, f32);
  at::Tensor k8 = new_tensor({B, p.kv_len_pad, Hkv, Dp}, i8);
  at::Tensor k_scale = new_tensor({B, Hkv, sage::scale_blocks(p.kv_len_pad)}, f32);
  const bool pv_fp16 = p.pv_dtype == SAGE_PV_FP16;
  at::Tensor v8 =
      new_tensor({B, Hkv, Dp, p.kv_len_pad}, q.options().dtype(pv_fp16 ? at::kHalf : kFp8Storage));
  at::Tensor v_scale = new_tensor({B, Hkv, Dp}, f32);
  // The GPU prepare's scratch (the cpu module ignores it; small: B * Hkv * 16 * Dp floats).
  // It lives until the launch is queued; the stream orders its reuse.
  at::Tensor v_amax_part = new_tensor({B, Hkv, SAGE_V_AMAX_SPLITS, Dp}, f32);
  at::Tensor k_mean, lse_corr;
  const bool smooth_k = p.smooth_k;
  if (smooth_k) {
    k_mean = new_tensor({B, Hkv, Dp}, f32);
    lse_corr = new_tensor({B, Hq, p.q_len_pad}, f32);
  }
  p.q8 = q8.data_ptr<int8_t>();
  p.q_scale = q_scale.data_ptr<float>();
  p.k8 = k8.data_ptr<int8_t>();
  p.k_scale = k_scale.data_ptr<float>();
  p.v8 = pv_fp16 ? nullptr : reinterpret_cast<sage_fp8_t*>(v8.data_ptr());
  p.v16 = pv_fp16 ? reinterpret_cast<sage_fp16_t*>(v8.data_ptr()) : nullptr;
  p.v_scale = v_scale.data_ptr<float>();
  p.v_amax_part = v_amax_part.data_ptr<float>();
  p.k_mean = smooth_k ? k_mean.data_ptr<float>() : nullptr;
  p.lse_corr = smooth_k ? lse_corr.data_ptr<float>() : nullptr;

  launch(be, kPrepareKind, device, p);
  return {{q8, q_scale, k8, k_scale, v8, v_scale}, lse_corr};
}

// ---------------------------------------------------------------------------------------------
// forward on prepared tensors
// ---------------------------------------------------------------------------------------------
at::ScalarType scalar_type_of(int32_t sage_dtype) {
  return sage_dtype == SAGE_DTYPE_FP16 ? at::kHalf : at::kBFloat16;
}

// Allocates the output [B, out_rows, Hq, head_dim] (and the LSE) for the validated `p`, fills
// the prepared tensors' and the outputs' pointers into it, launches. A prepare of the same call
// left p.lse_corr set with smooth_k; the attention adds it to the LSE when it writes one.
std::tuple<at::Tensor, at::Tensor> run_attention(SageParams& p, const Prepared6& in_raw,
                                                 bool return_lse, const Backend& be) {
  const at::Device device = in_raw.q8.device();
  const int64_t align = be.align_bytes;
  const at::Tensor q8 = aligned_for(in_raw.q8, align), q_scale = aligned_for(in_raw.q_scale, align),
                   k8 = aligned_for(in_raw.k8, align), k_scale = aligned_for(in_raw.k_scale, align),
                   v8 = aligned_for(in_raw.v8, align), v_scale = aligned_for(in_raw.v_scale, align);
  at::Tensor out = new_tensor({p.batch, p.out_rows, p.heads_q, p.head_dim},
                              q8.options().dtype(scalar_type_of(p.out_dtype)));
  p.q8 = const_cast<int8_t*>(ptr_of<int8_t>(q8));
  p.q_scale = const_cast<float*>(ptr_of<float>(q_scale));
  p.k8 = const_cast<int8_t*>(ptr_of<int8_t>(k8));
  p.k_scale = const_cast<float*>(ptr_of<float>(k_scale));
  if (p.pv_dtype == SAGE_PV_FP16)
    p.v16 = const_cast<sage_fp16_t*>(ptr_of<sage_fp16_t>(v8));
  else
    p.v8 = const_cast<sage_fp8_t*>(ptr_of<sage_fp8_t>(v8));
  p.v_scale = const_cast<float*>(ptr_of<float>(v_scale));
  p.out = out.data_ptr();
  p.out_stride_b = out.stride(0), p.out_stride_s = out.stride(1), p.out_stride_h = out.stride(2);
  at::Tensor lse;
  if (return_lse) {
    lse = new_tensor({p.batch, p.heads_q, p.out_rows}, q8.options().dtype(at::kFloat));
    p.lse = lse.data_ptr<float>();
    p.lse_stride_b = lse.stride(0), p.lse_stride_h = lse.stride(1);
  }
  launch(be, kAttentionKind, device, p);
  return {out, lse};
}

// ---------------------------------------------------------------------------------------------
// Op kernels. The schemas are aiter_sage/signatures.py's (registered from Python); these take
// their arguments in that order.
// ---------------------------------------------------------------------------------------------
PreparedTuple prepare_op(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    std::optional<double> softmax_scale, const std::optional<at::Tensor>& query_weight,
    const std::optional<at::Tensor>& key_weight, const std::optional<at::Tensor>& cosine,
    const std::optional<at::Tensor>& sine, double eps, const std::optional<at::Tensor>& q_lens,
    const std::optional<at::Tensor>& kv_lens, bool smooth_k, std::string pv_dtype,
    int64_t q_scale_rows, std::optional<std::string> backend) {
  NormRope nr{query_weight, key_weight, cosine, sine, eps};
  SageParams p =
      prepare_params(query, key, value, softmax_scale, nr, smooth_k, pv_dtype, q_scale_rows, false);
  validate(p, Check::kPrepare);
  const auto held = set_lengths(p, {q_lens, kv_lens}, query.device(), false);
  const Backend& be = backend_for(query.device(), backend);
  Budget budget;
  add_prepare(budget, p, query, key, value, nr, be.align_bytes);
  check_fits(budget, query.device(), "gfx1201_sage_prepare");
  return run_prepare(p, query, key, value, nr, be).prepared;
}

std::tuple<at::Tensor, at::Tensor> fwd_any(const at::Tensor& q_int8, const at::Tensor& q_scale,
                                           const at::Tensor& k_int8, const at::Tensor& k_scale,
                                           const at::Tensor& v_fp8, const at::Tensor& v_scale,
                                           int64_t seq_len, std::optional<int64_t> kv_len,
                                           bool is_causal, std::optional<at::ScalarType> out_dtype,
                                           const Lengths& lens, std::optional<std::string> backend,
                                           bool return_lse) {
  const Prepared6 in{q_int8, q_scale, k_int8, k_scale, v_fp8, v_scale};
  SageParams p = fwd_params(in, seq_len, kv_len, is_causal, resolve_out_dtype(out_dtype), false);
  validate(p, Check::kAttention);
  const auto held = set_lengths(p, lens, q_int8.device(), false);
  const Backend& be = backend_for(q_int8.device(), backend);
  Budget budget;
  add_attention(budget, p, return_lse);
  for (const at::Tensor* t : {&q_int8, &q_scale, &k_int8, &k_scale, &v_fp8, &v_scale})
    budget.copies += copy_bytes(*t, be.align_bytes);
  check_fits(budget, q_int8.device(), "gfx1201_sage_attention_fwd");
  return run_attention(p, in, return_lse, be);
}

// An op and its `_lse` companion take the same arguments: kLse picks the output (the tensor,
// or the pair with the LSE). The deduced return type makes TORCH_FN's use instantiate them.
template <bool kLse>
auto fwd_op(const at::Tensor& q_int8, const at::Tensor& q_scale, const at::Tensor& k_int8,
            const at::Tensor& k_scale, const at::Tensor& v_fp8, const at::Tensor& v_scale,
            int64_t seq_len, const std::optional<at::Tensor>& q_lens,
            const std::optional<at::Tensor>& kv_lens, std::optional<int64_t> kv_len, bool is_causal,
            std::optional<at::ScalarType> out_dtype, std::optional<std::string> backend) {
  auto result = fwd_any(q_int8, q_scale, k_int8, k_scale, v_fp8, v_scale, seq_len, kv_len,
                        is_causal, out_dtype, {q_lens, kv_lens}, backend, kLse);
  if constexpr (kLse)
    return result;
  else
    return std::get<0>(result);
}

std::tuple<at::Tensor, at::Tensor> attention_any(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    std::optional<double> softmax_scale, const std::optional<at::Tensor>& query_weight,
    const std::optional<at::Tensor>& key_weight, const std::optional<at::Tensor>& cosine,
    const std::optional<at::Tensor>& sine, double eps, bool is_causal, bool smooth_k,
    const std::string& pv_dtype, int64_t q_scale_rows, const Lengths& lens,
    std::optional<std::string> backend, bool return_lse) {
  NormRope nr{query_weight, key_weight, cosine, sine, eps};
  // One SageParams for both launches, validated once: the attention reads the prepared
  // tensors prepare writes into it, and writes the inputs' shape (head dim, real rows).
  SageParams p =
      prepare_params(query, key, value, softmax_scale, nr, smooth_k, pv_dtype, q_scale_rows, false);
  set_attention_fields(p, is_causal);
  validate(p, Check::kPrepareThenAttention);
  const auto held = set_lengths(p, lens, query.device(), false);
  const Backend& be = backend_for(query.device(), backend);
  Budget budget;
  add_prepare(budget, p, query, key, value, nr, be.align_bytes);
  add_attention(budget, p, return_lse);
  check_fits(budget, query.device(), "gfx1201_sage_attention");
  PrepareResult pr = run_prepare(p, query, key, value, nr, be);  // keeps lse_corr alive
  auto& [q8, qs, k8, ks, v8, vs] = pr.prepared;
  return run_attention(p, {q8, qs, k8, ks, v8, vs}, return_lse, be);
}

template <bool kLse>
auto attention_op(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  std::optional<double> softmax_scale,
                  const std::optional<at::Tensor>& query_weight,
                  const std::optional<at::Tensor>& key_weight,
                  const std::optional<at::Tensor>& cosine, const std::optional<at::Tensor>& sine,
                  double eps, const std::optional<at::Tensor>& q_lens,
                  const std::optional<at::Tensor>& kv_lens, bool is_causal, bool smooth_k,
                  std::string pv_dtype, int64_t q_scale_rows, std::optional<std::string> backend) {
  auto result =
      attention_any(query, key, value, softmax_scale, query_weight, key_weight, cosine, sine, eps,
                    is_causal, smooth_k, pv_dtype, q_scale_rows, {q_lens, kv_lens}, backend, kLse);
  if constexpr (kLse)
    return result;
  else
    return std::get<0>(result);
}

// The fake implementations' checks: the same rules on meta/fake tensors (no launch). The fakes
// derive the output shapes themselves, symbolically, so these only raise.
void check_prepare_meta(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        std::optional<double> softmax_scale,
                        const std::optional<at::Tensor>& query_weight,
                        const std::optional<at::Tensor>& key_weight,
                        const std::optional<at::Tensor>& cosine,
                        const std::optional<at::Tensor>& sine, double eps, bool smooth_k,
                        const std::string& pv_dtype, int64_t q_scale_rows,
                        const std::optional<at::Tensor>& q_lens,
                        const std::optional<at::Tensor>& kv_lens) {
  NormRope nr{query_weight, key_weight, cosine, sine, eps};
  SageParams p =
      prepare_params(query, key, value, softmax_scale, nr, smooth_k, pv_dtype, q_scale_rows, true);
  validate(p, Check::kPrepare);
  set_lengths(p, {q_lens, kv_lens}, query.device(), true);
}

void check_attention_meta(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          std::optional<double> softmax_scale,
                          const std::optional<at::Tensor>& query_weight,
                          const std::optional<at::Tensor>& key_weight,
                          const std::optional<at::Tensor>& cosine,
                          const std::optional<at::Tensor>& sine, double eps, bool is_causal,
                          bool smooth_k, const std::string& pv_dtype, int64_t q_scale_rows,
                          const std::optional<at::Tensor>& q_lens,
                          const std::optional<at::Tensor>& kv_lens) {
  NormRope nr{query_weight, key_weight, cosine, sine, eps};
  SageParams p =
      prepare_params(query, key, value, softmax_scale, nr, smooth_k, pv_dtype, q_scale_rows, true);
  set_attention_fields(p, is_causal);
  validate(p, Check::kPrepareThenAttention);
  set_lengths(p, {q_lens, kv_lens}, query.device(), true);
}

void check_fwd_meta(const at::Tensor& q8, const at::Tensor& q_scale, const at::Tensor& k8,
                    const at::Tensor& k_scale, const at::Tensor& v8, const at::Tensor& v_scale,
                    int64_t seq_len, std::optional<int64_t> kv_len, bool is_causal,
                    std::optional<at::ScalarType> out_dtype,
                    const std::optional<at::Tensor>& q_lens,
                    const std::optional<at::Tensor>& kv_lens) {
  SageParams p = fwd_params({q8, q_scale, k8, k_scale, v8, v_scale}, seq_len, kv_len, is_causal,
                            resolve_out_dtype(out_dtype), true);
  validate(p, Check::kAttention);
  set_lengths(p, {q_lens, kv_lens}, q8.device(), true);
}

std::unique_ptr<torch::Library> g_cpu_lib, g_gpu_lib;

template <class Lib>
void impl_all(Lib& lib) {
  lib.impl("gfx1201_sage_prepare", TORCH_FN(prepare_op));
  lib.impl("gfx1201_sage_attention_fwd", TORCH_FN(fwd_op<false>));
  lib.impl("gfx1201_sage_attention_fwd_lse", TORCH_FN(fwd_op<true>));
  lib.impl("gfx1201_sage_attention", TORCH_FN(attention_op<false>));
  lib.impl("gfx1201_sage_attention_lse", TORCH_FN(attention_op<true>));
}

// The schemas are defined by aiter_sage/ops.py (from aiter_sage/signatures.py) before this runs.
void register_ops() {
  TORCH_CHECK(!g_cpu_lib, "aiter_sage: ops already registered");
  auto cpu = std::make_unique<torch::Library>(torch::Library::IMPL, "aiter", c10::DispatchKey::CPU,
                                              __FILE__, __LINE__);
  impl_all(*cpu);
#ifdef SAGE_TORCH_GPU
  auto gpu = std::make_unique<torch::Library>(torch::Library::IMPL, "aiter", c10::DispatchKey::CUDA,
                                              __FILE__, __LINE__);
  impl_all(*gpu);
  g_gpu_lib = std::move(gpu);
#endif
  g_cpu_lib = std::move(cpu);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  note_forks();
  m.doc() = "aiter_sage torch binding (ops are registered by register_ops())";
  m.def("register_ops", &register_ops);
  // The fakes pass the lengths last (the meta tensors of q_lens / kv_lens, or None).
  m.def("check_prepare_meta", &check_prepare_meta);
  m.def("check_attention_meta", &check_attention_meta);
  m.def("check_fwd_meta", &check_fwd_meta);
  // fn(device: str, backend: str | None) -> backends.Resolved, called once per op call.
  m.def("set_backend_resolver", [](py::object fn) {
    if (!g_resolver) g_resolver = new py::object();
    *g_resolver = std::move(fn);
  });
  // fn(op, prepared_bytes, output_bytes, copy_bytes, device: str): raises if they cannot fit.
  m.def("set_memory_guard", [](py::object fn) {
    if (!g_memory_guard) g_memory_guard = new py::object();
    *g_memory_guard = std::move(fn);
  });
  m.def("loaded_modules", &loaded_modules);
  m.def("check_params_calls", &check_params_calls);
  m.def("host_cache_stats", [] {
    const sage::HostBlockCache::Stats s = host_blocks().stats();
    py::dict d;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["cached_bytes"] = s.cached_bytes;
    d["cached_blocks"] = s.cached_blocks;
    return d;
  });
  m.def("empty_host_cache", [] { host_blocks().trim(); });
  m.def("cpu_executor_threads", &cpu_executor_threads);
  m.attr("abi_version") = SAGE_ABI_VERSION;
  m.attr("gpu") = py::bool_(
#ifdef SAGE_TORCH_GPU
      true
#else
      false
#endif
  );
}
