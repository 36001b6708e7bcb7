"""The backend table: every backend aiter_sage can run on, in one place.

The op layer, the torch binding, the tests and the benchmark all read this table. A backend
serves tensors of one device type; the JIT builds its modules for a *target* (``cpu``, ``emu``,
or a GPU arch) with one toolchain kind of ``jit/modules.py``. The first backend of a device type
whose ``automatic`` flag is set is the one a call without ``backend=`` gets.

:func:`resolve` is the one interpretation of a call's ``backend`` argument (and of
``$AITER_SAGE_BACKEND``): it returns a :class:`Resolved` record that the binding uses as it is
(which modules to load, whether they run on the host, the alignment their loads need). The
binding reads no backend from the environment, compares no backend name and parses no module
string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import env, jit_driver

ENV_BACKEND = "AITER_SAGE_BACKEND"


def _rocm_arch(device: torch.device) -> Optional[str]:
    if device.type != "cuda" or not torch.version.hip:
        return None
    return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]


def _emu_target(device: torch.device) -> str:
    # AITER_SAGE_EMU_ASAN=1: the AddressSanitizer build of the emulator (needs asan_env()).
    return "emu-asan" if env.get("AITER_SAGE_EMU_ASAN") == "1" else "emu"


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


# Row alignment (bytes) of the tensors a backend's kernels read with 128-bit loads: the binding
# copies a tensor whose base or row strides miss it (a valid view such as x[..., 1:65]).
ALIGN_NONE = 0  # any layout with a contiguous last dim (the cpu kernels)
ALIGN_128_BIT = 16


@dataclass(frozen=True)
class Backend:
    name: str
    device_type: str  # torch device type of the tensors it takes
    toolchain: str  # jit/modules.py source set ("cpu", "emu", "hip", "cuda")
    automatic: bool  # chosen when no backend is named
    target: Callable[[torch.device], str]  # device -> JIT build target
    host: bool  # runs on the calling host's threads (its stream argument: a SageCpuExecutor)
    align_bytes: int  # ALIGN_NONE or ALIGN_128_BIT
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
    Backend(
        "cpu", device_type="cpu", toolchain="cpu", automatic=True, target=lambda d: "cpu",
        host=True, align_bytes=ALIGN_NONE, summary="host C++ (AMX / AVX-512 / AVX2 tiers)",
    ),
    Backend(
        "emu", device_type="cpu", toolchain="emu", automatic=False, target=_emu_target,
        host=True, align_bytes=ALIGN_128_BIT, summary="the gfx12 kernels on the wave emulator",
    ),
    Backend(
        "gfx12", device_type="cuda", toolchain="hip", automatic=True, target=_gfx12_target,
        host=False, align_bytes=ALIGN_128_BIT, summary="RDNA4 GPUs (gfx1201, gfx1200)",
    ),
    Backend(
        "cuda", device_type="cuda", toolchain="cuda", automatic=True, target=_cuda_target,
        host=False, align_bytes=ALIGN_128_BIT, summary="NVIDIA Hopper GPUs (sm_90, wgmma)",
    ),
)  # fmt: skip
NAMES: tuple[str, ...] = tuple(b.name for b in BACKENDS)
BY_NAME: dict[str, Backend] = {b.name: b for b in BACKENDS}


def requested(backend: Optional[str]) -> str:
    """The backend a call asks for: its argument, else $AITER_SAGE_BACKEND, else '' (automatic).
    An unknown name is a ValueError."""
    name = (backend or env.get(ENV_BACKEND)).strip().lower()
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
    return resolve(device, backend).target


@dataclass(frozen=True)
class Resolved:
    """A backend resolved for one device: what the torch binding uses, as it is."""

    backend: str  # the canonical name (a row of BACKENDS)
    device: str  # the tensors' device, as torch spells it ("cpu", "cuda:0")
    target: str  # JIT build target of its modules
    toolchain: str
    host: bool  # Backend.host
    align_bytes: int  # Backend.align_bytes

    def module_path(self, module: str) -> str:
        """Path of `module` (a jit/modules.py name) built for this target (built if needed)."""
        return str(jit_driver.ensure_module(module, self.target))


# (device, backend name) -> its record, one record per (device, backend): the binding keeps
# the records it was given and looks them up by identity, so its module cache holds one entry
# per backend and device however a call names it ("EMU", " emu", $AITER_SAGE_BACKEND, or none).
_resolved: dict[tuple[str, str], Resolved] = {}
# The same records by the call's raw (device, name or $AITER_SAGE_BACKEND): every op call
# resolves, so the common case is one dict lookup.
_by_request: dict[tuple[str, str], Resolved] = {}


def _resolve(device, name: str) -> Resolved:
    dev = torch.device(device)
    b = select(dev, name or None)
    key = (str(dev), b.name)
    found = _resolved.get(key)
    if found is None:
        found = Resolved(b.name, key[0], b.target(dev), b.toolchain, b.host, b.align_bytes)
        found = _resolved.setdefault(key, found)
    return found


def resolve(device, backend: Optional[str] = None) -> Resolved:
    """The record for tensors on `device` and a call's `backend` argument (None or '': the
    environment's, else the table's automatic choice). Unknown names and backends that cannot
    serve the device raise ValueError (see :func:`select`)."""
    raw = (str(device), backend or env.get(ENV_BACKEND))
    found = _by_request.get(raw)
    if found is None:
        found = _by_request.setdefault(raw, _resolve(device, requested(raw[1])))
    return found


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
