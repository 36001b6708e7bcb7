"""aiter_sage packaging.

The package carries its C++/HIP sources (as aiter_sage/_csrc) and the module table (as
aiter_sage/jit) so the JIT can build on first call from an installed copy, not only from a
checkout. With PREBUILD_KERNELS=1 the kernel modules are built at install time for the archs
in GPU_ARCHS (environment, else GPU_ARCHS.cfg) that they serve; the gfx1201 SageAttention
modules are left to the JIT unless gfx1201 or gfx1200 is listed. Nothing here needs torch.
"""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _load_driver():
    spec = importlib.util.spec_from_file_location(
        "_aiter_sage_jit_driver", ROOT / "aiter_sage" / "jit_driver.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


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
    packages=["aiter_sage", "aiter_sage.integrations", "aiter_sage.jit"],
    package_dir={"aiter_sage": "aiter_sage", "aiter_sage.jit": "jit"},
    cmdclass={"build_py": BuildPyWithSources},
)
