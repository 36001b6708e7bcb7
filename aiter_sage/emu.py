"""Run any shim-based HIP kernel source on the gfx12 wave emulator (csrc/emu), on the CPU.

    from aiter_sage import emu
    res = emu.run_kernel("op_tests/emu_probes/wmma_probe.hip", "probe_wmma_fp8",
                         grid=(1, 1, 1), block=32, args=[a, bt, c, d])   # numpy / torch CPU
    assert res.ok, res.reports

The source is compiled once (clang++, as C++ with -DSAGE_EMU) together with the emulator
runtime and a small generated trampoline that exports, per kernel,
``sage_emu_run_<kernel>`` and ``sage_emu_signature_<kernel>``; the shared object is cached
under a directory keyed by the sources, headers, flags and compiler. Array arguments are
passed by pointer and modified in place.

Command line (arrays from/to .npy files):

    python -m aiter_sage.emu SOURCE KERNEL --grid 4,1,1 --block 128 \
        --arg a.npy --arg out.npy --arg i:16 --arg f:0.5 --write-back

Only the standard library is needed (numpy / torch are used when given). The compiler command
is built in one place, :func:`emu_compile_command`, so a JIT driver can reuse it.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "EMU_RUNTIME_SOURCES",
    "EmuError",
    "EmuModule",
    "EmuResult",
    "asan_env",
    "asan_runtime_path",
    "emu_compile_command",
    "find_compiler",
    "load_module",
    "run_kernel",
]

# Emulator runtime sources, relative to csrc/; linked into every emulated module.
EMU_RUNTIME_SOURCES = ("emu/runtime.cpp", "emu/fiber.cpp", "emu/models.cpp")
# Flags for compiling kernel sources (.hip as C++) and the runtime for the emulator.
EMU_CXX_FLAGS = ("-std=c++20", "-DSAGE_EMU", "-O2", "-fPIC", "-fvisibility=hidden", "-pthread",
                 "-Wno-psabi")  # v8i32 by value without AVX: same ABI in every TU of a module
ASAN_FLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer")

_SIG_RE = re.compile(r"^(p|[ifs]\d+)$")
_KINFO_RE = re.compile(r"\bsage_emu_kinfo_([A-Za-z_]\w*)\s*=")


class EmuError(RuntimeError):
    """Compile failure, bad arguments, or (with check=True) a failed emulated launch."""


# ------------------------------------------------------------------------------------------
# Locations and tools
# ------------------------------------------------------------------------------------------
def csrc_dir() -> Path:
    """csrc/ of this checkout or installed package (AITER_SAGE_CSRC overrides)."""
    env = os.environ.get("AITER_SAGE_CSRC")
    here = Path(__file__).resolve().parent
    for cand in ([Path(env)] if env else []) + [here / "_csrc", here.parent / "csrc"]:
        if (cand / "emu" / "sage_emu.h").is_file():
            return cand
    raise EmuError("aiter_sage.emu: cannot find csrc/ with emu/sage_emu.h (set AITER_SAGE_CSRC)")


def find_compiler() -> str:
    """A clang++ (needed for ext_vector_type); AITER_SAGE_EMU_CXX overrides."""
    for name in (os.environ.get("AITER_SAGE_EMU_CXX", ""), "clang++-19", "clang++-20",
                 "clang++-18", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise EmuError("aiter_sage.emu: no clang++ found: install clang (`apt-get install clang-19`) "
                   "or set AITER_SAGE_EMU_CXX")


def emu_compile_command(sources, output, *, compiler: str | None = None,
                        csrc: Path | str | None = None, sanitize: str | None = None,
                        include_dirs=(), extra_flags=(), with_runtime: bool = True) -> list[str]:
    """The one place that spells the emulator build: sources (+ runtime) -> shared object.

    ``sources`` are compiled as C++ (``-x c++``, so ``.hip`` files work) with -DSAGE_EMU;
    ``sanitize="address"`` adds ASan (the .so then needs the ASan runtime preloaded, see
    :func:`asan_env`).
    """
    csrc = Path(csrc) if csrc else csrc_dir()
    cmd = [compiler or find_compiler(), "-x", "c++", *EMU_CXX_FLAGS,
           f"-I{csrc}", f"-I{csrc / 'include'}", *(f"-I{d}" for d in include_dirs)]
    if sanitize == "address":
        cmd += ASAN_FLAGS
    elif sanitize:
        raise EmuError(f"aiter_sage.emu: unsupported sanitizer {sanitize!r}")
    cmd += list(extra_flags)
    cmd += [str(s) for s in sources]
    if with_runtime:
        cmd += [str(csrc / s) for s in EMU_RUNTIME_SOURCES]
    cmd += ["-shared", "-o", str(output), "-ldl"]
    return cmd


def asan_runtime_path(compiler: str | None = None) -> str | None:
    """The shared ASan runtime matching the compiler (to LD_PRELOAD into Python), or None."""
    cc = compiler or find_compiler()
    for name in ("libclang_rt.asan-x86_64.so", "libclang_rt.asan.so"):
        try:
            out = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True,
                                 text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            continue
        if out and os.path.isabs(out) and os.path.isfile(out):
            return out
    return None


def asan_env(compiler: str | None = None, base: dict | None = None) -> dict:
    """Environment for a subprocess that loads ASan-built emulated modules into Python."""
    rt = asan_runtime_path(compiler)
    if not rt:
        raise EmuError("aiter_sage.emu: the compiler has no shared ASan runtime "
                       "(libclang_rt.asan-x86_64.so)")
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = rt + ((" " + env["LD_PRELOAD"]) if env.get("LD_PRELOAD") else "")
    # Python itself is not instrumented: its allocations at exit are not leaks we care about.
    env.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    return env


def _asan_loaded() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "__asan_init")
    except OSError:
        return False


def cache_dir() -> Path:
    env = os.environ.get("AITER_SAGE_EMU_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    try:
        p = Path(base) / "aiter_sage" / "emu"
        p.mkdir(parents=True, exist_ok=True)
        return p
    except OSError:
        return Path(tempfile.gettempdir()) / "aiter_sage_emu"


# ------------------------------------------------------------------------------------------
# Building
# ------------------------------------------------------------------------------------------
def _dependency_files(source: Path, csrc: Path) -> list[Path]:
    """Files the build may read: the source, headers next to it, csrc/include and csrc/emu."""
    files = {source}
    for d in {source.parent, csrc / "include", csrc / "emu"}:
        if d.is_dir():
            files.update(p for p in d.rglob("*") if p.is_file() and p.suffix in
                         (".h", ".hpp", ".hip", ".cpp", ".cuh", ".inc"))
    return sorted(files)


def _trampoline_text(source: Path, kernels) -> str:
    lines = ["// generated by aiter_sage.emu: exports a runner per kernel",
             f'#include "{source}"', '#include "emu/trampoline.h"', "SAGE_EMU_EXPORT_LAST_ERROR()"]
    lines += [f"SAGE_EMU_EXPORT_KERNEL({k})" for k in kernels]
    return "\n".join(lines) + "\n"


def _scan_kernels(source: Path, cc: str, csrc: Path) -> list[str]:
    """Kernel names after preprocessing (so kernels defined through macros are found):
    SAGE_KERNEL(name, ...) expands to a `sage_emu_kinfo_<name> = ...` definition."""
    cmd = emu_compile_command([source], "-", compiler=cc, csrc=csrc, include_dirs=[source.parent],
                              with_runtime=False)
    cmd = [c for c in cmd[:cmd.index("-shared")]] + ["-E", "-P"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise EmuError("aiter_sage.emu: preprocessing failed:\n$ " + " ".join(cmd) + "\n" +
                       r.stderr[-8000:])
    return list(dict.fromkeys(_KINFO_RE.findall(r.stdout)))


def _build(source: Path, sanitize, extra_flags) -> tuple[Path, list[str]]:
    """Builds (once; cached by content) the module exporting every kernel of `source`."""
    csrc = csrc_dir()
    cc = find_compiler()
    probe = emu_compile_command(["<trampoline>"], "<out>", compiler=cc, csrc=csrc,
                                sanitize=sanitize, include_dirs=[source.parent],
                                extra_flags=extra_flags)
    h = hashlib.sha256()
    h.update("\0".join(probe).encode() + b"\0" + _trampoline_text(source, ["<k>"]).encode())
    try:
        h.update(subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.encode())
    except OSError:
        pass
    for f in _dependency_files(source, csrc):
        h.update(str(f).encode() + b"\0" + f.read_bytes() + b"\0")
    key = h.hexdigest()[:24]
    out_dir = cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    so = out_dir / f"{source.stem}-{key}{'-asan' if sanitize else ''}.so"
    names_file = so.with_suffix(".kernels")

    def cached():
        if so.is_file() and names_file.is_file():
            return so, names_file.read_text().split()
        return None

    if (hit := cached()) is not None:
        return hit
    with open(out_dir / f".{so.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent first calls build once
        if (hit := cached()) is not None:
            return hit
        names = _scan_kernels(source, cc, csrc)
        if not names:
            raise EmuError(f"aiter_sage.emu: no SAGE_KERNEL found in {source}")
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            tramp = Path(tmp) / "trampoline.cpp"
            tramp.write_text(_trampoline_text(source, names))
            tmp_so = Path(tmp) / so.name
            cmd = emu_compile_command([tramp], tmp_so, compiler=cc, csrc=csrc, sanitize=sanitize,
                                      include_dirs=[source.parent], extra_flags=extra_flags)
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise EmuError("aiter_sage.emu: build failed:\n$ " + " ".join(cmd) + "\n" +
                               r.stderr[-8000:])
            tmp_names = Path(tmp) / "kernels"
            tmp_names.write_text("\n".join(names) + "\n")
            os.replace(tmp_so, so)  # atomic: readers never see a partial file
            os.replace(tmp_names, names_file)
    return so, names


# ------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------
class _Arg(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("size", ctypes.c_int32), ("i", ctypes.c_int64),
                ("f", ctypes.c_double), ("p", ctypes.c_void_p)]


@dataclass
class EmuResult:
    rc: int
    reports: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.reports

    def kinds(self) -> list[str]:
        """Report kinds, e.g. ['lds-race'] (the bracketed tag of each report line)."""
        return [m.group(1) for r in self.reports if (m := re.match(r"\[([\w-]+)\]", r))]


def _pointer_of(value, keep: list) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    if hasattr(value, "__array_interface__") and not _is_torch(value):
        return value.__array_interface__["data"][0]
    if _is_torch(value):
        if value.device.type != "cpu":
            raise EmuError(f"aiter_sage.emu: tensor on {value.device}; the emulator needs CPU memory")
        return value.data_ptr()
    if isinstance(value, (bytearray, memoryview)):
        buf = (ctypes.c_char * len(value)).from_buffer(value)
        keep.append(buf)
        return ctypes.addressof(buf)
    raise EmuError(f"aiter_sage.emu: cannot pass {type(value).__name__} as a pointer")


def _is_torch(value) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def _pack(code: str, value, index: int, keep: list) -> _Arg:
    a = _Arg()
    kind, size = code[0], int(code[1:] or 8)
    try:
        if kind == "p":
            a.kind, a.p = 0, _pointer_of(value, keep)
        elif kind == "i":
            if isinstance(value, float):
                raise TypeError("float for an integer parameter")
            a.kind, a.i = 1, int(value)
        elif kind == "f":
            a.kind, a.f = 2, float(value)
        else:
            raw = bytes(value) if not isinstance(value, (bytes, bytearray)) else bytes(value)
            if len(raw) != size:
                raise TypeError(f"{len(raw)} bytes for a {size}-byte struct parameter")
            buf = ctypes.create_string_buffer(raw, size)
            keep.append(buf)
            a.kind, a.size, a.p = 3, size, ctypes.addressof(buf)
    except (TypeError, ValueError) as e:
        raise EmuError(f"aiter_sage.emu: argument {index} ({code}): {e}") from None
    return a


class EmuModule:
    """A loaded emulated module: the source's kernels, runnable by name."""

    def __init__(self, path: Path, source: Path, kernels, sanitize):
        self.path, self.source, self.kernels, self.sanitize = path, source, list(kernels), sanitize
        self.lib = ctypes.CDLL(str(path), mode=getattr(os, "RTLD_LOCAL", 0))
        self.lib.sage_emu_reports_text.restype = ctypes.c_char_p
        self.lib.sage_emu_last_error.restype = ctypes.c_char_p

    def signature(self, kernel: str) -> list[str]:
        fn = getattr(self.lib, f"sage_emu_signature_{kernel}")
        fn.restype = ctypes.c_char_p
        text = fn().decode()
        return text.split(",") if text else []

    def reports(self) -> list[str]:
        text = self.lib.sage_emu_reports_text().decode(errors="replace")
        return [line for line in text.splitlines() if line.strip()]

    def run(self, kernel: str, grid=(1, 1, 1), block: int = 32, args=(), *,
            threads: int | None = None, check: bool = False) -> EmuResult:
        if kernel not in self.kernels:
            raise EmuError(f"aiter_sage.emu: {kernel!r} is not a kernel of {self.source}")
        grid = tuple(int(g) for g in (grid if isinstance(grid, (tuple, list)) else (grid,)))
        grid = grid + (1,) * (3 - len(grid))
        sig = self.signature(kernel)
        if len(sig) != len(args):
            raise EmuError(f"aiter_sage.emu: {kernel} takes {len(sig)} arguments "
                           f"({','.join(sig)}), {len(args)} given")
        keep: list = []
        packed = (_Arg * max(1, len(args)))(*[_pack(c, v, i, keep)
                                              for i, (c, v) in enumerate(zip(sig, args))])
        self.lib.sage_emu_set_num_threads(int(threads or 0))
        self.lib.sage_emu_clear_reports()
        run = getattr(self.lib, f"sage_emu_run_{kernel}")
        run.restype = ctypes.c_int
        rc = run(packed, len(args), ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]),
                 ctypes.c_uint(grid[2]), ctypes.c_uint(int(block)))
        res = EmuResult(rc=rc, reports=self.reports(),
                        error=self.lib.sage_emu_last_error().decode(errors="replace") if rc else "")
        if check and not res.ok:
            raise EmuError(f"aiter_sage.emu: {kernel} failed: {res.error}\n" + "\n".join(res.reports))
        return res


_MODULES: dict = {}


def load_module(source, *, sanitize: str | None = None, extra_flags=()) -> EmuModule:
    """Builds (or takes from the cache) and loads the emulated module of ``source``, which
    exports every ``SAGE_KERNEL`` of the file (macro-generated ones included)."""
    source = Path(source).resolve()
    if not source.is_file():
        raise EmuError(f"aiter_sage.emu: no source file {source}")
    if sanitize == "address" and not _asan_loaded():
        raise EmuError("aiter_sage.emu: an ASan module needs the ASan runtime in this process; "
                       "run Python with aiter_sage.emu.asan_env() (LD_PRELOAD)")
    so, names = _build(source, sanitize, tuple(extra_flags))
    if str(so) not in _MODULES:
        _MODULES[str(so)] = EmuModule(so, source, names, sanitize)
    return _MODULES[str(so)]


def run_kernel(source, kernel: str, grid=(1, 1, 1), block: int = 32, args=(), *,
               sanitize: str | None = None, threads: int | None = None, check: bool = False,
               extra_flags=()) -> EmuResult:
    """Runs ``kernel`` of ``source`` on grid x block emulated threads; returns rc + reports."""
    mod = load_module(source, sanitize=sanitize, extra_flags=extra_flags)
    return mod.run(kernel, grid, block, args, threads=threads, check=check)


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------
def _parse_cli_arg(text: str):
    """'x.npy' -> array; 'i:5' / 'int:5' -> int; 'f:0.5' / 'float:0.5' -> float; 'null' -> None."""
    if text == "null":
        return None, None
    kind, _, val = text.partition(":")
    if val and kind in ("i", "int"):
        return int(val, 0), None
    if val and kind in ("f", "float"):
        return float(val), None
    import numpy as np

    arr = np.ascontiguousarray(np.load(text))
    return arr, text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aiter_sage.emu", description=__doc__.split("\n\n")[0])
    ap.add_argument("source")
    ap.add_argument("kernel")
    ap.add_argument("--grid", default="1,1,1", help="x[,y[,z]] workgroups")
    ap.add_argument("--block", type=int, default=32, help="threads per workgroup")
    ap.add_argument("--arg", action="append", default=[],
                    help="kernel argument in order: FILE.npy | i:INT | f:FLOAT | null")
    ap.add_argument("--write-back", action="store_true", help="save arrays back to their .npy files")
    ap.add_argument("--sanitize", choices=["address"], default=None)
    ap.add_argument("--threads", type=int, default=None, help="host worker threads")
    ns = ap.parse_args(argv)
    if ns.sanitize == "address" and not _asan_loaded():
        # Re-run this command with the ASan runtime preloaded.
        cmd = [sys.executable, "-m", "aiter_sage.emu", *(argv if argv is not None else sys.argv[1:])]
        env = asan_env()
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        return subprocess.run(cmd, env=env).returncode
    parsed = [_parse_cli_arg(a) for a in ns.arg]
    grid = tuple(int(g) for g in ns.grid.split(","))
    res = run_kernel(ns.source, ns.kernel, grid, ns.block, [v for v, _ in parsed],
                     sanitize=ns.sanitize, threads=ns.threads)
    if ns.write_back:
        import numpy as np

        for v, path in parsed:
            if path:
                np.save(path, v)
    for line in res.reports:
        print(line)
    if res.rc:
        print(f"error: {res.error}", file=sys.stderr)
    else:
        print(f"ok: {ns.kernel} grid={grid} block={ns.block}")
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
