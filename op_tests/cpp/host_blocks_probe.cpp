// Drives sage::HostBlockCache (csrc/binding/host_blocks.h) without torch and prints one
// line per check, "name value", for op_tests/backends/test_host_blocks.py to assert on.
#include <stdio.h>
#include <string.h>

#include "binding/host_blocks.h"

namespace {

constexpr size_t kMiB = size_t(1) << 20;

// A taken block and its capacity, given back as one.
struct Held {
  void* data;
  size_t capacity;
};
Held take(sage::HostBlockCache& cache, size_t mib) {
  Held h{nullptr, 0};
  h.data = cache.take(mib * kMiB, &h.capacity);
  return h;
}
void give(sage::HostBlockCache& cache, const Held& h) { cache.give(h.data, h.capacity); }

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
    const Held b8 = take(cache, 8), b16 = take(cache, 16), b40 = take(cache, 40);
    for (const Held& h : {b40, b16, b8}) give(cache, h);
    const Held q = take(cache, 12);  // 16 fits best (8 too small, 40 more than twice)
    printf("best_fit_16 %d\n", int(q.data == b16.data && q.capacity == b16.capacity));
    const Held r = take(cache, 15);  // 40 > 2 x 16: a new block
    printf("no_oversized_block %d\n", int(r.data != b40.data && r.data != b8.data));
    give(cache, q);
    give(cache, r);
  }
  {  // the limit: the oldest cached blocks go first
    HostBlockCache cache(10 * kMiB);
    const Held a = take(cache, 4), b = take(cache, 4), c = take(cache, 4);
    for (const Held& h : {a, b, c}) give(cache, h);  // 12 MiB > 10: a (the oldest) is unmapped
    const HostBlockCache::Stats s = cache.stats();
    printf("limited_blocks %zu bytes %zu\n", s.cached_blocks, s.cached_bytes / kMiB);
    const Held x = take(cache, 4), y = take(cache, 4);
    const bool x_kept = x.data == b.data || x.data == c.data;
    const bool y_kept = y.data == b.data || y.data == c.data;
    printf("kept_newest %d\n", int(x_kept && y_kept && x.data != y.data));
    give(cache, x);
    give(cache, y);
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
