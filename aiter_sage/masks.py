"""Key masks as per-batch key lengths: how an SDPA-style mask reaches the kernels.

The kernels know one kind of mask besides causal: batch entry ``b`` sees its first
``kv_lens[b]`` keys (the ``kv_lens`` argument of the ops; ``csrc/include/sage/params.h``). A
boolean or additive (0 / -inf) mask that varies only along the key axis — ``[B, 1, 1, Skv]``,
``[B, H, 1, Skv]``, ``[1, 1, 1, Skv]``, ``[B, Skv]`` in diffusers' reading — becomes exactly
that, by :func:`plan`:

* **suffix padding** (each row keeps a prefix of its keys: text tokens padded to a fixed
  length, the common case): ``kv_lens[b]`` = the kept count, K and V are used in place — no
  copy, and the key tiles past each length are skipped, not computed;
* **holes** (any other pattern): the kept keys of each entry are gathered to the front of a
  new K/V (a stable compaction, so their order is kept), then as above;
* a mask that differs between heads makes each (batch, head) pair its own batch entry (the
  query heads of a GQA group ride along; K/V are expanded only when the mask differs inside a
  group);
* causal with a mask that has holes cannot be compacted (compaction moves keys, and causal
  compares positions): :func:`plan` says so and the caller runs SDPA.

A row whose keys are all masked gets 0 (and LSE -inf), as torch's SDPA gives it (torch >= 2.5;
older releases gave NaN).
Why compaction and lengths rather than a per-key bitmask in the kernels: the kernels' inner
loops stay as they are (one length per batch entry, loaded once per block; the unmasked path
is unchanged), masked key tiles cost nothing, and the compaction is one gather of K and V —
far less than the attention on them (docs/design.md, "Key masks").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class KeyMaskPlan:
    """How to run one masked call on the kernels (all tensors [B', S, H', D], NHD)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_lens: Optional[torch.Tensor]  # int32 [B'], None: every key of every entry is kept
    fold: Optional[tuple]  # (B, Hq, G): entries are (batch, head group) pairs; None: as given

    def unfold(self, out: torch.Tensor) -> torch.Tensor:
        """The kernels' output [B', Sq, G, D] back to [B, Sq, Hq, D]; rows that see no key at
        all are 0, as torch's SDPA gives them (since torch 2.5; before, NaN)."""
        if self.kv_lens is not None:
            out = out.masked_fill((self.kv_lens == 0)[:, None, None, None], 0.0)
        if self.fold is None:
            return out
        b, hq, g = self.fold
        sq, d = out.shape[1], out.shape[3]
        return out.reshape(b, hq // g, sq, g, d).permute(0, 2, 1, 3, 4).reshape(b, sq, hq, d)

    def unfold_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """The kernels' LSE [B', G, Sq] back to [B, Hq, Sq]."""
        if self.fold is None:
            return lse
        b, hq, g = self.fold
        return lse.reshape(b, hq, lse.shape[-1])


def key_mask_reason(attn_mask, batch: int, heads_q: int, q_len: int, kv_len: int) -> Optional[str]:
    """None when ``attn_mask`` (SDPA's broadcasting rules, against scores [B, Hq, Sq, Skv]) varies
    along the key axis only and is boolean or 0/-inf; else why the kernels cannot take it. Reads
    only shapes and dtypes (the values are checked by :func:`keep_of`)."""
    if not isinstance(attn_mask, torch.Tensor):
        return "attn_mask is not a tensor"
    if attn_mask.is_floating_point() is False and attn_mask.dtype != torch.bool:
        return f"attn_mask of dtype {attn_mask.dtype} (boolean or additive float masks only)"
    if attn_mask.dim() == 0 or attn_mask.dim() > 4:
        return f"a {attn_mask.dim()}-D attn_mask"
    shape = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
    want = (batch, heads_q, q_len, kv_len)
    for n, w in zip(shape, want):
        if n not in (1, w):
            return f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {want}"
    if shape[2] != 1 and q_len != 1:
        return "attn_mask varies along the queries (the kernels take key masks only)"
    if shape[3] == 1 and kv_len != 1:
        return "attn_mask does not vary along the keys"  # a per-row constant: not a key mask
    return None


def keep_of(attn_mask: torch.Tensor, batch: int, heads_q: int, kv_len: int):
    """The kept keys ``[B, Hm, Skv]`` (Hm 1 or Hq) of a key mask that passed
    :func:`key_mask_reason`, or (None, reason) when its values are not a key mask the kernels
    can take (an additive mask with values other than 0 and -inf: a bias, not a mask)."""
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    m = m[:, :, 0, :]  # [B or 1, H or 1, Skv or 1]
    if m.dtype == torch.bool:
        keep = m
    else:
        keep = m == 0
        if not bool(((m == 0) | (m == -math.inf)).all()):
            return None, "additive attn_mask with values other than 0 and -inf (a bias)"
    keep = keep.expand(batch, keep.shape[1], kv_len)
    if keep.shape[1] != 1 and bool((keep == keep[:, :1]).all()):
        keep = keep[:, :1]  # the same for every head
    return keep, None


def _is_suffix_padding(keep: torch.Tensor, lens: torch.Tensor) -> bool:
    """Each row keeps exactly its first lens[row] keys."""
    idx = torch.arange(keep.shape[-1], device=keep.device)
    return bool((keep == (idx < lens[..., None])).all())


def plan(q, k, v, keep: torch.Tensor, *, is_causal: bool = False):
    """A :class:`KeyMaskPlan` for q [B, Sq, Hq, D], k and v [B, Skv, Hkv, D] (NHD) under the
    kept keys ``keep`` [B, Hm, Skv] (Hm 1 or Hq); or (None, reason)."""
    b, sq, hq, d = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    fold = None
    if keep.shape[1] != 1:  # per head: (batch, head group) pairs become the batch entries
        per_group = keep.reshape(b, hkv, g, skv)
        if g > 1 and not bool((per_group == per_group[:, :, :1]).all()):
            # the mask differs inside a GQA group: every query head gets its own K/V
            k = k.repeat_interleave(g, dim=2)
            v = v.repeat_interleave(g, dim=2)
            hkv, g = hq, 1
            per_group = keep.reshape(b, hq, 1, skv)
        keep = per_group[:, :, 0].reshape(b * hkv, skv)
        q = q.reshape(b, sq, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b * hkv, sq, g, d)
        k, v = (t.permute(0, 2, 1, 3).reshape(b * hkv, skv, 1, d) for t in (k, v))
        fold = (b, hq, g)
    else:
        keep = keep[:, 0]
    lens = keep.sum(-1, dtype=torch.int32)
    if bool((lens == skv).all()):
        return KeyMaskPlan(q, k, v, None, fold), None
    if not _is_suffix_padding(keep, lens):
        if is_causal:
            return None, "causal with a key mask that has holes (compaction moves keys)"
        # Stable: kept keys first, in their order; the rest are past kv_lens (never read).
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
        width = max(int(lens.max()), 1)
        index = order[:, :width, None, None].expand(-1, -1, k.shape[2], d)
        k, v = (torch.gather(t, 1, index) for t in (k, v))
    return KeyMaskPlan(q, k, v, lens, fold), None
