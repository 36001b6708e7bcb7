// aiter_sage gfx12 emulator: fiber implementation (see fiber.h for why it is hand-written).
#include "emu/fiber.h"

#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if SAGE_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__x86_64__)
// void sage_emu_swap(void** save_sp, void* new_sp)
// Pushes the System V callee-saved registers and the FP control state on the current stack,
// stores the stack pointer in *save_sp, switches to new_sp and pops the same frame there.
// The symbols are .hidden so that every emulated module keeps its own copy.
asm(R"(
  .text
  .p2align 4
  .globl sage_emu_swap
  .hidden sage_emu_swap
  .type sage_emu_swap,@function
sage_emu_swap:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size sage_emu_swap, .-sage_emu_swap

  .p2align 4
  .globl sage_emu_fiber_start
  .hidden sage_emu_fiber_start
  .type sage_emu_fiber_start,@function
sage_emu_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size sage_emu_fiber_start, .-sage_emu_fiber_start
)");
extern "C" void sage_emu_swap(void** save_sp, void* new_sp) __attribute__((visibility("hidden")));
extern "C" void sage_emu_fiber_start() __attribute__((visibility("hidden")));
#endif

namespace sage_emu {

bool FiberStack::allocate(size_t bytes) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  bytes = (bytes + page - 1) / page * page;
  map_size = bytes + page;
  void* p = mmap(nullptr, map_size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    map = nullptr;
    return false;
  }
  map = static_cast<char*>(p);
  mprotect(map, page, PROT_NONE);  // guard page: stacks grow down into it
  base = map + page;
  size = bytes;
  return true;
}

void FiberStack::release() {
  if (map) munmap(map, map_size);
  map = base = nullptr;
  size = map_size = 0;
}

// First code run on a fresh fiber: completes the ASan switch, runs fn, and never returns.
static void fiber_main(void* self) {
  Fiber* f = static_cast<Fiber*>(self);
#if SAGE_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &f->host->asan_bottom, &f->host->asan_size);
#endif
  f->fn(f->arg);
  f->yield(/*finished=*/true);
  __builtin_trap();  // a finished fiber is never resumed
}

#if !defined(__x86_64__)
static void fiber_main_uc(unsigned hi, unsigned lo) {
  fiber_main(reinterpret_cast<void*>((uintptr_t(hi) << 32) | uintptr_t(lo)));
}
#endif

void Fiber::reset(FiberStack* s, HostContext* h, void (*f)(void*), void* a) {
  stack = s;
  host = h;
  fn = f;
  arg = a;
  asan_fake_stack = nullptr;
#if SAGE_EMU_ASAN
  // A fiber abandoned mid-way (aborted workgroup) leaves poisoned redzones behind.
  __asan_unpoison_memory_region(s->base, s->size);
#endif
#if defined(__x86_64__)
  // Initial frame, popped by sage_emu_swap: fp-control, r15, r14, r13 (fn), r12 (arg), rbx,
  // rbp (0 ends frame-pointer unwinding), return address = sage_emu_fiber_start. After the
  // `ret`, rsp is 16-byte aligned, so the `call` in sage_emu_fiber_start is ABI-correct.
  uintptr_t top = (reinterpret_cast<uintptr_t>(s->base) + s->size - 64) & ~uintptr_t(15);
  uint64_t* frame = reinterpret_cast<uint64_t*>(top) - 8;
  const uint32_t mxcsr = 0x1f80;  // round-to-nearest, no FTZ/DAZ, exceptions masked
  const uint16_t fpcw = 0x037f;
  frame[0] = uint64_t(mxcsr) | (uint64_t(fpcw) << 32);
  frame[1] = 0;                                        // r15
  frame[2] = 0;                                        // r14
  frame[3] = reinterpret_cast<uint64_t>(&fiber_main);  // r13
  frame[4] = reinterpret_cast<uint64_t>(this);         // r12
  frame[5] = 0;                                        // rbx
  frame[6] = 0;                                        // rbp
  frame[7] = reinterpret_cast<uint64_t>(&sage_emu_fiber_start);
  sp = frame;
#else
  getcontext(&uc);
  uc.uc_stack.ss_sp = s->base;
  uc.uc_stack.ss_size = s->size;
  uc.uc_link = nullptr;
  uintptr_t me = reinterpret_cast<uintptr_t>(this);
  makecontext(&uc, reinterpret_cast<void (*)()>(&fiber_main_uc), 2, unsigned(me >> 32),
              unsigned(me & 0xffffffffu));
#endif
}

void Fiber::resume() {
#if SAGE_EMU_ASAN
  void* host_fake = nullptr;
  __sanitizer_start_switch_fiber(&host_fake, stack->base, stack->size);
#endif
#if defined(__x86_64__)
  sage_emu_swap(&host->sp, sp);
#else
  swapcontext(&host->uc, &uc);
#endif
#if SAGE_EMU_ASAN
  __sanitizer_finish_switch_fiber(host_fake, nullptr, nullptr);
#endif
}

void Fiber::yield(bool finished) {
#if SAGE_EMU_ASAN
  // nullptr: the fiber's fake stack (use-after-return detection) can be released.
  __sanitizer_start_switch_fiber(finished ? nullptr : &asan_fake_stack, host->asan_bottom,
                                 host->asan_size);
#else
  (void)finished;
#endif
#if defined(__x86_64__)
  sage_emu_swap(&sp, host->sp);
#else
  swapcontext(&uc, &host->uc);
#endif
#if SAGE_EMU_ASAN
  __sanitizer_finish_switch_fiber(asan_fake_stack, &host->asan_bottom, &host->asan_size);
#endif
}

}  // namespace sage_emu
