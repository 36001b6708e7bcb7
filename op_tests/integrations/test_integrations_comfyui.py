"""ComfyUI's ``--use-sage-attention`` calls, exactly as comfy/ldm/modules/attention.py makes
them, through ``from sageattention import sageattn`` answered by the shim:

    sageattn(q, k, v, is_causal=False, tensor_layout="HND" | "NHD", sm_scale=s,
             smooth_k=False[, attn_mask=m])

with ComfyUI's own preparation: ``[B, S, H*D]`` inputs viewed as NHD (or ``[B, H, S, D]`` as
HND when it skips the reshape), GQA K/V heads repeated before the call, masks widened to 4-D,
and ``attn_mask`` passed only when ``inspect.signature(sageattn)`` has it.

Masks: today a masked call runs torch SDPA (the kernels take no mask yet); the tests assert the
result against FP32 SDPA with the same mask within the band, which stays the property when
masks reach the kernels. smooth_k: the shim smooths K also when ComfyUI says smooth_k=False
(the reason and the measurement: aiter_sage/integrations/sageattention_shim.py).
"""

import inspect
import logging
import sys

import pytest
import torch
import torch.nn.functional as F

import aiter_sage
from aiter_sage import ref
from aiter_sage.integrations import router, sageattention_shim

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import count_router_calls, run_as_script


@pytest.fixture
def sageattention(monkeypatch):
    """``import sageattention`` as ComfyUI does it, answered by the shim in this process."""
    if sageattention_shim.real_sageattention_installed():
        pytest.skip("a real SageAttention is installed here: the shim steps aside for it")
    added = sageattention_shim.enable_sageattention_shim()
    monkeypatch.delitem(sys.modules, "sageattention", raising=False)
    import sageattention as module

    assert module.__aiter_sage_shim__
    yield module
    sys.modules.pop("sageattention", None)
    if added:
        sageattention_shim.disable_sageattention_shim()


@pytest.fixture
def calls(monkeypatch):
    return count_router_calls(monkeypatch)


def comfy_attention_sage(sageattn, q, k, v, heads, mask=None, skip_reshape=False):
    """ComfyUI's attention_sage call form: q ``[B, S, heads*D]`` (or ``[B, heads, S, D]`` with
    ``skip_reshape``), k/v with ``heads`` or fewer heads; returns ``[B, S, heads*D]``."""
    if skip_reshape:
        b, _, _, dim_head = q.shape
        layout, h_ax = "HND", 1
    else:
        b, _, dim_head = q.shape
        dim_head //= heads
        q, k, v = (t.view(b, -1, t.shape[-1] // dim_head, dim_head) for t in (q, k, v))
        layout, h_ax = "NHD", 2
    if k.shape[h_ax] != q.shape[h_ax]:  # GQA: ComfyUI repeats the K/V heads itself
        k, v = (t.repeat_interleave(q.shape[h_ax] // t.shape[h_ax], dim=h_ax) for t in (k, v))
    if mask is not None:
        if mask.ndim == 2:  # add a batch dimension
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:  # add a heads dimension
            mask = mask.unsqueeze(1)
    extra = {}
    if mask is not None and "attn_mask" in inspect.signature(sageattn).parameters:
        extra["attn_mask"] = mask
    out = sageattn(
        q,
        k,
        v,
        is_causal=False,
        tensor_layout=layout,
        sm_scale=dim_head**-0.5,
        smooth_k=False,
        **extra,
    )
    if layout == "HND":
        out = out.transpose(1, 2)
    return out.reshape(b, -1, heads * dim_head)


def make(b=2, sq=96, skv=96, heads=4, kv_heads=4, d=64, seed=0, k_offset=0.0):
    """ComfyUI's [B, S, H*D] q, k, v; ``k_offset``: a per-channel K offset of that std (DiT
    key projections), with outlier Q channels then too."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, heads, d, generator=g)
    k = torch.randn(b, skv, kv_heads, d, generator=g)
    v = torch.randn(b, skv, kv_heads, d, generator=g)
    if k_offset:
        q[..., :4] *= 12.0
        k += k_offset * torch.randn(1, 1, kv_heads, d, generator=g)
    return tuple(t.flatten(2).bfloat16() for t in (q, k, v))


def truth(q, k, v, heads, mask=None):
    """FP32 SDPA on ComfyUI's [B, S, H*D] tensors (K/V heads repeated), the mask as given."""
    b, d = q.shape[0], q.shape[-1] // heads
    qt, kt, vt = (t.float().view(b, -1, t.shape[-1] // d, d).transpose(1, 2) for t in (q, k, v))
    kt, vt = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (kt, vt))
    if mask is not None:  # [Sq, Skv] for every batch and head; [B, Sq|1, Skv] for every head
        mask = mask[None, None] if mask.ndim == 2 else mask[:, None]
        mask = mask.float() if mask.is_floating_point() else mask  # the FP32 reference's dtype
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, -1, heads * d)


def assert_band(out, want):
    acc = ref.accuracy(out, want)
    assert not ref.band_failures(acc), (ref.band_failures(acc), acc)
    return acc


def test_signature_offers_attn_mask(sageattention):
    # ComfyUI sends masks only when sageattn's signature names attn_mask.
    assert "attn_mask" in inspect.signature(sageattention.sageattn).parameters


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("skip_reshape", [False, True], ids=["NHD", "HND"])
def test_comfyui_call_runs_the_kernels(sageattention, calls, skip_reshape, kv_heads):
    q, k, v = make(kv_heads=kv_heads, seed=kv_heads)
    args = (q, k, v)
    if skip_reshape:  # ComfyUI hands [B, H, S, D] for models that prepare heads themselves
        args = tuple(t.view(2, 96, -1, 64).transpose(1, 2) for t in args)
    with torch.no_grad():
        out = comfy_attention_sage(
            sageattention.sageattn, *args, heads=4, skip_reshape=skip_reshape
        )
    assert calls["kernel"] == 1 and not calls["fallback"]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_band(out, truth(q, k, v, 4))


@pytest.mark.parametrize("kind", ["bool_key_padding_3d", "float_additive_2d", "bf16_additive_2d"])
def test_comfyui_masks_match_sdpa(sageattention, kind):
    """Today: SDPA with the widened mask. Asserted against FP32 SDPA with the same mask, so
    the test holds when masks run on the kernels."""
    q, k, v = make(sq=64, skv=80, seed=11)
    if kind == "bool_key_padding_3d":  # [B, 1, Skv] text padding
        mask = torch.ones(2, 1, 80, dtype=torch.bool)
        mask[0, :, 57:] = False
    else:  # [Sq, Skv] additive bias with masked keys, FP32 or in the model's dtype
        mask = torch.zeros(64, 80)
        mask[:, 70:] = -torch.inf
        mask[:, :10] = -2.0
        mask = mask.to(q.dtype) if kind.startswith("bf16") else mask
    with torch.no_grad():
        out = comfy_attention_sage(sageattention.sageattn, q, k, v, heads=4, mask=mask)
    assert_band(out, truth(q, k, v, 4, mask=mask))


@pytest.fixture
def aiter_sage_log():
    """The aiter_sage logger's messages (it does not propagate to the root logger)."""
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    router.logger.addHandler(handler)
    yield messages
    router.logger.removeHandler(handler)


def test_explicit_smooth_k_false_is_smoothed(sageattention, calls, monkeypatch, aiter_sage_log):
    """DiT-like keys (a per-channel offset): ComfyUI's smooth_k=False runs the smoothed
    kernels, whose error is lower than that of the unsmoothed ones."""
    monkeypatch.setattr(sageattention_shim, "_override_noted", [])
    q, k, v = make(sq=256, skv=512, heads=4, d=128, seed=5, k_offset=3.0)
    want = truth(q, k, v, 4)
    nhd = tuple(t.view(2, -1, 4, 128) for t in (q, k, v))
    with torch.no_grad():
        comfy = comfy_attention_sage(sageattention.sageattn, q, k, v, heads=4)
        comfy2 = comfy_attention_sage(sageattention.sageattn, q, k, v, heads=4)
        smoothed = aiter_sage.sageattn(*nhd, tensor_layout="NHD", smooth_k=True).flatten(2)
        plain = aiter_sage.sageattn(*nhd, tensor_layout="NHD", smooth_k=False).flatten(2)
    assert torch.equal(comfy, smoothed) and torch.equal(comfy2, smoothed)
    err = {n: ref.accuracy(x, want)["rel_l2"] for n, x in (("smoothed", comfy), ("plain", plain))}
    assert err["smoothed"] < 0.9 * err["plain"], err  # measured: about 0.84x
    notes = [m for m in aiter_sage_log if "smooth_k=False" in m]
    assert len(notes) == 1  # one line per process, not per call
    # Positional smooth_k (SageAttention's 8th parameter) is read the same way.
    with torch.no_grad():
        positional = sageattention.sageattn(*nhd, "NHD", False, None, False, False).flatten(2)
    assert torch.equal(positional, smoothed)


if __name__ == "__main__":
    run_as_script(__file__)
