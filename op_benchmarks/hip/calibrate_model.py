"""Calibrate aiter_sage.perf_model on measured RDNA4 attention kernels (held-out protocol).

    python3 op_benchmarks/hip/calibrate_model.py                # fit, held-out errors, table
    python3 op_benchmarks/hip/calibrate_model.py --extract DIR  # refresh the ISA statistics

The measured points are carlushuang/gcnasm's opus_attn_gfx1201 v0-v11 (RX 9070 XT, bf16,
D = 128, TFLOPS = 4 B H N^2 D / t) at three shapes, kept with their source in
op_tests/data/opus_attn_gfx1201.json beside each kernel's ISA statistics (the main loop's
instruction mix, VGPRs, occupancy, workgroup size): no code of theirs is kept here.

--extract DIR takes a checkout of that folder (e.g. `git show COMMIT:opus_attn_gfx1201/...`
into DIR), compiles each version's kernel with clang-19 for gfx1201 (aiter_sage.isa's
--source compile: device only, Debian's HIP headers with isa.OCKL_PRELUDE), lowers clang-19's
bitcode with ROCm 7.2's AMDGPU backend too (aiter_sage.rocm_llvm: the measured binaries came
from ROCm's compiler), and rewrites the statistics in the data file.

Protocol: fit the five costs on TRAIN versions, report the error on the held-out ones, then fit
on all versions (the constants aiter_sage.perf_model.CALIBRATED) and print every point.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from aiter_sage import isa, perf_model  # noqa: E402

DATA = ROOT / "op_tests" / "data" / "opus_attn_gfx1201.json"
# Held out: the two documented regressions (v2 spills, v4's register double buffer) and two
# variants of trained kernels (v7 batched V loads, v10 = v9 with 32-key tiles).
HELD_OUT = (2, 4, 7, 10)
TOOLCHAIN = "rocm72"  # whose ISA statistics calibrate (the measured binaries: ROCm's hipcc)


def load(path: Path = DATA) -> dict:
    return json.loads(path.read_text())


def points(data: dict, versions=None, toolchain: str = TOOLCHAIN) -> list:
    """perf_model.Point per (version, shape) of the measured table."""
    out = []
    for v, entry in sorted(data["kernels"].items(), key=lambda kv: int(kv[0])):
        if versions is not None and int(v) not in versions:
            continue
        stats = entry["isa"][toolchain]
        kernel = perf_model.Kernel(
            f"v{v}", stats["vgprs"], stats["waves_per_simd"], stats["threads"], stats["loop"]
        )
        for shape, tflops in zip(data["shapes"], entry["measured_tflops"]):
            b, h, n = shape
            out.append(
                perf_model.Point(
                    kernel,
                    perf_model.Shape(b, h, n, data["head_dim"]),
                    entry["queries_per_group"],
                    tflops,
                    f"v{v} B{b} H{h} N{n}",
                )
            )
    return out


def errors(cal, pts) -> list:
    """[(point, predicted, relative error)]."""
    rows = []
    for p in pts:
        pred = perf_model.predict(
            p.kernel, perf_model.RX9070XT, p.shape, p.queries_per_group, cal
        ).tflops
        rows.append((p, pred, (pred - p.measured_tflops) / p.measured_tflops))
    return rows


@dataclasses.dataclass
class Protocol:
    held_out_cal: perf_model.Calibration
    held_out_rows: list
    final_cal: perf_model.Calibration
    final_rows: list

    @property
    def held_out_median(self) -> float:
        return statistics.median(abs(e) for _, _, e in self.held_out_rows)

    @property
    def held_out_spearman(self) -> float:
        return perf_model.spearman(
            [pred for _, pred, _ in self.held_out_rows],
            [p.measured_tflops for p, _, _ in self.held_out_rows],
        )

    @property
    def final_median(self) -> float:
        return statistics.median(abs(e) for _, _, e in self.final_rows)


def run_protocol(data: dict, toolchain: str = TOOLCHAIN, held_out=HELD_OUT) -> Protocol:
    train = [int(v) for v in data["kernels"] if int(v) not in held_out]
    cal = perf_model.fit(points(data, train, toolchain))
    held = errors(cal, points(data, held_out, toolchain))
    final = perf_model.fit(points(data, None, toolchain))
    return Protocol(cal, held, final, errors(final, points(data, None, toolchain)))


def leave_one_out(data: dict, toolchain: str = TOOLCHAIN) -> list:
    """[(point, predicted, error)] of every version predicted by a fit on the other eleven."""
    versions = sorted(int(v) for v in data["kernels"])
    rows = []
    for v in versions:
        cal = perf_model.fit(points(data, [u for u in versions if u != v], toolchain))
        rows += errors(cal, points(data, [v], toolchain))
    return rows


def table(rows, held_out=()) -> str:
    lines = [
        "| version | shape | predicted TFLOPS | measured TFLOPS | error |",
        "|---|---|---:|---:|---:|",
    ]
    for p, pred, err in rows:
        v, shape = p.label.split(" ", 1)
        mark = " (held out)" if int(v[1:]) in held_out else ""
        lines.append(
            f"| {v}{mark} | {shape} | {pred:.1f} | {p.measured_tflops:.1f} | {100 * err:+.0f} % |"
        )
    return "\n".join(lines)


def _fmt(cal) -> str:
    return ", ".join(f"{f.name}={getattr(cal, f.name):.1f}" for f in dataclasses.fields(cal))


# --- --extract: ISA statistics of each version from a fetched checkout ------------------------
def kernel_stats(co: Path) -> dict:
    reports = [k for k in isa.analyze_code_object(co, "gfx1201") if k.loop and k.loop.wmma]
    (k,) = reports  # v9's V transpose kernel has no WMMA loop
    return {
        "kernel": k.name,
        "vgprs": k.vgprs,
        "scratch_bytes": k.scratch_bytes,
        "vgpr_spills": k.vgpr_spills,
        "lds_bytes": k.lds_bytes,
        "threads": k.max_threads,
        "waves_per_simd": k.waves_per_simd,
        "loop": {f: v for f, v in dataclasses.asdict(k.loop).items() if f not in ("start", "end")},
    }


def extract(src: Path, data: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for v in data["kernels"]:
            cc = src / f"attn_gfx1201_kernel_v{v}.cc"
            stats = {}
            for toolchain, rocm in (("clang19", False), ("rocm72", True)):
                co = isa.compile_source(cc, "gfx1201", work, [str(src)], rocm_codegen=rocm)
                stats[toolchain] = kernel_stats(co)
            data["kernels"][v]["isa"] = stats
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extract", type=Path, help="opus_attn_gfx1201 folder to compile")
    ap.add_argument("--toolchain", default=TOOLCHAIN, choices=("rocm72", "clang19"))
    ap.add_argument(
        "--loo", action="store_true", help="also leave each version out in turn (12 fits)"
    )
    args = ap.parse_args(argv)
    data = load()
    if args.extract:
        DATA.write_text(json.dumps(extract(args.extract, data), indent=1) + "\n")
        print(f"wrote {DATA}")
    pr = run_protocol(data, args.toolchain)
    print(f"ISA statistics: {args.toolchain}; held out: v{', v'.join(map(str, HELD_OUT))}")
    print(f"fit without them: {_fmt(pr.held_out_cal)}")
    print(
        f"held-out median |error| {100 * pr.held_out_median:.1f} %, Spearman "
        f"{pr.held_out_spearman:.2f} over {len(pr.held_out_rows)} points"
    )
    print(
        f"final fit (all versions): {_fmt(pr.final_cal)}; median |error| "
        f"{100 * pr.final_median:.1f} %\n"
    )
    print("held-out fit on the held-out points:")
    print(table(pr.held_out_rows, HELD_OUT))
    print("\nfinal fit, every point:")
    print(table(pr.final_rows, HELD_OUT))
    if args.loo:
        rows = leave_one_out(data, args.toolchain)
        rho = perf_model.spearman([r[1] for r in rows], [r[0].measured_tflops for r in rows])
        med = statistics.median(abs(r[2]) for r in rows)
        print(f"\nleave one version out: median |error| {100 * med:.1f} %, Spearman {rho:.2f}")
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
