"""op_benchmarks/nvidia/ceiling.py: its stripped kernels are what it says they are.

The tool times two copies of the cuda attention kernel (no softmax; no wgmma) beside the
default on a GPU. Without one: each edit matches the current source exactly once (a kernel
change that moves the edited lines fails here rather than on the device), the stripped copies
compile with the JIT's nvcc flags, and their PTX has lost exactly what the name says; the
copy-and-bench plumbing runs end to end on the cpu backend.
"""

from __future__ import annotations

import importlib.util

import pytest

from aiter_sage.builder import paths

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import REPO, cuda_attention_kernels, nvcc_module, nvcc_or_fail

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


@pytest.fixture(scope="module")
def stripped_ptx(tmp_path_factory):
    """variant -> {(head dim, warpgroups, keys per tile): PTX} of its serial FP8 attention
    kernels."""
    nvcc_or_fail()
    ptx = {}
    for variant in ("default", "mma", "softmax"):
        tmp = tmp_path_factory.mktemp(variant)
        copy = ceiling.make_copy(variant, tmp / "repo")
        module = "module_gfx1201_sage_attention"
        nvcc_module(module, ("-ptx", "-o", "a.ptx"), tmp, csrc=copy / "csrc")
        kernels = cuda_attention_kernels((tmp / "a.ptx").read_text())
        ptx[variant] = {
            (d, wgs, n): body for (d, _, serial, wgs, n), body in kernels.items() if serial
        }
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
