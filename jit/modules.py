"""The module table: every shared object aiter_sage builds, its sources and the archs it serves.

Plain data (no eval'd strings). Source paths are relative to ``csrc/``. A module is built per
*target*: a GPU arch (``gfx1201``, ``gfx1200``: toolchain "hip"), ``emu`` (the gfx12 sources on
the CPU wave emulator), ``cpu`` (the host implementation) or ``torch`` (the binding, built once
per torch version). ``setup.py`` with PREBUILD_KERNELS=1 builds a module for the archs in
GPU_ARCHS that it lists; a module whose archs miss GPU_ARCHS is left to the JIT.
"""

from __future__ import annotations

from dataclasses import dataclass

GFX12_ARCHS = ("gfx1201", "gfx1200")
# NVIDIA targets (toolchain "cuda", nvcc): Hopper. The modules hold sm_90a code (wgmma).
CUDA_ARCHS = ("sm_90",)

# Sources of the gfx12 wave emulator runtime, linked into every "emu" build.
EMU_RUNTIME = ("emu/runtime.cpp", "emu/fiber.cpp", "emu/models.cpp")


@dataclass(frozen=True)
class ModuleSpec:
    name: str
    archs: tuple[str, ...]  # GPU archs served; empty: host-only module
    sources: dict[str, tuple[str, ...]]  # toolchain ("hip", "emu", "cpu", "torch") -> sources
    entry: str = ""  # launch symbol of the C ABI (csrc/include/sage/module_abi.h)
    root: str = ""  # folder the sources are relative to; "" = the package's csrc/
    flags: tuple[str, ...] = ()  # extra compile flags of this module
    kind_flags: dict[str, tuple[str, ...]] = None  # extra flags for one toolchain kind only

    def flags_for(self, kind: str) -> tuple[str, ...]:
        return tuple(self.flags) + tuple((self.kind_flags or {}).get(kind, ()))


MODULES: dict[str, ModuleSpec] = {
    spec.name: spec
    for spec in (
        ModuleSpec(
            name="module_gfx1201_sage_prepare",
            archs=GFX12_ARCHS + CUDA_ARCHS,
            sources={
                "hip": ("simt/prepare.hip",),
                # The same SIMT source through the platform shim's CUDA branch.
                "cuda": ("cuda/prepare.cu",),
                "emu": ("simt/prepare.hip",) + EMU_RUNTIME,
                "cpu": (
                    "cpu/prepare.cpp",
                    "cpu/prepare_scalar.cpp",
                    "cpu/prepare_avx2.cpp",
                    "cpu/prepare_avx512.cpp",
                    "cpu/cpu_runtime.cpp",
                ),
            },
            entry="sage_prepare_launch",
            # Bit-exact prepare: no multiply-add contraction (IEEE div/sqrt are nvcc's default).
            kind_flags={"cuda": ("--fmad=false",)},
        ),
        ModuleSpec(
            name="module_gfx1201_sage_attention",
            archs=GFX12_ARCHS + CUDA_ARCHS,
            sources={
                "hip": ("gfx12/attention.hip",),
                "cuda": ("cuda/attention.cu",),
                "emu": ("gfx12/attention.hip",) + EMU_RUNTIME,
                "cpu": (
                    "cpu/attention.cpp",
                    "cpu/attention_scalar.cpp",
                    "cpu/attention_avx2.cpp",
                    "cpu/attention_avx512.cpp",
                    "cpu/attention_amx.cpp",
                    "cpu/attention_amx_model.cpp",
                    "cpu/cpu_runtime.cpp",
                ),
            },
            entry="sage_attention_launch",
        ),
        ModuleSpec(
            name="aiter_sage_torch",
            archs=(),
            sources={"torch": ("binding/sage_torch.cpp",)},
        ),
    )
}

# The ops' kernel modules (what a user call needs), in build order.
KERNEL_MODULES = ("module_gfx1201_sage_prepare", "module_gfx1201_sage_attention")


def parse_archs(text: str) -> list[str]:
    """GPU_ARCHS syntax: names separated by ';', ',' or whitespace; '#' starts a comment."""
    names = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        for tok in line.replace(";", " ").replace(",", " ").split():
            name = tok.split(":", 1)[0]  # "gfx1201:xnack-" -> "gfx1201"
            names.append("sm_90" if name in ("sm_90a", "90", "9.0", "90a") else name)
    return names


def modules_for_archs(archs) -> list[tuple[str, str]]:
    """(module, arch) pairs to prebuild for GPU_ARCHS; modules serving none of them are left out."""
    wanted = list(dict.fromkeys(archs))
    return [(m, a) for m in KERNEL_MODULES for a in wanted if a in MODULES[m].archs]
