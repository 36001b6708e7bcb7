"""Micro-benchmark of the gfx12 emulator on an attention-shaped probe (S = 512, H = 2).

    python op_tests/emu_probes/bench_emu.py [--threads N]
"""
import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("aiter_sage_emu_bench", ROOT / "aiter_sage" / "emu.py")
emu = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = emu
spec.loader.exec_module(emu)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ns = ap.parse_args()
    S, H, D = ns.seq, 2, 128
    rng = np.random.default_rng(0)
    q8 = rng.integers(-127, 128, (H, 512, D), dtype=np.int8)
    k8 = rng.integers(-127, 128, (H, S, D), dtype=np.int8)
    v8 = rng.integers(0, 0x7E, (H, D, S), dtype=np.uint8)
    out = np.zeros((H, 512, D), np.float32)
    mod = emu.load_module(Path(__file__).with_name("bench_probe.hip"))
    t0 = time.perf_counter()
    res = mod.run("bench_attention_like", (512 // 64, H, 1), 128, [q8, k8, v8, out, S],
                  threads=ns.threads)
    dt = time.perf_counter() - t0
    waves = (512 // 16) * H
    tiles = S // 64
    print(f"rc={res.rc} reports={len(res.reports)} time={dt:.3f}s threads={ns.threads} "
          f"({waves * tiles * 64} WMMAs, {waves * tiles * 32 * 165 / 1e6:.1f} M lane-ops approx)")
    for r in res.reports[:5]:
        print(r)
    return 0 if res.ok and np.isfinite(out).all() else 1


if __name__ == "__main__":
    sys.exit(main())
