"""A vLLM-Omni diffusion attention backend: ``DIFFUSION_ATTENTION_BACKEND=SAGE_ATTN``.

vLLM-Omni loads the entry points of the group ``vllm_omni.general_plugins`` in every process;
aiter_sage's (``pyproject.toml``) is :func:`register`, which points vLLM-Omni's ``SAGE_ATTN``
backend at :class:`AiterSageAttentionBackend` with ``register_diffusion_backend`` — unless a
real SageAttention is installed, which then keeps ``SAGE_ATTN`` (as with the ``sageattention``
shim, an installed SageAttention always wins). Users select it as any backend:
``DIFFUSION_ATTENTION_BACKEND=SAGE_ATTN`` (or the engine's per-role attention config).

The backend follows vLLM-Omni's backend interface (``get_name``, ``get_impl_cls``,
``get_supported_head_sizes``; an impl built with ``num_heads, head_size, softmax_scale,
causal, num_kv_heads, ...`` whose ``forward(query, key, value, attn_metadata)`` takes and
returns ``[B, S, H, D]``), on every platform vLLM-Omni dispatches to (``forward`` itself, and
``forward_hip``/``forward_cuda``): GQA, causal, a key mask from ``attn_metadata.attn_mask``
(torch SDPA today). vLLM-Omni's ring sequence parallelism has no hook for backends and
refuses ``SAGE_ATTN`` explicitly; Ulysses hands the backend whole sequences and works.

Loading the plugin imports aiter_sage in each vLLM-Omni process, which loads its torch binding
(built once per torch version, then cached); where that fails vLLM-Omni logs the plugin as
failed and goes on without it.
"""

from __future__ import annotations

from . import router
from .sageattention_shim import real_sageattention_installed

BACKEND_MEMBER = "SAGE_ATTN"
CLASS_PATH = f"{__name__}.AiterSageAttentionBackend"
KERNEL_HEAD_SIZES = tuple(range(8, 129, 8))  # the kernels' head dims (others run SDPA)

try:  # inside vLLM-Omni: its base classes (their defaults for what is not defined here)
    from vllm_omni.diffusion.attention.backends.abstract import AttentionBackend as _Backend
    from vllm_omni.diffusion.attention.backends.abstract import AttentionImpl as _Impl
except ImportError:  # outside it (tests, docs): the same interface without base classes
    _Backend = _Impl = object


class AiterSageAttentionBackend(_Backend):
    accept_output_buffer = False
    supported_platforms = None  # every platform aiter_sage's router serves or falls back on

    @staticmethod
    def get_name() -> str:
        return BACKEND_MEMBER

    @staticmethod
    def get_impl_cls():
        return AiterSageAttentionImpl

    @staticmethod
    def get_supported_head_sizes() -> list:
        return list(KERNEL_HEAD_SIZES)

    @classmethod
    def supports_attention_mask(cls, attention_spec=None) -> bool:
        return False  # a mask runs torch SDPA today: let the engine prefer mask-free plans


class AiterSageAttentionImpl(_Impl):
    """One attention layer's implementation. ``backend_kwargs`` may name an aiter_sage
    ``backend`` ("cpu", "gfx12", ...) and SageAttention's tuning keywords; any other key is a
    TypeError. The engine's ``extra_impl_args`` are its own bookkeeping and are not read."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        softmax_scale: float,
        causal: bool = False,
        num_kv_heads=None,
        prefix: str = "",
        backend_kwargs=None,
        **extra_impl_args,
    ) -> None:
        options = dict(backend_kwargs or {})
        self.backend = options.pop("backend", None)
        router.resolve_keywords("aiter_sage vLLM-Omni backend", {}, options, {})
        self.num_heads, self.head_size = num_heads, head_size
        self.num_kv_heads = num_kv_heads or num_heads
        self.softmax_scale = softmax_scale
        self.causal = bool(causal)

    def forward(self, query, key, value, attn_metadata=None):
        """``[B, S, H, D]`` in and out."""
        mask = getattr(attn_metadata, "attn_mask", None)
        if mask is not None and mask.dim() == 2:  # [B, Skv] key padding: broadcast over rows
            mask = mask[:, None, None, :]
        gqa = query.dim() == 4 and key.dim() == 4 and query.shape[2] != key.shape[2]
        return router.attention(
            query,
            key,
            value,
            layout="NHD",
            attn_mask=mask,
            is_causal=self.causal,
            scale=self.softmax_scale,
            enable_gqa=gqa,
            smooth_k=True,
            backend=self.backend,
            where="aiter_sage vLLM-Omni backend",
        )

    forward_hip = forward_cuda = forward


def register() -> bool:
    """The ``vllm_omni.general_plugins`` entry point: ``SAGE_ATTN`` runs aiter_sage unless a
    real SageAttention is installed. Safe to call in every process, any number of times;
    returns whether aiter_sage's backend is registered."""
    if real_sageattention_installed():
        router.logger.info("vLLM-Omni: SageAttention is installed; SAGE_ATTN stays its own")
        return False
    from vllm_omni.diffusion.attention.backends.registry import (
        DiffusionAttentionBackendEnum,
        register_diffusion_backend,
    )

    register_diffusion_backend(DiffusionAttentionBackendEnum[BACKEND_MEMBER], CLASS_PATH)
    return True
