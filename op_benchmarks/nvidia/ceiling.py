"""Where the cuda attention kernel's time goes: the default kernel beside two stripped copies.

    python3 op_benchmarks/nvidia/ceiling.py -s 16384 32768 [--head_dim 64] [--rounds 2]

- `mma`: the serial key loop without its softmax. P's A registers are S's bits masked to
  finite e4m3 values (up to 120, data-like bit patterns, not zeros), alpha = 1: every wgmma,
  TMA copy, barrier and O home move of the real kernel, no exponentials.
- `softmax`: the serial key loop without its wgmmas. The softmax runs on scores the compiler
  cannot see through (S's registers are left as they were), P is packed but not multiplied:
  every exponential, row sum, vote, rescale and copy, no tensor-core work.

Each copy is this repository with one source edit (STRIP, asserted to match exactly once, so a
kernel change that moves the edited lines fails here and in op_tests/infra/test_ceiling.py
instead of measuring something else). The stripped kernels compute wrong outputs; they exist
only in the copies under --work. The copies and the default are timed by the benchmark, each
in its own process with its own JIT cache, alternating, the order reversed every round.

Per shape the table gives ms per call and the overlap: the share of the shorter stripped time
that the default kernel hides, (t_mma + t_softmax - t_default) / min(t_mma, t_softmax). With
perfect overlap the default would take max(t_mma, t_softmax); with none, their sum.
"""

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KERNEL = Path("csrc/cuda/attention.cu")

# variant -> [(text in the serial key loop, its replacement)]
STRIP = {
    "mma": [
        (
            "    softmax_any_tile<T>(pk, c, s, key0, c.row0 - 16 * c.warp - c.g, ks, alpha, f, "
            "c.pa);\n",
            "    {  // ceiling.py mma: no softmax; P from S's bits (finite e4m3 up to 120)\n"
            "#pragma unroll\n"
            "      for (int kb = 0; kb < T::kPvSteps; ++kb)\n"
            "#pragma unroll\n"
            "        for (int r = 0; r < 4; ++r)\n"
            "          c.pa[kb][r] =\n"
            "              uint32_t(s[(kb * 4 + r) * (16 / T::kPvSteps)]) & 0x6F6F6F6Fu;\n"
            "      alpha[0] = alpha[1] = 1.0f;\n"
            "      (void)ks;\n"
            "      (void)f;\n"
            "    }\n",
        )
    ],
    "softmax": [
        (
            "      issue_qk<T>(qd, s);\n    }\n    wgmma_commit();\n    // The K scales",
            "      reg_fence(s);  // ceiling.py softmax: no QK wgmma\n    }\n    wgmma_commit();\n"
            "    // The K scales",
        ),
        (
            "      issue_pv<T>(vd, c.o, c.pa, o_moves_home_at<T>(j));\n    }",
            "      reg_fence(c.pa);  // ceiling.py softmax: no PV wgmma\n      reg_fence(c.o);\n"
            "    }",
        ),
    ],
}


def strip(source: str, variant: str) -> str:
    """The kernel source with `variant`'s edits; each must match exactly once."""
    for old, new in STRIP[variant]:
        n = source.count(old)
        if n != 1:
            raise ValueError(
                f"ceiling.py: the {variant} edit matches {n} times in {KERNEL} "
                f"(the serial key loop changed; update STRIP): {old.strip()[:60]!r}"
            )
        source = source.replace(old, new)
    return source


def make_copy(variant: str, dest: Path) -> Path:
    """A copy of the repository's sources under dest with `variant`'s kernel."""
    if dest.exists():
        shutil.rmtree(dest)
    ignore = shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".*cache*")
    for top in ("aiter_sage", "csrc", "jit", "op_benchmarks", "op_tests"):
        shutil.copytree(REPO / top, dest / top, ignore=ignore)
    for f in ("GPU_ARCHS.cfg", "setup.py", "pyproject.toml"):
        if (REPO / f).exists():
            shutil.copy2(REPO / f, dest / f)
    if variant != "default":
        kernel = dest / KERNEL
        kernel.write_text(strip(kernel.read_text(), variant))
    return dest


def bench(
    tree: Path, bench_args: list[str], backend: str = "cuda", cache: Path | None = None
) -> dict[int, float]:
    """sequence length -> ms per call of sage_core, from the benchmark run inside `tree` (its
    JIT cache: `cache`, by default one per copy beside it, which make_copy leaves in place, so
    the copies never share a module and a later run of the same copy builds nothing)."""
    cache = cache or tree.parent / f"{tree.name}.jit_cache"  # modules are keyed by content
    env = dict(os.environ, AITER_SAGE_CACHE_DIR=str(cache))
    rows = tree / "ceiling_rows.csv"  # the benchmark's own CSV (-o), not its printed table
    cmd = [sys.executable, "op_benchmarks/bench_gfx1201_sage_attention.py", "--backend", backend]
    cmd += ["--providers", "sage_core", "-o", str(rows), *bench_args]
    subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
    with open(rows, newline="") as f:
        return {
            int(r["S"]): float(r["ms"]) for r in csv.DictReader(f) if r["provider"] == "sage_core"
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-s", "--seq_len", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of the three")
    p.add_argument("--work", type=Path, default=Path("/tmp/aiter_sage_ceiling"))
    args = p.parse_args()
    names = ["default", "mma", "softmax"]
    trees = {n: make_copy(n, args.work / n) for n in names}
    bench_args = ["--rounds", "2", "--head_dim", str(args.head_dim), "-s"]
    bench_args += [str(s) for s in args.seq_len]
    times: dict[str, dict[int, list[float]]] = {n: {s: [] for s in args.seq_len} for n in names}
    for r in range(args.rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            for s, ms in bench(trees[n], bench_args).items():
                times[n][s].append(ms)
    print("| S | D | default ms | mma ms | softmax ms | overlap | bound (max) ms |")
    print("|---|---|---|---|---|---|---|")
    for s in args.seq_len:
        d, m, x = (statistics.median(times[n][s]) for n in names)
        overlap = (m + x - d) / min(m, x)
        cells = [s, args.head_dim, f"{d:.3f}", f"{m:.3f}", f"{x:.3f}", f"{overlap:.0%}"]
        print("| " + " | ".join(map(str, [*cells, f"{max(m, x):.3f}"])) + " |")


if __name__ == "__main__":
    main()
