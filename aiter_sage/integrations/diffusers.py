"""The ``"aiter_sage"`` attention backend for diffusers (tested with diffusers 0.42.1).

    import aiter_sage.integrations.diffusers as aiter_diffusers  # registers the backend
    aiter_diffusers.enable(pipe)  # both routes, every component (see enable())
    # or only the registered backend:
    pipe.transformer.set_attention_backend("aiter_sage")
    # or, for a block of code:
    from diffusers import attention_backend
    with attention_backend("aiter_sage"):
        image = pipe(...).images[0]

What it does: BF16/FP16 calls with D a multiple of 8 up to 128 and no dropout run the
SageAttention kernels (with K smoothing); GQA (fewer key/value heads), ``is_causal`` and key
masks too (``[B, Skv]`` masks broadcast as diffusers' ``native`` backend does; padding masks
and biases become per-batch key lengths, :mod:`aiter_sage.masks`). Every other call runs torch
SDPA exactly as the ``native`` backend would. Context parallelism: Ulysses and ring (and
both together) through diffusers' templated context-parallel attention — the backend returns
the natural-log LSE ``[B, S, H]`` that ring attention merges partial results with. Under
context parallelism GQA key/value heads are expanded to the query heads (diffusers' templated
attention takes no GQA); ``is_causal`` works with Ulysses alone (every rank then attends over
whole sequences) and raises diffusers' own error with ring attention (its ring loop has no
causal rule). Inference only: the context-parallel backward raises.

The hook: diffusers 0.42.1 has no documented way to add a backend *name*: ``set_attention_backend``
and ``attention_backend`` accept only members of ``AttentionBackendName``. :func:`register`
adds one member, ``AITER_SAGE = "aiter_sage"``, to that enum (what ``aenum.extend_enum``
does) and registers the function with ``_AttentionBackendRegistry.register(name, constraints,
supports_context_parallel=True)``, diffusers' own registration decorator. Setting
``DIFFUSERS_ATTN_BACKEND=aiter_sage`` does not work (diffusers reads it before this module
can run); use ``set_attention_backend`` or ``attention_backend``.
"""

from __future__ import annotations

import torch

from . import router
from .enums import extend_enum

BACKEND_NAME = "aiter_sage"
_MEMBER_NAME = "AITER_SAGE"


def _broadcast_mask(attn_mask, query, key):
    # diffusers' native backend: a [B, Skv] mask means [B, 1, 1, Skv] (SDPA would read it as
    # [Sq, Skv]).
    if (
        attn_mask is not None
        and attn_mask.ndim == 2
        and attn_mask.shape[0] == query.shape[0]
        and attn_mask.shape[1] == key.shape[1]
    ):
        attn_mask = attn_mask[:, None, None, :]
    return attn_mask


def _attention_bshd(query, key, value, attn_mask, dropout_p, is_causal, scale, return_lse):
    """[B, S, H, D] attention through the router; the LSE as diffusers wants it, [B, S, H]."""
    gqa = query.dim() == 4 and key.dim() == 4 and query.shape[2] != key.shape[2]
    res = router.attention(
        query,
        key,
        value,
        layout="NHD",
        attn_mask=_broadcast_mask(attn_mask, query, key),
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=gqa,
        smooth_k=True,
        return_lse=return_lse,
        where="aiter_sage diffusers backend",
        strict_mask=True,
    )
    if not return_lse:
        return res
    out, lse = res
    return out, lse.permute(0, 2, 1).contiguous()


def _forward_op(
    ctx,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    return_lse=False,
    _save_ctx=True,
    _parallel_config=None,
):
    """One step of diffusers' templated context-parallel attention (ring calls it with
    return_lse=True at every step)."""
    return _attention_bshd(query, key, value, attn_mask, dropout_p, is_causal, scale, return_lse)


def _backward_op(ctx, grad_out, *args, **kwargs):
    raise NotImplementedError("aiter_sage attention is inference-only (no backward)")


def aiter_sage_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config=None,
    **kwargs,
):
    """The backend: ``[B, S, H, D]`` in and out; with ``return_lse`` also the natural-log LSE,
    FP32 ``[B, S, H]``. A processor's ``attention_kwargs`` follow :func:`aiter_sage.sdpa`'s
    keyword rules: ``causal``/``softmax_scale``/``sm_scale`` are read as ``is_causal``/
    ``scale``, SageAttention's tuning keywords are ignored, any other name is a TypeError."""
    # diffusers' dispatcher passes is_causal and scale on every call, so their defaults mean
    # "not given": an alias in attention_kwargs then sets them.
    given = {
        "is_causal": router._FALSE_UNLESS_GIVEN if is_causal is False else is_causal,
        "scale": router._NONE_UNLESS_GIVEN if scale is None else scale,
    }
    a = router.resolve_keywords("aiter_sage diffusers backend", given, kwargs, router.SDPA_ALIASES)
    is_causal, scale = a["is_causal"], a["scale"]
    if _parallel_config is None:
        return _attention_bshd(
            query, key, value, attn_mask, dropout_p, is_causal, scale, return_lse
        )
    from diffusers.models import attention_dispatch as ad

    hq, hkv = query.shape[2], key.shape[2]
    if hq != hkv and hq % hkv == 0:  # templated attention takes no GQA: expand K/V heads
        key = key.repeat_interleave(hq // hkv, dim=2)
        value = value.repeat_interleave(hq // hkv, dim=2)
        enable_gqa = False
    cp = _parallel_config.context_parallel_config
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)
    if is_causal and cp.ring_degree == 1 and not cp.ulysses_anything:
        # Ulysses alone: after the all-to-all every rank holds whole sequences (of some heads),
        # so the causal rule is the single-process one. diffusers' dispatcher refuses causal
        # for every templated mode; ring attention (no causal rule per step) still does.
        return ad.TemplatedUlyssesAttention.apply(
            *args, _forward_op, _backward_op, _parallel_config
        )
    return ad._templated_context_parallel_attention(
        *args,
        forward_op=_forward_op,
        backward_op=_backward_op,
        _parallel_config=_parallel_config,
    )


class Enabled:
    """What :func:`enable` turned on; :meth:`remove` turns it off again (hooks removed, the
    models' attention backend reset to diffusers' default)."""

    def __init__(self, models, handles, active_before):
        self.models, self._handles, self._active_before = models, handles, active_before

    def remove(self) -> None:
        from diffusers.models import attention_dispatch as ad

        for h in self._handles:
            h.remove()
        self._handles = []
        for m in self.models:
            if hasattr(m, "reset_attention_backend"):
                m.reset_attention_backend()
        # set_attention_backend also sets diffusers' process-wide active backend; reset does not
        ad._AttentionBackendRegistry.set_active_backend(self._active_before)


def _models_of(obj) -> list:
    """The torch modules of a diffusers pipeline (its components), or the module itself."""
    if isinstance(obj, torch.nn.Module):
        return [obj]
    components = getattr(obj, "components", None)
    if isinstance(components, dict):
        return [m for m in components.values() if isinstance(m, torch.nn.Module)]
    raise TypeError(
        f"aiter_sage: enable() takes a diffusers pipeline or a torch.nn.Module, not "
        f"{type(obj).__name__}"
    )


def enable(pipeline_or_model) -> Enabled:
    """Both routes to the kernels for a whole pipeline (every component) or model, in one call:

    * the registered ``"aiter_sage"`` backend (``set_attention_backend``) on every model whose
      processors dispatch attention through diffusers (Flux, Flux2, Wan, HunyuanVideo,
      HunyuanImage, QwenImage, LTX, MiniMax-H3, Z-Image, ...);
    * :func:`aiter_sage.route_sdpa` around every forward call of each model, for processors
      that call ``F.scaled_dot_product_attention`` themselves (SD3, CogVideoX, Mochi, HiDream,
      Allegro, AuraFlow, Lumina2, ...).

    Returns an :class:`Enabled`; ``.remove()`` undoes it."""
    from diffusers.models import attention_dispatch as ad

    from . import router

    register()
    active_before = ad._AttentionBackendRegistry._active_backend
    models, handles = _models_of(pipeline_or_model), []
    for m in models:
        if hasattr(m, "set_attention_backend"):
            m.set_attention_backend(BACKEND_NAME)
        stack = []

        def enter(module, args, _stack=stack):
            cm = router.route_sdpa()
            cm.__enter__()
            _stack.append(cm)

        def leave(module, args, output, _stack=stack):
            _stack.pop().__exit__(None, None, None)

        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave, always_call=True))
    return Enabled(models, handles, active_before)


class _EveryName(set):
    """A set of parameter names that answers ``in`` with True for every name (iterating it
    still gives the signature's names)."""

    def __contains__(self, name) -> bool:
        return True


_registered = None


def register():
    """Register the ``"aiter_sage"`` backend with diffusers (idempotent); returns its
    ``AttentionBackendName`` member."""
    global _registered
    if _registered is not None:
        return _registered
    from diffusers.models import attention_dispatch as ad

    member = extend_enum(ad.AttentionBackendName, _MEMBER_NAME, BACKEND_NAME)
    registry = ad._AttentionBackendRegistry
    registry.register(member, constraints=[], supports_context_parallel=True)(aiter_sage_attention)
    # diffusers' dispatcher passes a backend only the keywords its signature names and drops the
    # rest of a processor's attention_kwargs unread (a warning only with its checks on). The
    # backend reads every keyword itself and refuses the ones it does not know, so the
    # dispatcher is told that every name is supported.
    registry._supported_arg_names[member] = _EveryName(registry._supported_arg_names[member])
    _registered = member
    return member


register()
