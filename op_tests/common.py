"""Shared pieces of the op tests: which backends are present, inputs, and the script runner.

Every test file runs under pytest and as `python op_tests/<group>/test_x.py` (which calls pytest
on itself). Backends are the ones present: `cpu` wherever a C++ compiler exists, `emu` where
clang and the gfx12 sources exist, `gfx12` on an RDNA4 GPU, `cuda` on a Hopper GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, str(REPO))

import aiter_sage  # noqa: E402
from aiter_sage import backends, jit_driver, ref  # noqa: E402
from aiter_sage.builder import paths, toolchains  # noqa: E402


def present_backends() -> list[str]:
    found = aiter_sage.available_backends()
    if "emu" in found and not (jit_driver.csrc_dir() / "simt" / "prepare.hip").exists():
        found.remove("emu")
    return found


BACKENDS = present_backends()


def backend_params():
    return [pytest.param(b, id=b) for b in BACKENDS]


GPU_BACKENDS = tuple(b.name for b in backends.BACKENDS if b.device_type != "cpu")


def device_for(backend: str) -> str:
    return backends.BY_NAME[backend].device_type


def skip_no_hardware(what: str) -> None:
    """Skip because a piece of hardware is absent: the only skip CI allows (ci_policy.py)."""
    from ci_policy import HARDWARE_PREFIX

    pytest.skip(HARDWARE_PREFIX + what)


def randn_bshd(b, s, h, *, seed, scale=1.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((b, s, h, 128), generator=g) * scale
    return x.to(torch.bfloat16).to(device)


def every_16_bit_value(dtype) -> torch.Tensor:
    """All 65536 bit patterns of a 16-bit float dtype, as float32 (NaN and inf included)."""
    return torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(dtype).float()


def qkv(b, sq, skv, h, *, seed=0, device="cpu"):
    return (
        randn_bshd(b, sq, h, seed=seed, device=device),
        randn_bshd(b, skv, h, seed=seed + 1, device=device),
        randn_bshd(b, skv, h, seed=seed + 2, device=device),
    )


def rope_tables(s, rope_dim, *, base=10000.0):
    """FP32 cos/sin [S, rope_dim] from the usual base^(-2i/d) angles, as upstream's test and
    diffusers build them (rotate-half layout: the angles repeat over the two halves)."""
    inv = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().contiguous(), ang.sin().contiguous()


def norm_weights(seed=7):
    """RMSNorm weights as upstream's test draws them: rand + 0.5, BF16 [128]."""
    g = torch.Generator().manual_seed(seed)
    return (
        (torch.rand(128, generator=g) + 0.5).to(torch.bfloat16),
        (torch.rand(128, generator=g) + 0.5).to(torch.bfloat16),
    )


def to_device(backend, *tensors):
    dev = device_for(backend)
    return tuple(None if t is None else t.to(dev) for t in tensors)


def with_garbage_padding(prepared, q_len: int, kv_len: int) -> list:
    """Copies of prepared tensors (rows >= 64 padding on both sides) whose padding holds
    junk: Q/K codes, NaN scales of the all-padding blocks, e4m3 NaN V codes past kv_len. An
    attention that masks correctly gives the same output as on the clean tensors."""
    assert q_len <= 64 and kv_len <= 64 and prepared[0].shape[1] > 64
    dirty = [t.clone() for t in prepared]
    dirty[0][:, q_len:] = -100
    dirty[1][..., 2] = float("nan")
    dirty[2][:, kv_len:] = 99
    dirty[3][..., 2] = float("nan")
    dirty[4].view(torch.uint8)[..., kv_len:] = 0x7F
    return dirty


def build_host_program(exe, *args) -> None:
    """Compiles a host C++ program against the repo's headers (csrc/include, csrc) with the
    JIT's host compiler (CXX, else c++ / g++ / clang++): `args` are the sources and any extra
    flags."""
    cxx = toolchains._host_cxx()
    if cxx is None:
        pytest.fail("no host C++ compiler (apt-get install g++)")
    subprocess.run(
        [
            cxx,
            "-std=c++17",
            "-O1",
            "-I",
            str(REPO / "csrc" / "include"),
            "-I",
            str(REPO / "csrc"),
            *map(str, args),
            "-o",
            str(exe),
        ],
        check=True,
    )


def use_cpu_tier(monkeypatch, tier: str) -> None:
    """Forces cpu tier `tier` (AITER_SAGE_CPU_ISA) for the test; skips as absent hardware when
    this CPU lacks it."""
    if not cpu_has_tier(tier):
        skip_no_hardware(f"this CPU has no {tier} tier")
    monkeypatch.setenv("AITER_SAGE_CPU_ISA", tier)


# cpu tiers whose FP8-mode P.V runs on int8 tiles (csrc/cpu/attention_tiles.inc), modelled by
# ref.attention_from_prepared(int8_pv=True); the others keep P unrounded (fp8_p=False).
INT8_PV_TIERS = ("amx", "amx_model")
# The tiers a launch picks with no AITER_SAGE_CPU_ISA, widest first (scalar is the last resort).
AUTO_CPU_TIERS = ("amx", "avx512", "avx2", "scalar")


def cpu_has_tier(tier: str) -> bool:
    """Whether this CPU and OS run cpu tier `tier` when asked for (a small prepare with
    AITER_SAGE_CPU_ISA=tier asks the backend, which refuses a tier the machine lacks)."""
    q = torch.zeros(1, 8, 1, 64, dtype=torch.bfloat16)
    before = os.environ.get("AITER_SAGE_CPU_ISA")
    os.environ["AITER_SAGE_CPU_ISA"] = tier
    try:
        aiter_sage.gfx1201_sage_prepare(q, q, q, backend="cpu")
        return True
    except RuntimeError as e:
        if "lacks" not in str(e):
            raise
        return False
    finally:
        if before is None:
            del os.environ["AITER_SAGE_CPU_ISA"]
        else:
            os.environ["AITER_SAGE_CPU_ISA"] = before


def cpu_tier_in_effect() -> str:
    """The cpu tier a launch runs now: AITER_SAGE_CPU_ISA, else the first of AUTO_CPU_TIERS
    that this CPU and OS accept when asked for."""
    forced = os.environ.get("AITER_SAGE_CPU_ISA")
    if forced:
        return forced
    return next((t for t in AUTO_CPU_TIERS[:-1] if cpu_has_tier(t)), AUTO_CPU_TIERS[-1])


def cpu_model(prepared, q_len: int, kv_len: int | None = None, **kw):
    """ref's step-by-step model of the cpu tier in effect on `prepared`: P unrounded, and on
    the amx tiers (FP8 V) their int8 P.V."""
    int8 = cpu_tier_in_effect() in INT8_PV_TIERS and prepared.v_fp8.dtype != torch.float16
    return ref.attention_from_prepared(prepared, q_len, kv_len, fp8_p=False, int8_pv=int8, **kw)


def child_json(script: str, *args: str, env=None, cwd=REPO, timeout=600):
    """Runs `python -c script args` in a child process (its own environment, limits or crashes
    stay there) and returns what its last stdout line holds as JSON; the child must exit 0."""
    import json

    r = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-4000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_as_script(file: str) -> None:
    sys.exit(pytest.main([file, "-q", *sys.argv[1:]]))


def count_router_calls(monkeypatch=None) -> dict:
    """Counts the integrations' router calls that ran the kernels (``"kernel"``) and the
    reasons of those that fell back to SDPA (``"fallback"``). With ``monkeypatch`` the counting
    ends with the test; without (a worker process), for the rest of the process."""
    from aiter_sage.integrations import router

    seen = {"kernel": 0, "fallback": []}
    real_kernel, real_log = router.kernel_attention, router._log_fallback

    def kernel(*args, **kwargs):
        seen["kernel"] += 1
        return real_kernel(*args, **kwargs)

    def log(where, reason):
        seen["fallback"].append(reason)
        return real_log(where, reason)

    for name, fn in (("kernel_attention", kernel), ("_log_fallback", log)):
        if monkeypatch is None:
            setattr(router, name, fn)
        else:
            monkeypatch.setattr(router, name, fn)
    return seen


# ---- the cuda sources without a GPU (nvcc with the JIT's flags) ----------------------------
def nvcc_or_fail() -> str:
    nvcc = toolchains._nvcc()
    if not nvcc:
        pytest.fail("nvcc (CUDA 12.3+) is needed to compile the cuda sources; set NVCC/CUDA_HOME")
    return nvcc


def nvcc_module(module: str, extra: tuple[str, ...], cwd, csrc: Path | None = None) -> str:
    """nvcc with the JIT's flags for `module` plus `extra`; returns stdout + stderr. `csrc`: a
    copy of the sources to compile instead of the repository's (its include paths too)."""
    spec = jit_driver.module_table().MODULES[module]
    tc = jit_driver.toolchain_for("sm_90")
    flags = [*tc.cflags, *paths._spec_flags(spec, "cuda")]
    src = jit_driver.csrc_dir() / spec.sources["cuda"][0]
    if csrc is not None:
        flags = [f.replace(str(jit_driver.csrc_dir()), str(csrc)) for f in flags]
        src = Path(csrc) / spec.sources["cuda"][0]
    cmd = [tc.compiler, *flags, *extra, str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def cuda_attention_kernels(ptx: str) -> dict[tuple[int, bool, bool, int, int], str]:
    """(head dim, FP16 P.V, serial schedule, consumer warpgroups, keys per tile) -> the PTX of the
    non-ping-pong attention kernel of that variant, from the mangled names of
    attention_kernel<Traits<kDp, kStages, kPingPong, kPv16, kWgs, kOHomeTiles, kSerial,
    kBlockN>>."""
    found = {}
    for part in re.split(r"(?=^\.visible \.entry )", ptx, flags=re.M)[1:]:
        m = re.match(
            r"\.visible \.entry \S*TraitsILi(\d+)ELi\d+ELb([01])ELb([01])ELi(\d+)ELi\d+"
            r"ELb([01])ELi(\d+)E",
            part,
        )
        assert m, part[:200]
        if m.group(2) == "0":
            key = (int(m.group(1)), m.group(3) == "1", m.group(5) == "1", int(m.group(4)))
            found[(*key, int(m.group(6)))] = part
    return found
