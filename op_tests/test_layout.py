"""Host tests of the shared headers: layout math and the scalar quantization helpers."""

import ctypes
import itertools

import pytest
import torch
from common import REPO, run_as_script

from aiter_sage import jit_driver, ref


@pytest.fixture(scope="module")
def probe():
    spec = jit_driver.module_table().ModuleSpec(
        name="layout_probe", archs=(), sources={"cpu": ("layout_probe.cpp",)},
        entry="sage_layout_offset", root=str(REPO / "op_tests" / "cpp"))
    lib = ctypes.CDLL(str(jit_driver.ensure_module(spec, "cpu")))
    lib.sage_padded_len.restype = ctypes.c_int64
    lib.sage_padded_len.argtypes = [ctypes.c_int64]
    lib.sage_e4m3.restype = ctypes.c_uint8
    lib.sage_e4m3.argtypes = [ctypes.c_float]
    lib.sage_e4m3_decode.restype = ctypes.c_float
    lib.sage_e4m3_decode.argtypes = [ctypes.c_uint8]
    lib.sage_quant_i8.restype = ctypes.c_int8
    lib.sage_quant_i8.argtypes = [ctypes.c_float, ctypes.c_float]
    lib.sage_f32_to_bf16.restype = ctypes.c_uint16
    lib.sage_f32_to_bf16.argtypes = [ctypes.c_float]
    return lib


def offset(lib, kind, head, s_pad, a, b=0):
    out = ctypes.c_int64()
    assert lib.sage_layout_offset(kind, head, s_pad, a, b, ctypes.byref(out)) == 0
    return out.value


def test_padded_len(probe):
    for n in (1, 127, 128, 129, 200, 4096, 4097):
        assert probe.sage_padded_len(n) == ref.padded_len(n)


@pytest.mark.parametrize("b,h,s", [(1, 1, 1), (2, 3, 200), (1, 2, 300)])
def test_offsets_match_prepared_tensor_strides(probe, b, h, s):
    """layout.h addresses exactly the elements torch addresses in ref.prepare's tensors."""
    q = torch.zeros(b, s, h, 128, dtype=torch.bfloat16)
    p = ref.prepare(q, q, q, 1.0)
    s_pad = p.q8.shape[2]
    for bi, hi in itertools.product(range(b), range(h)):
        head = bi * h + hi
        for si, d in ((0, 0), (s - 1, 127), (s_pad - 1, 5), (min(33, s_pad - 1), 64)):
            assert offset(probe, 0, head, s_pad, si, d) == \
                p.q8[bi, hi, si, d].data_ptr() - p.q8.data_ptr()
            assert offset(probe, 1, head, s_pad, si) * 4 == \
                p.q_scale[bi, hi, si // 32].data_ptr() - p.q_scale.data_ptr()
            assert offset(probe, 2, head, s_pad, d, si) == \
                p.v8[bi, hi, d, si].data_ptr() - p.v8.data_ptr()
            assert offset(probe, 3, head, s_pad, d) * 4 == \
                p.v_scale[bi, hi, d].data_ptr() - p.v_scale.data_ptr()


def test_scalar_fp8_encoder_matches_reference(probe):
    g = torch.Generator().manual_seed(1)
    codes = torch.arange(256, dtype=torch.uint8)
    vals = ref.e4m3_decode(codes)
    finite = vals[~vals.isnan()].sort().values
    ties = (finite[:-1] + finite[1:]) / 2
    xs = torch.cat([torch.randn(3000, generator=g) * 50, finite, ties,
                    torch.tensor([449.0, 1e20, -1e20, float("nan"), 1e-12])])
    want = ref.e4m3_encode_sat(xs)
    got = torch.tensor([probe.sage_e4m3(float(x)) for x in xs], dtype=torch.uint8)
    assert torch.equal(got, want)
    dec = torch.tensor([probe.sage_e4m3_decode(int(c)) for c in codes])
    assert torch.equal(dec.nan_to_num(9.0), vals.nan_to_num(9.0))


def test_scalar_int8_and_bf16_rounding(probe):
    for x, s in ((2.5, 1.0), (3.5, 1.0), (-2.5, 1.0), (1000.0, 1.0), (-1000.0, 1.0), (0.0, 1.0)):
        want = int(torch.round(torch.tensor(x / s)).clamp(-127, 127))
        assert probe.sage_quant_i8(x, s) == want
    xs = torch.randn(2000, generator=torch.Generator().manual_seed(2)) * 1e3
    want = xs.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    got = torch.tensor([probe.sage_f32_to_bf16(float(x)) for x in xs], dtype=torch.int32)
    assert torch.equal(got, want)


if __name__ == "__main__":
    run_as_script(__file__)
