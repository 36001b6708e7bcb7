// aiter_sage gfx12 emulator: the runtime's internal types (launch state, workers, lanes,
// reports), implemented in runtime.cpp.
#pragma once
#include <stdint.h>

#include <atomic>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "emu/fiber.h"
#include "emu/models.h"
#include "emu/sage_emu.h"

#pragma GCC visibility push(hidden)
namespace sage_emu {

constexpr int kMaxThreadsPerBlock = 1024;
constexpr int kMaxWaves = kMaxThreadsPerBlock / kWaveSize;  // 32: a reader mask fits uint32
constexpr uint32_t kLdsBytes = 64 * 1024;                   // gfx12 LDS per workgroup
// Emulated LDS addresses live in a PROT_NONE window twice the LDS size: a direct dereference
// faults, and pointers just past the end are still recognised as LDS (for OOB reports).
constexpr uint32_t kLdsWindowBytes = 2 * kLdsBytes;

enum class ReportKind : uint8_t {
  kLaunchConfig,
  kLdsRace,
  kBarrierDivergence,
  kLdsOutOfBounds,
  kLdsBadPointer,
  kLdsOverflow,
  kLdsMisaligned,
  kLdsUninitRead,
  kGlobalMisaligned,
  kWmmaExec,
  kReadlaneInactive,
};
const char* report_kind_name(ReportKind k);

// Reports of one launch, shared by its worker threads. Identical findings (same kind and
// sites) are merged into one entry with a count, so a race inside a loop is one report.
struct ReportKey {
  ReportKind kind;
  Site a, b;
  bool operator==(const ReportKey& o) const;
};
struct ReportKeyHash {
  size_t operator()(const ReportKey& k) const;
};
class Reports {
 public:
  // Returns true when this is the first occurrence of `key` (the caller then formats text).
  bool add_occurrence(const ReportKey& key);
  void set_text(const ReportKey& key, std::string text);
  size_t size() const { return order_.size(); }
  std::string render() const;
  std::string first_line() const;

 private:
  struct Entry {
    std::string text;
    uint64_t count = 0;
  };
  mutable std::mutex mu_;
  std::unordered_map<ReportKey, Entry, ReportKeyHash> entries_;
  std::vector<ReportKey> order_;
};

struct LaunchState {
  const char* kernel_name;
  unsigned threads;
  sage_dim3 grid;
  KernelEntry entry;
  const void* closure;
  Reports reports;
  bool check_uninit;
  size_t stack_bytes = 0;  // per lane, from AITER_SAGE_EMU_STACK_KB (validated at launch)
};

struct Lane {
  LaneIds ids;
  Fiber fiber;
  OpRequest* req = nullptr;
  enum State : uint8_t { kRunnable, kParked, kDone } state = kRunnable;
  struct Worker* worker = nullptr;
};

struct WaveState {
  int first = 0, count = 0;
  enum State : uint8_t { kActive, kAtBarrier, kDone } state = kActive;
  unsigned barriers_passed = 0;
  Site barrier_site{};
};

struct LdsAlloc {
  const LdsDecl* decl;
  uint32_t offset, bytes;
};

// Per-byte LDS history for race and uninitialised-read detection. Epochs number the
// barrier intervals of this worker; a new workgroup starts a new epoch range, so no reset.
struct ShadowByte {
  uint32_t w_epoch, r_epoch, r_mask;
  uint16_t w_wave, w_site, r_wave, r_site;
};

// One host thread's emulation state: it runs whole workgroups, one at a time.
struct Worker {
  explicit Worker(LaunchState* l);
  ~Worker();
  void run_workgroup(int64_t linear_index);

  // --- state of the current workgroup ---
  LaunchState* launch;
  HostContext host;
  std::vector<FiberStack> stacks;
  std::vector<Lane> lanes;
  std::vector<WaveState> waves;
  std::vector<LdsAlloc> allocs;
  uint32_t lds_used = 0;
  std::vector<unsigned char> lds;
  std::vector<ShadowByte> shadow;
  uint32_t epoch = 0, wg_epoch_base = 0;
  bool aborted = false;
  int alloc_errno = 0;  // non-zero: the lane stacks could not be mapped; do not run
  int bx = 0, by = 0, bz = 0;
  Lane* current = nullptr;
  std::vector<Site> sites;  // site ids used in the shadow
  std::unordered_map<uint64_t, std::vector<uint16_t>> site_index;

  uint16_t site_id(const Site& s);
  void report(ReportKind kind, const Site& a, const Site& b, const char* fmt, ...)
      __attribute__((format(printf, 5, 6)));
  std::string where() const;  // "kernel K, workgroup (x,y,z)"

 private:
  void run_lane(Lane& l);
  void run_wave(WaveState& w, int wave_index);
  bool release_barrier();
  void execute_group(int wave_index, Lane* group[kWaveSize], int n);
  void exec_lds(int wave_index, Lane& l);
  void exec_shfl(Lane* group[kWaveSize], bool readlane);
  void exec_wmma(int wave_index, Lane* group[kWaveSize], int n, Op op);
};

extern thread_local Worker* t_worker;
// Address of the emulated LDS window (PROT_NONE).
uintptr_t lds_window();
std::string site_text(const Site& s);

}  // namespace sage_emu
#pragma GCC visibility pop
