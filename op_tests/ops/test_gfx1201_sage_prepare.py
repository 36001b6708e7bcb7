"""gfx1201_sage_prepare: bit-exact against aiter_sage.ref on every backend present, with
upstream ROCm aiter's test cases and call forms; ref itself checked against upstream's
formulas written out independently below."""

import functools

import pytest
import torch
import torch.nn.functional as F

import aiter_sage
from aiter_sage import ref

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import (
    backend_params,
    every_16_bit_value,
    norm_weights,
    qkv,
    randn_bshd,
    rope_tables,
    run_as_script,
    skip_no_hardware,
    to_device,
)

FIELDS = ref.Prepared._fields  # q_int8, q_scale, k_int8, k_scale, v_fp8, v_scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.cpu()
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_prepared_equal(got, want) -> None:
    """Same dtypes, shapes and bits (NaN payloads and -0 included)."""
    assert len(got) == 6 and len(want) == 6
    for name, g, w in zip(FIELDS, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape, w.dtype, w.shape)
        diff = _bits(g) != _bits(w)
        assert not diff.any(), f"{name}: {int(diff.sum())} of {diff.numel()} elements differ"


# ---- upstream's inputs --------------------------------------------------------------------
def upstream_quant_inputs(b, s, h, seed):
    """randn*3; K head 0 times 1e-38 (BF16 denormals, whole blocks of them), K channel 0 too;
    V channel 5 all zero; Q rows 32-63 zero (an all-zero block) when S > 64."""
    q, k, v = (randn_bshd(b, s, h, seed=seed + i, scale=3.0) for i in range(3))
    k[:, :, 0] *= 1e-38
    k[..., 0] *= 1e-38
    v[..., 5] = 0
    if s > 64:
        q[:, 32:64] = 0
    return q, k, v


@functools.lru_cache(maxsize=None)
def _reference(key):
    """ref.prepare of one case, shared by the backends (ref is the slow part at 20000 x 56)."""
    kind, b, s, h, extra, q_scale_rows = key
    if kind == "quant":
        q, k, v = upstream_quant_inputs(b, s, h, seed=s + h)
        return (q, k, v), (), ref.prepare(q, k, v, q_scale_rows=q_scale_rows)
    rope_dim = extra
    q, k, v = (randn_bshd(1, s, h, seed=s + i, scale=3.0) for i in range(3))
    qw, kw = norm_weights(s)
    cos, sin = rope_tables(s, rope_dim)
    fused = (qw, kw, cos, sin)
    return (q, k, v), fused, ref.prepare(q, k, v, None, *fused, 1e-5, q_scale_rows=q_scale_rows)


QUANT_CASES = [(1, 1, 1), (1, 33, 7), (2, 513, 14), (1, 4097, 28), (2, 2000, 3), (1, 20000, 56)]


def _with_q_scale_rows(cases, fine):
    """Every case at upstream's 32-row Q scales, and the cases `fine` at q_scale_rows=16."""
    return [pytest.param(*c, 32, id=str(c)) for c in cases] + [
        pytest.param(*c, 16, id=f"{c}-q16") for c in cases if c in fine
    ]


# q_scale_rows=16 on all but the largest (its reference alone takes half a minute).
@pytest.mark.parametrize("b,s,h,q_scale_rows", _with_q_scale_rows(QUANT_CASES, QUANT_CASES[:-1]))
@pytest.mark.parametrize("backend", backend_params())
def test_prepare_upstream_quant_cases(backend, b, s, h, q_scale_rows):
    (q, k, v), _, want = _reference(("quant", b, s, h, None, q_scale_rows))
    kw = {} if q_scale_rows == 32 else dict(q_scale_rows=q_scale_rows)  # upstream's call
    got = aiter_sage.gfx1201_sage_prepare(*to_device(backend, q, k, v), backend=backend, **kw)
    assert_prepared_equal(got, want)


NORM_ROPE_CASES = [(33, 7, 96), (4097, 28, 96), (513, 14, 128), (1000, 5, 64), (300, 3, 32)]


@pytest.mark.parametrize(
    "s,h,rope_dim,q_scale_rows",
    _with_q_scale_rows(NORM_ROPE_CASES, [c for c in NORM_ROPE_CASES if c[0] < 4097]),
)
@pytest.mark.parametrize("backend", backend_params())
def test_prepare_upstream_norm_rope_cases(backend, s, h, rope_dim, q_scale_rows):
    """Upstream's positional call: (q, k, v, None, qw, kw, cosine, sine, 1e-5)."""
    (q, k, v), fused, want = _reference(("norm_rope", 1, s, h, rope_dim, q_scale_rows))
    kw = {} if q_scale_rows == 32 else dict(q_scale_rows=q_scale_rows)
    got = aiter_sage.gfx1201_sage_prepare(
        *to_device(backend, q, k, v), None, *to_device(backend, *fused), 1e-5, backend=backend, **kw
    )
    assert_prepared_equal(got, want)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("d,dtype", [(128, torch.bfloat16), (64, torch.float16)])
def test_prepare_q_scale_rows_16_halves(backend, d, dtype):
    """q_scale_rows=16: Q gets one scale per 16 rows, [B, Hq, Sq_pad / 16], each the 32-row
    rule over its 16 rows; K and V do not change. Blocks whose halves differ (one loud row in
    the first or the second half, a zero half, a half past q_len, NaN in one half) show that
    every half has its own scale and codes: the 32-row block's scale is the larger of its two
    (a NaN one if either is NaN), and the half holding the block's maximum keeps the 32-row
    codes. Bit for bit against ref.prepare (the NaN scale's payload aside, as in
    test_prepare_v_scale_sees_every_key_range)."""
    g = torch.Generator().manual_seed(d)
    s = 150  # Sq_pad 160: five 32-row blocks, the last one's second half past q_len
    q = torch.randn(2, s, 3, d, generator=g)
    k, v = (torch.randn(2, 70, 3, d, generator=g) for _ in range(2))
    q[:, 5] *= 40  # block 0: first half loud
    q[:, 32 + 20] *= 40  # block 1: second half loud
    q[:, 64:80] = 0  # block 2: first half zero
    q[1, 100, 2, 3] = float("nan")  # block 3, batch 1, head 2: second half NaN
    q, k, v = (t.to(dtype) for t in (q, k, v))
    got16 = aiter_sage.gfx1201_sage_prepare(
        *to_device(backend, q, k, v), q_scale_rows=16, backend=backend
    )
    got32 = aiter_sage.gfx1201_sage_prepare(*to_device(backend, q, k, v), backend=backend)
    wants = (ref.prepare(q, k, v, q_scale_rows=16), ref.prepare(q, k, v))
    for got, want in zip((got16, got32), wants):
        assert torch.equal(got.q_scale.cpu().isnan(), want.q_scale.isnan())
        assert_prepared_equal(
            got._replace(q_scale=got.q_scale.cpu().nan_to_num(-1.0)),
            want._replace(q_scale=want.q_scale.nan_to_num(-1.0)),
        )
    assert got16.q_scale.shape == (2, 3, 10) and got32.q_scale.shape == (2, 3, 5)
    for name in ("k_int8", "k_scale", "v_fp8", "v_scale"):
        assert torch.equal(_bits(getattr(got16, name)), _bits(getattr(got32, name))), name
    s16, s32 = got16.q_scale.cpu().view(2, 3, 5, 2), got32.q_scale.cpu()
    nan = s16.isnan().any(-1)
    assert torch.equal(nan, s32.isnan()) and int(nan.sum()) == 1 and nan[1, 2, 3]
    assert torch.equal(s16.amax(-1)[~nan], s32[~nan])
    assert (s16[:, :, 0, 0] > 4 * s16[:, :, 0, 1]).all()  # the loud row's half
    assert (s16[:, :, 1, 1] > 4 * s16[:, :, 1, 0]).all()
    assert (s16[:, :, 2, 0] == 0).all() and (s16[:, :, 2, 1] > 0).all()
    q16, q32 = got16.q_int8.cpu(), got32.q_int8.cpu()
    assert torch.equal(q16[:, :16], q32[:, :16]) and torch.equal(q16[:, 48:64], q32[:, 48:64])
    assert not torch.equal(q16[:, 16:32], q32[:, 16:32])  # the quiet half's finer codes
    assert not q16[:, 64:80].any() and not q16[:, s:].any()


@pytest.mark.parametrize("backend", backend_params())
def test_prepare_shapes_and_padding_are_upstreams(backend):
    q, k, v = qkv(2, 45, 70, 3, seed=1)
    p = aiter_sage.gfx1201_sage_prepare(*to_device(backend, q, k, v), backend=backend)
    assert type(p).__name__ == "Prepared" and p._fields == FIELDS
    assert p.q_int8.shape == (2, 64, 3, 128) and p.q_int8.dtype == torch.int8
    assert p.q_scale.shape == (2, 3, 2) and p.q_scale.dtype == torch.float32
    assert p.k_int8.shape == (2, 96, 3, 128) and p.k_scale.shape == (2, 3, 3)
    assert p.v_fp8.shape == (2, 3, 128, 96) and p.v_fp8.dtype == torch.float8_e4m3fn
    assert p.v_scale.shape == (2, 3, 128)
    assert not p.q_int8[:, 45:].cpu().any() and not p.k_int8[:, 70:].cpu().any()
    assert not _bits(p.v_fp8)[..., 70:].any()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("part", ["norm", "rope"])
def test_prepare_norm_or_rope_alone(backend, part):
    """Each pair is optional here (upstream takes all four together)."""
    s = 200
    q, k, v = qkv(2, s, s, 2, seed=3)
    qw, kw = norm_weights(3)
    cos, sin = rope_tables(s, 64)
    fused = (qw, kw, None, None) if part == "norm" else (None, None, cos, sin)
    got = aiter_sage.gfx1201_sage_prepare(
        *to_device(backend, q, k, v), 0.09, *to_device(backend, *fused), 1e-5, backend=backend
    )
    assert_prepared_equal(got, ref.prepare(q, k, v, 0.09, *fused, 1e-5))


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("sq,skv,hq,hkv,d", [(161, 225, 6, 2, 128), (100, 31, 3, 1, 64)])
def test_prepare_gqa_with_odd_block_counts(backend, sq, skv, hq, hkv, d):
    """Upstream's call with GQA (groups 3) and odd numbers of 32-row blocks (6 Q / 8 K, 4 Q / 1
    K): the GPU qk grid gives the plain BF16 build two blocks per workgroup and deals K blocks
    round robin to a group's query heads (simt/prepare_layout.h qk_block), so a lost, doubled
    or skipped block shows here, bit for bit against ref.prepare."""
    g = torch.Generator().manual_seed(sq)
    q = torch.randn(2, sq, hq, d, generator=g).bfloat16()
    k, v = (torch.randn(2, skv, hkv, d, generator=g).bfloat16() for _ in range(2))
    got = aiter_sage.gfx1201_sage_prepare(*to_device(backend, q, k, v), backend=backend)
    assert_prepared_equal(got, ref.prepare(q, k, v))


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize(
    "d,dtype,part",
    [
        (128, torch.bfloat16, None),
        (96, torch.float16, None),
        (64, torch.bfloat16, None),
        (128, torch.bfloat16, "norm"),
        (128, torch.float16, "rope"),
    ],
)
def test_smooth_k_prepare_over_many_keys(backend, d, dtype, part):
    """smooth_k over 1100 keys (more than two passes of the GPU K mean's slices, 512 rows
    each, and a tail that is not a whole pass), K offset per channel so the mean decides the
    codes: bit for bit against ref.prepare. Without the fused norm the GPU splits a head's K
    mean over channel slices (simt/prepare_layout.h km_*), with it one workgroup takes the
    head; both must keep quant.h's pinned order. D 96 leaves a Dp-128 slice's lanes past D."""
    s, h = 1100, 2
    q, k, v = qkv(1, s, s, h, seed=40 + d)
    q, v = q[..., :d].to(dtype), v[..., :d].to(dtype)
    k = (k[..., :d].float() + torch.linspace(-3, 5, d)).to(dtype)
    fused = (None,) * 4
    if part == "norm":
        fused = (*norm_weights(11), None, None)
    elif part == "rope":
        fused = (None, None, *rope_tables(s, 64))
    got = aiter_sage.gfx1201_sage_prepare(
        *to_device(backend, q, k, v),
        None,
        *to_device(backend, *fused),
        1e-5,
        smooth_k=True,
        backend=backend,
    )
    assert_prepared_equal(got, ref.prepare(q, k, v, None, *fused, 1e-5, smooth_k=True))


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("rope_dim", [32, 64, 96, 128])
def test_fused_equals_unfused(backend, rope_dim):
    """Fused norm+rope == F.rms_norm-style norm, FP32 RoPE, then plain prepare, bit for bit."""
    s = 96
    q, k, v = qkv(1, s, s, 2, seed=100 + rope_dim)
    cos, sin = rope_tables(s, rope_dim)
    qw, kw = norm_weights()
    fused = aiter_sage.gfx1201_sage_prepare(
        *to_device(backend, q, k, v), 0.125, *to_device(backend, qw, kw, cos, sin), backend=backend
    )
    qn = ref.rope(ref.rmsnorm(q, qw, 1e-6), cos, sin, rope_dim)
    kn = ref.rope(ref.rmsnorm(k, kw, 1e-6), cos, sin, rope_dim)
    unfused = aiter_sage.gfx1201_sage_prepare(
        *to_device(backend, qn, kn, v), 0.125, backend=backend
    )
    assert_prepared_equal(fused, unfused)


@pytest.mark.parametrize("backend", backend_params())
def test_bf16_tables_are_upcast_exactly(backend):
    s = 64
    q, k, v = qkv(1, s, s, 2, seed=5)
    cos, sin = (t.to(torch.bfloat16) for t in rope_tables(s, 128))
    got = aiter_sage.gfx1201_sage_prepare(
        *to_device(backend, q, k, v),
        None,
        None,
        None,
        *to_device(backend, cos, sin),
        backend=backend,
    )
    assert_prepared_equal(got, ref.prepare(q, k, v, None, None, None, cos.float(), sin.float()))


@pytest.mark.parametrize("backend", backend_params())
def test_prepare_ties_round_away_from_zero(backend):
    """K blocks with amax 127 have scale 1, so k = n + 0.5 is an exact tie: upstream's codes
    go away from zero (2.5 -> 3, -2.5 -> -3, 0.5 -> 1), where round-half-even would not."""
    q, k, v = qkv(1, 32, 32, 1, seed=14)
    ties = torch.tensor([127.0, 2.5, -2.5, 0.5, -0.5, 1.5, 126.5, -126.5])
    k[0, :, 0, :8] = ties.to(torch.bfloat16)
    got = aiter_sage.gfx1201_sage_prepare(*to_device(backend, q, k, v), backend=backend)
    assert got.k_scale[0, 0, 0].item() == 1.0
    assert got.k_int8[0, 0, 0, :8].cpu().tolist() == [127, 3, -3, 1, -1, 2, 127, -127]
    assert_prepared_equal(got, ref.prepare(q, k, v))


@pytest.mark.parametrize("backend", backend_params())
def test_prepare_zero_blocks_keep_zero_scales(backend):
    """Upstream: an all-zero block has scale 0 and zero codes (not scale 1)."""
    q, k, v = qkv(1, 100, 100, 2, seed=5)
    q[:, 32:64] = 0
    k[:, :, 1] = 0
    v[..., 5] = 0
    got = aiter_sage.gfx1201_sage_prepare(*to_device(backend, q, k, v), backend=backend)
    assert_prepared_equal(got, ref.prepare(q, k, v))
    assert torch.all(got.q_scale[0, :, 1].cpu() == 0) and not got.q_int8[0, 32:64].cpu().any()
    assert torch.all(got.k_scale[0, 1].cpu() == 0) and torch.all(got.v_scale[0, :, 5].cpu() == 0)


@pytest.mark.parametrize("backend", backend_params())
def test_prepare_v_scale_sees_every_key_range(backend):
    """The GPU prepare takes V's channel maxima over SAGE_V_AMAX_SPLITS key ranges in parallel
    and folds them: a channel whose maximum sits at the first key, at either side of a range
    boundary, in a middle range or at the last key, and a NaN at the last key, all give the
    scale of the whole sequence (ref.prepare's amax). The NaN scale's payload is not compared:
    torch's vectorised amax returns 0xffffffff where one maximum pass gives the input's NaN."""
    s = 3000  # ranges of 256 keys: 12 of the 16 hold keys
    q, k, v = qkv(1, s, s, 1, seed=21)
    v = v * 0.01
    keys = (0, 255, 256, 511, 1024, 1791, 2047, 2048, 2815, 2816, s - 1)
    for ch, key in enumerate(keys):
        v[0, key, 0, ch] = 50.0 + ch
    v[0, s - 1, 0, 100] = float("nan")
    got = aiter_sage.gfx1201_sage_prepare(*to_device(backend, q, k, v), backend=backend)
    want = ref.prepare(q, k, v)
    v_scale, want_scale = got.v_scale[0, 0].cpu(), want.v_scale[0, 0]
    assert torch.equal(v_scale.isnan(), want_scale.isnan())
    canonical = {"v_scale": got.v_scale.cpu().nan_to_num(-1.0)}
    assert_prepared_equal(
        got._replace(**canonical), want._replace(v_scale=want.v_scale.nan_to_num(-1.0))
    )
    for ch in range(len(keys)):
        assert v_scale[ch].item() == pytest.approx((50.0 + ch) / 448, rel=1e-6), ch
    assert v_scale[100].isnan() and not v_scale[len(keys) : 100].isnan().any()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("magnitude", [1e-38, 1e-30, 1e4, 1e30])
def test_prepare_large_and_tiny_magnitudes(backend, magnitude):
    q, k, v = (randn_bshd(1, 64, 1, seed=i, scale=magnitude) for i in range(3))
    got = aiter_sage.gfx1201_sage_prepare(*to_device(backend, q, k, v), backend=backend)
    assert_prepared_equal(got, ref.prepare(q, k, v))


def every_finite_value_v(dtype, amaxes, seed):
    """V [1, S, len(amaxes), 128] whose head h holds every finite value of `dtype` of magnitude
    <= amaxes[h] once (shuffled), key 0 = amaxes[h] in every channel, zeros after."""
    every = every_16_bit_value(dtype)
    heads = []
    for h, amax in enumerate(amaxes):
        vals = every[every.abs() <= amax]  # NaN and inf compare false
        g = torch.Generator().manual_seed(seed + h)
        heads.append(
            torch.cat([torch.full((128,), amax), vals[torch.randperm(len(vals), generator=g)]])
        )
    keys = -(-max(len(x) for x in heads) // 128)
    v = torch.zeros(len(amaxes), keys * 128)
    for h, x in enumerate(heads):
        v[h, : len(x)] = x
    return v.view(len(amaxes), keys, 128).transpose(0, 1)[None].contiguous().to(dtype)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prepare_v_codes_of_every_16_bit_value(backend, dtype):
    """Every finite BF16 / FP16 value up to a channel's maximum, for a few maxima: V's e4m3
    codes and scales are ref.prepare's. The formats hold each e4m3 midpoint exactly, so v / s
    lands on or within an ulp of one (where the division's last bit and the ties decide the
    code); the e4m3 subnormals, signed zeros and saturation at 448 are there too. The BF16
    maximum 1e-35 gives a scale near FP32's smallest normal."""
    amaxes = (448.0, 3.0, 0.0123, 1e-35 if dtype == torch.bfloat16 else 6e-5)
    v = every_finite_value_v(dtype, amaxes, seed=30)
    s = v.shape[1]
    q = randn_bshd(1, s, len(amaxes), seed=31).to(dtype)
    k = randn_bshd(1, s, len(amaxes), seed=32).to(dtype)
    got = aiter_sage.gfx1201_sage_prepare(*to_device(backend, q, k, v), backend=backend)
    assert_prepared_equal(got, ref.prepare(q, k, v))


@pytest.mark.parametrize("backend", backend_params())
def test_prepare_strided_and_misaligned_inputs(backend):
    """Views of a packed QKV projection, a head-major tensor and an odd storage offset: the
    same bits as contiguous copies (a GPU-style backend copies what it cannot load)."""
    b, s, h = 2, 130, 2
    packed = randn_bshd(b, s, 3 * h, seed=9).view(b, s, 3, h, 128)
    q, k = packed[:, :, 0], packed[:, :, 1]
    v = randn_bshd(b, h, s, seed=10).transpose(1, 2)
    flat = randn_bshd(1, 1, 1, seed=11).new_zeros(b * s * h * 128 + 1)
    flat[1:] = randn_bshd(b, s, h, seed=12).flatten()
    odd = flat[1:].view(b, s, h, 128)  # 2-byte offset: not 16-byte aligned
    assert not q.is_contiguous() and not v.is_contiguous() and odd.data_ptr() % 16
    got = aiter_sage.gfx1201_sage_prepare(*to_device(backend, q, k, v), 0.088, backend=backend)
    assert_prepared_equal(got, ref.prepare(q, k, v, 0.088))
    got = aiter_sage.gfx1201_sage_prepare(*to_device(backend, odd, k, v), backend=backend)
    assert_prepared_equal(got, ref.prepare(odd, k, v))


@pytest.mark.parametrize("backend", backend_params())
def test_torch_op_positional_and_keyword_forms(backend):
    """torch.ops.aiter.gfx1201_sage_prepare takes upstream's names, order and defaults."""
    s = 40
    q, k, v = to_device(backend, *qkv(1, s, s, 2, seed=13))
    qw, kw, cos, sin = to_device(backend, *norm_weights(), *rope_tables(s, 32))
    op = torch.ops.aiter.gfx1201_sage_prepare
    pos = op(q, k, v, 0.1, qw, kw, cos, sin, 1e-5, backend=backend)
    by_name = dict(query=q, key=k, value=v, softmax_scale=0.1, query_weight=qw, key_weight=kw,
                   cosine=cos, sine=sin, eps=1e-5, backend=backend)  # fmt: skip
    kws = op(**by_name)
    want = ref.prepare(q, k, v, 0.1, qw, kw, cos, sin, 1e-5)
    for got in (pos, kws):
        assert_prepared_equal(list(got[:4]) + [got[4].view(torch.float8_e4m3fn), got[5]], want)
    py = aiter_sage.gfx1201_sage_prepare(**by_name)
    assert_prepared_equal(py, want)


@pytest.mark.parametrize("backend", backend_params())
def test_eps_zero_with_norm_weights_is_used_as_given(backend):
    """eps=0 is a value, not "unset": rows whose mean square is near 1e-6 (where eps=1e-6
    changes the RMS by about 30 %) quantize as ref.prepare does with eps=0, and not as with
    the default."""
    s = 64
    q, k, v = qkv(1, s, s, 2, seed=14)
    q, k = (q.float() * 1e-3).to(q.dtype), (k.float() * 1e-3).to(k.dtype)
    qw, kw = norm_weights(14)
    dev = to_device(backend, q, k, v, qw, kw)
    got = aiter_sage.gfx1201_sage_prepare(*dev[:3], 0.1, dev[3], dev[4], eps=0.0, backend=backend)
    want = ref.prepare(q, k, v, 0.1, qw, kw, eps=0.0)
    assert_prepared_equal(got, want)
    default = ref.prepare(q, k, v, 0.1, qw, kw)
    assert not torch.equal(_bits(want.q_int8), _bits(default.q_int8))  # the case can tell


@pytest.mark.parametrize("op", ["gfx1201_sage_prepare", "gfx1201_sage_attention"])
def test_a_value_given_twice_is_a_type_error(op):
    """att(q, k, v, 0.1, softmax_scale=0.2): positional and keyword for one parameter."""
    q, k, v = qkv(1, 32, 32, 1, seed=15)
    with pytest.raises(TypeError, match="multiple values for 'softmax_scale'"):
        getattr(aiter_sage, op)(q, k, v, 0.1, softmax_scale=0.2)
    with pytest.raises(TypeError, match="multiple values for 'query'"):
        getattr(aiter_sage, op)(q, k, v, query=q)
    p = aiter_sage.gfx1201_sage_prepare(q, k, v)
    with pytest.raises(TypeError, match="multiple values for 'seq_len'"):
        aiter_sage.gfx1201_sage_attention_fwd(*p, 32, seq_len=32)


# ---- the reference against upstream's formulas --------------------------------------------
def _upstream_formula_prepare(
    q, k, v, sm_scale, qw=None, kw=None, cos=None, sin=None, eps=1e-6, q_block=32
):
    """Upstream's reference, written out step by step with plain torch ops:
    F.rms_norm then FP32 RoPE; Q times float32(scale*log2e); block scale amax/127; codes
    trunc(t +- 0.5); V scale amax * float32(1/448), codes via torch's e4m3 converter.
    `q_block`: Q rows per scale (upstream's 32; 16 for q_scale_rows=16)."""
    rows = q.shape[1]
    padded = (rows + 31) // 32 * 32

    def norm_rope(x, w):
        x = F.rms_norm(x, (128,), w, eps)
        d = cos.shape[-1]
        head = x[..., :d].float()
        rot = torch.cat([-head[..., d // 2 :], head[..., : d // 2]], dim=-1)
        head = head * cos[None, :, None] + rot * sin[None, :, None]
        return torch.cat([head.to(x.dtype), x[..., d:]], dim=-1)

    def quant(x, factor=None, block=32):
        b, _, h, d = x.shape
        x = F.pad(x.float(), (0, 0, 0, 0, 0, padded - rows))
        if factor is not None:
            x = x * torch.tensor(factor, dtype=torch.float32)
        blocks = x.view(b, padded // block, block, h, d)
        amax = blocks.abs().amax(dim=(2, 4))
        scale = torch.div(amax, torch.full_like(amax, 127.0))
        t = torch.div(blocks, scale[:, :, None, :, None])
        t = t + torch.where(t >= 0, 0.5, -0.5)
        t = torch.where(scale[:, :, None, :, None] > 0, t.trunc(), 0.0)
        return t.to(torch.int8).view(b, padded, h, d), scale.transpose(1, 2).contiguous()

    if qw is not None:
        q, k = norm_rope(q, qw), norm_rope(k, kw)
    qi, qs = quant(q, sm_scale * 1.4426950408889634, q_block)
    ki, ks = quant(k)
    one = torch.ones((), dtype=torch.float32)
    vs = v.float().abs().amax(dim=1) * (one / 448.0)
    x = torch.where(vs[:, None] > 0, v.float() / vs[:, None], 0.0)
    vf = F.pad(x, (0, 0, 0, 0, 0, padded - rows)).to(torch.float8_e4m3fn)
    return qi, qs, ki, ks, vf.permute(0, 2, 3, 1).contiguous(), vs


def _rms_norm_matches_torch() -> bool:
    x = randn_bshd(1, 4096, 4, seed=17, scale=3.0)
    w, _ = norm_weights(17)
    return torch.equal(
        ref.rmsnorm(x, w, 1e-5).view(torch.int16), F.rms_norm(x, (128,), w, 1e-5).view(torch.int16)
    )


def test_ref_rmsnorm_equals_torch_rms_norm():
    """The pinned order is torch's CPU order at AVX2 capability: equal on 16384 rows there.
    (At another capability torch sums in another order; the test then bounds the effect.)"""
    x = randn_bshd(1, 4096, 4, seed=17, scale=3.0)
    w, _ = norm_weights(17)
    ours = ref.rmsnorm(x, w, 1e-5)
    theirs = F.rms_norm(x, (128,), w, 1e-5)
    same = (ours.view(torch.int16) == theirs.view(torch.int16)).double().mean().item()
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        assert same == 1.0, same
    else:
        assert same > 0.9999, same


@pytest.mark.parametrize("q_block", [32, 16])
@pytest.mark.parametrize("case", [(1, 33, 7), (2, 513, 14), (1, 100, 3)], ids=str)
def test_ref_prepare_equals_upstream_formulas(case, q_block):
    """Upstream's steps; with q_scale_rows=16 the same steps over 16-row Q blocks."""
    b, s, h = case
    q, k, v = upstream_quant_inputs(b, s, h, seed=s)
    want = _upstream_formula_prepare(q, k, v, 128**-0.5, q_block=q_block)
    assert_prepared_equal(ref.prepare(q, k, v, q_scale_rows=q_block), want)


@pytest.mark.parametrize("s,h,rope_dim", [(33, 7, 96), (300, 3, 32), (513, 2, 128)], ids=str)
def test_ref_norm_rope_equals_upstream_formulas(s, h, rope_dim):
    if not _rms_norm_matches_torch():
        skip_no_hardware(
            "a CPU at which torch's rms_norm sums in the pinned (AVX2) order; "
            "test_ref_rmsnorm_equals_torch_rms_norm bounds the difference"
        )
    q, k, v = (randn_bshd(1, s, h, seed=s + i, scale=3.0) for i in range(3))
    qw, kw = norm_weights(s)
    cos, sin = rope_tables(s, rope_dim)
    want = _upstream_formula_prepare(q, k, v, 128**-0.5, qw, kw, cos, sin, 1e-5)
    assert_prepared_equal(ref.prepare(q, k, v, None, qw, kw, cos, sin, 1e-5), want)


def test_ref_int8_rounding_is_upstreams():
    """Ties go away from zero after a float32 addition (not round-half-even), and the int8
    conversion is torch's (through int32, low byte)."""
    t = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, 126.5, -126.5, 190.0, float("nan")])
    got = ref.to_int8_like_torch((t + torch.where(t >= 0, 0.5, -0.5)).trunc())
    assert got.tolist() == [1, 2, 3, -1, -3, 1, 127, -127, -66, 0]
    assert torch.equal(got, (t + torch.where(t >= 0, 0.5, -0.5)).trunc().to(torch.int8))


def test_ref_fp8_encoder_matches_torch():
    """The reference's bit-level e4m3 encoder agrees with torch's float8_e4m3fn converter
    wherever torch releases agree (|x| < 464: round to nearest even). At and above 464 torch
    2.13 saturates to +-448 while torch 2.11 returns NaN; the reference and every kernel
    saturate (a finite V never becomes NaN; V codes reach there only with a subnormal scale)."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(200000, generator=g) * s for s in (1e-3, 1.0, 100.0)])
    codes = torch.arange(256, dtype=torch.uint8)
    vals = ref.e4m3_decode(codes)
    srt = vals[~vals.isnan()].sort().values
    ties = (srt[:-1] + srt[1:]) / 2
    edges = torch.tensor([448.0, 460.0, 463.99997, 2.0**-10, 0.0, -0.0, float("nan")])
    x = torch.cat([x, srt, ties, ties.nextafter(torch.tensor(float("inf"))), edges])
    common = x[~(x.abs() >= 464)]  # NaN stays in
    want = common.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ref.e4m3_encode_sat(common), want)
    big = torch.tensor([464.0, 479.0, 480.0, 1e9, float("inf")])
    assert ref.e4m3_encode_sat(big).tolist() == [0x7E] * 5
    assert ref.e4m3_encode_sat(-big).tolist() == [0xFE] * 5
    assert torch.equal(
        ref.e4m3_decode(codes).nan_to_num(7.0),
        codes.view(torch.float8_e4m3fn).float().nan_to_num(7.0),
    )


def test_ref_rope_is_fp32_with_one_rounding():
    x = randn_bshd(1, 50, 2, seed=4)
    cos, sin = rope_tables(50, 128)
    xf = x.float()
    eager = (
        xf * cos[None, :, None] + torch.cat([-xf[..., 64:], xf[..., :64]], -1) * sin[None, :, None]
    )
    assert torch.equal(ref.rope(x, cos, sin, 128), eager.to(torch.bfloat16))


if __name__ == "__main__":
    run_as_script(__file__)
