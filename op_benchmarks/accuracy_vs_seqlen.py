#!/usr/bin/env python3
"""Accuracy versus sequence length: FP8 vs FP16 P·V, with and without K smoothing.

For each key length S (default 16k, 64k, 128k, 256k), input kind and configuration, scores
relative L2 and cosine against plain FP32 attention for two implementations:

  cpu    the cpu backend (gfx1201_sage_attention, backend="cpu"): P kept in the tier's P·V
         type (FP32 on avx2/scalar, BF16 on avx512/amx); V in e4m3 (fp8) or FP16 (fp16)
  model  the gfx12 kernels' arithmetic on the same prepared tensors (gpu_model: the steps of
         ref.attention_from_prepared, vectorized over 8192-key chunks; P rounded to e4m3 (fp8)
         or FP16 (fp16), FP32 accumulation; only the alpha rescales are folded into one
         factor per tile, a float32 rounding apart from the tile-by-tile loop)

Inputs (B = 1, H heads, D = 128, BF16):
  randn  q, k, v ~ N(0, 1)
  dit    DiT-like: a few outlier channels in Q (x12), a per-channel offset in K (N(0, 3) per
         channel, shared by all keys), V ~ N(0, 1)

Feasible on a 2-core CPU: query rows are independent given all the keys, so only --rows query
rows (default 256 = 8 Q scale blocks of 32 rows; rows are i.i.d., so these blocks quantize as
any 8 blocks of a full-length Q would) are scored against all S keys (Sq != Skv is supported).
Not a CI test. Writes a CSV and, when matplotlib is present, a PNG plot.

  python3 op_benchmarks/accuracy_vs_seqlen.py -s 16384 65536 131072 262144 -o acc.csv
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiter_sage  # noqa: E402
from aiter_sage import ref  # noqa: E402

D = 128
OUTLIER_CHANNELS = (3, 41, 77, 120)
OUTLIER_GAIN = 12.0
K_OFFSET_STD = 3.0
FIELDS = ("seq_len", "inputs", "impl", "pv_dtype", "smooth_k", "rel_l2", "cosine", "seconds")


def make_inputs(kind: str, rows: int, s: int, h: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((1, rows, h, D), generator=g)
    k = torch.randn((1, s, h, D), generator=g)
    v = torch.randn((1, s, h, D), generator=g)
    if kind == "dit":
        q[..., list(OUTLIER_CHANNELS)] *= OUTLIER_GAIN
        k += torch.randn((1, 1, h, D), generator=g) * K_OFFSET_STD
    elif kind != "randn":
        raise ValueError(kind)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def gpu_model(p, rows: int, s: int, chunk: int = 8192) -> torch.Tensor:
    """ref.attention_from_prepared's steps (32-key tiles, one score scale per tile, running max
    over tiles, P' = exp2(fma(dot - d_max, ss, (m_t - m') + EXP_OFFSET)), P rounded to e4m3 or
    FP16 by the prepared V's dtype, l from unquantized P'), vectorized over chunks of tiles:
    [B=1, rows, H, Dp] FP32. Keys: a multiple of 32, no masking, no causal."""
    tile = ref.KERNEL_KV_TILE
    assert s % tile == 0 and chunk % tile == 0
    fp16_pv = p.v_fp8.dtype == torch.float16
    q8 = p.q_int8[0, :rows].float().transpose(0, 1)  # [H, rows, Dp]
    k8 = p.k_int8[0, :s].float().transpose(0, 1)  # [H, S, Dp]
    qs = p.q_scale[0].repeat_interleave(ref.SCALE_BLOCK, dim=-1)[:, :rows]  # [H, rows]
    ks = p.k_scale[0][:, : s // tile]  # [H, tiles]: one scale per 32-key tile
    h, _, d = q8.shape
    offset = ref.EXP_OFFSET
    m = torch.full((h, rows), -float("inf"))
    l = torch.zeros((h, rows))
    acc = torch.zeros((h, rows, d))
    for c0 in range(0, s, chunk):
        c1 = min(c0 + chunk, s)
        nt = (c1 - c0) // tile
        dot = (q8 @ k8[:, c0:c1].transpose(1, 2)).view(h, rows, nt, tile)  # exact integers
        ss = qs[:, :, None] * ks[:, None, c0 // tile : c0 // tile + nt]  # [H, rows, nt]
        d_max = dot.amax(-1)
        m_t = d_max * ss
        m_new = torch.cummax(torch.maximum(m_t, m[..., None]), dim=-1).values
        bias = (m_t - m_new) + offset
        u = (dot - d_max[..., None]).double() * ss.double()[..., None] + bias.double()[..., None]
        pr = torch.exp2(u.float())  # [H, rows, nt, tile]
        m_end = m_new[..., -1]
        w = torch.exp2(m_new - m_end[..., None])  # the product of the later tiles' alphas
        l = l * torch.exp2(m - m_end) + (pr.sum(-1) * w).sum(-1)
        pq = pr.half().float() if fp16_pv else ref.e4m3_decode(ref.e4m3_encode_sat(pr))
        v = p.v_fp8[0, :, :, c0:c1]
        v = v.float() if fp16_pv else ref.e4m3_decode(ref.fp8_bits(v))  # [H, Dp, keys]
        part = (pq * w[..., None]).view(h, rows, c1 - c0) @ v.transpose(1, 2)
        acc = acc * torch.exp2(m - m_end)[..., None] + part
        m = m_end
    o = acc / l[..., None] * p.v_scale[0][:, None, :]
    return o.transpose(0, 1)[None]


def score(out, want):
    o, r = out.double().flatten(), want.double().flatten()
    rel = ((o - r).norm() / r.norm()).item()
    cos = torch.nn.functional.cosine_similarity(o, r, dim=0).item()
    return rel, cos


def run(args) -> list[dict]:
    results = []
    for s in args.seq_lens:
        for kind in args.inputs:
            q, k, v = make_inputs(kind, args.rows, s, args.heads, seed=s)
            t0 = time.time()
            want = ref.attention_fp32(q, k, v, chunk=64)
            print(f"S={s} {kind}: FP32 reference in {time.time() - t0:.1f} s", flush=True)
            for smooth in (False, True):
                for mode in ("fp8", "fp16"):
                    t0 = time.time()
                    out = aiter_sage.gfx1201_sage_attention(
                        q, k, v, smooth_k=smooth, pv_dtype=mode, backend="cpu"
                    )
                    impls = [("cpu", out, time.time() - t0)]
                    if not args.no_model:
                        t0 = time.time()
                        prep = aiter_sage.gfx1201_sage_prepare(
                            q, k, v, smooth_k=smooth, pv_dtype=mode, backend="cpu"
                        )  # bit-identical to ref.prepare
                        o = gpu_model(prep, args.rows, s).to(q.dtype)
                        impls.append(("model", o, time.time() - t0))
                    for impl, o, secs in impls:
                        rel, cos = score(o, want)
                        row = dict(
                            seq_len=s,
                            inputs=kind,
                            impl=impl,
                            pv_dtype=mode,
                            smooth_k=int(smooth),
                            rel_l2=f"{rel:.5f}",
                            cosine=f"{cos:.6f}",
                            seconds=f"{secs:.1f}",
                        )
                        results.append(row)
                        print(" ".join(f"{f}={row[f]}" for f in FIELDS), flush=True)
                        if args.out:
                            write_csv(args.out, results)
    return results


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


def plot(path, rows) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (the CSV has the numbers)")
        return
    kinds = sorted({r["inputs"] for r in rows})
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        series = {}
        for r in rows:
            if r["inputs"] != kind:
                continue
            key = (r["impl"], r["pv_dtype"], int(r["smooth_k"]))
            series.setdefault(key, []).append((int(r["seq_len"]), float(r["rel_l2"])))
        for (impl, mode, smooth), pts in sorted(series.items()):
            pts.sort()
            style = "-" if mode == "fp16" else "--"
            marker = "o" if impl == "model" else "s"
            label = f"{impl} {mode} P·V{' +smooth_k' if smooth else ''}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=marker, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("key length S")
        ax.set_ylabel("relative L2 vs FP32")
        ax.set_title(f"{kind} inputs (D = {D})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-s", "--seq_lens", type=int, nargs="+", default=[16384, 65536, 131072, 262144])
    ap.add_argument("-n", "--heads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=256, help="query rows scored (multiple of 32)")
    ap.add_argument("--inputs", nargs="+", default=["randn", "dit"], choices=["randn", "dit"])
    ap.add_argument("--no_model", action="store_true", help="skip the gfx12 arithmetic model")
    ap.add_argument("-o", "--out", default="accuracy_vs_seqlen.csv")
    ap.add_argument("--plot", default=None, help="PNG path (default: the CSV's name, .png)")
    args = ap.parse_args(argv)
    if args.rows % ref.SCALE_BLOCK:
        ap.error(f"--rows must be a multiple of {ref.SCALE_BLOCK}")
    rows = run(args)
    plot(args.plot or str(Path(args.out).with_suffix(".png")), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
