"""Key masks and packed varlen on the kernels, every backend and cpu tier, against FP32 SDPA
with the same mask: suffix padding of different lengths per batch entry, holes, all-masked
rows, additive masks, GQA and causal with a key mask, the [B, 1, 1, Skv] and [B, Skv] forms,
varlen with lengths 1, 31, 32, 33, 1000, and bad masks refused with errors that name them.
Every masked call here must reach the kernels (no SDPA fallback)."""

import math

import pytest
import torch
import torch.nn.functional as F

import aiter_sage
from aiter_sage import backends, ref
from aiter_sage.integrations import router

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import (
    BACKENDS,
    count_router_calls,
    run_as_script,
    skip_no_hardware,
    to_device,
    use_cpu_tier,
)

CPU_TIERS = ["scalar", "avx2", "avx512", "amx", "amx_model"]
TARGETS = (
    [("cpu", t) for t in CPU_TIERS if "cpu" in BACKENDS]
    + [(b, None) for b in BACKENDS if b != "cpu" and backends.BY_NAME[b].device_type == "cpu"]
    + [("cuda", None)]
)


@pytest.fixture(params=[pytest.param(t, id=t[1] or t[0]) for t in TARGETS])
def target(request, monkeypatch):
    backend, tier = request.param
    if backend == "cuda":
        if not (torch.cuda.is_available() and torch.version.cuda and not torch.version.hip):
            skip_no_hardware("no NVIDIA GPU")
        if torch.cuda.get_device_capability() != (9, 0):
            skip_no_hardware("no sm_90 (Hopper) GPU")
    if tier is not None:
        use_cpu_tier(monkeypatch, tier)
    return backend


@pytest.fixture
def no_fallback(monkeypatch):
    """Fails the test if a call runs torch SDPA instead of the kernels; counts kernel calls."""
    seen = count_router_calls(monkeypatch)

    def refuse(*a, **kw):
        raise AssertionError(f"a masked call fell back to torch SDPA: {seen['fallback']}")

    monkeypatch.setattr(router, "sdpa_fallback", refuse)
    return seen


def bhsd(b, hq, hkv, sq, skv, d=64, *, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn((b, hq, sq, d), generator=g).to(dtype),
        torch.randn((b, hkv, skv, d), generator=g).to(dtype),
        torch.randn((b, hkv, skv, d), generator=g).to(dtype),
    )


def sdpa32(q, k, v, mask=None, is_causal=False):
    m = mask.float() if mask is not None and mask.is_floating_point() else mask
    if is_causal and m is not None:
        m = router._with_causal(m, q.shape[-2], k.shape[-2])
        is_causal = False
    return F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=m, is_causal=is_causal,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # fmt: skip


def suffix(b, skv, lens):
    m = torch.zeros(b, 1, 1, skv, dtype=torch.bool)
    for i, n in enumerate(lens):
        m[i, ..., :n] = True
    return m


def assert_matches(out, want):
    """In the band where rows see keys, and exactly SDPA's 0 where a row sees none."""
    out = out.float().cpu()
    empty = (want == 0).all(-1)
    assert (out[empty] == 0).all()
    acc = ref.accuracy(out[~empty], want[~empty])
    assert not ref.band_failures(acc), (ref.band_failures(acc), acc)


def run(target, q, k, v, mask, **kw):
    dq, dk, dv, dm = to_device(target, q, k, v, mask)
    with torch.no_grad():
        res = aiter_sage.sageattn(dq, dk, dv, attn_mask=dm, backend=target, **kw)
    return tuple(t.cpu() for t in res) if isinstance(res, tuple) else res.cpu()


@pytest.mark.parametrize("pv_dtype", ["fp8", "fp16"])
def test_suffix_padding_of_different_lengths(target, no_fallback, pv_dtype):
    q, k, v = bhsd(3, 2, 2, 40, 100, seed=1)
    mask = suffix(3, 100, [100, 37, 1])
    out = run(target, q, k, v, mask)
    assert no_fallback["kernel"]
    assert_matches(out, sdpa32(q, k, v, mask))


def test_holes_and_all_masked_rows(target, no_fallback):
    q, k, v = bhsd(3, 2, 2, 33, 70, seed=2)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(3, 1, 1, 70, generator=g) > 0.5
    mask[2] = False  # entry 2 sees no key at all
    out, lse = run(target, q, k, v, mask, return_lse=True)
    assert no_fallback["kernel"]
    assert_matches(out, sdpa32(q, k, v, mask))
    want_lse = router.torch_lse(q, k, attn_mask=mask)
    assert torch.isinf(lse[2]).all() and (lse[2] < 0).all()
    assert (lse[:2] - want_lse[:2]).abs().max() <= 5e-2


@pytest.mark.parametrize("value", [-math.inf, -10000.0])
def test_additive_masks(target, no_fallback, value):
    q, k, v = bhsd(2, 2, 2, 32, 64, seed=4)
    keep = suffix(2, 64, [64, 20])
    keep[0, ..., 7] = False
    mask = torch.zeros(keep.shape).masked_fill(~keep, value).to(q.dtype)
    out = run(target, q, k, v, mask)
    assert no_fallback["kernel"]
    assert_matches(out, sdpa32(q, k, v, keep))


def test_gqa_and_causal_with_a_key_mask(target, no_fallback):
    q, k, v = bhsd(2, 4, 2, 64, 64, seed=5)
    mask = suffix(2, 64, [64, 45])
    out = run(target, q, k, v, mask, is_causal=True)
    assert no_fallback["kernel"]
    assert_matches(out, sdpa32(q, k, v, mask, is_causal=True))
    per_head = torch.rand(2, 4, 1, 64, generator=torch.Generator().manual_seed(6)) > 0.3
    out = run(target, q, k, v, per_head)
    assert_matches(out, sdpa32(q, k, v, per_head))


def test_bsk_mask_form_in_the_diffusers_backend(target, no_fallback, monkeypatch):
    pytest.importorskip("diffusers")  # .ci/install installs it (the H200 image has none)
    from aiter_sage.integrations import diffusers as aiter_diffusers

    q, k, v = (t.transpose(1, 2) for t in bhsd(2, 2, 2, 32, 48, seed=7))  # [B, S, H, D]
    mask = torch.ones(2, 48, dtype=torch.bool)
    mask[1, 30:] = False
    monkeypatch.setenv("AITER_SAGE_BACKEND", target)
    dq, dk, dv, dm = to_device(target, q, k, v, mask)
    with torch.no_grad():
        out = aiter_diffusers.aiter_sage_attention(dq, dk, dv, attn_mask=dm).cpu()
    assert no_fallback["kernel"]
    want = sdpa32(*(t.transpose(1, 2) for t in (q, k, v)), mask[:, None, None, :])
    assert_matches(out.transpose(1, 2), want)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen(target, no_fallback, causal):
    lens = [1, 31, 32, 33, 1000] if target != "emu" else [1, 31, 32, 33, 200]
    g = torch.Generator().manual_seed(8)
    total = sum(lens)
    q = torch.randn(total, 4, 64, generator=g).bfloat16()
    k = torch.randn(total, 2, 64, generator=g).bfloat16()
    v = torch.randn(total, 2, 64, generator=g).bfloat16()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    dq, dk, dv = to_device(target, q, k, v)
    with torch.no_grad():
        out = aiter_sage.sageattn_varlen(
            dq, dk, dv, cu, cu, max(lens), max(lens), is_causal=causal, backend=target
        ).cpu()
    assert no_fallback["kernel"] and out.shape == q.shape
    for i, n in enumerate(lens):
        a, b = int(cu[i]), int(cu[i + 1])
        want = sdpa32(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), is_causal=causal)
        got = out[a:b].transpose(0, 1)[None]
        if n >= 32:
            assert_matches(got, want)
        else:  # too few elements for the band's 0.5 % rule: every element inside atol/rtol
            err = (got.float() - want).abs()
            assert (err <= ref.BAND["atol"] + ref.BAND["rtol"] * want.abs()).all(), n


@pytest.mark.parametrize(
    "mask,error,says",
    [
        (torch.ones(2, 1, 1, 48, dtype=torch.int32), TypeError, "dtype torch.int32"),
        (torch.ones(2, 1, 1, 47, dtype=torch.bool), ValueError, "does not broadcast"),
        (torch.ones(3, 1, 1, 48, dtype=torch.bool), ValueError, "does not broadcast"),
        ("not a mask", TypeError, "not a tensor"),
    ],
)
def test_bad_masks_are_refused_naming_the_problem(mask, error, says):
    q, k, v = bhsd(2, 2, 2, 32, 48, seed=9)
    with pytest.raises(error, match=says):
        aiter_sage.sageattn(q, k, v, attn_mask=mask)


def test_mask_on_another_device_is_refused():
    q, k, v = bhsd(2, 2, 2, 32, 48, seed=10)
    with pytest.raises(ValueError, match="device"):
        aiter_sage.sageattn(q, k, v, attn_mask=torch.ones(2, 1, 1, 48, device="meta").bool())


if __name__ == "__main__":
    run_as_script(__file__)
