"""The gfx12 attention kernel variants (head dim 64/128 x causal x P·V in FP8 or FP16; GQA,
FP16 output, head dims that are not 64/128, LSE with and without the K-smoothing correction)
on the wave emulator, called directly through the module's C ABI on tensors prepared by
aiter_sage.ref.prepare (so the kernel is tested independently of the gfx12 prepare module
and of the torch binding).

Checks per case: the output sits in ref.BAND of ref.attention_fp32 (is_causal as given), it
is within BF16/FP16 rounding of ref.attention_from_prepared (the kernel's own arithmetic),
the LSE is within 1e-4 of ref.attention_from_prepared(..., return_lse=True).lse, rows in
[q_len, out_rows) are zero with LSE -inf, channels >= head_dim and rows >= out_rows are not
written, and the emulator reports nothing. Small shapes: the emulator runs ~1e7 lane-ops/s.
Runnable as a script or under pytest."""

import ctypes
import os

import pytest
import torch

from aiter_sage import jit_driver, ref

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import run_as_script

_PARAM_FIELDS = [
    *[
        (n, ctypes.c_int32)
        for n in (
            "batch heads_q heads_kv head_dim head_dim_pad q_len kv_len q_len_pad kv_len_pad "
            "in_dtype out_dtype mask smooth_k pv_dtype"
        ).split()
    ],
    ("q_prescale", ctypes.c_float),
    ("q_scale_rows", ctypes.c_int32),
    ("q_lens", ctypes.c_void_p),
    ("kv_lens", ctypes.c_void_p),
    ("q", ctypes.c_void_p),
    ("k", ctypes.c_void_p),
    ("v", ctypes.c_void_p),
    *[(f"{t}_stride_{a}", ctypes.c_int64) for t in "qkv" for a in "bsh"],
    ("q_norm_weight", ctypes.c_void_p),
    ("k_norm_weight", ctypes.c_void_p),
    ("norm_eps", ctypes.c_float),
    ("rope_cos", ctypes.c_void_p),
    ("rope_sin", ctypes.c_void_p),
    ("rope_dim", ctypes.c_int32),
    ("rope_stride_s", ctypes.c_int64),
    *[
        (n, ctypes.c_void_p)
        for n in "q8 q_scale k8 k_scale v8 v16 v_scale v_amax_part k_mean lse_corr out".split()
    ],
    ("out_rows", ctypes.c_int32),
    ("out_stride_b", ctypes.c_int64),
    ("out_stride_s", ctypes.c_int64),
    ("out_stride_h", ctypes.c_int64),
    ("lse", ctypes.c_void_p),
    ("lse_stride_b", ctypes.c_int64),
    ("lse_stride_h", ctypes.c_int64),
    ("num_threads", ctypes.c_int32),
]


class SageParams(ctypes.Structure):
    _fields_ = _PARAM_FIELDS


_LIB = {}


def _module():
    if "lib" not in _LIB:
        try:
            so = jit_driver.ensure_module("module_gfx1201_sage_attention", "emu")
        except jit_driver.CompilerNotFound as e:
            pytest.skip(str(e))
        lib = ctypes.CDLL(str(so))
        lib.sage_attention_launch.argtypes = [ctypes.POINTER(SageParams), ctypes.c_void_p]
        lib.sage_module_last_error.restype = ctypes.c_char_p
        lib.sage_emu_reports_text.restype = ctypes.c_char_p
        assert lib.sage_abi_version() == 8  # the layout of _PARAM_FIELDS
        _LIB["lib"] = lib
    return _LIB["lib"]


def run_kernel(
    prep, q_len, kv_len, head_dim, *, causal, out_dtype, lse, lse_corr=None, extra_rows=0
):
    """Launches the emulated kernel; returns (out [B, out_rows, Hq, head_dim], lse or None,
    the raw output buffer with its guard channels/rows)."""
    lib = _module()
    q8, qs, k8, ks, v8, vs = (t.contiguous() for t in prep)
    b, sq_pad, hq, dp = q8.shape
    hkv, skv_pad = k8.shape[2], k8.shape[1]
    out_rows = min(q_len + extra_rows, sq_pad)
    # Guards: 8 extra channels per head and 3 extra rows, filled with NaN bits, must survive.
    guard_c, guard_r = 8, 3
    out = torch.full((b, out_rows + guard_r, hq, head_dim + guard_c), float("nan"), dtype=out_dtype)
    lse_t = torch.full((b, hq, out_rows + guard_r), float("nan")) if lse else None
    pv16 = v8.dtype == torch.float16  # pv_dtype "fp16": FP16 V codes, the FP16 P·V kernels
    p = SageParams()
    p.batch, p.heads_q, p.heads_kv, p.head_dim, p.head_dim_pad = b, hq, hkv, head_dim, dp
    p.q_len, p.kv_len, p.q_len_pad, p.kv_len_pad = q_len, kv_len, sq_pad, skv_pad
    p.in_dtype = p.out_dtype = 1 if out_dtype == torch.float16 else 0
    p.mask = 1 if causal else 0
    p.pv_dtype = 1 if pv16 else 0
    p.q_scale_rows = sq_pad // qs.shape[-1]  # 32, or 16 for q_scale_rows=16 prepared tensors
    p.q8, p.q_scale, p.k8, p.k_scale = q8.data_ptr(), qs.data_ptr(), k8.data_ptr(), ks.data_ptr()
    if pv16:
        p.v16 = v8.data_ptr()
    else:
        p.v8 = v8.view(torch.uint8).data_ptr()
    p.v_scale = vs.data_ptr()
    corr = None if lse_corr is None else lse_corr.contiguous().float()
    p.lse_corr = corr.data_ptr() if corr is not None else None
    p.out = out.data_ptr()
    p.out_rows = out_rows
    p.out_stride_b, p.out_stride_s, p.out_stride_h = out.stride()[:3]
    if lse:
        p.lse = lse_t.data_ptr()
        p.lse_stride_b, p.lse_stride_h = lse_t.stride()[:2]
    lib.sage_emu_clear_reports()
    rc = lib.sage_attention_launch(ctypes.byref(p), None)
    assert rc == 0, lib.sage_module_last_error()
    assert lib.sage_emu_report_count() == 0, lib.sage_emu_reports_text()
    # nothing written outside [out_rows) x [head_dim)
    assert torch.isnan(out[:, out_rows:].float()).all()
    assert torch.isnan(out[..., head_dim:].float()).all()
    if lse:
        assert torch.isnan(lse_t[..., out_rows:]).all()
        lse_t = lse_t[..., :out_rows]
    return out[:, :out_rows, :, :head_dim], lse_t


CASES = [
    # (B, Sq, Skv, Hq, Hkv, D, causal, dtype, smooth_k)
    (1, 96, 96, 2, 2, 128, False, torch.bfloat16, False),
    (1, 200, 200, 2, 2, 128, True, torch.bfloat16, False),
    (1, 77, 77, 2, 2, 64, False, torch.bfloat16, False),
    (1, 300, 300, 1, 1, 64, True, torch.float16, False),
    (2, 130, 130, 4, 2, 128, True, torch.float16, True),  # GQA 2, smooth_k LSE correction
    (1, 140, 140, 4, 1, 48, True, torch.bfloat16, True),  # MQA, D 48 -> 64 kernel
    (1, 70, 160, 2, 2, 96, True, torch.bfloat16, False),  # q_len < kv_len, D 96 -> 128
    (1, 200, 65, 2, 1, 64, True, torch.float16, False),  # q_len > kv_len (rows past kv_len)
    (1, 33, 33, 3, 3, 120, False, torch.float16, True),
]


def _id(c):
    b, sq, skv, hq, hkv, d, causal, dt, sk = c
    return (
        f"B{b}-Sq{sq}-Skv{skv}-H{hq}/{hkv}-D{d}-{'causal' if causal else 'full'}-"
        f"{'fp16' if dt == torch.float16 else 'bf16'}{'-smooth' if sk else ''}"
    )


# Every case at 32-row Q scales; q_scale_rows=16 (a Q scale per 16-query WMMA block) on the
# cases of each head dim and mask, with GQA and smoothing among them.
Q16_CASES = (CASES[0], CASES[1], CASES[3], CASES[4], CASES[6])
VARIANTS = [pytest.param(c, 32, id=_id(c)) for c in CASES] + [
    pytest.param(c, 16, id=_id(c) + "-q16") for c in Q16_CASES
]


@pytest.mark.parametrize("pv_dtype", ["fp8", "fp16"])
@pytest.mark.parametrize("case,q_scale_rows", VARIANTS)
def test_attention_variant_emu(case, q_scale_rows, pv_dtype):
    b, sq, skv, hq, hkv, d, causal, dtype, smooth = case
    g = torch.Generator().manual_seed(sq * 131 + d * 7 + hq)
    q = torch.randn(b, sq, hq, d, generator=g)
    if q_scale_rows == 16:  # rows whose 16-row half outweighs the other: the scales differ
        q[:, 5::32] *= 2.0
    q = q.to(dtype)
    k = (torch.randn(b, skv, hkv, d, generator=g) + (0.5 if smooth else 0.0)).to(dtype)
    v = torch.randn(b, skv, hkv, d, generator=g).to(dtype)
    prep, smoothing = ref.prepare(
        q, k, v, smooth_k=smooth, pv_dtype=pv_dtype, q_scale_rows=q_scale_rows,
        return_smoothing=True,
    )  # fmt: skip
    out, lse = run_kernel(
        prep,
        sq,
        skv,
        d,
        causal=causal,
        out_dtype=dtype,
        lse=True,
        lse_corr=smoothing.lse_corr if smooth else None,
        extra_rows=5,
    )
    # padded rows: zeros, LSE -inf
    assert (out[:, sq:].float() == 0).all()
    assert torch.isneginf(lse[..., sq:]).all()
    out, lse = out[:, :sq], lse[..., :sq]
    want = ref.attention_fp32(q, k, v, is_causal=causal)
    acc = ref.accuracy(out.float(), want)
    assert ref.in_band(acc), (ref.band_failures(acc), acc)
    model = ref.attention_from_prepared(
        prep,
        sq,
        skv,
        is_causal=causal,
        lse_corr=smoothing.lse_corr if smooth else None,
        head_dim=d,
        out_dtype=dtype,
        return_lse=True,
    )
    # the kernel's own arithmetic: within one rounding of the output format
    tol = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    diff = (out.float() - model.out.float()).abs()
    assert (diff <= tol * model.out.float().abs() + 1e-3).all(), diff.max()
    assert torch.allclose(lse, model.lse, atol=1e-4, rtol=0), (lse - model.lse).abs().max()
    # and the LSE is that of the unsmoothed FP32 scores, up to the quantization
    want_lse = ref.lse_fp32(q, k, is_causal=causal)
    assert (lse - want_lse).abs().max() < 0.1, (lse - want_lse).abs().max()


@pytest.mark.parametrize("q_scale_rows", [32, 16])
def test_nan_score_propagates_emu(q_scale_rows):
    """A NaN Q scale makes exactly its rows NaN (a 32-row block; with q_scale_rows=16 the 16
    rows 32-47, not the other half of their wave); the other rows stay finite."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 64, 1, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    prep = ref.prepare(q, k, v, q_scale_rows=q_scale_rows)
    prep.q_scale[0, 0, 32 // q_scale_rows] = float("nan")
    bad = torch.zeros(64, dtype=torch.bool)
    bad[32 : 32 + q_scale_rows] = True
    for causal in (False, True):
        out, lse = run_kernel(prep, 64, 64, 64, causal=causal, out_dtype=torch.bfloat16, lse=True)
        rows_nan = torch.isnan(out[0].float()).all(-1).all(-1)
        assert torch.equal(rows_nan, bad) and torch.isfinite(out[0][~bad].float()).all()
        assert torch.equal(torch.isnan(lse[0, 0]), bad)


if __name__ == "__main__":
    os.environ.setdefault("AITER_SAGE_LAZY_REGISTER", "1")
    run_as_script(__file__)
