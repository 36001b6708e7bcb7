"""gfx1201_sage_prepare: bit-exact against aiter_sage.ref on every backend present."""

import pytest
import torch
from common import (BACKENDS, backend_params, device_for, norm_weights, qkv, randn_bshd,
                    rope_tables, run_as_script, skip_if_too_big)

import aiter_sage
from aiter_sage import ref

FIELDS = ("q8", "q_scale", "k8", "k_scale", "v8", "v_scale")


def assert_prepared_equal(got: ref.Prepared, want: ref.Prepared) -> None:
    assert (got.q_len, got.kv_len) == (want.q_len, want.kv_len)
    for name in FIELDS:
        g, w = getattr(got, name).cpu(), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape, w.shape)
        if name == "v8":  # compare bits: NaN-free but -0 must match too
            g, w = ref.fp8_bits(g), ref.fp8_bits(w)
        diff = (g.view(torch.int8) != w.view(torch.int8)) if g.element_size() == 1 else \
            (g.view(torch.int32) != w.view(torch.int32))
        assert not diff.any(), f"{name}: {int(diff.sum())} of {diff.numel()} elements differ"


def run_both(backend, q, k, v, scale, **kw):
    dev = device_for(backend)
    kw_dev = {n: (t.to(dev) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    got = aiter_sage.gfx1201_sage_prepare(q.to(dev), k.to(dev), v.to(dev), scale,
                                          backend=backend, **kw_dev)
    return got, ref.prepare(q, k, v, scale, **kw)


SHAPES = [  # (B, Sq, Skv, H)
    (1, 1, 1, 1),
    (1, 32, 32, 1),
    (2, 200, 200, 2),  # tail: not a multiple of 32 or of the 128 pad
    (1, 257, 31, 2),  # q_len != kv_len, both with tails
    (1, 512, 512, 2),
    (2, 1000, 1000, 3),
]


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("b,sq,skv,h", SHAPES)
def test_prepare_bit_exact(backend, b, sq, skv, h):
    skip_if_too_big(backend, sq, skv, heads=h, batch=b)
    q, k, v = qkv(b, sq, skv, h, seed=sq + 7 * h)
    got, want = run_both(backend, q, k, v, 128 ** -0.5)
    assert_prepared_equal(got, want)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("rope_dim", [32, 64, 96, 128])
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "norm+rope"])
def test_prepare_norm_rope_bit_exact(backend, rope_dim, norm):
    b, s, h = 2, 200, 2
    q, k, v = qkv(b, s, s, h, seed=rope_dim)
    cos, sin = rope_tables(s, rope_dim)
    kw = dict(rope_cos=cos, rope_sin=sin)
    if norm:
        kw.update(zip(("q_norm_weight", "k_norm_weight"), norm_weights()), norm_eps=1e-6)
    got, want = run_both(backend, q, k, v, 0.1, **kw)
    assert_prepared_equal(got, want)


@pytest.mark.parametrize("backend", backend_params())
def test_prepare_norm_only_bit_exact(backend):
    q, k, v = qkv(1, 160, 160, 2, seed=3)
    qw, kw_ = norm_weights(11)
    got, want = run_both(backend, q, k, v, 0.09, q_norm_weight=qw, k_norm_weight=kw_,
                         norm_eps=1e-5)
    assert_prepared_equal(got, want)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("rope_dim", [32, 64, 96, 128])
def test_fused_equals_unfused(backend, rope_dim):
    """Fused norm+rope == eager BF16 rmsnorm, rope, then plain prepare, bit for bit."""
    b, s, h = 1, 96, 2
    q, k, v = qkv(b, s, s, h, seed=100 + rope_dim)
    cos, sin = rope_tables(s, rope_dim)
    qw, kw_ = norm_weights()
    dev = device_for(backend)
    fused = aiter_sage.gfx1201_sage_prepare(
        q.to(dev), k.to(dev), v.to(dev), 0.125, q_norm_weight=qw.to(dev), k_norm_weight=kw_.to(dev),
        rope_cos=cos.to(dev), rope_sin=sin.to(dev), backend=backend)
    qn = ref.rope(ref.rmsnorm(q, qw, 1e-6), cos, sin, rope_dim)
    kn = ref.rope(ref.rmsnorm(k, kw_, 1e-6), cos, sin, rope_dim)
    unfused = aiter_sage.gfx1201_sage_prepare(qn.to(dev), kn.to(dev), v.to(dev), 0.125,
                                              backend=backend)
    assert_prepared_equal(fused, ref.Prepared(*[t.cpu() for t in unfused[:6]], *unfused[6:]))


@pytest.mark.parametrize("backend", backend_params())
def test_prepare_zero_blocks(backend):
    q, k, v = qkv(1, 100, 100, 2, seed=5)
    q[:, 32:64] = 0  # one all-zero Q block
    k[:, :, 1] = 0  # one all-zero K head
    v[..., 5] = 0  # one all-zero V channel
    got, want = run_both(backend, q, k, v, 128 ** -0.5)
    assert_prepared_equal(got, want)
    assert torch.all(got.q_scale[0, :, 1].cpu() == 1) and not got.q8[0, :, 32:64].any()
    assert torch.all(got.v_scale[0, :, 5].cpu() == 1)
    for t in (got.q_scale, got.k_scale, got.v_scale):
        assert torch.isfinite(t).all()
    zeros = [torch.zeros_like(x) for x in (q, k, v)]
    got, want = run_both(backend, *zeros, 1.0)
    assert_prepared_equal(got, want)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("magnitude", [1e-30, 1e4, 1e30])
def test_prepare_large_and_tiny_magnitudes(backend, magnitude):
    q = randn_bshd(1, 64, 1, seed=1, scale=magnitude)
    k = randn_bshd(1, 64, 1, seed=2, scale=magnitude)
    v = randn_bshd(1, 64, 1, seed=3, scale=magnitude)
    got, want = run_both(backend, q, k, v, 128 ** -0.5)
    assert_prepared_equal(got, want)
    assert not ref.e4m3_decode(ref.fp8_bits(got.v8.cpu())).isnan().any()


@pytest.mark.parametrize("backend", backend_params())
def test_prepare_strided_inputs(backend):
    """Views of a packed QKV projection and of a head-major tensor: same bits as contiguous."""
    b, s, h = 2, 130, 2
    qkv_packed = randn_bshd(b, s, 3 * h, seed=9).view(b, s, 3, h, 128)
    q, k = qkv_packed[:, :, 0], qkv_packed[:, :, 1]
    v = randn_bshd(b, h, s, seed=10).transpose(1, 2)  # [B, S, H, D] view of [B, H, S, D]
    assert not q.is_contiguous() and not v.is_contiguous()
    got, want = run_both(backend, q, k, v, 0.088)
    assert_prepared_equal(got, want)


def test_ref_fp8_encoder_matches_torch():
    """The reference's bit-level e4m3 encoder agrees with torch's float8_e4m3fn converter."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(200000, generator=g) * s for s in (1e-3, 1.0, 100.0)])
    codes = torch.arange(256, dtype=torch.uint8)
    vals = ref.e4m3_decode(codes)
    vals = vals[~vals.isnan()]
    mids = (vals[:-1] + vals[1:]) / 2  # exact ties between neighbouring codes
    srt = vals.sort().values
    ties = (srt[:-1] + srt[1:]) / 2
    x = torch.cat([x, vals, ties, ties.nextafter(torch.tensor(float("inf"))), mids,
                   torch.tensor([448.0, 460.0, 464.0, 1e9, -1e9, 2.0 ** -10, 0.0, -0.0])])
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ref.e4m3_encode_sat(x), want)
    assert torch.equal(ref.e4m3_decode(codes).nan_to_num(7.0),
                       codes.view(torch.float8_e4m3fn).float().nan_to_num(7.0))


def test_ref_rope_is_eager_bf16():
    """ref.rope is the plain eager BF16 expression x*cos + rotate_half(x)*sin."""
    x = randn_bshd(1, 50, 2, seed=4)
    cos, sin = rope_tables(50, 128)
    x1, x2 = x[..., :64], x[..., 64:]
    eager = x * cos[None, :, None] + torch.cat([-x2, x1], -1) * sin[None, :, None]
    assert torch.equal(ref.rope(x, cos, sin, 128), eager)


def test_ref_rmsnorm_close_to_torch_rms_norm():
    """Pinned reduction order changes at most one BF16 ulp against torch's own rms_norm."""
    x = randn_bshd(2, 64, 4, seed=6)
    w, _ = norm_weights()
    ours = ref.rmsnorm(x, w, 1e-6).float()
    theirs = (torch.nn.functional.rms_norm(x.float(), (128,), eps=1e-6).to(torch.bfloat16) * w).float()
    ulp = (theirs.abs() * 2.0 ** -7).clamp_min(2.0 ** -126)
    assert ((ours - theirs).abs() <= 2 * ulp).all()
    assert (ours == theirs).float().mean() > 0.99


if __name__ == "__main__":
    run_as_script(__file__)
