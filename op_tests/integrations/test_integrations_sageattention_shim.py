"""The ``sageattention`` shim, each case in a fresh interpreter: ``from sageattention import
sageattn`` gets aiter_sage's only after the opt-in and only where no real SageAttention is
found (a fake "real" package on sys.path wins); the .pth install runs without importing torch
at start-up, and uninstall removes it."""

import os
import subprocess
import sys
import textwrap

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import REPO, run_as_script

RUN_OURS = """
import torch, aiter_sage
from sageattention import sageattn
import sageattention
assert sageattn.__wrapped__ is aiter_sage.sageattn and sageattention.__aiter_sage_shim__
q = torch.randn(1, 2, 40, 64).bfloat16()
with torch.no_grad():
    out = sageattn(q, q, q, tensor_layout="HND", is_causal=False)
ref = torch.nn.functional.scaled_dot_product_attention(q.float(), q.float(), q.float())
cos = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0)
assert cos > 0.99, cos
from sageattention import sageattn_qk_int8_pv_fp8_cuda as fp8
with torch.no_grad():
    assert torch.equal(fp8(q, q, q, tensor_layout="HND", pv_accum_dtype="fp32+fp32"), out)
print("OURS")
"""


def python(code: str, *, extra_path=(), env=None) -> str:
    paths = [*extra_path, str(REPO), os.environ.get("PYTHONPATH", "")]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), **(env or {})}
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def fake_real_sageattention(tmp_path):
    pkg = tmp_path / "real" / "sageattention"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("def sageattn(*a, **k):\n    return 'real'\n")
    return str(tmp_path / "real")


def test_provided_only_after_opt_in():
    code = """
        import aiter_sage
        try:
            import sageattention
            raise SystemExit("provided without the opt-in")
        except ImportError:
            pass
        from aiter_sage.integrations import enable_sageattention_shim
        assert enable_sageattention_shim() and not enable_sageattention_shim()
        """
    assert "OURS" in python(textwrap.dedent(code) + RUN_OURS)


def test_real_sageattention_wins(tmp_path):
    real = fake_real_sageattention(tmp_path)
    code = """
        from aiter_sage.integrations import enable_sageattention_shim
        enable_sageattention_shim()
        from sageattention import sageattn
        import sageattention
        assert sageattn() == "real" and not hasattr(sageattention, "__aiter_sage_shim__")
        print("REAL")
        """
    assert "REAL" in python(code, extra_path=[real])


SHIM = REPO / "aiter_sage" / "integrations" / "sageattention_shim.py"


def shim_command(*args):
    """The install command, run as a script: it needs neither torch nor aiter_sage."""
    subprocess.run([sys.executable, str(SHIM), *args], check=True, capture_output=True)


def test_pth_install_and_uninstall(tmp_path):
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shim_command("install", "--site-dir", str(site_dir))
    pth = site_dir / "aiter_sage_sageattention_shim.pth"
    assert pth.exists()
    start = textwrap.dedent(
        f"""
        import site, sys
        site.addsitedir({str(site_dir)!r})
        assert "torch" not in sys.modules and "aiter_sage" not in sys.modules  # cheap start-up
        """
    )
    assert "OURS" in python(start + RUN_OURS)
    # A real SageAttention still wins over the installed shim (and aiter_sage is not loaded).
    real = fake_real_sageattention(tmp_path)
    code = start + (
        "from sageattention import sageattn\n"
        "assert sageattn() == 'real' and 'aiter_sage' not in sys.modules\n"
        "print('REAL')\n"
    )
    assert "REAL" in python(code, extra_path=[real])
    shim_command("uninstall", "--site-dir", str(site_dir))
    assert not pth.exists()


if __name__ == "__main__":
    run_as_script(__file__)
