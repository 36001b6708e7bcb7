"""op_benchmarks/nvidia/ceiling.py: its stripped kernels are what it says they are.

The tool times two copies of the cuda attention kernel (no softmax; no wgmma) beside the
default on a GPU. Without one: each edit matches the current source exactly once (a kernel
change that moves the edited lines fails here rather than on the device), the stripped copies
compile with the JIT's nvcc flags, and their PTX has lost exactly what the name says; the
copy-and-bench plumbing runs end to end on the cpu backend.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess

import pytest

from aiter_sage import jit_driver
from aiter_sage.builder import paths, toolchains

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import REPO

_spec = importlib.util.spec_from_file_location("ceiling", REPO / "op_benchmarks/nvidia/ceiling.py")
ceiling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ceiling)


def test_each_edit_matches_the_kernel_once():
    source = (REPO / ceiling.KERNEL).read_text()
    for variant, edits in ceiling.STRIP.items():
        stripped = ceiling.strip(source, variant)
        for old, new in edits:
            assert old not in stripped and new in stripped, variant
        # an anchor that no longer matches (or matches twice) is an error, not a silent no-op
        with pytest.raises(ValueError, match="matches 0 times"):
            ceiling.strip(source.replace(edits[0][0], ""), variant)
        with pytest.raises(ValueError, match="matches 2 times"):
            ceiling.strip(source + edits[0][0], variant)


def _serial_kernels(ptx: str) -> dict[str, str]:
    """mangled name -> PTX body of each serial FP8 attention kernel (Traits' last flag set)."""
    out = {}
    for part in re.split(r"(?=^\.visible \.entry )", ptx, flags=re.M)[1:]:
        name = re.match(r"\.visible \.entry (\S+?)\(", part).group(1)
        if re.search(r"TraitsILi\d+ELi\d+ELb0ELb0ELi\d+ELi\d+ELb1E", name):
            out[name] = part
    return out


@pytest.fixture(scope="module")
def stripped_ptx(tmp_path_factory):
    if not toolchains._nvcc():
        pytest.fail("nvcc (CUDA 12.3+) is needed to compile the cuda sources; set NVCC/CUDA_HOME")
    spec = jit_driver.module_table().MODULES["module_gfx1201_sage_attention"]
    tc = jit_driver.toolchain_for("sm_90")
    csrc = str(jit_driver.csrc_dir())
    ptx = {}
    for variant in ("default", "mma", "softmax"):
        tmp = tmp_path_factory.mktemp(variant)
        copy = ceiling.make_copy(variant, tmp / "repo")
        flags = [
            f.replace(csrc, str(copy / "csrc"))
            for f in (*tc.cflags, *paths._spec_flags(spec, "cuda"))
        ]
        cmd = [tc.compiler, *flags, "-ptx", "-o", str(tmp / "a.ptx"), str(copy / ceiling.KERNEL)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ptx[variant] = _serial_kernels((tmp / "a.ptx").read_text())
    return ptx


def test_stripped_kernels_lose_what_their_names_say(stripped_ptx):
    default, mma, softmax = (stripped_ptx[v] for v in ("default", "mma", "softmax"))
    assert default and set(default) == set(mma) == set(softmax)
    wgmma = "wgmma.mma_async"
    for name, body in default.items():
        ex2 = body.count("ex2.approx")
        assert ex2 >= 64 and wgmma in body, name  # the real loop: 64 numerators a tile
        # mma: every wgmma kept, the numerators gone (what is left: O's home and the epilogue)
        assert mma[name].count(wgmma) == body.count(wgmma), name
        assert mma[name].count("ex2.approx") < ex2 // 8, name
        # softmax: no wgmma at all, every exponential kept
        assert wgmma not in softmax[name], name
        assert softmax[name].count("ex2.approx") == ex2, name


def test_copy_and_bench_plumbing_on_the_cpu_backend(tmp_path):
    tree = ceiling.make_copy("default", tmp_path / "default")
    assert (tree / ceiling.KERNEL).read_text() == (REPO / ceiling.KERNEL).read_text()
    # the default copy's sources are the repository's: its modules are the cached ones
    args = ["--rounds", "1", "-s", "128", "256"]
    ms = ceiling.bench(tree, args, backend="cpu", cache=paths.cache_root())
    assert set(ms) == {128, 256} and all(t > 0 for t in ms.values())
