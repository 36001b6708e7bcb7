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
// Validation: every message names the argument and the problem. These checks read only
// metadata (dtype, shape, strides, device), so the fake implementations call the same
// functions on meta/fake tensors (the check_*_meta functions below): one set of rules.
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

void check_seq_len(int64_t len, const char* name) {
  TORCH_CHECK_VALUE(len <= SAGE_MAX_SEQ_LEN, "aiter_sage: ", name, " has ", len,
                    " rows; the longest supported sequence is ", SAGE_MAX_SEQ_LEN);
}

// query, key, value: BF16 [B, S, H, 128], non-empty, last dim contiguous.
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
  check_seq_len(t.size(1), name);
  TORCH_CHECK_VALUE(t.size(0) <= 65535 && t.size(2) <= 65535, "aiter_sage: ", name, " has batch ",
                    t.size(0), " and heads ", t.size(2), "; each must be <= 65535");
}

// GPU kernels and the gfx12 emulator use 128-bit loads: copy a tensor whose rows are not
// 16-byte aligned (a fresh contiguous allocation is), as a GPU path must. The cpu kernels take
// any layout with a contiguous last dim.
at::Tensor aligned_for(const at::Tensor& t, bool need_alignment) {
  if (!need_alignment) return t;
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(-1) == 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    ok = ok && (t.size(d) == 1 || (t.stride(d) * t.element_size()) % 16 == 0);
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

bool needs_alignment(const at::Device& device, const std::string& backend) {
  return !device.is_cpu() || backend == "emu";
}

void check_same_shape_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(),
                    "aiter_sage: key and value must have the same shape, "
                    "got ",
                    k.sizes(), " and ", v.sizes());
  TORCH_CHECK_VALUE(q.size(0) == k.size(0),
                    "aiter_sage: query and key must have the same batch, "
                    "got ",
                    q.size(0), " and ", k.size(0));
  TORCH_CHECK_VALUE(q.size(2) == k.size(2), "aiter_sage: query and key must have the same number ",
                    "of heads, got ", q.size(2), " and ", k.size(2),
                    " (grouped-query attention is not supported in this version)");
}

void check_vector_bf16(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kBFloat16, "aiter_sage: ", name,
                   " must be torch.bfloat16, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == SAGE_HEAD_DIM, "aiter_sage: ", name,
                    " must have shape [128], got ", t.sizes());
  check_device(t, name, device);
}

// cosine/sine: FP32 [S, rope_dim] (upstream); BF16 tables are accepted and upcast exactly.
void check_rope_table(const at::Tensor& t, const char* name, int64_t seq,
                      const at::Device& device) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
                   "aiter_sage: ", name, " must be torch.float32 (or torch.bfloat16), got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == seq, "aiter_sage: ", name,
                    " must have shape [seq, rope_dim] with seq = ", seq, ", got ", t.sizes());
  TORCH_CHECK_VALUE(sage::rope_dim_supported(int(t.size(1))), "aiter_sage: rope_dim (", name,
                    ".shape[-1]) must be 32, 64, 96 or 128, got ", t.size(1));
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

double resolve_scale(std::optional<double> softmax_scale) {
  return softmax_scale ? *softmax_scale : 1.0 / std::sqrt(double(SAGE_HEAD_DIM));
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

// The problem size both ops check, and the one place it goes into a SageParams.
struct Problem {
  int64_t B, H, q_len, kv_len, Sq_pad, Skv_pad;
};

SageParams params_for(const Problem& pr) {
  SageParams p{};
  p.batch = int32_t(pr.B);
  p.heads = int32_t(pr.H);
  p.q_len = int32_t(pr.q_len);
  p.kv_len = int32_t(pr.kv_len);
  p.q_len_pad = int32_t(pr.Sq_pad);
  p.kv_len_pad = int32_t(pr.Skv_pad);
  p.num_threads = at::get_num_threads();
  return p;
}

// Every check of prepare's arguments; with shapes_only the device may be meta (fakes).
Problem check_prepare_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           double softmax_scale, const NormRope& nr, bool shapes_only) {
  check_bshd(q, "query");
  check_bshd(k, "key");
  check_bshd(v, "value");
  const at::Device device = q.device();
  check_supported_device(device, shapes_only);
  check_device(k, "key", device);
  check_device(v, "value", device);
  check_same_shape_qkv(q, k, v);
  checked_q_prescale(softmax_scale);
  TORCH_CHECK_VALUE(nr.q_weight.has_value() == nr.k_weight.has_value(),
                    "aiter_sage: pass both query_weight and key_weight, or neither");
  TORCH_CHECK_VALUE(nr.cos.has_value() == nr.sin.has_value(),
                    "aiter_sage: pass both cosine and sine, or neither");
  TORCH_CHECK_VALUE(std::isfinite(float(nr.eps)) && nr.eps >= 0, "aiter_sage: eps must be a ",
                    "finite float32 >= 0, got ", nr.eps);
  if (nr.q_weight) {
    check_vector_bf16(*nr.q_weight, "query_weight", device);
    check_vector_bf16(*nr.k_weight, "key_weight", device);
  }
  const int64_t Sq = q.size(1), Skv = k.size(1);
  if (nr.cos) {
    TORCH_CHECK_VALUE(Sq == Skv, "aiter_sage: RoPE (cosine/sine) needs query and key of the same ",
                      "length, got ", Sq, " and ", Skv);
    check_rope_table(*nr.cos, "cosine", Sq, device);
    check_rope_table(*nr.sin, "sine", Sq, device);
    TORCH_CHECK_VALUE(
        nr.cos->sizes() == nr.sin->sizes() && nr.cos->scalar_type() == nr.sin->scalar_type(),
        "aiter_sage: cosine and sine must have the same shape and dtype, got ", nr.cos->sizes(),
        " ", nr.cos->scalar_type(), " and ", nr.sin->sizes(), " ", nr.sin->scalar_type());
  }
  return {q.size(0), q.size(2), Sq, Skv, sage::padded_len(Sq), sage::padded_len(Skv)};
}

// ---------------------------------------------------------------------------------------------
// prepare
// ---------------------------------------------------------------------------------------------
using PreparedTuple =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Raw e4m3fn bits as uint8 at the op level: torch's CPU tooling (opcheck's checks, comparisons)
// does not support float8 tensors; the Python API returns them viewed as float8_e4m3fn, and
// every entry point takes either dtype.
constexpr at::ScalarType kFp8Storage = at::kByte;

PreparedTuple prepare_checked(const at::Tensor& q_in, const at::Tensor& k_in,
                              const at::Tensor& v_in, double softmax_scale, const NormRope& nr,
                              const std::optional<std::string>& backend_arg) {
  const Problem sh = check_prepare_args(q_in, k_in, v_in, softmax_scale, nr, false);
  const at::Device device = q_in.device();
  const std::string backend = requested_backend(backend_arg);
  const bool align = needs_alignment(device, backend);
  at::Tensor q = aligned_for(q_in, align), k = aligned_for(k_in, align),
             v = aligned_for(v_in, align);

  SageParams p = params_for(sh);
  p.q_prescale = checked_q_prescale(softmax_scale);
  p.q = ptr_of<sage_bf16_t>(q);
  p.k = ptr_of<sage_bf16_t>(k);
  p.v = ptr_of<sage_bf16_t>(v);
  p.q_stride_b = q.stride(0), p.q_stride_s = q.stride(1), p.q_stride_h = q.stride(2);
  p.k_stride_b = k.stride(0), p.k_stride_s = k.stride(1), p.k_stride_h = k.stride(2);
  p.v_stride_b = v.stride(0), p.v_stride_s = v.stride(1), p.v_stride_h = v.stride(2);

  at::Tensor qw, kw, cos, sin;  // keep any copies alive until the launch returns
  if (nr.q_weight) {
    qw = aligned_for(nr.q_weight->contiguous(), align);
    kw = aligned_for(nr.k_weight->contiguous(), align);
    p.q_norm_weight = ptr_of<sage_bf16_t>(qw);
    p.k_norm_weight = ptr_of<sage_bf16_t>(kw);
  }
  p.norm_eps = float(nr.eps);
  if (nr.cos) {
    cos = aligned_for(nr.cos->to(at::kFloat).contiguous(), align);  // BF16 -> FP32 is exact
    sin = aligned_for(nr.sin->to(at::kFloat).contiguous(), align);
    p.rope_cos = ptr_of<float>(cos);
    p.rope_sin = ptr_of<float>(sin);
    p.rope_dim = int32_t(cos.size(1));
    p.rope_stride_s = cos.stride(0);
  }

  auto i8 = q.options().dtype(at::kChar);
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor q8 = at::empty({sh.B, sh.Sq_pad, sh.H, SAGE_HEAD_DIM}, i8);
  at::Tensor q_scale = at::empty({sh.B, sh.H, sage::scale_blocks(sh.Sq_pad)}, f32);
  at::Tensor k8 = at::empty({sh.B, sh.Skv_pad, sh.H, SAGE_HEAD_DIM}, i8);
  at::Tensor k_scale = at::empty({sh.B, sh.H, sage::scale_blocks(sh.Skv_pad)}, f32);
  at::Tensor v8 =
      at::empty({sh.B, sh.H, SAGE_HEAD_DIM, sh.Skv_pad}, q.options().dtype(kFp8Storage));
  at::Tensor v_scale = at::empty({sh.B, sh.H, SAGE_HEAD_DIM}, f32);
  p.q8 = q8.data_ptr<int8_t>();
  p.q_scale = q_scale.data_ptr<float>();
  p.k8 = k8.data_ptr<int8_t>();
  p.k_scale = k_scale.data_ptr<float>();
  p.v8 = reinterpret_cast<sage_fp8_t*>(v8.data_ptr());
  p.v_scale = v_scale.data_ptr<float>();

  launch(kPrepareModule, "sage_prepare_launch", device, backend, p);
  return {q8, q_scale, k8, k_scale, v8, v_scale};
}

// ---------------------------------------------------------------------------------------------
// forward on prepared tensors
// ---------------------------------------------------------------------------------------------
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

Problem check_fwd_args(const at::Tensor& q8, const at::Tensor& q_scale, const at::Tensor& k8,
                       const at::Tensor& k_scale, const at::Tensor& v8, const at::Tensor& v_scale,
                       int64_t seq_len, std::optional<int64_t> kv_len_arg, bool shapes_only) {
  TORCH_CHECK_VALUE(q8.dim() == 4 && k8.dim() == 4, "aiter_sage: prepared q_int8/k_int8 must be ",
                    "4-D [batch, seq_pad, heads, 128], got ", q8.sizes(), " and ", k8.sizes());
  const at::Device device = q8.device();
  check_supported_device(device, shapes_only);
  const int64_t B = q8.size(0), Sq_pad = q8.size(1), H = q8.size(2), Skv_pad = k8.size(1);
  TORCH_CHECK_VALUE(B >= 1 && H >= 1 && Sq_pad >= 1 && Skv_pad >= 1 && B <= 65535 && H <= 65535,
                    "aiter_sage: prepared q_int8/k_int8 have unusable shapes ", q8.sizes(), " and ",
                    k8.sizes());
  TORCH_CHECK_VALUE(Sq_pad % SAGE_SEQ_ALIGN == 0 && Skv_pad % SAGE_SEQ_ALIGN == 0,
                    "aiter_sage: prepared sequence lengths must be multiples of ", SAGE_SEQ_ALIGN,
                    ", got ", Sq_pad, " and ", Skv_pad);
  check_seq_len(Sq_pad, "q_int8");
  check_seq_len(Skv_pad, "k_int8");
  const int64_t kv_len = kv_len_arg.value_or(seq_len);
  TORCH_CHECK_VALUE(seq_len >= 1 && seq_len <= Sq_pad, "aiter_sage: seq_len ", seq_len,
                    " does not fit the padded length ", Sq_pad, " of q_int8");
  TORCH_CHECK_VALUE(kv_len >= 1 && kv_len <= Skv_pad, "aiter_sage: ",
                    kv_len_arg ? "kv_len " : "seq_len (the key length unless kv_len is given) ",
                    kv_len, " does not fit the padded length ", Skv_pad, " of k_int8");
  check_prepared(q8, "q_int8", at::kChar, {B, Sq_pad, H, SAGE_HEAD_DIM}, device);
  check_prepared(q_scale, "q_scale", at::kFloat, {B, H, sage::scale_blocks(Sq_pad)}, device);
  check_prepared(k8, "k_int8", at::kChar, {B, Skv_pad, H, SAGE_HEAD_DIM}, device);
  check_prepared(k_scale, "k_scale", at::kFloat, {B, H, sage::scale_blocks(Skv_pad)}, device);
  check_prepared(v8, "v_fp8", kFp8Storage, {B, H, SAGE_HEAD_DIM, Skv_pad}, device);
  check_prepared(v_scale, "v_scale", at::kFloat, {B, H, SAGE_HEAD_DIM}, device);
  return {B, H, seq_len, kv_len, Sq_pad, Skv_pad};
}

// out_rows: q_len (the attention op) or the padded length (the raw fwd, upstream's shape).
at::Tensor fwd_checked(const at::Tensor& q8_in, const at::Tensor& q_scale_in,
                       const at::Tensor& k8_in, const at::Tensor& k_scale_in,
                       const at::Tensor& v8_in, const at::Tensor& v_scale_in, int64_t seq_len,
                       std::optional<int64_t> kv_len, bool padded_out,
                       const std::optional<std::string>& backend_arg) {
  const Problem sh = check_fwd_args(q8_in, q_scale_in, k8_in, k_scale_in, v8_in, v_scale_in,
                                    seq_len, kv_len, false);
  const at::Device device = q8_in.device();
  const std::string backend = requested_backend(backend_arg);
  const bool align = needs_alignment(device, backend);
  const at::Tensor q8 = aligned_for(q8_in, align), q_scale = aligned_for(q_scale_in, align),
                   k8 = aligned_for(k8_in, align), k_scale = aligned_for(k_scale_in, align),
                   v8 = aligned_for(v8_in, align), v_scale = aligned_for(v_scale_in, align);
  const int64_t out_rows = padded_out ? sh.Sq_pad : sh.q_len;
  at::Tensor out =
      at::empty({sh.B, out_rows, sh.H, SAGE_HEAD_DIM}, q8.options().dtype(at::kBFloat16));
  SageParams p = params_for(sh);
  p.q8 = const_cast<int8_t*>(ptr_of<int8_t>(q8));
  p.q_scale = const_cast<float*>(ptr_of<float>(q_scale));
  p.k8 = const_cast<int8_t*>(ptr_of<int8_t>(k8));
  p.k_scale = const_cast<float*>(ptr_of<float>(k_scale));
  p.v8 = const_cast<sage_fp8_t*>(ptr_of<sage_fp8_t>(v8));
  p.v_scale = const_cast<float*>(ptr_of<float>(v_scale));
  p.out = reinterpret_cast<sage_bf16_t*>(out.data_ptr());
  p.out_rows = int32_t(out_rows);
  p.out_stride_b = out.stride(0), p.out_stride_s = out.stride(1), p.out_stride_h = out.stride(2);
  launch(kAttentionModule, "sage_attention_launch", device, backend, p);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Op kernels (schemas in register_ops): upstream's argument names, order and defaults; what
// aiter_sage adds is keyword-only after them.
// ---------------------------------------------------------------------------------------------
PreparedTuple prepare_op(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         std::optional<double> softmax_scale,
                         const std::optional<at::Tensor>& query_weight,
                         const std::optional<at::Tensor>& key_weight,
                         const std::optional<at::Tensor>& cosine,
                         const std::optional<at::Tensor>& sine, double eps,
                         std::optional<std::string> backend) {
  NormRope nr{query_weight, key_weight, cosine, sine, eps};
  return prepare_checked(query, key, value, resolve_scale(softmax_scale), nr, backend);
}

at::Tensor fwd_op(const at::Tensor& q_int8, const at::Tensor& q_scale, const at::Tensor& k_int8,
                  const at::Tensor& k_scale, const at::Tensor& v_fp8, const at::Tensor& v_scale,
                  int64_t seq_len, std::optional<int64_t> kv_len,
                  std::optional<std::string> backend) {
  return fwd_checked(q_int8, q_scale, k_int8, k_scale, v_fp8, v_scale, seq_len, kv_len, true,
                     backend);
}

void check_attention_options(bool is_causal) {
  TORCH_CHECK_NOT_IMPLEMENTED(!is_causal, "aiter_sage: causal attention is not supported in ",
                              "this version (non-causal only)");
}

at::Tensor attention_op(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        std::optional<double> softmax_scale,
                        const std::optional<at::Tensor>& query_weight,
                        const std::optional<at::Tensor>& key_weight,
                        const std::optional<at::Tensor>& cosine,
                        const std::optional<at::Tensor>& sine, double eps, bool is_causal,
                        std::optional<std::string> backend) {
  check_attention_options(is_causal);
  NormRope nr{query_weight, key_weight, cosine, sine, eps};
  auto [q8, qs, k8, ks, v8, vs] =
      prepare_checked(query, key, value, resolve_scale(softmax_scale), nr, backend);
  return fwd_checked(q8, qs, k8, ks, v8, vs, query.size(1), key.size(1), false, backend);
}

// The fake implementations' checks: the same rules on meta/fake tensors. The fakes derive the
// output shapes themselves, symbolically, so these only raise.
void check_prepare_meta(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        std::optional<double> softmax_scale,
                        const std::optional<at::Tensor>& query_weight,
                        const std::optional<at::Tensor>& key_weight,
                        const std::optional<at::Tensor>& cosine,
                        const std::optional<at::Tensor>& sine, double eps) {
  NormRope nr{query_weight, key_weight, cosine, sine, eps};
  check_prepare_args(query, key, value, resolve_scale(softmax_scale), nr, true);
}

void check_attention_meta(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          std::optional<double> softmax_scale,
                          const std::optional<at::Tensor>& query_weight,
                          const std::optional<at::Tensor>& key_weight,
                          const std::optional<at::Tensor>& cosine,
                          const std::optional<at::Tensor>& sine, double eps, bool is_causal) {
  check_attention_options(is_causal);
  check_prepare_meta(query, key, value, softmax_scale, query_weight, key_weight, cosine, sine, eps);
}

void check_fwd_meta(const at::Tensor& q8, const at::Tensor& q_scale, const at::Tensor& k8,
                    const at::Tensor& k_scale, const at::Tensor& v8, const at::Tensor& v_scale,
                    int64_t seq_len, std::optional<int64_t> kv_len) {
  check_fwd_args(q8, q_scale, k8, k_scale, v8, v_scale, seq_len, kv_len, true);
}

// Upstream's arguments, in upstream's order, with upstream's defaults.
constexpr const char* kUpstreamArgs =
    "Tensor query, Tensor key, Tensor value, float? softmax_scale=None, "
    "Tensor? query_weight=None, Tensor? key_weight=None, Tensor? cosine=None, "
    "Tensor? sine=None, float eps=1e-06";

std::unique_ptr<torch::Library> g_def_lib, g_cpu_lib, g_gpu_lib;

void register_ops() {
  TORCH_CHECK(!g_def_lib, "aiter_sage: ops already registered");
  auto def = std::make_unique<torch::Library>(torch::Library::FRAGMENT, "aiter", std::nullopt,
                                              __FILE__, __LINE__);
  const std::string prepare_schema = std::string("gfx1201_sage_prepare(") + kUpstreamArgs +
                                     ", *, str? backend=None) -> (Tensor, Tensor, Tensor, "
                                     "Tensor, Tensor, Tensor)";
  const std::string attention_schema = std::string("gfx1201_sage_attention(") + kUpstreamArgs +
                                       ", *, bool is_causal=False, str? backend=None) -> Tensor";
  def->def(prepare_schema.c_str());
  def->def(
      "gfx1201_sage_attention_fwd(Tensor q_int8, Tensor q_scale, Tensor k_int8, "
      "Tensor k_scale, Tensor v_fp8, Tensor v_scale, int seq_len, *, int? kv_len=None, "
      "str? backend=None) -> Tensor");
  def->def(attention_schema.c_str());
  auto cpu = std::make_unique<torch::Library>(torch::Library::IMPL, "aiter", c10::DispatchKey::CPU,
                                              __FILE__, __LINE__);
  cpu->impl("gfx1201_sage_prepare", TORCH_FN(prepare_op));
  cpu->impl("gfx1201_sage_attention_fwd", TORCH_FN(fwd_op));
  cpu->impl("gfx1201_sage_attention", TORCH_FN(attention_op));
#ifdef SAGE_TORCH_GPU
  auto gpu = std::make_unique<torch::Library>(torch::Library::IMPL, "aiter", c10::DispatchKey::CUDA,
                                              __FILE__, __LINE__);
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
  m.def("check_prepare_meta", &check_prepare_meta);
  m.def("check_attention_meta", &check_attention_meta);
  m.def("check_fwd_meta", &check_fwd_meta);
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
