"""hiprtc: compile the device half of a gfx12 module at run time, without hipcc or clang.

Users with ROCm's PyTorch but no ROCm SDK still have ROCm's run-time compiler, libhiprtc
(pip/TheRock ROCm: inside the ``_rocm_sdk_core`` package; a ROCm install: ``$ROCM_PATH/lib``;
some PyTorch wheels: ``torch/lib``). The JIT driver (``jit_driver.HiprtcToolchain``) builds a
module in two halves from the same ``.hip`` file:

* device: this file, run by ninja as a script, compiles it with hiprtc and ``-DSAGE_HIPRTC``
  (``SAGE_HOST_LAUNCH`` drops the launch section) into a code object for one arch, and writes
  a C++ file embedding that code object in the section ``.sage_code_object``;
* host: the host compiler builds the same file with ``-DSAGE_HIPRTC_HOST`` plus the embedding
  file; ``sage_launch`` loads the code object with the HIP module API
  (``csrc/include/sage/hiprtc_host.h``).

hiprtc resolves no system header and no include path of ours, so every header the kernels may
include is handed to it by name (``device_headers``).

This file imports nothing from the package: ninja runs it by path
(``python hiprtc.py compile ...``) in a process of its own, so a hiprtc that crashes (HIP 5.2's
does, without a GPU) fails one build step, not the caller.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import glob
import importlib.util
import os
import sys
from pathlib import Path

if __package__:
    from . import env
else:  # run by path (ninja's compile step): sys.path[0] is this folder
    import env

# hiprtcResult values this module names (hip/hiprtc.h).
HIPRTC_SUCCESS = 0
HIPRTC_ERROR_COMPILATION = 6

# Embedded code objects are aligned to a page: the HIP runtime reads the ELF in place.
EMBED_ALIGN = 4096
EMBED_SECTION = ".sage_code_object"
EMBED_SYMBOL = "sage_hiprtc_code_object"


class HiprtcNotFound(RuntimeError):
    """No usable libhiprtc; the message lists where it was looked for."""


class HiprtcCompileError(RuntimeError):
    """hiprtc rejected a source; the message carries hiprtc's own log."""


# ----------------------------------------------------------------------------------------------
# Finding libhiprtc (in PyTorch's order: the pip ROCm SDK, ROCM_PATH, the system, torch/lib)
# ----------------------------------------------------------------------------------------------
def _package_dir(name: str) -> Path | None:
    """Folder of an installed package, found without importing it (torch is slow to import)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _rocm_sdk_libraries() -> list[str]:
    """pip/TheRock ROCm ships libhiprtc.so.N with no unversioned link; rocm_sdk knows where."""
    try:
        import rocm_sdk  # type: ignore[import-not-found]

        return [str(p) for p in rocm_sdk.find_libraries("hiprtc")]
    except Exception:  # absent, or an SDK without the core package: not this candidate
        return []


def _rocm_path() -> str:
    return os.environ.get("ROCM_PATH") or os.environ.get("HIP_PATH") or "/opt/rocm"


def library_candidates() -> list[str]:
    """Where libhiprtc may be, best first; sonames are left to the dynamic loader's path.

    HIP <= 5.2 carried hiprtc inside libamdhip64; that one compiles for the current device
    only (it ignores --offload-arch and aborts without a GPU), so it is not a candidate."""
    found: list[str] = []
    chosen = env.get("AITER_SAGE_HIPRTC_LIB")
    if chosen:
        found.append(chosen)
    found += _rocm_sdk_libraries()
    found += sorted(glob.glob(os.path.join(_rocm_path(), "lib", "libhiprtc.so*")))
    found += ["libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6", "libhiprtc.so.5"]
    torch_dir = _package_dir("torch")
    if torch_dir:
        found += sorted(glob.glob(str(torch_dir / "lib" / "libhiprtc*.so*")))
    return list(dict.fromkeys(found))


class HiprtcLibrary:
    """The few hiprtc entry points a compile needs, through ctypes."""

    def __init__(self, path: str):
        self.path = path
        self.lib = ctypes.CDLL(path)
        for name in (
            "hiprtcVersion",
            "hiprtcCreateProgram",
            "hiprtcCompileProgram",
            "hiprtcGetProgramLogSize",
            "hiprtcGetProgramLog",
            "hiprtcGetCodeSize",
            "hiprtcGetCode",
            "hiprtcDestroyProgram",
            "hiprtcGetErrorString",
        ):
            getattr(self.lib, name)  # AttributeError: not a hiprtc
        self.lib.hiprtcGetErrorString.restype = ctypes.c_char_p

    def version(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(
            self.lib.hiprtcVersion(ctypes.byref(major), ctypes.byref(minor)), "hiprtcVersion"
        )
        return f"{major.value}.{minor.value}"

    def _check(self, rc: int, what: str) -> None:
        if rc != HIPRTC_SUCCESS:
            msg = self.lib.hiprtcGetErrorString(rc) or b"?"
            raise RuntimeError(f"{self.path}: {what} failed: {msg.decode()} ({rc})")

    def _log(self, prog) -> str:
        size = ctypes.c_size_t()
        if self.lib.hiprtcGetProgramLogSize(prog, ctypes.byref(size)) or size.value <= 1:
            return ""
        buf = ctypes.create_string_buffer(size.value)
        self.lib.hiprtcGetProgramLog(prog, buf)
        return buf.value.decode(errors="replace")

    def compile(self, source: str, name: str, options: list[str], headers: dict[str, str]) -> bytes:
        """Code object of `source`; HiprtcCompileError with hiprtc's log when it fails."""
        prog = ctypes.c_void_p()
        names = [n.encode() for n in headers]
        texts = [t.encode() for t in headers.values()]
        self._check(
            self.lib.hiprtcCreateProgram(
                ctypes.byref(prog),
                source.encode(),
                name.encode(),
                len(names),
                (ctypes.c_char_p * len(texts))(*texts),
                (ctypes.c_char_p * len(names))(*names),
            ),
            "hiprtcCreateProgram",
        )
        try:
            opts = [o.encode() for o in options]
            rc = self.lib.hiprtcCompileProgram(
                prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)
            )
            log = self._log(prog)
            if rc != HIPRTC_SUCCESS:
                what = (self.lib.hiprtcGetErrorString(rc) or b"?").decode()
                raise HiprtcCompileError(
                    f"hiprtc ({self.path}) failed to compile {name} ({what}):\n{log.strip()}"
                )
            size = ctypes.c_size_t()
            self._check(self.lib.hiprtcGetCodeSize(prog, ctypes.byref(size)), "hiprtcGetCodeSize")
            code = ctypes.create_string_buffer(size.value)
            self._check(self.lib.hiprtcGetCode(prog, code), "hiprtcGetCode")
            return code.raw
        finally:
            self.lib.hiprtcDestroyProgram(ctypes.byref(prog))


@functools.lru_cache(None)
def load_library() -> HiprtcLibrary:
    """The first candidate that loads and exports the hiprtc API."""
    tried = []
    for cand in library_candidates():
        try:
            return HiprtcLibrary(cand)
        except (OSError, AttributeError) as e:
            tried.append(f"{cand}: {e}")
    raise HiprtcNotFound(
        "aiter_sage: no libhiprtc found (install ROCm's PyTorch, whose ROCm "
        "SDK ships it, or set AITER_SAGE_HIPRTC_LIB); tried:\n  " + "\n  ".join(tried)
    )


# ----------------------------------------------------------------------------------------------
# HIP runtime headers for the host half
# ----------------------------------------------------------------------------------------------
def hip_include_candidates() -> list[Path]:
    dirs = []
    core = _package_dir("_rocm_sdk_core")
    if core:
        dirs.append(core / "include")
    dirs.append(Path(_rocm_path()) / "include")
    triton = _package_dir("triton")
    if triton:  # triton's AMD backend carries the HIP runtime headers it builds its driver with
        dirs.append(triton / "backends" / "amd" / "include")
    dirs.append(Path("/usr/include"))  # Debian/Ubuntu libamdhip64-dev
    return dirs


def find_hip_include() -> Path | None:
    for d in hip_include_candidates():
        if (d / "hip" / "hip_runtime_api.h").is_file():
            return d
    return None


# ----------------------------------------------------------------------------------------------
# The device half
# ----------------------------------------------------------------------------------------------
# csrc/ folders whose headers device code includes as "<room>/<name>.h" (tiling, lane layouts).
KERNEL_HEADER_ROOMS = ("gfx12", "simt")


def device_headers(csrc: Path) -> dict[str, str]:
    """Every header a kernel source may include, by the name it is included as."""
    inc = Path(csrc) / "include"
    headers = {
        p.relative_to(inc).as_posix(): p.read_text() for p in sorted((inc / "sage").rglob("*.h"))
    }
    # Headers that live beside the kernels they serve are included by their csrc/ path.
    for room in KERNEL_HEADER_ROOMS:
        headers.update(
            {
                p.relative_to(csrc).as_posix(): p.read_text()
                for p in sorted((Path(csrc) / room).glob("*.h"))
            }
        )
    headers["stdint.h"] = (inc / "sage" / "hiprtc" / "stdint.h").read_text()
    return headers


def device_options(arch: str) -> list[str]:
    return [f"--offload-arch={arch}", "-O3", "-std=c++17", "-DSAGE_HIPRTC"]


def embed_source(code: bytes) -> str:
    """C++ defining the code object as a page-aligned array in its own section (so
    aiter_sage.isa can dump it with llvm-objcopy), hidden: each module has its own."""
    rows = []
    for i in range(0, len(code), 24):
        rows.append(",".join(str(b) for b in code[i : i + 24]))
    body = ",\n".join(rows)
    return (
        "// generated by aiter_sage/hiprtc.py: the hiprtc code object of this module\n"
        "#include <stddef.h>\n"
        f'extern "C" __attribute__((visibility("hidden"), used, section("{EMBED_SECTION}"), '
        f"aligned({EMBED_ALIGN})))\n"
        f"const unsigned char {EMBED_SYMBOL}[{len(code)}] = {{\n{body}\n}};\n"
        f'extern "C" __attribute__((visibility("hidden"))) const size_t '
        f"{EMBED_SYMBOL}_size = {len(code)};\n"
    )


def compile_file(src: Path, arch: str, csrc: Path) -> bytes:
    return load_library().compile(
        Path(src).read_text(), Path(src).name, device_options(arch), device_headers(csrc)
    )


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="device half of one .hip file -> code object + embedding")
    c.add_argument("src")
    c.add_argument("--arch", required=True)
    c.add_argument("--csrc", required=True, help="the csrc/ folder (headers)")
    c.add_argument("-o", "--output", required=True, help="code object to write")
    c.add_argument("--embed", required=True, help="C++ file embedding the code object")
    sub.add_parser("version", help="print the libhiprtc used and its version")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "version":
            lib = load_library()
            print(lib.path, lib.version())
            return 0
        code = compile_file(Path(args.src), args.arch, Path(args.csrc))
    except (HiprtcNotFound, HiprtcCompileError) as e:
        print(e, file=sys.stderr)
        return 1
    _write_atomic(Path(args.output), code)
    _write_atomic(Path(args.embed), embed_source(code).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
