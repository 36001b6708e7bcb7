#!/usr/bin/env python3
"""Where the time of one call goes, on a Hopper GPU: ours (prepare + attention) and, when the
real sageattention package is importable, SageAttention2's sm90 call, on the same randn inputs.

    python3 op_benchmarks/nvidia/profile_h200.py --trace        # torch profiler: every kernel
    ncu --clock-control none -k regex:'attention_kernel|qk_int8_sv_f8_attn' -c 2 \\
        python3 op_benchmarks/nvidia/profile_h200.py              # Nsight Compute: a few calls

--trace prints the kernels of a few back-to-back calls with their device times (the in-place
cost of prepare is the sum of its kernels there).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2]), str(HERE.parents[1])]

import bench_gfx1201_sage_attention as bench  # noqa: E402, I001

import aiter_sage  # noqa: E402


def calls(s, heads, d, smooth_k=False, dit=False, providers=("sage", "sage_core", "sage2")):
    q, k, v = bench.make_inputs(1, heads, s, "cuda", d=d, dit=dit)
    scale = d**-0.5
    out = bench.provider_calls(q, k, v, scale, "cuda", False, smooth_k=smooth_k)
    return {n: out[n] for n in providers if n in out}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("-s", "--seq", type=int, default=16384)
    ap.add_argument("-n", "--heads", type=int, default=24)
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=2, help="calls per provider")
    ap.add_argument("--trace", action="store_true", help="torch profiler table of the kernels")
    ap.add_argument("--smooth_k", action="store_true", help="our calls quantize K minus its mean")
    ap.add_argument("--dit", action="store_true", help="DiT-like inputs (the bench's --dit)")
    ap.add_argument(
        "--providers", nargs="+", choices=bench.PROVIDERS, default=["sage", "sage_core", "sage2"]
    )
    a = ap.parse_args(argv)
    fns = calls(a.seq, a.heads, a.head_dim, a.smooth_k, a.dit, a.providers)
    for name in a.providers:
        if name not in fns:  # sage2 without the sageattention package; *_kept without a mask
            print(f"# {name}: not available here, not profiled")
    for fn in fns.values():  # warm-up: builds, autotuning, allocator
        fn()
    torch.cuda.synchronize()
    if not a.trace:
        for fn in fns.values():
            for _ in range(a.calls):
                fn()
        torch.cuda.synchronize()
        return 0
    from torch.profiler import ProfilerActivity, profile

    for name, fn in fns.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.calls):
                fn()
            torch.cuda.synchronize()
        kernels_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / a.calls
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(bench.QUEUE_AHEAD_CYCLES)
        start.record()
        for _ in range(a.calls):
            fn()
        end.record()
        end.synchronize()
        wall = start.elapsed_time(end) / a.calls
        print(f"\n## {name}: {a.calls} calls, B1 H{a.heads} S{a.seq} D{a.head_dim}")
        print(f"# per call: {wall:.3f} ms between events, {kernels_ms:.3f} ms of kernels")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    print(f"# backends present: {aiter_sage.available_backends()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
