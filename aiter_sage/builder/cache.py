"""The module cache: a folder that can hold and load modules, the cache key (sources with every
file they may include, ABI, flags, compiler, target), the build lock between processes, and the
manifest that an installed module is checked against."""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

from .. import env
from ..log import logger
from .errors import CacheDirError, LockTimeout
from .paths import _spec_flags, _src_root, abi_version, csrc_dir
from .toolchains import Toolchain

# ----------------------------------------------------------------------------------------------
# The cache directory must be writable (to build) and on a mount that allows executable
# mappings (to load what was built); otherwise say so instead of a raw OSError at dlopen.
# ----------------------------------------------------------------------------------------------
_CACHE_HINT = (
    "set AITER_SAGE_CACHE_DIR to a writable directory on a filesystem that is not mounted noexec"
)


def _cache_dir_error(path: Path, problem: str) -> CacheDirError:
    return CacheDirError(
        f"aiter_sage: cannot use the module cache directory {path}: {problem}; {_CACHE_HINT}"
    )


def _file_in_the_way(path: Path) -> Path | None:
    """The first existing component of `path` that is not a directory (mkdir's ENOTDIR/EEXIST)."""
    for p in reversed((path, *path.parents)):
        if p.exists() and not p.is_dir():
            return p
    return None


def _mounted_noexec(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & getattr(os, "ST_NOEXEC", 0))


def usable_cache_dir(path: Path) -> Path:
    """Creates the cache folder `path` if needed and checks that modules in it can be loaded.

    Only creation is checked for writing: a read-only cache that already holds every module
    is usable, and a build that needs to write reports it at the lock (:class:`_FileLock`)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = _file_in_the_way(path)
        problem = (
            f"{blocker} is a file, not a directory"
            if blocker is not None
            else f"cannot create {path} ({e.strerror or e})"
        )
        raise _cache_dir_error(path, problem) from None
    if _mounted_noexec(path):
        raise _cache_dir_error(
            path,
            "it is on a filesystem mounted noexec, so the modules built there cannot be loaded",
        )
    return path


def _is_noexec_load_failure(err: OSError) -> bool:
    """dlopen of a file on a noexec mount: glibc says "failed to map segment" (mmap: EPERM)."""
    text = str(err)
    return "failed to map segment" in text or "Operation not permitted" in text


def load_library(path, mode: int = getattr(os, "RTLD_LOCAL", 0)) -> ctypes.CDLL:
    """ctypes.CDLL of a built module; a noexec mount becomes a :class:`CacheDirError`."""
    try:
        return ctypes.CDLL(str(path), mode=mode)
    except OSError as e:
        if _is_noexec_load_failure(e):
            raise _cache_dir_error(
                Path(path).parent,
                f"the system refused to map {Path(path).name} as executable (noexec mount?): {e}",
            ) from e
        raise


def _cache_target(target: str) -> str:
    """Cache folder of a target (the binding's depends on the torch and Python versions)."""
    if target == "torch":
        import torch

        return f"torch-{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    return target


# Cache keys
# What a module's sources may include: headers, and sources pulled in whole (cuda/prepare.cu
# includes simt/prepare.hip).
_SOURCE_SUFFIXES = (".h", ".hpp", ".hip", ".cpp", ".cu", ".cuh", ".inc")
_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _included_files(f: Path, search: tuple[Path, ...]) -> list[Path]:
    """The files `f` names in #include "..." that exist beside it or under a search dir."""
    found = []
    for name in _QUOTED_INCLUDE.findall(f.read_text(errors="replace")):
        for d in (f.parent, *search):
            if (d / name).is_file():
                found.append((d / name).resolve())
                break
    return found


def _source_files(spec, kind: str) -> list[Path]:
    """The module's sources plus every file it may include: every file under csrc/include and
    its source dirs (a macro-named include, as the cpu tiers use, lands there), and every file
    reached through quoted #includes (csrc/ and csrc/include are the include path)."""
    files = {(_src_root(spec) / s).resolve() for s in spec.sources[kind]}
    dirs = {csrc_dir() / "include"} | {f.parent for f in files}
    for d in dirs:
        files.update(
            p.resolve() for p in d.rglob("*") if p.is_file() and p.suffix in _SOURCE_SUFFIXES
        )
    search = (csrc_dir(), csrc_dir() / "include")
    todo = list(files)
    while todo:
        for inc in _included_files(todo.pop(), search):
            if inc not in files:
                files.add(inc)
                todo.append(inc)
    return sorted(files)


def _kind_of(target: str) -> str:
    if target.startswith("gfx"):
        return "hip"
    if target.startswith("sm_"):
        return "cuda"
    return target.split("-")[0]


def sources_digest(spec, kind: str) -> str:
    h = hashlib.sha256()
    for f in _source_files(spec, kind):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def cache_key(spec, target: str, tc: Toolchain, digest: str) -> str:
    """Sources (`digest`: with every header they may include) + ABI + flags + compiler + target."""
    h = hashlib.sha256()
    h.update(f"{spec.name}\0{target}\0{abi_version()}\0".encode())
    h.update(digest.encode())
    flags = tc.cflags + _spec_flags(spec, tc.kind) + tc.ldflags
    h.update("\0".join(flags).replace(str(csrc_dir()), "<csrc>").encode())
    h.update(tc.identity.encode())
    return h.hexdigest()


def _sha256_file(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _is_valid(so: Path, manifest: Path, key: str) -> bool:
    """Both files present, the manifest names this key, and the .so hashes as recorded."""
    try:
        meta = json.loads(manifest.read_text())
        return meta.get("key") == key and so.is_file() and meta.get("sha256") == _sha256_file(so)
    except (OSError, ValueError):
        return False


# Waiting for another process's build: report who holds the lock at once and then every
# LOCK_REPORT_EVERY_S, so that a hung builder is visible instead of a silent hang.
LOCK_REPORT_EVERY_S = 30.0
_LOCK_POLL_S = 0.1


def _lock_timeout() -> float | None:
    """AITER_SAGE_LOCK_TIMEOUT in seconds; unset or empty: wait for ever (with messages)."""
    text = env.get("AITER_SAGE_LOCK_TIMEOUT", "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise ValueError(
            f"aiter_sage: AITER_SAGE_LOCK_TIMEOUT={text!r} is not a number of "
            f"seconds >= 0 (unset it to wait for ever)"
        )
    return value


def _holder_record() -> bytes:
    """What a lock holder writes into the lock file, for the processes that wait on it."""
    command = " ".join(getattr(sys, "orig_argv", None) or sys.argv or [sys.executable])
    return json.dumps(
        dict(pid=os.getpid(), host=socket.gethostname(), command=command[:500], since=time.time())
    ).encode()


def _describe_holder(text: str) -> str:
    try:
        h = json.loads(text)
        since = time.strftime("%H:%M:%S", time.localtime(float(h["since"])))
        return f"pid {h['pid']} on {h['host']} since {since} ({h['command']})"
    except (ValueError, KeyError, TypeError):
        return "a process that has not recorded itself (an older aiter_sage?)"


class _FileLock:
    """Exclusive flock on a side file: concurrent builders in other processes wait here.

    The holder writes its pid, host and command line into the file; a waiter logs them and
    gives up after AITER_SAGE_LOCK_TIMEOUT seconds with a :class:`LockTimeout`."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as e:
            problem = f"cannot write {self.path.name} in it ({e.strerror or e})"
            raise _cache_dir_error(self.path.parent, problem) from None
        try:
            if not self._try_lock():
                self._wait()
        except BaseException:
            os.close(self.fd)
            raise
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, _holder_record(), 0)
        return self

    def __exit__(self, *exc):
        os.ftruncate(self.fd, 0)  # a later waiter must not name a process that is gone
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)

    def _try_lock(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _holder(self) -> str:
        return _describe_holder(os.pread(self.fd, 4096, 0).decode(errors="replace"))

    def _wait(self) -> None:
        timeout = _lock_timeout()
        start = next_report = time.monotonic()
        reported = False
        while True:
            now = time.monotonic()
            waited = now - start
            if timeout is not None and waited >= timeout:
                raise LockTimeout(
                    f"aiter_sage: gave up after {waited:.1f} s "
                    f"(AITER_SAGE_LOCK_TIMEOUT={timeout:g}) waiting for the build lock "
                    f"{self.path}, held by {self._holder()}; if that process is hung, end it "
                    f"and retry"
                )
            if now >= next_report:
                verb = f"still waiting ({waited:.0f} s)" if reported else "waiting"
                logger.warning(
                    "%s for the build lock %s, held by %s%s",
                    verb,
                    self.path,
                    self._holder(),
                    "" if timeout is not None else " (AITER_SAGE_LOCK_TIMEOUT=SECONDS gives up)",
                )
                reported, next_report = True, now + LOCK_REPORT_EVERY_S
            pause = _LOCK_POLL_S if timeout is None else min(_LOCK_POLL_S, timeout - waited)
            time.sleep(max(pause, 0.0))
            if self._try_lock():
                return
