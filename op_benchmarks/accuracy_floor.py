"""How far the attention kernel is from its format's own floor.

For randn inputs, prints the relative L2 error against FP32 SDPA of
  * the kernel (``gfx1201_sage_attention_fwd`` on the chosen backend), and
  * the same prepared tensors (INT8 Q/K per 32-row block, e4m3 V per channel) and e4m3 P taken
    through the online softmax in float64 (128-key tiles, exact sums): the error the format
    itself leaves, whatever the arithmetic,
and the kernel's distance from that exact-arithmetic result. (The cpu backend keeps P
unquantized, so there the kernel is below this floor.) On an H200 (cuda backend) this
showed the format's floor at 0.0384 / 0.0390 / 0.0387 for S = 4k / 16k / 32k and the kernel
within 0.0018-0.0019 of the exact result (0.002-0.005, growing with S, before O's FP32 home;
README, NVIDIA section).

    python3 op_benchmarks/accuracy_floor.py --backend cuda -s 4096 16384 32768
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import aiter_sage  # noqa: E402
from aiter_sage import ref  # noqa: E402

KV_TILE = 128  # the cuda kernel's key tile (the error against FP32 barely depends on it)


def exact_from_prepared(p, s: int, kv_tile: int = KV_TILE) -> torch.Tensor:
    """Attention of prepared tensors with e4m3 P, in float64: [B, S, H, Dp]."""
    q = dequantize_blocks(p.q_int8, p.q_scale, s)
    k = dequantize_blocks(p.k_int8, p.k_scale, s)
    v = ref.e4m3_decode(ref.fp8_bits(p.v_fp8)).double()[..., :s] * p.v_scale.double()[..., None]
    return exact_from_dequantized(q, k, v.transpose(-1, -2), kv_tile)


def dequantize_blocks(x8: torch.Tensor, scale: torch.Tensor, s: int) -> torch.Tensor:
    """INT8 [B, S_pad, H, Dp] with block scales [B, H, S_pad / block] -> float64 [B, H, s, Dp]."""
    block = x8.shape[1] // scale.shape[-1]
    x = x8.double().transpose(1, 2) * scale.double().repeat_interleave(block, -1)[..., None]
    return x[..., :s, :]


def fp64_attention(q, k, v) -> torch.Tensor:
    """SDPA in float64 of [B, S, H, D] inputs: the reference the error tables are against."""
    t = lambda x: x.double().transpose(1, 2)  # noqa: E731
    return torch.nn.functional.scaled_dot_product_attention(t(q), t(k), t(v)).transpose(1, 2)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def exact_from_dequantized(q, k, v, kv_tile: int = KV_TILE) -> torch.Tensor:
    """The online softmax of exact_from_prepared on dequantized float64 [B, H, S, Dp] Q (scores
    in the log2 domain: Q carries softmax_scale * log2 e), K and V: [B, S, H, Dp]."""
    s = k.shape[2]
    m = torch.full((*q.shape[:3], 1), -math.inf, dtype=torch.float64, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    for j in range(0, s, kv_tile):
        scores = q @ k[..., j : j + kv_tile, :].transpose(-1, -2)
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        alpha = torch.exp2(m - m_new)
        pr = torch.exp2(scores - m_new + ref.EXP_OFFSET).float()  # P' <= 448, as the kernels
        p8 = ref.e4m3_decode(ref.e4m3_encode_sat(pr)).double()
        l = l * alpha + pr.double().sum(-1, keepdim=True)
        acc = acc * alpha + p8 @ v[..., j : j + kv_tile, :]
        m = m_new
    return (acc / l).transpose(1, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backend", default=None, help="default: the best one present")
    ap.add_argument("-s", "--seqs", type=int, nargs="+", default=[4096])
    ap.add_argument("--heads", type=int, default=8)
    args = ap.parse_args()
    backend = args.backend or aiter_sage.available_backends()[0]
    device = "cuda" if backend == "cuda" else "cpu"
    print("| S | H | kernel vs FP32 | exact arithmetic vs FP32 | kernel vs exact |")
    print("|---|---|---|---|---|")
    for s in args.seqs:
        g = torch.Generator().manual_seed(s)
        q, k, v = (
            torch.randn(1, s, args.heads, 128, generator=g).to(torch.bfloat16).to(device)
            for _ in range(3)
        )
        want = fp64_attention(q, k, v)
        p = aiter_sage.gfx1201_sage_prepare(q, k, v, backend=backend)
        out = aiter_sage.gfx1201_sage_attention_fwd(*p, s, backend=backend)[:, :s].double()
        exact = exact_from_prepared(p, s)
        print(
            f"| {s} | {args.heads} | {rel_l2(out, want):.5f} | {rel_l2(exact, want):.5f} | "
            f"{rel_l2(out, exact):.5f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
