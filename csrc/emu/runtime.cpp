// aiter_sage gfx12 emulator: the scheduler (grid -> host threads -> waves -> lane fibers), the
// wave-synchronous operations, LDS with its checks, launch and the C API.
//
// Scheduling of one workgroup (why it looks like this: README.md "Execution model"):
//   repeat
//     for each wave that is not waiting at a barrier:
//       repeat: run every runnable lane until it parks at a kernel-API call or returns;
//               pick ONE group of parked lanes at the same call site (earliest site first),
//               execute that operation for the group at once, make the group runnable;
//       until every live lane waits at a barrier (or all returned)
//     check that the waves agree on the barrier, advance the LDS epoch, release them
//   until every wave returned
#include "emu/runtime.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <algorithm>
#include <thread>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace sage_emu {

__thread const LaneIds* t_lane_ids = nullptr;
thread_local Worker* t_worker = nullptr;
namespace {

// "0" turns a check off; anything else (or unset) keeps the default.
bool env_flag(const char* name, bool fallback) {
  const char* e = getenv(name);
  if (!e || !*e) return fallback;
  return e[0] != '0';
}

std::atomic<int> g_thread_override{0};

// Host worker threads: the launch's override (sage_emu_set_num_threads), else
// AITER_SAGE_EMU_THREADS, else the hardware's concurrency. A bad setting is an error, not a
// silent fallback to the default, as for the lane stack size below.
constexpr long kMaxWorkers = 4096;

bool worker_count(int* n, std::string* error) {
  if (const int o = g_thread_override.load(); o > 0) {
    *n = o;
    return true;
  }
  const char* e = getenv("AITER_SAGE_EMU_THREADS");
  if (!e || !*e) {
    const unsigned hw = std::thread::hardware_concurrency();
    *n = hw ? int(hw) : 1;
    return true;
  }
  char* end = nullptr;
  errno = 0;
  const long v = strtol(e, &end, 10);
  if (errno != 0 || end == e || *end != '\0' || v < 1 || v > kMaxWorkers) {
    *error = std::string("AITER_SAGE_EMU_THREADS=") + e +
             " is not a host worker thread count from 1 to " + std::to_string(kMaxWorkers);
    return false;
  }
  *n = int(v);
  return true;
}

// Lane stack size. Kernels keep a few hundred bytes of vector registers per lane plus call
// frames; ASan frames carry redzones, hence the larger default there. A bad setting is an
// error, not a fallback: too small overflows into the guard page, too large cannot be mapped
// for 1024 lanes (and would have aborted the process).
constexpr long kMinStackKb = 16, kMaxStackKb = 65536;

bool lane_stack_bytes(size_t* bytes, std::string* error) {
  const char* e = getenv("AITER_SAGE_EMU_STACK_KB");
  if (!e || !*e) {
    *bytes = size_t(SAGE_EMU_ASAN ? 256 : 64) * 1024;
    return true;
  }
  char* end = nullptr;
  errno = 0;
  const long kb = strtol(e, &end, 10);
  if (errno != 0 || end == e || *end != '\0' || kb < kMinStackKb || kb > kMaxStackKb) {
    *error = std::string("AITER_SAGE_EMU_STACK_KB=") + e +
             " is not a lane stack size in KiB from " + std::to_string(kMinStackKb) + " to " +
             std::to_string(kMaxStackKb);
    return false;
  }
  *bytes = size_t(kb) * 1024;
  return true;
}

// ---- process-wide report log (C API) ----
std::mutex g_log_mu;
std::string g_log;
int g_log_count = 0;

}  // namespace

bool g_check_align = env_flag("AITER_SAGE_EMU_CHECK_ALIGN", true);

uintptr_t lds_window() {
  static const uintptr_t base = [] {
    void* p = mmap(nullptr, kLdsWindowBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    return p == MAP_FAILED ? uintptr_t(0) : reinterpret_cast<uintptr_t>(p);  // launch reports 0
  }();
  return base;
}

std::string site_text(const Site& s) {
  if (!s.file) return "?";
  const char* f = strrchr(s.file, '/');
  char buf[512];
  snprintf(buf, sizeof buf, "%s:%u", f ? f + 1 : s.file, s.line);
  return buf;
}

// Program order of two call sites, used to pick which diverged group of lanes goes first:
// within one file the earlier line is (for structured code without back edges) earlier in
// program order, which makes lanes of an if-body run before lanes waiting after it.
static bool site_before(const Site& a, const Site& b) {
  if (a.file != b.file) {
    int c = strcmp(a.file ? a.file : "", b.file ? b.file : "");
    if (c != 0) return c < 0;
  }
  if (a.line != b.line) return a.line < b.line;
  return a.col < b.col;
}
static bool same_site(const Site& a, const Site& b) {
  return a.line == b.line && a.col == b.col &&
         (a.file == b.file || (a.file && b.file && strcmp(a.file, b.file) == 0));
}

// ------------------------------------------------------------------ reports -------------
const char* report_kind_name(ReportKind k) {
  switch (k) {
    case ReportKind::kLaunchConfig:
      return "launch-config";
    case ReportKind::kLdsRace:
      return "lds-race";
    case ReportKind::kBarrierDivergence:
      return "barrier-divergence";
    case ReportKind::kLdsOutOfBounds:
      return "lds-out-of-bounds";
    case ReportKind::kLdsBadPointer:
      return "lds-bad-pointer";
    case ReportKind::kLdsOverflow:
      return "lds-overflow";
    case ReportKind::kLdsMisaligned:
      return "lds-misaligned";
    case ReportKind::kLdsUninitRead:
      return "lds-uninitialized-read";
    case ReportKind::kGlobalMisaligned:
      return "global-misaligned";
    case ReportKind::kWmmaExec:
      return "wmma-partial-exec";
    case ReportKind::kReadlaneInactive:
      return "readlane-inactive";
  }
  return "?";
}

bool ReportKey::operator==(const ReportKey& o) const {
  return kind == o.kind && same_site(a, o.a) && same_site(b, o.b);
}
size_t ReportKeyHash::operator()(const ReportKey& k) const {
  size_t h = size_t(k.kind);
  h = h * 1000003u ^ k.a.line ^ (size_t(k.a.col) << 20);
  h = h * 1000003u ^ k.b.line ^ (size_t(k.b.col) << 20);
  return h;
}
bool Reports::add_occurrence(const ReportKey& key) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    ++it->second.count;
    return false;
  }
  entries_[key].count = 1;
  order_.push_back(key);
  return true;
}
void Reports::set_text(const ReportKey& key, std::string text) {
  std::lock_guard<std::mutex> g(mu_);
  entries_[key].text = std::move(text);
}
std::string Reports::render() const {
  std::lock_guard<std::mutex> g(mu_);
  std::string out;
  for (const ReportKey& k : order_) {
    const Entry& e = entries_.at(k);
    out += e.text;
    if (e.count > 1) out += " [x" + std::to_string(e.count) + "]";
    out += "\n";
  }
  return out;
}
std::string Reports::first_line() const {
  std::lock_guard<std::mutex> g(mu_);
  return order_.empty() ? std::string() : entries_.at(order_.front()).text;
}

void Worker::report(ReportKind kind, const Site& a, const Site& b, const char* fmt, ...) {
  ReportKey key{kind, a, b};
  if (!launch->reports.add_occurrence(key)) return;
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  launch->reports.set_text(key,
                           std::string("[") + report_kind_name(kind) + "] " + where() + ": " + msg);
}

std::string Worker::where() const {
  char buf[256];
  snprintf(buf, sizeof buf, "kernel %s, workgroup (%d,%d,%d)", launch->kernel_name, bx, by, bz);
  return buf;
}

uint16_t Worker::site_id(const Site& s) {
  const uint64_t h = (reinterpret_cast<uintptr_t>(s.file) * 31u) ^ (uint64_t(s.line) << 16) ^ s.col;
  std::vector<uint16_t>& ids = site_index[h];
  for (uint16_t id : ids)
    if (same_site(sites[id], s)) return id;
  if (sites.size() >= 65535) return 0;
  sites.push_back(s);
  ids.push_back(uint16_t(sites.size() - 1));
  return uint16_t(sites.size() - 1);
}

// ------------------------------------------------------------------ worker --------------
static void lane_entry(void* p) {
  Lane* l = static_cast<Lane*>(p);
  l->worker->launch->entry(l->worker->launch->closure);
  l->state = Lane::kDone;
}

Worker::Worker(LaunchState* l) : launch(l) {
  const unsigned n = l->threads;
  stacks.resize(n);
  for (FiberStack& s : stacks)
    if (!s.allocate(l->stack_bytes)) {
      alloc_errno = errno;  // the launch fails with this instead of the process aborting
      return;
    }
  lanes.resize(n);
  waves.resize((n + kWaveSize - 1) / kWaveSize);
  lds.assign(kLdsBytes, 0);
  shadow.assign(kLdsBytes, ShadowByte{});
  sites.push_back(Site{nullptr, 0, 0});  // id 0: unknown
}

Worker::~Worker() {
  for (FiberStack& s : stacks) s.release();
}

void Worker::run_lane(Lane& l) {
  current = &l;
  t_lane_ids = &l.ids;
  l.fiber.resume();
  current = nullptr;
}

void Worker::run_workgroup(int64_t linear) {
  const int64_t gx = launch->grid.x, gy = launch->grid.y;
  bx = int(linear % gx);
  by = int((linear / gx) % gy);
  bz = int(linear / (gx * gy));
  allocs.clear();
  lds_used = 0;
  aborted = false;
  epoch += 1;
  wg_epoch_base = epoch;
  // LDS contents are undefined at workgroup start on the GPU; a recognisable pattern makes
  // uses of stale data visible (the uninitialised-read check names them).
  memset(lds.data(), 0xA5, lds.size());
  for (size_t i = 0; i < lanes.size(); ++i) {
    Lane& l = lanes[i];
    l.ids = LaneIds{int(i), int(i % kWaveSize), int(i / kWaveSize), bx, by, bz};
    l.state = Lane::kRunnable;
    l.req = nullptr;
    l.worker = this;
    l.fiber.reset(&stacks[i], &host, &lane_entry, &l);
  }
  for (size_t w = 0; w < waves.size(); ++w) {
    waves[w] = WaveState{};
    waves[w].first = int(w * kWaveSize);
    waves[w].count = std::min<int>(kWaveSize, int(lanes.size()) - int(w * kWaveSize));
  }
  for (;;) {
    for (size_t w = 0; w < waves.size() && !aborted; ++w)
      if (waves[w].state == WaveState::kActive) run_wave(waves[w], int(w));
    if (aborted || !release_barrier()) break;
  }
}

// Runs one wave until all of its live lanes wait at a barrier or have returned.
void Worker::run_wave(WaveState& w, int wave_index) {
  Lane* group[kWaveSize];
  for (;;) {
    for (int i = 0; i < w.count; ++i) {
      Lane& l = lanes[size_t(w.first + i)];
      if (l.state == Lane::kRunnable) run_lane(l);
      if (aborted) return;
    }
    // The earliest (program order) non-barrier call site where lanes are parked.
    const Site* best = nullptr;
    Op best_op = Op::kNone;
    for (int i = 0; i < w.count; ++i) {
      Lane& l = lanes[size_t(w.first + i)];
      if (l.state != Lane::kParked || l.req->op == Op::kBarrier) continue;
      if (!best || site_before(l.req->site, *best)) {
        best = &l.req->site;
        best_op = l.req->op;
      }
    }
    if (best) {
      const Site site = *best;
      int n = 0;
      for (int i = 0; i < kWaveSize; ++i) group[i] = nullptr;
      for (int i = 0; i < w.count; ++i) {
        Lane& l = lanes[size_t(w.first + i)];
        if (l.state == Lane::kParked && l.req->op == best_op && same_site(l.req->site, site)) {
          group[i] = &l;
          ++n;
        }
      }
      execute_group(wave_index, group, n);
      for (int i = 0; i < kWaveSize; ++i)
        if (group[i]) {
          group[i]->state = Lane::kRunnable;
          group[i]->req = nullptr;
        }
      continue;
    }
    // Only barriers (or nothing) left.
    const Lane* first_waiting = nullptr;
    for (int i = 0; i < w.count; ++i) {
      const Lane& l = lanes[size_t(w.first + i)];
      if (l.state != Lane::kParked) continue;
      if (!first_waiting) {
        first_waiting = &l;
      } else if (!same_site(l.req->site, first_waiting->req->site)) {
        report(ReportKind::kBarrierDivergence, first_waiting->req->site, l.req->site,
               "lanes of wave %d wait at different barriers: lane %d at %s, lane %d at %s",
               wave_index, first_waiting->ids.lane_id, site_text(first_waiting->req->site).c_str(),
               l.ids.lane_id, site_text(l.req->site).c_str());
      }
    }
    if (!first_waiting) {
      w.state = WaveState::kDone;
    } else {
      w.state = WaveState::kAtBarrier;
      w.barrier_site = first_waiting->req->site;
    }
    return;
  }
}

// All waves wait at a barrier or have returned. Checks agreement, then releases the waiting
// ones (as s_barrier does on gfx12: waves that ended no longer take part). Returns false when
// the workgroup has finished.
bool Worker::release_barrier() {
  int first_waiting = -1, first_done = -1;
  for (size_t w = 0; w < waves.size(); ++w) {
    if (waves[w].state == WaveState::kAtBarrier && first_waiting < 0) first_waiting = int(w);
    if (waves[w].state == WaveState::kDone && first_done < 0) first_done = int(w);
  }
  if (first_waiting < 0) return false;
  const WaveState& ref = waves[size_t(first_waiting)];
  if (first_done >= 0) {
    report(ReportKind::kBarrierDivergence, ref.barrier_site, Site{nullptr, 0, 0},
           "wave %d waits at barrier #%u (%s) but wave %d has already returned (a real GPU "
           "would release the barrier without it or hang, depending on the code)",
           first_waiting, ref.barriers_passed + 1, site_text(ref.barrier_site).c_str(), first_done);
  }
  for (size_t w = 0; w < waves.size(); ++w) {
    const WaveState& ws = waves[w];
    if (ws.state == WaveState::kAtBarrier && !same_site(ws.barrier_site, ref.barrier_site)) {
      report(ReportKind::kBarrierDivergence, ref.barrier_site, ws.barrier_site,
             "waves wait at different barriers: wave %d at barrier #%u (%s), wave %d at "
             "barrier #%u (%s)",
             first_waiting, ref.barriers_passed + 1, site_text(ref.barrier_site).c_str(), int(w),
             ws.barriers_passed + 1, site_text(ws.barrier_site).c_str());
    }
  }
  epoch += 1;  // accesses after the barrier are ordered after those before it
  for (WaveState& ws : waves) {
    if (ws.state != WaveState::kAtBarrier) continue;
    ws.state = WaveState::kActive;
    ws.barriers_passed += 1;
    for (int i = 0; i < ws.count; ++i) {
      Lane& l = lanes[size_t(ws.first + i)];
      if (l.state == Lane::kParked) {
        l.state = Lane::kRunnable;
        l.req = nullptr;
      }
    }
  }
  return true;
}

// ------------------------------------------------------------------ wave operations -----
void Worker::execute_group(int wave_index, Lane* group[kWaveSize], int n) {
  Lane* any = nullptr;
  for (int i = 0; i < kWaveSize && !any; ++i) any = group[i];
  const Op op = any->req->op;
  switch (op) {
    case Op::kLdsLoad:
    case Op::kLdsStore:
      // Lanes in ascending order: for two lanes storing to one address the higher lane wins.
      for (int i = 0; i < kWaveSize; ++i)
        if (group[i]) exec_lds(wave_index, *group[i]);
      break;
    case Op::kShflXor:
      exec_shfl(group, false);
      break;
    case Op::kReadLane:
      exec_shfl(group, true);
      break;
    case Op::kWmmaIu8:
    case Op::kWmmaFp8:
    case Op::kWmmaF16:
      exec_wmma(wave_index, group, n, op);
      break;
    default:
      break;
  }
}

// ds_bpermute (the HIP side's shuffle) returns 0 for an inactive source lane (see e.g. the
// Rust core::arch::amdgpu ds_bpermute docs: "Reading from inactive lanes returns 0");
// v_readlane reads the register regardless of EXEC, a value the emulator does not have, so
// that case is reported.
void Worker::exec_shfl(Lane* group[kWaveSize], bool readlane) {
  int32_t value[kWaveSize] = {};
  for (int i = 0; i < kWaveSize; ++i)
    if (group[i]) memcpy(&value[i], group[i]->req->src[0], 4);
  for (int i = 0; i < kWaveSize; ++i) {
    if (!group[i]) continue;
    const OpRequest& r = *group[i]->req;
    int32_t out = 0;
    if (readlane) {
      const int src = int(r.arg & (kWaveSize - 1));
      if (group[src]) {
        out = value[src];
      } else {
        report(ReportKind::kReadlaneInactive, r.site, Site{nullptr, 0, 0},
               "wave %d lane %d: sage_readlane(.., %d) at %s reads a lane that is not active "
               "there; the emulator returns 0",
               group[i]->ids.wave_id, i, int(r.arg), site_text(r.site).c_str());
      }
    } else {
      const int src = int((i ^ r.arg) & (kWaveSize - 1));  // ds_bpermute uses address bits [6:2]
      out = group[src] ? value[src] : 0;
    }
    memcpy(r.dst, &out, 4);
  }
}

// Gathers the wave's operands (each lane's A, B and C registers) into the model's struct, runs
// `model` once and scatters D back to the lanes. Missing lanes contribute zeros.
template <class Operands, class DElem, class Model>
static void run_wmma(Lane* group[kWaveSize], Model model) {
  Operands in{};
  DElem d[kWaveSize][8];
  for (int i = 0; i < kWaveSize; ++i)
    if (group[i]) {
      memcpy(in.a[i], group[i]->req->src[0], sizeof(in.a[i]));
      memcpy(in.b[i], group[i]->req->src[1], sizeof(in.b[i]));
      memcpy(in.c[i], group[i]->req->src[2], sizeof(in.c[i]));
    }
  model(in, d);
  for (int i = 0; i < kWaveSize; ++i)
    if (group[i]) memcpy(group[i]->req->dst, d[i], sizeof(d[i]));
}

// WMMA needs EXEC = all ones ([RDNA4-ISA], "WMMA" section); a partial wave is reported and
// its missing lanes contribute zeros.
void Worker::exec_wmma(int wave_index, Lane* group[kWaveSize], int n, Op op) {
  Lane* any = nullptr;
  for (int i = 0; i < kWaveSize && !any; ++i) any = group[i];
  const OpRequest& r0 = *any->req;
  if (n != kWaveSize) {
    report(ReportKind::kWmmaExec, r0.site, Site{nullptr, 0, 0},
           "WMMA at %s executed by %d of 32 lanes of wave %d (WMMA requires all 32 lanes "
           "active; missing lanes read as zero here, undefined on the GPU)",
           site_text(r0.site).c_str(), n, wave_index);
  }
  if (op == Op::kWmmaIu8) {
    run_wmma<WmmaIu8Operands, int32_t>(group, [&](const WmmaIu8Operands& in, int32_t(*d)[8]) {
      wmma_iu8_model(in, r0.sign_a, r0.sign_b, r0.clamp, d);
    });
  } else if (op == Op::kWmmaF16) {
    run_wmma<WmmaF16Operands, float>(
        group, [](const WmmaF16Operands& in, float(*d)[8]) { wmma_f16_model(in, d); });
  } else {
    run_wmma<WmmaFp8Operands, float>(
        group, [](const WmmaFp8Operands& in, float(*d)[8]) { wmma_fp8_model(in, d); });
  }
}

// One lane's LDS access: bounds against the SAGE_LDS array the pointer belongs to, alignment,
// race/uninitialised checks on the shadow, then the copy. A rejected access touches nothing
// (a load returns zeros).
void Worker::exec_lds(int wave_index, Lane& l) {
  const OpRequest& r = *l.req;
  const bool store = r.op == Op::kLdsStore;
  const uintptr_t p = reinterpret_cast<uintptr_t>(r.lds), win = lds_window();
  auto reject = [&] {
    if (!store) memset(r.dst, 0, r.size);
  };
  if (p < win || p >= win + kLdsWindowBytes) {
    report(ReportKind::kLdsBadPointer, r.site, Site{nullptr, 0, 0},
           "wave %d lane %d: LDS %s at %s through a pointer that is not LDS (%p)", wave_index,
           l.ids.lane_id, store ? "store" : "load", site_text(r.site).c_str(), r.lds);
    return reject();
  }
  const int64_t base = int64_t(p - win);
  // The array containing the pointer; a one-past-the-end pointer (base == end) belongs to
  // its array only if it is not also the start of the next one.
  const LdsAlloc* a = nullptr;
  for (const LdsAlloc& c : allocs)
    if (base >= c.offset && base < int64_t(c.offset) + c.bytes) a = &c;
  if (!a)
    for (const LdsAlloc& c : allocs)
      if (base == int64_t(c.offset) + c.bytes) a = &c;
  if (!a) {
    report(ReportKind::kLdsBadPointer, r.site, Site{nullptr, 0, 0},
           "wave %d lane %d: LDS %s at %s through a pointer outside every SAGE_LDS array "
           "(LDS byte %lld)",
           wave_index, l.ids.lane_id, store ? "store" : "load", site_text(r.site).c_str(),
           (long long)base);
    return reject();
  }
  const int64_t start = base + r.arg, end = start + r.size;
  if (start < a->offset || end > int64_t(a->offset) + a->bytes) {
    report(ReportKind::kLdsOutOfBounds, r.site, Site{nullptr, 0, 0},
           "wave %d lane %d: %u-byte LDS %s at %s touches bytes [%lld, %lld) of '%s', which "
           "has %u bytes (LDS byte offset %lld)",
           wave_index, l.ids.lane_id, r.size, store ? "store" : "load", site_text(r.site).c_str(),
           (long long)(start - a->offset), (long long)(end - a->offset), a->decl->name, a->bytes,
           (long long)start);
    return reject();
  }
  if (g_check_align && (start % r.align) != 0) {
    report(ReportKind::kLdsMisaligned, r.site, Site{nullptr, 0, 0},
           "wave %d lane %d: %u-byte LDS %s at %s at byte %lld of '%s' is not %u-byte aligned",
           wave_index, l.ids.lane_id, r.size, store ? "store" : "load", site_text(r.site).c_str(),
           (long long)(start - a->offset), a->decl->name, r.align);
  }
  const uint16_t sid = site_id(r.site);
  const uint32_t bit = 1u << wave_index;
  for (int64_t b = start; b < end; ++b) {
    ShadowByte& s = shadow[size_t(b)];
    int other = -1;
    uint16_t other_site = 0;
    const char* what = nullptr;
    if (store) {
      if (s.w_epoch == epoch && s.w_wave != wave_index) {
        other = s.w_wave, other_site = s.w_site, what = "store/store";
      } else if (s.r_epoch == epoch && (s.r_mask & ~bit)) {
        other = s.r_wave != wave_index ? s.r_wave : __builtin_ctz(s.r_mask & ~bit);
        other_site = s.r_wave != wave_index ? s.r_site : 0;
        what = "load/store";
      }
      s.w_epoch = epoch;
      s.w_wave = uint16_t(wave_index);
      s.w_site = sid;
    } else {
      if (s.w_epoch < wg_epoch_base) {
        if (launch->check_uninit)
          report(ReportKind::kLdsUninitRead, r.site, Site{nullptr, 0, 0},
                 "wave %d lane %d: LDS load at %s reads byte %lld of '%s', which no lane of "
                 "this workgroup has written",
                 wave_index, l.ids.lane_id, site_text(r.site).c_str(), (long long)(b - a->offset),
                 a->decl->name);
      } else if (s.w_epoch == epoch && s.w_wave != wave_index) {
        other = s.w_wave, other_site = s.w_site, what = "store/load";
      }
      if (s.r_epoch != epoch) {
        s.r_epoch = epoch;
        s.r_mask = 0;
        s.r_wave = uint16_t(wave_index);
        s.r_site = sid;
      }
      s.r_mask |= bit;
    }
    if (what) {
      const Site& os = sites[other_site];
      report(ReportKind::kLdsRace, os, r.site,
             "%s race on LDS byte offset %lld ('%s' + %lld) between wave %d (%s) and wave %d "
             "(%s) with no barrier in between (after barrier #%u)",
             what, (long long)b, a->decl->name, (long long)(b - a->offset), other,
             other_site ? site_text(os).c_str() : "?", wave_index, site_text(r.site).c_str(),
             waves[size_t(wave_index)].barriers_passed);
      break;  // one report per access is enough
    }
  }
  if (store)
    memcpy(&lds[size_t(start)], r.src[0], r.size);
  else
    memcpy(r.dst, &lds[size_t(start)], r.size);
}

// ------------------------------------------------------------------ lane-side entry points
// The kernel API only exists inside a launch; calling it from plain host code is a bug.
static Worker* current_worker(const char* what) {
  Worker* w = t_worker;
  if (!w || !w->current) {
    fprintf(stderr, "sage_emu: %s called outside an emulated kernel (sage_launch)\n", what);
    abort();
  }
  return w;
}

void wave_sync(OpRequest& req) {
  Worker* w = current_worker("a kernel-API wave operation");
  Lane* l = w->current;
  l->req = &req;
  l->state = Lane::kParked;
  l->fiber.yield();
}

void* lds_declare(const LdsDecl* decl, Site site) {
  Worker* w = current_worker("SAGE_LDS");
  for (const LdsAlloc& a : w->allocs)
    if (a.decl == decl) return reinterpret_cast<void*>(lds_window() + a.offset);
  const uint32_t align = uint32_t(std::max<size_t>(decl->align, 16));
  const uint64_t offset = (uint64_t(w->lds_used) + align - 1) / align * align;
  if (offset + decl->bytes > kLdsBytes) {
    w->report(ReportKind::kLdsOverflow, site, Site{nullptr, 0, 0},
              "SAGE_LDS '%s' (%zu bytes, %s) exceeds the 64 KiB of LDS of a workgroup (%llu "
              "bytes already declared); workgroup aborted",
              decl->name, decl->bytes, site_text(site).c_str(), (unsigned long long)w->lds_used);
    w->aborted = true;
    Lane* l = w->current;
    l->state = Lane::kDone;
    l->fiber.yield();  // never resumed: the scheduler drops an aborted workgroup
    __builtin_trap();
  }
  w->allocs.push_back(LdsAlloc{decl, uint32_t(offset), uint32_t(decl->bytes)});
  w->lds_used = uint32_t(offset + decl->bytes);
  return reinterpret_cast<void*>(lds_window() + offset);
}

void report_global_misaligned(const void* p, int64_t off, size_t align, bool store, Site site) {
  Worker* w = t_worker;
  if (!w || !w->current) return;
  w->report(ReportKind::kGlobalMisaligned, site, Site{nullptr, 0, 0},
            "wave %d lane %d: global %s at %s of a %zu-aligned type at %p + %lld is misaligned",
            w->current->ids.wave_id, w->current->ids.lane_id, store ? "store" : "load",
            site_text(site).c_str(), align, p, (long long)off);
}

// ------------------------------------------------------------------ launch --------------
namespace {

struct KernelMeta {
  std::string name;
  int max_threads = 0;  // 0: unknown
};

// SAGE_KERNEL exports the kernel and `sage_emu_kinfo_<name>`; find both from the pointer.
KernelMeta kernel_meta(const void* kernel) {
  static std::mutex mu;
  static std::unordered_map<const void*, KernelMeta> cache;
  std::lock_guard<std::mutex> g(mu);
  auto it = cache.find(kernel);
  if (it != cache.end()) return it->second;
  KernelMeta m;
  Dl_info info{};
  if (dladdr(kernel, &info) && info.dli_sname) {
    m.name = info.dli_sname;
    const std::string sym = "sage_emu_kinfo_" + m.name;
    const KernelInfo* ki = nullptr;
    if (void* h = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD)) {
      ki = static_cast<const KernelInfo*>(dlsym(h, sym.c_str()));
      dlclose(h);
    }
    if (!ki) ki = static_cast<const KernelInfo*>(dlsym(RTLD_DEFAULT, sym.c_str()));
    if (ki) m.max_threads = ki->max_threads;
  } else {
    char buf[64];
    snprintf(buf, sizeof buf, "kernel@%p", kernel);
    m.name = buf;
  }
  cache[kernel] = m;
  return m;
}

void publish(const std::string& text, int count) {
  std::lock_guard<std::mutex> g(g_log_mu);
  g_log += text;
  g_log_count += count;
}

// A launch that could not run at all: the error goes to the caller through *summary.
int fail_launch(const std::string& kernel, const std::string& why, const char** summary) {
  static thread_local std::string buf;
  buf = "sage_emu: kernel " + kernel + " not run: " + why;
  *summary = buf.c_str();
  return 1;
}

}  // namespace

int launch(const void* kernel, sage_dim3 grid, unsigned threads, KernelEntry entry,
           const void* closure, const char** summary) {
  static thread_local std::string summary_buf;
  const KernelMeta meta = kernel_meta(kernel);
  LaunchState st;
  st.kernel_name = meta.name.c_str();
  st.threads = threads;
  st.grid = grid;
  st.entry = entry;
  st.closure = closure;
  st.check_uninit = env_flag("AITER_SAGE_EMU_CHECK_UNINIT", true);

  char bad[256] = {0};
  if (grid.x == 0 || grid.y == 0 || grid.z == 0)
    snprintf(bad, sizeof bad, "empty grid (%u,%u,%u)", grid.x, grid.y, grid.z);
  else if (threads == 0 || threads > unsigned(kMaxThreadsPerBlock))
    snprintf(bad, sizeof bad, "%u threads per workgroup (1..1024 allowed)", threads);
  else if (meta.max_threads > 0 && threads > unsigned(meta.max_threads))
    snprintf(bad, sizeof bad, "%u threads per workgroup exceed SAGE_KERNEL max_threads %d", threads,
             meta.max_threads);
  if (bad[0]) {
    summary_buf = std::string("[launch-config] kernel ") + meta.name + ": " + bad;
    publish(summary_buf + "\n", 1);
    *summary = summary_buf.c_str();
    return 1;
  }

  std::string setup_error;
  int workers = 1;
  if (lane_stack_bytes(&st.stack_bytes, &setup_error) && worker_count(&workers, &setup_error) &&
      !lds_window())
    setup_error = "cannot reserve the 128 KiB LDS address window (mmap failed)";
  if (!setup_error.empty()) return fail_launch(meta.name, setup_error, summary);

  const int64_t nwg = int64_t(grid.x) * grid.y * grid.z;
  const int nworkers = int(std::min<int64_t>(workers, nwg));
  std::atomic<int64_t> next{0};
  std::atomic<int> alloc_errno{0};
  auto work = [&] {
#if defined(__x86_64__)
    const unsigned saved_csr = _mm_getcsr();
    _mm_setcsr(0x1f80);  // the models round like IEEE RNE whatever the caller set (e.g. FTZ)
#endif
    Worker w(&st);
    Worker* const saved = t_worker;
    t_worker = &w;
    if (w.alloc_errno) alloc_errno.store(w.alloc_errno);
    // One worker without stacks fails the launch: the others stop taking workgroups.
    for (int64_t i; !w.alloc_errno && !alloc_errno.load() && (i = next.fetch_add(1)) < nwg;)
      w.run_workgroup(i);
    t_worker = saved;
#if defined(__x86_64__)
    _mm_setcsr(saved_csr);
#endif
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < nworkers; ++i) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (const int err = alloc_errno.load()) {
    return fail_launch(meta.name,
                       "cannot allocate " + std::to_string(threads) + " lane stacks of " +
                           std::to_string(st.stack_bytes / 1024) + " KiB per host thread (" +
                           strerror(err) + "); lower AITER_SAGE_EMU_STACK_KB or " +
                           "AITER_SAGE_EMU_THREADS",
                       summary);
  }

  const size_t n = st.reports.size();
  if (n == 0) return 0;
  const std::string text = st.reports.render();
  publish(text, int(n));
  if (getenv("AITER_SAGE_EMU_VERBOSE")) fprintf(stderr, "%s", text.c_str());
  summary_buf = "sage_emu: " + std::to_string(n) + " report(s) in kernel " + meta.name +
                "; first: " + st.reports.first_line() + " (all: sage_emu_reports_text())";
  *summary = summary_buf.c_str();
  return 1;
}

}  // namespace sage_emu

// ------------------------------------------------------------------ C API ---------------
extern "C" {
int sage_emu_report_count(void) {
  std::lock_guard<std::mutex> g(sage_emu::g_log_mu);
  return sage_emu::g_log_count;
}
const char* sage_emu_reports_text(void) {
  static thread_local std::string copy;
  std::lock_guard<std::mutex> g(sage_emu::g_log_mu);
  copy = sage_emu::g_log;
  return copy.c_str();
}
void sage_emu_clear_reports(void) {
  std::lock_guard<std::mutex> g(sage_emu::g_log_mu);
  sage_emu::g_log.clear();
  sage_emu::g_log_count = 0;
}
void sage_emu_set_num_threads(int n) { sage_emu::g_thread_override.store(n > 0 ? n : 0); }
}
