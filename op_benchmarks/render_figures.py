#!/usr/bin/env python3
"""Renders the README's figures (docs/images/*.png) from the measurements and the model.

One figure per backend, each a speed panel and an accuracy-versus-length panel:

  cpu     op_benchmarks/results/cpu_main_job.csv (the main job's two runs on a 2-core Zen 3,
          avx2 tier) and the cpu rows of op_benchmarks/results/accuracy_vs_seqlen.csv
  cuda    op_benchmarks/nvidia/hopper_side_by_side.csv (one Hopper GPU, named in its gpu
          column: run_h200.sh's side-by-side with SageAttention2 and cuDNN; with --sweeps N,
          the median of the sweeps)
  gfx12   a PREDICTION: the calibrated model's TFLOPS (aiter_sage/perf_model.py, what
          `python3 -m aiter_sage.isa --arch gfx1201 --model r9700 --shape B,H,S,D
          --queries-per-group 128` prints) for each S, with its held-out error as the band
          (computed here, so a recalibrated model re-renders with this one command), and the
          gfx12 arithmetic model's rows of accuracy_vs_seqlen.csv

plus accuracy_vs_seqlen.png (every row of that CSV). Needs matplotlib (rendering only; the
tests do not import this file):

    python3 op_benchmarks/render_figures.py            # all four
    python3 op_benchmarks/render_figures.py gfx12      # the prediction only (after isa.py changes)
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "op_benchmarks" / "results"
SIDE_BY_SIDE_CSV = REPO / "op_benchmarks" / "nvidia" / "hopper_side_by_side.csv"
IMAGES = REPO / "docs" / "images"
ACCURACY_CSV = RESULTS / "accuracy_vs_seqlen.csv"
CPU_CSV = RESULTS / "cpu_main_job.csv"
PREDICTION_SEQS = (1024, 2048, 4096, 8192, 16384, 32768)
# Published gfx1201 figures the prediction is set against (B1 H24 D128): torch SDPA (flash),
# aiter#4188 at S 1536-4096, and the fastest published RDNA4 attention kernel (aiter FlyDSL
# FP8, kernel only, 115.7 TFLOPS).
GFX1201_SDPA_TFLOPS = (46, 51)
GFX1201_BEST_PUBLISHED_TFLOPS = 115.7
ROOF_8BIT_TOPS = 383
# One kernel per line of the prediction plot: label, kernel name.
PREDICTED_KERNELS = (
    ("D 128, FP8 P·V", "sage_attention_fwd_kernel"),
    ("D 64, FP8 P·V", "sage_attention_fwd_kernel_d64"),
    ("D 128, FP16 P·V", "sage_attention_fwd_kernel_pv16"),
)
QUERIES_PER_GROUP = 128  # csrc/gfx12/attention.hip AttnTraits::kQueriesPerGroup


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _accuracy_panel(ax, impl: str, title: str) -> None:
    """rel L2 against key length for one implementation of accuracy_vs_seqlen.csv."""
    series: dict = {}
    for r in _rows(ACCURACY_CSV):
        if r["impl"] == impl:
            key = (r["inputs"], r["pv_dtype"], int(r["smooth_k"]))
            series.setdefault(key, []).append((int(r["seq_len"]), float(r["rel_l2"])))
    for (inputs, mode, smooth), pts in sorted(series.items()):
        pts.sort()
        label = f"{inputs}, {mode} P·V{', smooth_k' if smooth else ''}"
        style = "-" if inputs == "randn" else "--"
        ax.plot(*zip(*pts), style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("key length S (256 query rows, D 128)")
    ax.set_ylabel("relative L2 vs FP32 attention")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _save(fig, name: str) -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    path = IMAGES / name
    fig.savefig(path, dpi=100)
    print(f"wrote {path.relative_to(REPO)}")


def render_cpu(plt) -> None:
    rows = _rows(CPU_CSV)
    fig, (speed, acc) = plt.subplots(1, 2, figsize=(11, 4))
    seqs = sorted({int(r["S"]) for r in rows})
    providers = ("sage", "sage_core")  # sage: prepare + attention; sage_core: attention alone
    width = 0.8 / len(providers)
    for i, prov in enumerate(providers):
        mine = [r for _, r in sorted((int(r["S"]), r) for r in rows if r["provider"] == prov)]
        xs = [j + (i - 0.5) * width for j in range(len(seqs))]
        lo = [float(r["speedup_lo"]) for r in mine]
        hi = [float(r["speedup_hi"]) for r in mine]
        speed.bar(xs, hi, width, color=f"C{i}", alpha=0.35)
        speed.bar(xs, lo, width, color=f"C{i}", label=f"{prov} (pale: range of 2 runs)")
    speed.axhline(1.0, color="black", ls="--", label="torch SDPA, BF16 (same run)")
    speed.set_xticks(range(len(seqs)), [f"S {s}" for s in seqs])
    speed.set_ylim(0, 1.5)
    speed.set_ylabel("speed-up over torch SDPA (higher is better)")
    speed.set_title("cpu backend, avx2 tier: 2-core Zen 3, B1 H8 D128")
    speed.legend(fontsize=7, loc="lower right")
    speed.grid(True, axis="y", alpha=0.3)
    _accuracy_panel(acc, "cpu", "cpu backend: accuracy vs key length")
    _save(fig, "cpu.png")


def render_cuda(plt) -> None:
    """The side-by-side run (op_benchmarks/nvidia/side_by_side.py): TFLOPS per shape of our
    full call and kernel, SageAttention2 (the faster of its smooth_k settings) and cuDNN, and
    rel L2 of ours and SageAttention2's (randn, then the DiT-like rows with smooth_k)."""
    sys.path.insert(0, str(REPO / "op_benchmarks" / "nvidia"))
    from side_by_side import merge_sweeps, read_rows

    rows = read_rows(SIDE_BY_SIDE_CSV)
    gpus = {r.get("gpu") for r in rows}
    if len(gpus) != 1 or None in gpus:
        raise SystemExit(f"{SIDE_BY_SIDE_CSV}: expected one run on one card, gpu column {gpus}")
    (gpu,) = gpus
    sweeps = len({r.get("sweep") for r in rows if r.get("sweep")}) or 1
    # side_by_side.py --sweeps N writes N rows per shape and provider: the figure shows their
    # median, as the README's table does.
    by = {}
    for r in merge_sweeps(rows):
        by.setdefault(r["shape"], {})[r["provider"]] = r
    speed_shapes = [sh for sh, prov in by.items() if "sdpa_cudnn" in prov]
    fig, (speed, acc) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})

    def sage2_best(prov):
        return max((prov[n] for n in ("sage2", "sage2_nosmooth") if n in prov),
                   key=lambda r: r["tflops"], default=None)  # fmt: skip

    series = (
        ("sage (with prepare)", lambda p: p.get("sage")),
        ("sage_core", lambda p: p.get("sage_core")),
        ("SageAttention2 sm90 (faster setting)", sage2_best),
        ("cuDNN BF16", lambda p: p.get("sdpa_cudnn")),
    )
    width = 0.2
    for i, (label, pick) in enumerate(series):
        xs = [j + (i - 1.5) * width for j in range(len(speed_shapes))]
        ys = [pick(by[sh])["tflops"] if pick(by[sh]) else 0.0 for sh in speed_shapes]
        speed.bar(xs, ys, width, label=label, color=f"C{i}")
    speed.set_xticks(range(len(speed_shapes)), [sh.replace(": ", "\n") for sh in speed_shapes],
                     fontsize=6, rotation=30, ha="right")  # fmt: skip
    speed.set_ylabel("TFLOPS (higher is better)")
    median = f", median of {sweeps} sweeps" if sweeps > 1 else ""
    speed.set_title(f"cuda backend on one {gpu}, side by side in one run{median}", fontsize=10)
    speed.grid(True, axis="y", alpha=0.3)
    speed.set_ylim(0, 1050)
    speed.legend(fontsize=7, loc="upper left", ncol=4)
    acc_shapes = list(by)
    for i, (label, pick) in enumerate(
        (("sage", lambda p: p.get("sage")), ("SageAttention2", sage2_best))
    ):
        xs = [j + (i - 0.5) * 0.35 for j in range(len(acc_shapes))]
        ys = [pick(by[sh])["rel_l2"] if pick(by[sh]) else 0.0 for sh in acc_shapes]
        acc.bar(xs, ys, 0.35, label=label, color=f"C{i * 2}")
    acc.set_xticks(range(len(acc_shapes)), [sh.replace(": ", "\n") for sh in acc_shapes],
                   fontsize=6, rotation=30, ha="right")  # fmt: skip
    acc.set_ylabel("relative L2 vs FP32 attention")
    acc.set_title("accuracy on the same inputs (DiT-like: smooth_k on both)", fontsize=10)
    acc.grid(True, axis="y", alpha=0.3)
    acc.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, "cuda_hopper.png")


def predicted_tflops(seqs=PREDICTION_SEQS) -> dict:
    """{(kernel, S): (TFLOPS, band)} of the calibrated model on the R9700, for the kernels
    clang-19 builds from csrc/gfx12/attention.hip (the JIT's code without ROCm)."""
    import tempfile

    sys.path.insert(0, str(REPO))
    from aiter_sage import isa, perf_model

    with tempfile.TemporaryDirectory() as tmp:
        src = REPO / "csrc" / "gfx12" / "attention.hip"
        co = isa.compile_source(src, "gfx1201", Path(tmp))
        kernels = {k.name: k for k in isa.analyze_code_object(co, "gfx1201")}
    found = {}
    for _label, name in PREDICTED_KERNELS:
        d = 64 if "_d64" in name else 128
        for s in seqs:
            shape = perf_model.Shape(1, 24, s, d, False)
            pr = perf_model.predict(
                perf_model.Kernel.from_report(kernels[name]),
                perf_model.R9700,
                shape,
                QUERIES_PER_GROUP,
            )
            found[(name, s)] = (pr.tflops, pr.band)
    return found


def render_gfx12(plt) -> None:
    pred = predicted_tflops()
    fig, (speed, acc) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (label, kernel) in enumerate(PREDICTED_KERNELS):
        mid = [pred[(kernel, s)][0] for s in PREDICTION_SEQS]
        lo = [t * (1 - pred[(kernel, s)][1]) for s, t in zip(PREDICTION_SEQS, mid)]
        hi = [t * (1 + pred[(kernel, s)][1]) for s, t in zip(PREDICTION_SEQS, mid)]
        speed.fill_between(PREDICTION_SEQS, lo, hi, color=f"C{i}", alpha=0.25)
        speed.plot(
            PREDICTION_SEQS, mid, "-o", color=f"C{i}", label=f"{label} (band: held-out error)"
        )
    speed.axhspan(
        *GFX1201_SDPA_TFLOPS,
        color="grey",
        alpha=0.5,
        label="torch SDPA on gfx1201, measured (aiter#4188)",
    )
    speed.axhline(
        GFX1201_BEST_PUBLISHED_TFLOPS, color="black", ls=":", label="fastest published RDNA4 kernel"
    )
    speed.axhline(
        ROOF_8BIT_TOPS, color="red", ls="--", label=f"8-bit WMMA roof, {ROOF_8BIT_TOPS} TOPS"
    )
    speed.set_xscale("log", base=2)
    speed.set_ylim(0, ROOF_8BIT_TOPS * 1.08)
    speed.set_xlabel("S (B1 H24, non-causal)")
    speed.set_ylabel("predicted TFLOPS")
    speed.set_title(
        "PREDICTION, not a measurement: gfx12 kernels on an R9700\n"
        "(calibrated model, `python3 -m aiter_sage.isa --shape ...`)",
        color="darkred",
    )
    speed.grid(True, which="both", alpha=0.3)
    speed.legend(fontsize=7, loc="lower right")
    _accuracy_panel(acc, "model", "gfx12 kernels' arithmetic (ref model): accuracy vs length")
    _save(fig, "gfx12_prediction.png")


def render_accuracy(plt) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    _accuracy_panel(axes[0], "cpu", "cpu backend")
    _accuracy_panel(axes[1], "model", "gfx12 / GPU arithmetic (e4m3 or FP16 P)")
    _save(fig, "accuracy_vs_seqlen.png")


FIGURES = {
    "cpu": render_cpu,
    "cuda": render_cuda,
    "gfx12": render_gfx12,
    "accuracy": render_accuracy,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("figures", nargs="*", help=f"some of: {', '.join(FIGURES)} (default: all)")
    args = ap.parse_args(argv)
    unknown = set(args.figures) - set(FIGURES)
    if unknown:
        ap.error(f"unknown figures {sorted(unknown)}; choose from {list(FIGURES)}")
    plt = _pyplot()
    for name in args.figures or FIGURES:
        FIGURES[name](plt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
