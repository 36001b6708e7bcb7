"""Integrations: SageAttention's API, an SDPA drop-in, the ``sageattention`` shim, diffusers.

* :func:`sageattn` — SageAttention's ``sageattn`` (``HND``/``NHD``), kernels or SDPA, and
  :func:`sageattn_varlen` (packed sequences);
* :func:`sdpa`, :func:`route_sdpa` — ``F.scaled_dot_product_attention`` drop-in, and a
  context manager routing a model's SDPA calls through it;
* :func:`enable_sageattention_shim` — ``from sageattention import sageattn`` gets ours where
  SageAttention itself is not installed (:mod:`.sageattention_shim`);
* :mod:`aiter_sage.integrations.diffusers` — the ``"aiter_sage"`` diffusers attention backend.
"""

from .router import route_sdpa, sageattn, sdpa  # noqa: F401
from .sageattention_shim import (  # noqa: F401
    disable_sageattention_shim,
    enable_sageattention_shim,
)
from .varlen import sageattn_varlen  # noqa: F401
