"""Where things live: an installed package carries csrc/ and jit/ inside it (setup.py copies
them); a source checkout (editable install, or PYTHONPATH) uses the repository's own. Also the
module table's per-module facts the builders share (a spec's source root and flags) and the
lookup of executables."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

from .. import env

PKG_DIR = Path(__file__).resolve().parents[1]  # the aiter_sage package


# Where things live: an installed package carries csrc/ and jit/ inside it (setup.py copies
# them); a source checkout (editable install, or PYTHONPATH) uses the repository's own.
def _first_existing(*candidates: Path) -> Path:
    for c in candidates:
        if c.exists():
            return c
    raise FileNotFoundError(f"none of {', '.join(map(str, candidates))} exists")


@functools.lru_cache(None)
def csrc_dir() -> Path:
    return _first_existing(PKG_DIR / "_csrc", PKG_DIR.parent / "csrc")


@functools.lru_cache(None)
def module_table():
    path = _first_existing(PKG_DIR / "jit" / "modules.py", PKG_DIR.parent / "jit" / "modules.py")
    spec = importlib.util.spec_from_file_location("aiter_sage_jit_modules", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def gpu_archs_cfg() -> Path:
    return _first_existing(PKG_DIR / "GPU_ARCHS.cfg", PKG_DIR.parent / "GPU_ARCHS.cfg")


def configured_archs() -> list[str]:
    """GPU_ARCHS from the environment, else GPU_ARCHS.cfg."""
    text = os.environ.get("GPU_ARCHS")
    if text is None:
        text = gpu_archs_cfg().read_text()
    return module_table().parse_archs(text)


@functools.lru_cache(None)
def abi_version() -> int:
    text = (csrc_dir() / "include" / "sage" / "params.h").read_text()
    return int(re.search(r"#define SAGE_ABI_VERSION (\d+)", text).group(1))


def cache_root() -> Path:
    chosen = env.get("AITER_SAGE_CACHE_DIR")
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "aiter_sage"


def prebuilt_root() -> Path:
    return PKG_DIR / "_prebuilt"


def _which(*names: str) -> str | None:
    for n in names:
        if not n:
            continue
        p = shutil.which(n) if os.sep not in n else (n if os.access(n, os.X_OK) else None)
        if p:
            return os.path.abspath(p)
    return None


def _rocm_path() -> str:
    return os.environ.get("ROCM_PATH") or os.environ.get("HIP_PATH") or "/opt/rocm"


def _spec_flags(spec, kind: str) -> tuple[str, ...]:
    """A module's extra compile flags for one toolchain kind (ModuleSpec.flags_for)."""
    per_kind = getattr(spec, "kind_flags", None) or {}
    return tuple(spec.flags) + tuple(per_kind.get(kind, ()))


def _src_root(spec) -> Path:
    return Path(spec.root) if spec.root else csrc_dir()
