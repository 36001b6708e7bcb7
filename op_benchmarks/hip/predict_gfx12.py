"""PREDICTED TFLOPS of our gfx12 kernels (calibrated model, aiter_sage/perf_model.py).

    python3 op_benchmarks/hip/predict_gfx12.py [--toolchain rocm72|clang19] [--source F.hip]

Compiles csrc/gfx12/attention.hip (or --source) for gfx1201 with clang-19, lowered by ROCm
7.2's backend (the calibration's toolchain) or clang-19's own, and prints one markdown table
per GPU: every attention variant at B1 H24 S 4k/16k/32k, Flux 1024^2 (S 4608 H 24) and Wan-14B
480p (S 32760 H 40), D = its head dim, the prepare kernels as memory-bound floors at the
vendor DRAM rate, and the full call (prepare + the D128 FP8 attention). Band: the
calibration's median held-out error. A prediction, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from aiter_sage import isa, perf_model  # noqa: E402

SHAPES = (
    ("B1 H24 S4096", 1, 24, 4096),
    ("B1 H24 S16384", 1, 24, 16384),
    ("B1 H24 S32768", 1, 24, 32768),
    ("Flux S4608 H24", 1, 24, 4608),
    ("Wan S32760 H40", 1, 40, 32760),
)
QUERIES_PER_GROUP = 128  # csrc/gfx12/attention.hip AttnTraits::kQueriesPerGroup
MAIN = "sage_attention_fwd_kernel"


def head_dim(name: str) -> int:
    return 64 if "_d64" in name else 128


def prepare_bytes(b: int, h: int, s: int, d: int) -> float:
    """Bytes the prepare kernels move: Q, K, V read as BF16 (V twice: its scale pass and its
    quantization), Q/K int8 and V fp8 written; the scales are negligible."""
    n = b * h * s * d
    return n * 2 * 4 + n * 3


def kernels(source: Path, toolchain: str) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        co = isa.compile_source(source, "gfx1201", Path(tmp), rocm_codegen=toolchain == "rocm72")
        return [k for k in isa.analyze_code_object(co, "gfx1201") if k.loop and k.loop.wmma]


def predict(k, gpu, b, h, s, rescale="always") -> perf_model.Prediction:
    """The rescale branch charged every tile unless `rescale` says otherwise."""
    shape = perf_model.Shape(b, h, s, head_dim(k.name), "causal" in k.name)
    return perf_model.predict(
        perf_model.Kernel.from_report(k), gpu, shape, QUERIES_PER_GROUP, rescale=rescale
    )


def table(ks, gpu) -> str:
    head = "| kernel (VGPRs, waves) | " + " | ".join(s[0] for s in SHAPES) + " | bound |"
    lines = [head, "|---" * (len(SHAPES) + 2) + "|"]
    for k in ks:
        preds = [predict(k, gpu, b, h, s) for _, b, h, s in SHAPES]
        cells = " | ".join(f"{p.tflops:.0f}" for p in preds)
        lines.append(f"| {k.name} ({k.vgprs}, {k.waves_per_simd}) | {cells} | {preds[1].bound} |")
    main = next(k for k in ks if k.name == MAIN)
    iid = [predict(main, gpu, b, h, s, rescale="iid").tflops for _, b, h, s in SHAPES]
    cells = " | ".join(f"{t:.0f}" for t in iid)
    lines.append(f"| {MAIN}, rescale as for random scores (iid) | {cells} | SIMD issue |")
    prep, full = [], []
    for _, b, h, s in SHAPES:
        t_prep = perf_model.memory_bound_seconds(prepare_bytes(b, h, s, 128), gpu)
        t_attn = predict(main, gpu, b, h, s).seconds
        prep.append(f"{t_prep * 1e3:.2f} ms")
        full.append(f"{4.0 * b * h * s * s * 128 / (t_prep + t_attn) / 1e12:.0f}")
    lines.append(f"| prepare (DRAM floor, D128) | {' | '.join(prep)} | DRAM |")
    lines.append(f"| full call (prepare + {MAIN}) | {' | '.join(full)} | |")
    return "\n".join(lines)


def sensitivity(ks, gpu=perf_model.R9700, b=1, h=24, s=16384) -> str:
    """The D128 FP8 prediction with each fitted cost halved / raised by half, and with the
    fixed issue costs moved to the ends of what the measurements allow."""
    main = perf_model.Kernel.from_report(next(k for k in ks if k.name == MAIN))
    shape = perf_model.Shape(b, h, s, 128)

    def tflops(cal=perf_model.CALIBRATED):
        return perf_model.predict(main, gpu, shape, QUERIES_PER_GROUP, cal).tflops

    base = tflops()
    lines = [f"| change | TFLOPS | vs {base:.0f} |", "|---|---:|---:|"]
    for field in dataclasses.fields(perf_model.Calibration):
        for factor in (0.5, 1.5):
            value = getattr(perf_model.CALIBRATED, field.name) * factor
            t = tflops(dataclasses.replace(perf_model.CALIBRATED, **{field.name: value}))
            lines.append(f"| {field.name} x{factor} | {t:.0f} | {100 * (t / base - 1):+.0f} % |")
    fixed = (
        ("TRANS_CLOCKS", 1.0, "exp fully hidden beside WMMA"),
        ("TRANS_CLOCKS", 4.0, "exp at the quarter rate, not hidden"),
        ("WMMA8_CLOCKS", 10, "8-bit WMMA 20 % below the vendor rate"),
    )
    for name, value, why in fixed:
        saved = getattr(perf_model, name)
        setattr(perf_model, name, value)
        try:
            t = tflops()
        finally:
            setattr(perf_model, name, saved)
        lines.append(f"| {name} = {value} ({why}) | {t:.0f} | {100 * (t / base - 1):+.0f} % |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toolchain", default="rocm72", choices=("rocm72", "clang19"))
    ap.add_argument("--source", type=Path, default=ROOT / "csrc" / "gfx12" / "attention.hip")
    ap.add_argument(
        "--sensitivity", action="store_true", help="the D128 FP8 prediction's sensitivity"
    )
    args = ap.parse_args(argv)
    ks = kernels(args.source, args.toolchain)
    if args.sensitivity:
        print(sensitivity(ks))
        return 0
    band = perf_model.HELD_OUT_ERROR
    for gpu in (perf_model.R9700, perf_model.RX9070XT):
        print(
            f"\nPREDICTED TFLOPS, {gpu.name}, {args.toolchain} code, band +-{100 * band:.0f} % "
            f"(4 B H S^2 D / t; causal: half the FLOPs)\n"
        )
        print(table(ks, gpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
