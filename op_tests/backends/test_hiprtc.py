"""The hiprtc toolchain end to end, without a GPU (docs/hiprtc.md).

hiprtc here is op_tests/cpp/comgr_hiprtc.cpp: the hiprtc C API on Debian's amd_comgr (what
ROCm's libhiprtc compiles through) with hiprtc's own runtime header. Debian's only real hiprtc
(inside HIP 5.2's libamdhip64) compiles for the current device and aborts without a GPU.
That comgr knows gfx1030 but no gfx11/gfx12, so the prepare kernels (no gfx12 builtins) are
built for gfx1030; the attention module and the ISA check need a hiprtc that knows gfx1201 and
skip, saying so, where there is none. Runnable as a script or under pytest."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from aiter_sage import hiprtc, isa, jit_driver  # noqa: E402
from aiter_sage.builder import toolchains  # noqa: E402

import _op_tests  # noqa: E402,F401  (op_tests/ and its groups on sys.path)
from test_isa import PREPARE_WAVES  # noqa: E402

ARCH = "gfx1030"  # an arch Debian 12's comgr (ROCm 5.2) knows
PREPARE = "module_gfx1201_sage_prepare"
PREPARE_KERNELS = set(PREPARE_WAVES)
STANDIN = REPO / "op_tests" / "cpp" / "comgr_hiprtc.cpp"


def _missing_prerequisite(what: str):
    """A Debian package the CI installs (.ci/install) is missing: an error under CI=true."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{what} missing on CI")
    pytest.skip(f"{what} missing")


@pytest.fixture(scope="session")
def standin_lib(tmp_path_factory) -> str:
    """The comgr-backed libhiprtc, built once (g++ + libamd-comgr-dev, via libamdhip64-dev)."""
    if not Path("/usr/include/amd_comgr.h").is_file():
        _missing_prerequisite("amd_comgr.h (apt-get install libamdhip64-dev)")
    cxx = shutil.which(os.environ.get("CXX", "")) or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        _missing_prerequisite("a C++ compiler")
    out = tmp_path_factory.mktemp("hiprtc") / "libhiprtc.so"
    subprocess.run(
        [
            cxx,
            "-std=c++17",
            "-O1",
            "-shared",
            "-fPIC",
            str(STANDIN),
            "-o",
            str(out),
            "-lamd_comgr",
            "-ldl",
        ],
        check=True,
    )
    return str(out)


@pytest.fixture
def hiprtc_env(standin_lib, tmp_path, monkeypatch):
    """hiprtc forced, the stand-in as libhiprtc, a fresh module cache."""
    monkeypatch.setenv("AITER_SAGE_HIPRTC_LIB", standin_lib)
    monkeypatch.setenv("AITER_SAGE_HIP_TOOLCHAIN", "hiprtc")
    monkeypatch.setenv("AITER_SAGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AITER_SAGE_IGNORE_PREBUILT", "1")
    hiprtc.load_library.cache_clear()
    yield tmp_path
    hiprtc.load_library.cache_clear()


def _readelf(*args) -> str:
    exe = isa.tool("llvm-readelf")
    if not exe:
        _missing_prerequisite("llvm-readelf (apt-get install llvm-19)")
    return subprocess.run([exe, *args], check=True, capture_output=True, text=True).stdout


def _code_object(so: Path, work: Path) -> Path:
    if not isa.tool("llvm-objcopy"):
        _missing_prerequisite("llvm-objcopy (apt-get install llvm-19)")
    return isa.extract_code_object(so, ARCH, work)


def _kernel_symbols(co: Path) -> set[str]:
    """FUNC symbols of an amdgcn code object (the kernels hipModuleGetFunction can find)."""
    names = set()
    for line in _readelf("--dyn-syms", "-W", str(co)).splitlines():
        f = line.split()
        if len(f) >= 8 and f[3] == "FUNC" and f[4] == "GLOBAL":
            names.add(f[7])
    return names


# ----------------------------------------------------------------------------------------------
# The prepare module through hiprtc
# ----------------------------------------------------------------------------------------------
def test_prepare_builds_a_code_object_with_its_kernels(hiprtc_env):
    so = jit_driver.ensure_module(PREPARE, ARCH)
    co = _code_object(so, hiprtc_env)
    header = _readelf("-h", str(co))
    assert "EM_AMDGPU" in header and ARCH in header, header
    assert PREPARE_KERNELS <= _kernel_symbols(co)
    # The kernels' resources as the driver will see them: no scratch in any prepare kernel.
    reports = {r.name: r for r in isa.analyze_so(so, ARCH)}
    assert set(reports) == PREPARE_KERNELS
    assert all(r.scratch_bytes == 0 and r.vgprs > 0 for r in reports.values()), reports


def test_host_half_exports_the_module_abi_and_loads(hiprtc_env):
    """The host .so links (the embedded code object resolves), exports the C ABI, and its
    own launch validation runs: built from the same .hip launch section as hipcc builds."""
    so = jit_driver.ensure_module(PREPARE, ARCH)
    syms = _readelf("--dyn-syms", "-W", str(so))
    for sym in ("sage_abi_version", "sage_module_info", "sage_prepare_launch"):
        assert sym in syms
    assert "sage_hiprtc_code_object" not in syms  # hidden: each module keeps its own
    probe = (
        "import ctypes,sys; m=ctypes.CDLL(sys.argv[1]);"
        "m.sage_module_last_error.restype=ctypes.c_char_p;"
        "print(m.sage_prepare_launch(None,None), m.sage_module_last_error().decode())"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(so)], check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == "1 sage_prepare_launch: null SageParams", out


def test_second_call_hits_the_cache(hiprtc_env):
    so = jit_driver.ensure_module(PREPARE, ARCH)
    stamp = so.stat().st_mtime_ns
    meta = json.loads(so.with_suffix(".json").read_text())
    assert meta["target"] == ARCH
    assert jit_driver.ensure_module(PREPARE, ARCH) == so
    assert so.stat().st_mtime_ns == stamp  # not rebuilt
    assert len(list(so.parent.glob(f"{PREPARE}-*.so"))) == 1


def _key(tc, spec):
    return jit_driver.cache_key(spec, ARCH, tc, jit_driver.sources_digest(spec, "hip"))


def test_key_changes_with_hiprtc_version_and_sources(hiprtc_env, tmp_path):
    spec = jit_driver.module_table().MODULES[PREPARE]
    tc = jit_driver.toolchain_for(ARCH)
    assert isinstance(tc, jit_driver.HiprtcToolchain)
    assert tc.hiprtc_lib == os.environ["AITER_SAGE_HIPRTC_LIB"] and tc.hiprtc_version
    base = _key(tc, spec)
    assert _key(dataclasses.replace(tc, hiprtc_version=tc.hiprtc_version + ".1"), spec) != base
    assert _key(dataclasses.replace(tc, hiprtc_lib="/other/libhiprtc.so.7"), spec) != base
    # An edit of the kernel source: the same module from a copy of csrc with one byte more.
    copy = tmp_path / "csrc"
    shutil.copytree(jit_driver.csrc_dir(), copy)
    (copy / "simt" / "prepare.hip").write_text((copy / "simt" / "prepare.hip").read_text() + "\n")
    edited = dataclasses.replace(spec, root=str(copy))
    assert _key(tc, edited) != _key(tc, dataclasses.replace(spec, root=str(jit_driver.csrc_dir())))


def test_forced_toolchain(hiprtc_env, monkeypatch):
    assert isinstance(jit_driver.toolchain_for(ARCH), jit_driver.HiprtcToolchain)
    monkeypatch.setenv("AITER_SAGE_HIP_TOOLCHAIN", "nvcc")
    with pytest.raises(ValueError, match="AITER_SAGE_HIP_TOOLCHAIN='nvcc'"):
        jit_driver.toolchain_for(ARCH)
    # Forced hiprtc with no libhiprtc anywhere: a clear CompilerNotFound, no fallback.
    monkeypatch.setenv("AITER_SAGE_HIP_TOOLCHAIN", "hiprtc")
    monkeypatch.setenv("AITER_SAGE_HIPRTC_LIB", str(hiprtc_env / "absent" / "libhiprtc.so"))
    monkeypatch.setattr(hiprtc, "library_candidates", lambda: [os.environ["AITER_SAGE_HIPRTC_LIB"]])
    hiprtc.load_library.cache_clear()
    with pytest.raises(jit_driver.CompilerNotFound, match="no libhiprtc found"):
        jit_driver.toolchain_for(ARCH)


def test_default_order_prefers_a_compiler_over_hiprtc(hiprtc_env, monkeypatch):
    monkeypatch.delenv("AITER_SAGE_HIP_TOOLCHAIN")
    tc = jit_driver.toolchain_for(ARCH)
    if toolchains._hipcc_toolchain(ARCH) or toolchains._clang_hip_toolchain(ARCH):
        assert not isinstance(tc, jit_driver.HiprtcToolchain)
    # With neither hipcc nor clang, the same call falls back to hiprtc.
    monkeypatch.setattr(toolchains, "_hipcc_toolchain", lambda arch: None)
    monkeypatch.setattr(toolchains, "_clang_hip_toolchain", lambda arch: None)
    assert isinstance(jit_driver.toolchain_for(ARCH), jit_driver.HiprtcToolchain)


def test_compile_error_carries_hiprtc_log(hiprtc_env, tmp_path):
    src = tmp_path / "broken" / "simt" / "prepare.hip"
    src.parent.mkdir(parents=True)
    src.write_text(
        '#include "sage/platform.h"\n'
        "SAGE_KERNEL(broken_kernel, 64)(int* p) { p[0] = undeclared_thing; }\n"
    )
    spec = dataclasses.replace(
        jit_driver.module_table().MODULES[PREPARE], root=str(src.parent.parent)
    )
    with pytest.raises(jit_driver.BuildError) as e:
        jit_driver.build_into(spec, ARCH, tmp_path / "out")
    msg = str(e.value)
    assert "hiprtc" in msg and "failed to compile prepare.hip" in msg, msg
    assert "undeclared_thing" in msg and "error" in msg, msg  # hiprtc's own diagnostic


def test_library_search_order(monkeypatch, tmp_path):
    """The explicit variable first, then the pip ROCm SDK, ROCM_PATH, sonames, torch/lib."""
    monkeypatch.setenv("AITER_SAGE_HIPRTC_LIB", "/explicit/libhiprtc.so")
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libhiprtc.so.7").write_bytes(b"")
    monkeypatch.setattr(hiprtc, "_rocm_sdk_libraries", lambda: ["/sdk/libhiprtc.so.7"])
    c = hiprtc.library_candidates()
    assert c[:3] == [
        "/explicit/libhiprtc.so",
        "/sdk/libhiprtc.so.7",
        str(tmp_path / "lib" / "libhiprtc.so.7"),
    ], c
    assert c.index("libhiprtc.so") > 2


# ----------------------------------------------------------------------------------------------
# gfx1201 through hiprtc: needs a hiprtc whose compiler knows gfx1201 (ROCm >= 6.4)
# ----------------------------------------------------------------------------------------------
def _unknown_arch(log: str) -> bool:
    low = log.lower()
    return (
        "does not know the isa" in low
        or "unknown target" in low
        or "invalid target" in low
        or "unsupported" in low
    )


def test_gfx1201_modules_and_isa(hiprtc_env):
    """Both modules for gfx1201 through hiprtc, held to test_isa.py's ISA properties — or,
    with a hiprtc too old to know gfx1201 (Debian's comgr), a BuildError whose text carries
    hiprtc's own log saying so (never a crash or a silent fallback)."""
    from test_isa import TARGET_WAVES

    for tool in ("llvm-objcopy", "llvm-objdump", "llvm-readelf"):
        if not isa.tool(tool):
            _missing_prerequisite(f"{tool} (apt-get install llvm-19)")
    sos = []
    for name in jit_driver.module_table().KERNEL_MODULES:
        try:
            sos.append(jit_driver.ensure_module(name, "gfx1201"))
        except jit_driver.BuildError as e:
            assert _unknown_arch(str(e)) and "hiprtc" in str(e), str(e)[-3000:]
            return  # the old hiprtc's answer is the property checked here
    kernels = {k.name: k for so in sos for k in isa.analyze_so(so, "gfx1201")}
    assert set(TARGET_WAVES) <= set(kernels), sorted(kernels)
    loop = kernels["sage_attention_fwd_kernel"].loop
    assert loop is not None and loop.wmma_iu8 == 32 and loop.wmma_fp8 == 32, loop
    for name, k in kernels.items():
        assert k.scratch_bytes == 0 and k.vgpr_spills == 0, k
        assert k.waves_per_simd >= TARGET_WAVES.get(name, 1), (name, k.waves_per_simd)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
