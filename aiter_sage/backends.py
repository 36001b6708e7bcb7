"""The backend table: every backend aiter_sage can run on, in one place.

The op layer (which module a call loads), the torch binding's module resolver, the tests and
the benchmark all read this table. A backend serves tensors of one device type; the JIT builds
its modules for a *target* (``cpu``, ``emu``, or a GPU arch) with one toolchain kind of
``jit/modules.py``. The first backend of a device type whose ``automatic`` flag is set is the
one a call without ``backend=`` gets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import jit_driver

ENV_BACKEND = "AITER_SAGE_BACKEND"


def _rocm_arch(device: torch.device) -> Optional[str]:
    if device.type != "cuda" or not torch.version.hip:
        return None
    return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]


def _emu_target(device: torch.device) -> str:
    # AITER_SAGE_EMU_ASAN=1: the AddressSanitizer build of the emulator (needs asan_env()).
    return "emu-asan" if os.environ.get("AITER_SAGE_EMU_ASAN") == "1" else "emu"


def _gfx12_target(device: torch.device) -> str:
    arch = _rocm_arch(device)
    archs = jit_driver.module_table().GFX12_ARCHS
    if arch not in archs:
        raise ValueError(f"aiter_sage: {arch} is not supported; the kernels target {archs}")
    return arch


def _cuda_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """Compute capability of an NVIDIA GPU (None for ROCm or non-CUDA devices)."""
    if device.type != "cuda" or torch.version.hip or not torch.version.cuda:
        return None
    return tuple(torch.cuda.get_device_capability(device))


def _cuda_target(device: torch.device) -> str:
    cap = _cuda_capability(device)
    archs = jit_driver.module_table().CUDA_ARCHS
    arch = f"sm_{cap[0]}{cap[1]}" if cap else "none"
    if arch not in archs:
        name = torch.cuda.get_device_name(device) if cap else str(device)
        raise ValueError(
            f"aiter_sage: the cuda backend supports Hopper GPUs ({', '.join(archs)}: H100, "
            f"H200) only; {name} is {arch}"
        )
    return arch


@dataclass(frozen=True)
class Backend:
    name: str
    device_type: str  # torch device type of the tensors it takes
    toolchain: str  # jit/modules.py source set ("cpu", "emu", "hip")
    automatic: bool  # chosen when no backend is named
    target: Callable[[torch.device], str]  # device -> JIT build target
    summary: str

    def serves(self, device: torch.device) -> bool:
        if device.type != self.device_type:
            return False
        if self.device_type != "cuda":
            return True
        if self.toolchain == "hip":
            return _rocm_arch(device) is not None
        return _cuda_capability(device) is not None  # NVIDIA: cuda (non-Hopper: clear error)


BACKENDS: tuple[Backend, ...] = (
    Backend("cpu", "cpu", "cpu", True, lambda d: "cpu", "host C++ (AMX / AVX-512 / AVX2 tiers)"),
    Backend("emu", "cpu", "emu", False, _emu_target, "the gfx12 kernels on the wave emulator"),
    Backend("gfx12", "cuda", "hip", True, _gfx12_target, "RDNA4 GPUs (gfx1201, gfx1200)"),
    Backend("cuda", "cuda", "cuda", True, _cuda_target, "NVIDIA Hopper GPUs (sm_90, wgmma)"),
)
NAMES: tuple[str, ...] = tuple(b.name for b in BACKENDS)
BY_NAME: dict[str, Backend] = {b.name: b for b in BACKENDS}


def requested(backend: Optional[str]) -> str:
    """The backend a call asks for: its argument, else $AITER_SAGE_BACKEND, else '' (automatic).
    An unknown name is a ValueError."""
    name = (backend or os.environ.get(ENV_BACKEND, "")).strip().lower()
    if name and name not in BY_NAME:
        raise ValueError(f"aiter_sage: unknown backend {name!r}; choose one of {NAMES}")
    return name


def select(device, backend: Optional[str] = None) -> Backend:
    """The backend for tensors on `device` (a ValueError says why none fits)."""
    dev = torch.device(device)
    name = requested(backend)
    if name:
        b = BY_NAME[name]
        if not b.serves(dev):
            hosts = [x.name for x in BACKENDS if x.serves(dev)]
            raise ValueError(
                f"aiter_sage: backend {name!r} cannot run {dev.type} tensors here "
                f"(backends for them: {hosts or 'none'})"
            )
        return b
    for b in BACKENDS:
        if b.automatic and b.serves(dev):
            return b
    raise ValueError(
        f"aiter_sage: no backend for {dev.type} tensors (supported: CPU tensors, "
        f"ROCm GPUs gfx1201/gfx1200, and NVIDIA Hopper sm_90)"
    )


def target_for(device, backend: Optional[str] = None) -> str:
    """The JIT build target for a tensor device and a requested backend."""
    dev = torch.device(device)
    return select(dev, backend).target(dev)


def available() -> list[str]:
    """Backends usable in this process: a compiler for it is present (and, for a GPU backend,
    a supported GPU)."""
    found = []
    for b in BACKENDS:
        if b.device_type == "cpu":
            try:
                jit_driver.toolchain_for(b.target(torch.device("cpu")))
            except jit_driver.CompilerNotFound:
                continue
            found.append(b.name)
        elif torch.cuda.is_available():
            try:
                target_for("cuda", b.name)
            except ValueError:
                continue
            found.append(b.name)
    return found
