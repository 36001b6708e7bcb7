"""JIT driver: builds the modules of ``jit/modules.py`` with ninja and caches them per target.

* The cache key covers the module's sources and every header they may include, the flags,
  the compiler's identity and the target, so an edit or a compiler upgrade rebuilds.
* A file lock serialises concurrent first calls from several processes (one builds, the
  others wait and then load its result); the ``.so`` and its manifest are installed by
  atomic rename, and a cached file whose hash does not match its manifest is rebuilt.
* A missing compiler raises :class:`CompilerNotFound`, which says what to install; a cache
  directory that cannot hold or load modules raises :class:`CacheDirError`; a build lock held
  too long (``AITER_SAGE_LOCK_TIMEOUT``) raises :class:`LockTimeout`, naming the holder.

This module must not import torch at import time: ``setup.py`` uses it to prebuild.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("aiter_sage")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _configure_logger() -> None:
    """One line per first build, visible by default; AITER_SAGE_LOG_LEVEL picks the level.

    An unknown level must not make `import aiter_sage` fail: it is ignored with a warning."""
    if logger.handlers:  # the application configured it already
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[aiter_sage] %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    raw = os.environ.get("AITER_SAGE_LOG_LEVEL", "INFO")
    level = raw.strip().upper()
    logger.setLevel(level if level in LOG_LEVELS else "INFO")
    if level not in LOG_LEVELS:
        logger.warning(
            "AITER_SAGE_LOG_LEVEL=%r is not a log level; using INFO (valid: %s)",
            raw,
            ", ".join(LOG_LEVELS),
        )


_configure_logger()

PKG_DIR = Path(__file__).resolve().parent


class CompilerNotFound(RuntimeError):
    """No compiler for a target; the message says what to install."""


class BuildError(RuntimeError):
    """A compile or link failed; the message carries the command and its output."""


class CacheDirError(RuntimeError):
    """The module cache cannot hold or load modules; the message says why and what to set."""


class LockTimeout(TimeoutError):
    """Another process held a build lock longer than AITER_SAGE_LOCK_TIMEOUT; names it."""


# ----------------------------------------------------------------------------------------------
# Where things live: an installed package carries csrc/ and jit/ inside it (setup.py copies
# them); a source checkout (editable install, or PYTHONPATH) uses the repository's own.
# ----------------------------------------------------------------------------------------------
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
    env = os.environ.get("AITER_SAGE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "aiter_sage"


def prebuilt_root() -> Path:
    return PKG_DIR / "_prebuilt"


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


# ----------------------------------------------------------------------------------------------
# Toolchains
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Toolchain:
    kind: str  # "hip" | "emu" | "cpu" | "torch"
    compiler: str  # absolute path
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    hip_as_cxx: bool = False  # compile .hip sources as plain C++ (the emulator)

    @property
    def identity(self) -> str:
        return _compiler_identity(self.compiler)


@functools.lru_cache(None)
def _compiler_identity(compiler: str) -> str:
    """Path and `--version` of a compiler: part of every cache key (run once per process)."""
    try:
        out = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:  # pragma: no cover - broken compiler
        raise CompilerNotFound(f"{compiler} does not run: {e}") from e
    return f"{compiler}\n{out.strip()}"


@functools.lru_cache(None)
def _compiler_has_openmp(compiler: str) -> bool:
    """Whether `compiler` compiles and links a shared object with -fopenmp (clang without
    libomp, for one, does not): the binding then builds without it. The answer is kept in the
    cache per compiler identity: the probe compiles a program (about 0.1 s), and every process
    asks when it computes the binding's cache key."""
    ident = hashlib.sha256(_compiler_identity(compiler).encode()).hexdigest()[:16]
    record = cache_root() / "compiler_probes" / f"openmp-{ident}"
    try:
        return record.read_text() == "1"
    except OSError:
        pass
    src = "#include <omp.h>\nint sage_openmp_probe() { return omp_get_max_threads(); }\n"
    with tempfile.TemporaryDirectory() as d:
        try:
            proc = subprocess.run(
                [compiler, "-x", "c++", "-fPIC", "-shared", "-fopenmp", "-", "-o", f"{d}/p.so"],
                input=src,
                capture_output=True,
                text=True,
                timeout=120,
            )
            has = proc.returncode == 0
        except (OSError, subprocess.SubprocessError):
            has = False
    try:  # atomic: a concurrent reader sees the whole answer or none
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f"{record.name}.{os.getpid()}")
        tmp.write_text("1" if has else "0")
        os.replace(tmp, record)
    except OSError:
        pass  # an unwritable cache: the next process probes again
    return has


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


def _include_flags() -> tuple[str, ...]:
    return (f"-I{csrc_dir()}", f"-I{csrc_dir() / 'include'}")


_INSTALL_HINT = {
    "hip": "install ROCm (hipcc, https://rocm.docs.amd.com) or, on Debian/Ubuntu, "
    "`apt-get install clang-19 lld-19 libamdhip64-dev`; or set HIPCC to a HIP compiler; "
    "or install ROCm's PyTorch, whose libhiprtc builds the modules (docs/hiprtc.md)",
    "emu": "install clang (`apt-get install clang-19`) or set AITER_SAGE_EMU_CXX to a clang++",
    "cpu": "install a C++ compiler (`apt-get install g++`) or set CXX",
    "torch": "install a C++ compiler (`apt-get install g++`) or set CXX",
    "cuda": "install the CUDA toolkit 12.3 or newer (nvcc) or set NVCC / CUDA_HOME",
}


def _missing(kind: str, target: str) -> CompilerNotFound:
    return CompilerNotFound(
        f"aiter_sage: no compiler to build the {target!r} modules: {_INSTALL_HINT[kind]}"
    )


HIP_TOOLCHAINS = ("hipcc", "clang", "hiprtc")  # order of preference for the gfx targets


def _hipcc_toolchain(arch: str) -> Toolchain | None:
    """ROCm's hipcc: its own device libraries and runtime."""
    hipcc = _which(os.environ.get("HIPCC", ""), os.path.join(_rocm_path(), "bin", "hipcc"), "hipcc")
    if not hipcc:
        return None
    common = ("-O3", "-std=c++17", "-fPIC", f"--offload-arch={arch}") + _include_flags()
    return Toolchain("hip", hipcc, ("-x", "hip") + common, ("-shared", f"--offload-arch={arch}"))


def _clang_hip_toolchain(arch: str) -> Toolchain | None:
    """Plain LLVM with Debian's HIP headers/runtime: no gfx12 device libraries exist there, so
    -nogpulib; the kernels use only builtins through csrc/include/sage/platform.h."""
    clang = _which(
        os.environ.get("AITER_SAGE_HIP_CLANG", ""), "clang++-19", "clang++-20", "clang++-18"
    )
    if not clang or not _which("ld.lld-19", "ld.lld-20", "ld.lld-18", "ld.lld"):
        return None
    common = ("-O3", "-std=c++17", "-fPIC", f"--offload-arch={arch}") + _include_flags()
    return Toolchain("hip", clang, ("-x", "hip", "-nogpulib") + common, ("-shared", "-lamdhip64"))


def _hip_toolchain(arch: str) -> Toolchain:
    """hipcc, else clang++ --offload-arch, else hiprtc; AITER_SAGE_HIP_TOOLCHAIN forces one."""
    forced = os.environ.get("AITER_SAGE_HIP_TOOLCHAIN", "").strip().lower()
    if forced and forced not in HIP_TOOLCHAINS:
        raise ValueError(
            f"aiter_sage: AITER_SAGE_HIP_TOOLCHAIN={forced!r} is not one of "
            f"{', '.join(HIP_TOOLCHAINS)}"
        )
    makers = {"hipcc": _hipcc_toolchain, "clang": _clang_hip_toolchain, "hiprtc": _hiprtc_toolchain}
    reasons = []
    for name in (forced,) if forced else HIP_TOOLCHAINS:
        try:
            tc = makers[name](arch)
        except CompilerNotFound as e:  # hiprtc says which of its pieces is missing
            tc, reason = None, str(e)
        else:
            reason = f"{name}: not found"
        if tc is not None:
            return tc
        reasons.append(reason)
    if forced:
        raise CompilerNotFound(
            f"aiter_sage: AITER_SAGE_HIP_TOOLCHAIN={forced} but {'; '.join(reasons)}"
        )
    raise CompilerNotFound(f"{_missing('hip', arch)} ({'; '.join(reasons)})")


def _emu_toolchain(sanitize: bool) -> Toolchain:
    """clang (the kernels use ext_vector_type) compiling .hip sources as C++ with -DSAGE_EMU.

    -Wno-psabi: v8i32 passed by value is the same in every TU of a module. With ASan the
    loading process needs the sanitizer runtime preloaded (aiter_sage.emu.asan_env)."""
    clang = _which(
        os.environ.get("AITER_SAGE_EMU_CXX", ""),
        "clang++-19",
        "clang++-20",
        "clang++-18",
        "clang++",
        os.path.join(_rocm_path(), "llvm", "bin", "clang++"),
    )
    if not clang:
        raise _missing("emu", "emu")
    flags = (
        "-std=c++20",
        "-O2",
        "-fPIC",
        "-DSAGE_EMU",
        "-pthread",
        "-fvisibility=hidden",
        "-Wno-psabi",
    ) + _include_flags()
    ld = ("-shared", "-pthread", "-ldl")
    if sanitize:
        san = ("-fsanitize=address", "-fno-omit-frame-pointer")
        flags, ld = flags + san, ld + san
    return Toolchain("emu", clang, flags, ld, hip_as_cxx=True)


def _host_cxx() -> str | None:
    return _which(os.environ.get("CXX", ""), "c++", "g++", "clang++")


def _cpu_toolchain() -> Toolchain:
    cxx = _host_cxx()
    if not cxx:
        raise _missing("cpu", "cpu")
    # ISO C++ and no FP contraction: prepare's bit-exactness must not depend on a compiler
    # fusing a multiply into an add. Per-ISA code is selected at run time (no -march).
    flags = ("-std=c++17", "-O3", "-fPIC", "-pthread", "-ffp-contract=off", "-fvisibility=hidden")
    return Toolchain("cpu", cxx, flags + _include_flags(), ("-shared", "-pthread"))


def _torch_toolchain() -> Toolchain:
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    cxx = _host_cxx()
    if not cxx:
        raise _missing("torch", "torch")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    inc = [f"-isystem{p}" for p in cpp_extension.include_paths()]
    inc.append(f"-isystem{sysconfig.get_paths()['include']}")
    libdirs = cpp_extension.library_paths()
    cflags = (
        "-std=c++20",
        "-O2",
        "-fPIC",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        "-DTORCH_EXTENSION_NAME=aiter_sage_torch",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *inc,
    ) + _include_flags()
    libs = ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-ldl"]
    # at::parallel_for reaches torch's intra-op threads only when compiled with OpenMP (the cpu
    # modules' workers run there: csrc/binding/sage_torch.cpp, cpu_executor; without it they
    # run on the modules' own pool).
    if torch.backends.openmp.is_available() and _compiler_has_openmp(cxx):
        cflags += ("-fopenmp",)
        libs.append("-fopenmp")
    if torch.version.hip or torch.version.cuda:  # GPU torch: register the GPU kernels too
        gpu = "hip" if torch.version.hip else "cuda"
        cflags += (
            "-DSAGE_TORCH_GPU",
            *[f"-isystem{p}" for p in cpp_extension.include_paths(device_type=gpu)],
        )
        if torch.version.hip:
            cflags += ("-DUSE_ROCM", "-D__HIP_PLATFORM_AMD__")
        libs += [f"-lc10_{gpu}", f"-ltorch_{gpu}"]
    ldflags = (
        "-shared",
        *[f"-L{d}" for d in libdirs],
        *[f"-Wl,-rpath,{d}" for d in libdirs],
        *libs,
    )
    return Toolchain("torch", cxx, cflags, ldflags)


def _spec_flags(spec, kind: str) -> tuple[str, ...]:
    """A module's extra compile flags for one toolchain kind (ModuleSpec.flags_for)."""
    per_kind = getattr(spec, "kind_flags", None) or {}
    return tuple(spec.flags) + tuple(per_kind.get(kind, ()))


def _nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return _which(os.environ.get("NVCC", ""), os.path.join(cuda_home, "bin", "nvcc"), "nvcc")


# nvcc -gencode per NVIDIA build target: wgmma and setmaxnreg need the arch-specific sm_90a
# (the -arch=sm_90a shorthand also runs a plain sm_90 pass that rejects them).
CUDA_GENCODE = {"sm_90": "-gencode=arch=compute_90a,code=sm_90a"}


def _cuda_toolchain(arch: str) -> Toolchain:
    """nvcc for the NVIDIA targets (CUDA 12.3+; the modules link the CUDA runtime statically).
    No fast math anywhere: prepare's bit-exactness needs IEEE division and square root."""
    if arch not in CUDA_GENCODE:
        raise ValueError(
            f"aiter_sage: the cuda backend targets {tuple(CUDA_GENCODE)} (Hopper), not {arch!r}"
        )
    nvcc = _nvcc()
    if not nvcc:
        raise _missing("cuda", arch)
    host = os.environ.get("CXX")
    ccbin = ("-ccbin", host) if host and _which(host) else ()
    flags = (
        "-std=c++17",
        "-O3",
        CUDA_GENCODE[arch],
        "-Xcompiler",
        "-fPIC,-fvisibility=hidden",
        *ccbin,
    ) + _include_flags()
    return Toolchain("cuda", nvcc, flags, ("-shared", CUDA_GENCODE[arch], *ccbin))


def toolchain_for(target: str) -> Toolchain:
    if target == "cpu":
        return _cpu_toolchain()
    if target in ("emu", "emu-asan"):
        return _emu_toolchain(sanitize=target == "emu-asan")
    if target == "torch":
        return _torch_toolchain()
    if target.startswith("gfx"):
        return _hip_toolchain(target)
    if target.startswith("sm_"):
        return _cuda_toolchain(target)
    raise ValueError(f"aiter_sage: unknown build target {target!r}")


def _cache_target(target: str) -> str:
    """Cache folder of a target (the binding's depends on the torch and Python versions)."""
    if target == "torch":
        import torch

        return f"torch-{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    return target


# ----------------------------------------------------------------------------------------------
# Cache keys
# ----------------------------------------------------------------------------------------------
def _src_root(spec) -> Path:
    return Path(spec.root) if spec.root else csrc_dir()


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
    text = os.environ.get("AITER_SAGE_LOCK_TIMEOUT", "").strip()
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


# ----------------------------------------------------------------------------------------------
# Building with ninja
# ----------------------------------------------------------------------------------------------
def _ninja() -> str:
    exe = _which(os.environ.get("AITER_SAGE_NINJA", ""), "ninja")
    if exe:
        return exe
    try:
        import ninja  # the PyPI package ships the binary

        return os.path.join(ninja.BIN_DIR, "ninja")
    except ImportError:
        raise CompilerNotFound(
            "aiter_sage: ninja is needed to build modules: "
            "`pip install ninja` or `apt-get install ninja-build`"
        ) from None


# Two escapings meet in build.ninja. Paths in `build` lines are read by ninja's lexer, where
# "$", " " and ":" need "$$", "$ " and "$:" (and "|", newlines cannot be written at all);
# ninja shell-quotes them itself when it substitutes $in / $out. Values of the variables that
# the rules paste into a command (compiler, flags) reach /bin/sh verbatim, so they are
# shell-quoted, and then every "$" is doubled for ninja.
_NINJA_UNWRITABLE = re.compile(r"[|\n\r\0]")


def _unwritable(text: str, what: str) -> BuildError:
    bad = _NINJA_UNWRITABLE.search(text).group(0)
    return BuildError(
        f"aiter_sage: the {what} {text!r} contains {bad!r}, which a ninja build "
        f"file cannot express; move it to a path without that character "
        f"(the module cache: AITER_SAGE_CACHE_DIR)"
    )


def ninja_path(path) -> str:
    """A path as written in a ninja `build` line."""
    text = str(path)
    if _NINJA_UNWRITABLE.search(text):
        raise _unwritable(text, "path")
    return text.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def ninja_command_words(words) -> str:
    """Words for a ninja variable that a rule substitutes into a shell command."""
    out = []
    for w in map(str, words):
        if re.search(r"[\n\r\0]", w):
            raise _unwritable(w, "compiler argument")
        out.append(shlex.quote(w).replace("$", "$$"))
    return " ".join(out)


def write_ninja(spec, tc: Toolchain, build_dir: Path, output: Path) -> Path:
    """build.ninja for one module; ninja runs in build_dir, so objects are named relative to
    it and the cache directory's own name never has to appear in a build line."""
    root = _src_root(spec)
    lines = [
        "ninja_required_version = 1.3",
        f"cxx = {ninja_command_words([tc.compiler])}",
        f"cflags = {ninja_command_words(tc.cflags + _spec_flags(spec, tc.kind))}",
        f"ldflags = {ninja_command_words(tc.ldflags)}",
        "rule cxx\n  command = $cxx $lang $cflags -c $in -o $out\n  description = CXX $in",
        "rule link\n  command = $cxx $in $ldflags -o $out\n  description = LINK $out",
    ]
    objs = []
    for i, src in enumerate(spec.sources[tc.kind]):
        obj = ninja_path(f"{i}_{Path(src).stem}.o")
        lang = "-x c++" if (tc.hip_as_cxx and src.endswith(".hip")) else ""
        lines.append(f"build {obj}: cxx {ninja_path(root / src)}\n  lang = {lang}")
        objs.append(obj)
    out = os.path.relpath(output, build_dir)
    lines.append(f"build {ninja_path(out)}: link {' '.join(objs)}")
    path = build_dir / "build.ninja"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run_ninja(build_dir: Path, spec, target: str) -> None:
    jobs = os.environ.get("MAX_JOBS") or str(max(1, os.cpu_count() or 1))
    proc = subprocess.run(
        [_ninja(), "-C", str(build_dir), "-j", jobs], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise BuildError(
            f"aiter_sage: building {spec.name} for {target} failed:\n"
            f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )


def _spec(module):
    """A ModuleSpec, given one or the name of one in jit/modules.py."""
    return module_table().MODULES[module] if isinstance(module, str) else module


def build_into(module, target: str, out_dir: Path) -> Path:
    """Build one module for one target into out_dir (locked, atomic); returns the .so path."""
    spec = _spec(module)
    name = spec.name
    tc = toolchain_for(target)
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
                write_ninja(spec, tc, Path(tmp), tmp_so)
            _run_ninja(Path(tmp), spec, target)
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
    d = prebuilt_root() / target
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
    if os.environ.get("AITER_SAGE_IGNORE_PREBUILT") != "1":
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


# ----------------------------------------------------------------------------------------------
# hiprtc: the gfx modules without hipcc or clang (docs/hiprtc.md, aiter_sage/hiprtc.py)
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HiprtcToolchain(Toolchain):
    """Device half by hiprtc (run by ninja through aiter_sage/hiprtc.py), host half and link by
    the host compiler (`compiler`). The cache key's identity names the host compiler, the
    hiprtc library and its version, the device options and the hiprtc.py that embeds."""

    arch: str = ""
    hiprtc_lib: str = ""
    hiprtc_version: str = ""
    device_flags: tuple[str, ...] = ()

    @property
    def identity(self) -> str:
        script = hashlib.sha256(_hiprtc_script().read_bytes()).hexdigest()[:16]
        return (
            f"{_compiler_identity(self.compiler)}\nhiprtc {self.hiprtc_lib} "
            f"{self.hiprtc_version}\ndevice {' '.join(self.device_flags)}\n"
            f"hiprtc.py {script}"
        )

    def write_ninja(self, spec, build_dir: Path, output: Path) -> Path:
        root = _src_root(spec)
        hip = [s for s in spec.sources[self.kind] if s.endswith(".hip")]
        if len(hip) != 1:  # one embedded code object per module (sage_hiprtc_code_object)
            raise ValueError(
                f"aiter_sage: the hiprtc toolchain builds modules with exactly one "
                f".hip source; {spec.name} has {hip}"
            )
        # Same escaping rules as write_ninja: build-line paths through ninja_path (relative to
        # build_dir, where ninja runs), command variables through ninja_command_words.
        hiprtc_cmd = [
            sys.executable,
            _hiprtc_script(),
            "compile",
            "--arch",
            self.arch,
            "--csrc",
            csrc_dir(),
        ]
        lines = [
            "ninja_required_version = 1.3",
            f"cxx = {ninja_command_words([self.compiler])}",
            f"cflags = {ninja_command_words(self.cflags + _spec_flags(spec, self.kind))}",
            f"ldflags = {ninja_command_words(self.ldflags)}",
            f"hiprtc = {ninja_command_words(hiprtc_cmd)}",
            "rule hiprtc\n  command = $hiprtc $in -o $co --embed $out\n  description = HIPRTC $in",
            "rule cxx\n  command = $cxx $lang $cflags -c $in -o $out\n  description = CXX $in",
            "rule link\n  command = $cxx $in $ldflags -o $out\n  description = LINK $out",
        ]
        objs = []
        for i, src in enumerate(spec.sources[self.kind]):
            stem = f"{i}_{Path(src).stem}"
            host_obj = ninja_path(f"{stem}.host.o")
            lines.append(
                f"build {host_obj}: cxx {ninja_path(root / src)}\n"
                f"  lang = {'-x c++' if src.endswith('.hip') else ''}"
            )
            objs.append(host_obj)
            if src.endswith(".hip"):
                co, embed, co_obj = f"{stem}.co", f"{stem}_co.cpp", f"{stem}_co.o"
                lines.append(
                    f"build {ninja_path(embed)} | {ninja_path(co)}: hiprtc "
                    f"{ninja_path(root / src)}\n  co = {ninja_command_words([co])}"
                )
                lines.append(f"build {ninja_path(co_obj)}: cxx {ninja_path(embed)}\n  lang =")
                objs.append(ninja_path(co_obj))
        out = os.path.relpath(output, build_dir)
        lines.append(f"build {ninja_path(out)}: link {' '.join(objs)}")
        path = build_dir / "build.ninja"
        path.write_text("\n".join(lines) + "\n")
        return path


def _hiprtc_script() -> Path:
    return PKG_DIR / "hiprtc.py"


@functools.lru_cache(None)
def _hiprtc_module():
    """aiter_sage/hiprtc.py, also when this file was loaded by path (setup.py's prebuild)."""
    if __package__:
        from . import hiprtc

        return hiprtc
    spec = importlib.util.spec_from_file_location("aiter_sage_hiprtc", _hiprtc_script())
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _hiprtc_toolchain(arch: str) -> HiprtcToolchain:
    """Raises CompilerNotFound naming the missing piece: libhiprtc, HIP headers, a host C++."""
    rtc = _hiprtc_module()
    try:
        lib = rtc.load_library()
        version = lib.version()
    except rtc.HiprtcNotFound as e:
        raise CompilerNotFound(str(e)) from None
    hip_inc = rtc.find_hip_include()
    if hip_inc is None:
        where = ", ".join(str(d) for d in rtc.hip_include_candidates())
        raise CompilerNotFound(
            f"aiter_sage: hiprtc found ({lib.path}) but no HIP runtime headers "
            f"(hip/hip_runtime_api.h) in {where}; set ROCM_PATH"
        )
    cxx = _host_cxx()
    if not cxx:
        raise CompilerNotFound(
            f"aiter_sage: hiprtc needs a host C++ compiler for the launch "
            f"code: {_INSTALL_HINT['cpu']}"
        )
    # The host half parses the kernel bodies against declarations only (sage/hiprtc_host.h);
    # -Wno-unknown-pragmas: their clang/unroll pragmas mean nothing there.
    cflags = (
        "-std=c++17",
        "-O2",
        "-fPIC",
        "-fvisibility=hidden",
        "-DSAGE_HIPRTC_HOST",
        "-D__HIP_PLATFORM_AMD__",
        "-Wno-unknown-pragmas",
    )
    if str(hip_inc) not in ("/usr/include", "/usr/local/include"):  # -isystem on a default
        cflags += (f"-isystem{hip_inc}",)  # dir would break libstdc++'s #include_next
    return HiprtcToolchain(
        "hip",
        cxx,
        cflags + _include_flags(),
        ("-shared", "-pthread", "-ldl"),
        arch=arch,
        hiprtc_lib=lib.path,
        hiprtc_version=version,
        device_flags=tuple(rtc.device_options(arch)),
    )
