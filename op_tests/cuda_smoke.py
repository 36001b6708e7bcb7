"""Quick look at the cuda backend on an sm_90 GPU (not a pytest file): prepare bit-exact vs
ref.prepare, attention against FP32 for a few contract-v2 cases, and one timing per head dim."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import aiter_sage  # noqa: E402
from aiter_sage import ref  # noqa: E402


def inputs(b, sq, skv, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(b, skv, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, skv, hkv, d, generator=g).to(dtype)
    return q, k, v


def main():
    t0 = time.time()
    ok = True
    for b, sq, skv, hq, hkv, d, dt, sm in [
        (1, 300, 300, 2, 2, 128, torch.bfloat16, False),
        (2, 77, 200, 4, 2, 64, torch.float16, True),
        (1, 129, 129, 2, 1, 96, torch.bfloat16, True),
    ]:
        q, k, v = inputs(b, sq, skv, hq, hkv, d, dt, 1)
        got = (
            aiter_sage.gfx1201_sage_prepare(
                q.cuda(), k.cuda(), v.cuda(), backend="cuda", smooth_k=sm
            )
            if sm
            else aiter_sage.gfx1201_sage_prepare(q.cuda(), k.cuda(), v.cuda(), backend="cuda")
        )
        want = ref.prepare(q, k, v, smooth_k=sm)
        same = all(
            torch.equal(
                a.cpu().view(torch.uint8) if a.dtype != torch.float32 else a.cpu(),
                w.view(torch.uint8) if w.dtype != torch.float32 else w,
            )
            for a, w in zip(got, want)
        )
        print(
            f"prepare b={b} sq={sq} skv={skv} hq={hq} hkv={hkv} d={d} {dt} smooth={sm}: "
            f"{'bit-exact' if same else 'MISMATCH'}"
        )
        ok &= same
        for causal in (False, True):
            out = aiter_sage.gfx1201_sage_attention(
                q.cuda(), k.cuda(), v.cuda(), backend="cuda", is_causal=causal
            )
            r = ref.attention_fp32(q, k, v, is_causal=causal)
            acc = ref.accuracy(out.float(), r)
            print(
                f"  attention causal={causal}: rel_l2={acc['rel_l2']:.4f} cos={acc['cosine']:.5f}"
                f" outside={acc['outside']:.4f} band={'ok' if ref.in_band(acc) else 'FAIL'}"
            )
            ok &= ref.in_band(acc)
    for d in (128, 64):
        q, k, v = (t.cuda() for t in inputs(1, 16384, 16384, 24, 24, d, torch.bfloat16, 2))
        prep = aiter_sage.gfx1201_sage_prepare(q, k, v, backend="cuda")
        f = lambda: aiter_sage.gfx1201_sage_attention_fwd(*prep, 16384, backend="cuda")  # noqa
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            f()
        e1.record()
        torch.cuda.synchronize()
        ms = e0.elapsed_time(e1) / 10
        print(f"sage_core S=16k D={d}: {ms:.3f} ms, {4 * 24 * 16384**2 * d / ms / 1e9:.1f} TFLOPS")
    print(f"smoke {'OK' if ok else 'FAILED'} in {time.time() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
