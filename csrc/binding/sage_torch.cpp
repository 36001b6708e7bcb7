// aiter_sage torch binding: validates tensors, allocates outputs, fills the one SageParams and
// calls the kernel module for the tensor's device and the selected backend through its C ABI.
//
// Ops are registered from register_ops() (called by aiter_sage/ops.py after it has checked
// that no other library owns the names), not from static initialisers, so that any
// registration error reaches Python as an exception instead of aborting the process.
// Kernel modules are located by a Python resolver (the JIT driver) on first use per
// (module, device, backend) and then called without touching Python again.
#include <dlfcn.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "sage/layout.h"
#include "sage/params.h"
#include "sage/quant.h"

#ifdef SAGE_TORCH_GPU
#include <ATen/cuda/CUDAContext.h>
#endif

namespace py = pybind11;

namespace {

constexpr const char* kPrepareModule = "module_gfx1201_sage_prepare";
constexpr const char* kAttentionModule = "module_gfx1201_sage_attention";

// ---------------------------------------------------------------------------------------------
// Kernel modules
// ---------------------------------------------------------------------------------------------
struct KernelModule {
  sage_launch_fn launch = nullptr;
  sage_last_error_fn last_error = nullptr;
  std::string info;
};

std::mutex g_modules_mutex;
std::unordered_map<std::string, KernelModule> g_modules;
py::object* g_resolver = nullptr;  // leaked on purpose: must outlive interpreter teardown order

std::string requested_backend(const std::optional<std::string>& backend) {
  if (backend && !backend->empty()) return *backend;
  const char* env = std::getenv("AITER_SAGE_BACKEND");
  return env ? std::string(env) : std::string();
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
  m.launch = symbol<sage_launch_fn>(h, entry, path);
  m.last_error = symbol<sage_last_error_fn>(h, "sage_module_last_error", path);
  m.info = symbol<sage_module_info_fn>(h, "sage_module_info", path)();
  return m;
}

// The resolver may build (minutes) and needs the GIL: never call it under our own mutex.
const KernelModule& module_for(const char* name, const char* entry, const at::Device& device,
                               const std::string& backend) {
  const std::string key = std::string(name) + "|" + device.str() + "|" + backend;
  {
    std::lock_guard<std::mutex> lock(g_modules_mutex);
    auto it = g_modules.find(key);
    if (it != g_modules.end()) return it->second;
  }
  TORCH_CHECK(g_resolver, "aiter_sage: the binding was used before `import aiter_sage`");
  std::string path;
  {
    py::gil_scoped_acquire gil;
    path = (*g_resolver)(name, device.str(), backend).cast<std::string>();
  }
  KernelModule m = load_module(path, entry);
  std::lock_guard<std::mutex> lock(g_modules_mutex);
  return g_modules.emplace(key, m).first->second;
}

void* stream_for(const at::Device& device) {
#ifdef SAGE_TORCH_GPU
  if (device.is_cuda()) return at::cuda::getCurrentCUDAStream(device.index()).stream();
#endif
  (void)device;
  return nullptr;
}

void launch(const char* name, const char* entry, const at::Device& device,
            const std::optional<std::string>& backend, const SageParams& p) {
  const KernelModule& m = module_for(name, entry, device, requested_backend(backend));
  int rc = m.launch(&p, stream_for(device));
  TORCH_CHECK(rc == 0, "aiter_sage: ", m.info, " failed: ", m.last_error());
}

// ---------------------------------------------------------------------------------------------
// Validation: every message names the argument and the problem.
// ---------------------------------------------------------------------------------------------
void check_device(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, "aiter_sage: ", name, " is on ", t.device(),
                    " but the inputs are on ", device);
}

void check_supported_device(const at::Device& device) {
#ifdef SAGE_TORCH_GPU
  TORCH_CHECK_VALUE(device.is_cpu() || device.is_cuda(), "aiter_sage: unsupported device ",
                    device, " (supported: cpu, and ROCm/CUDA GPUs)");
#else
  TORCH_CHECK_VALUE(device.is_cpu(), "aiter_sage: unsupported device ", device,
                    ": this torch build has no GPU support (supported: cpu)");
#endif
}

// Q, K, V: BF16 [B, S, H, 128], non-empty, last dim contiguous.
void check_bshd(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kBFloat16, "aiter_sage: ", name,
                   " must be torch.bfloat16, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 4, "aiter_sage: ", name,
                    " must be 4-D [batch, seq, heads, 128], got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.size(3) == SAGE_HEAD_DIM, "aiter_sage: ", name,
                    " must have head dim 128, got ", t.size(3), " (shape ", t.sizes(), ")");
  TORCH_CHECK_VALUE(t.numel() > 0, "aiter_sage: ", name, " is empty (shape ", t.sizes(), ")");
  TORCH_CHECK_VALUE(t.stride(3) == 1, "aiter_sage: ", name,
                    "'s last dimension must be contiguous (stride 1), got strides ", t.strides());
  TORCH_CHECK_VALUE(t.size(1) <= (int64_t(1) << 30) && t.size(0) * t.size(2) <= (int64_t(1) << 30),
                    "aiter_sage: ", name, " is too large (shape ", t.sizes(), ")");
}

// GPU kernels use 128-bit loads: copy a tensor whose rows are not 16-byte aligned (a fresh
// contiguous allocation is). CPU kernels take any layout with a contiguous last dim.
at::Tensor aligned_for(const at::Tensor& t) {
  if (t.is_cpu()) return t;
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) ok = ok && (t.stride(d) % 8 == 0);
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

void check_same_shape_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "aiter_sage: k and v must have the same shape, got ",
                    k.sizes(), " and ", v.sizes());
  TORCH_CHECK_VALUE(q.size(0) == k.size(0), "aiter_sage: q and k must have the same batch, got ",
                    q.size(0), " and ", k.size(0));
  TORCH_CHECK_VALUE(q.size(2) == k.size(2), "aiter_sage: q and k must have the same number of ",
                    "heads, got ", q.size(2), " and ", k.size(2),
                    " (grouped-query attention is not supported in this version)");
}

void check_vector_bf16(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kBFloat16, "aiter_sage: ", name,
                   " must be torch.bfloat16, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == SAGE_HEAD_DIM, "aiter_sage: ", name,
                    " must have shape [128], got ", t.sizes());
  check_device(t, name, device);
}

void check_rope_table(const at::Tensor& t, const char* name, int64_t seq, const at::Device& device) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kBFloat16, "aiter_sage: ", name,
                   " must be torch.bfloat16, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == seq, "aiter_sage: ", name,
                    " must have shape [seq, rope_dim] with seq = ", seq, ", got ", t.sizes());
  TORCH_CHECK_VALUE(sage::rope_dim_supported(int(t.size(1))), "aiter_sage: rope_dim (", name,
                    ".shape[-1]) must be 32, 64, 96 or 128, got ", t.size(1));
  TORCH_CHECK_VALUE(t.stride(1) == 1, "aiter_sage: ", name,
                    "'s last dimension must be contiguous, got strides ", t.strides());
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

// ---------------------------------------------------------------------------------------------
// prepare
// ---------------------------------------------------------------------------------------------
using PreparedTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                 at::Tensor>;

PreparedTuple prepare_checked(const at::Tensor& q_in, const at::Tensor& k_in,
                              const at::Tensor& v_in, double softmax_scale, const NormRope& nr,
                              const std::optional<std::string>& backend) {
  check_bshd(q_in, "q");
  check_bshd(k_in, "k");
  check_bshd(v_in, "v");
  const at::Device device = q_in.device();
  check_supported_device(device);
  check_device(k_in, "k", device);
  check_device(v_in, "v", device);
  check_same_shape_qkv(q_in, k_in, v_in);
  TORCH_CHECK_VALUE(std::isfinite(softmax_scale), "aiter_sage: softmax_scale must be finite, got ",
                    softmax_scale);
  TORCH_CHECK_VALUE(nr.q_weight.has_value() == nr.k_weight.has_value(),
                    "aiter_sage: pass both q_norm_weight and k_norm_weight, or neither");
  TORCH_CHECK_VALUE(nr.cos.has_value() == nr.sin.has_value(),
                    "aiter_sage: pass both rope_cos and rope_sin, or neither");
  TORCH_CHECK_VALUE(std::isfinite(nr.eps) && nr.eps >= 0, "aiter_sage: norm_eps must be finite ",
                    "and >= 0, got ", nr.eps);

  at::Tensor q = aligned_for(q_in), k = aligned_for(k_in), v = aligned_for(v_in);
  const int64_t B = q.size(0), H = q.size(2), Sq = q.size(1), Skv = k.size(1);

  SageParams p{};
  p.batch = int32_t(B);
  p.heads = int32_t(H);
  p.q_len = int32_t(Sq);
  p.kv_len = int32_t(Skv);
  p.q_len_pad = int32_t(sage::padded_len(Sq));
  p.kv_len_pad = int32_t(sage::padded_len(Skv));
  p.softmax_scale = float(softmax_scale);
  p.q = ptr_of<sage_bf16_t>(q);
  p.k = ptr_of<sage_bf16_t>(k);
  p.v = ptr_of<sage_bf16_t>(v);
  p.q_stride_b = q.stride(0), p.q_stride_s = q.stride(1), p.q_stride_h = q.stride(2);
  p.k_stride_b = k.stride(0), p.k_stride_s = k.stride(1), p.k_stride_h = k.stride(2);
  p.v_stride_b = v.stride(0), p.v_stride_s = v.stride(1), p.v_stride_h = v.stride(2);

  at::Tensor qw, kw, cos, sin;  // keep any contiguous copies alive until the launch returns
  if (nr.q_weight) {
    check_vector_bf16(*nr.q_weight, "q_norm_weight", device);
    check_vector_bf16(*nr.k_weight, "k_norm_weight", device);
    qw = aligned_for(nr.q_weight->contiguous());
    kw = aligned_for(nr.k_weight->contiguous());
    p.q_norm_weight = ptr_of<sage_bf16_t>(qw);
    p.k_norm_weight = ptr_of<sage_bf16_t>(kw);
  }
  p.norm_eps = float(nr.eps);
  if (nr.cos) {
    TORCH_CHECK_VALUE(Sq == Skv, "aiter_sage: RoPE needs q and k of the same length, got ", Sq,
                      " and ", Skv);
    check_rope_table(*nr.cos, "rope_cos", Sq, device);
    check_rope_table(*nr.sin, "rope_sin", Sq, device);
    TORCH_CHECK_VALUE(nr.cos->sizes() == nr.sin->sizes(), "aiter_sage: rope_cos and rope_sin ",
                      "must have the same shape, got ", nr.cos->sizes(), " and ", nr.sin->sizes());
    cos = aligned_for(nr.cos->contiguous());
    sin = aligned_for(nr.sin->contiguous());
    p.rope_cos = ptr_of<sage_bf16_t>(cos);
    p.rope_sin = ptr_of<sage_bf16_t>(sin);
    p.rope_dim = int32_t(cos.size(1));
    p.rope_stride_s = cos.stride(0);
  }

  auto i8 = q.options().dtype(at::kChar);
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor q8 = at::empty({B, H, p.q_len_pad, SAGE_HEAD_DIM}, i8);
  at::Tensor q_scale = at::empty({B, H, sage::scale_blocks(p.q_len_pad)}, f32);
  at::Tensor k8 = at::empty({B, H, p.kv_len_pad, SAGE_HEAD_DIM}, i8);
  at::Tensor k_scale = at::empty({B, H, sage::scale_blocks(p.kv_len_pad)}, f32);
  // Raw e4m3fn bits as uint8 at the op level: torch's CPU tooling (opcheck's schema check,
  // comparisons) does not support float8 inputs; the Python API views them as float8_e4m3fn.
  at::Tensor v8 = at::empty({B, H, SAGE_HEAD_DIM, p.kv_len_pad}, q.options().dtype(at::kByte));
  at::Tensor v_scale = at::empty({B, H, SAGE_HEAD_DIM}, f32);
  p.q8 = q8.data_ptr<int8_t>();
  p.q_scale = q_scale.data_ptr<float>();
  p.k8 = k8.data_ptr<int8_t>();
  p.k_scale = k_scale.data_ptr<float>();
  p.v8 = reinterpret_cast<sage_fp8_t*>(v8.data_ptr());
  p.v_scale = v_scale.data_ptr<float>();
  p.num_threads = at::get_num_threads();

  launch(kPrepareModule, "sage_prepare_launch", device, backend, p);
  return {q8, q_scale, k8, k_scale, v8, v_scale};
}

// ---------------------------------------------------------------------------------------------
// forward on prepared tensors
// ---------------------------------------------------------------------------------------------
void check_prepared(const at::Tensor& t, const char* name, at::ScalarType dtype,
                    at::IntArrayRef shape, const at::Device& device) {
  // v8 may come as uint8 bits (the op's own output) or as a float8_e4m3fn view of them.
  const bool ok = t.scalar_type() == dtype ||
                  (dtype == at::kByte && t.scalar_type() == at::kFloat8_e4m3fn);
  TORCH_CHECK_TYPE(ok, "aiter_sage: prepared ", name, " must be ", dtype, ", got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == shape, "aiter_sage: prepared ", name, " must have shape ", shape,
                    ", got ", t.sizes(), " (pass the tensors gfx1201_sage_prepare returned)");
  TORCH_CHECK_VALUE(t.is_contiguous(), "aiter_sage: prepared ", name, " must be contiguous");
  check_device(t, name, device);
}

at::Tensor fwd_checked(const at::Tensor& q8, const at::Tensor& q_scale, const at::Tensor& k8,
                       const at::Tensor& k_scale, const at::Tensor& v8, const at::Tensor& v_scale,
                       int64_t q_len, int64_t kv_len, const std::optional<std::string>& backend) {
  TORCH_CHECK_VALUE(q8.dim() == 4 && k8.dim() == 4, "aiter_sage: prepared q8/k8 must be 4-D ",
                    "[batch, heads, seq_pad, 128], got ", q8.sizes(), " and ", k8.sizes());
  const at::Device device = q8.device();
  check_supported_device(device);
  const int64_t B = q8.size(0), H = q8.size(1);
  TORCH_CHECK_VALUE(q_len >= 1 && kv_len >= 1, "aiter_sage: q_len and kv_len must be >= 1, got ",
                    q_len, " and ", kv_len);
  TORCH_CHECK_VALUE(B >= 1 && H >= 1, "aiter_sage: prepared tensors are empty (q8 shape ",
                    q8.sizes(), ")");
  const int64_t sq = sage::padded_len(q_len), skv = sage::padded_len(kv_len);
  check_prepared(q8, "q8", at::kChar, {B, H, sq, SAGE_HEAD_DIM}, device);
  check_prepared(q_scale, "q_scale", at::kFloat, {B, H, sage::scale_blocks(sq)}, device);
  check_prepared(k8, "k8", at::kChar, {B, H, skv, SAGE_HEAD_DIM}, device);
  check_prepared(k_scale, "k_scale", at::kFloat, {B, H, sage::scale_blocks(skv)}, device);
  check_prepared(v8, "v8", at::kByte, {B, H, SAGE_HEAD_DIM, skv}, device);
  check_prepared(v_scale, "v_scale", at::kFloat, {B, H, SAGE_HEAD_DIM}, device);

  at::Tensor out = at::empty({B, q_len, H, SAGE_HEAD_DIM}, q8.options().dtype(at::kBFloat16));
  SageParams p{};
  p.batch = int32_t(B);
  p.heads = int32_t(H);
  p.q_len = int32_t(q_len);
  p.kv_len = int32_t(kv_len);
  p.q_len_pad = int32_t(sq);
  p.kv_len_pad = int32_t(skv);
  p.q8 = const_cast<int8_t*>(ptr_of<int8_t>(q8));
  p.q_scale = const_cast<float*>(ptr_of<float>(q_scale));
  p.k8 = const_cast<int8_t*>(ptr_of<int8_t>(k8));
  p.k_scale = const_cast<float*>(ptr_of<float>(k_scale));
  p.v8 = const_cast<sage_fp8_t*>(ptr_of<sage_fp8_t>(v8));
  p.v_scale = const_cast<float*>(ptr_of<float>(v_scale));
  p.out = reinterpret_cast<sage_bf16_t*>(out.data_ptr());
  p.out_stride_b = out.stride(0), p.out_stride_s = out.stride(1), p.out_stride_h = out.stride(2);
  p.num_threads = at::get_num_threads();
  launch(kAttentionModule, "sage_attention_launch", device, backend, p);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Op kernels (schemas in register_ops)
// ---------------------------------------------------------------------------------------------
double resolve_scale(std::optional<double> softmax_scale) {
  return softmax_scale ? *softmax_scale : 1.0 / std::sqrt(double(SAGE_HEAD_DIM));
}

PreparedTuple prepare_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         std::optional<double> softmax_scale,
                         const std::optional<at::Tensor>& q_norm_weight,
                         const std::optional<at::Tensor>& k_norm_weight, double norm_eps,
                         const std::optional<at::Tensor>& rope_cos,
                         const std::optional<at::Tensor>& rope_sin,
                         std::optional<std::string> backend) {
  NormRope nr{q_norm_weight, k_norm_weight, rope_cos, rope_sin, norm_eps};
  return prepare_checked(q, k, v, resolve_scale(softmax_scale), nr, backend);
}

at::Tensor fwd_op(const at::Tensor& q8, const at::Tensor& q_scale, const at::Tensor& k8,
                  const at::Tensor& k_scale, const at::Tensor& v8, const at::Tensor& v_scale,
                  int64_t q_len, int64_t kv_len, std::optional<std::string> backend) {
  return fwd_checked(q8, q_scale, k8, k_scale, v8, v_scale, q_len, kv_len, backend);
}

at::Tensor attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        std::optional<double> softmax_scale, bool is_causal,
                        const std::optional<at::Tensor>& attn_mask,
                        const std::optional<at::Tensor>& q_norm_weight,
                        const std::optional<at::Tensor>& k_norm_weight, double norm_eps,
                        const std::optional<at::Tensor>& rope_cos,
                        const std::optional<at::Tensor>& rope_sin,
                        std::optional<std::string> backend) {
  TORCH_CHECK_NOT_IMPLEMENTED(!is_causal, "aiter_sage: causal attention is not supported in ",
                              "this version (non-causal only)");
  TORCH_CHECK_NOT_IMPLEMENTED(!attn_mask.has_value(), "aiter_sage: attn_mask is not supported ",
                              "in this version (no mask)");
  NormRope nr{q_norm_weight, k_norm_weight, rope_cos, rope_sin, norm_eps};
  auto [q8, qs, k8, ks, v8, vs] = prepare_checked(q, k, v, resolve_scale(softmax_scale), nr, backend);
  return fwd_checked(q8, qs, k8, ks, v8, vs, q.size(1), k.size(1), backend);
}

constexpr const char* kNormRopeArgs =
    "Tensor? q_norm_weight=None, Tensor? k_norm_weight=None, float norm_eps=1e-06, "
    "Tensor? rope_cos=None, Tensor? rope_sin=None, str? backend=None";

std::unique_ptr<torch::Library> g_def_lib, g_cpu_lib, g_gpu_lib;

void register_ops() {
  TORCH_CHECK(!g_def_lib, "aiter_sage: ops already registered");
  auto def = std::make_unique<torch::Library>(torch::Library::FRAGMENT, "aiter", std::nullopt,
                                              __FILE__, __LINE__);
  const std::string prepare_schema =
      std::string("gfx1201_sage_prepare(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, *, ") +
      kNormRopeArgs + ") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)";
  const std::string attention_schema =
      std::string("gfx1201_sage_attention(Tensor q, Tensor k, Tensor v, float? softmax_scale=None, *, "
                  "bool is_causal=False, Tensor? attn_mask=None, ") +
      kNormRopeArgs + ") -> Tensor";
  def->def(prepare_schema.c_str());
  def->def("gfx1201_sage_attention_fwd(Tensor q8, Tensor q_scale, Tensor k8, Tensor k_scale, "
           "Tensor v8, Tensor v_scale, int q_len, int kv_len, *, str? backend=None) -> Tensor");
  def->def(attention_schema.c_str());
  auto cpu = std::make_unique<torch::Library>(torch::Library::IMPL, "aiter",
                                              c10::DispatchKey::CPU, __FILE__, __LINE__);
  cpu->impl("gfx1201_sage_prepare", TORCH_FN(prepare_op));
  cpu->impl("gfx1201_sage_attention_fwd", TORCH_FN(fwd_op));
  cpu->impl("gfx1201_sage_attention", TORCH_FN(attention_op));
#ifdef SAGE_TORCH_GPU
  auto gpu = std::make_unique<torch::Library>(torch::Library::IMPL, "aiter",
                                              c10::DispatchKey::CUDA, __FILE__, __LINE__);
  gpu->impl("gfx1201_sage_prepare", TORCH_FN(prepare_op));
  gpu->impl("gfx1201_sage_attention_fwd", TORCH_FN(fwd_op));
  gpu->impl("gfx1201_sage_attention", TORCH_FN(attention_op));
  g_gpu_lib = std::move(gpu);
#endif
  g_def_lib = std::move(def);
  g_cpu_lib = std::move(cpu);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "aiter_sage torch binding (ops are registered by register_ops())";
  m.def("register_ops", &register_ops);
  m.def("set_module_resolver", [](py::object fn) {
    if (!g_resolver) g_resolver = new py::object();
    *g_resolver = std::move(fn);
  });
  m.def("loaded_modules", [] {
    std::lock_guard<std::mutex> lock(g_modules_mutex);
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& [key, mod] : g_modules) out.emplace_back(key, mod.info);
    return out;
  });
  m.attr("abi_version") = SAGE_ABI_VERSION;
  m.attr("gpu") = py::bool_(
#ifdef SAGE_TORCH_GPU
      true
#else
      false
#endif
  );
}
