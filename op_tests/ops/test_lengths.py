"""Per-entry lengths (``q_lens`` / ``kv_lens``, SageParams ABI 7) on every backend and cpu tier.

Entry b of a batch has q_lens[b] real query rows and kv_lens[b] real keys; what the inputs hold
past them is padding (here: NaN and huge values, which must not leak). Prepare is bit-exact
against ref.prepare with the same lengths; attention is in band against FP32 attention over
each entry's real rows and keys, and close to ref's step-by-step model with the lengths; rows
past q_lens[b] are exact zeros with LSE -inf; an entry without keys gives NaN rows with LSE
-inf (SDPA's result for an all-masked boolean row). Lengths 0, 1, 31, 32, 33 and full, causal,
GQA, D 64 and 128, FP16 P.V, K smoothing and the LSE.
"""

import math

import pytest
import torch

import aiter_sage
from aiter_sage import ref

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import BACKENDS, cpu_model, device_for, run_as_script, use_cpu_tier
from test_gfx1201_sage_prepare import assert_prepared_equal

CPU_TIERS = ("scalar", "avx2", "avx512", "amx", "amx_model")
# Every cpu tier, then the other backends present (the gfx12 kernels on the emulator; cuda
# where a GPU is).
WHERE = [pytest.param(f"cpu:{t}", id=f"cpu-{t}") for t in CPU_TIERS if "cpu" in BACKENDS] + [
    pytest.param(b, id=b) for b in BACKENDS if b != "cpu"
]
SQ, SKV = 70, 90
# One entry per interesting length: no keys, 1 key, a scale block and its neighbours, full.
KV_LENS = [0, 1, 31, 32, 33, SKV]
Q_LENS = [SQ, 33, 1, 32, 31, 0]
GARBAGE = (float("nan"), 3e38)
# |LSE - FP32 LSE| bound: the INT8 scores move a row's LSE by up to ~0.03 on these inputs (the
# model comparison below is the tight one, 1e-4); a key too many or too few moves it by ~1.
LSE_ATOL = 0.1  # Q/K rows and V rows past the entry's length


def _backend(where: str, monkeypatch) -> str:
    if where.startswith("cpu:"):
        use_cpu_tier(monkeypatch, where[4:])
        return "cpu"
    return where


def _inputs(d, hq, hkv, dtype, seed, q_lens=Q_LENS, kv_lens=KV_LENS):
    """(clean q, k, v, the same with garbage past each entry's lengths) on the CPU."""
    g = torch.Generator().manual_seed(seed)
    b = len(kv_lens)
    q = torch.randn(b, SQ, hq, d, generator=g).to(dtype)
    k = (torch.randn(b, SKV, hkv, d, generator=g) + 0.5).to(dtype)  # an offset for smooth_k
    v = torch.randn(b, SKV, hkv, d, generator=g).to(dtype)
    dq, dk, dv = q.clone(), k.clone(), v.clone()
    for e, (nq, nkv) in enumerate(zip(q_lens, kv_lens)):
        dq[e, nq:], dk[e, nkv:] = GARBAGE[0], GARBAGE[0]
        dv[e, nkv:] = GARBAGE[1]
    return (q, k, v), (dq, dk, dv)


PREPARE_CASES = [  # d, hq, hkv, dtype, smooth_k, pv_dtype
    (128, 2, 2, torch.bfloat16, False, "fp8"),
    (128, 4, 2, torch.bfloat16, True, "fp8"),
    (64, 2, 1, torch.float16, True, "fp16"),
    (40, 2, 2, torch.bfloat16, False, "fp16"),
]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("d, hq, hkv, dtype, smooth_k, pv_dtype", PREPARE_CASES)
def test_prepare_with_lengths_is_bit_exact(
    where, d, hq, hkv, dtype, smooth_k, pv_dtype, monkeypatch
):
    """Bit-exact against ref.prepare given the lengths (as int64 on the CPU; ref reads a list):
    rows and keys past them are zero codes in no scale and not in the K mean, whatever the
    inputs hold there. Fails on a prepare that ignores the lengths (NaN reaches the scales)."""
    backend = _backend(where, monkeypatch)
    _, (q, k, v) = _inputs(d, hq, hkv, dtype, seed=d + hq)
    dev = device_for(backend)
    got = aiter_sage.gfx1201_sage_prepare(
        *(t.to(dev) for t in (q, k, v)),
        smooth_k=smooth_k,
        pv_dtype=pv_dtype,
        q_lens=torch.tensor(Q_LENS),
        kv_lens=torch.tensor(KV_LENS, device=dev),
        backend=backend,
    )
    want = ref.prepare(
        q, k, v, smooth_k=smooth_k, pv_dtype=pv_dtype, q_lens=Q_LENS, kv_lens=KV_LENS
    )
    assert_prepared_equal([t.cpu() for t in got], want)


ATTENTION_CASES = [  # d, hq, hkv, dtype, causal, smooth_k, pv_dtype
    (128, 2, 2, torch.bfloat16, False, False, "fp8"),
    (128, 4, 2, torch.bfloat16, True, True, "fp8"),
    (64, 2, 1, torch.float16, True, False, "fp16"),
    (64, 2, 2, torch.bfloat16, False, True, "fp16"),
]


def _sdpa_rows(q, k, v, causal):
    """FP32 attention and LSE of each entry over its real rows and keys: [rows, Hq, D] and
    [Hq, rows] per entry (entries with rows and keys)."""
    outs, lses = [], []
    for e, (nq, nkv) in enumerate(zip(Q_LENS, KV_LENS)):
        if nq == 0 or nkv == 0:
            continue
        qe, ke, ve = q[e : e + 1, :nq], k[e : e + 1, :nkv], v[e : e + 1, :nkv]
        outs.append(ref.attention_fp32(qe, ke, ve, is_causal=causal)[0])
        lses.append(ref.lse_fp32(qe, ke, is_causal=causal)[0])
    return outs, lses


def _check_special_rows(out, lse):
    """Rows past q_lens[b]: exact zeros, LSE -inf; real rows of an entry without keys: NaN,
    LSE -inf."""
    for e, (nq, nkv) in enumerate(zip(Q_LENS, KV_LENS)):
        assert torch.equal(out[e, nq:], torch.zeros_like(out[e, nq:])), e
        assert (lse[e, :, nq:] == -math.inf).all(), e
        if nkv == 0:
            assert out[e, :nq].isnan().all(), e
            assert (lse[e, :, :nq] == -math.inf).all(), e


def _real_rows(x, lse):
    """The output rows and LSE of the entries with rows and keys, concatenated."""
    keep = [e for e, (nq, nkv) in enumerate(zip(Q_LENS, KV_LENS)) if nq and nkv]
    rows = torch.cat([x[e, : Q_LENS[e]] for e in keep])
    lses = torch.cat([lse[e, :, : Q_LENS[e]] for e in keep], dim=-1)
    return rows, lses


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("d, hq, hkv, dtype, causal, smooth_k, pv_dtype", ATTENTION_CASES)
def test_attention_with_lengths(where, d, hq, hkv, dtype, causal, smooth_k, pv_dtype, monkeypatch):
    """Each entry attends over its first kv_lens[b] keys (causal: also j <= i): in band against
    FP32 attention on the real rows, LSE within LSE_ATOL of FP32's (and within 1e-4 of ref's model
    on the host backends), padding rows zero / -inf, no-key rows NaN / -inf."""
    backend = _backend(where, monkeypatch)
    (q, k, v), dirty = _inputs(d, hq, hkv, dtype, seed=2 * d + hq)
    dev = device_for(backend)
    quant = dict(smooth_k=smooth_k, pv_dtype=pv_dtype, q_lens=Q_LENS)  # kernel and ref alike
    out, lse = aiter_sage.gfx1201_sage_attention(
        *(t.to(dev) for t in dirty),
        is_causal=causal,
        return_lse=True,
        kv_lens=torch.tensor(KV_LENS, dtype=torch.int32, device=dev),
        backend=backend,
        **quant,
    )
    out, lse = out.cpu(), lse.cpu()
    assert out.shape == q.shape and out.dtype == dtype
    _check_special_rows(out, lse)
    want_out, want_lse = _sdpa_rows(q, k, v, causal)
    got_out, got_lse = _real_rows(out, lse)
    acc = ref.accuracy(got_out, torch.cat(want_out))
    assert ref.band_failures(acc) == [], acc
    assert (got_lse - torch.cat(want_lse, dim=-1)).abs().max() < LSE_ATOL
    if backend in ("cpu", "emu"):  # ref's model of these kernels' arithmetic, with the lengths
        prep, sm = ref.prepare(*dirty, return_smoothing=True, kv_lens=KV_LENS, **quant)
        kw = dict(
            is_causal=causal,
            lse_corr=sm.lse_corr if smooth_k else None,
            head_dim=d,
            out_dtype=dtype,
            return_lse=True,
            q_lens=Q_LENS,
            kv_lens=KV_LENS,
        )
        model = (
            cpu_model(prep, SQ, SKV, **kw)
            if backend == "cpu"
            else ref.attention_from_prepared(prep, SQ, SKV, **kw)
        )
        _check_special_rows(model.out, model.lse)
        m_out, m_lse = _real_rows(model.out, model.lse)
        assert ref.accuracy(got_out, m_out)["rel_l2"] < 5e-3
        assert torch.allclose(got_lse, m_lse, atol=1e-4, rtol=0)


@pytest.mark.parametrize("where", WHERE)
def test_fwd_with_lengths_is_the_attention(where, monkeypatch):
    """The prepared-tensor op takes the lengths too: on gfx1201_sage_prepare's output (with the
    same lengths) it gives the attention op's rows bit for bit, and its padded rows (up to
    S_pad) are zero with LSE -inf."""
    backend = _backend(where, monkeypatch)
    _, dirty = _inputs(128, 2, 2, torch.bfloat16, seed=5)
    dev = device_for(backend)
    q, k, v = (t.to(dev) for t in dirty)
    lens = dict(q_lens=torch.tensor(Q_LENS), kv_lens=torch.tensor(KV_LENS), backend=backend)
    prep = aiter_sage.gfx1201_sage_prepare(q, k, v, **lens)
    out, lse = aiter_sage.gfx1201_sage_attention_fwd(
        *prep, SQ, kv_len=SKV, is_causal=True, return_lse=True, **lens
    )
    want, want_lse = aiter_sage.gfx1201_sage_attention(
        q, k, v, is_causal=True, return_lse=True, **lens
    )
    assert out.shape[1] == ref.padded_len(SQ)
    assert torch.equal(out[:, :SQ].cpu().view(torch.int16), want.cpu().view(torch.int16))
    assert torch.equal(lse[..., :SQ].cpu(), want_lse.cpu())
    assert not out[:, SQ:].cpu().any() and (lse[..., SQ:] == -math.inf).all()


def test_full_lengths_are_no_lengths():
    """Lengths equal to the full lengths change nothing (bit for bit, cpu default tier)."""
    (q, k, v), _ = _inputs(128, 2, 2, torch.bfloat16, seed=9)
    full = dict(q_lens=[SQ] * len(KV_LENS), kv_lens=[SKV] * len(KV_LENS), backend="cpu")
    a, la = aiter_sage.gfx1201_sage_attention(q, k, v, return_lse=True, backend="cpu")
    b, lb = aiter_sage.gfx1201_sage_attention(q, k, v, return_lse=True, **full)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16)) and torch.equal(la, lb)


def test_lengths_that_do_not_fit_are_clear_errors():
    """Wrong dtype: TypeError; wrong shape, values outside [0, full], another device:
    ValueError naming the argument."""
    (q, k, v), _ = _inputs(64, 1, 1, torch.bfloat16, seed=3)
    b = len(KV_LENS)
    call = lambda **kw: aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu", **kw)  # noqa: E731
    with pytest.raises(TypeError, match="kv_lens must be torch.int32 or torch.int64"):
        call(kv_lens=torch.ones(b))
    with pytest.raises(ValueError, match=r"q_lens must have shape \[6\]"):
        call(q_lens=torch.ones(b + 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"kv_lens\[2\] = 91 lies outside \[0, 90\]"):
        call(kv_lens=[1, 1, SKV + 1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"q_lens\[0\] = -1 lies outside \[0, 70\]"):
        call(q_lens=[-1, 1, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="kv_lens is on meta"):
        call(kv_lens=torch.ones(b, dtype=torch.int32, device="meta"))


if __name__ == "__main__":
    run_as_script(__file__)
