// aiter_sage host block cache: the memory of the binding's large CPU tensors (prepared Q/K/V and
// outputs), kept for reuse once torch frees them.
//
// Why: torch's CPU allocator takes blocks of this size from mmap and gives them back on free, so
// every call page-faults all of its memory again, 4 KiB at a time, and the faults land inside
// the kernels' parallel loops. On the 16-core Xeon VM (B1 H24 S16384 D128) that cost the fused
// op 100 ms of its 597 (prepare alone went from 19 to 90 ms); with the blocks reused the same
// call took 496 ms. New blocks are 2 MiB aligned and advised for transparent huge pages
// (MADV_HUGEPAGE; where the OS allows it, 512x fewer faults on their first touch).
//
// A block is taken by the best fit among the cached ones (at least the request, at most twice
// it) or mapped new; given back, it goes to the cache, and the oldest cached blocks are
// unmapped while the cache holds more than its limit (AITER_SAGE_HOST_CACHE_MB, default 1024;
// 0 disables the cache: every block is mapped and unmapped). Thread-safe. No torch here: the
// binding wraps blocks into tensors, a host test drives this class directly.
#pragma once

#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <vector>

namespace sage {

class HostBlockCache {
 public:
  static constexpr size_t kMinBytes = size_t(4) << 20;  // smaller: torch's allocator (malloc's heap
                                                        // keeps and reuses these)
  static constexpr size_t kAlign = size_t(2) << 20;     // one x86-64 huge page
  static constexpr size_t kDefaultLimitMb = 1024;

  struct Stats {
    uint64_t hits = 0, misses = 0;  // takes served from the cache / by a new mapping
    size_t cached_bytes = 0, cached_blocks = 0;
  };

  explicit HostBlockCache(size_t limit_bytes) : limit_(limit_bytes) {}
  HostBlockCache(const HostBlockCache&) = delete;
  HostBlockCache& operator=(const HostBlockCache&) = delete;

  // The limit from AITER_SAGE_HOST_CACHE_MB (unset or unparsable: the default).
  static size_t limit_from_env() {
    const char* env = getenv("AITER_SAGE_HOST_CACHE_MB");
    char* end = nullptr;
    const long long mb = env ? strtoll(env, &end, 10) : -1;
    if (!env || end == env || *end || mb < 0) return kDefaultLimitMb << 20;
    return size_t(mb) << 20;
  }

  static size_t capacity_for(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

  // A block of capacity_for(bytes) bytes or more, kAlign-aligned; its capacity in *capacity.
  // nullptr when the OS has no memory.
  void* take(size_t bytes, size_t* capacity) {
    const size_t want = capacity_for(bytes);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      size_t best = blocks_.size();
      for (size_t i = 0; i < blocks_.size(); ++i) {
        const size_t cap = blocks_[i].capacity;
        if (cap >= want && cap <= 2 * want &&
            (best == blocks_.size() || cap < blocks_[best].capacity))
          best = i;
      }
      if (best < blocks_.size()) {
        const Block b = blocks_[best];
        blocks_.erase(blocks_.begin() + std::ptrdiff_t(best));
        cached_bytes_ -= b.capacity;
        ++stats_.hits;
        *capacity = b.capacity;
        return b.data;
      }
      ++stats_.misses;
    }
    *capacity = want;
    return map_aligned(want);
  }

  // Back from a tensor that held it: cached (newest last), then the oldest unmapped while the
  // cache is over its limit.
  void give(void* data, size_t capacity) {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_.push_back({data, capacity});
      cached_bytes_ += capacity;
      while (cached_bytes_ > limit_) {
        evicted.push_back(blocks_.front());
        cached_bytes_ -= blocks_.front().capacity;
        blocks_.erase(blocks_.begin());
      }
    }
    for (const Block& b : evicted) munmap(b.data, b.capacity);  // outside the lock
  }

  // Unmaps every cached block (blocks held by live tensors stay theirs).
  void trim() {
    std::vector<Block> all;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      all.swap(blocks_);
      cached_bytes_ = 0;
    }
    for (const Block& b : all) munmap(b.data, b.capacity);
  }

  // For pthread_atfork: the lock is held across fork(), so the child's copy of the cache is
  // never one that another thread had locked at that moment (it would stay locked forever).
  void lock_for_fork() { mutex_.lock(); }
  void unlock_after_fork() { mutex_.unlock(); }

  Stats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    Stats s = stats_;
    s.cached_bytes = cached_bytes_;
    s.cached_blocks = blocks_.size();
    return s;
  }

 private:
  struct Block {
    void* data;
    size_t capacity;
  };

  // `bytes` (a multiple of kAlign) at a kAlign boundary: map kAlign more and unmap the slack on
  // both sides.
  static void* map_aligned(size_t bytes) {
    const size_t span = bytes + kAlign;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t base = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t start = (base + kAlign - 1) / kAlign * kAlign;
    if (start > base) munmap(raw, start - base);
    const uintptr_t tail = base + span - (start + bytes);
    if (tail) munmap(reinterpret_cast<void*>(start + bytes), tail);
    void* data = reinterpret_cast<void*>(start);
#ifdef MADV_HUGEPAGE
    madvise(data, bytes, MADV_HUGEPAGE);  // advice only: refused (THP off) changes nothing
#endif
    return data;
  }

  mutable std::mutex mutex_;
  std::vector<Block> blocks_;  // cached, oldest first
  size_t cached_bytes_ = 0;
  size_t limit_;
  Stats stats_;
};

}  // namespace sage
