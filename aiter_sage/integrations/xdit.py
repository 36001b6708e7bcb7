"""An xDiT (xfuser) attention backend: ``--attention_backend sage_rdna4``.

    import aiter_sage.integrations.xdit as aiter_sage_xdit
    aiter_sage_xdit.register()   # before xfuser creates its pipeline (its runtime state)
    # then run with --attention_backend sage_rdna4

xDiT picks the attention function by a member of ``AttentionBackendType`` (the name given to
``--attention_backend``, upper-cased) from ``ATTENTION_FUNCTION_REGISTRY``, both in
``xfuser.core.distributed.attention_backend``. :func:`register` adds the member
``SAGE_RDNA4`` (``AITER_SAGE`` is taken: ROCm aiter's Triton SageAttention) and
registers :func:`attention` under it. xDiT has no plugin hook, so the call must come from the
program before xfuser selects its backend.

:func:`attention` has xDiT's attention-function form: ``[B, H, S, D]`` query/key/value, the
keywords ``dropout_p``, ``is_causal`` and ``attention_kwargs``, and returns ``(out, lse)``
with the natural-log LSE ``[B, H, S]`` that xDiT's ring attention (torch's
``_templated_ring_attention``) merges partial results with — causal and not. With Ulysses,
xDiT's all-to-all hands it whole sequences. Masks reach it through ``attention_kwargs``
(``attn_mask``, or ``indices_k``/``cu_seqlens_k`` for packed keys): ``attn_mask`` is honoured
(torch SDPA today), packed-key indices raise ValueError rather than being ignored.
"""

from __future__ import annotations

from . import router
from .enums import extend_enum

BACKEND_MEMBER = "SAGE_RDNA4"  # --attention_backend sage_rdna4
BACKEND_VALUE = "aiter_sage SageAttention (INT8 Q·Kᵀ, FP8 P·V)"
PACKED_KEY_ENTRIES = ("indices_k", "cu_seqlens_k")


def attention(query, key, value, dropout_p=0.0, is_causal=False, attention_kwargs=None):
    """xDiT's attention function on ``[B, H, S, D]`` tensors; returns ``(out, lse)``."""
    extra = attention_kwargs or {}
    packed = [name for name in PACKED_KEY_ENTRIES if extra.get(name) is not None]
    if packed:
        raise ValueError(
            f"aiter_sage xDiT backend: attention_kwargs {packed} (packed variable-length keys) "
            "are not supported; pick a varlen-capable --attention_backend for such models"
        )
    gqa = query.dim() == 4 and key.dim() == 4 and query.shape[1] != key.shape[1]
    return router.attention(
        query,
        key,
        value,
        layout="HND",
        attn_mask=extra.get("attn_mask"),
        dropout_p=dropout_p,
        is_causal=bool(is_causal),
        enable_gqa=gqa,
        smooth_k=True,
        return_lse=True,
        where="aiter_sage xDiT backend",
    )


def register(attention_backend=None):
    """Register :func:`attention` as xDiT's ``SAGE_RDNA4`` backend (idempotent); returns
    the ``AttentionBackendType`` member. ``attention_backend``: the module holding
    ``AttentionBackendType`` and ``ATTENTION_FUNCTION_REGISTRY`` (default: xfuser's)."""
    if attention_backend is None:
        from xfuser.core.distributed import attention_backend
    member = extend_enum(attention_backend.AttentionBackendType, BACKEND_MEMBER, BACKEND_VALUE)
    attention_backend.ATTENTION_FUNCTION_REGISTRY[member] = attention
    return member
