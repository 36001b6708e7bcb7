"""Host tests of the shared headers: layout math and the scalar quantization helpers."""

import ctypes
import itertools

import pytest
import torch

from aiter_sage import jit_driver, ref

from common import REPO, run_as_script


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
        ("sage_qk8_offset", [i64] * 6),
        ("sage_qk_scale_offset", [i64] * 3),
        ("sage_v8_offset", [i64] * 4),
        ("sage_v_scale_offset", [i64] * 2),
        ("sage_padded_len", [i64]),
    ):
        getattr(lib, name).restype = i64
        getattr(lib, name).argtypes = args
    lib.sage_e4m3.restype = ctypes.c_uint8
    lib.sage_e4m3.argtypes = [ctypes.c_float]
    lib.sage_e4m3_decode.restype = ctypes.c_float
    lib.sage_e4m3_decode.argtypes = [ctypes.c_uint8]
    lib.sage_quant_i8.restype = ctypes.c_int8
    lib.sage_quant_i8.argtypes = [ctypes.c_float, ctypes.c_float]
    lib.sage_quant_v.restype = ctypes.c_uint8
    lib.sage_quant_v.argtypes = [ctypes.c_float, ctypes.c_float]
    lib.sage_f32_to_bf16.restype = ctypes.c_uint16
    lib.sage_f32_to_bf16.argtypes = [ctypes.c_float]
    lib.sage_rms_sum_squares.restype = ctypes.c_float
    lib.sage_rms_sum_squares.argtypes = [ctypes.POINTER(ctypes.c_float)]
    return lib


def test_padded_len(probe):
    for n in (1, 31, 32, 33, 127, 128, 129, 200, 4096, 4097):
        assert probe.sage_padded_len(n) == ref.padded_len(n) == (n + 31) // 32 * 32


@pytest.mark.parametrize("b,h,s", [(1, 1, 1), (2, 3, 200), (1, 2, 300)])
def test_offsets_match_prepared_tensor_strides(probe, b, h, s):
    """layout.h addresses exactly the elements torch addresses in ref.prepare's tensors."""
    q = torch.zeros(b, s, h, 128, dtype=torch.bfloat16)
    p = ref.prepare(q, q, q, 1.0)
    s_pad = p.q_int8.shape[1]
    for bi, hi in itertools.product(range(b), range(h)):
        head = bi * h + hi
        for si, d in ((0, 0), (s - 1, 127), (s_pad - 1, 5), (min(33, s_pad - 1), 64)):
            assert (
                probe.sage_qk8_offset(h, s_pad, bi, si, hi, d)
                == p.q_int8[bi, si, hi, d].data_ptr() - p.q_int8.data_ptr()
            )
            assert (
                probe.sage_qk_scale_offset(head, s_pad, si) * 4
                == p.q_scale[bi, hi, si // 32].data_ptr() - p.q_scale.data_ptr()
            )
            assert (
                probe.sage_v8_offset(head, s_pad, d, si)
                == p.v_fp8[bi, hi, d, si].data_ptr() - p.v_fp8.data_ptr()
            )
            assert (
                probe.sage_v_scale_offset(head, d) * 4
                == p.v_scale[bi, hi, d].data_ptr() - p.v_scale.data_ptr()
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


def test_scalar_rms_sum_squares_matches_reference(probe):
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        x = (torch.randn(128, generator=g) * 3).to(torch.bfloat16).float().contiguous()
        got = probe.sage_rms_sum_squares(ctypes.cast(x.data_ptr(), ctypes.POINTER(ctypes.c_float)))
        assert torch.tensor(got, dtype=torch.float32).view(torch.int32) == ref.rms_sum_squares(
            x
        ).view(torch.int32)


def test_scalar_bf16_rounding(probe):
    xs = torch.randn(2000, generator=torch.Generator().manual_seed(2)) * 1e3
    want = xs.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    got = torch.tensor([probe.sage_f32_to_bf16(float(x)) for x in xs], dtype=torch.int32)
    assert torch.equal(got, want)


if __name__ == "__main__":
    run_as_script(__file__)
