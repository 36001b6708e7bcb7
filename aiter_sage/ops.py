"""Op surface: registers ``torch.ops.aiter.gfx1201_sage_*`` (libtorch binding + fake impls)
and the Python functions that call them.

Backends (see README "How a backend is chosen"): CPU tensors run the ``cpu`` module unless
``backend="emu"`` (or ``AITER_SAGE_BACKEND=emu``) selects the gfx12 sources on the wave
emulator; ROCm tensors on gfx1201/gfx1200 run the HIP modules built for that arch.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import math
import os
import warnings
from typing import Optional

import torch

from . import backends, env, guards, jit_driver, ref, signatures
from .ref import Prepared
from .signatures import OPS, RETURN_LSE

OP_NAMES = tuple(signatures.OPS)
BACKENDS = backends.NAMES


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


# A line every copy of aiter_sage's ops.py carries: how a conflict tells a second copy of this
# package (a vendored or Hub-carried one, another checkout) from another library.
_OWNER_MARK = "class OpNamespaceConflict(RuntimeError):"


def describe_owner(where: str) -> str:
    """Who registered an op, from the dispatcher's "FILE:LINE" of its schema definition."""
    path = where.rsplit(":", 1)[0]
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
        if _OWNER_MARK in text:
            pkg = os.path.dirname(os.path.abspath(path))
            same = pkg == os.path.dirname(os.path.abspath(__file__))
            what = "this aiter_sage, imported a second time under another module name"
            if not same:
                what = "another copy of aiter_sage"
            return (
                f"{what} ({pkg}; registered at {where}). Import aiter_sage from one place only "
                f"(uninstall the other copy, or let the Hub package use the installed aiter_sage)"
            )
        if f"{os.sep}aiter{os.sep}" in path:
            return (
                f"ROCm's aiter package ({where}). aiter_sage provides the same op; import only "
                f"one of them in a process, or call aiter's version"
            )
    return (
        f"{where}. aiter_sage provides ops of the same names; import only one of the two "
        f"libraries in a process"
    )


def _check_namespace_free() -> None:
    for name in OP_NAMES:
        owner = _existing_owner(name)
        if owner is not None:
            raise OpNamespaceConflict(
                f"aiter_sage: torch.ops.aiter.{name} is already registered by "
                f"{describe_owner(owner)}."
            )


def _load_binding():
    path = jit_driver.ensure_module("aiter_sage_torch", "torch")
    loader = importlib.machinery.ExtensionFileLoader("aiter_sage_torch", str(path))
    spec = importlib.util.spec_from_file_location("aiter_sage_torch", str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


_binding = None
_schema_lib = None  # the torch.library.Library that owns our schemas (kept alive)


def _define_schemas() -> None:
    global _schema_lib
    lib = torch.library.Library("aiter", "FRAGMENT")
    for sig in OPS.values():
        lib.define(sig.schema())
    _schema_lib = lib


def _register() -> None:
    global _binding
    if _binding is not None:
        return
    _check_namespace_free()
    binding = _load_binding()
    # Every op call asks backends.resolve for its record: the one reading of `backend` and
    # $AITER_SAGE_BACKEND (a dict lookup after the first call of a device and name).
    binding.set_backend_resolver(backends.resolve)
    binding.set_memory_guard(guards.check_bytes)
    _define_schemas()
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


def _head_dim_pad(d):
    d = int(d)  # the head dim is static in every model; a symbolic one would be specialized
    return ref.padded_head_dim(d) if ref.head_dim_supported(d) else d


def _prepare_shapes(query, key, pv_dtype="fp8", q_scale_rows=ref.SCALE_BLOCK):
    """Shapes and dtypes of prepare's outputs (symbolic in S)."""
    b, sq, hq, d = query.shape
    hkv = key.shape[2]
    dp = _head_dim_pad(d)
    sq_pad, skv_pad = _padded(sq), _padded(key.shape[1])
    return (
        ((b, sq_pad, hq, dp), torch.int8),
        ((b, hq, sq_pad // q_scale_rows), torch.float32),
        ((b, skv_pad, hkv, dp), torch.int8),
        ((b, hkv, skv_pad // ref.SCALE_BLOCK), torch.float32),
        ((b, hkv, dp, skv_pad), torch.float16 if pv_dtype == "fp16" else torch.uint8),
        ((b, hkv, dp), torch.float32),
    )


def _fake_prepare(binding, a):
    binding.check_prepare_meta(
        *map(_concrete, (a["query"], a["key"], a["value"])),
        a["softmax_scale"],
        *map(_concrete, (a["query_weight"], a["key_weight"], a["cosine"], a["sine"])),
        a["eps"],
        a["smooth_k"],
        a["pv_dtype"],
        a["q_scale_rows"],
        *map(_concrete, (a["q_lens"], a["kv_lens"])),
    )
    new = a["query"].new_empty
    shapes = _prepare_shapes(a["query"], a["key"], a["pv_dtype"], a["q_scale_rows"])
    return tuple(new(shape, dtype=dt) for shape, dt in shapes)


def _fake_fwd(binding, a, lse: bool):
    prepared = [a[n] for n in ("q_int8", "q_scale", "k_int8", "k_scale", "v_fp8", "v_scale")]
    binding.check_fwd_meta(
        *map(_concrete, prepared),
        a["seq_len"],
        a["kv_len"],
        a["is_causal"],
        a["out_dtype"],
        *map(_concrete, (a["q_lens"], a["kv_lens"])),
    )
    q8 = a["q_int8"]
    out = q8.new_empty(q8.shape, dtype=a["out_dtype"] or torch.bfloat16)
    if not lse:
        return out
    b, s_pad, h, _ = q8.shape
    return out, q8.new_empty((b, h, s_pad), dtype=torch.float32)


def _fake_attention(binding, a, lse: bool):
    q = a["query"]
    binding.check_attention_meta(
        *map(_concrete, (q, a["key"], a["value"])),
        a["softmax_scale"],
        *map(_concrete, (a["query_weight"], a["key_weight"], a["cosine"], a["sine"])),
        a["eps"],
        a["is_causal"],
        a["smooth_k"],
        a["pv_dtype"],
        a["q_scale_rows"],
        *map(_concrete, (a["q_lens"], a["kv_lens"])),
    )
    out = q.new_empty(q.shape)
    if not lse:
        return out
    b, s, h, _ = q.shape
    return out, q.new_empty((b, h, s), dtype=torch.float32)


# Op name -> fake body (binding, bound arguments) -> outputs.
_FAKES = {
    "gfx1201_sage_prepare": _fake_prepare,
    "gfx1201_sage_attention_fwd": lambda bd, a: _fake_fwd(bd, a, False),
    "gfx1201_sage_attention_fwd_lse": lambda bd, a: _fake_fwd(bd, a, True),
    "gfx1201_sage_attention": lambda bd, a: _fake_attention(bd, a, False),
    "gfx1201_sage_attention_lse": lambda bd, a: _fake_attention(bd, a, True),
}


def _register_fakes(binding) -> None:
    """One fake per op: the op's arguments bound by its signature (signatures.py), the backend
    name checked, the binding's checks run, then empty outputs of the right shapes."""

    def make(sig):
        body = _FAKES[sig.name]

        def fake(*args, **kwargs):
            a = sig.bind(args, kwargs, schema=True)
            backends.requested(a["backend"])  # an unknown name raises
            return body(binding, a)

        torch.library.register_fake(f"aiter::{sig.name}")(fake)

    for sig in OPS.values():
        make(sig)


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
# Public Python API: upstream ROCm aiter's call forms; additions keyword-only after them. The
# signatures come from signatures.py; `return_lse=True` calls the op's `_lse` companion.
# ----------------------------------------------------------------------------------------------
_TENSOR_INPUTS = ("query", "key", "value", "query_weight", "key_weight", "cosine", "sine")

# ----------------------------------------------------------------------------------------------
# Debug check (AITER_SAGE_CHECK=1): the Python functions look at what they return and warn,
# naming (batch, head, row), about output rows that are not finite and LSE values out of range.
# Off by default (it reads the whole output back).
# ----------------------------------------------------------------------------------------------
ENV_CHECK = "AITER_SAGE_CHECK"
CHECK_MAX_NAMED = 8  # rows named per warning


# AITER_SAGE_CHECK=1 warnings: non-finite rows and LSE values here, outlier Q/K blocks in guards
# (SageOutlierWarning, a subclass).
SageCheckWarning = guards.SageCheckWarning


def check_enabled() -> bool:
    return env.get(ENV_CHECK) not in ("", "0")


def _name_rows(mask, what: str, op: str) -> None:
    """mask: bool [B, H, S]; warns naming its first rows."""
    idx = mask.nonzero()
    if idx.numel() == 0:
        return
    named = ", ".join(f"({b}, {h}, {s})" for b, h, s in idx[:CHECK_MAX_NAMED].tolist())
    more = f" and {idx.shape[0] - CHECK_MAX_NAMED} more" if idx.shape[0] > CHECK_MAX_NAMED else ""
    warnings.warn(
        f"aiter_sage: {op}: {idx.shape[0]} (batch, head, row) {what}: {named}{more}",
        SageCheckWarning,
        stacklevel=4,
    )


def check_output(
    out, lse=None, *, rows=None, lse_bound=None, op: str = "gfx1201_sage_attention"
) -> dict:
    """The AITER_SAGE_CHECK rules on an output ``[B, S, H, D]`` (rows >= ``rows`` ignored) and
    an optional LSE ``[B, H, S]``: rows whose output is not finite, and LSE values that are not
    finite or exceed ``lse_bound`` in magnitude (a bound on |score| + ln(kv_len), see
    :func:`lse_bound`). Warns (:class:`SageCheckWarning`) and returns the masks ``[B, H, S]``."""
    rows = out.shape[1] if rows is None else rows
    bad_out = ~torch.isfinite(out[:, :rows]).all(-1).transpose(1, 2).cpu()
    _name_rows(bad_out, "rows with a non-finite output", op)
    found = {"output": bad_out}
    if lse is not None:
        lv = lse[..., :rows].float().cpu()
        bad_lse = ~torch.isfinite(lv)
        if lse_bound is not None:
            bad_lse |= lv.abs() > lse_bound
        _name_rows(bad_lse, "rows with an LSE out of range", op)
        found["lse"] = bad_lse
    return found


def lse_bound(query, key, softmax_scale, kv_len: int) -> float:
    """An upper bound on |LSE| of any row: softmax_scale * max|q| * max|k| (Cauchy-Schwarz on
    the row norms) + ln(kv_len), with 1% and 1.0 of slack for the quantization."""
    scale = query.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    qn = query.float().norm(dim=-1).nan_to_num(posinf=math.inf).max().item()
    kn = key.float().norm(dim=-1).nan_to_num(posinf=math.inf).max().item()
    return abs(scale) * qn * kn * 1.01 + math.log(max(kv_len, 1)) + 1.0


def _warn_outliers(a: dict, op: str) -> None:
    """AITER_SAGE_CHECK=1: name the Q/K blocks whose INT8 scale one outlier row sets (inputs
    the binding will refuse anyway, not 4-D tensors, are left to its checks; nothing while
    torch.compile traces)."""
    q, k = a["query"], a["key"]
    if torch.compiler.is_compiling() or not check_enabled():
        return
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k)):
        return
    if a["q_scale_rows"] not in ref.Q_SCALE_ROWS:  # _call names the bad value
        return
    guards.warn_outlier_blocks(
        q, k, smooth_k=a["smooth_k"], query_weight=a["query_weight"],
        key_weight=a["key_weight"], eps=a["eps"], q_scale_rows=a["q_scale_rows"], op=op,
    )  # fmt: skip


def _lengths_tensor(lens):
    """q_lens / kv_lens as the ops take them: a list or tuple of ints becomes an int32 tensor
    (the schema's type is Tensor?); tensors and None pass unchanged."""
    return torch.tensor(lens, dtype=torch.int32) if isinstance(lens, (list, tuple)) else lens


def _check_q_scale_rows(value) -> None:
    """A TypeError / ValueError naming the accepted values (32, 16), not torch's schema
    mismatch (a RuntimeError) for a value that is not an int."""
    try:
        ref.check_q_scale_rows(value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"aiter_sage: {e}") from None


def _call(sig, a: dict, lse: bool = False):
    if "q_scale_rows" in a:
        _check_q_scale_rows(a["q_scale_rows"])
    op_sig = OPS[f"{sig.name}_lse"] if lse else sig
    a = {**a, **{n: _lengths_tensor(a[n]) for n in ("q_lens", "kv_lens") if n in a}}
    pos, kw = op_sig.call_args(a)
    return getattr(torch.ops.aiter, op_sig.name)(*pos, **kw)


def _public(sig, doc: str, extra=()):
    """Decorator: gives a wrapper `fn(a: dict)` the op's Python signature and a docstring."""

    def wrap(fn):
        def api(*args, **kwargs):
            _register()
            return fn(sig.bind(args, kwargs, extra))

        api.__name__ = api.__qualname__ = sig.name
        api.__signature__ = sig.python_signature(extra)
        api.__doc__ = doc
        api.__module__ = __name__
        return api

    return wrap


@_public(
    signatures.PREPARE,
    """Quantize ``[B, S, H, D]`` query/key/value (BF16 or FP16) for SageAttention.

    Returns ``(q_int8, q_scale, k_int8, k_scale, v_fp8, v_scale)`` (a :class:`Prepared`
    namedtuple): Q/K INT8 ``[B, S_pad, H, Dp]`` with FP32 scales ``[B, H, S_pad / 32]`` (one
    per 32-row block; Q carries ``softmax_scale * log2(e)``; ``q_scale_rows=16``: one Q scale
    per 16 rows, ``[B, Hq, S_pad / 16]``), V FP8 e4m3 ``[B, Hkv, Dp, S_pad]``
    with FP32 per-channel scales ``[B, Hkv, Dp]``. ``S_pad`` is S rounded up to 32; ``Dp`` is
    the kernel head dim (64 for D <= 64, else 128); padding is zero. Key/value may be longer
    or shorter than query, and have fewer heads (GQA: Hq a multiple of Hkv).

    With ``query_weight``/``key_weight`` (``[D]``, the inputs' dtype) Q and K first go through
    RMSNorm, and with ``cosine``/``sine`` (FP32 ``[S, rope_dim]``, rope_dim a multiple of 32 up
    to D; BF16 accepted) through rotate-half RoPE on their leading rope_dim channels, as
    upstream (which takes all four together; here each pair is optional).

    ``smooth_k=True`` quantizes K minus its per-channel mean over the keys (the softmax does not
    change; the INT8 error of K with a large common offset does).

    ``pv_dtype="fp16"`` returns V as float16 codes ``fp16(v / v_scale)`` instead of e4m3 (same
    layout, same ``v_scale``): the attention on them runs P·V with FP16 operands (more accurate
    at long sequences; twice V's bytes).
    """,
)
def gfx1201_sage_prepare(a) -> Prepared:
    check_no_grad(*(a[n] for n in _TENSOR_INPUTS), op="gfx1201_sage_prepare")
    _warn_outliers(a, "gfx1201_sage_prepare")
    q8, q_scale, k8, k_scale, v_codes, v_scale = _call(signatures.PREPARE, a)
    if v_codes.dtype == torch.uint8:  # fp8 mode: e4m3 bits (float16 codes in fp16 mode)
        v_codes = v_codes.view(torch.float8_e4m3fn)
    return Prepared(q8, q_scale, k8, k_scale, v_codes, v_scale)


@_public(
    signatures.ATTENTION_FWD,
    """Attention over the tensors :func:`gfx1201_sage_prepare` returned.

    ``seq_len``: the real query length (and key length unless ``kv_len`` is given). Returns
    ``[B, S_pad, Hq, Dp]`` (upstream's shape) in ``out_dtype`` (BF16 unless FP16 is asked
    for); rows at or beyond ``seq_len`` are zero. Keys at or beyond the key length are masked
    whatever the padded K/V rows hold. ``is_causal``: query i sees keys j <= i (top-left).
    ``return_lse=True`` also returns the natural-log LSE, FP32 ``[B, Hq, S_pad]`` (rows at or
    beyond ``seq_len``: -inf) — of the scores of these prepared tensors (with smoothed K, the
    smoothed scores; :func:`gfx1201_sage_attention` adds the mean's term back). The P·V mode
    follows ``v_fp8``'s dtype: e4m3 (or its uint8 bits) runs FP8 P·V, float16 (what
    ``pv_dtype="fp16"`` prepare returns) FP16 P·V. The Q scale granularity follows
    ``q_scale``'s shape: ``[B, Hq, S_pad / 32]`` or, from ``q_scale_rows=16`` prepare,
    ``[B, Hq, S_pad / 16]``.
    """,
    extra=(RETURN_LSE,),
)
def gfx1201_sage_attention_fwd(a):
    # The op takes e4m3 as its uint8 bits (see the binding); any other dtype goes through for
    # the binding to name it.
    v = a["v_fp8"]
    a["v_fp8"] = v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v
    lse = a.pop("return_lse")
    result = _call(signatures.ATTENTION_FWD, a, lse)
    if check_enabled():
        out, lse_t = result if lse else (result, None)
        check_output(out, lse_t, rows=a["seq_len"], op="gfx1201_sage_attention_fwd")
    return result


@_public(
    signatures.ATTENTION,
    """SageAttention: softmax(q kᵀ · softmax_scale) v with INT8 Q·Kᵀ and FP8 P·V.

    query: ``[B, Sq, Hq, D]``; key, value: ``[B, Skv, Hkv, D]``, BF16 or FP16 (one dtype), D a
    multiple of 8 up to 128, Hq a multiple of Hkv (GQA/MQA), last dim contiguous, other strides
    free. ``softmax_scale`` defaults to D**-0.5. The optional norm/RoPE arguments are applied to
    Q and K first (see :func:`gfx1201_sage_prepare`). Keyword-only: ``is_causal`` (query i sees
    keys j <= i, top-left aligned as SDPA's), ``smooth_k`` (K smoothing), ``return_lse`` (also
    return the natural-log LSE of the unsmoothed scaled scores, FP32 ``[B, Hq, Sq]``),
    ``pv_dtype`` (``"fp8"``, upstream's, or ``"fp16"``: FP16 P·V), ``q_scale_rows`` (32,
    upstream's, or 16: one Q scale per 16 rows, more accurate on outlier-heavy DiT
    activations), ``backend``. Returns
    ``[B, Sq, Hq, D]`` in the inputs' dtype (and the LSE). Inference only.
    """,
    extra=(RETURN_LSE,),
)
def gfx1201_sage_attention(a):
    check_no_grad(*(a[n] for n in _TENSOR_INPUTS))
    lse = a.pop("return_lse")
    _warn_outliers(a, "gfx1201_sage_attention")
    result = _call(signatures.ATTENTION, a, lse)
    if check_enabled():
        out, lse_t = result if lse else (result, None)
        bound = None
        if lse_t is not None and a["query_weight"] is None:  # a norm changes |q| and |k|
            bound = lse_bound(a["query"], a["key"], a["softmax_scale"], a["key"].shape[1])
        check_output(out, lse_t, lse_bound=bound)
    return result


def empty_host_cache() -> None:
    """Unmaps the host memory blocks that the cpu ops keep for reuse.

    The binding's large CPU tensors (prepared Q/K/V, outputs; 4 MiB or more) live in blocks
    that go back to a cache when torch frees them, so that the next call does not page-fault
    all of its memory again (``AITER_SAGE_HOST_CACHE_MB`` caps the cache, default 1024; 0 turns
    it off). Blocks still held by live tensors stay theirs.
    """
    binding().empty_host_cache()


def host_cache_stats() -> dict:
    """The host block cache's counters: ``hits``, ``misses``, ``cached_bytes``,
    ``cached_blocks``."""
    return dict(binding().host_cache_stats())


def available_backends() -> list[str]:
    """Backends usable in this process (a compiler for each is present)."""
    return backends.available()


if env.get("AITER_SAGE_LAZY_REGISTER") != "1":
    _register()
