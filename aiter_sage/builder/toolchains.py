"""The toolchains: one per build kind (hipcc, clang and hiprtc for the gfx targets, nvcc for
NVIDIA, the host compiler for cpu, the emulator's clang, the torch binding's build), each with
its compiler identity for the cache key, and toolchain_for(target) that picks one."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import env
from .errors import CompilerNotFound
from .ninja import ninja_command_words, ninja_path
from .paths import PKG_DIR, _rocm_path, _spec_flags, _src_root, _which, cache_root, csrc_dir


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
    clang = _which(env.get("AITER_SAGE_HIP_CLANG", ""), "clang++-19", "clang++-20", "clang++-18")
    if not clang or not _which("ld.lld-19", "ld.lld-20", "ld.lld-18", "ld.lld"):
        return None
    common = ("-O3", "-std=c++17", "-fPIC", f"--offload-arch={arch}") + _include_flags()
    return Toolchain("hip", clang, ("-x", "hip", "-nogpulib") + common, ("-shared", "-lamdhip64"))


def _hip_toolchain(arch: str) -> Toolchain:
    """hipcc, else clang++ --offload-arch, else hiprtc; AITER_SAGE_HIP_TOOLCHAIN forces one."""
    forced = env.get("AITER_SAGE_HIP_TOOLCHAIN", "").strip().lower()
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
        env.get("AITER_SAGE_EMU_CXX", ""),
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
    """aiter_sage/hiprtc.py (it imports nothing from the package; ninja also runs it by path)."""
    from .. import hiprtc

    return hiprtc


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
