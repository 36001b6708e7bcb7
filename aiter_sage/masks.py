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
* a mask whose query rows take a few distinct patterns (at most ``MAX_ROW_PATTERNS`` per batch
  entry: HunyuanVideo's token refiner masks real rows by the text length and padded rows down
  to key 0) makes each (batch, pattern) pair its own entry holding the rows of that pattern;
* additive masks: 0 keeps a key, -inf or anything ``MASKED_BIAS_GAP`` or more below the row's
  largest value masks it (a row's scores move by one constant, which the softmax removes:
  LTX's -10000 padding bias is a key mask); other values are a bias, not a mask;
* causal with a mask that has holes, or with a mask that varies along the queries, cannot be
  compacted (compaction moves keys, and causal compares positions): :func:`plan` says so and
  the caller runs SDPA.

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
    # Query-row grouping (masks that vary along the queries): (batch, row) of each real row
    # and its (entry, slot) in the kernels' batch; None: entry b holds batch b's rows.
    rows: Optional[tuple] = None
    shape: tuple = ()  # (B, Sq, Hq, D) of the call

    def _unfold_heads(self, out: torch.Tensor) -> torch.Tensor:
        if self.fold is None:
            return out
        b, hq, g = self.fold
        sq, d = out.shape[1], out.shape[3]
        return out.reshape(b, hq // g, sq, g, d).permute(0, 2, 1, 3, 4).reshape(b, sq, hq, d)

    def unfold(self, out: torch.Tensor) -> torch.Tensor:
        """The kernels' output [B', R, G, D] back to [B, Sq, Hq, D]; rows that see no key at all
        are 0, as torch's SDPA gives them (since torch 2.5; before, NaN)."""
        if self.kv_lens is not None:
            out = out.masked_fill((self.kv_lens == 0)[:, None, None, None], 0.0)
        out = self._unfold_heads(out)
        if self.rows is None:
            return out
        (bi, qi), (ei, ri) = self.rows
        full = out.new_zeros(self.shape)
        full[bi, qi] = out[ei, ri]
        return full

    def unfold_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """The kernels' LSE [B', G, R] back to [B, Hq, Sq]."""
        if self.fold is not None:
            b, hq, g = self.fold
            lse = lse.reshape(b, hq, lse.shape[-1])
        if self.rows is None:
            return lse
        (bi, qi), (ei, ri) = self.rows
        b, sq, hq, _ = self.shape
        full = lse.new_full((b, hq, sq), -math.inf)
        full[bi, :, qi] = lse[ei, :, ri]
        return full


# Distinct query-row patterns of one batch entry that become entries of their own; more than
# this (a mask that truly varies per query, e.g. block-sparse or sliding-window) runs SDPA.
MAX_ROW_PATTERNS = 4
# An additive mask value this far below its row's largest value weighs exp(-1000) relative to
# it: below FP32's smallest subnormal unless the row's scores span more than ~900 (they span
# tens): exactly a masked key in FP32 arithmetic. diffusers' padding bias is -10000.
MASKED_BIAS_GAP = 1000.0


def check_mask(attn_mask, batch, heads_q, q_len, kv_len, device, where: str) -> None:
    """Raises TypeError / ValueError naming what is wrong with a mask no attention could take
    (the entry points that take masks as SageAttention's do check them up front)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"{where}: attn_mask is not a tensor ({type(attn_mask).__name__})")
    if not attn_mask.is_floating_point() and attn_mask.dtype != torch.bool:
        raise TypeError(
            f"{where}: attn_mask of dtype {attn_mask.dtype}: boolean (True keeps a key) or "
            f"additive float masks only"
        )
    if attn_mask.device != device:
        raise ValueError(
            f"{where}: attn_mask is on device {attn_mask.device}, the inputs on {device}"
        )
    why = _shape_problem(attn_mask, (batch, heads_q, q_len, kv_len))
    if why:
        raise ValueError(f"{where}: {why}")


def _shape_problem(attn_mask, want) -> Optional[str]:
    if attn_mask.dim() == 0 or attn_mask.dim() > 4:
        return f"a {attn_mask.dim()}-D attn_mask"
    shape = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
    for n, w in zip(shape, want):
        if n not in (1, w):
            return f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {want}"
    return None


def key_mask_reason(attn_mask, batch: int, heads_q: int, q_len: int, kv_len: int) -> Optional[str]:
    """None when ``attn_mask`` (SDPA's broadcasting rules, against scores [B, Hq, Sq, Skv]) may
    run on the kernels as key masks — boolean or additive; whether its values vary only along
    the keys (or along the queries in a few row patterns, the same for every head) is
    :func:`keep_of`'s to find; else why not. Reads only shapes and dtypes."""
    if not isinstance(attn_mask, torch.Tensor):
        return "attn_mask is not a tensor"
    if not attn_mask.is_floating_point() and attn_mask.dtype != torch.bool:
        return f"attn_mask of dtype {attn_mask.dtype} (boolean or additive float masks only)"
    why = _shape_problem(attn_mask, (batch, heads_q, q_len, kv_len))
    if why:
        return why
    return None


def _keep_of_values(m: torch.Tensor):
    """Kept keys of mask values ``m`` [..., Skv], or (None, reason) for a bias."""
    if m.dtype == torch.bool:
        return m, None
    mf = m.float()
    top = mf.amax(-1, keepdim=True)
    keep = mf == top
    masked = (mf <= top - MASKED_BIAS_GAP) | (mf == -math.inf)
    if not bool((keep | masked).all()):
        return None, (
            f"additive attn_mask with values that are neither its row's largest nor "
            f"{MASKED_BIAS_GAP:g} below it (a bias, not a mask)"
        )
    return keep & (top > -math.inf), None


def keep_of(attn_mask: torch.Tensor, batch: int, heads_q: int, kv_len: int):
    """(keep, rows, None): the kept keys ``keep`` [B', Hm, Skv] (Hm 1 or Hq) of a mask that passed
    :func:`key_mask_reason`, and ``rows`` — None when the mask does not vary along the queries,
    else (entry_of_batch [B'], row_index [B', R], row_count [B']) grouping each batch entry's
    query rows by pattern; or (None, None, reason)."""
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    keep, why = _keep_of_values(m)
    if why:
        return None, None, why
    if keep.shape[2] == 1:
        keep = keep[:, :, 0, :].expand(batch, keep.shape[1], kv_len)
        if keep.shape[1] != 1 and bool((keep == keep[:, :1]).all()):
            keep = keep[:, :1]  # the same for every head
        return keep, None, None
    if keep.shape[1] != 1:  # e.g. prepare_attention_mask's copy per head
        if not bool((keep == keep[:, :1]).all()):
            return None, None, "attn_mask varies along the queries and the heads"
    keep = keep[:, 0].expand(batch, keep.shape[2], kv_len)  # [B, Sq, Skv], one for every head
    entries, rows, counts, patterns = [], [], [], []
    for b in range(batch):
        uniq, inverse = torch.unique(keep[b], dim=0, return_inverse=True)
        if uniq.shape[0] > MAX_ROW_PATTERNS:
            return (
                None,
                None,
                (
                    f"attn_mask varies along the queries in more than {MAX_ROW_PATTERNS} "
                    f"row patterns"
                ),
            )
        for u in range(uniq.shape[0]):
            idx = (inverse == u).nonzero().flatten()
            entries.append(b)
            rows.append(idx)
            counts.append(idx.numel())
            patterns.append(uniq[u])
    width = max(counts)
    row_index = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])
    keep = torch.stack(patterns)[:, None, :]
    grouping = (torch.tensor(entries), row_index, torch.tensor(counts))
    return keep, grouping, None


def _is_suffix_padding(keep: torch.Tensor, lens: torch.Tensor) -> bool:
    """Each row keeps exactly its first lens[row] keys."""
    idx = torch.arange(keep.shape[-1], device=keep.device)
    return bool((keep == (idx < lens[..., None])).all())


def _group_rows(q, k, v, grouping):
    """Each (batch, row pattern) entry's query rows gathered into an entry of its own (padded
    with row 0 of its batch entry, whose results are dropped), with its batch entry's K and V."""
    entry_of, row_index, counts = grouping
    slots = torch.arange(row_index.shape[1])
    real = slots[None, :] < counts[:, None]  # [B', R]
    ei, ri = real.nonzero(as_tuple=True)
    rows = (
        (entry_of[ei].to(q.device), row_index[ei, ri].to(q.device)),
        (ei.to(q.device), ri.to(q.device)),
    )
    dev_entry, dev_rows = entry_of.to(q.device), row_index.to(q.device)
    qg = q[dev_entry[:, None], dev_rows]  # [B', R, Hq, D]
    return qg, k[dev_entry], v[dev_entry], rows


def plan(q, k, v, keep: torch.Tensor, grouping=None, *, is_causal: bool = False):
    """A :class:`KeyMaskPlan` for q [B, Sq, Hq, D], k and v [B, Skv, Hkv, D] (NHD) under the
    kept keys ``keep`` [B', Hm, Skv] (Hm 1 or Hq) and :func:`keep_of`'s row ``grouping``; or
    (None, reason)."""
    shape = tuple(q.shape)
    rows = None
    if grouping is not None:
        if is_causal:
            return None, "causal with a mask that varies along the queries"
        q, k, v, rows = _group_rows(q, k, v, grouping)
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
    keep = keep.to(k.device)
    lens = keep.sum(-1, dtype=torch.int32)
    if bool((lens == skv).all()):
        return KeyMaskPlan(q, k, v, None, fold, rows, shape), None
    if _is_suffix_padding(keep, lens):
        width = max(int(lens.max()), 1)  # keys no entry keeps: not even prepared (a view)
        k, v = k[:, :width], v[:, :width]
    else:
        if is_causal:
            return None, "causal with a key mask that has holes (compaction moves keys)"
        # Stable: kept keys first, in their order; the rest are past kv_lens (never read).
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
        width = max(int(lens.max()), 1)
        index = order[:, :width, None, None].expand(-1, -1, k.shape[2], d)
        k, v = (torch.gather(t, 1, index) for t in (k, v))
    return KeyMaskPlan(q, k, v, lens, fold, rows, shape), None
