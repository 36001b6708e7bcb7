"""Routing attention calls: the kernels where they can serve a call, torch SDPA where not.

Two entry points share one router:

* :func:`sageattn` — SageAttention's ``sageattn(q, k, v, tensor_layout="HND", ...)``;
* :func:`sdpa` — a drop-in for ``torch.nn.functional.scaled_dot_product_attention``, and
  :func:`route_sdpa`, a context manager that routes a model's SDPA calls through it.

A call goes to ``torch.ops.aiter.gfx1201_sage_attention`` only when every property the
kernels need holds; the checks read only static properties (dtypes, ranks, head dims, devices,
flags; a mask's values only outside torch.compile), so ``torch.compile(fullgraph=True)``
traces through them. Key masks run on the kernels as per-entry key lengths
(:mod:`aiter_sage.masks`). Everything else — a mask that varies along the queries, a bias,
dropout, FP32, D > 128 or not a multiple of 8, a device no backend serves, head counts that
are not a GQA group, inputs that need a gradient — runs through torch SDPA, with one log line
per distinct reason. SDPA then raises whatever it raises for that call (a call SDPA accepts
never raises here).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from typing import Optional

import torch
import torch.nn.functional as F

from .. import backends, env, guards, jit_driver, masks, ops, ref
from ..log import logger

_SAGE_DTYPES = (torch.bfloat16, torch.float16)
# The original torch function, whatever F.scaled_dot_product_attention is later patched to.
_TORCH_SDPA = torch._C._nn.scaled_dot_product_attention
_LSE_CHUNK = 1024


# ----------------------------------------------------------------------------------------------
# Fallback log: one line per distinct reason (not while torch.compile traces: logging there
# would break the graph).
# ----------------------------------------------------------------------------------------------
_logged: set = set()


def _log_fallback(where: str, reason: str) -> None:
    if torch.compiler.is_compiling():
        return
    key = (where, reason)
    if key in _logged:
        return
    _logged.add(key)
    logger.info("%s: %s; running torch SDPA for such calls", where, reason)


# ----------------------------------------------------------------------------------------------
# Eligibility
# ----------------------------------------------------------------------------------------------
def _device_unsupported_uncached(device_type: str, index: int, backend: str) -> str:
    """'' when a backend serves this device, else why not. A backend *named* by the call or by
    $AITER_SAGE_BACKEND is the caller's choice, so a name that is unknown, or that cannot serve
    this device, raises ValueError instead of quietly running torch SDPA; only the automatic
    choice falls back (a device no backend serves, a missing compiler)."""
    dev = torch.device(device_type) if index < 0 else torch.device(device_type, index)
    named = backends.requested(backend or None)  # an unknown name raises
    try:
        b = backends.select(dev, named or None)
        target = b.target(dev)
        if b.device_type == "cpu":
            jit_driver.toolchain_for(target)
    except (ValueError, jit_driver.CompilerNotFound) as e:
        if named:
            raise ValueError(
                f"aiter_sage: backend {named!r} cannot serve these {dev} tensors: {e}"
            ) from None
        return f"no aiter_sage backend for {dev} ({e})"
    return ""


_device_cache: dict = {}


def _assume_constant_result(fn):
    """torch.compiler.assume_constant_result without importing torch._dynamo (2 s) at import
    time: that function only sets this attribute; the public one is used when dynamo is
    already loaded. test_integrations_sdpa's fullgraph tests trace through the marked call."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _device_unsupported(device_type: str, index: int, backend: str) -> str:
    """'' when a backend serves tensors on this device, else why not (cached per device,
    requested backend and $AITER_SAGE_BACKEND)."""
    key = (device_type, index, backend, env.get(backends.ENV_BACKEND))
    if key not in _device_cache:
        _device_cache[key] = _device_unsupported_uncached(device_type, index, backend)
    return _device_cache[key]


@_assume_constant_result
def _named_backend(backend: str) -> str:
    """The backend a call names (its argument, else $AITER_SAGE_BACKEND), normalised; '' for
    the automatic choice. An unknown name raises ValueError, whatever else the call holds."""
    return backends.requested(backend or None)


def fallback_reason(
    q,
    k,
    v,
    *,
    layout: str,
    attn_mask=None,
    dropout_p=0.0,
    scale=None,
    gqa_ok=True,
    backend=None,
    is_causal=False,
    mask_with_causal=False,
) -> Optional[str]:
    """None when the kernels serve the call, else the reason (static properties only).

    ``layout``: "HND" ([B, H, S, D], SDPA's) or "NHD" ([B, S, H, D], the kernels'). ``gqa_ok``:
    whether fewer key/value heads than query heads are allowed (SDPA: ``enable_gqa``). A mask
    that varies along the keys only is eligible (:mod:`aiter_sage.masks`; its values are read
    later, by :func:`attention`); ``mask_with_causal``: whether a mask may come with
    ``is_causal`` (SageAttention's call; SDPA refuses the pair). A backend name that is
    unknown, or names a backend that cannot serve the tensors' device, raises ValueError (the
    caller chose it), whether or not the call is otherwise eligible."""
    named = _named_backend(backend or "")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "query/key/value are not all tensors"
    if named:  # raises now if the named backend cannot serve q's device
        _device_unsupported(q.device.type, -1 if q.device.index is None else q.device.index, named)
    if not (isinstance(dropout_p, (int, float)) and dropout_p == 0.0):
        return "dropout_p > 0 (the kernels have no dropout)"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "inputs are not 4-D"
    if any(t.is_nested or t.layout != torch.strided for t in (q, k, v)):
        return "nested or non-strided inputs"
    if q.dtype not in _SAGE_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}/{k.dtype}/{v.dtype} (the kernels take BF16 or FP16, one dtype)"
    if k.device != q.device or v.device != q.device:
        return "inputs on different devices"
    d = q.shape[-1]
    if k.shape[-1] != d or v.shape[-1] != d:
        return "key/value head dims differ from the query's"
    if not ref.head_dim_supported(d):
        return f"head dim {d} (the kernels take multiples of 8 up to 128)"
    h_ax, s_ax = (1, 2) if layout == "HND" else (2, 1)
    hq, hkv = q.shape[h_ax], k.shape[h_ax]
    if (
        k.shape[0] != q.shape[0]
        or v.shape[0] != q.shape[0]
        or v.shape[h_ax] != hkv
        or v.shape[s_ax] != k.shape[s_ax]
    ):
        return "query/key/value shapes do not line up"
    if hq % hkv != 0:
        return f"{hq} query heads are not a multiple of {hkv} key/value heads"
    if hq != hkv and not gqa_ok:
        return "fewer key/value heads than query heads without enable_gqa"
    if any(n == 0 for t in (q, k, v) for n in t.shape):
        return "empty inputs"
    if attn_mask is not None:
        why = _mask_reason(attn_mask, q, k, s_ax, hq, is_causal, mask_with_causal)
        if why:
            return why
    if scale is not None and not (isinstance(scale, (int, float)) and 0 < scale < math.inf):
        return "scale is not a positive finite number"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return "inputs require grad (the kernels are inference-only)"
    why = _device_unsupported(
        q.device.type, -1 if q.device.index is None else q.device.index, backend or ""
    )
    return why or None


def _mask_reason(attn_mask, q, k, s_ax, hq, is_causal, mask_with_causal) -> Optional[str]:
    if torch.compiler.is_compiling():
        return "attn_mask under torch.compile (the mask's values choose the kernels' plan)"
    if is_causal and not mask_with_causal:
        return "attn_mask with is_causal (SDPA's rule: one or the other)"
    if isinstance(attn_mask, torch.Tensor) and attn_mask.device != q.device:
        return "attn_mask on another device than the inputs"
    return masks.key_mask_reason(attn_mask, q.shape[0], hq, q.shape[s_ax], k.shape[s_ax])


def _key_mask_plan(q, k, v, layout, attn_mask, is_causal):
    """(plan, None) for an eligible masked call, or (None, why the kernels cannot take it)."""
    qn, kn, vn = (_to_nhd(t, layout) for t in (q, k, v))
    keep, grouping, why = masks.keep_of(attn_mask, qn.shape[0], qn.shape[2], kn.shape[1])
    if why:
        return None, why
    return masks.plan(qn, kn, vn, keep, grouping, is_causal=bool(is_causal))


def _with_causal(attn_mask, sq: int, skv: int):
    """One SDPA mask for a mask and the causal rule together (query i sees keys j <= i)."""
    tril = torch.ones(sq, skv, dtype=torch.bool, device=attn_mask.device).tril()
    if attn_mask.dtype == torch.bool:
        return attn_mask & tril
    return attn_mask.masked_fill(~tril, -math.inf)


# ----------------------------------------------------------------------------------------------
# The two paths
# ----------------------------------------------------------------------------------------------
# The Q scale granularity of every routed call: one scale per 16 query rows, SageAttention2's
# on Hopper, where the ops keep upstream's 32 (the op contract). On DiT-like inputs with smooth_k
# (what the integrations pass) the output's rel L2 drops from 0.0581 / 0.0588 to 0.0556 / 0.0566
# at S 4k / 16k (SageAttention2: 0.0560 / 0.0571) at the same speed: one H100 run, 536 / 696 vs
# 537 / 704 TFLOPS (docs/perf/2026-12-06-prepare-smooth-and-host-overhead.md); the gfx12 model
# predicts the same (docs/perf/2026-12-02-q-scale-rows.md).
ROUTED_Q_SCALE_ROWS = 16


def _to_nhd(t, layout):
    t = t.transpose(1, 2) if layout == "HND" else t
    return t if t.stride(-1) == 1 else t.contiguous()


def kernel_attention(
    q, k, v, *, layout, is_causal, scale, smooth_k, return_lse, backend=None, plan=None, q_lens=None
):
    """The kernels on an eligible call; output in ``layout``, LSE FP32 [B, Hq, Sq]. ``plan``: a
    key mask's :class:`aiter_sage.masks.KeyMaskPlan` (its tensors replace q, k, v). ``q_lens``:
    int32 [B] real query rows of each entry (packed sequences): rows past them are not computed
    and come back zero; used only where the plan keeps the batch as it is."""
    if not torch.compiler.is_compiling():
        ops._register()
    if plan is not None:
        qn, kn, vn = plan.query, plan.key, plan.value
    else:
        qn, kn, vn = (_to_nhd(t, layout) for t in (q, k, v))
    scale = None if scale is None else float(scale)
    if not torch.compiler.is_compiling() and ops.check_enabled():
        guards.warn_outlier_blocks(
            qn, kn, smooth_k=bool(smooth_k), q_scale_rows=ROUTED_Q_SCALE_ROWS,
            op="aiter_sage attention",
        )  # fmt: skip
    kw = dict(
        is_causal=bool(is_causal), smooth_k=bool(smooth_k), q_scale_rows=ROUTED_Q_SCALE_ROWS,
        backend=backend,
    )  # fmt: skip
    if plan is not None and plan.kv_lens is not None:
        kw["kv_lens"] = plan.kv_lens.to(qn.device)
    if q_lens is not None and (plan is None or (plan.fold is None and plan.rows is None)):
        kw["q_lens"] = q_lens.to(qn.device)
    aiter = torch.ops.aiter
    if return_lse:
        out, lse = aiter.gfx1201_sage_attention_lse(qn, kn, vn, scale, **kw)
    else:
        out, lse = aiter.gfx1201_sage_attention(qn, kn, vn, scale, **kw), None
    if plan is not None:
        out = plan.unfold(out)
        lse = None if lse is None else plan.unfold_lse(lse)
    if layout == "HND":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def torch_sdpa():
    """Torch's SDPA: the function route_sdpa found on entry, else the current one (never ours)."""
    fn = _saved_sdpa if _saved_sdpa is not None else F.scaled_dot_product_attention
    return _TORCH_SDPA if fn is sdpa else fn


def torch_lse(q, k, *, scale=None, is_causal=False, attn_mask=None, chunk=_LSE_CHUNK):
    """Natural-log LSE of the scaled scores, FP32 [B, Hq, Sq], from [B, H, S, D] inputs, in
    query chunks (SDPA's masking rules: a boolean mask keeps True, a float mask is added;
    causal is top-left aligned; GQA groups consecutive query heads)."""
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else float(scale)
    qf, kf = q.float(), k.float()
    if kf.shape[-3] != qf.shape[-3]:
        kf = kf.repeat_interleave(qf.shape[-3] // kf.shape[-3], dim=-3)
    sq, skv = qf.shape[-2], kf.shape[-2]
    out = []
    for i in range(0, sq, chunk):
        s = (qf[..., i : i + chunk, :] @ kf.transpose(-1, -2)) * scale
        if is_causal:
            rows = torch.arange(i, i + s.shape[-2], device=s.device)[:, None]
            cols = torch.arange(skv, device=s.device)[None, :]
            s = s.masked_fill(cols > rows, -math.inf)
        if attn_mask is not None:
            m = attn_mask
            if m.dim() >= 2 and m.shape[-2] != 1:
                m = m[..., i : i + chunk, :]
            s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.float()
        out.append(torch.logsumexp(s, dim=-1))
    return torch.cat(out, dim=-1)


def sdpa_fallback(q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    """Torch SDPA on [B, H, S, D] (and the LSE computed with torch when asked)."""
    kw = {} if not enable_gqa else {"enable_gqa": True}
    out = torch_sdpa()(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw
    )
    if not return_lse:
        return out
    with torch.no_grad():
        lse = torch_lse(q, k, scale=scale, is_causal=is_causal, attn_mask=attn_mask)
    return out, lse


# ----------------------------------------------------------------------------------------------
# Keyword rules shared by every entry point: no argument is ever dropped unread
# ----------------------------------------------------------------------------------------------
# SageAttention's tuning keywords: they choose among *its* kernels (quantization granularity
# and backend, accumulator types, V smoothing); aiter_sage runs its own, so they are accepted
# and ignored. Every other unknown keyword is a TypeError.
SAGEATTN_TUNING_KEYWORDS = (
    "qk_quant_gran",
    "qk_quant_dtype",
    "quantization_backend",
    "pv_accum_dtype",
    "smooth_v",
)
# flash-attn's names for two arguments (yunchang's ring and Ulysses paths pass them to
# sageattn): alias -> the entry point's own parameter. sdpa and the diffusers backend call the
# scale `scale`.
SAGEATTN_ALIASES = {"causal": "is_causal", "softmax_scale": "sm_scale"}
# flash-attn options that ring-attention libraries pass with every call (yunchang's ring
# forward: window_size, softcap, alibi_slopes, return_softmax; flash-attn's own signature also
# has deterministic and return_attn_probs), each at the value that leaves attention unchanged.
# They are read: the neutral value is accepted, any other raises (the kernels have no sliding
# window, softcapping, ALiBi or probabilities). deterministic: any value (the forward pass is).
ANY_VALUE = object()
FLASH_ATTN_NEUTRAL = {
    "window_size": (-1, -1),
    "softcap": 0.0,
    "alibi_slopes": None,
    "return_softmax": False,
    "return_attn_probs": False,
    "deterministic": ANY_VALUE,
}


def _is_neutral(name: str, value) -> bool:
    neutral = FLASH_ATTN_NEUTRAL[name]
    if neutral is ANY_VALUE:
        return True
    if isinstance(neutral, tuple):
        return isinstance(value, (tuple, list)) and tuple(value) == neutral
    if neutral is None:
        return value is None
    return not isinstance(value, torch.Tensor) and value == neutral


def check_flash_attn_neutral(where: str, options: dict, error=TypeError) -> None:
    """Raise ``error`` naming the first flash-attn option of ``options`` that is not at its
    neutral value (FLASH_ATTN_NEUTRAL)."""
    for name, value in options.items():
        if not _is_neutral(name, value):
            raise error(
                f"{where}(): flash-attn option {name!r} is {value!r}: aiter_sage's kernels have "
                f"no such variant and take it only at {FLASH_ATTN_NEUTRAL[name]!r}"
            )


SDPA_ALIASES = {"causal": "is_causal", "softmax_scale": "scale", "sm_scale": "scale"}


class _Unset:
    """The default of a parameter that has an alias: tells "not given" from "given as the
    default", so that an alias beside its parameter is a TypeError even when the two agree
    with the default. Shows as the default in help() and inspect.signature."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return repr(self.value)


_FALSE_UNLESS_GIVEN = _Unset(False)
_NONE_UNLESS_GIVEN = _Unset(None)


def resolve_keywords(where: str, given: dict, extra: dict, aliases: dict) -> dict:
    """The values of ``given`` (parameter -> value or :class:`_Unset`) after reading ``extra``
    (the call's ``**kwargs``): an alias sets its parameter (TypeError if both are given), a
    SageAttention tuning keyword is ignored, a flash-attn option is accepted at its neutral value
    (FLASH_ATTN_NEUTRAL; another value is a TypeError), anything else is a TypeError naming it."""
    extra = dict(extra)
    for alias, name in aliases.items():
        if alias not in extra or name not in given:
            continue
        value = extra.pop(alias)
        if not isinstance(given[name], _Unset):
            raise TypeError(f"{where}() got {name!r} and its alias {alias!r}: pass one of the two")
        given[name] = value
    check_flash_attn_neutral(
        where, {k: extra.pop(k) for k in list(extra) if k in FLASH_ATTN_NEUTRAL}
    )
    unknown = sorted(k for k in extra if k not in SAGEATTN_TUNING_KEYWORDS)
    if unknown:
        known = sorted({*given, *aliases})
        raise TypeError(
            f"{where}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))} "
            f"(it takes {', '.join(known)}; SageAttention's tuning keywords "
            f"{', '.join(SAGEATTN_TUNING_KEYWORDS)} are accepted and ignored)"
        )
    return {k: (v.value if isinstance(v, _Unset) else v) for k, v in given.items()}


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------
def attention(
    q,
    k,
    v,
    *,
    layout="HND",
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=True,
    smooth_k=True,
    return_lse=False,
    backend=None,
    where="aiter_sage",
    mask_with_causal=False,
    strict_mask=False,
    q_lens=None,
):
    """The router on ``layout`` tensors ("HND" [B, H, S, D] or "NHD" [B, S, H, D]): kernels or
    SDPA. Returns the output in ``layout`` (and the LSE, FP32 [B, Hq, Sq]). A key mask runs on
    the kernels as per-batch key lengths (:mod:`aiter_sage.masks`); ``strict_mask``: a mask no
    attention could take (not a tensor, an integer dtype, another device, a shape that does not
    broadcast) raises TypeError / ValueError naming it, instead of whatever SDPA raises."""
    if (
        strict_mask
        and attn_mask is not None
        and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k))
    ):
        h_ax, s_ax = (1, 2) if layout == "HND" else (2, 1)
        masks.check_mask(
            attn_mask, q.shape[0], q.shape[h_ax], q.shape[s_ax], k.shape[s_ax], q.device, where
        )
    why = fallback_reason(
        q,
        k,
        v,
        layout=layout,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        scale=scale,
        gqa_ok=enable_gqa,
        backend=backend,
        is_causal=is_causal,
        mask_with_causal=mask_with_causal,
    )
    plan = None
    if why is None and attn_mask is not None:
        plan, why = _key_mask_plan(q, k, v, layout, attn_mask, is_causal)
    if why is None:
        return kernel_attention(
            q,
            k,
            v,
            layout=layout,
            is_causal=is_causal,
            scale=scale,
            smooth_k=smooth_k,
            return_lse=return_lse,
            backend=backend,
            plan=plan,
            q_lens=q_lens,
        )
    _log_fallback(where, why)
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2) if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    if mask_with_causal and is_causal and isinstance(attn_mask, torch.Tensor):
        attn_mask, is_causal = _with_causal(attn_mask, q.shape[-2], k.shape[-2]), False
    res = sdpa_fallback(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        return_lse=return_lse,
    )
    if layout == "NHD":
        if return_lse:
            return res[0].transpose(1, 2), res[1]
        return res.transpose(1, 2)
    return res


def sageattn(
    q,
    k,
    v,
    tensor_layout="HND",
    is_causal=_FALSE_UNLESS_GIVEN,
    sm_scale=_NONE_UNLESS_GIVEN,
    return_lse=False,
    smooth_k=True,
    attn_mask=None,
    *,
    dropout_p=0.0,
    backend=None,
    **kwargs,
):
    """SageAttention's ``sageattn`` on RDNA4 / CPU: INT8 Q·Kᵀ, FP8 P·V.

    ``tensor_layout``: "HND" ([B, H, S, D]) or "NHD" ([B, S, H, D]); q has Hq heads, k and v
    Hkv (Hq a multiple of Hkv). ``sm_scale`` defaults to D**-0.5; ``smooth_k`` subtracts the
    keys' mean before quantizing (the softmax is unchanged). Returns the output in q's layout
    and dtype; with ``return_lse`` also the natural-log LSE of the scaled scores, FP32
    ``[B, Hq, Sq]``. ``attn_mask``: SDPA's convention; key masks (with ``is_causal`` too, when
    they are suffix padding) run on the kernels. Calls the kernels cannot serve (other masks,
    ``dropout_p`` > 0, FP32,
    D > 128 or not a multiple of 8, an unsupported device, head counts that are not a GQA
    group) run through torch SDPA. flash-attn's ``causal`` and ``softmax_scale`` are aliases
    of ``is_causal`` and ``sm_scale``; SageAttention's tuning keywords
    (``SAGEATTN_TUNING_KEYWORDS``: ``qk_quant_gran``, ``pv_accum_dtype``, ``smooth_v``, ...)
    are accepted and ignored; any other keyword is a TypeError. ``backend=`` picks an
    aiter_sage backend ("cpu", "emu", "gfx12", "cuda"); an unknown name, or one that cannot
    serve the tensors' device, is a ValueError.
    """
    a = resolve_keywords(
        "sageattn", {"is_causal": is_causal, "sm_scale": sm_scale}, kwargs, SAGEATTN_ALIASES
    )
    if tensor_layout not in ("HND", "NHD"):
        raise ValueError(f"Unsupported tensor layout: {tensor_layout!r} (use 'HND' or 'NHD')")
    h_ax = 1 if tensor_layout == "HND" else 2
    # SageAttention groups query heads by itself; SDPA needs enable_gqa for that.
    gqa = all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k)) and bool(
        q.shape[h_ax] != k.shape[h_ax]
    )
    return attention(
        q,
        k,
        v,
        layout=tensor_layout,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=a["is_causal"],
        scale=a["sm_scale"],
        enable_gqa=gqa,
        smooth_k=smooth_k,
        return_lse=return_lse,
        backend=backend,
        where="aiter_sage.sageattn",
        mask_with_causal=True,
        strict_mask=True,
    )


def sageattn_keywords(
    q,
    k,
    v,
    *,
    tensor_layout="HND",
    return_lse=False,
    smooth_k=True,
    attn_mask=None,
    **kwargs,
):
    """:func:`sageattn` taking everything after q, k, v by keyword: what the sageattention
    shim offers under SageAttention's per-kernel names (``sageattn_qk_int8_pv_fp16_triton``,
    ...), whose positional orders differ from ``sageattn``'s (a positional option raises
    TypeError rather than being read as another one). Same keyword rules as :func:`sageattn`."""
    return sageattn(
        q,
        k,
        v,
        tensor_layout=tensor_layout,
        return_lse=return_lse,
        smooth_k=smooth_k,
        attn_mask=attn_mask,
        **kwargs,
    )


def sdpa(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=_FALSE_UNLESS_GIVEN,
    scale=_NONE_UNLESS_GIVEN,
    enable_gqa=False,
    *,
    backend=None,
    **kwargs,
):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` ([B, H, S, D]).

    Eligible calls (no mask or a key mask, no dropout, BF16/FP16, D a multiple of 8 up to 128,
    a device an aiter_sage backend serves, no gradient needed) run the SageAttention kernels with K
    smoothing; the rest run torch's SDPA unchanged. The output of a kernel call is a
    [B, H, S, D] view of a [B, S, H, D] tensor (as the output of a flash SDPA backend is).
    ``causal``/``softmax_scale``/``sm_scale`` are read as ``is_causal``/``scale``,
    SageAttention's tuning keywords are ignored, any other keyword is a TypeError;
    ``backend=`` as for :func:`sageattn`."""
    a = resolve_keywords(
        "aiter_sage.sdpa", {"is_causal": is_causal, "scale": scale}, kwargs, SDPA_ALIASES
    )
    return attention(
        query,
        key,
        value,
        layout="HND",
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=a["is_causal"],
        scale=a["scale"],
        enable_gqa=enable_gqa,
        smooth_k=True,
        return_lse=False,
        backend=backend,
        where="aiter_sage.sdpa",
    )


# ----------------------------------------------------------------------------------------------
# route_sdpa: patch F.scaled_dot_product_attention for the duration (nesting-safe)
# ----------------------------------------------------------------------------------------------
_patch_lock = threading.Lock()
_patch_depth = 0
_saved_sdpa = None  # the function the outermost route_sdpa replaced


@contextlib.contextmanager
def route_sdpa():
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through :func:`sdpa` while
    the block runs; restores the previous function on leaving the outermost block."""
    global _patch_depth, _saved_sdpa
    with _patch_lock:
        if _patch_depth == 0:
            _saved_sdpa = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = sdpa
        _patch_depth += 1
    try:
        yield sdpa
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                F.scaled_dot_product_attention = _saved_sdpa
                _saved_sdpa = None
