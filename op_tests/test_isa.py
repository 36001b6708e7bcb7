"""ISA checks of the gfx12 modules, built for real with clang++-19 (no GPU needed).

For gfx1201 and gfx1200: the attention kernel's main loop contains both WMMA kinds (iu8 for
Q·Kᵀ, fp8 for P·V), no kernel uses scratch, and every kernel reaches the occupancy it was
designed for (csrc/gfx12/README.md). Runnable as a script or under pytest."""

import pytest
from common import run_as_script

from aiter_sage import isa, jit_driver

ARCHS = ("gfx1201", "gfx1200")
# Designed occupancy (waves per SIMD). Attention: 251 VGPRs -> 5 (264-VGPR allocation);
# the prepare kernels are memory bound and small.
TARGET_WAVES = {
    "sage_attention_fwd_kernel": 5,
    "sage_prepare_qk_kernel": 12,
    "sage_prepare_v_scale_kernel": 12,
    "sage_prepare_v_quant_kernel": 12,
}
_TOOLS = ("llvm-objcopy", "llvm-objdump", "llvm-readelf", "clang-offload-bundler")


def _reports(arch):
    missing = [t for t in _TOOLS if not isa.tool(t)]
    if missing:
        pytest.skip(f"LLVM tools missing: {', '.join(missing)} (apt-get install llvm-19 clang-tools-19: .ci/install does)")
    try:
        built = isa.build_modules(arch)  # the JIT's own build for this arch
    except jit_driver.CompilerNotFound as e:
        pytest.skip(str(e))
    return {k.name: k for so in built.values() for k in isa.analyze_so(so, arch)}


def _check_arch(arch):
    kernels = _reports(arch)
    assert set(TARGET_WAVES) <= set(kernels), sorted(kernels)
    attn = kernels["sage_attention_fwd_kernel"]
    loop = attn.loop
    assert loop is not None, "attention main loop not found"
    assert loop.wmma_iu8 > 0 and loop.wmma_fp8 > 0, loop
    # 32 queries x 32 keys per wave per tile: 2 x 2 x 8 WMMAs of each kind
    assert loop.wmma_iu8 == 32 and loop.wmma_fp8 == 32, loop
    assert loop.barrier <= 2 and loop.scratch == 0  # one s_barrier (signal + wait on gfx12)
    for name, k in kernels.items():
        assert k.scratch_bytes == 0 and k.vgpr_spills == 0 and k.sgpr_spills == 0, k
        assert k.waves_per_simd >= TARGET_WAVES.get(name, 1), (name, k.waves_per_simd)


def test_isa_gfx1201():
    _check_arch("gfx1201")


def test_isa_gfx1200():
    _check_arch("gfx1200")


if __name__ == "__main__":
    run_as_script(__file__)
