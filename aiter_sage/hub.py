"""A Kernels Hub repository for aiter_sage, loadable by the ``kernels`` library (0.17).

    python3 -m aiter_sage.hub build DIR          # writes the repository into DIR
    python3 -m aiter_sage.hub cache DIR --repo-id SageAttention/sage-attention --version 3
                                                 # copies it into the Hugging Face cache

The repository has the layout ``kernels`` reads from the Hub, a cache snapshot or a local
folder (``get_kernel``, ``get_local_kernel``, ``LOCAL_KERNELS``, ``load_kernel`` with a
``kernels.lock``): a card ``README.md`` and one noarch build variant per backend,
``build/torch-rocm``, ``build/torch-cuda``, ``build/torch-cpu``, each a ``metadata.json``
(the archs it serves: gfx1201/gfx1200, sm_90a; ``kernels`` refuses a GPU whose arch is not
listed) and a package exposing ``sageattn`` (SageAttention's call form, what diffusers'
``sage_hub`` backend calls) and ``flash_attn_func`` (flash-attn's, what ``aiter_fa2_hub``
calls).

The package carries no kernels and no copy of aiter_sage: it re-exports the *installed*
aiter_sage, which builds and caches its kernels on first use. ``python-depends`` takes only
``kernels``' allow-list, so the dependency is stated in the card and enforced at import (an
ImportError saying what to install). A carried copy would register ``torch.ops.aiter.*`` a
second time next to an installed aiter_sage (``OpNamespaceConflict``); a re-export never
does. Each variant's ``id`` — the module name ``kernels`` imports the package under — is a
private name (``_aiter_sage_hub_<backend>_<hash>``), never ``aiter_sage``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import __version__, jit_driver

KERNEL_NAME = "aiter-sage-attention"
# The version diffusers 0.42.1's sage_hub backend asks for: get_kernel(..., version=3).
KERNEL_VERSION = 3
LICENSE = "MIT"
# What the package exposes, and the aiter_sage modules they come from.
EXPORTS = {
    "sageattn": "aiter_sage.integrations.router",
    "flash_attn_func": "aiter_sage.integrations.flash_attn",
}
INSTALL_HINT = "pip install aiter_sage (or pip install . from an aiter_sage checkout)"


@dataclass(frozen=True)
class Variant:
    """One build variant: the kernels backend name and the archs it declares."""

    backend: str
    archs: tuple[str, ...]

    @property
    def dirname(self) -> str:
        return f"torch-{self.backend}"


def _kernels_cuda_arch(sm: str) -> str:
    """ "sm_90" -> "9.0a": the cuda modules are built for the arch-specific sm_90a (wgmma)."""
    digits = sm.removeprefix("sm_")
    return f"{digits[:-1]}.{digits[-1]}a"


def variants() -> tuple[Variant, ...]:
    """The variants, from the module table (jit/modules.py): the archs aiter_sage builds for."""
    table = jit_driver.module_table()
    return (
        Variant("rocm", tuple(table.GFX12_ARCHS)),
        Variant("cuda", tuple(_kernels_cuda_arch(a) for a in table.CUDA_ARCHS)),
        Variant("cpu", ()),
    )


def package_source(name: str = KERNEL_NAME) -> str:
    """The variant package's ``__init__.py``: imports the installed aiter_sage first (so a
    missing one is named, whatever else is importable), then re-exports its entry points."""
    imports = "\n".join(f"    from {mod} import {fn}" for fn, mod in EXPORTS.items())
    names = ", ".join(repr(n) for n in EXPORTS)
    return f'''"""{name}: aiter_sage's SageAttention (INT8 Q·Kᵀ, FP8 P·V) as a Kernels Hub package.

It carries no kernels: it re-exports the installed aiter_sage package ({INSTALL_HINT}),
which builds its kernels for the device on first use and caches them. Built from aiter_sage
{__version__}.
"""

try:
    import aiter_sage
except ModuleNotFoundError as e:
    if e.name != "aiter_sage":
        raise
    raise ImportError(
        "the Kernels Hub package {name} needs the aiter_sage Python package installed in "
        "this environment ({INSTALL_HINT}); it re-exports aiter_sage's sageattn and "
        "flash_attn_func and carries no kernels of its own"
    ) from None
else:
{imports}

__all__ = [{names}]
__aiter_sage_version__ = aiter_sage.__version__
'''


def _variant_id(name: str, backend: str, source: str) -> str:
    digest = hashlib.sha256(f"{name}\n{backend}\n{source}".encode()).hexdigest()[:10]
    return f"_aiter_sage_hub_{backend}_{digest}"


def metadata(variant: Variant, source: str, name: str, version: int) -> dict:
    backend = {"type": variant.backend}
    if variant.archs:
        backend["archs"] = list(variant.archs)
    return {
        "id": _variant_id(name, variant.backend, source),
        "name": name,
        "version": version,
        "license": LICENSE,
        # kernels accepts only its allow-list here; aiter_sage is required at import instead.
        "python-depends": [],
        "backend": backend,
    }


def card(name: str, version: int, vs: tuple[Variant, ...]) -> str:
    rows = "\n".join(
        f"| `build/{v.dirname}` | {', '.join(v.archs) if v.archs else 'any CPU'} |" for v in vs
    )
    return f"""---
license: mit
tags:
- kernels
- attention
---

# {name}

aiter_sage's SageAttention — INT8 Q·Kᵀ, FP8 P·V, FP32 accumulation — for AMD RDNA4 (gfx1201,
gfx1200), NVIDIA Hopper and the CPU, as a Kernels Hub package (version {version}).

**Requires the aiter_sage Python package** in the same environment: `{INSTALL_HINT}`.
This package re-exports it and carries no kernels; aiter_sage builds them for your device on
the first call (minutes) and caches them. Without it, loading raises an ImportError that says
so.

| variant | archs |
|---|---|
{rows}

Functions: `sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None,
return_lse=False)` (SageAttention's) and `flash_attn_func(q, k, v, dropout_p=0.0,
softmax_scale=None, causal=False, return_lse=False)` (flash-attn's, `[B, S, H, D]`).

## diffusers (`sage_hub`)

```bash
export LOCAL_KERNELS="SageAttention/sage-attention=/path/to/this/folder"
```

```python
pipe.transformer.set_attention_backend("sage_hub")  # loads this folder instead of the Hub
```

`aiter_fa2_hub` reads `kernels-community/aiter-flash-attn-ck` the same way (its
`flash_attn_func`). Made by `python3 -m aiter_sage.hub build DIR`.
"""


def build(out_dir, *, name: str = KERNEL_NAME, version: int = KERNEL_VERSION) -> list[Path]:
    """Write the repository into ``out_dir`` (its ``build/`` is replaced); returns the variant
    folders."""
    out = Path(out_dir)
    python_name = name.replace("-", "_")
    source = package_source(name)
    vs = variants()
    build_dir = out / "build"
    if build_dir.exists():
        shutil.rmtree(build_dir)
    written = []
    for v in vs:
        vdir = build_dir / v.dirname
        (vdir / python_name).mkdir(parents=True)
        (vdir / python_name / "__init__.py").write_text(source, encoding="utf-8")
        meta = metadata(v, source, name, version)
        (vdir / "metadata.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        written.append(vdir)
    (out / "README.md").write_text(card(name, version, vs), encoding="utf-8")
    return written


# ----------------------------------------------------------------------------------------------
# A Hugging Face cache snapshot of the repository (offline get_kernel, load_kernel + lock)
# ----------------------------------------------------------------------------------------------
def tree_commit(repo_dir) -> str:
    """A 40-hex name for the repository's content (paths and bytes): the snapshot's
    "commit", stable across rebuilds of the same content."""
    root = Path(repo_dir)
    h = hashlib.sha1()
    for p in sorted(q for q in root.rglob("*") if q.is_file() and "__pycache__" not in q.parts):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def default_cache_dir() -> Path:
    """Where ``kernels`` looks: $KERNELS_CACHE, else the Hugging Face hub cache."""
    env = os.environ.get("KERNELS_CACHE")
    if env:
        return Path(env)
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def lock_json(repo_id: str, version: int, commit: str) -> str:
    """A ``kernels.lock`` entry pinning ``repo_id`` version ``version`` to ``commit``."""
    entry = {"dependency": {"repo-id": repo_id, "version": version}, "lock": {"commit": commit}}
    return json.dumps([entry], indent=2) + "\n"


def install_into_cache(
    repo_dir, repo_id: str, *, version: int = KERNEL_VERSION, cache_dir: Optional[str] = None
) -> str:
    """Copy a built repository into the cache as ``repo_id``'s snapshot, with the ref
    ``v<version>`` (how ``kernels`` finds a version offline) and ``main`` pointing at it;
    returns the snapshot's commit."""
    commit = tree_commit(repo_dir)
    org, _, repo = repo_id.partition("/")
    if not org or not repo:
        raise ValueError(f"repo_id must be ORG/NAME, not {repo_id!r}")
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    folder = root / f"kernels--{org}--{repo}"
    snapshot = folder / "snapshots" / commit
    if snapshot.exists():
        shutil.rmtree(snapshot)
    shutil.copytree(repo_dir, snapshot, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    for ref in (f"v{version}", "main"):
        (folder / "refs" / ref).write_text(commit)
    return commit


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python3 -m aiter_sage.hub", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="action", required=True)
    b = sub.add_parser("build", help="write the Kernels Hub repository into DIR")
    b.add_argument("dir")
    b.add_argument("--name", default=KERNEL_NAME)
    b.add_argument("--version", type=int, default=KERNEL_VERSION)
    c = sub.add_parser("cache", help="copy a built DIR into the Hugging Face cache as REPO_ID")
    c.add_argument("dir")
    c.add_argument("--repo-id", required=True)
    c.add_argument("--version", type=int, default=KERNEL_VERSION)
    c.add_argument("--cache-dir", default=None)
    a = ap.parse_args(argv)
    if a.action == "build":
        for v in build(a.dir, name=a.name, version=a.version):
            print(f"wrote {v}")
        print(f"wrote {Path(a.dir) / 'README.md'}")
        return 0
    commit = install_into_cache(a.dir, a.repo_id, version=a.version, cache_dir=a.cache_dir)
    print(f"cached {a.repo_id} v{a.version} as commit {commit}; kernels.lock entry:")
    sys.stdout.write(lock_json(a.repo_id, a.version, commit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
