"""aiter_sage.masks: which masks are key masks, and the plan that turns one into per-batch key
lengths (compaction for holes, folding for per-head masks) computes SDPA's answer. The plans
are checked here with FP32 torch arithmetic over the first kv_lens[b] keys of each entry (the
kernels' rule), independently of any kernel; the kernels on masked calls are tested in
test_masked_attention.py."""

import math

import pytest
import torch
import torch.nn.functional as F

from aiter_sage import masks

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import run_as_script


def nhd(b, s, h, d=32, *, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((b, s, h, d), generator=g)


def sdpa_nhd(q, k, v, mask, is_causal=False):
    hq, hkv = q.shape[2], k.shape[2]
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)),
        attn_mask=mask,
        is_causal=is_causal,
        enable_gqa=hq != hkv,
    )
    return out.transpose(1, 2)


def lengths_rule(p: masks.KeyMaskPlan, is_causal=False):
    """FP32 attention where entry b sees its first kv_lens[b] keys (NaN rows for none, which
    the plan's unfold turns into SDPA's 0)."""
    q, k, v = p.query, p.key, p.value
    bq, sq, hq, _ = q.shape
    g = hq // k.shape[2]
    kk, vv = (t.repeat_interleave(g, dim=2).transpose(1, 2) for t in (k, v))
    s = q.transpose(1, 2) @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
    keys = torch.arange(k.shape[1])
    lens = p.kv_lens if p.kv_lens is not None else torch.full((bq,), k.shape[1])
    seen = keys[None, :] < lens[:, None]  # [B', Skv]
    seen = seen[:, None, None, :].expand(-1, hq, sq, -1)
    if is_causal:
        seen = seen & (keys[None, :] <= torch.arange(sq)[:, None])
    s = s.masked_fill(~seen, -math.inf)
    return p.unfold((torch.softmax(s, -1) @ vv).transpose(1, 2))


def run_plan(q, k, v, mask, is_causal=False):
    b, sq, hq, _ = q.shape
    assert masks.key_mask_reason(mask, b, hq, sq, k.shape[1]) is None
    keep, grouping, why = masks.keep_of(mask, b, hq, k.shape[1])
    assert why is None
    p, why = masks.plan(q, k, v, keep, grouping, is_causal=is_causal)
    assert why is None, why
    return p


def suffix_mask(b, skv, lens):
    m = torch.zeros(b, 1, 1, skv, dtype=torch.bool)
    for i, n in enumerate(lens):
        m[i, ..., :n] = True
    return m


def assert_same(got, want):
    both_nan = got.isnan() & want.isnan()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.allclose(got[~both_nan], want[~both_nan], atol=1e-5, rtol=1e-5)


def test_suffix_padding_uses_k_and_v_in_place():
    q, k, v = nhd(3, 20, 2, seed=1), nhd(3, 40, 2, seed=2), nhd(3, 40, 2, seed=3)
    mask = suffix_mask(3, 40, [40, 17, 1])
    p = run_plan(q, k, v, mask)
    assert p.key.data_ptr() == k.data_ptr() and p.value.data_ptr() == v.data_ptr()  # no copy
    assert p.fold is None
    assert p.kv_lens.tolist() == [40, 17, 1] and p.kv_lens.dtype == torch.int32
    assert_same(lengths_rule(p), sdpa_nhd(q, k, v, mask))


def test_holes_are_compacted_in_order():
    q, k, v = nhd(2, 12, 2, seed=4), nhd(2, 50, 2, seed=5), nhd(2, 50, 2, seed=6)
    g = torch.Generator().manual_seed(7)
    mask = torch.rand(2, 1, 1, 50, generator=g) > 0.4
    p = run_plan(q, k, v, mask)
    assert p.kv_lens.tolist() == mask.sum(-1).flatten().tolist()
    for b in range(2):
        kept = k[b, mask[b, 0, 0]]
        assert torch.equal(p.key[b, : len(kept)], kept)  # stable: the kept keys, in order
    assert_same(lengths_rule(p), sdpa_nhd(q, k, v, mask))


@pytest.mark.parametrize("form", ["bool", "additive", "additive_bf16"])
def test_mask_forms(form):
    q, k, v = nhd(2, 8, 4, seed=8), nhd(2, 30, 2, seed=9), nhd(2, 30, 2, seed=10)
    keep = suffix_mask(2, 30, [30, 9])
    keep[1, ..., 3] = False  # a hole too
    if form == "bool":
        mask = keep
    else:
        mask = torch.zeros(keep.shape).masked_fill(~keep, -math.inf)
        if form == "additive_bf16":
            mask = mask.bfloat16()
    want = sdpa_nhd(q, k, v, mask.float() if form == "additive_bf16" else mask)
    assert_same(lengths_rule(run_plan(q, k, v, mask)), want)


def test_bsk_and_broadcast_shapes():
    q, k, v = nhd(2, 8, 2, seed=11), nhd(2, 30, 2, seed=12), nhd(2, 30, 2, seed=13)
    keep = suffix_mask(2, 30, [30, 11])
    one = keep[:1]  # [1, 1, 1, Skv]: one mask for every batch entry
    assert_same(lengths_rule(run_plan(q, k, v, one)), sdpa_nhd(q, k, v, one))
    # [B, H, 1, Skv] with the same row for every head is one entry per batch, not folded
    per_head = keep.expand(2, 2, 1, 30)
    p = run_plan(q, k, v, per_head)
    assert p.fold is None
    assert_same(lengths_rule(p), sdpa_nhd(q, k, v, per_head))


@pytest.mark.parametrize("hq,hkv,inside_group", [(4, 4, False), (4, 2, False), (4, 2, True)])
def test_per_head_masks_fold_heads_into_the_batch(hq, hkv, inside_group):
    q, k, v = nhd(2, 10, hq, seed=14), nhd(2, 24, hkv, seed=15), nhd(2, 24, hkv, seed=16)
    g = torch.Generator().manual_seed(17)
    kv_keep = torch.rand(2, hkv, 1, 24, generator=g) > 0.3
    keep = kv_keep.repeat_interleave(hq // hkv, dim=1)  # the same inside each group
    if inside_group:
        keep[0, 1, 0, 5] = not bool(keep[0, 0, 0, 5])  # differs inside group 0
    keep[..., 0] = True
    p = run_plan(q, k, v, keep)
    assert p.fold is not None
    want_g = 1 if inside_group else hq // hkv
    assert p.query.shape[2] == want_g and p.key.shape[2] == 1
    assert_same(lengths_rule(p), sdpa_nhd(q, k, v, keep))


def test_all_masked_rows_are_what_sdpa_gives():
    q, k, v = nhd(2, 6, 2, seed=18), nhd(2, 16, 2, seed=19), nhd(2, 16, 2, seed=20)
    mask = suffix_mask(2, 16, [16, 0])
    p = run_plan(q, k, v, mask)
    want = sdpa_nhd(q, k, v, mask)
    # torch >= 2.5 gives 0 for a row that sees no key (boolean or -inf masks alike)
    assert (want[1] == 0).all() and p.kv_lens.tolist() == [16, 0]
    assert_same(lengths_rule(p), want)


def test_causal_with_suffix_padding_and_refusal_with_holes():
    q, k, v = nhd(2, 20, 2, seed=21), nhd(2, 20, 2, seed=22), nhd(2, 20, 2, seed=23)
    mask = suffix_mask(2, 20, [20, 13])
    p = run_plan(q, k, v, mask, is_causal=True)
    # SDPA refuses mask + is_causal together; the same rule written as one boolean mask:
    both = mask & torch.ones(20, 20, dtype=torch.bool).tril()
    assert_same(lengths_rule(p, is_causal=True), sdpa_nhd(q, k, v, both))
    holes = mask.clone()
    holes[0, ..., 4] = False
    keep, grouping, _ = masks.keep_of(holes, 2, 2, 20)
    plan, why = masks.plan(q, k, v, keep, grouping, is_causal=True)
    assert plan is None and "holes" in why


def test_all_kept_needs_no_lengths():
    q, k, v = nhd(1, 4, 2, seed=24), nhd(1, 9, 2, seed=25), nhd(1, 9, 2, seed=26)
    p = run_plan(q, k, v, torch.ones(1, 1, 1, 9, dtype=torch.bool))
    assert p.kv_lens is None and p.key is k


@pytest.mark.parametrize(
    "mask_shape,why",
    [
        ((2, 1, 1, 29), "does not broadcast"),
        ((2, 2, 2, 1, 30), "5-D"),
    ],
)
def test_masks_that_are_not_key_masks(mask_shape, why):
    mask = torch.ones(mask_shape, dtype=torch.bool)
    assert why in masks.key_mask_reason(mask, 2, 2, 8, 30)


def test_query_rows_in_a_few_patterns_become_entries():
    """HunyuanVideo's token refiner: real rows see the real text keys, padded rows key 0 only
    (a mask that varies along the queries in two patterns per batch entry)."""
    b, s = 2, 24
    valid = torch.zeros(b, s, dtype=torch.bool)
    valid[0, :24], valid[1, :9] = True, True
    m = valid[:, None, None, :] & valid[:, None, :, None]
    m[:, :, :, 0] = True
    q, k, v = nhd(b, s, 2, seed=27), nhd(b, s, 2, seed=28), nhd(b, s, 2, seed=29)
    p = run_plan(q, k, v, m)
    assert p.rows is not None and p.query.shape[0] == 3  # entry 0: one pattern; entry 1: two
    assert_same(lengths_rule(p), sdpa_nhd(q, k, v, m))
    # A 2-D [Sq, Skv] mask (SDPA's reading) in few patterns, e.g. rows that see a prefix each:
    two = torch.ones(s, s, dtype=torch.bool)
    two[12:, 5:] = False
    assert_same(lengths_rule(run_plan(q, k, v, two)), sdpa_nhd(q, k, v, two))


def test_masks_varying_along_queries_and_heads():
    """A per-head copy of one query-varying mask (diffusers' prepare_attention_mask) is taken;
    a mask that differs between heads along the queries is refused."""
    q, k, v = nhd(1, 8, 2, seed=33), nhd(1, 8, 2, seed=34), nhd(1, 8, 2, seed=35)
    m = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    m[:, :, 4:, 6:] = False
    copied = m.expand(1, 2, 8, 8)
    assert_same(lengths_rule(run_plan(q, k, v, copied)), sdpa_nhd(q, k, v, copied))
    differs = copied.clone()
    differs[0, 1, 0, 3] = False
    keep, grouping, why = masks.keep_of(differs, 1, 2, 8)
    assert keep is None and "the queries and the heads" in why


def test_masks_varying_per_query_beyond_the_pattern_limit_are_refused():
    tril = torch.ones(30, 30, dtype=torch.bool).tril()  # causal as a mask: 30 patterns
    keep, grouping, why = masks.keep_of(tril, 1, 2, 30)
    assert keep is None and f"more than {masks.MAX_ROW_PATTERNS} row patterns" in why


def test_bias_masks_are_not_key_masks_but_padding_biases_are():
    assert "dtype" in masks.key_mask_reason(torch.ones(2, 1, 1, 30, dtype=torch.int32), 2, 2, 8, 30)
    bias = torch.zeros(2, 1, 1, 30)
    bias[..., 3] = -5.0  # a bias: the key keeps a (smaller) weight
    keep, _, why = masks.keep_of(bias, 2, 2, 30)
    assert keep is None and "a bias, not a mask" in why
    # LTX's padding: (1 - mask) * -10000 in the model's dtype, [B, H, 1, Skv]
    q, k, v = nhd(2, 8, 2, seed=30), nhd(2, 30, 2, seed=31), nhd(2, 30, 2, seed=32)
    keep01 = suffix_mask(2, 30, [30, 7]).expand(2, 2, 1, 30)
    ltx = ((1 - keep01.float()) * -10000.0).bfloat16()
    assert_same(lengths_rule(run_plan(q, k, v, ltx)), sdpa_nhd(q, k, v, ltx.float()))
    # every key of a row at -10000: one constant shift, the same as no mask at all
    # (SDPA itself loses ~1e-4 there: scores - 10000 keep fewer bits in FP32)
    allpad = torch.full((2, 1, 1, 30), -10000.0)
    p = run_plan(q, k, v, allpad)
    assert p.kv_lens is None
    assert_same(lengths_rule(p), sdpa_nhd(q, k, v, None))
    assert torch.allclose(lengths_rule(p), sdpa_nhd(q, k, v, allpad), atol=1e-3)


if __name__ == "__main__":
    run_as_script(__file__)
