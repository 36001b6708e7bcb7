"""aiter_sage packaging.

The package carries its C++/HIP sources (as aiter_sage/_csrc) and the module table (as
aiter_sage/jit) so the JIT can build on first call from an installed copy, not only from a
checkout. With PREBUILD_KERNELS=1 the kernel modules are built at install time for the archs
in GPU_ARCHS (environment, else GPU_ARCHS.cfg) that they serve; the gfx1201 SageAttention
modules are left to the JIT unless gfx1201 or gfx1200 is listed. Nothing here needs torch.
"""

import os
import shutil
import sys
import types
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _load_driver():
    """aiter_sage.builder.driver without running aiter_sage/__init__.py (which imports torch): the
    package is entered as a bare namespace of its folder, for this process only."""
    if "aiter_sage" not in sys.modules:
        pkg = types.ModuleType("aiter_sage")
        pkg.__path__ = [str(ROOT / "aiter_sage")]
        sys.modules["aiter_sage"] = pkg
    from aiter_sage.builder import driver, paths

    return types.SimpleNamespace(configured_archs=paths.configured_archs, prebuild=driver.prebuild)


class BuildPyWithSources(build_py):
    def run(self):
        super().run()
        pkg = Path(self.build_lib) / "aiter_sage"
        shutil.copytree(
            ROOT / "csrc",
            pkg / "_csrc",
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("*.o", "*.so", "__pycache__"),
        )
        shutil.copy2(ROOT / "GPU_ARCHS.cfg", pkg / "GPU_ARCHS.cfg")
        if os.environ.get("PREBUILD_KERNELS", "0") == "1":
            driver = _load_driver()
            archs = driver.configured_archs()
            built = driver.prebuild(archs, pkg / "_prebuilt")
            print(
                f"aiter_sage: prebuilt {len(built)} module(s) for GPU_ARCHS={archs}: "
                + ", ".join(p.name for p in built)
            )


# Name, version, dependencies and entry points: pyproject.toml's [project].
setup(
    packages=["aiter_sage", "aiter_sage.builder", "aiter_sage.integrations", "aiter_sage.jit"],
    package_dir={"aiter_sage": "aiter_sage", "aiter_sage.jit": "jit"},
    cmdclass={"build_py": BuildPyWithSources},
)
