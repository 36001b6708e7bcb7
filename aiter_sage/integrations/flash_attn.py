"""flash-attn's ``flash_attn_func`` call form on aiter_sage's router (``[B, S, H, D]``).

What the Kernels Hub package offers next to ``sageattn`` (diffusers' ``aiter_fa2_hub`` backend
calls ``flash_attn_func(q=, k=, v=, dropout_p=, softmax_scale=, causal=, return_lse=)``), and
what flash-attn callers such as ring-attention libraries reach. Calls the kernels cannot
serve (dropout, FP32, D > 128, ...) run torch SDPA, as every integration does.

flash-attn's options that select attention variants aiter_sage does not implement (sliding
window, softcapping, ALiBi) are accepted only at their neutral values; any other value raises
ValueError naming it: no option is ignored.
"""

from __future__ import annotations

from . import router

NO_WINDOW = router.FLASH_ATTN_NEUTRAL["window_size"]
NO_SOFTCAP = router.FLASH_ATTN_NEUTRAL["softcap"]


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=NO_WINDOW,
    softcap=NO_SOFTCAP,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    return_lse=False,
    backend=None,
):
    """flash-attn's ``flash_attn_func`` on ``[B, S, H, D]`` tensors (Hq a multiple of Hkv).

    Returns the output; with ``return_lse`` (aiter's spelling) ``(out, lse)``, with
    ``return_attn_probs`` (flash-attn's) ``(out, lse, None)``: the natural-log LSE, FP32
    ``[B, Hq, Sq]``, and no attention probabilities (aiter_sage never forms them).
    ``deterministic`` is accepted: the forward pass is deterministic. ``backend=`` as for
    :func:`aiter_sage.sageattn`."""
    router.check_flash_attn_neutral(
        "flash_attn_func",
        dict(window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes),
        error=ValueError,
    )
    del deterministic  # the forward pass is deterministic whatever is asked
    want_lse = bool(return_lse or return_attn_probs)
    gqa = all(hasattr(t, "dim") and t.dim() == 4 for t in (q, k)) and q.shape[2] != k.shape[2]
    res = router.attention(
        q,
        k,
        v,
        layout="NHD",
        dropout_p=dropout_p,
        is_causal=bool(causal),
        scale=softmax_scale,
        enable_gqa=gqa,
        smooth_k=True,
        return_lse=want_lse,
        backend=backend,
        where="aiter_sage.flash_attn_func",
    )
    if return_attn_probs:
        return res[0], res[1], None
    return res
