// aiter_sage gfx12 emulator: generic entry point for running any SAGE_KERNEL of a shim-based
// source from a foreign caller (aiter_sage/emu.py through ctypes, the CLI).
//
// A generated translation unit includes the kernel source, then this header, then invokes
// SAGE_EMU_EXPORT_KERNEL(name) for each kernel. That exports
//   int         sage_emu_run_<name>(const sage_emu_arg* args, int nargs,
//                                   unsigned gx, unsigned gy, unsigned gz, unsigned threads);
//   const char* sage_emu_signature_<name>(void);   e.g. "p,i4,f4,s256"
// Parameters are described as p (pointer), i<bytes> (integer), f<bytes> (floating point),
// s<bytes> (any other trivially copyable type, passed as raw bytes), so the caller can check
// its arguments before anything runs.
#pragma once
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <string>
#include <type_traits>
#include <utility>

#include "sage/platform.h"

extern "C" {
// kind: 0 pointer (p), 1 integer (i), 2 floating point (f), 3 raw bytes (p points to size bytes)
typedef struct sage_emu_arg {
  int32_t kind;
  int32_t size;
  int64_t i;
  double f;
  void* p;
} sage_emu_arg;
}

#pragma GCC visibility push(hidden)
namespace sage_emu {

template <class T>
std::string param_code() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_pointer_v<U>)
    return "p";
  else if constexpr (std::is_integral_v<U> || std::is_enum_v<U>)
    return "i" + std::to_string(sizeof(U));
  else if constexpr (std::is_floating_point_v<U>)
    return "f" + std::to_string(sizeof(U));
  else
    return "s" + std::to_string(sizeof(U));
}

template <class T>
bool convert_arg(const sage_emu_arg& a, T* out) {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_pointer_v<U>) {
    if (a.kind != 0) return false;
    *out = static_cast<U>(a.p);
  } else if constexpr (std::is_integral_v<U> || std::is_enum_v<U>) {
    if (a.kind != 1) return false;
    *out = static_cast<U>(a.i);
  } else if constexpr (std::is_floating_point_v<U>) {
    if (a.kind == 2)
      *out = static_cast<U>(a.f);
    else if (a.kind == 1)
      *out = static_cast<U>(a.i);
    else
      return false;
  } else {
    static_assert(std::is_trivially_copyable_v<U>, "kernel parameters must be trivially copyable");
    if (a.kind != 3 || a.size != int32_t(sizeof(U)) || !a.p) return false;
    memcpy(static_cast<void*>(out), a.p, sizeof(U));
  }
  return true;
}

template <class... K>
std::string signature(void (*)(K...)) {
  std::string s;
  ((s += (s.empty() ? "" : ",") + param_code<K>()), ...);
  return s;
}

template <class... K, size_t... I>
int run_packed_impl(void (*k)(K...), const sage_emu_arg* args, sage_dim3 grid, unsigned threads,
                    std::index_sequence<I...>) {
  std::tuple<std::remove_cv_t<K>...> values;
  bool ok = true;
  int bad = -1;
  ((ok && !convert_arg(args[I], &std::get<I>(values)) ? (ok = false, bad = int(I)) : 0), ...);
  if (!ok) return sage::set_error("sage_emu: argument %d does not match the kernel parameter", bad);
  return sage_launch(k, grid, threads, nullptr, std::get<I>(values)...);
}

template <class... K>
int run_packed(void (*k)(K...), const sage_emu_arg* args, int nargs, unsigned gx, unsigned gy,
               unsigned gz, unsigned threads) {
  if (nargs != int(sizeof...(K)))
    return sage::set_error("sage_emu: kernel takes %d arguments, %d given", int(sizeof...(K)),
                           nargs);
  return run_packed_impl(k, args, sage_dim3{gx, gy, gz}, threads, std::index_sequence_for<K...>{});
}

}  // namespace sage_emu
#pragma GCC visibility pop

#define SAGE_EMU_EXPORT_KERNEL(name)                                                              \
  extern "C" __attribute__((visibility("default"))) int sage_emu_run_##name(                      \
      const sage_emu_arg* args, int nargs, unsigned gx, unsigned gy, unsigned gz,                 \
      unsigned threads) {                                                                         \
    return ::sage_emu::run_packed(&name, args, nargs, gx, gy, gz, threads);                       \
  }                                                                                               \
  extern "C" __attribute__((visibility("default"))) const char* sage_emu_signature_##name(void) { \
    static const std::string s = ::sage_emu::signature(&name);                                    \
    return s.c_str();                                                                             \
  }

// The error text of this thread's last failed run (from sage::set_error).
#define SAGE_EMU_EXPORT_LAST_ERROR()                                                        \
  extern "C" __attribute__((visibility("default"))) const char* sage_emu_last_error(void) { \
    return sage::last_error_buffer();                                                       \
  }
