"""Host tests of the shared headers: layout math and the scalar quantization helpers."""

import ctypes
import itertools

import pytest
import torch

from aiter_sage import jit_driver, ref

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import REPO, every_16_bit_value, run_as_script


@pytest.fixture(scope="module")
def probe():
    spec = jit_driver.module_table().ModuleSpec(
        name="layout_probe",
        archs=(),
        sources={"cpu": ("layout_probe.cpp",)},
        entry="sage_qk8_offset",
        root=str(REPO / "op_tests" / "cpp"),
    )
    lib = ctypes.CDLL(str(jit_driver.ensure_module(spec, "cpu")))
    i64 = ctypes.c_int64
    for name, args in (
        ("sage_qk8_offset", [i64] * 7),
        ("sage_qk_scale_offset", [i64] * 3),
        ("sage_qk_scale_offset_rows", [i64] * 4),
        ("sage_scale_blocks", [i64] * 2),
        ("sage_q_scale_blocks", [ctypes.c_int, i64]),
        ("sage_q_scale_offset", [ctypes.c_int, i64, i64, i64]),
        ("sage_v8_offset", [i64] * 5),
        ("sage_channel_offset", [i64] * 3),
        ("sage_padded_len", [i64]),
        ("sage_v_amax_part_offset", [i64] * 4),
        ("sage_v_amax_split_keys", [i64] * 2),
    ):
        getattr(lib, name).restype = i64
        getattr(lib, name).argtypes = args
    lib.sage_e4m3.restype = ctypes.c_uint8
    lib.sage_e4m3.argtypes = [ctypes.c_float]
    lib.sage_e4m3_decode.restype = ctypes.c_float
    lib.sage_e4m3_decode.argtypes = [ctypes.c_uint8]
    lib.sage_quant_i8.restype = ctypes.c_int8
    lib.sage_quant_i8.argtypes = [ctypes.c_float, ctypes.c_float]
    # (values, n_blocks, block, *compared[, *unsure]) -> mismatches
    blocks_args = [ctypes.POINTER(ctypes.c_float), i64, i64, ctypes.POINTER(i64)]
    for name, counters in (("normal", 0), ("recip", 1)):
        fn = getattr(lib, f"sage_quant_i8_{name}_mismatches")
        fn.restype = i64
        fn.argtypes = blocks_args + [ctypes.POINTER(i64)] * counters
    lib.sage_quant_v_recip_mismatches.restype = i64
    lib.sage_quant_v_recip_mismatches.argtypes = [
        ctypes.POINTER(ctypes.c_float),
        i64,
        ctypes.c_int,
        ctypes.POINTER(i64),
        ctypes.POINTER(i64),
    ]
    lib.sage_quant_v.restype = ctypes.c_uint8
    lib.sage_quant_v.argtypes = [ctypes.c_float, ctypes.c_float]
    lib.sage_f32_to_bf16.restype = ctypes.c_uint16
    lib.sage_f32_to_bf16.argtypes = [ctypes.c_float]
    lib.sage_rms_sum_squares.restype = ctypes.c_float
    lib.sage_rms_sum_squares.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_int]
    lib.sage_f32_to_fp16.restype = ctypes.c_uint16
    lib.sage_f32_to_fp16.argtypes = [ctypes.c_float]
    lib.sage_fp16_to_f32.restype = ctypes.c_float
    lib.sage_fp16_to_f32.argtypes = [ctypes.c_uint16]
    lib.sage_padded_head_dim.restype = ctypes.c_int
    lib.sage_padded_head_dim.argtypes = [ctypes.c_int]
    return lib


def test_padded_len(probe):
    for n in (1, 31, 32, 33, 127, 128, 129, 200, 4096, 4097):
        assert probe.sage_padded_len(n) == ref.padded_len(n) == (n + 31) // 32 * 32


def test_v_amax_part_offsets_are_a_contiguous_tensor(probe):
    """The GPU prepare's scratch [B, Hkv, splits, D]: layout.h addresses it as torch would."""
    splits = probe.sage_v_amax_splits()
    t = torch.empty(2, 3, splits, 128)
    for b, h, sp, d in itertools.product((0, 1), (0, 2), (0, 7, splits - 1), (0, 5, 127)):
        want = t[b, h, sp, d].data_ptr() - t.data_ptr()
        assert 4 * probe.sage_v_amax_part_offset(b * 3 + h, 128, sp, d) == want


@pytest.mark.parametrize("step", [256, 128])
def test_v_amax_splits_cover_every_key_once(probe, step):
    """Split i covers [i * keys, min((i + 1) * keys, kv_len)): the splits tile [0, kv_len)
    with no gap and no overlap, every split starts on a whole pass (`step` keys), and the
    ranges are as even as that allows (at most one pass longer than an even share)."""
    splits = probe.sage_v_amax_splits()
    for kv_len in (1, 31, 255, 256, 257, 3000, 4096, 4097, 16384, 20000, (1 << 24) - 1):
        keys = probe.sage_v_amax_split_keys(kv_len, step)
        assert keys % step == 0 and keys > 0
        covered = [(i * keys, min((i + 1) * keys, kv_len)) for i in range(splits)]
        assert covered[0][0] == 0 and max(e for _, e in covered) == kv_len
        ends = [e for b, e in covered if b < e]
        assert all(b == e0 for (b, _), e0 in zip(covered[1 : len(ends)], ends)), kv_len
        assert keys < -(-kv_len // splits) + step, kv_len


@pytest.mark.parametrize("smooth_k", [0, 1])
def test_v_scale_grid_has_each_v_range_once_and_the_k_mean_first(probe, smooth_k):
    """The v_scale kernel's grid z: every V key range exactly once and, with smooth_k, the K
    mean's channel slices at z = 0 .. slices - 1 (dispatched first: they stream a whole head of
    K between them), each naming its slice as z."""
    splits, slices = probe.sage_v_amax_splits(), probe.sage_k_mean_slices()
    zs = range(probe.sage_v_scale_workgroups(smooth_k))
    roles = [probe.sage_v_scale_split(z, smooth_k) for z in zs]
    assert sorted(r for r in roles if r >= 0) == list(range(splits))
    k_mean_zs = [z for z, r in zip(zs, roles) if r < 0]
    assert k_mean_zs == (list(range(slices)) if smooth_k else [])
    assert slices >= 2  # one workgroup per head kept a head's K on one SM


def test_q_scale_rows_field_reads_as_32_or_16(probe):
    """SageParams::q_scale_rows: 0 (a zero-initialised struct, every caller before the field)
    and 32 mean upstream's 32-row Q scales, 16 the fine mode; scale_blocks counts either."""
    assert [probe.sage_q_scale_rows(f) for f in (0, 32, 16)] == [32, 32, 16]
    for s_pad in (32, 64, 4096, 4128):
        assert probe.sage_scale_blocks(s_pad, 32) == s_pad // 32
        assert probe.sage_scale_blocks(s_pad, 16) == s_pad // 16
        assert probe.sage_q_scale_blocks(0, s_pad) == probe.sage_q_scale_blocks(32, s_pad)
        assert probe.sage_q_scale_blocks(16, s_pad) == 2 * probe.sage_q_scale_blocks(0, s_pad)


def test_check_params_names_the_q_scale_rows_it_accepts(probe):
    probe.sage_module_last_error.restype = ctypes.c_char_p
    for field in (0, 32, 16):
        assert probe.sage_problem_refuses_q_scale_rows(field) == 0, field
    for field in (8, 64, -16, 1):
        assert probe.sage_problem_refuses_q_scale_rows(field) == 1, field
        msg = probe.sage_module_last_error().decode()
        assert msg == f"probe: q_scale_rows must be 32 or 16 (0: 32), got {field}", msg


def test_padded_head_dim(probe):
    for d in range(8, 129, 8):
        assert probe.sage_padded_head_dim(d) == ref.padded_head_dim(d) == (64 if d <= 64 else 128)


@pytest.mark.parametrize(
    "b,hq,hkv,s,d", [(1, 1, 1, 1, 128), (2, 3, 3, 200, 128), (1, 4, 2, 300, 64), (2, 2, 1, 40, 72)]
)
@pytest.mark.parametrize("q_scale_rows", [32, 16])
def test_offsets_match_prepared_tensor_strides(probe, b, hq, hkv, s, d, q_scale_rows):
    """layout.h addresses exactly the elements torch addresses in ref.prepare's tensors (Q
    scales at either granularity: q_scale_offset of a SageParams, and qk_scale_offset with the
    row count, agree with ref's q_scale[b, h, s // q_scale_rows])."""
    q = torch.zeros(b, s, hq, d, dtype=torch.bfloat16)
    kv = torch.zeros(b, s, hkv, d, dtype=torch.bfloat16)
    p = ref.prepare(q, kv, kv, 1.0, q_scale_rows=q_scale_rows)
    s_pad, dp = p.q_int8.shape[1], p.q_int8.shape[3]
    assert p.q_scale.shape[-1] == probe.sage_q_scale_blocks(q_scale_rows, s_pad)
    assert dp == ref.padded_head_dim(d)
    for bi, hi in itertools.product(range(b), range(hq)):
        for si, c in ((0, 0), (s - 1, dp - 1), (s_pad - 1, 5), (min(33, s_pad - 1), dp // 2)):
            assert (
                probe.sage_qk8_offset(hq, dp, s_pad, bi, si, hi, c)
                == p.q_int8[bi, si, hi, c].data_ptr() - p.q_int8.data_ptr()
            )
            q_at = p.q_scale[bi, hi, si // q_scale_rows].data_ptr() - p.q_scale.data_ptr()
            qh = bi * hq + hi
            assert probe.sage_q_scale_offset(q_scale_rows, s_pad, qh, si) * 4 == q_at
            assert probe.sage_qk_scale_offset_rows(qh, s_pad, si, q_scale_rows) * 4 == q_at
            if q_scale_rows == 32:  # the default argument is the contract's 32
                assert probe.sage_qk_scale_offset(qh, s_pad, si) * 4 == q_at
            if hi >= hkv:
                continue
            head = bi * hkv + hi
            assert (
                probe.sage_qk8_offset(hkv, dp, s_pad, bi, si, hi, c)
                == p.k_int8[bi, si, hi, c].data_ptr() - p.k_int8.data_ptr()
            )
            assert (
                probe.sage_v8_offset(head, dp, s_pad, c, si)
                == p.v_fp8[bi, hi, c, si].data_ptr() - p.v_fp8.data_ptr()
            )
            assert (
                probe.sage_channel_offset(head, dp, c) * 4
                == p.v_scale[bi, hi, c].data_ptr() - p.v_scale.data_ptr()
            )
            assert (  # K scales stay per 32 keys whatever q_scale_rows is
                probe.sage_qk_scale_offset(head, s_pad, si) * 4
                == p.k_scale[bi, hi, si // 32].data_ptr() - p.k_scale.data_ptr()
            )


def test_scalar_fp8_encoder_matches_reference(probe):
    g = torch.Generator().manual_seed(1)
    codes = torch.arange(256, dtype=torch.uint8)
    vals = ref.e4m3_decode(codes)
    finite = vals[~vals.isnan()].sort().values
    ties = (finite[:-1] + finite[1:]) / 2
    xs = torch.cat(
        [
            torch.randn(3000, generator=g) * 50,
            finite,
            ties,
            torch.tensor([449.0, 1e20, -1e20, float("nan"), 1e-12, float("inf")]),
        ]
    )
    want = ref.e4m3_encode_sat(xs)
    got = torch.tensor([probe.sage_e4m3(float(x)) for x in xs], dtype=torch.uint8)
    assert torch.equal(got, want)
    dec = torch.tensor([probe.sage_e4m3_decode(int(c)) for c in codes])
    assert torch.equal(dec.nan_to_num(9.0), vals.nan_to_num(9.0))


def test_quant_i8_normal_equals_quant_i8(probe):
    """The fast int8 form prepare's qk kernel takes in blocks with a normal scale gives
    quant_i8's codes: random blocks over the whole exponent range (normal scales down to
    FLT_MIN and up to FLT_MAX / 127), exact ties k + 1/2 (and their float neighbours), -0,
    subnormal values inside normal blocks, and the block maximum itself."""
    g = torch.Generator().manual_seed(7)
    n_blocks, block = 20000, 32
    mant = torch.randn(n_blocks, block, generator=g)
    expo = torch.randint(-125, 120, (n_blocks, 1), generator=g).float()
    x = mant * torch.pow(2.0, expo)
    # Ties: values t * scale with t = k + 1/2, rounded to float, and one ulp either side.
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = amax * (1.0 / 127.0)
    k = torch.randint(-127, 127, (n_blocks, block // 4), generator=g).float() + 0.5
    ties = k * scale
    x[:, : block // 4] = ties
    x[:, block // 4 : block // 2] = torch.nextafter(ties, torch.full_like(ties, float("inf")))
    x[:, block // 2] = -0.0
    x[:, block // 2 + 1] = torch.sign(mant[:, 0]) * 1e-40  # subnormal
    x[::7, 0] = torch.finfo(torch.float32).max * 0.5  # scales near FLT_MAX / 127
    x[::11] = x[::11] * 2.0**-120  # scales down to FLT_MIN (and below: not compared)
    x = x.contiguous()
    compared = ctypes.c_int64(0)
    ptr = ctypes.cast(x.data_ptr(), ctypes.POINTER(ctypes.c_float))
    bad = probe.sage_quant_i8_normal_mismatches(ptr, n_blocks, block, ctypes.byref(compared))
    assert bad == 0
    assert compared.value > 0.9 * n_blocks * block  # nearly all blocks have normal scales


def _near_ties(n_blocks, block, g):
    """Blocks over the whole exponent range whose first half are values within a few ulps of
    the code boundaries t = k + 1/2 (each block's own scale; ties, and 1..4 float steps either
    side), the rest randn."""
    mant = torch.randn(n_blocks, block, generator=g)
    expo = torch.randint(-122, 120, (n_blocks, 1), generator=g).float()
    x = mant * torch.pow(2.0, expo)
    x[:, 0] = x.abs().amax(dim=1) * torch.sign(mant[:, 0])  # keep the block's maximum
    scale = x.abs().amax(dim=1, keepdim=True) * (1.0 / 127.0)
    half = block // 2
    ties = (torch.randint(-126, 126, (n_blocks, half - 1), generator=g).float() + 0.5) * scale
    steps = torch.randint(-4, 5, (n_blocks, half - 1), generator=g)
    inf = torch.full_like(ties, float("inf"))
    for _ in range(4):  # move each tie |steps| float steps up or down
        up, down = torch.nextafter(ties, inf), torch.nextafter(ties, -inf)
        ties = torch.where(steps > 0, up, torch.where(steps < 0, down, ties))
        steps = steps - steps.sign()
    x[:, 1:half] = ties
    return x.contiguous()


def test_quant_i8_recip_equals_quant_i8(probe):
    """The cuda qk kernel's division-free int8 form (x * 1/s, falling back to the division where
    the proof in quant.h cannot vouch for the code) gives quant_i8's codes: blocks whose values
    sit within a few ulps of every code boundary, over the exponent range where 1/s is normal,
    and randn blocks. The fallback is rare on randn values and taken only near boundaries."""
    g = torch.Generator().manual_seed(11)
    i64 = ctypes.c_int64
    cases = ((_near_ties(20000, 32, g), 0.5), (torch.randn(20000, 32, generator=g), 1e-3))
    for x, max_unsure in cases:
        compared, unsure = i64(0), i64(0)
        ptr = ctypes.cast(x.data_ptr(), ctypes.POINTER(ctypes.c_float))
        bad = probe.sage_quant_i8_recip_mismatches(
            ptr, x.shape[0], x.shape[1], ctypes.byref(compared), ctypes.byref(unsure)
        )
        assert bad == 0
        assert compared.value > 0.9 * x.numel()
        assert unsure.value <= max_unsure * compared.value, (unsure.value, compared.value)


SAGE_DTYPE = {torch.bfloat16: 0, torch.float16: 1}  # params.h SageDtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quant_v_recip_equals_quant_v(probe, dtype):
    """The cuda v_quant's division-free e4m3 encoding (quant.h quant_v_recip: one midpoint
    decided by an FMA residual; the division only below e4m3's normal range) gives quant_v's
    code for every finite 16-bit input up to the channel's maximum, in 400 channels whose
    maxima are values of the format spread over the scale range where v_recip_ok holds, and at
    the maxima 448 (scale ~1: inputs on the e4m3 midpoints) and 7 * 2^k (a factor 7 like 448's:
    BF16 inputs land within an ulp of the midpoints; 5 % of randn BF16 channels have such a
    maximum). Only quotients below e4m3's normal range (zero included) fall back."""
    g = torch.Generator().manual_seed(12)
    lo, hi = (-80, 80) if dtype == torch.bfloat16 else (-5, 7)  # scales 2^-89 .. 2^72; FP16's
    expo = torch.randint(lo, hi, (400,), generator=g).float()
    amax = ((torch.rand(400, generator=g) + 1.0) * torch.pow(2.0, expo)).to(dtype).float()
    fixed = torch.tensor([448.0, 1.0, 3.0, 7.0, 0.4375, 224.0, 1.75 * 2.0**-4])
    amax = torch.cat([amax, fixed.to(dtype).float()]).contiguous()
    compared, unsure = ctypes.c_int64(0), ctypes.c_int64(0)
    ptr = ctypes.cast(amax.data_ptr(), ctypes.POINTER(ctypes.c_float))
    bad = probe.sage_quant_v_recip_mismatches(
        ptr, amax.numel(), SAGE_DTYPE[dtype], ctypes.byref(compared), ctypes.byref(unsure)
    )
    assert bad == 0
    every = every_16_bit_value(dtype)
    scale = amax * torch.tensor(1.0 / 448, dtype=torch.float32)
    ok = (scale >= 2.0**-90) & (scale <= 2.0**90)
    assert ok.sum() >= 400
    kept = every.abs()[None] <= amax[ok, None]
    assert compared.value == int(kept.sum())
    # the quotients below 2^-6: those of |v| below ~scale / 64, give or take 1/s's rounding
    tiny = kept & (every.abs()[None] < scale[ok, None] * 2.0**-6)
    assert abs(unsure.value - int(tiny.sum())) <= 0.001 * int(tiny.sum()) + 10


def test_scalar_quantizers_match_reference(probe):
    """quant.h's int8 and V codes equal ref.py's on ties, wraps, zero and NaN scales."""
    xs = torch.tensor([2.5, 3.5, -2.5, 0.5, -0.5, 126.5, 1000.0, -1000.0, 0.0, 1.0, float("nan")])
    for scale in (1.0, 0.5, 0.0, float("nan")):
        sc = torch.tensor(scale)
        t = xs / sc
        t = t + torch.where(t >= 0, 0.5, -0.5)
        want = torch.where(
            sc > 0, ref.to_int8_like_torch(t.trunc()), torch.zeros((), dtype=torch.int8)
        )
        got = [probe.sage_quant_i8(float(x), scale) for x in xs]
        assert got == want.tolist(), (scale, got, want.tolist())
        vwant = ref.e4m3_encode_sat(torch.where(sc > 0, xs / sc, torch.zeros(())))
        assert [probe.sage_quant_v(float(x), scale) for x in xs] == vwant.tolist()


@pytest.mark.parametrize("d", [32, 64, 96, 128])
def test_scalar_rms_sum_squares_matches_reference(probe, d):
    g = torch.Generator().manual_seed(3)
    for _ in range(100):
        x = (torch.randn(d, generator=g) * 3).to(torch.bfloat16).float().contiguous()
        ptr = ctypes.cast(x.data_ptr(), ctypes.POINTER(ctypes.c_float))
        got = probe.sage_rms_sum_squares(ptr, d)
        assert torch.tensor(got, dtype=torch.float32).view(torch.int32) == ref.rms_sum_squares(
            x
        ).view(torch.int32)


def test_scalar_bf16_rounding(probe):
    xs = torch.randn(2000, generator=torch.Generator().manual_seed(2)) * 1e3
    want = xs.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    got = torch.tensor([probe.sage_f32_to_bf16(float(x)) for x in xs], dtype=torch.int32)
    assert torch.equal(got, want)


def test_scalar_fp16_conversions_match_torch(probe):
    """quant.h's FP16 encode (RNE, overflow to inf, subnormals) and decode equal torch's."""
    g = torch.Generator().manual_seed(4)
    special = [65504.0, 65519.99, 65520.0, 1e6, -1e6, 6.1e-5, 6.0e-8, 2.9e-8, 3.0e-8, 0.0, -0.0]
    xs = torch.cat([torch.randn(3000, generator=g) * 1e3, torch.randn(1000, generator=g) * 1e-5])
    xs = torch.cat([xs, torch.tensor(special + [float("inf"), -float("inf")])])
    want = xs.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    got = torch.tensor([probe.sage_f32_to_fp16(float(x)) for x in xs], dtype=torch.int32)
    assert torch.equal(got, want)
    assert probe.sage_f32_to_fp16(float("nan")) & 0x7FFF == 0x7E00
    bits = torch.arange(0, 1 << 16, 7, dtype=torch.int32)
    halves = bits.to(torch.int16).view(torch.float16).float()
    dec = torch.tensor([probe.sage_fp16_to_f32(int(b)) for b in bits])
    assert torch.equal(dec.nan_to_num(7.0), halves.nan_to_num(7.0))


@pytest.mark.parametrize(
    "fields,prepare,names",
    [
        (dict(head_dim_pad=64), 1, "head dims <= 64"),
        (dict(fp16=1), 1, "float16 tensors"),
        (dict(heads_q=4, heads_kv=2), 0, "grouped-query attention"),
        (dict(pv16=1), 1, 'pv_dtype="fp16" (FP16 P.V)'),
        (dict(pv16=1), 0, 'pv_dtype="fp16" (FP16 P.V)'),
        (dict(causal=1), 0, "causal attention"),
        (dict(lse=1), 0, "return_lse"),
        (dict(smooth_k=1), 1, "smooth_k"),
        (dict(smooth_k=1), 0, "the LSE of smoothed K"),
        (dict(q_scale_rows=16), 1, "q_scale_rows=16 (16-row Q scales)"),
        (dict(q_scale_rows=16), 0, "q_scale_rows=16 (16-row Q scales)"),
    ],
)
def test_check_features_refuses_by_name(probe, fields, prepare, names):
    """check.h's Features gate (every backend implements all of contract v2 today, so no op
    test reaches it): a backend with only contract v1 refuses each v2 feature, naming it and
    the launch; the same launch without the feature passes."""
    base = dict(
        head_dim_pad=128, fp16=0, heads_q=2, heads_kv=2, causal=0, lse=0, smooth_k=0, pv16=0,
        q_scale_rows=32,
    )  # fmt: skip
    order = (
        "head_dim_pad", "fp16", "heads_q", "heads_kv", "causal", "lse", "smooth_k", "pv16",
        "q_scale_rows",
    )  # fmt: skip
    probe.sage_module_last_error.restype = ctypes.c_char_p
    assert probe.sage_v1_refuses(prepare, *(base[k] for k in order)) == 0
    assert probe.sage_v1_refuses(prepare, *({**base, **fields}[k] for k in order)) == 1
    msg = probe.sage_module_last_error().decode()
    launch = "sage_prepare_launch" if prepare else "sage_attention_launch"
    assert msg == f"{launch}: the v1 backend does not support {names} yet", msg


if __name__ == "__main__":
    run_as_script(__file__)
