// aiter_sage platform shim: the only place where kernel code meets a platform.
//
//   SAGE_EMU  : the gfx12 wave emulator (csrc/emu) runs the csrc/gfx12 sources on the CPU.
//   __HIP__   : real HIP (ROCm hipcc, or clang++ --offload-arch with -nogpulib). With
//               SAGE_HIPRTC too: the device half of a hiprtc build (hiprtc pre-includes its
//               own runtime header and resolves no system header; the host launch sections of
//               csrc/gfx12 are compiled out, see SAGE_HOST_LAUNCH).
//   SAGE_HIPRTC_HOST: the host half of a hiprtc build, plain C++ (g++ or clang++) against
//               the HIP runtime headers: kernels become named handles and sage_launch runs
//               them from the hiprtc code object through the HIP module API (sage/hiprtc_host.h).
//   __CUDACC__: NVIDIA port.
//   otherwise : plain host C++ (cpu backend, host tests).
//
// Kernel sources (csrc/gfx12) use only what is listed under "kernel API" below, never a
// builtin or threadIdx directly: the emulator implements exactly this list, so an
// unmodelled builtin is a compile error under emulation rather than a silent fallback.
// (Debian's HIP headers implement threadIdx through ockl, which has no gfx12 build; the
// workitem builtins keep -nogpulib builds link-clean.)
#pragma once
#include <stdint.h>  // under hiprtc: sage/hiprtc/stdint.h, passed as a named header
#if !defined(SAGE_HIPRTC)
#include <string.h>
#endif

// True where a .hip file's host launch section (module ABI, validation, grids, launches) is
// compiled: everywhere except the device half of a hiprtc build.
#if defined(SAGE_HIPRTC)
#define SAGE_HOST_LAUNCH 0
#else
#define SAGE_HOST_LAUNCH 1
#endif

#if defined(SAGE_EMU)
#define SAGE_HD inline
#elif defined(__HIP__) || defined(__CUDACC__)
#define SAGE_HD __host__ __device__ inline
#else
#define SAGE_HD inline
#endif

// ---------------------------------------------------------------------------------------
// Kernel API (HIP and EMU):
//   types      v2i32 (8-bit WMMA operand: 8 bytes), v8i32 / v8f32 (WMMA accumulators),
//              u32x4 (128-bit memory transfers)
//   kernels    SAGE_KERNEL(name, max_threads)  declares a kernel `extern "C"`
//              SAGE_KERNEL_NV_BLOCKS(name, max_threads, blocks): the same, and on NVIDIA
//                  `blocks` resident blocks per SM (a register cap); elsewhere SAGE_KERNEL
//                  (gfx12 occupancy is held by the ISA test, not by a launch bound)
//              SAGE_DEVICE                      a device function
//              sage_launch(kernel, grid(dim3-like x,y,z), threads, stream, args...)  (host)
//   ids        sage_thread_id(), sage_block_id_x/y/z(), sage_lane_id(), sage_wave_id()
//   sync       sage_barrier()                                  workgroup barrier
//   LDS        SAGE_LDS(type, name, count)  declares workgroup memory inside a kernel;
//              sage_lds_load<T>(name, byte_offset) / sage_lds_store<T>(name, byte_offset, v)
//   global     sage_gload<T>(ptr, byte_offset) / sage_gstore<T>(ptr, byte_offset, v)
//   cross-lane sage_shfl_xor(float|int, lane_mask)  (within the 32-lane wave)
//              sage_swap_halves(int|float)  (= shfl_xor 16, all lanes active; no address VGPR)
//              sage_readlane(int|float, lane)
//   WMMA       sage_wmma_i32_iu8(a, b, c)     signed x signed, no clamp   (v2i32,v2i32,v8i32)
//              sage_wmma_i32_iu8_ex<sgn_a, sgn_b, clamp>(a, b, c)
//              sage_wmma_f32_fp8(a, b, c)     e4m3 x e4m3 -> f32          (v2i32,v2i32,v8f32)
//              sage_wmma_f32_f16(a, b, c)     fp16 x fp16 -> f32         (u32x4,u32x4,v8f32)
//   convert    sage_cvt_pk_f16(x, y)          two f32 -> packed fp16 pair (RNE)
//   convert    sage_e4m3_sat(x)               f32 -> e4m3fn, quant.h f32_to_e4m3_sat's bits
//                                             (CUDA only, where SAGE_HAS_E4M3_SAT is defined)
//              sage_e4m3x2_finite(lo, hi)     two finite f32 -> two e4m3 bytes, lo low (CUDA
//                                             only, where SAGE_QUANT_V_RECIP is defined)
//   math       sage_fmax_nan(a, b)            NaN-propagating max (CUDA only, SAGE_HAS_FMAX_NAN)
//   convert    sage_cvt_pk_fp8(x, y, old, hi) two f32 -> two e4m3 bytes in the low (hi=false)
//                                             or high (hi=true) half of `old` (RNE, no clamp)
//   math       sage_exp2f(x) (hardware v_exp_f32), sage_log2f(x) (hardware v_log_f32, x > 0
//              normal; the emulator's accuracy: csrc/emu/README.md), sage_sqrtf, sage_rintf,
//              sage_fmaxf, sage_fminf, sage_fabsf, sage_rcpf (1/x, correctly rounded)
// ---------------------------------------------------------------------------------------

#if defined(SAGE_EMU)
#include "emu/sage_emu.h"  // implements the kernel API on the CPU

#elif defined(SAGE_HIPRTC_HOST)
#include "sage/hiprtc_host.h"  // the kernel API as host declarations + module-API launches

#elif defined(__CUDACC__)
// NVIDIA (nvcc): the SIMT part of the kernel API only (what csrc/simt/prepare.hip uses, and the
// cuda attention kernel's host side). A gfx12 wave of 32 lanes is a CUDA warp; LDS is shared
// memory. The gfx12 WMMA/fp8-convert builtins have no CUDA form here (the sm_90a attention uses
// wgmma directly, csrc/cuda/attention.cu): they are deleted, so a kernel that needs them fails
// to compile naming the wrapper.
#include <cuda_runtime.h>

struct v2i32 {
  int x, y;
};
typedef uint4 u32x4;

#define SAGE_DEVICE __device__ __forceinline__
// (max_threads, 1): one resident block is enough, so ptxas may use the whole register file
// (the 512-thread v_scale kernel otherwise spills at a 64-register cap).
#define SAGE_KERNEL(name, max_threads) \
  extern "C" __global__ void __launch_bounds__(max_threads, 1) name
#define SAGE_KERNEL_NV_BLOCKS(name, max_threads, blocks) \
  extern "C" __global__ void __launch_bounds__(max_threads, blocks) name

// max(a, b) that returns NaN when either is NaN (max.NaN, sm_80+; canonical NaN).
#define SAGE_HAS_FMAX_NAN 1
SAGE_DEVICE float sage_fmax_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// Two finite floats -> their e4m3fn codes in one conversion (RNE, saturating to +-448), lo in
// the low byte: sage_e4m3_sat's bits without its NaN repair (cvt.rn.satfinite gives every NaN
// as 0x7f; quant.h's quant_v_recip_arg gives no NaN).
SAGE_DEVICE uint16_t sage_e4m3x2_finite(float lo, float hi) {
  unsigned short pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
  return pair;
}
// f32 -> e4m3fn with round-to-nearest-even, saturating to +-448 (inf too), NaN -> 0x7f | sign:
// quant.h's f32_to_e4m3_sat on the hardware converter (sm_89+), the sign put back into its NaN;
// op_tests/cuda_probes/e4m3_probe.cu compares the two over all 2^32 floats. The bit-level
// encoder took ~25 instructions a value: prepare's v_quant was issue-bound (H200, B1 H24
// S16384: 52 instructions per element, 104 us).
#define SAGE_HAS_E4M3_SAT 1
SAGE_DEVICE uint8_t sage_e4m3_sat(float x) {
  const uint16_t pair = sage_e4m3x2_finite(x, 0.0f);  // x: low byte
  const uint8_t nan = uint8_t(((__float_as_uint(x) >> 24) & 0x80u) | 0x7fu);
  return x != x ? nan : uint8_t(pair & 0xffu);
}
// prepare's v_quant encodes with quant.h's quant_v_recip_arg (no division) and
// sage_e4m3x2_finite; it divides only for the values quant_v_recip_arg leaves (below e4m3's
// normal range) and for a channel whose scale is not v_recip_ok.
#define SAGE_QUANT_V_RECIP 1
// prepare's qk kernel quantizes with quant.h's quant_i8_recip (a multiply by 1/s, the division
// where it cannot vouch for the code): the division was ~12 instructions a value there.
#define SAGE_QUANT_I8_RECIP 1
// prepare's K mean with the fused norm / RoPE on K (k_mean_body; without them the head's
// channels are split over SAGE_K_MEAN_SLICES workgroups): rows of K in flight per thread
// group. One workgroup per head streams the whole head (the mean's pinned order), so its loads
// in flight set its speed (H100, B1 H24 S16384 DiT-like, when every smooth_k call took this
// path: v_scale_smooth 175 us at 4 rows, 148 at 8). 8 gave the FP16 build a stack frame at the
// 512-thread workgroup's 128 registers; 6 keeps 121, none.
#define SAGE_K_MEAN_ROWS_IN_FLIGHT 6

SAGE_DEVICE int sage_thread_id() { return int(threadIdx.x); }
SAGE_DEVICE int sage_block_id_x() { return int(blockIdx.x); }
SAGE_DEVICE int sage_block_id_y() { return int(blockIdx.y); }
SAGE_DEVICE int sage_block_id_z() { return int(blockIdx.z); }
SAGE_DEVICE int sage_lane_id() { return int(threadIdx.x) & 31; }
SAGE_DEVICE int sage_wave_id() { return int(threadIdx.x) >> 5; }
SAGE_DEVICE void sage_barrier() { __syncthreads(); }

// The gfx12 kernels call shuffles with every lane of the wave active (uniform control flow).
SAGE_DEVICE int sage_shfl_xor(int v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
SAGE_DEVICE float sage_shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
SAGE_DEVICE int sage_swap_halves(int v) { return __shfl_xor_sync(0xffffffffu, v, 16); }
SAGE_DEVICE float sage_swap_halves(float v) { return __shfl_xor_sync(0xffffffffu, v, 16); }
SAGE_DEVICE int sage_readlane(int v, int lane) { return __shfl_sync(0xffffffffu, v, lane); }
SAGE_DEVICE float sage_readlane(float v, int lane) { return __shfl_sync(0xffffffffu, v, lane); }

// Correctly rounded: the module is built without --use_fast_math (-prec-div/-prec-sqrt on) and
// with --fmad=false, so prepare's arithmetic is quant.h's single IEEE operations.
SAGE_DEVICE float sage_exp2f(float x) { return exp2f(x); }
SAGE_DEVICE float sage_log2f(float x) { return log2f(x); }
SAGE_DEVICE float sage_sqrtf(float x) { return __fsqrt_rn(x); }
SAGE_DEVICE float sage_rintf(float x) { return rintf(x); }
SAGE_DEVICE float sage_fmaxf(float a, float b) { return fmaxf(a, b); }
SAGE_DEVICE float sage_fminf(float a, float b) { return fminf(a, b); }
SAGE_DEVICE float sage_fabsf(float x) { return fabsf(x); }
SAGE_DEVICE float sage_rcpf(float x) { return __frcp_rn(x); }

struct sage_dim3 {
  unsigned x, y, z;
};
template <class... KArgs, class... Args>
inline int sage_launch(void (*kernel)(KArgs...), sage_dim3 grid, unsigned threads, void* stream,
                       Args... args) {
  // A header is formatted as C++, which would split the launch brackets.
  // clang-format off
  kernel<<<dim3(grid.x, grid.y, grid.z), dim3(threads), 0, static_cast<cudaStream_t>(stream)>>>(
      args...);
  // clang-format on
  return static_cast<int>(cudaGetLastError());
}

// Programmatic dependent launch (sm_90): a kernel launched with sage_launch_after_prior may be
// scheduled once every block of the kernel before it in the stream has called
// sage_dependents_may_start (or exited), and must call sage_wait_for_prior_grid before it reads
// what that kernel writes (the wait returns once it has completed, its writes visible).
#define SAGE_HAS_PDL 1
SAGE_DEVICE void sage_dependents_may_start() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
SAGE_DEVICE void sage_wait_for_prior_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// With `smem_bytes` of dynamic shared memory (the cuda attention kernel); a cudaError_t.
template <class... KArgs, class... Args>
inline int sage_launch_after_prior_smem(void (*kernel)(KArgs...), sage_dim3 grid, unsigned threads,
                                        unsigned smem_bytes, void* stream, Args... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid.x, grid.y, grid.z);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
  return static_cast<int>(e != cudaSuccess ? e : cudaGetLastError());
}
template <class... KArgs, class... Args>
inline int sage_launch_after_prior(void (*kernel)(KArgs...), sage_dim3 grid, unsigned threads,
                                   void* stream, Args... args) {
  return sage_launch_after_prior_smem(kernel, grid, threads, 0, stream, args...);
}

#elif defined(__HIP__)
#if !defined(SAGE_HIPRTC)
#include <hip/hip_runtime.h>
#endif

typedef int v2i32 __attribute__((ext_vector_type(2)));
typedef int v8i32 __attribute__((ext_vector_type(8)));
typedef float v8f32 __attribute__((ext_vector_type(8)));
typedef uint32_t u32x4 __attribute__((ext_vector_type(4)));

#define SAGE_DEVICE __device__ __forceinline__
#define SAGE_KERNEL(name, max_threads) \
  extern "C" __global__ void __launch_bounds__(max_threads) name

SAGE_DEVICE int sage_thread_id() { return __builtin_amdgcn_workitem_id_x(); }
SAGE_DEVICE int sage_block_id_x() { return __builtin_amdgcn_workgroup_id_x(); }
SAGE_DEVICE int sage_block_id_y() { return __builtin_amdgcn_workgroup_id_y(); }
SAGE_DEVICE int sage_block_id_z() { return __builtin_amdgcn_workgroup_id_z(); }
SAGE_DEVICE int sage_lane_id() { return sage_thread_id() & 31; }
SAGE_DEVICE int sage_wave_id() { return sage_thread_id() >> 5; }
// Not __syncthreads(): Debian's HIP 5.2 headers implement it as a call to the device
// library's __atomic_work_item_fence, which a -nogpulib build cannot link, and a real call in
// a kernel forces every live VGPR across it to scratch. Same semantics: LDS release, barrier,
// acquire at workgroup scope.
SAGE_DEVICE void sage_barrier() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

// ds_bpermute addresses lanes in bytes.
SAGE_DEVICE int sage_shfl_xor(int v, int mask) {
  int src = (sage_lane_id() ^ mask) << 2;
  return __builtin_amdgcn_ds_bpermute(src, v);
}
// = sage_shfl_xor(v, 16) with every lane active: v_permlanex16_b32 with the identity lane
// selects (lane i reads lane i of the other half-wave). A VALU op that needs no per-lane
// address VGPR and no LDS round trip.
SAGE_DEVICE int sage_swap_halves(int v) {
  return __builtin_amdgcn_permlanex16(v, v, 0x76543210u, 0xfedcba98u, false, false);
}
SAGE_DEVICE float sage_swap_halves(float v) {
  return __builtin_bit_cast(float, sage_swap_halves(__builtin_bit_cast(int, v)));
}
SAGE_DEVICE float sage_shfl_xor(float v, int mask) {
  return __builtin_bit_cast(float, sage_shfl_xor(__builtin_bit_cast(int, v), mask));
}
SAGE_DEVICE int sage_readlane(int v, int lane) { return __builtin_amdgcn_readlane(v, lane); }
SAGE_DEVICE float sage_readlane(float v, int lane) {
  return __builtin_bit_cast(float, __builtin_amdgcn_readlane(__builtin_bit_cast(int, v), lane));
}

// (hiprtc only: a hipcc/clang host pass may not report the device builtins.)
// A compiler without the gfx12 builtins (an older hiprtc building the prepare kernels for an
// older arch, as CI does) gets these as deleted functions: a kernel that needs them fails to
// compile naming the wrapper, and the kernels that do not still build.
#if !defined(SAGE_HIPRTC) || __has_builtin(__builtin_amdgcn_wmma_i32_16x16x16_iu8_w32_gfx12)
template <bool kSignedA, bool kSignedB, bool kClamp>
SAGE_DEVICE v8i32 sage_wmma_i32_iu8_ex(v2i32 a, v2i32 b, v8i32 c) {
  return __builtin_amdgcn_wmma_i32_16x16x16_iu8_w32_gfx12(kSignedA, a, kSignedB, b, c, kClamp);
}
SAGE_DEVICE v8i32 sage_wmma_i32_iu8(v2i32 a, v2i32 b, v8i32 c) {
  return sage_wmma_i32_iu8_ex<true, true, false>(a, b, c);
}
SAGE_DEVICE v8f32 sage_wmma_f32_fp8(v2i32 a, v2i32 b, v8f32 c) {
  return __builtin_amdgcn_wmma_f32_16x16x16_fp8_fp8_w32_gfx12(a, b, c);
}
SAGE_DEVICE int sage_cvt_pk_fp8(float x, float y, int old, bool hi) {
  return hi ? __builtin_amdgcn_cvt_pk_fp8_f32(x, y, old, true)
            : __builtin_amdgcn_cvt_pk_fp8_f32(x, y, old, false);
}
typedef _Float16 sage_v8f16 __attribute__((ext_vector_type(8)));
SAGE_DEVICE v8f32 sage_wmma_f32_f16(u32x4 a, u32x4 b, v8f32 c) {
  return __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12(__builtin_bit_cast(sage_v8f16, a),
                                                          __builtin_bit_cast(sage_v8f16, b), c);
}
#else
template <bool kSignedA, bool kSignedB, bool kClamp>
v8i32 sage_wmma_i32_iu8_ex(v2i32 a, v2i32 b, v8i32 c) = delete;
v8i32 sage_wmma_i32_iu8(v2i32 a, v2i32 b, v8i32 c) = delete;
v8f32 sage_wmma_f32_fp8(v2i32 a, v2i32 b, v8f32 c) = delete;
int sage_cvt_pk_fp8(float x, float y, int old, bool hi) = delete;
v8f32 sage_wmma_f32_f16(u32x4 a, u32x4 b, v8f32 c) = delete;
#endif
// Two f32 -> packed FP16 (x low, y high), each rounded to nearest even (v_cvt_f16_f32).
SAGE_DEVICE uint32_t sage_cvt_pk_f16(float x, float y) {
  typedef _Float16 v2f16 __attribute__((ext_vector_type(2)));
  return __builtin_bit_cast(uint32_t, v2f16{static_cast<_Float16>(x), static_cast<_Float16>(y)});
}
#if !defined(SAGE_HIPRTC) || __has_builtin(__builtin_amdgcn_exp2f)
SAGE_DEVICE float sage_exp2f(float x) { return __builtin_amdgcn_exp2f(x); }
#else
float sage_exp2f(float x) = delete;
#endif
#if !defined(SAGE_HIPRTC) || __has_builtin(__builtin_amdgcn_logf)
SAGE_DEVICE float sage_log2f(float x) { return __builtin_amdgcn_logf(x); }
#else
float sage_log2f(float x) = delete;
#endif
SAGE_DEVICE float sage_sqrtf(float x) { return __builtin_sqrtf(x); }
SAGE_DEVICE float sage_rintf(float x) { return __builtin_rintf(x); }
SAGE_DEVICE float sage_fmaxf(float a, float b) { return __builtin_fmaxf(a, b); }
SAGE_DEVICE float sage_fminf(float a, float b) { return __builtin_fminf(a, b); }
SAGE_DEVICE float sage_fabsf(float x) { return __builtin_fabsf(x); }
SAGE_DEVICE float sage_rcpf(float x) { return 1.0f / x; }

#if !defined(SAGE_HIPRTC)  // hiprtc compiles device code only
struct sage_dim3 {
  unsigned x, y, z;
};
template <class... KArgs, class... Args>
inline int sage_launch(void (*kernel)(KArgs...), sage_dim3 grid, unsigned threads, void* stream,
                       Args... args) {
  hipLaunchKernelGGL(kernel, dim3(grid.x, grid.y, grid.z), dim3(threads), 0,
                     static_cast<hipStream_t>(stream), args...);
  return static_cast<int>(hipGetLastError());
}
#endif                     // !SAGE_HIPRTC
#endif

// LDS and global memory access, the same on both GPU platforms (the emulator and the hiprtc
// host half bring their own).
#if !defined(SAGE_EMU) && !defined(SAGE_HIPRTC_HOST) && (defined(__CUDACC__) || defined(__HIP__))
#define SAGE_LDS(type, name, count) __shared__ type name[count]
template <class T, class L>
SAGE_DEVICE T sage_lds_load(const L* lds, int byte_offset) {
  return *reinterpret_cast<const T*>(reinterpret_cast<const char*>(lds) + byte_offset);
}
template <class T, class L>
SAGE_DEVICE void sage_lds_store(L* lds, int byte_offset, T v) {
  *reinterpret_cast<T*>(reinterpret_cast<char*>(lds) + byte_offset) = v;
}
template <class T>
SAGE_DEVICE T sage_gload(const void* p, int64_t byte_offset) {
  return *reinterpret_cast<const T*>(static_cast<const char*>(p) + byte_offset);
}
template <class T>
SAGE_DEVICE void sage_gstore(void* p, int64_t byte_offset, T v) {
  *reinterpret_cast<T*>(static_cast<char*>(p) + byte_offset) = v;
}
#endif

#ifndef SAGE_K_MEAN_ROWS_IN_FLIGHT  // gfx12 and the emulator: see prepare.hip's PrepTraits
#define SAGE_K_MEAN_ROWS_IN_FLIGHT 2
#endif

// Elsewhere the launch is a plain one and the dependency calls do nothing (stream order).
#if !defined(SAGE_HAS_PDL) && defined(SAGE_DEVICE)
SAGE_DEVICE void sage_dependents_may_start() {}
SAGE_DEVICE void sage_wait_for_prior_grid() {}
#endif
#ifndef SAGE_HAS_PDL
#define sage_launch_after_prior sage_launch
#endif

#ifndef SAGE_KERNEL_NV_BLOCKS
#define SAGE_KERNEL_NV_BLOCKS(name, max_threads, blocks) SAGE_KERNEL(name, max_threads)
#endif
