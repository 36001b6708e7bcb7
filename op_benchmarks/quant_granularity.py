"""The format's accuracy floor at other INT8 block sizes than the contract's 32 rows.

The contract (upstream aiter's prepare numerics) gives Q and K one INT8 scale per 32-row block.
This prints the relative L2 error against FP64 attention of exact arithmetic on tensors
quantized with Q blocks of ``--q_blocks`` rows and K blocks of ``--k_blocks`` keys
(``ref.quantize_int8_blocks`` at that block size; V per channel e4m3 and P e4m3 as the
contract's; `accuracy_floor.exact_from_dequantized`), on randn and on the benchmark's DiT-like
inputs (`--dit`: outlier Q channels, a shared K offset; with smooth_k). At 32 / 32 the codes
are ``ref.prepare``'s, at 16 / 32 those of ``ref.prepare(..., q_scale_rows=16)`` (the op's
opt-in). SageAttention2's sm90 call uses Q blocks of 16 rows and K blocks of 128 keys.

    python3 op_benchmarks/quant_granularity.py -s 4096 --heads 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent)]
import accuracy_floor  # noqa: E402
import bench_gfx1201_sage_attention as bench  # noqa: E402

from aiter_sage import ref  # noqa: E402


def floor_at(q, k, v, q_block: int, k_block: int, smooth_k: bool) -> torch.Tensor:
    """Exact-arithmetic attention [B, S, H, D] of the format at these block sizes."""
    d = q.shape[-1]
    kf = k.float()
    if smooth_k:
        kf = kf - ref.k_mean(kf)[:, None]
    s = k.shape[1]
    qd = accuracy_floor.dequantize_blocks(
        *ref.quantize_int8_blocks(q.float() * ref.q_prescale(d**-0.5), q_block), q.shape[1]
    )
    kd = accuracy_floor.dequantize_blocks(*ref.quantize_int8_blocks(kf, k_block), s)
    v8, v_scale = ref.quantize_v(v)
    vd = ref.e4m3_decode(ref.fp8_bits(v8)).double()[..., :s] * v_scale.double()[..., None]
    return accuracy_floor.exact_from_dequantized(qd, kd, vd.transpose(-1, -2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("-s", "--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--q_blocks", type=int, nargs="+", default=[32, 16, 8])
    ap.add_argument("--k_blocks", type=int, nargs="+", default=[32, 128])
    a = ap.parse_args(argv)
    print("| inputs | Q block rows | K block keys | rel L2 vs FP64 |")
    print("|---|---|---|---|")
    for dit in (False, True):
        q, k, v = bench.make_inputs(1, a.heads, a.seq, "cpu", dit=dit)
        want = accuracy_floor.fp64_attention(q, k, v)
        for qb in a.q_blocks:
            for kb in a.k_blocks:
                err = accuracy_floor.rel_l2(floor_at(q, k, v, qb, kb, smooth_k=dit), want)
                name = "DiT-like, smooth_k" if dit else "randn"
                print(f"| {name} | {qb} | {kb} | {err:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
