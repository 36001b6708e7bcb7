"""aiter_sage: SageAttention (INT8 Q·Kᵀ, FP8 P·V) for AMD RDNA4, as JIT-compiled modules.

    import aiter_sage as aiter
    out = aiter.gfx1201_sage_attention(q, k, v, softmax_scale)   # BF16 [B, S, H, 128]

Importing registers torch.ops.aiter.gfx1201_sage_{prepare,attention_fwd,attention}.
"""

# SageAttention's sageattn, the SDPA drop-in and the context manager routing SDPA through it.
from .integrations.router import route_sdpa, sageattn, sdpa  # noqa: F401
from .integrations.varlen import sageattn_varlen  # noqa: F401
from .ops import (  # noqa: F401
    BACKENDS,
    OpNamespaceConflict,
    available_backends,
    empty_host_cache,
    gfx1201_sage_attention,
    gfx1201_sage_attention_fwd,
    gfx1201_sage_prepare,
    host_cache_stats,
)
from .ref import Prepared  # noqa: F401

__version__ = "0.1.0"
