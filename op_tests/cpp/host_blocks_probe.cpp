// Drives sage::HostBlockCache (csrc/include/sage/host_blocks.h) without torch and prints one
// line per check, "name value", for op_tests/test_host_blocks.py to assert on.
#include <stdio.h>
#include <string.h>

#include "sage/host_blocks.h"

namespace {

constexpr size_t kMiB = size_t(1) << 20;

bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % sage::HostBlockCache::kAlign == 0;
}

}  // namespace

int main() {
  using sage::HostBlockCache;
  {  // capacity rounding, alignment, writable memory, reuse of a given-back block
    HostBlockCache cache(64 * kMiB);
    size_t cap = 0;
    void* a = cache.take(5 * kMiB + 1, &cap);
    printf("capacity %zu\n", cap / kMiB);
    printf("aligned %d\n", int(a && aligned(a)));
    memset(a, 0x5a, cap);  // every byte is ours
    cache.give(a, cap);
    printf("cached_after_give %zu\n", cache.stats().cached_bytes / kMiB);
    size_t cap2 = 0;
    void* b = cache.take(5 * kMiB, &cap2);
    printf("reused_same_block %d\n", int(b == a && cap2 == cap));
    const HostBlockCache::Stats s = cache.stats();
    printf("hits %llu misses %llu\n", (unsigned long long)s.hits, (unsigned long long)s.misses);
    cache.give(b, cap2);
  }
  {  // best fit, and no block of more than twice the request
    HostBlockCache cache(256 * kMiB);
    size_t c8 = 0, c16 = 0, c40 = 0;
    void* p8 = cache.take(8 * kMiB, &c8);
    void* p16 = cache.take(16 * kMiB, &c16);
    void* p40 = cache.take(40 * kMiB, &c40);
    cache.give(p40, c40);
    cache.give(p16, c16);
    cache.give(p8, c8);
    size_t c = 0;
    void* q = cache.take(12 * kMiB, &c);  // 16 fits best (8 too small, 40 more than twice)
    printf("best_fit_16 %d\n", int(q == p16 && c == c16));
    void* r = cache.take(15 * kMiB, &c);  // 40 > 2 x 16: a new block
    printf("no_oversized_block %d\n", int(r != p40 && r != p8));
    cache.give(q, c16);
    cache.give(r, c);
  }
  {  // the limit: the oldest cached blocks go first
    HostBlockCache cache(10 * kMiB);
    size_t ca = 0, cb = 0, cc = 0;
    void* a = cache.take(4 * kMiB, &ca);
    void* b = cache.take(4 * kMiB, &cb);
    void* c = cache.take(4 * kMiB, &cc);
    cache.give(a, ca);
    cache.give(b, cb);
    cache.give(c, cc);  // 12 MiB > 10: a (the oldest) is unmapped
    const HostBlockCache::Stats s = cache.stats();
    printf("limited_blocks %zu bytes %zu\n", s.cached_blocks, s.cached_bytes / kMiB);
    size_t cx = 0, cy = 0;
    void* x = cache.take(4 * kMiB, &cx);
    void* y = cache.take(4 * kMiB, &cy);
    printf("kept_newest %d\n", int((x == b || x == c) && (y == b || y == c) && x != y));
    cache.give(x, cx);
    cache.give(y, cy);
    cache.trim();
    printf("trimmed %zu\n", cache.stats().cached_blocks);
  }
  {  // limit 0: nothing is kept
    HostBlockCache cache(0);
    size_t cap = 0;
    void* a = cache.take(4 * kMiB, &cap);
    cache.give(a, cap);
    printf("zero_limit_cached %zu\n", cache.stats().cached_blocks);
  }
  return 0;
}
