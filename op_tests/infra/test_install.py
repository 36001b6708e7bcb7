"""`pip install .` (not only -e) gives a package that carries its sources and works elsewhere."""

import importlib.metadata
import os
import subprocess
import sys

import pytest

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import REPO, run_as_script


def test_pip_install_non_editable_runs_from_installed_copy(tmp_path):
    target = tmp_path / "site"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            str(REPO),
        ],
        capture_output=True,
        text=True,
    )
    if pip.returncode != 0 and "Could not find a version that satisfies" in pip.stderr:
        pytest.skip("no package index reachable for the build backend")
    assert pip.returncode == 0, pip.stderr[-3000:]
    pkg = target / "aiter_sage"
    assert (pkg / "_csrc" / "include" / "sage" / "params.h").is_file()
    assert (pkg / "jit" / "modules.py").is_file() and (pkg / "GPU_ARCHS.cfg").is_file()
    # The installed metadata carries the vLLM-Omni plugin entry point (pyproject.toml).
    (dist,) = target.glob("aiter_sage-*.dist-info")
    eps = importlib.metadata.PathDistribution(dist).entry_points
    (plugin,) = eps.select(group="vllm_omni.general_plugins")
    assert plugin.value == "aiter_sage.integrations.vllm_omni:register"
    script = (
        "import torch, aiter_sage as aiter\n"
        "from aiter_sage import jit_driver, ref\n"
        "assert str(jit_driver.csrc_dir()).startswith(%r), jit_driver.csrc_dir()\n"
        "q, k, v = (torch.randn(1, 70, 2, 128).bfloat16() for _ in range(3))\n"
        "out = aiter.gfx1201_sage_attention(q, k, v)\n"
        "acc = ref.accuracy(out, ref.attention_fp32(q, k, v, 128**-0.5))\n"
        "assert ref.in_band(acc), acc\n"
        "print('ok')\n" % str(pkg)
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


if __name__ == "__main__":
    run_as_script(__file__)
