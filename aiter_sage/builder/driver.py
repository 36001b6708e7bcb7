"""ensure_module: a loadable build of a module for a target — the install-time prebuilt copy when
its sources match, else the cache's, built (locked, atomic) when missing or damaged — and
build_into / prebuild, which setup.py's PREBUILD_KERNELS step runs."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from .. import env
from ..log import logger
from . import ninja, paths, toolchains
from .cache import (
    _cache_target,
    _FileLock,
    _is_valid,
    _kind_of,
    _sha256_file,
    cache_key,
    sources_digest,
    usable_cache_dir,
)
from .errors import BuildError
from .paths import cache_root, module_table
from .toolchains import HiprtcToolchain


def _spec(module):
    """A ModuleSpec, given one or the name of one in jit/modules.py."""
    return module_table().MODULES[module] if isinstance(module, str) else module


def build_into(module, target: str, out_dir: Path) -> Path:
    """Build one module for one target into out_dir (locked, atomic); returns the .so path."""
    spec = _spec(module)
    name = spec.name
    tc = toolchains.toolchain_for(target)
    if tc.kind not in spec.sources:
        raise ValueError(f"aiter_sage: {name} has no sources for target {target!r}")
    digest = sources_digest(spec, tc.kind)
    key = cache_key(spec, target, tc, digest)
    stem = f"{name}-{key[:16]}"
    so, manifest = out_dir / f"{stem}.so", out_dir / f"{stem}.json"
    if _is_valid(so, manifest, key):
        return so
    with _FileLock(out_dir / f"{stem}.lock"):
        if _is_valid(so, manifest, key):  # another process built it while we waited
            return so
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f".build-{stem}-", dir=out_dir) as tmp:
            tmp_so = Path(tmp) / f"{stem}.so"
            if isinstance(tc, HiprtcToolchain):
                tc.write_ninja(spec, Path(tmp), tmp_so)
            else:
                ninja.write_ninja(spec, tc, Path(tmp), tmp_so)
            ninja.run_ninja(Path(tmp), spec, target)
            meta = dict(
                key=key,
                sha256=_sha256_file(tmp_so),
                module=name,
                target=target,
                sources=digest,
                compiler=tc.identity.splitlines()[0],
                built=time.time(),
            )
            tmp_manifest = Path(tmp) / f"{stem}.json"
            tmp_manifest.write_text(json.dumps(meta, indent=1))
            os.replace(tmp_so, so)  # .so first: a manifest never names a missing file
            os.replace(tmp_manifest, manifest)
        logger.info("built %s for %s in %.1f s", name, target, time.perf_counter() - t0)
    return so


def _prebuilt(spec, target: str) -> Path | None:
    """A module prebuilt at install time whose sources match these (no compiler needed)."""
    d = paths.prebuilt_root() / target
    if not d.is_dir():
        return None
    digest = sources_digest(spec, _kind_of(target))
    for manifest in sorted(d.glob(f"{spec.name}-*.json")):
        try:
            meta = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        so = manifest.with_suffix(".so")
        if (
            meta.get("sources") == digest
            and so.is_file()
            and meta.get("sha256") == _sha256_file(so)
        ):
            return so
    return None


def _check_loadable(so: Path, entry: str) -> str | None:
    """None if the file is a shared object exporting the C ABI; else what is wrong.

    Read, not dlopen'ed: a process that already loaded this path would get the old mapping
    back from the loader and never notice a damaged file on disk.
    """
    try:
        data = so.read_bytes()
    except OSError as e:
        return f"cannot read: {e}"
    if data[:4] != b"\x7fELF":
        return "not an ELF shared object"
    for sym in ("sage_abi_version", entry) if entry else ():
        if sym.encode() + b"\0" not in data:
            return f"does not export {sym}"
    return None


def ensure_module(module, target: str) -> Path:
    """Path of a loadable build of `module` (a name or ModuleSpec) for `target`, built if needed."""
    spec = _spec(module)
    if env.get("AITER_SAGE_IGNORE_PREBUILT") != "1":
        pre = _prebuilt(spec, target)
        if pre is not None and _check_loadable(pre, spec.entry) is None:
            return pre
    out_dir = usable_cache_dir(cache_root() / _cache_target(target))
    so = build_into(spec, target, out_dir)
    problem = _check_loadable(so, spec.entry)
    if problem:  # corrupt or foreign file that still hashed right: rebuild once
        logger.warning("cached %s is unusable (%s); rebuilding", so.name, problem)
        so.with_suffix(".json").unlink(missing_ok=True)
        so = build_into(spec, target, out_dir)
        problem = _check_loadable(so, spec.entry)
        if problem:
            raise BuildError(f"aiter_sage: freshly built {so} is unusable: {problem}")
    return so


def prebuild(archs, out_root: Path) -> list[Path]:
    """setup.py's PREBUILD_KERNELS step: build kernel modules for the archs they serve."""
    built = []
    for name, arch in module_table().modules_for_archs(archs):
        built.append(build_into(name, arch, out_root / arch))
    return built
