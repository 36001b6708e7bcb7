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

from . import jit_driver, ref
from .ref import Prepared

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
                f"one of them in a process, or call aiter's version."
            )


def select_target(device: str, backend: str) -> str:
    """Build target for a tensor device and a requested backend ('' = automatic)."""
    dev = torch.device(device)
    _check_backend_name(backend)
    b = (backend or "").lower()
    if dev.type == "cpu":
        if b in ("", "cpu"):
            return "cpu"
        if b == "emu":  # AITER_SAGE_EMU_ASAN=1: the AddressSanitizer build (needs asan_env())
            return "emu-asan" if os.environ.get("AITER_SAGE_EMU_ASAN") == "1" else "emu"
        raise ValueError(
            f"aiter_sage: backend {backend!r} needs a GPU tensor; CPU tensors run on 'cpu' or 'emu'"
        )
    if dev.type == "cuda" and torch.version.hip:
        arch = torch.cuda.get_device_properties(dev).gcnArchName.split(":")[0]
        gfx12 = jit_driver.module_table().GFX12_ARCHS
        if arch not in gfx12:
            raise ValueError(f"aiter_sage: {arch} is not supported; the kernels target {gfx12}")
        if b not in ("", "gfx12"):
            raise ValueError(f"aiter_sage: backend {backend!r} cannot run on {arch} tensors")
        return arch
    raise ValueError(
        f"aiter_sage: no backend for {dev.type} tensors (supported: CPU tensors, "
        f"and ROCm GPUs gfx1201/gfx1200)"
    )


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
    _register_fakes(binding)
    _register_autograd()
    _binding = binding


def binding():
    _register()
    return _binding


# ----------------------------------------------------------------------------------------------
# Fake (meta) implementations: the binding's own argument checks (check_*_meta) on the fake
# tensors, so torch.compile and mixed-device calls obey the same rules as the kernels; then
# empty outputs whose shapes stay symbolic.
# ----------------------------------------------------------------------------------------------
def _check_backend_name(backend) -> None:
    name = backend or os.environ.get("AITER_SAGE_BACKEND", "")
    if name and name.lower() not in BACKENDS:
        raise ValueError(f"aiter_sage: unknown backend {name!r}; choose one of {BACKENDS}")


def _padded(n):
    """S rounded up to 32 (works on SymInts: the fakes keep dynamic shapes symbolic)."""
    return (n + ref.SEQ_ALIGN - 1) // ref.SEQ_ALIGN * ref.SEQ_ALIGN


def _size_hint():
    """A function giving a SymInt's example value without adding a guard (its name and home
    changed across torch releases)."""
    from torch.fx.experimental import symbolic_shapes as sym

    for name in ("optimization_hint", "hint_int"):
        if hasattr(sym, name):
            return getattr(sym, name)
    return lambda d: d if isinstance(d, int) else int(d.node.hint)


def _concrete(t):
    """A stand-in with the same dtype, device and layout but concrete sizes, for the binding's
    checks (C++ cannot read symbolic sizes); the tensor itself when its sizes are plain ints."""
    if not isinstance(t, torch.Tensor):
        return t
    dims = (*t.shape, *t.stride())
    if all(isinstance(d, int) for d in dims):
        return t
    hint = _size_hint()
    return torch.empty_strided(
        [hint(d) for d in t.shape], [hint(d) for d in t.stride()], dtype=t.dtype, device=t.device
    )


def _register_fakes(binding) -> None:
    @torch.library.register_fake("aiter::gfx1201_sage_prepare")
    def _prepare_fake(
        query,
        key,
        value,
        softmax_scale=None,
        query_weight=None,
        key_weight=None,
        cosine=None,
        sine=None,
        eps=1e-6,
        *,
        backend=None,
    ):
        _check_backend_name(backend)
        binding.check_prepare_meta(
            *map(_concrete, (query, key, value)),
            softmax_scale,
            *map(_concrete, (query_weight, key_weight, cosine, sine)),
            eps,
        )
        b, sq, h, d = query.shape
        sq_pad, skv_pad = _padded(sq), _padded(key.shape[1])
        new = query.new_empty
        return (
            new((b, sq_pad, h, d), dtype=torch.int8),
            new((b, h, sq_pad // ref.SCALE_BLOCK), dtype=torch.float32),
            new((b, skv_pad, h, d), dtype=torch.int8),
            new((b, h, skv_pad // ref.SCALE_BLOCK), dtype=torch.float32),
            new((b, h, d, skv_pad), dtype=torch.uint8),
            new((b, h, d), dtype=torch.float32),
        )

    @torch.library.register_fake("aiter::gfx1201_sage_attention_fwd")
    def _fwd_fake(
        q_int8, q_scale, k_int8, k_scale, v_fp8, v_scale, seq_len, *, kv_len=None, backend=None
    ):
        _check_backend_name(backend)
        prepared = (q_int8, q_scale, k_int8, k_scale, v_fp8, v_scale)
        binding.check_fwd_meta(*map(_concrete, prepared), seq_len, kv_len)
        return q_int8.new_empty(q_int8.shape, dtype=torch.bfloat16)

    @torch.library.register_fake("aiter::gfx1201_sage_attention")
    def _attention_fake(
        query,
        key,
        value,
        softmax_scale=None,
        query_weight=None,
        key_weight=None,
        cosine=None,
        sine=None,
        eps=1e-6,
        *,
        is_causal=False,
        backend=None,
    ):
        _check_backend_name(backend)
        binding.check_attention_meta(
            *map(_concrete, (query, key, value)),
            softmax_scale,
            *map(_concrete, (query_weight, key_weight, cosine, sine)),
            eps,
            is_causal,
        )
        return query.new_empty(query.shape, dtype=torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Inference only: inputs that require grad while grad mode is on are refused up front by the
# Python functions; for direct torch.ops calls an autograd rule refuses them too, so no
# gradient is ever silently missing.
# ----------------------------------------------------------------------------------------------
def check_no_grad(*tensors, op: str = "gfx1201_sage_attention") -> None:
    if not torch.is_grad_enabled():
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(
                f"aiter_sage: {op} is inference-only: an input requires grad "
                f"while grad mode is on; call it under torch.no_grad() or "
                f"torch.inference_mode(), or pass detached tensors"
            )


def _register_autograd() -> None:
    def make(op_name):
        # Called (under no_grad) only when grad mode is on and an input requires grad.
        def setup_context(ctx, inputs, output, keyword_only_inputs=None):
            with torch.enable_grad():
                check_no_grad(*inputs, op=op_name)

        def backward(ctx, *grads):
            raise RuntimeError(f"aiter_sage: {op_name} is inference-only (no backward)")

        torch.library.register_autograd(f"aiter::{op_name}", backward, setup_context=setup_context)

    for name in OP_NAMES:
        make(name)


# ----------------------------------------------------------------------------------------------
# Public Python API: upstream ROCm aiter's call forms; additions keyword-only after them.
# ----------------------------------------------------------------------------------------------
def gfx1201_sage_prepare(
    query,
    key,
    value,
    softmax_scale=None,
    query_weight=None,
    key_weight=None,
    cosine=None,
    sine=None,
    eps=1e-6,
    *,
    backend=None,
) -> Prepared:
    """Quantize BF16 ``[B, S, H, 128]`` query/key/value for SageAttention.

    Returns ``(q_int8, q_scale, k_int8, k_scale, v_fp8, v_scale)`` (a :class:`Prepared`
    namedtuple): Q/K INT8 ``[B, S_pad, H, 128]`` with FP32 scales ``[B, H, S_pad / 32]`` (one
    per 32-row block; Q carries ``softmax_scale * log2(e)``), V FP8 e4m3 ``[B, H, 128, S_pad]``
    with FP32 per-channel scales ``[B, H, 128]``. ``S_pad`` is S rounded up to 32; padding is
    zero. Key/value may be longer or shorter than query (each is padded on its own).

    With ``query_weight``/``key_weight`` (BF16 ``[128]``) Q and K first go through RMSNorm, and
    with ``cosine``/``sine`` (FP32 ``[S, rope_dim]``, rope_dim 32/64/96/128; BF16 accepted)
    through rotate-half RoPE on their leading rope_dim channels, as upstream (which takes all
    four together; here each pair is optional).
    """
    _register()
    check_no_grad(
        query, key, value, query_weight, key_weight, cosine, sine, op="gfx1201_sage_prepare"
    )
    out = torch.ops.aiter.gfx1201_sage_prepare(
        query,
        key,
        value,
        softmax_scale,
        query_weight,
        key_weight,
        cosine,
        sine,
        eps,
        backend=backend,
    )
    q8, q_scale, k8, k_scale, v8_bits, v_scale = out
    return Prepared(q8, q_scale, k8, k_scale, v8_bits.view(torch.float8_e4m3fn), v_scale)


def gfx1201_sage_attention_fwd(
    q_int8, q_scale, k_int8, k_scale, v_fp8, v_scale, seq_len, *, kv_len=None, backend=None
) -> torch.Tensor:
    """Attention over the tensors :func:`gfx1201_sage_prepare` returned.

    ``seq_len``: the real query length (and key length unless ``kv_len`` is given). Returns
    BF16 ``[B, S_pad, H, 128]`` (upstream's shape); rows at or beyond ``seq_len`` are zero.
    Keys at or beyond the key length are masked whatever the padded K/V rows hold.
    """
    _register()
    # The op takes e4m3 as its uint8 bits (see the binding); any other dtype goes through for
    # the binding to name it.
    v_bits = v_fp8.view(torch.uint8) if v_fp8.dtype == torch.float8_e4m3fn else v_fp8
    return torch.ops.aiter.gfx1201_sage_attention_fwd(
        q_int8, q_scale, k_int8, k_scale, v_bits, v_scale, seq_len, kv_len=kv_len, backend=backend
    )


def gfx1201_sage_attention(
    query,
    key,
    value,
    softmax_scale=None,
    query_weight=None,
    key_weight=None,
    cosine=None,
    sine=None,
    eps=1e-6,
    *,
    is_causal=False,
    backend=None,
) -> torch.Tensor:
    """SageAttention: softmax(q kᵀ · softmax_scale) v with INT8 Q·Kᵀ and FP8 P·V.

    query: BF16 ``[B, Sq, H, 128]``; key, value: BF16 ``[B, Skv, H, 128]`` (last dim
    contiguous, other strides free). ``softmax_scale`` defaults to 128**-0.5. The optional
    norm/RoPE arguments are applied to Q and K first (see :func:`gfx1201_sage_prepare`).
    Non-causal, no mask in this version. Returns BF16 ``[B, Sq, H, 128]``. Inference only.
    """
    _register()
    check_no_grad(query, key, value, query_weight, key_weight, cosine, sine)
    return torch.ops.aiter.gfx1201_sage_attention(
        query,
        key,
        value,
        softmax_scale,
        query_weight,
        key_weight,
        cosine,
        sine,
        eps,
        is_causal=is_causal,
        backend=backend,
    )


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
