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
    fused = (*norm_weights(), *rope_tables(s, 96))
    got = aiter_sage.gfx1201_sage_prepare(q, k, v, 0.09, *fused, backend="cpu")
    assert_prepared_equal(got, ref.prepare(q, k, v, 0.09, *fused))
    q, k, v = qkv(1, 257, 31, 2, seed=6)
    assert_prepared_equal(aiter_sage.gfx1201_sage_prepare(q, k, v, 0.1, backend="cpu"),
                          ref.prepare(q, k, v, 0.1))


def test_tier_attention_in_band(tier):
    q, k, v = qkv(1, 300, 257, 2, seed=7)
    out = aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu")
    acc = ref.accuracy(out, ref.attention_fp32(q, k, v, 128 ** -0.5))
    assert ref.in_band(acc), acc


def _nonfinite_rows(x):
    return ~torch.isfinite(x.float()).all(-1)


@pytest.mark.parametrize("where", ["k_neg_inf", "k_nan", "q_nan", "v_inf"])
def test_tier_non_finite_inputs_agree_with_ref(tier, where):
    """Every tier makes exactly ref.py's rows non-finite, and its finite rows match ref's
    model (the SIMD max and exp2 used to drop a NaN score and return finite wrong rows)."""
    q, k, v = qkv(1, 128, 128, 1, seed=8)
    tensor, value = {"k_neg_inf": (k, -float("inf")), "k_nan": (k, float("nan")),
                     "q_nan": (q, float("nan")), "v_inf": (v, float("inf"))}[where]
    tensor[0, 5, 0, 7] = value
    out = aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu")
    prep = ref.prepare(q, k, v)
    want = ref.attention_from_prepared(prep, 128, fp8_p=False)
    bad = _nonfinite_rows(want)
    assert bad.any()
    assert torch.equal(_nonfinite_rows(out), bad)
    if not bad.all():
        assert ref.accuracy(out[~bad], want[~bad])["rel_l2"] < 5e-3


def test_tier_keeps_subnormal_outputs(tier):
    """V of BF16 subnormals: the outputs are subnormal too, not flushed to zero."""
    q, k, v = qkv(1, 64, 64, 1, seed=9)
    v = (v.float() * 1e-39).to(torch.bfloat16)
    out = aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu")
    want = ref.attention_from_prepared(ref.prepare(q, k, v), 64, fp8_p=False)
    assert out.float().abs().max() > 0
    assert ref.accuracy(out, want)["rel_l2"] < 2e-2


def test_unknown_tier_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("AITER_SAGE_CPU_ISA", "sse9")
    q, k, v = qkv(1, 8, 8, 1, seed=0)
    with pytest.raises(RuntimeError, match="AITER_SAGE_CPU_ISA=sse9: expected scalar, avx2 or avx512"):
        aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu")


if __name__ == "__main__":
    run_as_script(__file__)
