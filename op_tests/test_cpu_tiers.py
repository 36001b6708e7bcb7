"""Every CPU tier (AITER_SAGE_CPU_ISA=scalar|avx2|avx512) is bit-exact in prepare and in band."""

import pytest
import torch
from common import BACKENDS, norm_weights, qkv, rope_tables, run_as_script, skip_no_hardware
from test_gfx1201_sage_prepare import assert_prepared_equal

import aiter_sage
from aiter_sage import ref

pytestmark = pytest.mark.skipif("cpu" not in BACKENDS, reason="no C++ compiler for the cpu backend")


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def tier(request, monkeypatch):
    monkeypatch.setenv("AITER_SAGE_CPU_ISA", request.param)
    q, k, v = qkv(1, 8, 8, 1, seed=0)
    try:
        aiter_sage.gfx1201_sage_prepare(q, k, v, backend="cpu")
    except RuntimeError as e:
        if "lacks" in str(e):
            skip_no_hardware(f"this CPU has no {request.param} tier")
        raise
    return request.param


def test_tier_prepare_bit_exact(tier):
    s = 200
    q, k, v = qkv(2, s, s, 2, seed=5)
    cos, sin = rope_tables(s, 96)
    qw, kw = norm_weights()
    kwargs = dict(q_norm_weight=qw, k_norm_weight=kw, rope_cos=cos, rope_sin=sin)
    got = aiter_sage.gfx1201_sage_prepare(q, k, v, 0.09, backend="cpu", **kwargs)
    assert_prepared_equal(got, ref.prepare(q, k, v, 0.09, **kwargs))
    q, k, v = qkv(1, 257, 31, 2, seed=6)
    assert_prepared_equal(aiter_sage.gfx1201_sage_prepare(q, k, v, 0.1, backend="cpu"),
                          ref.prepare(q, k, v, 0.1))


def test_tier_attention_in_band(tier):
    q, k, v = qkv(1, 300, 257, 2, seed=7)
    out = aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu")
    acc = ref.accuracy(out, ref.attention_fp32(q, k, v, 128 ** -0.5))
    assert ref.in_band(acc), acc


def test_unknown_tier_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("AITER_SAGE_CPU_ISA", "sse9")
    q, k, v = qkv(1, 8, 8, 1, seed=0)
    with pytest.raises(RuntimeError, match="AITER_SAGE_CPU_ISA=sse9: expected scalar, avx2 or avx512"):
        aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu")


if __name__ == "__main__":
    run_as_script(__file__)
