// aiter_sage gfx12 wave emulator: the kernel API of sage/platform.h implemented on the CPU.
//
// Included by sage/platform.h when SAGE_EMU is defined; never include it directly. Kernel
// sources (csrc/gfx12/*.hip) compile unchanged as host C++:
//   clang++-19 -x c++ -std=c++20 -DSAGE_EMU -O2 -fPIC -fvisibility=hidden -I csrc -I csrc/include
// and link with csrc/emu/runtime.cpp + csrc/emu/fiber.cpp (see csrc/emu/README.md).
//
// Execution model (details in README.md): every GPU thread ("lane") is a cooperative fiber.
// Code between two communicating API calls runs natively, lane after lane. Each communicating
// call (WMMA, shuffle, readlane, barrier, LDS load/store) is a wave-synchronous point: the lane
// parks its request and yields; once every live lane of its wave has arrived, the runtime
// executes the operation once for the whole wave, as the hardware would in lockstep.
//
// Only the names listed in platform.h exist here. threadIdx, __shared__ and __builtin_amdgcn_*
// are deliberately not provided, so an unmodelled builtin is a compile error.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

#include "sage/module_abi.h"  // sage::set_error: launches report failures like every backend

// Same vector types as the HIP side (clang ext_vector_type), so kernels see identical types.
typedef int v2i32 __attribute__((ext_vector_type(2)));
typedef int v8i32 __attribute__((ext_vector_type(8)));
typedef float v8f32 __attribute__((ext_vector_type(8)));
typedef uint32_t u32x4 __attribute__((ext_vector_type(4)));

struct sage_dim3 {
  unsigned x, y, z;
};

#pragma GCC visibility push(hidden)  // one runtime per module: never interposed across .so files
namespace sage_emu {

// Where a kernel-API call was made; filled by default arguments at the call site. Used to
// group lanes that are at the same operation and to name the code in reports.
struct Site {
  const char* file;
  unsigned line;
  unsigned col;
};
#define SAGE_EMU_SITE_PARAMS                                                                   \
  const char *sage_site_file_ = __builtin_FILE(), unsigned sage_site_line_ = __builtin_LINE(), \
             unsigned sage_site_col_ = __builtin_COLUMN()
#define SAGE_EMU_SITE \
  ::sage_emu::Site { sage_site_file_, sage_site_line_, sage_site_col_ }

enum class Op : uint8_t {
  kNone,
  kBarrier,
  kLdsLoad,
  kLdsStore,
  kShflXor,
  kReadLane,
  kWmmaIu8,
  kWmmaFp8,
  kWmmaF16
};

// A lane's parked request at a wave-synchronous point. Operands live on the lane's stack,
// which stays valid while the lane is parked.
struct OpRequest {
  Op op;
  bool sign_a, sign_b, clamp;  // kWmmaIu8
  uint32_t size, align;        // LDS access width / natural alignment of the type
  Site site;
  const void* lds;     // LDS pointer given by the kernel (emulated address)
  int64_t arg;         // LDS byte offset, shuffle mask or readlane index
  const void* src[3];  // operands (WMMA a, b, c; store value; shuffle value)
  void* dst;           // result
};

// Identity of the lane currently running on this host thread.
struct LaneIds {
  int thread_id, lane_id, wave_id;
  int block_x, block_y, block_z;
};
extern __thread const LaneIds* t_lane_ids;  // __thread: no TLS init wrapper

// Parks the current lane at a wave-synchronous point; returns when the op was executed.
void wave_sync(OpRequest& req);
// SAGE_LDS: the workgroup's storage of one declaration (same for every lane of a workgroup).
struct LdsDecl {
  const char* name;
  size_t bytes;
  size_t align;
};
void* lds_declare(const LdsDecl* decl, Site site);
// Global-memory access checks (alignment); returns false when the access must be skipped.
void report_global_misaligned(const void* p, int64_t off, size_t align, bool store, Site site);
extern bool g_check_align;

// SAGE_KERNEL metadata, found through the kernel's symbol name at launch.
struct KernelInfo {
  const char* name;
  int max_threads;
};
typedef void (*KernelEntry)(const void* closure);
// Runs grid x threads synchronously; returns 0 or non-zero with *summary describing reports.
int launch(const void* kernel, sage_dim3 grid, unsigned threads, KernelEntry entry,
           const void* closure, const char** summary);

// ---- value models of gfx12 instructions (pure functions; emu/models.cpp) ----
uint8_t cvt_f32_to_fp8_e4m3(float x);  // v_cvt_pk_fp8_f32 per element: RNE, no clamp
uint16_t cvt_f32_to_f16(float x);      // v_cvt_f16_f32: RNE, FP16 denormals kept
float fp8_e4m3_to_f32(uint8_t b);
float exp2_v_exp_f32(float x);
float log2_v_log_f32(float x);

}  // namespace sage_emu
#pragma GCC visibility pop

// ------------------------------ kernel API ------------------------------------------------
#define SAGE_DEVICE inline
#define SAGE_KERNEL(name, max_threads)                                       \
  extern "C" __attribute__((visibility("default"), used))                    \
  const ::sage_emu::KernelInfo sage_emu_kinfo_##name = {#name, max_threads}; \
  extern "C" __attribute__((visibility("default"))) void name

inline int sage_thread_id() { return sage_emu::t_lane_ids->thread_id; }
inline int sage_block_id_x() { return sage_emu::t_lane_ids->block_x; }
inline int sage_block_id_y() { return sage_emu::t_lane_ids->block_y; }
inline int sage_block_id_z() { return sage_emu::t_lane_ids->block_z; }
inline int sage_lane_id() { return sage_emu::t_lane_ids->lane_id; }
inline int sage_wave_id() { return sage_emu::t_lane_ids->wave_id; }

inline void sage_barrier(SAGE_EMU_SITE_PARAMS) {
  sage_emu::OpRequest r{};
  r.op = sage_emu::Op::kBarrier;
  r.site = SAGE_EMU_SITE;
  sage_emu::wave_sync(r);
}

// Workgroup memory. `name` is a reference to an array at an *emulated* LDS address: pass it
// (or a pointer derived from it) to sage_lds_load/store; dereferencing it directly faults
// (SIGSEGV in a PROT_NONE window), because that would bypass lockstep and the checks.
#define SAGE_LDS(type, name, count)                                                           \
  static const ::sage_emu::LdsDecl sage_emu_lds_decl_##name = {#name, sizeof(type) * (count), \
                                                               alignof(type)};                \
  type(&name)[count] = *static_cast<type(*)[count]>(                                          \
      ::sage_emu::lds_declare(&sage_emu_lds_decl_##name, ::sage_emu::Site{__FILE__, __LINE__, 0}))

namespace sage_emu {
// An LDS access of sizeof(T) bytes: a wave-synchronous op, so lanes see program order.
template <class T>
inline OpRequest lds_request(Op op, const void* lds, int byte_offset, const Site& site) {
  static_assert(std::is_trivially_copyable_v<T>, "LDS values must be trivially copyable");
  OpRequest r{};
  r.op = op;
  r.size = sizeof(T);
  r.align = alignof(T);
  r.site = site;
  r.lds = lds;
  r.arg = byte_offset;
  return r;
}
}  // namespace sage_emu

template <class T, class L>
inline T sage_lds_load(const L* lds, int byte_offset, SAGE_EMU_SITE_PARAMS) {
  T out;
  auto r = sage_emu::lds_request<T>(sage_emu::Op::kLdsLoad, lds, byte_offset, SAGE_EMU_SITE);
  r.dst = &out;
  sage_emu::wave_sync(r);
  return out;
}
template <class T, class L>
inline void sage_lds_store(L* lds, int byte_offset, T v, SAGE_EMU_SITE_PARAMS) {
  auto r = sage_emu::lds_request<T>(sage_emu::Op::kLdsStore, lds, byte_offset, SAGE_EMU_SITE);
  r.src[0] = &v;
  sage_emu::wave_sync(r);
}

// Global memory is lane-private in between barriers (as on the GPU: no lockstep guarantee is
// needed), so it is plain host memory access; ASan builds catch out-of-bounds accesses.
template <class T>
inline T sage_gload(const void* p, int64_t byte_offset, SAGE_EMU_SITE_PARAMS) {
  const char* a = static_cast<const char*>(p) + byte_offset;
  if (sage_emu::g_check_align && (reinterpret_cast<uintptr_t>(a) % alignof(T)) != 0)
    sage_emu::report_global_misaligned(p, byte_offset, alignof(T), false, SAGE_EMU_SITE);
  T out;
  memcpy(&out, a, sizeof(T));
  return out;
}
template <class T>
inline void sage_gstore(void* p, int64_t byte_offset, T v, SAGE_EMU_SITE_PARAMS) {
  char* a = static_cast<char*>(p) + byte_offset;
  if (sage_emu::g_check_align && (reinterpret_cast<uintptr_t>(a) % alignof(T)) != 0)
    sage_emu::report_global_misaligned(p, byte_offset, alignof(T), true, SAGE_EMU_SITE);
  memcpy(a, &v, sizeof(T));
}

namespace sage_emu {
// A cross-lane op on one 32-bit value per lane: all live lanes arrive, then it runs once.
inline int lane_op(Op op, int v, int arg, const Site& site) {
  int out;
  OpRequest r{};
  r.op = op;
  r.site = site;
  r.arg = arg;
  r.src[0] = &v;
  r.dst = &out;
  wave_sync(r);
  return out;
}
}  // namespace sage_emu

// ds_bpermute-based xor shuffle within the 32-lane wave.
inline int sage_shfl_xor(int v, int mask, SAGE_EMU_SITE_PARAMS) {
  return sage_emu::lane_op(sage_emu::Op::kShflXor, v, mask, SAGE_EMU_SITE);
}
inline float sage_shfl_xor(float v, int mask, SAGE_EMU_SITE_PARAMS) {
  return __builtin_bit_cast(float, sage_shfl_xor(__builtin_bit_cast(int, v), mask, sage_site_file_,
                                                 sage_site_line_, sage_site_col_));
}
// v_permlanex16_b32 with identity selects: lane i reads lane i of the other half-wave; the
// emulator reports nothing different from a shfl_xor 16 (all lanes are active where used).
inline int sage_swap_halves(int v, SAGE_EMU_SITE_PARAMS) {
  return sage_emu::lane_op(sage_emu::Op::kShflXor, v, 16, SAGE_EMU_SITE);
}
inline float sage_swap_halves(float v, SAGE_EMU_SITE_PARAMS) {
  return __builtin_bit_cast(float, sage_swap_halves(__builtin_bit_cast(int, v), sage_site_file_,
                                                    sage_site_line_, sage_site_col_));
}
inline int sage_readlane(int v, int lane, SAGE_EMU_SITE_PARAMS) {
  return sage_emu::lane_op(sage_emu::Op::kReadLane, v, lane, SAGE_EMU_SITE);
}
inline float sage_readlane(float v, int lane, SAGE_EMU_SITE_PARAMS) {
  return __builtin_bit_cast(float, sage_readlane(__builtin_bit_cast(int, v), lane, sage_site_file_,
                                                 sage_site_line_, sage_site_col_));
}

namespace sage_emu {
// One WMMA of the wave: every lane parks its operands; the model runs once for the wave.
template <class D, class A, class B>
inline D wmma_request(Op op, const A& a, const B& b, const D& c, Site site, bool sign_a = false,
                      bool sign_b = false, bool clamp = false) {
  D d;
  OpRequest r{};
  r.op = op;
  r.sign_a = sign_a;
  r.sign_b = sign_b;
  r.clamp = clamp;
  r.site = site;
  r.src[0] = &a;
  r.src[1] = &b;
  r.src[2] = &c;
  r.dst = &d;
  wave_sync(r);
  return d;
}
}  // namespace sage_emu

template <bool kSignedA, bool kSignedB, bool kClamp>
inline v8i32 sage_wmma_i32_iu8_ex(v2i32 a, v2i32 b, v8i32 c, SAGE_EMU_SITE_PARAMS) {
  return sage_emu::wmma_request(sage_emu::Op::kWmmaIu8, a, b, c, SAGE_EMU_SITE, kSignedA, kSignedB,
                                kClamp);
}
inline v8i32 sage_wmma_i32_iu8(v2i32 a, v2i32 b, v8i32 c, SAGE_EMU_SITE_PARAMS) {
  return sage_wmma_i32_iu8_ex<true, true, false>(a, b, c, sage_site_file_, sage_site_line_,
                                                 sage_site_col_);
}
inline v8f32 sage_wmma_f32_fp8(v2i32 a, v2i32 b, v8f32 c, SAGE_EMU_SITE_PARAMS) {
  return sage_emu::wmma_request(sage_emu::Op::kWmmaFp8, a, b, c, SAGE_EMU_SITE);
}
// v_wmma_f32_16x16x16_f16: a, b hold 8 FP16 values each (element 2w in the low half of word w).
inline v8f32 sage_wmma_f32_f16(u32x4 a, u32x4 b, v8f32 c, SAGE_EMU_SITE_PARAMS) {
  return sage_emu::wmma_request(sage_emu::Op::kWmmaF16, a, b, c, SAGE_EMU_SITE);
}
// Two f32 -> a packed pair of FP16 (x low, y high), each rounded to nearest even.
inline uint32_t sage_cvt_pk_f16(float x, float y) {
  return uint32_t(sage_emu::cvt_f32_to_f16(x)) | (uint32_t(sage_emu::cvt_f32_to_f16(y)) << 16);
}

// v_cvt_pk_fp8_f32: x -> byte 0 (2), y -> byte 1 (3) of the low (high) half of `old`.
inline int sage_cvt_pk_fp8(float x, float y, int old, bool hi) {
  uint32_t pair = uint32_t(sage_emu::cvt_f32_to_fp8_e4m3(x)) |
                  (uint32_t(sage_emu::cvt_f32_to_fp8_e4m3(y)) << 8);
  uint32_t u = uint32_t(old);
  u = hi ? ((u & 0x0000ffffu) | (pair << 16)) : ((u & 0xffff0000u) | pair);
  return int(u);
}
inline float sage_exp2f(float x) { return sage_emu::exp2_v_exp_f32(x); }
inline float sage_log2f(float x) { return sage_emu::log2_v_log_f32(x); }
inline float sage_sqrtf(float x) { return __builtin_sqrtf(x); }
inline float sage_rintf(float x) { return __builtin_rintf(x); }
inline float sage_fmaxf(float a, float b) { return __builtin_fmaxf(a, b); }
inline float sage_fminf(float a, float b) { return __builtin_fminf(a, b); }
inline float sage_fabsf(float x) { return __builtin_fabsf(x); }
inline float sage_rcpf(float x) { return 1.0f / x; }

// Host side: runs the whole grid before returning (the stream is ignored: emulation is
// synchronous). Returns 0, or non-zero after sage::set_error() got a summary of the reports.
template <class... KArgs, class... Args>
inline int sage_launch(void (*kernel)(KArgs...), sage_dim3 grid, unsigned threads, void* stream,
                       Args... args) {
  static_assert(sizeof...(KArgs) == sizeof...(Args),
                "sage_launch: argument count differs from the kernel's parameter count");
  (void)stream;
  struct Closure {
    void (*kernel)(KArgs...);
    std::tuple<std::decay_t<KArgs>...> args;
  };
  const Closure closure{
      kernel, std::tuple<std::decay_t<KArgs>...>(static_cast<std::decay_t<KArgs>>(args)...)};
  auto entry = +[](const void* p) {
    const Closure* c = static_cast<const Closure*>(p);
    std::apply(c->kernel, c->args);
  };
  const char* summary = nullptr;
  int rc = sage_emu::launch(reinterpret_cast<const void*>(kernel), grid, threads, entry, &closure,
                            &summary);
  if (rc != 0) sage::set_error("%s", summary ? summary : "emulated launch failed");
  return rc;
}

// C API of the emulator runtime (exported by every emulated module).
extern "C" {
__attribute__((visibility("default"))) int sage_emu_report_count(void);
__attribute__((visibility("default"))) const char* sage_emu_reports_text(void);
__attribute__((visibility("default"))) void sage_emu_clear_reports(void);
__attribute__((visibility("default"))) void sage_emu_set_num_threads(int n);
}
