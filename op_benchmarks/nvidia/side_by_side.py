#!/usr/bin/env python3
"""Our cuda kernels beside SageAttention2's Hopper kernel and cuDNN, in one process, one timing
method (bench_gfx1201_sage_attention.py's), at the shapes the README's NVIDIA table quotes.

    python3 op_benchmarks/nvidia/side_by_side.py [-o rows.csv] [--quick] [--sweeps N]
        [--shapes D64 Wan ...]

Speed rows: randn inputs, providers sage (prepare + attention), sage_core (attention alone),
sage2 / sage2_nosmooth (SageAttention2 with its smooth_k on / off, quantization included),
fa3_fp8 (FlashAttention-3's FP8 kernel alone, when built: run_h200.sh's FA3_PKG) and
sdpa_cudnn, every output scored against the FP32 reference. Accuracy rows (--dit): DiT-like
inputs with smooth_k on both sides, ours also with q_scale_rows=16 (SageAttention2's 16-row Q
blocks). Prints one markdown table per kind; the last column of the
speed table is our full call's speedup over the faster SageAttention2 setting. Without the
sageattention package the sage2 columns stay empty (the bench says why).

--sweeps N runs the speed rows N times over (every shape, then again): a ratio within the rounds'
spread of 1.0 in one sweep may fall either side of it in the next, and a claim of "at least
level" has to hold across them. The table then shows each provider's median TFLOPS and the
speedup's median with its lowest and highest sweep; the CSV keeps every sweep's rows.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_gfx1201_sage_attention as bench  # noqa: E402

# (label, B, H, S, D, causal)
SHAPES = (
    ("B1 H24 S4096 D128", 1, 24, 4096, 128, False),
    ("B1 H24 S16384 D128", 1, 24, 16384, 128, False),
    ("B1 H24 S32768 D128", 1, 24, 32768, 128, False),
    ("B1 H24 S16384 D64", 1, 24, 16384, 64, False),
    ("B1 H24 S16384 D128 causal", 1, 24, 16384, 128, True),
    ("Flux 1024²: B1 H24 S4608", 1, 24, 4608, 128, False),
    ("Wan-14B 480p: B1 H40 S32760", 1, 40, 32760, 128, False),
    ("B4 H24 S4096", 4, 24, 4096, 128, False),
)
DIT_SHAPES = (
    ("DiT-like B1 H24 S4096 D128", 1, 24, 4096, 128, False),
    ("DiT-like B1 H24 S16384 D128", 1, 24, 16384, 128, False),
)
# The same DiT rows with our q_scale_rows=16 (SageAttention2 is measured once, above).
DIT_Q16_SHAPES = tuple((f"{label}, q_scale_rows 16", *rest) for label, *rest in DIT_SHAPES)
SPEED_PROVIDERS = ["sage", "sage_core", "sage2", "sage2_nosmooth", "fa3_fp8", "sdpa_cudnn"]
DIT_PROVIDERS = ["sage", "sage2"]
DIT_Q16_PROVIDERS = ["sage"]


def rows_for(shapes, providers, dit, rounds, q_scale_rows=32, timing=()):
    import torch

    gpu = torch.cuda.get_device_name()  # the CSV names its card (render_figures' title)
    out = []
    for label, b, h, s, d, causal in shapes:
        args = parse_bench(b, h, s, d, causal, providers, dit, rounds, q_scale_rows, timing)
        for r in bench.run(args):
            out.append({"shape": label, "gpu": gpu, **r})
            print(
                f"# {label}: {r['provider']} {r['tflops']:.0f} TFLOPS, rel L2 {r['rel_l2']:.4f}",
                flush=True,
            )
    return out


def parse_bench(b, h, s, d, causal, providers, dit, rounds, q_scale_rows=32, timing=()):
    """The bench's arguments for one shape; `timing`: more of its timing options, as argv."""
    argv = ["--backend", "cuda", "-b", str(b), "-n", str(h), "-s", str(s), "--head_dim", str(d)]
    argv += ["--providers", *providers, "--compare_to_ref", "--rounds", str(rounds)]
    argv += ["--causal"] * causal + ["--dit", "--smooth_k"] * dit
    argv += ["--q_scale_rows", str(q_scale_rows), *timing]
    return bench.parse_args(argv)


MEDIAN_FIELDS = ("tflops", "rel_l2")  # merge_sweeps' medians, beside speedup_vs_sage2


def write_rows(path, rows):
    """The CSV of a run: every sweep's rows, the union of their columns (a column a row lacks,
    such as speedup_vs_sage2 of a provider that is not our full call, an empty cell)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(c for r in rows for c in r)))
        w.writeheader()
        w.writerows(rows)


def read_rows(path):
    """write_rows' CSV as merge_sweeps takes it: the fields it takes medians of as numbers,
    their empty cells dropped (the other columns stay text)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for key in (*MEDIAN_FIELDS, "speedup_vs_sage2"):
            if r.get(key):
                r[key] = float(r[key])
            else:
                r.pop(key, None)
    return rows


def merge_sweeps(rows):
    """One row per (shape, provider) from the rows of several sweeps: TFLOPS and rel L2 their
    median, `speedups_vs_sage2` the full call's speedup of each sweep (speedup_vs_sage2 their
    median). Rows of one sweep come back as they are, but for that list."""
    groups = {}
    for r in rows:
        groups.setdefault((r["shape"], r["provider"]), []).append(r)
    out = []
    for rs in groups.values():
        m = dict(rs[0])
        for key in MEDIAN_FIELDS:
            if all(key in r for r in rs):
                m[key] = statistics.median(r[key] for r in rs)
        speedups = [r["speedup_vs_sage2"] for r in rs if "speedup_vs_sage2" in r]
        if speedups:
            m["speedups_vs_sage2"] = speedups
            m["speedup_vs_sage2"] = statistics.median(speedups)
        out.append(m)
    return out


def speedup_cell(row):
    """'1.01×', or over several sweeps '1.01× (0.99–1.03)': median (lowest–highest)."""
    if "speedup_vs_sage2" not in row:
        return "–"
    cell = f"{row['speedup_vs_sage2']:.2f}×"
    sweeps = row.get("speedups_vs_sage2", [])
    if len(sweeps) > 1:
        cell += f" ({min(sweeps):.2f}–{max(sweeps):.2f})"
    return cell


def table(rows, providers, value, extra=()):
    by = {}
    for r in rows:
        by.setdefault(r["shape"], {})[r["provider"]] = r
    head = ["shape", *providers, *(name for name, _ in extra)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape, prov in by.items():
        cells = [shape]
        for p in providers:
            cells.append(value(prov[p]) if p in prov else "–")
        cells += [fn(prov) for _, fn in extra]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("-o", "--output", help="write every row as CSV")
    ap.add_argument("--quick", action="store_true", help="S 16384 and 32768 only, 3 rounds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fixed_order", action="store_true", help="the bench's --fixed_order")
    ap.add_argument("--lead_in", type=int, help="the bench's --lead_in")
    ap.add_argument("--window_ms", type=float, help="the bench's --window_ms")
    ap.add_argument("--sweeps", type=int, default=1, help="the speed rows this many times over")
    ap.add_argument(
        "--shapes", nargs="+", metavar="TEXT", help="only the shapes whose label holds one of these"
    )
    a = ap.parse_args(argv)
    if a.sweeps < 1:
        ap.error("--sweeps must be at least 1")
    timing = ["--fixed_order"] * a.fixed_order
    timing += [] if a.lead_in is None else ["--lead_in", str(a.lead_in)]
    timing += [] if a.window_ms is None else ["--window_ms", str(a.window_ms)]
    shapes = (
        [sh for sh in SHAPES if sh[3] in (16384, 32768) and sh[1:3] == (1, 24)]
        if a.quick
        else SHAPES
    )

    def picked(shape_list):
        return [sh for sh in shape_list if not a.shapes or any(t in sh[0] for t in a.shapes)]

    shapes = picked(shapes)
    dit_shapes = [] if a.quick else picked(DIT_SHAPES)
    if a.shapes and not shapes and not dit_shapes:
        ap.error(f"--shapes {' '.join(a.shapes)} matches no shape label")
    rounds = 3 if a.quick else a.rounds
    speed = []
    for sweep in range(a.sweeps):
        for r in rows_for(shapes, SPEED_PROVIDERS, False, rounds, timing=timing):
            speed.append({**r, "sweep": sweep})
    dit = rows_for(dit_shapes, DIT_PROVIDERS, True, rounds, timing=timing)
    if not a.quick:
        dit += rows_for(picked(DIT_Q16_SHAPES), DIT_Q16_PROVIDERS, True, rounds, 16, timing)

    def vs_sage2(prov):
        return speedup_cell(prov.get("sage", {}))

    def l2(name):
        return lambda prov: f"{prov[name]['rel_l2']:.4f}" if name in prov else "–"

    sweeps = f", the median of {a.sweeps} sweeps (lowest–highest)" if a.sweeps > 1 else ""
    print(
        f"\nTFLOPS (our full call's speedup over the faster SageAttention2 setting{sweeps}; "
        "rel L2):"
    )
    print(
        table(
            merge_sweeps(speed),
            SPEED_PROVIDERS,
            lambda r: f"{r['tflops']:.0f}",
            (("sage / SA2", vs_sage2), ("rel L2 sage", l2("sage")), ("rel L2 SA2", l2("sage2"))),
        )
    )
    if dit:
        print(
            "\nDiT-like inputs, smooth_k on both sides (ours also at q_scale_rows 16): rel L2 "
            "(TFLOPS in brackets):"
        )
        print(table(dit, DIT_PROVIDERS, lambda r: f"{r['rel_l2']:.4f} ({r['tflops']:.0f})"))
    if a.output:
        write_rows(a.output, speed + dit)
    ours = [r for r in speed + dit if r["provider"] in ("sage", "sage_core")]
    return 0 if all(r.get("in_band", True) for r in ours) else 1


if __name__ == "__main__":
    sys.exit(main())
