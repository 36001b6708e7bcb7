"""The JIT driver: cache hits and misses, rebuilds, locking, corruption, compilers, prebuild."""

import ctypes
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aiter_sage import jit_driver
from aiter_sage.builder import cache as jit_cache
from aiter_sage.builder import driver, ninja, paths, toolchains

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import REPO, run_as_script

MODULES = jit_driver.module_table()

PROBE = """
#include "sage/module_abi.h"
#include "probe.h"
SAGE_DEFINE_MODULE_ABI("probe_module target=cpu")
SAGE_EXPORT int sage_probe_launch(const SageParams*, void*) { return PROBE_VALUE; }
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("AITER_SAGE_CACHE_DIR", str(d))
    return d


@pytest.fixture
def builds(monkeypatch):
    """Counts real compiler runs."""
    count = []
    real = ninja.run_ninja

    def counting(*a, **kw):
        count.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(ninja, "run_ninja", counting)
    return count


def make_probe(root: Path, value: int, name: str = "probe_module"):
    """A one-file cpu module under `root` whose launch returns `value` (shared with
    test_reliability_jit.py)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "probe.cpp").write_text(PROBE)
    (root / "probe.h").write_text(f"#define PROBE_VALUE {value}\n")
    return MODULES.ModuleSpec(
        name=name,
        archs=(),
        sources={"cpu": ("probe.cpp",)},
        entry="sage_probe_launch",
        root=str(root),
    )


def call_probe(so: Path) -> int:
    """Loads `so` (a path this process has not loaded before: dlopen would reuse a mapping)."""
    return ctypes.CDLL(str(so)).sage_probe_launch(None, None)


def test_cache_miss_then_hit(tmp_path, cache, builds):
    spec = make_probe(tmp_path / "src", 7)
    first = jit_driver.ensure_module(spec, "cpu")
    assert len(builds) == 1 and call_probe(first) == 7
    assert first.parent == cache / "cpu"
    second = jit_driver.ensure_module(spec, "cpu")
    assert second == first and len(builds) == 1


def test_source_or_header_edit_rebuilds(tmp_path, cache, builds):
    spec = make_probe(tmp_path / "src", 7)
    a = jit_driver.ensure_module(spec, "cpu")
    (tmp_path / "src" / "probe.h").write_text("#define PROBE_VALUE 8\n")  # an included header
    b = jit_driver.ensure_module(spec, "cpu")
    assert a != b and len(builds) == 2 and call_probe(b) == 8
    (tmp_path / "src" / "probe.cpp").write_text(PROBE + "\n// edited\n")
    c = jit_driver.ensure_module(spec, "cpu")
    assert c not in (a, b) and len(builds) == 3


def test_inc_file_edit_rebuilds(tmp_path, cache, builds):
    """The cpu kernels live in .inc files that their .cpp files include: an edit of one is a
    new module (the key hashes .inc files like headers)."""
    src = tmp_path / "src"
    spec = make_probe(src, 7)
    (src / "probe.h").write_text('#include "value.inc"\n')
    (src / "value.inc").write_text("#define PROBE_VALUE 11\n")
    a = jit_driver.ensure_module(spec, "cpu")
    assert call_probe(a) == 11
    (src / "value.inc").write_text("#define PROBE_VALUE 12\n")
    b = jit_driver.ensure_module(spec, "cpu")
    assert a != b and len(builds) == 2 and call_probe(b) == 12


# Preprocessor defines that pick each kind's branch of the platform shim (SAGE_HIPRTC keeps
# the hip branch off the HIP runtime's headers, which a host compiler cannot read).
KIND_DEFINES = {
    "hip": ("-D__HIP__", "-DSAGE_HIPRTC"),
    "cuda": ("-D__CUDACC__",),
    "emu": ("-DSAGE_EMU",),
    "cpu": (),
    "torch": (),
}


def _compiler_dependencies(source: Path, kind: str) -> set[Path]:
    """The files under csrc/ that the host compiler's preprocessor opens for `source` (-MM -MG:
    what it really includes, system headers left out, missing ones tolerated)."""
    cxx = toolchains._host_cxx()
    if cxx is None:
        pytest.fail("no host C++ compiler (apt-get install g++)")
    csrc = jit_driver.csrc_dir()
    out = subprocess.run(
        [cxx, "-x", "c++", "-std=c++17", "-MM", "-MG", f"-I{csrc}", f"-I{csrc / 'include'}"]
        + list(KIND_DEFINES[kind])
        + [str(source)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    names = out.replace("\\\n", " ").split(":", 1)[1].split()
    return {Path(n).resolve() for n in names if Path(n).resolve().is_relative_to(csrc.resolve())}


@pytest.mark.parametrize(
    "name,kind", [(m.name, k) for m in MODULES.MODULES.values() for k in m.sources]
)
def test_cache_key_covers_every_file_the_compiler_reads(name, kind):
    """Every csrc/ file the compiler opens for a module's sources is hashed into its key, also
    one included from another room (cuda/prepare.cu compiles simt/prepare.hip)."""
    spec = MODULES.MODULES[name]
    hashed = set(jit_cache._source_files(spec, kind))
    for src in spec.sources[kind]:
        missing = _compiler_dependencies(jit_driver.csrc_dir() / src, kind) - hashed
        assert not missing, f"{name} [{kind}] {src}: not in the cache key: {sorted(missing)}"


def test_compile_and_link_flags_are_in_the_key(tmp_path, cache, builds):
    """A module's own flags, the toolchain's compile flags and its link flags each change the
    key: a build with other flags is another module."""
    spec = make_probe(tmp_path / "src", 7)
    tc = jit_driver.toolchain_for("cpu")
    digest = jit_driver.sources_digest(spec, tc.kind)
    base = jit_driver.cache_key(spec, "cpu", tc, digest)
    other_c = dataclasses.replace(tc, cflags=tc.cflags + ("-DPROBE_C=1",))
    other_l = dataclasses.replace(tc, ldflags=tc.ldflags + ("-Wl,--as-needed",))
    other_spec = dataclasses.replace(spec, flags=("-DPROBE_SPEC=1",))
    keys = {
        base,
        jit_driver.cache_key(spec, "cpu", other_c, digest),
        jit_driver.cache_key(spec, "cpu", other_l, digest),
        jit_driver.cache_key(other_spec, "cpu", tc, digest),
    }
    assert len(keys) == 4
    # End to end: the module's flags reach the compiler and the cache.
    (tmp_path / "src" / "probe.h").write_text(
        "#ifdef PROBE_SPEC\n#define PROBE_VALUE 21\n#else\n#define PROBE_VALUE 7\n#endif\n"
    )
    spec_digest = jit_driver.sources_digest(spec, tc.kind)
    a = jit_driver.ensure_module(spec, "cpu")
    b = jit_driver.ensure_module(other_spec, "cpu")
    assert jit_driver.sources_digest(other_spec, tc.kind) == spec_digest  # only flags differ
    assert a != b and len(builds) == 2 and call_probe(a) == 7 and call_probe(b) == 21


def test_same_size_corruption_of_a_cached_module_is_rebuilt(tmp_path, cache, builds):
    """One byte of the module's info string changed: the file keeps its size and still loads
    and exports every symbol, so only the recorded sha256 can tell; it is rebuilt."""
    spec = make_probe(tmp_path / "src", 9)
    so = jit_driver.ensure_module(spec, "cpu")  # not loaded in this process
    data = bytearray(so.read_bytes())
    at = data.find(b"probe_module target=cpu")
    assert at >= 0
    data[at] = ord("P")
    damaged = so.with_suffix(".damaged")
    damaged.write_bytes(bytes(data))
    os.replace(damaged, so)
    assert so.stat().st_size == len(data)
    assert driver._check_loadable(so, spec.entry) is None
    again = jit_driver.ensure_module(spec, "cpu")
    assert again == so and len(builds) == 2
    assert b"probe_module target=cpu" in so.read_bytes() and call_probe(so) == 9


def test_compiler_change_rebuilds(tmp_path, cache, builds, monkeypatch):
    compilers = [c for c in ("g++", "clang++-19", "clang++") if shutil.which(c)]
    if len(compilers) < 2:
        pytest.skip("needs two host compilers")
    spec = make_probe(tmp_path / "src", 7)
    monkeypatch.setenv("CXX", compilers[0])
    a = jit_driver.ensure_module(spec, "cpu")
    monkeypatch.setenv("CXX", compilers[1])
    b = jit_driver.ensure_module(spec, "cpu")
    assert a != b and len(builds) == 2


def test_first_build_logs_one_line(tmp_path, cache):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    jit_driver.logger.addHandler(handler)
    try:
        spec = make_probe(tmp_path / "src", 3)
        jit_driver.ensure_module(spec, "cpu")
        jit_driver.ensure_module(spec, "cpu")
    finally:
        jit_driver.logger.removeHandler(handler)
    lines = [r.getMessage() for r in records]
    assert len(lines) == 1, lines
    assert lines[0].startswith("built probe_module for cpu in ") and lines[0].endswith(" s")


def test_concurrent_processes_build_once(tmp_path, cache):
    """Several processes asking at once: one compiles, the others wait and load its file."""
    src = tmp_path / "src"
    make_probe(src, 5)
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(REPO)!r})
        from aiter_sage import jit_driver
        m = jit_driver.module_table()
        spec = m.ModuleSpec(name="probe_module", archs=(), sources={{"cpu": ("probe.cpp",)}},
                            entry="sage_probe_launch", root={str(src)!r})
        print(jit_driver.ensure_module(spec, "cpu"))
    """)
    env = dict(os.environ, AITER_SAGE_CACHE_DIR=str(cache))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {o.strip() for o, _ in outs}
    built = sum(e.count("built probe_module") for _, e in outs)
    assert len(paths) == 1 and built == 1, outs
    assert call_probe(Path(paths.pop())) == 5


@pytest.mark.parametrize("damage", ["garbage", "truncated", "manifest", "unloadable"])
def test_corrupt_cached_file_is_rebuilt(tmp_path, cache, builds, damage):
    spec = make_probe(tmp_path / "src", 9)
    so = jit_driver.ensure_module(spec, "cpu")
    manifest = so.with_suffix(".json")

    def overwrite(path, data: bytes):  # a new file: this process has the old one mapped
        tmp = path.with_suffix(".damaged")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    if damage == "garbage":
        overwrite(so, b"\x7fELF not really")
    elif damage == "truncated":
        overwrite(so, so.read_bytes()[:1000])
    elif damage == "manifest":
        overwrite(manifest, b"{ broken")
    else:  # hashes as recorded, but is not a loadable module
        overwrite(so, b"junk")
        meta = json.loads(manifest.read_text())
        meta["sha256"] = jit_cache._sha256_file(so)
        manifest.write_text(json.dumps(meta))
    again = jit_driver.ensure_module(spec, "cpu")
    assert again == so and len(builds) == 2 and call_probe(again) == 9


def test_missing_compiler_says_what_to_install(monkeypatch, tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    for var in ("CXX", "HIPCC", "AITER_SAGE_EMU_CXX", "AITER_SAGE_HIP_CLANG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "no-rocm"))
    with pytest.raises(jit_driver.CompilerNotFound, match="apt-get install g\\+\\+"):
        jit_driver.toolchain_for("cpu")
    with pytest.raises(jit_driver.CompilerNotFound, match="ROCm.*clang-19 lld-19 libamdhip64-dev"):
        jit_driver.toolchain_for("gfx1201")
    with pytest.raises(jit_driver.CompilerNotFound, match="clang"):
        jit_driver.toolchain_for("emu")


def test_binding_builds_with_openmp_exactly_where_torch_and_the_compiler_have_it(
    tmp_path, cache, monkeypatch
):
    """The torch binding is compiled with -fopenmp (so that the cpu ops' workers reach torch's
    threads) where torch runs on OpenMP and the host compiler builds OpenMP code; a compiler
    that refuses -fopenmp (clang without libomp) gets a binding without it, not a failed
    build."""
    import torch

    real = shutil.which(os.environ.get("CXX", "")) or shutil.which("g++")
    assert real, "no host C++ compiler"
    refusing = tmp_path / "cxx-without-openmp"
    refusing.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do [ "$a" = -fopenmp ] && { echo "no omp" >&2; exit 1; }; done\n'
        f'exec {real} "$@"\n'
    )
    refusing.chmod(0o755)
    assert not toolchains._compiler_has_openmp(str(refusing))
    # the answer is kept per compiler: a later process reads it instead of compiling again
    toolchains._compiler_has_openmp.cache_clear()
    with monkeypatch.context() as m:
        m.setattr(toolchains.subprocess, "run", lambda *a, **k: pytest.fail("probed again"))
        assert not toolchains._compiler_has_openmp(str(refusing))
    monkeypatch.setenv("CXX", str(refusing))
    assert "-fopenmp" not in jit_driver.toolchain_for("torch").cflags
    monkeypatch.setenv("CXX", real)
    has = toolchains._compiler_has_openmp(real)
    want = torch.backends.openmp.is_available() and has
    tc = jit_driver.toolchain_for("torch")
    assert ("-fopenmp" in tc.cflags) == want and ("-fopenmp" in tc.ldflags) == want


def test_prebuild_arch_filter():
    pairs = MODULES.modules_for_archs
    kernels = set(MODULES.KERNEL_MODULES)
    assert {m for m, _ in pairs(["gfx1201"])} == kernels
    assert {a for _, a in pairs(["gfx1201"])} == {"gfx1201"}
    assert {a for _, a in pairs(["gfx1100", "gfx1200"])} == {"gfx1200"}
    assert len(pairs(["gfx1200", "gfx1201"])) == 2 * len(kernels)
    assert pairs(["gfx942", "gfx90a", "gfx1100"]) == []
    assert MODULES.parse_archs("gfx1201:xnack-;gfx942, gfx1200  # comment\n# x\n") == [
        "gfx1201",
        "gfx942",
        "gfx1200",
    ]


def test_gpu_archs_env_overrides_cfg(monkeypatch):
    monkeypatch.delenv("GPU_ARCHS", raising=False)
    from_cfg = jit_driver.configured_archs()
    assert "gfx1201" in from_cfg
    monkeypatch.setenv("GPU_ARCHS", "gfx942")
    assert jit_driver.configured_archs() == ["gfx942"]


def _setup_build_py(tmp_path, archs: str) -> Path:
    out = tmp_path / f"lib-{archs.replace(';', '_')}"
    env = dict(
        os.environ,
        PREBUILD_KERNELS="1",
        GPU_ARCHS=archs,
        AITER_SAGE_CACHE_DIR=str(tmp_path / "cache"),
    )
    r = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out / "aiter_sage"


def test_setup_prebuild_includes_gfx12_only_when_listed(tmp_path, monkeypatch):
    """PREBUILD_KERNELS=1: the gfx1201 modules are built for gfx1201/gfx1200, else left out."""
    try:
        jit_driver.toolchain_for("gfx1201")
    except jit_driver.CompilerNotFound as e:
        pytest.skip(str(e))
    pkg = _setup_build_py(tmp_path, "gfx942;gfx1100")
    assert (pkg / "_csrc" / "gfx12" / "attention.hip").is_file()
    assert not list((pkg / "_prebuilt").rglob("*.so")) if (pkg / "_prebuilt").exists() else True
    pkg = _setup_build_py(tmp_path, "gfx1201;gfx942;gfx1200")
    built = sorted(p.relative_to(pkg / "_prebuilt") for p in (pkg / "_prebuilt").rglob("*.so"))
    names = {(p.parts[0], p.name.rsplit("-", 1)[0]) for p in built}
    assert names == {(a, m) for a in ("gfx1201", "gfx1200") for m in MODULES.KERNEL_MODULES}
    assert len(built) == 4
    # The prebuilt files are what ensure_module takes first for a matching source tree,
    # without running a compiler.
    monkeypatch.setattr(paths, "prebuilt_root", lambda: pkg / "_prebuilt")
    monkeypatch.setattr(toolchains, "toolchain_for", lambda t: pytest.fail("compiler used"))
    for arch in ("gfx1201", "gfx1200"):
        so = jit_driver.ensure_module("module_gfx1201_sage_attention", arch)
        assert so.parent == pkg / "_prebuilt" / arch
        assert b"sage_attention_fwd_kernel" in so.read_bytes()


if __name__ == "__main__":
    run_as_script(__file__)
