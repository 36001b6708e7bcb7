"""Every environment variable aiter_sage reads, declared once.

Each entry names the variable, what unset means, one line on what it does and the files that
read it. Python reads every ``AITER_SAGE_*`` variable through :func:`get`, at call time (no
value is kept from import time: a variable set later in the process counts). The C++ modules
cannot import Python, so they read theirs where they are (``getenv`` in
``csrc/cpu/cpu_runtime.cpp``, ``csrc/emu/runtime.cpp``, ``csrc/binding/host_blocks.h``, the
cpu benchmark probe); they are declared here all the same, with those files as readers.
``op_tests/infra/test_env.py`` holds the code to it: every ``AITER_SAGE_*`` name in the code is
declared here, every declared name is read by the files listed, no Python file reads one
except through :func:`get`, and the README's table is this table.

    python3 -m aiter_sage.env     # prints the README's table

This file imports nothing from the package, so reading it builds nothing.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

PREFIX = "AITER_SAGE_"


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # what unset means, in words
    doc: str  # one line: what a value does
    readers: tuple[str, ...]  # repository paths of the files that read it


_EMU_RUNTIME = "csrc/emu/runtime.cpp"

VARIABLES: tuple[EnvVar, ...] = (
    # what a call runs
    EnvVar(
        "AITER_SAGE_BACKEND",
        "the first backend of `aiter_sage/backends.py` that serves the tensors",
        "`cpu`, `emu`, `gfx12` or `cuda` for calls that pass no `backend=`",
        ("aiter_sage/backends.py",),
    ),
    EnvVar(
        "AITER_SAGE_CPU_ISA",
        "the widest tier the CPU and OS allow",
        "force the cpu tier: `scalar`, `avx2`, `avx512`, `amx` or `amx_model` (tests); a tier "
        "the CPU lacks is an error",
        ("csrc/cpu/cpu_runtime.cpp", "op_benchmarks/cpu/bench_cpu_phases.cpp"),
    ),
    EnvVar(
        "AITER_SAGE_CHECK",
        "off",
        "`1` (debug): the Python functions warn (`SageCheckWarning`) about non-finite output "
        "rows, out-of-range LSE values and outlier blocks",
        ("aiter_sage/ops.py",),
    ),
    EnvVar(
        "AITER_SAGE_HOST_CACHE_MB",
        "1024",
        "MiB of freed host blocks (CPU tensors of 4 MiB or more) kept for reuse; `0` off",
        ("csrc/binding/host_blocks.h",),
    ),
    EnvVar(
        "AITER_SAGE_CUDA_SCHEDULE",
        "`default`",
        "(measurements only) the cuda kernels' schedule: `overlap` (the FP8 kernels "
        "overlapped, not serial), `pingpong` (overlapped, warpgroups taking turns), "
        "`shared192` (D 128: serial, three warpgroups of 64 rows sharing a CTA and its K/V "
        "copies), `wide256` (D 128: serial, two warpgroups sharing 256-key K/V tiles, one CTA "
        "per SM; slower, and its P is off the contract's rounding grid on long key loops) or "
        "`overlap192` (overlapped on 192-key tiles, P double-buffered; P rounds on a 192-key "
        "grid)",
        ("csrc/cuda/attention.cu",),
    ),
    # building modules
    EnvVar(
        "AITER_SAGE_CACHE_DIR",
        "`$XDG_CACHE_HOME/aiter_sage`, else `~/.cache/aiter_sage`",
        "the module cache, one folder per build target",
        ("aiter_sage/builder/paths.py",),
    ),
    EnvVar(
        "AITER_SAGE_HIP_TOOLCHAIN",
        "the first present of `hipcc`, `clang`, `hiprtc`",
        "force the gfx12 toolchain (`hipcc`, `clang` or `hiprtc`); a missing one is an error",
        ("aiter_sage/builder/toolchains.py",),
    ),
    EnvVar(
        "AITER_SAGE_HIP_CLANG",
        "`clang++-19`, `-20`, `-18` on `PATH`",
        "a clang++ that builds gfx12 code without ROCm",
        ("aiter_sage/builder/toolchains.py",),
    ),
    EnvVar(
        "AITER_SAGE_HIPRTC_LIB",
        "ROCm's pip package, `$ROCM_PATH/lib`, the system, `torch/lib`",
        "the libhiprtc the `hiprtc` toolchain loads",
        ("aiter_sage/hiprtc.py",),
    ),
    EnvVar(
        "AITER_SAGE_EMU_CXX",
        "`clang++-19`, `-20`, `-18`, `clang++`",
        "the clang++ that builds the emulator modules",
        ("aiter_sage/builder/toolchains.py",),
    ),
    EnvVar(
        "AITER_SAGE_NINJA",
        "`ninja` on `PATH`",
        "the ninja executable the JIT runs",
        ("aiter_sage/builder/ninja.py",),
    ),
    EnvVar(
        "AITER_SAGE_LOG_LEVEL",
        "`INFO`",
        "level of the `aiter_sage` logger (`INFO`: one line per module build); an unknown level "
        "warns and keeps `INFO`",
        ("aiter_sage/log.py",),
    ),
    EnvVar(
        "AITER_SAGE_LOCK_TIMEOUT",
        "wait, naming the holder every 30 s",
        "seconds to wait for another process's build of the same module before `LockTimeout`",
        ("aiter_sage/builder/cache.py",),
    ),
    EnvVar(
        "AITER_SAGE_IGNORE_PREBUILT",
        "prebuilt modules are used",
        "`1`: ignore modules prebuilt by `pip install` and build into the cache (tests)",
        ("aiter_sage/builder/driver.py",),
    ),
    EnvVar(
        "AITER_SAGE_LAZY_REGISTER",
        "the ops register at import",
        "`1`: `import aiter_sage` does not register the torch ops (tests that load no binding)",
        ("aiter_sage/ops.py",),
    ),
    # the wave emulator
    EnvVar(
        "AITER_SAGE_EMU_THREADS",
        "the hardware's thread count",
        "host threads the emulator runs workgroups on, 1 to 4096; anything else fails the launch",
        (_EMU_RUNTIME,),
    ),
    EnvVar(
        "AITER_SAGE_EMU_STACK_KB",
        "64 (256 under ASan)",
        "emulator lane stack in KiB, 16 to 65536; outside that the launch fails",
        (_EMU_RUNTIME,),
    ),
    EnvVar(
        "AITER_SAGE_EMU_ASAN",
        "off",
        "`1`: the `emu` backend loads its AddressSanitizer build (see `aiter_sage.emu.asan_env()`)",
        ("aiter_sage/backends.py",),
    ),
    EnvVar(
        "AITER_SAGE_EMU_CHECK_ALIGN",
        "on",
        "`0`: no `lds-misaligned` / `global-misaligned` reports",
        (_EMU_RUNTIME,),
    ),
    EnvVar(
        "AITER_SAGE_EMU_CHECK_UNINIT",
        "on",
        "`0`: no `lds-uninitialized-read` reports",
        (_EMU_RUNTIME,),
    ),
    EnvVar(
        "AITER_SAGE_EMU_VERBOSE",
        "off",
        "set: every failing emulated launch prints its reports to stderr",
        (_EMU_RUNTIME,),
    ),
    # general variables the build reads
    EnvVar(
        "GPU_ARCHS",
        "`GPU_ARCHS.cfg`",
        "archs to prebuild, e.g. `gfx1201;gfx1200` or `sm_90`",
        ("aiter_sage/builder/paths.py",),
    ),
    EnvVar(
        "PREBUILD_KERNELS",
        "off",
        "`1`: `pip install .` builds the kernel modules for the archs of `GPU_ARCHS`",
        ("setup.py",),
    ),
    EnvVar(
        "ROCM_PATH",
        "`$HIP_PATH`, else `/opt/rocm`",
        "the ROCm root (hipcc, hiprtc, HIP headers)",
        ("aiter_sage/builder/paths.py", "aiter_sage/hiprtc.py"),
    ),
    EnvVar(
        "HIP_PATH",
        "`/opt/rocm`",
        "the ROCm root when `ROCM_PATH` is unset",
        ("aiter_sage/builder/paths.py",),
    ),
    EnvVar(
        "HIPCC",
        "`$ROCM_PATH/bin/hipcc`, `hipcc`",
        "the HIP compiler",
        ("aiter_sage/builder/toolchains.py",),
    ),
    EnvVar(
        "CUDA_HOME",
        "`$CUDA_PATH`, else `/usr/local/cuda`",
        "the CUDA root (nvcc)",
        ("aiter_sage/builder/toolchains.py",),
    ),
    EnvVar(
        "CUDA_PATH",
        "`/usr/local/cuda`",
        "the CUDA root when `CUDA_HOME` is unset",
        ("aiter_sage/builder/toolchains.py",),
    ),
    EnvVar(
        "NVCC",
        "`$CUDA_HOME/bin/nvcc`, `nvcc`",
        "the CUDA compiler",
        ("aiter_sage/builder/toolchains.py",),
    ),
    EnvVar(
        "CXX",
        "`c++`, `g++`, `clang++`",
        "host compiler of the cpu modules, the binding and hiprtc's host half",
        ("aiter_sage/builder/toolchains.py",),
    ),
    EnvVar("MAX_JOBS", "the CPU count", "parallel compile jobs", ("aiter_sage/builder/ninja.py",)),
    EnvVar(
        "XDG_CACHE_HOME",
        "`~/.cache`",
        "parent of the default module cache",
        ("aiter_sage/builder/paths.py",),
    ),
)

BY_NAME: dict[str, EnvVar] = {v.name: v for v in VARIABLES}


def get(name: str, default: str = "") -> str:
    """The value of the declared variable `name` now, or `default` when it is unset. An
    undeclared name is a KeyError: declare it in VARIABLES first."""
    if name not in BY_NAME:
        raise KeyError(f"aiter_sage: {name} is not declared in aiter_sage/env.py")
    return os.environ.get(name, default)


def markdown_table() -> str:
    """The README's environment table: one row per variable, in declaration order."""
    rows = ["| variable | default | effect |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.default} | {v.doc} |" for v in VARIABLES]
    return "\n".join(rows)


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")
