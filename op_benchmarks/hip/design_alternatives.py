"""Design alternatives for the D128 FP8 attention kernel, decided by the calibrated model.

    python3 op_benchmarks/hip/design_alternatives.py [--toolchain rocm72|clang19]

Each alternative is today's measured main loop (csrc/gfx12/attention.hip, sage_attention_fwd_
kernel, compiled for gfx1201) with the instructions that the alternative adds or removes per
32-key tile changed as stated in its row, at B1 H24 S16384 on the R9700. PREDICTIONS of what-if
loops, not of compiled kernels: an alternative that wins >= 10 % here is worth writing.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from aiter_sage import perf_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import predict_gfx12  # noqa: E402

SHAPE = perf_model.Shape(1, 24, 16384, 128)
KV_TILE_BYTES = 32 * 128  # one 32-key tile of int8 K (and of fp8 V): 4 KiB
B128 = 16  # bytes per lane of a global_load_b128 / ds_load_b128
VGPR_FILE = 256  # per lane


@dataclasses.dataclass(frozen=True)
class Alternative:
    name: str
    change: str
    loop: dict
    threads: int
    queries_per_group: int
    vgprs: int


def alternatives(base: perf_model.Kernel) -> list:
    lp = base.loop
    per_lane_tile = KV_TILE_BYTES // perf_model.WAVE_SIZE // B128  # b128 loads per tile per wave
    one_wave = dict(
        lp,
        lds=0,
        lds_bytes=0,
        barrier=0,
        wait_lds=0,
        global_load=2 * per_lane_tile,
        vmem_bytes=2 * per_lane_tile * B128,
        wait_vmem=lp["wait_vmem"] + 2,
    )
    two_wave = dict(
        lp,
        global_load=2 * lp["global_load"],
        vmem_bytes=2 * lp["vmem_bytes"],
        lds=lp["lds"] + 4,
        lds_bytes=lp["lds_bytes"] + 4 * B128,
    )
    # 64-key tiles: per 64 keys twice the WMMAs, scores, exps and packs; the loop overhead
    # (SALU, barriers, address VALU) once. Expressed per 32 keys: halve the fixed parts.
    fixed_valu = 16
    wide = dict(
        lp,
        wmma_iu8=2 * lp["wmma_iu8"],
        wmma_fp8=2 * lp["wmma_fp8"],
        valu=2 * lp["valu"] - fixed_valu,
        trans=2 * lp["trans"],
        delay_alu=2 * lp["delay_alu"],
    )
    no_barrier = dict(lp, barrier=0)
    no_rescale = dict(lp, valu=lp["valu"] - lp["rescale_valu"])
    t, q, v = base.threads, 128, base.vgprs
    return [
        Alternative("today", "as compiled", lp, t, q, v),
        Alternative(
            "1-wave groups, K/V through L1 (opus v11)",
            f"no LDS, no barrier; {2 * per_lane_tile} global_load_b128 per tile per wave",
            one_wave,
            32,
            32,
            v,
        ),
        Alternative(
            "2 waves per group (64 queries)",
            "each wave stages twice the tile: 2x global loads, +4 ds_store",
            two_wave,
            64,
            64,
            v,
        ),
        Alternative(
            "64-key tiles",
            f"2x WMMA/VALU/exp per iteration, -{fixed_valu} VALU loop overhead; +32 VGPRs of "
            "scores, +16 of staging",
            wide,
            t,
            q,
            v + 48,
        ),
        Alternative("V load pattern", "V is already pre-transposed by prepare (b128)", lp, t, q, v),
        Alternative(
            "no barriers", "barrier-free staging (e.g. per-wave LDS slots)", no_barrier, t, q, v
        ),
        Alternative(
            "rescale never executed",
            f"-{lp['rescale_valu']} VALU (an upper bound for lazy rescaling)",
            no_rescale,
            t,
            q,
            v,
        ),
    ]


def evaluate(base: perf_model.Kernel, gpu=perf_model.R9700) -> list:
    rows = []
    ref = None
    for alt in alternatives(base):
        fits = alt.vgprs <= VGPR_FILE
        waves = min(16, 1536 // (-(-min(alt.vgprs, VGPR_FILE) // 24) * 24))
        k = perf_model.Kernel(alt.name, alt.vgprs, waves, alt.threads, alt.loop)
        pr = perf_model.predict(k, gpu, SHAPE, alt.queries_per_group)
        ref = ref or pr.tflops
        rows.append((alt, pr, fits, pr.tflops / ref - 1))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toolchain", default="rocm72", choices=("rocm72", "clang19"))
    args = ap.parse_args(argv)
    src = ROOT / "csrc" / "gfx12" / "attention.hip"
    (k,) = [k for k in predict_gfx12.kernels(src, args.toolchain) if k.name == predict_gfx12.MAIN]
    print(
        f"PREDICTED, R9700, B1 H24 S16384 D128, {args.toolchain} code, band +-"
        f"{100 * perf_model.HELD_OUT_ERROR:.0f} %\n"
    )
    print("| alternative | change per 32-key tile | VGPRs (waves) | TFLOPS | vs today | bound |")
    print("|---|---|---|---:|---:|---|")
    for alt, pr, fits, gain in evaluate(perf_model.Kernel.from_report(k)):
        regs = f"{alt.vgprs} ({pr.waves:.0f})" + (
            "" if fits else " > 256: spills, TFLOPS if it fit"
        )
        print(
            f"| {alt.name} | {alt.change} | {regs} | {pr.tflops:.0f} | {100 * gain:+.1f} % | "
            f"{pr.bound} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
