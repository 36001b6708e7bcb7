// Emulator probes for the checks: each kernel is run by op_tests/backends/test_emu.py, which
// expects exactly the named report (or none). All use two waves (64 threads) of one workgroup.
#include "sage/platform.h"

// Correct exchange through LDS: each thread writes its value, barrier, then reads the value
// of the thread with the same lane in the other wave. Expect no report.
SAGE_KERNEL(probe_lds_exchange, 64)(const int* in, int* out) {
  SAGE_LDS(int, buf, 64);
  const int t = sage_thread_id();
  sage_lds_store<int>(buf, 4 * t, sage_gload<int>(in, 4 * t));
  sage_barrier();
  sage_gstore<int>(out, 4 * t, sage_lds_load<int>(buf, 4 * (t ^ 32)));
}

// The same exchange with the barrier missing: an LDS race between wave 0 and wave 1.
SAGE_KERNEL(probe_lds_race, 64)(const int* in, int* out) {
  SAGE_LDS(int, buf, 64);
  const int t = sage_thread_id();
  sage_lds_store<int>(buf, 4 * t, sage_gload<int>(in, 4 * t));
  sage_gstore<int>(out, 4 * t, sage_lds_load<int>(buf, 4 * (t ^ 32)));
}

// Wave 1 returns before the barrier that wave 0 waits at.
SAGE_KERNEL(probe_barrier_exit, 64)(const int* in, int* out) {
  SAGE_LDS(int, buf, 64);
  const int t = sage_thread_id();
  if (sage_wave_id() == 1) return;
  sage_lds_store<int>(buf, 4 * t, sage_gload<int>(in, 4 * t));
  sage_barrier();
  sage_gstore<int>(out, 4 * t, sage_lds_load<int>(buf, 4 * t));
}

// The two waves wait at different barrier sites.
SAGE_KERNEL(probe_barrier_sites, 64)(const int* in, int* out) {
  const int t = sage_thread_id();
  if (sage_wave_id() == 0) {
    sage_barrier();
  } else {
    sage_barrier();
  }
  sage_gstore<int>(out, 4 * t, sage_gload<int>(in, 4 * t));
}

// Thread 63 reads one int past the end of the LDS array.
SAGE_KERNEL(probe_lds_oob, 64)(const int* in, int* out) {
  SAGE_LDS(int, buf, 64);
  const int t = sage_thread_id();
  sage_lds_store<int>(buf, 4 * t, sage_gload<int>(in, 4 * t));
  sage_barrier();
  sage_gstore<int>(out, 4 * t, sage_lds_load<int>(buf, 4 * (t + (t == 63 ? 1 : 0))));
}

// Lanes that exit early, a lane-divergent LDS store (lane 0 only) followed by a read in the
// same wave, and a uniform loop with barriers: all legal. Expect no report;
// out[t] = in[first thread of t's wave] for the lanes that stay (t % 32 < 24).
SAGE_KERNEL(probe_divergence_ok, 64)(const int* in, int* out) {
  SAGE_LDS(int, slot, 2);
  const int t = sage_thread_id(), lane = sage_lane_id(), w = sage_wave_id();
  if (lane >= 24) return;
  int acc = 0;
  for (int it = 0; it < 3; ++it) {
    if (lane == 0) sage_lds_store<int>(slot, 4 * w, sage_gload<int>(in, 4 * t) + it);
    acc = sage_lds_load<int>(slot, 4 * w) - it;
    sage_barrier();
  }
  sage_gstore<int>(out, 4 * t, acc);
}

// Reads one element past the end of `in` (global memory): only ASan sees this.
SAGE_KERNEL(probe_global_oob, 64)(const int* in, int* out, int n) {
  const int t = sage_thread_id();
  sage_gstore<int>(out, 4 * t, sage_gload<int>(in, 4 * (t == 63 ? n : t)));
}
