"""Which compiled module actually ran for each backend.

The binding records every kernel module it loaded as (key, info), info being the module's
`sage_module_info()` string: "... target=gfx12" for the gfx12 sources (run on the emulator
for backend="emu"), "... target=cpu" for the host implementation. A backend that silently ran
another backend's build would still produce a plausible result, so the result alone cannot
tell; this file checks the record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import aiter_sage

from common import BACKENDS, REPO, run_as_script

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
    """{key: info} of the modules the binding loaded for calls that asked for `backend` (keys
    are "module|device|requested backend": the device field can also read "cpu")."""
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
    r = subprocess.run(
        [sys.executable, "-c", STACK_SCRIPT],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["error"] and f"{variable}={value} {says}" in res["error"], res
    assert res["type"] == "RuntimeError", res


if __name__ == "__main__":
    run_as_script(__file__)
