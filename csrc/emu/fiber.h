// aiter_sage gfx12 emulator: minimal cooperative fibers (one per emulated lane).
//
// x86-64: a hand-written context switch that saves only the callee-saved registers, MXCSR and
// the x87 control word (~20 instructions, no system call), because every wave operation
// switches through all 32 lanes of a wave and ucontext's swapcontext makes a sigprocmask
// system call each time. Other architectures fall back to ucontext.
// ASan: every switch is announced with __sanitizer_start/finish_switch_fiber so that ASan
// knows which stack is live (required for correct reports and no false positives).
#pragma once
#include <stddef.h>
#include <stdint.h>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#pragma GCC visibility push(hidden)
namespace sage_emu {

#if defined(__SANITIZE_ADDRESS__)
#define SAGE_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SAGE_EMU_ASAN 1
#endif
#endif
#ifndef SAGE_EMU_ASAN
#define SAGE_EMU_ASAN 0
#endif

// A stack region; owns an mmap'd block with a PROT_NONE guard page below it, so overflowing
// the lane stack faults instead of corrupting a neighbour.
struct FiberStack {
  char* base = nullptr;  // lowest usable byte
  size_t size = 0;
  char* map = nullptr;
  size_t map_size = 0;
  bool allocate(size_t bytes);
  void release();
};

// The host thread's own context (the scheduler), which fibers switch back to.
struct HostContext {
  void* sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t uc;
#endif
  // ASan: the host stack's extent, learned on the first switch into a fiber.
  const void* asan_bottom = nullptr;
  size_t asan_size = 0;
};

struct Fiber {
  void* sp = nullptr;
  FiberStack* stack = nullptr;
  void* asan_fake_stack = nullptr;
  HostContext* host = nullptr;
  void (*fn)(void*) = nullptr;
  void* arg = nullptr;
#if !defined(__x86_64__)
  ucontext_t uc;
#endif
  // Prepares the fiber to start fn(arg) on `stack` at the next resume().
  void reset(FiberStack* stack, HostContext* host, void (*fn)(void*), void* arg);
  // Host -> fiber; returns when the fiber yields or finishes.
  void resume();
  // Fiber -> host (called on the fiber). `finished` tells ASan the fiber will not come back.
  void yield(bool finished = false);
};

}  // namespace sage_emu
#pragma GCC visibility pop
