"""The JIT driver's public names, from the modules of ``aiter_sage.builder`` that own them
(kept so that ``from aiter_sage import jit_driver`` and ``jit_driver.ensure_module`` keep
working). To replace a function in a test, patch the module that owns it (e.g.
``aiter_sage.builder.ninja.run_ninja``), not this one."""

from __future__ import annotations

from .builder.cache import cache_key, load_library, sources_digest, usable_cache_dir
from .builder.driver import build_into, ensure_module, prebuild
from .builder.errors import BuildError, CacheDirError, CompilerNotFound, LockTimeout
from .builder.ninja import ninja_command_words, ninja_path, write_ninja
from .builder.paths import (
    PKG_DIR,
    abi_version,
    cache_root,
    configured_archs,
    csrc_dir,
    gpu_archs_cfg,
    module_table,
    prebuilt_root,
)
from .builder.toolchains import (
    CUDA_GENCODE,
    HIP_TOOLCHAINS,
    HiprtcToolchain,
    Toolchain,
    toolchain_for,
)
from .log import LOG_LEVELS, logger

__all__ = [
    "BuildError",
    "CUDA_GENCODE",
    "CacheDirError",
    "CompilerNotFound",
    "HIP_TOOLCHAINS",
    "HiprtcToolchain",
    "LOG_LEVELS",
    "LockTimeout",
    "PKG_DIR",
    "Toolchain",
    "abi_version",
    "build_into",
    "cache_key",
    "cache_root",
    "configured_archs",
    "csrc_dir",
    "ensure_module",
    "gpu_archs_cfg",
    "load_library",
    "logger",
    "module_table",
    "ninja_command_words",
    "ninja_path",
    "prebuild",
    "prebuilt_root",
    "sources_digest",
    "toolchain_for",
    "usable_cache_dir",
    "write_ninja",
]
