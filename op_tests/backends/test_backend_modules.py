"""Which compiled module actually ran for each backend, how a backend name reaches the binding,
and how often a call is validated.

The binding records every kernel module it loaded as (key, info), info being the module's
`sage_module_info()` string: "... target=gfx12" for the gfx12 sources (run on the emulator
for backend="emu"), "... target=cpu" for the host implementation. A backend that silently ran
another backend's build would still produce a plausible result, so the result alone cannot
tell; this file checks the record. The binding uses the record `backends.resolve` returns as
it is, so every spelling Python accepts behaves as the canonical name; and it validates each
op call once (`check_params_calls`: sage/check.h's check_params in the binding and in the
modules it loaded).
"""

from __future__ import annotations

import os

import pytest
import torch

import aiter_sage
from aiter_sage import backends, ref

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import BACKENDS, child_json, run_as_script

KERNEL_MODULES = ("module_gfx1201_sage_prepare", "module_gfx1201_sage_attention")
EXPECTED_TARGET = {"cpu": "target=cpu", "emu": "target=gfx12"}


def require(backend: str) -> None:
    if backend in BACKENDS:
        return
    message = f"backend {backend!r} is not available here (found {BACKENDS})"
    if os.environ.get("CI") == "true":  # CI installs every tool these backends need
        pytest.fail(message)
    pytest.skip(message)


def small_qkv():
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(1, 64, 1, 128, generator=g).to(torch.bfloat16) for _ in range(3))


def modules_loaded_for(backend: str) -> dict[str, str]:
    """{key: info} of the modules the binding loaded for calls that resolved to `backend` (keys
    are "module|device|backend", the backend's canonical name)."""
    loaded = aiter_sage.ops.binding().loaded_modules()
    return {key: info for key, info in loaded if key.split("|")[2] == backend}


@pytest.mark.parametrize("backend", ["cpu", "emu"])
def test_each_backend_runs_its_own_build(backend):
    require(backend)
    q, k, v = small_qkv()
    out = aiter_sage.gfx1201_sage_attention(q, k, v, backend=backend)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    loaded = modules_loaded_for(backend)
    for name in KERNEL_MODULES:
        infos = [info for key, info in loaded.items() if key.startswith(name + "|")]
        assert infos, f"no {name} was loaded for backend={backend!r}: {loaded}"
        for info in infos:
            assert name in info and EXPECTED_TARGET[backend] in info, (backend, info)


# ---- one spelling reaches C++ ---------------------------------------------------------------
def misaligned_view_qkv():
    """A valid view whose rows start 2 bytes past a 16-byte boundary: the kernels' 128-bit
    loads need a copy (and the emulator reports [global-misaligned] without one)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 64, 2, 72, generator=g).bfloat16()
    q = x[..., 1:65]
    k, v = (torch.randn(1, 64, 2, 64, generator=g).bfloat16() for _ in range(2))
    assert q.data_ptr() % 16 != 0 and q.stride(-1) == 1
    return q, k, v


SPELLINGS = [("EMU", None), (" emu", None), (None, " Emu ")]  # (backend=, $AITER_SAGE_BACKEND)


@pytest.mark.parametrize("backend, env", SPELLINGS, ids=["EMU", "space-emu", "env-Emu"])
def test_any_spelling_of_emu_runs_a_misaligned_view(backend, env, monkeypatch):
    """Every spelling Python accepts is the emulator with its alignment copy: the output of
    the misaligned view equals that of its contiguous copy, inside the band of FP32
    attention (the binding once compared the raw string with "emu" and skipped the copy)."""
    require("emu")
    if env is None:
        monkeypatch.delenv(backends.ENV_BACKEND, raising=False)
    else:
        monkeypatch.setenv(backends.ENV_BACKEND, env)
    q, k, v = misaligned_view_qkv()
    out = aiter_sage.gfx1201_sage_attention(q, k, v, backend=backend)
    expected = aiter_sage.gfx1201_sage_attention(q.contiguous(), k, v, backend="emu")
    assert torch.equal(out, expected)
    acc = ref.accuracy(out, ref.attention_fp32(q, k, v))
    assert ref.in_band(acc), (ref.band_failures(acc), acc)
    names = {key.split("|")[2] for key, _ in aiter_sage.ops.binding().loaded_modules()}
    assert names <= set(backends.NAMES), names  # the binding sees canonical names only


def test_spellings_resolve_to_one_record(monkeypatch):
    """backends.resolve: one record per (device, backend) however the name is written, with
    the table's facts the binding uses (host or device, alignment, target)."""
    monkeypatch.setenv(backends.ENV_BACKEND, " Emu ")
    records = {backends.resolve("cpu", name) for name in ("emu", "EMU", " emu", None, "")}
    assert len(records) == 1, records
    (emu,) = records
    assert (emu.backend, emu.device, emu.host) == ("emu", "cpu", True)
    assert emu.align_bytes == backends.ALIGN_128_BIT and emu.target.startswith("emu")
    monkeypatch.delenv(backends.ENV_BACKEND)
    cpu = backends.resolve(torch.device("cpu"))
    assert (cpu.backend, cpu.target, cpu.host, cpu.align_bytes) == ("cpu", "cpu", True, 0)
    assert backends.resolve("cpu", "CPU") is cpu and backends.resolve("cpu", "cpu") is cpu
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        backends.resolve("cpu", "bogus")


# ---- one validation per op call --------------------------------------------------------------
def validations(call) -> int:
    """check_params runs (binding and loaded modules) during `call()`."""
    binding = aiter_sage.ops.binding()
    before = binding.check_params_calls()
    call()
    return binding.check_params_calls() - before


@pytest.mark.parametrize("backend", ["cpu", "emu"])
def test_each_op_call_is_validated_once(backend):
    """One op call, one sage::check_params (there were five for one attention call: the
    binding's prepare, forward and output checks and each module's own)."""
    require(backend)
    q, k, v = small_qkv()
    ops = torch.ops.aiter
    att = aiter_sage.gfx1201_sage_attention
    att(q, k, v, backend=backend)  # the modules are loaded (their counts are summed from then)
    prepared = ops.gfx1201_sage_prepare(q, k, v, backend=backend)
    calls = {
        "attention": lambda: att(q, k, v, backend=backend),
        "attention_lse": lambda: att(q, k, v, is_causal=True, return_lse=True, backend=backend),
        "smooth_k": lambda: att(q, k, v, smooth_k=True, return_lse=True, backend=backend),
        "prepare": lambda: ops.gfx1201_sage_prepare(q, k, v, backend=backend),
        "fwd": lambda: ops.gfx1201_sage_attention_fwd(*prepared, 64, backend=backend),
        "fwd_lse": lambda: ops.gfx1201_sage_attention_fwd_lse(*prepared, 64, backend=backend),
    }
    counts = {name: validations(call) for name, call in calls.items()}
    assert counts == dict.fromkeys(calls, 1), counts


def test_fake_implementations_validate_once():
    """The fakes (torch.compile's shape propagation) run the same single check."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(t) for t in small_qkv())
        ops = torch.ops.aiter
        counts = {
            "attention": validations(lambda: ops.gfx1201_sage_attention(q, k, v)),
            "prepare": validations(lambda: ops.gfx1201_sage_prepare(q, k, v)),
        }
        prepared = ops.gfx1201_sage_prepare(q, k, v)
        counts["fwd"] = validations(lambda: ops.gfx1201_sage_attention_fwd(*prepared, 64))
    assert counts == {"attention": 1, "prepare": 1, "fwd": 1}, counts


STACK_SCRIPT = """
import json, torch, aiter_sage
g = torch.Generator().manual_seed(3)
q, k, v = (torch.randn(1, 64, 1, 128, generator=g).to(torch.bfloat16) for _ in range(3))
try:
    aiter_sage.gfx1201_sage_attention(q, k, v, backend="emu")
    print(json.dumps({"error": None}))
except Exception as e:
    print(json.dumps({"type": type(e).__name__, "error": str(e)}))
"""


@pytest.mark.parametrize(
    "variable, value, says",
    [
        ("AITER_SAGE_EMU_STACK_KB", "2147483647", "is not a lane stack size"),
        ("AITER_SAGE_EMU_THREADS", "0", "is not a host worker thread count"),
        ("AITER_SAGE_EMU_THREADS", "-1", "is not a host worker thread count"),
        ("AITER_SAGE_EMU_THREADS", "abc", "is not a host worker thread count"),
    ],
)
def test_impossible_emulator_setting_is_a_python_error(variable, value, says):
    """AITER_SAGE_EMU_STACK_KB=2**31-1 used to abort the process (rc 134), and
    AITER_SAGE_EMU_THREADS=0/-1/abc was silently replaced by the default; each is an exception
    naming the variable, raised from the op (run in a child: the old stack behaviour kills it)."""
    require("emu")
    env = dict(os.environ, **{variable: value})
    res = child_json(STACK_SCRIPT, env=env)
    assert res["error"] and f"{variable}={value} {says}" in res["error"], res
    assert res["type"] == "RuntimeError", res


if __name__ == "__main__":
    run_as_script(__file__)
