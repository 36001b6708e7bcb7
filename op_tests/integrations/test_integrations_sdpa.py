"""aiter_sage.sageattn (SageAttention's API), aiter_sage.sdpa (the SDPA drop-in) and
aiter_sage.route_sdpa: eligible calls against torch's FP32 SDPA / logsumexp in the band, every
other call equal to torch SDPA (and the same errors), one log line per fallback reason,
patching and restoring F.scaled_dot_product_attention, and torch.compile(fullgraph=True)."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F

import aiter_sage
from aiter_sage import ref
from aiter_sage.integrations import router

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import run_as_script

TORCH_SDPA = torch._C._nn.scaled_dot_product_attention


def bhsd(b, hq, hkv, sq, skv, d, dtype=torch.bfloat16, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((b, hq, sq, d), generator=g).to(dtype)
    k = torch.randn((b, hkv, skv, d), generator=g).to(dtype)
    v = torch.randn((b, hkv, skv, d), generator=g).to(dtype)
    return q, k, v


def truth(q, k, v, *, is_causal=False, scale=None):
    gqa = q.shape[1] != k.shape[1]
    q, k, v = (t.float() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)
    return out, router.torch_lse(q, k, scale=scale, is_causal=is_causal)


def assert_band(out, want):
    acc = ref.accuracy(out, want)
    assert not ref.band_failures(acc), (ref.band_failures(acc), acc)


class Lines(logging.Handler):
    """Collects the aiter_sage logger's lines (it does not propagate to the root logger)."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines():
    router._logged.clear()
    h = Lines()
    router.logger.addHandler(h)
    yield h.lines
    router.logger.removeHandler(h)


# ------------------------------------------------------------------------------------ sageattn
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize(
    "hq,hkv,sq,skv,d,causal",
    [(2, 2, 96, 96, 64, False), (4, 2, 70, 130, 128, True), (4, 1, 40, 40, 72, False)],
)
def test_sageattn_matches_fp32(layout, hq, hkv, sq, skv, d, causal):
    q, k, v = bhsd(1, hq, hkv, sq, skv, d, seed=sq)
    want, want_lse = truth(q, k, v, is_causal=causal)
    args = (q, k, v) if layout == "HND" else tuple(t.transpose(1, 2) for t in (q, k, v))
    with torch.no_grad():
        out, lse = aiter_sage.sageattn(
            *args, tensor_layout=layout, is_causal=causal, return_lse=True
        )
        plain = aiter_sage.sageattn(*args, tensor_layout=layout, is_causal=causal)
    if layout == "NHD":
        out, plain = out.transpose(1, 2), plain.transpose(1, 2)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (1, hq, sq)
    assert_band(out, want)
    assert torch.equal(plain, out.contiguous()) or not ref.band_failures(ref.accuracy(plain, want))
    # INT8 scores move the LSE by a few 1e-3, up to ~3e-2 on the first causal rows (one or two
    # keys); natural log, of the unsmoothed scores.
    assert (lse - want_lse).abs().max() <= 5e-2


def test_sageattn_lse_is_of_unsmoothed_scores():
    """Keys with a large common offset: with smooth_k the LSE still includes the offset's term
    (what ring attention merges partial results with)."""
    q, k, v = bhsd(1, 2, 2, 64, 64, 64, seed=3)
    k = (k.float() + 4 * torch.randn(64, generator=torch.Generator().manual_seed(1))).bfloat16()
    _, want_lse = truth(q, k, v)
    with torch.no_grad():
        _, lse = aiter_sage.sageattn(q, k, v, return_lse=True, smooth_k=True)
    assert (lse - want_lse).abs().max() <= 5e-2


def test_sageattn_scale_and_kwargs():
    q, k, v = bhsd(1, 2, 2, 48, 48, 64, seed=4)
    want, _ = truth(q, k, v, scale=0.3)
    with torch.no_grad():
        out = aiter_sage.sageattn(q, k, v, sm_scale=0.3, qk_quant_gran="per_warp", smooth_v=False)
    assert_band(out, want)
    with pytest.raises(ValueError, match="layout"):
        aiter_sage.sageattn(q, k, v, tensor_layout="BSHD")


def _mask(sq, skv, kind):
    g = torch.Generator().manual_seed(11)
    keep = torch.rand((sq, skv), generator=g) > 0.3
    keep[:, 0] = True
    if kind == "bool":
        return keep
    return torch.where(keep, 0.0, -1e4).to(torch.bfloat16) + 0.1 * torch.rand(
        (sq, skv), generator=g
    ).to(torch.bfloat16)


@pytest.mark.parametrize(
    "case",
    ["bool_mask", "float_mask", "fp32", "d160", "d36", "meta_device", "dropout"],
)
def test_sageattn_fallbacks_equal_sdpa(case, log_lines):
    q, k, v = bhsd(1, 4, 2, 40, 56, 64, seed=5)
    kw, sdpa_kw = {}, {}
    if case in ("bool_mask", "float_mask"):
        kw["attn_mask"] = sdpa_kw["attn_mask"] = _mask(40, 56, case.split("_")[0])
    elif case == "fp32":
        q, k, v = (t.float() for t in (q, k, v))
    elif case == "d160":
        q, k, v = bhsd(1, 4, 2, 40, 56, 160, seed=5)
    elif case == "d36":
        q, k, v = bhsd(1, 4, 2, 40, 56, 36, seed=5)
    elif case == "meta_device":
        q, k, v = (t.to("meta") for t in (q, k, v))
    elif case == "dropout":
        kw["dropout_p"] = sdpa_kw["dropout_p"] = 0.25
    torch.manual_seed(0)
    want = TORCH_SDPA(q, k, v, enable_gqa=True, **sdpa_kw)
    for _ in range(2):
        torch.manual_seed(0)
        out, lse = aiter_sage.sageattn(q, k, v, return_lse=True, **kw)
        if case == "meta_device":
            assert out.device.type == "meta" and lse.shape == (1, 4, 40)
            continue
        assert torch.equal(out, want)
        mask = kw.get("attn_mask")
        assert torch.allclose(lse, router.torch_lse(q, k, attn_mask=mask), atol=1e-5, rtol=0)
        if mask is not None:
            s = (q.float() @ k.float().repeat_interleave(2, 1).transpose(-1, -2)) / 8
            s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.float()
            assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-4)
    assert len(log_lines) == 1, log_lines  # one line per distinct reason, not per call


# ---------------------------------------------------------------------------------------- sdpa
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_eligible_runs_the_kernels(causal):
    q, k, v = bhsd(2, 4, 2, 50, 80, 64, seed=6)
    with torch.no_grad():
        out = aiter_sage.sdpa(q, k, v, is_causal=causal, enable_gqa=True)
        kern = aiter_sage.gfx1201_sage_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal, smooth_k=True,
            q_scale_rows=16,  # router.ROUTED_Q_SCALE_ROWS: every routed call's
        )  # fmt: skip
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(out, kern.transpose(1, 2))
    assert_band(out, truth(q, k, v, is_causal=causal)[0])


def test_sdpa_fallbacks_and_errors_match_torch(log_lines):
    q, k, v = bhsd(1, 4, 4, 30, 30, 64, seed=7)
    mask = _mask(30, 30, "bool")
    # A mask, and grad: torch's result exactly (and autograd works).
    assert torch.equal(aiter_sage.sdpa(q, k, v, attn_mask=mask), TORCH_SDPA(q, k, v, mask))
    qg = q.float().requires_grad_()
    aiter_sage.sdpa(qg, k.float(), v.float()).sum().backward()
    assert qg.grad is not None
    # What torch does with mask + causal, or head counts that do not fit, is done unchanged:
    # the same result or the same exception.
    for args, kw in [
        ((q, k, v), dict(attn_mask=mask, is_causal=True)),
        ((q, k[:, :2], v[:, :2]), {}),
        ((q, k[:, :3], v[:, :3]), dict(enable_gqa=True)),
    ]:
        try:
            want = TORCH_SDPA(*args, **kw)
        except Exception as e:  # noqa: BLE001 - whatever torch raises
            with pytest.raises(type(e)):
                aiter_sage.sdpa(*args, **kw)
        else:
            assert torch.equal(aiter_sage.sdpa(*args, **kw), want)
    # 3-D inputs (allowed by SDPA) go to torch.
    q3, k3, v3 = (t[0] for t in (q, k, v))
    assert torch.equal(aiter_sage.sdpa(q3, k3, v3), TORCH_SDPA(q3, k3, v3))
    assert len(log_lines) == len(set(log_lines))


def test_route_sdpa_patches_restores_and_nests():
    original = F.scaled_dot_product_attention
    q, k, v = bhsd(1, 2, 2, 32, 32, 64, seed=8)
    with aiter_sage.route_sdpa():
        assert F.scaled_dot_product_attention is aiter_sage.sdpa
        with aiter_sage.route_sdpa():
            assert F.scaled_dot_product_attention is aiter_sage.sdpa
        assert F.scaled_dot_product_attention is aiter_sage.sdpa
        # a fallback inside the patch reaches torch's function, not itself
        mask = _mask(32, 32, "bool")
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, mask), TORCH_SDPA(q, k, v, mask))
    assert F.scaled_dot_product_attention is original
    with pytest.raises(RuntimeError, match="boom"):
        with aiter_sage.route_sdpa():
            raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is original


class TinyAttention(torch.nn.Module):
    def __init__(self, dim=128, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out(o.transpose(1, 2).reshape(b, s, -1))


def test_route_sdpa_on_a_model_and_compiled():
    torch.manual_seed(0)
    model = TinyAttention().to(torch.bfloat16).eval()
    x = torch.randn(1, 64, 128).to(torch.bfloat16)
    with torch.no_grad():
        native = model(x)
        with aiter_sage.route_sdpa():
            routed = model(x)
            compiled = torch.compile(model, fullgraph=True)(x)
    acc = ref.accuracy(routed, native)
    assert acc["cosine"] >= 0.999, acc
    assert torch.equal(compiled, routed)


def test_compile_fullgraph_sdpa_and_sageattn():
    q, k, v = bhsd(1, 4, 2, 40, 40, 64, seed=9)
    mask = _mask(40, 40, "bool")

    def f(q, k, v):
        a = aiter_sage.sdpa(q, k, v, is_causal=True, enable_gqa=True)
        b, lse = aiter_sage.sageattn(q, k, v, return_lse=True)
        c = aiter_sage.sdpa(q, k, v, attn_mask=mask, enable_gqa=True)  # -> torch SDPA
        d = aiter_sage.sageattn(q.float(), k.float(), v.float(), return_lse=True)  # -> SDPA
        return a, b, lse, c, *d

    with torch.no_grad():
        eager = f(q, k, v)
        compiled = torch.compile(f, fullgraph=True)(q, k, v)
    for e, c in zip(eager, compiled):
        assert torch.allclose(e.float(), c.float(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------- keyword rules: nothing dropped unread
def test_sageattn_reads_flash_attn_names():
    """yunchang's ring/Ulysses paths pass flash-attn's causal= and softmax_scale=: they are
    is_causal and sm_scale (they used to fall into **kwargs and run non-causal, rel L2 0.88)."""
    q, k, v = bhsd(1, 2, 2, 80, 80, 64, seed=21)
    want, want_lse = truth(q, k, v, is_causal=True, scale=0.2)
    with torch.no_grad():
        out, lse = aiter_sage.sageattn(
            q, k, v, tensor_layout="HND", causal=True, softmax_scale=0.2, return_lse=True
        )
        named = aiter_sage.sageattn(q, k, v, is_causal=True, sm_scale=0.2)
    assert_band(out, want)
    assert torch.equal(out, named)
    assert (lse - want_lse).abs().max() <= 5e-2
    # The shim's per-kernel names follow the same rules.
    with torch.no_grad():
        kw = router.sageattn_keywords(q, k, v, causal=True, softmax_scale=0.2)
    assert torch.equal(kw, named)


@pytest.mark.parametrize(
    "kw",
    [
        dict(is_causal=True, causal=True),
        dict(is_causal=False, causal=True),
        dict(sm_scale=0.2, softmax_scale=0.2),
    ],
)
def test_sageattn_alias_beside_its_name_is_a_type_error(kw):
    q, k, v = bhsd(1, 2, 2, 32, 32, 64, seed=22)
    with pytest.raises(TypeError, match="and its alias"):
        aiter_sage.sageattn(q, k, v, **kw)
    with pytest.raises(TypeError, match="and its alias"):  # positional is_causal, too
        aiter_sage.sageattn(q, k, v, "HND", True, causal=True)


def test_unknown_keywords_are_type_errors_everywhere():
    q, k, v = bhsd(1, 2, 2, 32, 32, 64, seed=23)
    with pytest.raises(TypeError, match="'windo_size'"):
        aiter_sage.sageattn(q, k, v, windo_size=(-1, -1))
    with pytest.raises(TypeError, match="'windo_size'"):
        router.sageattn_keywords(q, k, v, windo_size=(-1, -1))
    with pytest.raises(TypeError, match="'windo_size'"):
        aiter_sage.sdpa(q, k, v, windo_size=(-1, -1))
    # A mask makes the call fall back to SDPA: the keyword is still refused, not dropped.
    with pytest.raises(TypeError, match="'foo'"):
        aiter_sage.sageattn(q, k, v, attn_mask=_mask(32, 32, "bool"), foo=1)
    # SageAttention's tuning keywords are accepted and ignored: the same result as without.
    with torch.no_grad():
        plain = aiter_sage.sageattn(q, k, v)
        tuned = aiter_sage.sageattn(
            q, k, v, **{name: "x" for name in router.SAGEATTN_TUNING_KEYWORDS}
        )
    assert torch.equal(plain, tuned)


def test_sdpa_reads_aliases_and_refuses_both():
    q, k, v = bhsd(1, 2, 2, 48, 48, 64, seed=24)
    with torch.no_grad():
        named = aiter_sage.sdpa(q, k, v, is_causal=True, scale=0.3)
        alias = aiter_sage.sdpa(q, k, v, causal=True, softmax_scale=0.3)
    assert torch.equal(named, alias)
    assert_band(alias, truth(q, k, v, is_causal=True, scale=0.3)[0])
    with pytest.raises(TypeError, match="and its alias"):
        aiter_sage.sdpa(q, k, v, scale=0.3, sm_scale=0.3)


# --------------------------------------------------------- backend names: unknown ones raise
@pytest.mark.parametrize("entry", ["sageattn", "sdpa", "sageattn_masked", "sdpa_masked"])
def test_unknown_backend_name_raises_in_the_integrations(entry, monkeypatch):
    """backend="bogus" (or AITER_SAGE_BACKEND=bogus) used to run torch SDPA with an INFO line;
    like the ops, the integrations raise ValueError, also for a call that falls back anyway."""
    q, k, v = bhsd(1, 2, 2, 32, 32, 64, seed=25)
    fn = aiter_sage.sageattn if entry.startswith("sageattn") else aiter_sage.sdpa
    kw = dict(attn_mask=_mask(32, 32, "bool")) if entry.endswith("masked") else {}
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        fn(q, k, v, backend="bogus", **kw)
    monkeypatch.setenv("AITER_SAGE_BACKEND", "bogus")
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        fn(q, k, v, **kw)


@pytest.mark.parametrize("name", ["gfx12", "cuda"])
def test_backend_that_cannot_serve_the_device_raises_naming_it(name):
    q, k, v = bhsd(1, 2, 2, 32, 32, 64, seed=26)
    for fn in (aiter_sage.sageattn, aiter_sage.sdpa):
        with pytest.raises(ValueError, match=rf"backend '{name}' cannot serve these cpu tensors"):
            fn(q, k, v, backend=name)


def test_backend_names_are_normalised_in_the_integrations():
    q, k, v = bhsd(1, 2, 2, 32, 32, 64, seed=27)
    with torch.no_grad():
        want = aiter_sage.sageattn(q, k, v, backend="cpu")
        assert torch.equal(aiter_sage.sageattn(q, k, v, backend=" CPU "), want)
        assert torch.equal(aiter_sage.sdpa(q, k, v, backend="Cpu"), aiter_sage.sdpa(q, k, v))


# ------------------------------------------------------------- layouts, strides, GQA, grads
def test_last_dim_stride_two_inputs_are_served_correctly():
    """Every other channel of a wider tensor: last-dim stride 2 (copied for the kernels)."""
    g = torch.Generator().manual_seed(28)
    wide = [torch.randn(1, 2, 40, 128, generator=g).bfloat16() for _ in range(3)]
    q, k, v = (t[..., ::2] for t in wide)
    assert q.stride(-1) == 2
    want = truth(q, k, v)[0]
    with torch.no_grad():
        assert_band(aiter_sage.sdpa(q, k, v), want)
        assert_band(aiter_sage.sageattn(q, k, v), want)
        nhd = aiter_sage.sageattn(*(t.transpose(1, 2) for t in (q, k, v)), tensor_layout="NHD")
    assert_band(nhd.transpose(1, 2), want)


def test_nhd_fallback_with_lse_returns_nhd_output():
    q, k, v = bhsd(1, 4, 4, 36, 52, 64, seed=29)
    mask = _mask(36, 52, "bool")
    with torch.no_grad():
        out, lse = aiter_sage.sageattn(
            *(t.transpose(1, 2) for t in (q, k, v)),
            tensor_layout="NHD",
            attn_mask=mask,
            return_lse=True,
        )
    assert out.shape == (1, 36, 4, 64) and lse.shape == (1, 4, 36)
    assert torch.equal(out.transpose(1, 2), TORCH_SDPA(q, k, v, mask))
    assert torch.allclose(lse, router.torch_lse(q, k, attn_mask=mask), atol=1e-5)


def test_nhd_gqa_with_equal_lengths():
    """Sq == Skv with fewer key/value heads: the head axis of NHD is read as heads (not as
    the sequence)."""
    q, k, v = bhsd(1, 4, 2, 64, 64, 64, seed=30)
    with torch.no_grad():
        out = aiter_sage.sageattn(*(t.transpose(1, 2) for t in (q, k, v)), tensor_layout="NHD")
    assert out.shape == (1, 64, 4, 64)
    assert_band(out.transpose(1, 2), truth(q, k, v)[0])


def test_sdpa_gradient_flows_through_the_fallback():
    """BF16 inputs that require grad are not the kernels' (inference-only): torch SDPA runs,
    and its gradient reaches the inputs, equal to torch's own."""
    q, k, v = bhsd(1, 2, 2, 32, 32, 64, seed=31)
    qa, qb = q.clone().requires_grad_(), q.clone().requires_grad_()
    aiter_sage.sdpa(qa, k, v).float().sum().backward()
    TORCH_SDPA(qb, k, v).float().sum().backward()
    assert qa.grad is not None and torch.equal(qa.grad, qb.grad)


if __name__ == "__main__":
    run_as_script(__file__)
