"""Op surface: registers ``torch.ops.aiter.gfx1201_sage_*`` (libtorch binding + fake impls)
and the Python functions that call them.

Backends (see README "How a backend is chosen"): CPU tensors run the ``cpu`` module unless
``backend="emu"`` (or ``AITER_SAGE_BACKEND=emu``) selects the gfx12 sources on the wave
emulator; ROCm tensors on gfx1201/gfx1200 run the HIP modules built for that arch.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
from typing import Optional

import torch

from . import jit_driver
from . import ref
from .ref import HEAD_DIM, SCALE_BLOCK, SEQ_ALIGN, Prepared

OP_NAMES = ("gfx1201_sage_prepare", "gfx1201_sage_attention_fwd", "gfx1201_sage_attention")
BACKENDS = ("cpu", "emu", "gfx12")


class OpNamespaceConflict(RuntimeError):
    """Another library already registered one of our torch.ops.aiter names."""


def _existing_owner(name: str) -> Optional[str]:
    """Where torch.ops.aiter.<name> was registered, or None if it does not exist yet."""
    qualified = f"aiter::{name}"
    try:
        torch._C._dispatch_find_schema_or_throw(qualified, "")
    except RuntimeError:
        return None
    dump = torch._C._dispatch_dump(qualified)
    for line in dump.splitlines():
        if "registered at" in line:
            return line.split("registered at", 1)[1].strip()
    return "another library"


def _check_namespace_free() -> None:
    for name in OP_NAMES:
        owner = _existing_owner(name)
        if owner is not None:
            raise OpNamespaceConflict(
                f"aiter_sage: torch.ops.aiter.{name} is already registered by {owner} "
                f"(probably ROCm's aiter package). aiter_sage provides the same op; import only "
                f"one of them in a process, or call aiter's version.")


def select_target(device: str, backend: str) -> str:
    """Build target for a tensor device and a requested backend ('' = automatic)."""
    dev = torch.device(device)
    b = (backend or "").lower()
    if b and b not in BACKENDS:
        raise ValueError(f"aiter_sage: unknown backend {backend!r}; choose one of {BACKENDS}")
    if dev.type == "cpu":
        if b in ("", "cpu"):
            return "cpu"
        if b == "emu":  # AITER_SAGE_EMU_ASAN=1: the AddressSanitizer build (needs asan_env())
            return "emu-asan" if os.environ.get("AITER_SAGE_EMU_ASAN") == "1" else "emu"
        raise ValueError(f"aiter_sage: backend {backend!r} needs a GPU tensor; CPU tensors run "
                         f"on 'cpu' or 'emu'")
    if dev.type == "cuda" and torch.version.hip:
        arch = torch.cuda.get_device_properties(dev).gcnArchName.split(":")[0]
        gfx12 = jit_driver.module_table().GFX12_ARCHS
        if arch not in gfx12:
            raise ValueError(f"aiter_sage: {arch} is not supported; the kernels target {gfx12}")
        if b not in ("", "gfx12"):
            raise ValueError(f"aiter_sage: backend {backend!r} cannot run on {arch} tensors")
        return arch
    raise ValueError(f"aiter_sage: no backend for {dev.type} tensors (supported: CPU tensors, "
                     f"and ROCm GPUs gfx1201/gfx1200)")


def _resolve_module(name: str, device: str, backend: str) -> str:
    """Called by the binding on the first use of (module, device, backend)."""
    return str(jit_driver.ensure_module(name, select_target(device, backend)))


def _load_binding():
    path = jit_driver.ensure_module("aiter_sage_torch", "torch")
    loader = importlib.machinery.ExtensionFileLoader("aiter_sage_torch", str(path))
    spec = importlib.util.spec_from_file_location("aiter_sage_torch", str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


_binding = None


def _register() -> None:
    global _binding
    if _binding is not None:
        return
    _check_namespace_free()
    binding = _load_binding()
    binding.set_module_resolver(_resolve_module)
    binding.register_ops()
    _register_fakes()
    _binding = binding


def binding():
    _register()
    return _binding


# ----------------------------------------------------------------------------------------------
# Fake (meta) implementations: shapes and dtypes only, for torch.compile and opcheck
# ----------------------------------------------------------------------------------------------
def _pad(n):
    return (n + SEQ_ALIGN - 1) // SEQ_ALIGN * SEQ_ALIGN


def _register_fakes() -> None:
    @torch.library.register_fake("aiter::gfx1201_sage_prepare")
    def _prepare_fake(q, k, v, softmax_scale=None, *, q_norm_weight=None, k_norm_weight=None,
                      norm_eps=1e-6, rope_cos=None, rope_sin=None, backend=None):
        b, sq, h, _ = q.shape
        skv = k.shape[1]
        sqp, skp = _pad(sq), _pad(skv)
        return (q.new_empty((b, h, sqp, HEAD_DIM), dtype=torch.int8),
                q.new_empty((b, h, sqp // SCALE_BLOCK), dtype=torch.float32),
                q.new_empty((b, h, skp, HEAD_DIM), dtype=torch.int8),
                q.new_empty((b, h, skp // SCALE_BLOCK), dtype=torch.float32),
                q.new_empty((b, h, HEAD_DIM, skp), dtype=torch.uint8),
                q.new_empty((b, h, HEAD_DIM), dtype=torch.float32))

    @torch.library.register_fake("aiter::gfx1201_sage_attention_fwd")
    def _fwd_fake(q8, q_scale, k8, k_scale, v8, v_scale, q_len, kv_len, *, backend=None):
        return q8.new_empty((q8.shape[0], q_len, q8.shape[1], HEAD_DIM), dtype=torch.bfloat16)

    @torch.library.register_fake("aiter::gfx1201_sage_attention")
    def _attention_fake(q, k, v, softmax_scale=None, *, is_causal=False, attn_mask=None,
                        q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6, rope_cos=None,
                        rope_sin=None, backend=None):
        return q.new_empty(q.shape, dtype=torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Public Python API
# ----------------------------------------------------------------------------------------------
def gfx1201_sage_prepare(q, k, v, softmax_scale=None, *, q_norm_weight=None, k_norm_weight=None,
                         norm_eps=1e-6, rope_cos=None, rope_sin=None,
                         backend=None) -> Prepared:
    """Quantize BF16 [B, S, H, 128] q, k, v for :func:`gfx1201_sage_attention_fwd`.

    Optional fused QK RMSNorm (``q_norm_weight``/``k_norm_weight``, BF16 [128], ``norm_eps``)
    and rotate-half RoPE (``rope_cos``/``rope_sin``, BF16 [S, rope_dim], rope_dim 32/64/96/128)
    are applied to q and k first, bit-identical to the eager BF16 sequence in aiter_sage.ref.
    """
    _register()
    out = torch.ops.aiter.gfx1201_sage_prepare(
        q, k, v, softmax_scale, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
        norm_eps=norm_eps, rope_cos=rope_cos, rope_sin=rope_sin, backend=backend)
    q8, q_scale, k8, k_scale, v8_bits, v_scale = out
    return Prepared(q8, q_scale, k8, k_scale, v8_bits.view(torch.float8_e4m3fn), v_scale,
                    q.shape[1], k.shape[1])


def gfx1201_sage_attention_fwd(prepared: Prepared, *, backend=None) -> torch.Tensor:
    """The attention kernel alone on prepared tensors; returns BF16 [B, Sq, H, 128]."""
    _register()
    if not isinstance(prepared, Prepared):
        raise TypeError("aiter_sage: gfx1201_sage_attention_fwd expects the Prepared tuple that "
                        f"gfx1201_sage_prepare returned, got {type(prepared).__name__}")
    q8, q_scale, k8, k_scale, v8, v_scale = prepared[:6]
    return torch.ops.aiter.gfx1201_sage_attention_fwd(
        q8, q_scale, k8, k_scale, ref.fp8_bits(v8), v_scale, prepared.q_len, prepared.kv_len,
        backend=backend)


def gfx1201_sage_attention(q, k, v, softmax_scale=None, *, is_causal=False, attn_mask=None,
                           q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6, rope_cos=None,
                           rope_sin=None, backend=None) -> torch.Tensor:
    """SageAttention: softmax(q kᵀ · softmax_scale) v with INT8 Q·Kᵀ and FP8 P·V.

    q: BF16 [B, Sq, H, 128]; k, v: BF16 [B, Skv, H, 128] (last dim contiguous, other strides
    free). ``softmax_scale`` defaults to 128**-0.5. Non-causal, no mask in this version.
    Returns BF16 [B, Sq, H, 128].
    """
    _register()
    return torch.ops.aiter.gfx1201_sage_attention(
        q, k, v, softmax_scale, is_causal=is_causal, attn_mask=attn_mask,
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, norm_eps=norm_eps,
        rope_cos=rope_cos, rope_sin=rope_sin, backend=backend)


def available_backends() -> list[str]:
    """Backends usable in this process (a compiler for each is present)."""
    found = []
    for b, target in (("cpu", "cpu"), ("emu", "emu")):
        try:
            jit_driver.toolchain_for(target)
            found.append(b)
        except jit_driver.CompilerNotFound:
            pass
    if torch.cuda.is_available() and torch.version.hip:
        try:
            select_target("cuda", "")
            found.append("gfx12")
        except ValueError:
            pass
    return found


if os.environ.get("AITER_SAGE_LAZY_REGISTER") != "1":
    _register()
