"""``sageattn_varlen``: SageAttention's packed variable-length call on the kernels.

Packed ``[total, H, D]`` sequences (``cu_seqlens`` their boundaries, flash-attn's form) are
laid out as a zero-padded batch ``[B, max_seqlen, H, D]`` and run with per-batch lengths
(``q_lens`` / ``kv_lens``: each entry attends over its own keys only, and its key tiles and
query rows past its lengths are skipped), then packed back. The padding copy is one pass over
Q, K and V.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import router


def _lengths(cu: torch.Tensor, total: int, max_len: int, what: str) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"aiter_sage: {what} must be a 1-D tensor [batch + 1], got {cu!r:.80}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"aiter_sage: {what} must be int32 or int64, got {cu.dtype}")
    cu = cu.to("cpu", torch.int64)
    lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lens < 0).any()) or int(cu[-1]) != total:
        raise ValueError(
            f"aiter_sage: {what} must start at 0, not decrease and end at the packed length "
            f"{total}; got {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}"
        )
    if int(lens.max()) > max_len:
        raise ValueError(
            f"aiter_sage: a sequence of {what} is longer than its max_seqlen {max_len}"
        )
    return lens


def _pad(x: torch.Tensor, lens: torch.Tensor, width: int) -> tuple[torch.Tensor, tuple]:
    """[total, H, D] -> zero-padded [B, width, H, D], and the (entry, position) of each row."""
    b = lens.numel()
    entry = torch.repeat_interleave(torch.arange(b), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(x.shape[0]) - starts[entry]
    where = (entry.to(x.device), pos.to(x.device))
    out = x.new_zeros((b, max(width, 1), *x.shape[1:]))
    out[where] = x
    return out, where


def sageattn_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool = False,
    sm_scale: Optional[float] = None,
    smooth_k: bool = True,
    *,
    backend=None,
    **kwargs,
):
    """SageAttention's ``sageattn_varlen``: q ``[total_q, Hq, D]``, k and v ``[total_k, Hkv, D]``
    (BF16/FP16), ``cu_seqlens_q``/``cu_seqlens_k`` int32/int64 ``[B + 1]`` (0, then each
    sequence's end). Sequence b's queries attend over its own keys (``is_causal``: query i sees
    its keys j <= i, top-left). Returns ``[total_q, Hq, D]``. Keyword rules as
    :func:`aiter_sage.sageattn` (SageAttention's tuning keywords are ignored, unknown ones are
    a TypeError)."""
    router.resolve_keywords("sageattn_varlen", {}, kwargs, {})
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"aiter_sage: sageattn_varlen's {name} must be [total, heads, dim]")
    lq = _lengths(cu_seqlens_q, q.shape[0], int(max_seqlen_q), "cu_seqlens_q")
    lk = _lengths(cu_seqlens_k, k.shape[0], int(max_seqlen_k), "cu_seqlens_k")
    if lq.numel() != lk.numel():
        raise ValueError("aiter_sage: cu_seqlens_q and cu_seqlens_k describe different batches")
    if v.shape[0] != k.shape[0]:
        raise ValueError("aiter_sage: sageattn_varlen's k and v have different lengths")
    qp, rows = _pad(q, lq, int(lq.max()))
    kp, _ = _pad(k, lk, int(lk.max()))
    vp, _ = _pad(v, lk, int(lk.max()))
    keys = torch.arange(kp.shape[1])
    keep = (keys[None, :] < lk[:, None])[:, None, None, :].to(q.device)  # [B, 1, 1, Skv]
    out = router.attention(
        qp,
        kp,
        vp,
        layout="NHD",
        attn_mask=keep,
        is_causal=is_causal,
        scale=sm_scale,
        enable_gqa=True,
        smooth_k=smooth_k,
        backend=backend,
        where="aiter_sage.sageattn_varlen",
        mask_with_causal=True,
        q_lens=lq.to(torch.int32),  # each entry's padding rows are not computed
    )
    return out[rows]
