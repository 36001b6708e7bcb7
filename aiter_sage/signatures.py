"""The op signatures, declared once.

Each op's arguments are listed here as data; the torch schema registered for
``torch.ops.aiter.<name>``, the fake implementation's argument binding and the Python
functions' signatures are all derived from these lists. Upstream ROCm aiter's arguments come
first, in upstream's order with upstream's defaults; what aiter_sage adds is keyword-only after
them, with upstream's behaviour as the default.

Ops that can also return the log-sum-exp have a companion ``<name>_lse`` op with the same
arguments and a second output: a torch schema has one fixed output list, and the upstream
names must keep returning a single tensor.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

_REQUIRED = inspect.Parameter.empty


@dataclass(frozen=True)
class Arg:
    name: str
    schema_type: str  # torch schema type: "Tensor", "Tensor?", "float?", "int", "str?", ...
    default: Any = _REQUIRED  # _REQUIRED: no default
    kw_only: bool = False
    # Keyword-only in Python, but positional (after the positional arguments, with its default)
    # in the torch schema: torch.library.register_autograd refuses kwarg-only Tensor arguments.
    schema_positional: bool = False

    def schema(self) -> str:
        text = f"{self.schema_type} {self.name}"
        if self.default is _REQUIRED:
            return text
        return f"{text}={_schema_literal(self.default)}"


def _schema_literal(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    return repr(value)


@dataclass(frozen=True)
class OpSignature:
    name: str
    args: tuple[Arg, ...]
    returns: str  # schema return type

    def schema_args(self) -> tuple[Arg, ...]:
        """The arguments in the torch schema's order (and the C++ kernels'): the positional
        ones, then the schema-positional ones, then the keyword-only ones."""
        rank = lambda a: 0 if not a.kw_only else (1 if a.schema_positional else 2)  # noqa: E731
        return tuple(sorted(self.args, key=rank))

    def schema(self) -> str:
        """The torch schema, without the namespace."""
        parts, star = [], False
        for a in self.schema_args():
            if a.kw_only and not a.schema_positional and not star:
                parts.append("*")
                star = True
            parts.append(a.schema())
        return f"{self.name}({', '.join(parts)}) -> {self.returns}"

    def python_signature(self, extra: tuple[Arg, ...] = ()) -> inspect.Signature:
        """The Python signature of the op's arguments (plus `extra` keyword-only ones)."""
        params = []
        for a in (*self.args, *extra):
            kind = (
                inspect.Parameter.KEYWORD_ONLY
                if a.kw_only
                else inspect.Parameter.POSITIONAL_OR_KEYWORD
            )
            params.append(inspect.Parameter(a.name, kind, default=a.default))
        return inspect.Signature(params)

    def bind(self, args, kwargs, extra: tuple[Arg, ...] = (), schema: bool = False) -> dict:
        """Arguments by name, defaults filled in (a TypeError names what does not fit).
        ``schema``: `args` come in the torch schema's order (a fake implementation's call), so
        the schema-positional arguments may be among them.

        Plain dict work rather than inspect.Signature.bind: torch.compile traces through
        it on every torch release (some cannot trace inspect)."""
        params = (*self.args, *extra)
        in_order = self.schema_args() if schema else params
        positional = [a.name for a in in_order if not a.kw_only or (schema and a.schema_positional)]
        if len(args) > len(positional):
            raise TypeError(
                f"aiter_sage: {self.name}() takes {len(positional)} positional arguments "
                f"but {len(args)} were given"
            )
        values = dict(zip(positional, args))
        for name, value in kwargs.items():
            if not any(a.name == name for a in params):
                raise TypeError(f"aiter_sage: {self.name}() got an unexpected keyword {name!r}")
            if name in values:
                raise TypeError(f"aiter_sage: {self.name}() got multiple values for {name!r}")
            values[name] = value
        for a in params:
            if a.name not in values:
                if a.default is _REQUIRED:
                    raise TypeError(
                        f"aiter_sage: {self.name}() missing a required argument: {a.name!r}"
                    )
                values[a.name] = a.default
        return values

    def call_args(self, values: dict) -> tuple[list, dict]:
        """(positional, keyword) arguments for torch.ops in this op's order."""
        args = self.schema_args()
        schema_kw = lambda a: a.kw_only and not a.schema_positional  # noqa: E731
        pos = [values[a.name] for a in args if not schema_kw(a)]
        kw = {a.name: values[a.name] for a in args if schema_kw(a)}
        return pos, kw

    def with_lse(self) -> OpSignature:
        """The companion op that also returns the LSE."""
        return OpSignature(f"{self.name}_lse", self.args, f"({self.returns}, Tensor)")


# Upstream's inputs of prepare and attention, in upstream's order with upstream's defaults.
UPSTREAM_INPUTS = (
    Arg("query", "Tensor"),
    Arg("key", "Tensor"),
    Arg("value", "Tensor"),
    Arg("softmax_scale", "float?", None),
    Arg("query_weight", "Tensor?", None),
    Arg("key_weight", "Tensor?", None),
    Arg("cosine", "Tensor?", None),
    Arg("sine", "Tensor?", None),
    Arg("eps", "float", 1e-6),
)
BACKEND = Arg("backend", "str?", None, kw_only=True)
IS_CAUSAL = Arg("is_causal", "bool", False, kw_only=True)
SMOOTH_K = Arg("smooth_k", "bool", False, kw_only=True)
# P.V operand format: "fp8" (upstream's e4m3 V and P) or "fp16" (FP16 V and P; prepare then
# returns V as float16, and the fwd op reads the mode from that dtype).
PV_DTYPE = Arg("pv_dtype", "str", "fp8", kw_only=True)
PV_DTYPES = ("fp8", "fp16")
# Query rows per Q scale: 32 (upstream's) or 16 (q_scale [B, Hq, Sq_pad / 16]; K keeps 32-key
# blocks). The fwd op takes no such argument: it reads the granularity from q_scale's shape.
Q_SCALE_ROWS = Arg("q_scale_rows", "int", 32, kw_only=True)
# Per-batch lengths (int32/int64 [B] tensors on the inputs' device or the cpu; None: the full
# lengths): entry b has q_lens[b] real query rows and kv_lens[b] real keys, the rest is padding
# whatever it holds (a key-padding mask whose kept keys come first; varlen as padded batches).
Q_LENS = Arg("q_lens", "Tensor?", None, kw_only=True, schema_positional=True)
KV_LENS = Arg("kv_lens", "Tensor?", None, kw_only=True, schema_positional=True)
LENGTHS = (Q_LENS, KV_LENS)
# Python-only: selects the companion `_lse` op.
RETURN_LSE = Arg("return_lse", "bool", False, kw_only=True)

PREPARE = OpSignature(
    "gfx1201_sage_prepare",
    (*UPSTREAM_INPUTS, SMOOTH_K, PV_DTYPE, Q_SCALE_ROWS, *LENGTHS, BACKEND),
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
ATTENTION_FWD = OpSignature(
    "gfx1201_sage_attention_fwd",
    (
        Arg("q_int8", "Tensor"),
        Arg("q_scale", "Tensor"),
        Arg("k_int8", "Tensor"),
        Arg("k_scale", "Tensor"),
        Arg("v_fp8", "Tensor"),
        Arg("v_scale", "Tensor"),
        Arg("seq_len", "int"),
        Arg("kv_len", "int?", None, kw_only=True),
        IS_CAUSAL,
        Arg("out_dtype", "ScalarType?", None, kw_only=True),
        *LENGTHS,
        BACKEND,
    ),
    "Tensor",
)
ATTENTION = OpSignature(
    "gfx1201_sage_attention",
    (*UPSTREAM_INPUTS, IS_CAUSAL, SMOOTH_K, PV_DTYPE, Q_SCALE_ROWS, *LENGTHS, BACKEND),
    "Tensor",
)

# Every registered op: name -> signature.
OPS: dict[str, OpSignature] = {
    s.name: s
    for s in (
        PREPARE,
        ATTENTION_FWD,
        ATTENTION_FWD.with_lse(),
        ATTENTION,
        ATTENTION.with_lse(),
    )
}
