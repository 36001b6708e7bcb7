"""ROCm's own AMDGPU code generation on LLVM bitcode, through the C API of the LLVM that the
PyPI wheel ``rocm-llvm-python`` ships (``rocm/llvm/librocmllvm.so``: ROCm 7.2's LLVM).

Users on ROCm build our kernels with ROCm's compiler, not Debian's clang-19; the ISA budgets
(VGPRs, scratch, occupancy) must hold under both. This module takes clang-19's device bitcode
(``-emit-llvm``, already optimized at -O3 by clang-19's middle end) and runs ROCm's backend on it
(instruction selection, scheduling, register allocation at opt level 3, as ``llc -O3`` does),
writing a relocatable amdgcn object that ``aiter_sage.isa`` reads like any code object.

    python -m aiter_sage.rocm_llvm --arch gfx1201 IN.bc OUT.o
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import importlib.util
import sys
from pathlib import Path
from typing import Optional

TRIPLE = b"amdgcn-amd-amdhsa"
# LLVMCodeGenOptLevel, LLVMRelocMode, LLVMCodeModel, LLVMCodeGenFileType (llvm-c/TargetMachine.h)
OPT_AGGRESSIVE = 3
RELOC_PIC = 2
CODE_MODEL_DEFAULT = 0
OBJECT_FILE = 1


class RocmLlvmMissing(RuntimeError):
    """The rocm-llvm-python wheel is not installed."""


def library_path() -> Optional[Path]:
    """librocmllvm.so of the installed rocm-llvm-python wheel, or None."""
    spec = importlib.util.find_spec("rocm")
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(root) / "llvm" / "librocmllvm.so"
        if lib.is_file():
            return lib
    return None


@functools.lru_cache(maxsize=1)
def _llvm() -> ctypes.CDLL:
    lib_path = library_path()
    if lib_path is None:
        raise RocmLlvmMissing(
            "rocm-llvm-python is not installed (pip install rocm-llvm-python==7.2.2.562.46: "
            ".ci/install does)"
        )
    lib = ctypes.CDLL(str(lib_path))
    p, cp = ctypes.c_void_p, ctypes.c_char_p
    sigs = {
        "LLVMContextCreate": ([], p),
        "LLVMContextDispose": ([p], None),
        "LLVMCreateMemoryBufferWithContentsOfFile": (
            [cp, ctypes.POINTER(p), ctypes.POINTER(cp)],
            ctypes.c_int,
        ),
        "LLVMParseBitcodeInContext2": ([p, p, ctypes.POINTER(p)], ctypes.c_int),
        "LLVMDisposeModule": ([p], None),
        "LLVMGetTargetFromTriple": ([cp, ctypes.POINTER(p), ctypes.POINTER(cp)], ctypes.c_int),
        "LLVMCreateTargetMachine": ([p, cp, cp, cp, ctypes.c_int, ctypes.c_int, ctypes.c_int], p),
        "LLVMDisposeTargetMachine": ([p], None),
        "LLVMTargetMachineEmitToFile": ([p, p, cp, ctypes.c_int, ctypes.POINTER(cp)], ctypes.c_int),
        "LLVMDisposeMessage": ([cp], None),
        "LLVMInitializeAMDGPUTargetInfo": ([], None),
        "LLVMInitializeAMDGPUTarget": ([], None),
        "LLVMInitializeAMDGPUTargetMC": ([], None),
        "LLVMInitializeAMDGPUAsmPrinter": ([], None),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    lib.LLVMInitializeAMDGPUTargetInfo()
    lib.LLVMInitializeAMDGPUTarget()
    lib.LLVMInitializeAMDGPUTargetMC()
    lib.LLVMInitializeAMDGPUAsmPrinter()
    return lib


def _check(failed: int, err: ctypes.c_char_p, what: str) -> None:
    if failed:
        msg = err.value.decode(errors="replace") if err.value else "(no message)"
        raise RuntimeError(f"ROCm LLVM: {what}: {msg}")


def codegen(bitcode: Path, arch: str, out: Path) -> Path:
    """ROCm LLVM's AMDGPU backend at opt level 3 on `bitcode` for `arch`: a relocatable
    amdgcn object at `out` (its kernels' metadata note and code as a linked code object's)."""
    llvm = _llvm()
    ctx = llvm.LLVMContextCreate()
    try:
        buf, mod, err = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_char_p()
        _check(
            llvm.LLVMCreateMemoryBufferWithContentsOfFile(
                str(bitcode).encode(), ctypes.byref(buf), ctypes.byref(err)
            ),
            err,
            f"read {bitcode}",
        )
        # the module takes ownership of the buffer
        if llvm.LLVMParseBitcodeInContext2(ctx, buf, ctypes.byref(mod)):
            raise RuntimeError(f"ROCm LLVM: {bitcode} is not bitcode it can read")
        try:
            target = ctypes.c_void_p()
            _check(
                llvm.LLVMGetTargetFromTriple(TRIPLE, ctypes.byref(target), ctypes.byref(err)),
                err,
                "target amdgcn",
            )
            tm = llvm.LLVMCreateTargetMachine(
                target, TRIPLE, arch.encode(), b"", OPT_AGGRESSIVE, RELOC_PIC, CODE_MODEL_DEFAULT
            )
            try:
                _check(
                    llvm.LLVMTargetMachineEmitToFile(
                        tm, mod, str(out).encode(), OBJECT_FILE, ctypes.byref(err)
                    ),
                    err,
                    f"codegen {bitcode} for {arch}",
                )
            finally:
                llvm.LLVMDisposeTargetMachine(tm)
        finally:
            llvm.LLVMDisposeModule(mod)
    finally:
        llvm.LLVMContextDispose(ctx)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="gfx1201")
    ap.add_argument("bitcode", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    codegen(args.bitcode, args.arch, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
