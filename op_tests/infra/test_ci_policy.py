"""The CI skip policy: under CI=true only absent hardware may skip (op_tests/ci_policy.py)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import run_as_script

HERE = Path(__file__).resolve().parents[1]  # op_tests/: ci_policy.py

_SAMPLE = textwrap.dedent("""
    import pytest
    from ci_policy import HARDWARE_PREFIX

    def test_tool_missing():
        pytest.skip("clang-offload-bundler not found (apt-get install clang-tools-19)")

    @pytest.mark.skipif(True, reason="libfoo missing")
    def test_marked_skip():
        pass

    def test_no_gpu():
        pytest.skip(HARDWARE_PREFIX + "no gfx1201 GPU")

    def test_passes():
        assert True
""")


def _run(tmp_path, ci: str | None):
    (tmp_path / "test_sample.py").write_text(_SAMPLE)
    env = dict(os.environ, PYTHONPATH=str(HERE))
    env.pop("CI", None)
    env.pop("PYTEST_ADDOPTS", None)
    if ci is not None:
        env["CI"] = ci
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "ci_policy",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_sample.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r.stdout + r.stderr


def test_ci_turns_tool_skips_into_failures(tmp_path):
    out = _run(tmp_path, "true")
    # A skip in the call phase becomes a failure, one in setup (a skipif mark) an error: both
    # make pytest exit non-zero.
    assert "1 failed, 1 passed, 1 skipped, 1 error" in out, out
    assert "FAILED test_sample.py::test_tool_missing" in out, out
    assert "ERROR test_sample.py::test_marked_skip" in out, out
    assert "clang-tools-19" in out  # the failure repeats what to install


def test_outside_ci_skips_stay_skips(tmp_path):
    out = _run(tmp_path, None)
    assert "1 passed, 3 skipped" in out, out


if __name__ == "__main__":
    run_as_script(__file__)
