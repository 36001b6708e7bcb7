// aiter_sage: the one idiom that turns a validated run-time field of SageParams into a
// template argument (after FlashAttention-2's static_switch.h). Each macro evaluates its body
// (a lambda) with NAME a constexpr value; check_params has already limited the field to the
// values the switch knows. Every backend's launcher picks its kernels through these.
#pragma once
#include "sage/params.h"

#define SAGE_BOOL_SWITCH(COND, NAME, ...) \
  [&] {                                   \
    if (COND) {                           \
      constexpr bool NAME = true;         \
      return __VA_ARGS__();               \
    } else {                              \
      constexpr bool NAME = false;        \
      return __VA_ARGS__();               \
    }                                     \
  }()

// head_dim_pad: the two kernel head dims (SAGE_HEAD_DIM_SMALL / SAGE_HEAD_DIM_LARGE).
#define SAGE_HEAD_DIM_SWITCH(DIM, NAME, ...)    \
  [&] {                                         \
    if ((DIM) == SAGE_HEAD_DIM_SMALL) {         \
      constexpr int NAME = SAGE_HEAD_DIM_SMALL; \
      return __VA_ARGS__();                     \
    } else {                                    \
      constexpr int NAME = SAGE_HEAD_DIM_LARGE; \
      return __VA_ARGS__();                     \
    }                                           \
  }()

namespace sage {
// For the last branch of an `if constexpr` chain that picks a kernel from a variant table: a
// combination the table lacks is a compile error at its instantiation.
template <int...>
inline constexpr bool kNoSuchVariant = false;
}  // namespace sage
