"""ISA report for the gfx12 kernel modules.

    python -m aiter_sage.isa --arch gfx1201 [--so PATH ...]

Without ``--so`` it builds csrc/gfx12/{prepare,attention}.hip for ``--arch`` through the JIT
driver (hipcc, else clang++ --offload-arch; cached like a first call's build). It then
extracts the code object for ``--arch`` from each module's fat binary, reads the kernel
metadata and disassembles it, and prints per kernel: VGPRs, SGPRs, LDS bytes, scratch bytes,
estimated waves per SIMD, and the instruction mix of the main loop (the innermost backward
branch whose body contains WMMAs).

Occupancy model (gfx12 = RDNA4, wave32), from public sources:
  * 1536 VGPRs per SIMD lane, allocated in granules of 24, at most 16 waves per SIMD. LLVM's
    llvm/test/CodeGen/AMDGPU/occupancy-levels.ll checks gfx1200 with the GFX1100W32 prefixes
    (e.g. 256 VGPRs -> 5 waves, 200 -> 7, 168 -> 9, 128 -> 10, max 16), which is exactly
    min(16, 1536 // round_up(vgprs, 24)); the Linux amdkfd (kfd_queue.c,
    kfd_get_vgpr_size_per_cu) sizes the VGPR file of GFX_VERSION_GFX1200/GFX1201 at 0x60000
    bytes per CU = 2 SIMDs x 32 lanes x 4 bytes x 1536.
  * LDS: 128 KiB per WGP shared by its 4 SIMDs (the same LLVM test: a 128-thread workgroup
    with 8252 bytes of LDS reaches 15 waves on gfx1100/gfx1200 = floor(131072 / 8252) x 4
    waves / 4 SIMDs).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

from . import jit_driver

# gfx12 occupancy facts (see the module docstring for sources).
VGPRS_PER_SIMD_LANE = 1536
VGPR_GRANULE = 24
MAX_WAVES_PER_SIMD = 16
LDS_BYTES_PER_WGP = 128 * 1024
SIMDS_PER_WGP = 4
WAVE_SIZE = 32


def tool(name: str) -> Optional[str]:
    """An LLVM 19 tool: `name`-19 first, then the unversioned name."""
    return shutil.which(f"{name}-19") or shutil.which(name)


def build_modules(arch: str, names=None) -> dict:
    """{module name: .so} of the gfx12 kernel modules for `arch` (all, or those in `names`),
    built (or taken from the cache) by the JIT driver exactly as a first call on that GPU
    would build them."""
    table = jit_driver.module_table()
    return {
        name: jit_driver.ensure_module(name, arch)
        for name in table.KERNEL_MODULES
        if names is None or name in names
    }


def _has_section(so: Path, section: str) -> bool:
    out = subprocess.run(
        [tool("llvm-readelf"), "-S", "-W", str(so)], check=True, capture_output=True, text=True
    ).stdout
    return section in out.split()


def extract_code_object(so: Path, arch: str, work: Path) -> Path:
    """The amdgcn ELF for `arch` from a module .so: a hipcc/clang build carries a clang bundle
    in .hip_fatbin, a hiprtc build (aiter_sage/hiprtc.py) the code object itself in
    .sage_code_object."""
    if _has_section(so, ".sage_code_object"):
        co = work / f"{so.stem}.{arch}.co"
        subprocess.run(
            [
                tool("llvm-objcopy"),
                f"--dump-section=.sage_code_object={co}",
                str(so),
                str(work / f"{so.stem}.stripped"),
            ],
            check=True,
            capture_output=True,
        )
        return co
    fatbin = work / f"{so.stem}.fatbin"
    subprocess.run(
        [
            tool("llvm-objcopy"),
            f"--dump-section=.hip_fatbin={fatbin}",
            str(so),
            str(work / f"{so.stem}.stripped"),
        ],
        check=True,
        capture_output=True,
    )
    listing = subprocess.run(
        [tool("clang-offload-bundler"), "--list", "--type=o", f"--input={fatbin}"],
        check=True,
        capture_output=True,
        text=True,
    )
    targets = [t for t in listing.stdout.split() if t.endswith(f"--{arch}")]
    if not targets:
        raise RuntimeError(f"{so}: no code object for {arch} (bundle has {listing.stdout.split()})")
    co = work / f"{so.stem}.{arch}.co"
    subprocess.run(
        [
            tool("clang-offload-bundler"),
            "--unbundle",
            "--type=o",
            f"--input={fatbin}",
            f"--targets={targets[0]}",
            f"--output={co}",
        ],
        check=True,
        capture_output=True,
    )
    return co


@dataclasses.dataclass
class LoopMix:
    start: int
    end: int
    instructions: int = 0
    wmma_iu8: int = 0
    wmma_fp8: int = 0
    wmma_f16: int = 0  # 16-bit WMMA (FP16 P·V): twice the clocks of an 8-bit one
    wmma_bf16: int = 0  # v_wmma_f32_16x16x16_bf16 (16-bit: the FP16 rate)
    wmma_other: int = 0
    valu: int = 0
    trans: int = 0
    lds: int = 0
    global_load: int = 0
    global_store: int = 0
    waitcnt: int = 0
    barrier: int = 0
    salu: int = 0
    scratch: int = 0
    vopd: int = 0  # v_dual_* (two VALU ops issued as one instruction; counted once)
    delay_alu: int = 0  # s_delay_alu: a dependency stall the compiler could not schedule away
    rescale_valu: int = 0  # VALU inside the loop's EXEC-masked rescale branch (skippable)
    # Memory traffic and waits (what the calibrated model charges, aiter_sage/perf_model.py)
    vmem_bytes: int = 0  # bytes per lane of the global loads
    vmem_narrow: int = 0  # global loads of < 4 bytes per lane (strided gathers: u8/u16/d16)
    lds_bytes: int = 0  # bytes per lane of the LDS loads, stores and permutes
    scratch_bytes: int = 0  # bytes per lane of the scratch (spill / private array) accesses
    wait_vmem: int = 0  # waits on vector memory (s_wait_loadcnt*, s_wait_storecnt, vmcnt)
    wait_lds: int = 0  # waits on LDS (s_wait_dscnt, s_wait_loadcnt_dscnt counts in both)
    wait_alu: int = 0  # s_wait_alu (a VALU/SALU hazard wait; ROCm's LLVM emits them)

    @property
    def wmma(self) -> int:
        return self.wmma_iu8 + self.wmma_fp8 + self.wmma_16bit + self.wmma_other

    @property
    def wmma_16bit(self) -> int:
        return self.wmma_f16 + self.wmma_bf16

    def wmma_clocks(self, wmma_cycles: int = 8) -> int:
        """SIMD clocks of the loop's WMMAs: `wmma_cycles` per 8-bit one, twice that per 16-bit
        one (the FP16/BF16 rate is half the 8-bit rate: 1024 vs 2048 ops/clk/CU)."""
        return (self.wmma - self.wmma_16bit) * wmma_cycles + self.wmma_16bit * 2 * wmma_cycles

    def wmma_cycle_share(self, wmma_cycles: int = 8, skip_rescale: bool = False) -> float:
        """Share of the SIMD's vector issue cycles spent in WMMA, assuming a 16x16x16 8-bit
        WMMA occupies the SIMD `wmma_cycles` clocks (2048 8-bit ops/clk/CU, 2 SIMDs per CU:
        8192 ops / 1024 per clock), a 16-bit one twice that, and every other vector
        instruction one clock. skip_rescale: without the VALU of the EXEC-masked rescale
        branch."""
        vec = self.valu + self.trans - (self.rescale_valu if skip_rescale else 0)
        busy = self.wmma_clocks(wmma_cycles)
        return busy / (busy + vec) if busy + vec else 0.0


@dataclasses.dataclass
class KernelReport:
    name: str
    vgprs: int
    sgprs: int
    lds_bytes: int
    scratch_bytes: int
    vgpr_spills: int
    sgpr_spills: int
    max_threads: int
    waves_vgpr: int
    waves_lds: int
    loop: Optional[LoopMix]

    @property
    def waves_per_simd(self) -> int:
        return min(self.waves_vgpr, self.waves_lds)


def waves_per_simd_for_vgprs(vgprs: int) -> int:
    alloc = -(-max(vgprs, 1) // VGPR_GRANULE) * VGPR_GRANULE
    return min(MAX_WAVES_PER_SIMD, VGPRS_PER_SIMD_LANE // alloc)


def waves_per_simd_for_lds(lds_bytes: int, threads: int) -> int:
    if lds_bytes == 0:
        return MAX_WAVES_PER_SIMD
    groups = LDS_BYTES_PER_WGP // lds_bytes
    waves_per_group = -(-threads // WAVE_SIZE)
    return min(MAX_WAVES_PER_SIMD, groups * waves_per_group // SIMDS_PER_WGP)


def kernel_metadata(co: Path) -> dict:
    """{kernel name: {field: value}} from the code object's AMDGPU metadata note (YAML as
    printed by llvm-readelf: each kernel is a list item at indent 2, its fields at indent 4)."""
    notes = subprocess.run(
        [tool("llvm-readelf"), "--notes", str(co)], check=True, capture_output=True, text=True
    ).stdout
    entries, cur = [], None
    for line in notes.splitlines():
        if re.match(r"^  - \.", line):
            cur = {}
            entries.append(cur)
        m = re.match(r"^    \.(\w+):\s+(\S+)", line)
        if m and cur is not None:
            key, val = m.groups()
            cur[key] = int(val) if re.fullmatch(r"-?\d+", val) else val
    return {e["name"]: e for e in entries if "name" in e}


_INSN = re.compile(r"^\s+([a-z_0-9]+)(?:\s+(.*?))?\s*//\s*([0-9A-Fa-f]+):")
_TARGET = re.compile(r"<([\w.$]+)\+0x([0-9a-f]+)>")
_TRANS = ("v_exp_", "v_log_", "v_rcp_", "v_rsq_", "v_sqrt_", "v_sin_", "v_cos_")


def disassemble(co: Path, arch: str) -> dict:
    """{kernel: [(address, mnemonic, operands, branch target or None)]}."""
    text = subprocess.run(
        [tool("llvm-objdump"), "-d", f"--mcpu={arch}", str(co)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    funcs, cur, base = {}, None, 0
    for line in text.splitlines():
        m = re.match(r"^([0-9a-f]+) <([\w.$]+)>:", line)
        if m:
            base, cur = int(m.group(1), 16), m.group(2)
            funcs[cur] = []
            continue
        m = _INSN.match(line)
        if m and cur:
            mnem, ops, addr = m.group(1), m.group(2) or "", int(m.group(3), 16)
            tgt = None
            if mnem.startswith(("s_cbranch", "s_branch")):
                t = _TARGET.search(line)
                if t:
                    tgt = base + int(t.group(2), 16)
            funcs[cur].append((addr, mnem, ops, tgt))
    return funcs


_ACCESS_BYTES = {"b128": 16, "b96": 12, "b64": 8, "b32": 4, "u16": 2, "i16": 2, "b16": 2}


def access_bytes(mnem: str) -> int:
    """Bytes per lane of a memory instruction, from its mnemonic's width suffix
    (global_load_b128: 16, global_load_d16_hi_b16: 2, ds_bpermute_b32: 4, *_u8/_i8: 1)."""
    for suffix, n in _ACCESS_BYTES.items():
        if mnem.endswith(suffix):
            return n
    if mnem.endswith(("u8", "i8")):
        return 1
    return 4


def _classify_wait(mix: LoopMix, mnem: str) -> None:
    if mnem == "s_wait_alu":
        mix.wait_alu += 1
        return
    if "loadcnt" in mnem or "storecnt" in mnem or "samplecnt" in mnem or "vmcnt" in mnem:
        mix.wait_vmem += 1
    if "dscnt" in mnem or "lgkmcnt" in mnem:
        mix.wait_lds += 1


def classify(mix: LoopMix, mnem: str) -> None:
    mix.instructions += 1
    if mnem.startswith("v_wmma"):
        if "iu8" in mnem:
            mix.wmma_iu8 += 1
        elif "fp8" in mnem or "bf8" in mnem:
            mix.wmma_fp8 += 1
        elif mnem.endswith("_bf16"):  # v_wmma_f32_16x16x16_bf16
            mix.wmma_bf16 += 1
        elif mnem.endswith("_f16"):  # v_wmma_f32_16x16x16_f16
            mix.wmma_f16 += 1
        else:
            mix.wmma_other += 1
    elif mnem.startswith(_TRANS):
        mix.trans += 1
    elif mnem.startswith("v_"):
        mix.valu += 1
        if mnem.startswith("v_dual_"):
            mix.vopd += 1
    elif mnem.startswith("ds_"):
        mix.lds += 1
        mix.lds_bytes += access_bytes(mnem)
    elif mnem.startswith(("global_load", "buffer_load", "flat_load")):
        mix.global_load += 1
        width = access_bytes(mnem)
        mix.vmem_bytes += width
        mix.vmem_narrow += width < 4
    elif mnem.startswith(("global_store", "buffer_store", "flat_store")):
        mix.global_store += 1
    elif mnem.startswith("scratch_"):
        mix.scratch += 1
        mix.scratch_bytes += access_bytes(mnem)
    elif mnem.startswith(("s_waitcnt", "s_wait_")):  # gfx12 split counters: s_wait_loadcnt, ...
        mix.waitcnt += 1
        _classify_wait(mix, mnem)
    elif mnem.startswith("s_barrier"):
        mix.barrier += 1
    elif mnem == "s_delay_alu":
        mix.delay_alu += 1
    elif mnem.startswith("s_"):
        mix.salu += 1


# EXEC-mask branches skip divergent code; a loop's back edge is uniform (s_branch,
# s_cbranch_scc*/vcc*). A block placed after the latch may jump back into the loop with an
# s_cbranch_execz, whose [target, branch] range is not a loop (it misses the loop's head).
_DIVERGENT_BRANCHES = ("s_cbranch_execz", "s_cbranch_execnz")


def main_loop(insns: list) -> Optional[LoopMix]:
    """The innermost uniform backward branch whose body [target, branch] contains a WMMA."""
    best = None
    for addr, mnem, _, tgt in insns:
        if tgt is None or tgt > addr or mnem in _DIVERGENT_BRANCHES:
            continue
        body = [i for i in insns if tgt <= i[0] <= addr]
        if not any(i[1].startswith("v_wmma") for i in body):
            continue
        if best is None or addr - tgt < best[1] - best[0]:
            best = (tgt, addr, body)
    if best is None:
        return None
    mix = LoopMix(best[0], best[1])
    for _, mnem, _, _ in best[2]:
        classify(mix, mnem)
    # The skippable rescale: the body of a forward s_cbranch_execz inside the loop (an
    # EXEC-masked "if" that the whole wave jumps over when no lane takes it).
    body = best[2]
    for i, (addr, mnem, _, tgt) in enumerate(body):
        if mnem == "s_cbranch_execz" and tgt is not None and tgt > addr:
            mix.rescale_valu += sum(
                1
                for a, m, _, _ in body[i + 1 :]
                if a < tgt and m.startswith("v_") and not m.startswith(("v_wmma",) + _TRANS)
            )
    return mix


def compile_source(
    src: Path, arch: str, work: Path, includes=(), rocm_codegen: bool = False, defines=()
) -> Path:
    """A HIP source compiled for `arch` with the flags of the gfx12 modules (csrc/gfx12/README:
    -O3 -std=c++17 -nogpulib, the repository's include dirs) into a device code object.
    rocm_codegen: clang-19's bitcode lowered by ROCm 7.2's AMDGPU backend instead
    (aiter_sage.rocm_llvm; a relocatable object, read the same way)."""
    root = Path(__file__).resolve().parent.parent
    co = work / f"{src.stem}.{arch}.co"
    if rocm_codegen:
        from . import rocm_llvm

        bc = work / f"{src.stem}.{arch}.bc"
        cmd = _clang_device_cmd(root, arch, includes, defines, work) + [
            "-emit-llvm",
            str(src),
            "-o",
            str(bc),
        ]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        return rocm_llvm.codegen(bc, arch, work / f"{src.stem}.{arch}.rocm.o")
    cmd = _clang_device_cmd(root, arch, includes, defines, work) + ["--no-gpu-bundle-output"]
    subprocess.run(cmd + [str(src), "-o", str(co)], check=True, capture_output=True, text=True)
    return co


# Device definitions of the ockl entry points that Debian's HIP 5.2 headers call for threadIdx,
# blockIdx, blockDim and __syncthreads (Debian has no gfx12 device libraries, so -nogpulib):
# the builtins they stand for. Force-included into every --source compile (our own kernels
# never call them: csrc/include/sage/platform.h uses the builtins directly).
OCKL_PRELUDE = """#pragma once
extern "C" __attribute__((device)) inline unsigned long __ockl_get_local_id(unsigned d) {
  return d == 0 ? __builtin_amdgcn_workitem_id_x()
       : d == 1 ? __builtin_amdgcn_workitem_id_y() : __builtin_amdgcn_workitem_id_z();
}
extern "C" __attribute__((device)) inline unsigned long __ockl_get_group_id(unsigned d) {
  return d == 0 ? __builtin_amdgcn_workgroup_id_x()
       : d == 1 ? __builtin_amdgcn_workgroup_id_y() : __builtin_amdgcn_workgroup_id_z();
}
extern "C" __attribute__((device)) inline unsigned long __ockl_get_local_size(unsigned d) {
  return d == 0 ? __builtin_amdgcn_workgroup_size_x()
       : d == 1 ? __builtin_amdgcn_workgroup_size_y() : __builtin_amdgcn_workgroup_size_z();
}
extern "C" __attribute__((device)) inline void __atomic_work_item_fence(unsigned, int, int) {
  __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "workgroup");
}
"""


def _clang_device_cmd(root: Path, arch: str, includes, defines, work: Path) -> list:
    prelude = work / "sage_ockl_prelude.h"
    prelude.write_text(OCKL_PRELUDE)
    clang = tool("clang++") or "clang++"
    cmd = [
        clang,
        "-x",
        "hip",
        f"--offload-arch={arch}",
        "-nogpulib",
        "-O3",
        "-std=c++17",
        "--cuda-device-only",
        "-include",
        "hip/hip_runtime.h",
        "-include",
        str(prelude),
        "-c",
        "-I",
        str(root / "csrc"),
        "-I",
        str(root / "csrc" / "include"),
    ]
    return cmd + [a for inc in includes for a in ("-I", inc)] + [f"-D{d}" for d in defines]


def analyze_so(so: Path, arch: str) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        co = extract_code_object(Path(so), arch, Path(tmp))
        return analyze_code_object(co, arch)


def analyze_code_object(co: Path, arch: str) -> list:
    if True:
        meta = kernel_metadata(co)
        code = disassemble(co, arch)
    reports = []
    for name, md in meta.items():
        vgprs, lds = md.get("vgpr_count", 0), md.get("group_segment_fixed_size", 0)
        threads = md.get("max_flat_workgroup_size", 1024)
        reports.append(
            KernelReport(
                name=name,
                vgprs=vgprs,
                sgprs=md.get("sgpr_count", 0),
                lds_bytes=lds,
                scratch_bytes=md.get("private_segment_fixed_size", 0),
                vgpr_spills=md.get("vgpr_spill_count", 0),
                sgpr_spills=md.get("sgpr_spill_count", 0),
                max_threads=threads,
                waves_vgpr=waves_per_simd_for_vgprs(vgprs),
                waves_lds=waves_per_simd_for_lds(lds, threads),
                loop=main_loop(code.get(name, [])),
            )
        )
    return reports


# ---------------------------------------------------------------------------------------------
# Performance model (a prediction from the code object, not a measurement)
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GpuSpec:
    name: str
    cus: int  # compute units (2 per WGP)
    clock_hz: float  # boost clock
    dense_8bit_ops: float  # dense INT8/FP8 matrix ops per second (1 multiply-add = 2 ops)
    dram_bytes_s: float


# Radeon AI PRO R9700 (Navi 48, gfx1201). Sources: AMD's product page for the R9700 (64 CUs,
# 640 GB/s GDDR6, 383 TOPS dense INT8/FP8); the RX 9070 XT on the same
# Navi 48 die: 64 CUs, 256-bit GDDR6 at 20 Gbps = 640 GB/s (AMD launch specifications, e.g.
# multiplayer.it/notizie/amd-radeon-rx-9070-xt-rx-9070-specifiche.html). The clock is the one
# that makes the published TOPS consistent with 2048 dense 8-bit ops/clk/CU (see WMMA_CLOCKS):
# 383e12 / (64 * 2048) = 2.92 GHz, AMD's listed boost clock for the R9700.
R9700 = GpuSpec(
    "Radeon AI PRO R9700",
    cus=64,
    clock_hz=383e12 / (64 * 2048),
    dense_8bit_ops=383e12,
    dram_bytes_s=640e9,
)
# Radeon RX 9070 XT (same Navi 48 die): 389 TOPS dense INT8 at its 2.97 GHz boost (AMD).
RX9070XT = GpuSpec(
    "Radeon RX 9070 XT", cus=64, clock_hz=2.97e9, dense_8bit_ops=389e12, dram_bytes_s=640e9
)
GPUS = {"r9700": R9700, "rx9070xt": RX9070XT}

# A 16x16x16 8-bit WMMA is 4096 multiply-adds = 8192 ops; at 2048 ops/clk/CU over 2 SIMDs per CU
# it holds its SIMD 8 clocks (AMD: 383 TOPS / 64 CUs / 2.92 GHz). LLVM's gfx1201 scheduling
# model (llvm-mca-19 -mcpu=gfx1201: latency 5, throughput 1) is not the hardware matrix rate.
WMMA_CLOCKS = 8
WMMA_OPS = 2 * 16 * 16 * 16
# Transcendentals (v_exp_f32 ...) are quarter rate (LLVM SISchedule.td, WriteTrans32: "F16 or
# F32 transcendental instructions (these are quarter rate)", reviews.llvm.org/D81011) and on
# RDNA3/4 run in a separate unit beside the VALU (RDNA3 ISA guide, s_delay_alu TRANS32_DEP):
# each costs 1 issue clock, and the unit bounds a wave at 4 clocks per transcendental.
TRANS_CLOCKS = 4
# LDS: 64 banks x 4 bytes per WGP (RDNA4 ISA guide, LDS chapter; gfx12/fragments.h
# kLdsPassBytes) = 256 B/clk per WGP shared by 4 SIMDs.
LDS_BYTES_PER_CLK_PER_WGP = 256
# Vector memory: one 64-byte cache line per clock per CU from L1/L2 (RDNA whitepaper: the L0
# vector cache returns 64 B/clk per CU; an assumption for RDNA4, whose guide gives no figure).
L2_BYTES_PER_CLK_PER_CU = 64
# Latencies the scheduler could not hide inside a wave are charged per wait instruction
# (assumptions, typical RDNA figures: LDS ~64 clocks, VALU dependency (s_delay_alu) ~4).
LDS_WAIT_CLOCKS = 64
DELAY_ALU_CLOCKS = 4


@dataclasses.dataclass
class Prediction:
    gpu: str
    shape: tuple
    waves_per_simd: int
    queries_per_group: int
    rescale_executed: bool
    issue_clocks: float  # one wave, one loop iteration: WMMA + VALU + transcendental issue
    trans_clocks: float  # the transcendental unit's busy time for the same
    stall_clocks: float  # exposed waits of one wave (hidden by the other waves if enough)
    simd_clocks: float  # SIMD time per wave-iteration with the occupancy interleaved
    lds_clocks: float  # LDS time per wave-iteration (its share of the WGP's LDS)
    l2_clocks: float  # vector memory time per wave-iteration (its share of the CU)
    bound: str  # which of the above sets the rate
    iterations: float  # loop iterations per SIMD for the whole problem (tails included)
    dram_seconds: float
    seconds: float
    tflops: float
    roof_tflops: float


def predict(
    k: "KernelReport",
    gpu: GpuSpec = R9700,
    b: int = 1,
    h: int = 24,
    s: int = 16384,
    d: int = 128,
    queries_per_group: int = 128,
    rescale_executed: bool = True,
    kv_tile: int = 32,
    compute_queries: int | None = None,
) -> Prediction:
    """Time of non-causal attention B x H x S x S x D from one kernel's main loop.

    One loop iteration of one wave does lp.wmma WMMAs; the problem needs FLOPs / WMMA_OPS of
    them after padding queries to `queries_per_group` and keys to `kv_tile`. A SIMD runs its
    `waves_per_simd` waves interleaved: per wave-iteration it spends the issue clocks, unless a
    wave's exposed waits exceed what the other waves can fill. LDS and vector memory are shared
    resources: each wave-iteration needs its bytes at the WGP's / CU's rate. The slowest of
    the three is the bound. Workgroups run in rounds of (WGPs x groups per WGP).

    `compute_queries`: the query granule that does matrix work (default: the whole group).
    Ours is 32: a wave whose 32 queries are all padding only stages K/V, and the model assumes
    its issue slots go to the other waves of its SIMD (its loads and barriers are not charged)."""
    lp = k.loop
    if lp is None or lp.wmma == 0:
        raise ValueError(f"{k.name}: no WMMA main loop to model")
    vec = lp.valu + lp.trans - (0 if rescale_executed else lp.rescale_valu)
    issue = lp.wmma_clocks(WMMA_CLOCKS) + vec
    trans = lp.trans * TRANS_CLOCKS
    stall = lp.waitcnt * LDS_WAIT_CLOCKS + lp.delay_alu * DELAY_ALU_CLOCKS
    w = max(k.waves_per_simd, 1)
    # w waves share the SIMD: the SIMD is busy for w * issue per round of w wave-iterations,
    # or one wave's full critical path (issue + stalls) when that is longer.
    simd = max(issue, trans, (issue + stall) / w)
    # LDS: 16 bytes x 32 lanes per 128-bit access (ds_load/store_b128 dominate the loop);
    # 4 SIMDs share a WGP's LDS, so one wave-iteration may take 4 x its bytes / rate.
    lds = lp.lds * 16 * WAVE_SIZE * SIMDS_PER_WGP / LDS_BYTES_PER_CLK_PER_WGP
    l2 = lp.global_load * 16 * WAVE_SIZE * 2 / L2_BYTES_PER_CLK_PER_CU  # 2 SIMDs per CU
    per_iter = max(simd, lds, l2)
    bound = {
        simd: "SIMD issue" if simd == issue else ("transcendental" if simd == trans else "latency"),
        lds: "LDS",
        l2: "L2",
    }[per_iter]
    sq_pad = -(-s // queries_per_group) * queries_per_group
    granule = compute_queries or queries_per_group
    sq_compute = -(-s // granule) * granule
    skv_pad = -(-s // kv_tile) * kv_tile
    wmmas = b * h * sq_compute * skv_pad * d * 4 / WMMA_OPS  # QK^T and PV, 2 ops per MAC
    wave_iters = wmmas / lp.wmma
    simds = gpu.cus * 2
    # rounds: each SIMD holds w waves; a group of n waves spans the WGP's 4 SIMDs
    waves_per_group = -(-k.max_threads // WAVE_SIZE)
    groups = b * h * (sq_pad // queries_per_group)
    slots = (gpu.cus // 2) * (SIMDS_PER_WGP * w // waves_per_group)
    rounds = -(-groups // max(slots, 1))
    iters_per_group_wave = wave_iters / groups / waves_per_group
    # A full round keeps w waves on every SIMD, each doing its iterations at per_iter clocks;
    # a partial last round is charged as a full one (its SIMDs still wait for the slowest).
    per_round = w * iters_per_group_wave * per_iter
    seconds = rounds * per_round / gpu.clock_hz
    # DRAM floor: Q (int8) and O (BF16) once, K (int8) and V (fp8) once per head (L2 reuse
    # across the head's workgroups, which run together), scales negligible.
    dram = b * h * (sq_pad * d * 3 + skv_pad * d * 2) / gpu.dram_bytes_s
    seconds = max(seconds, dram)
    flops = 4.0 * b * h * s * s * d
    return Prediction(
        gpu.name,
        (b, h, s, d),
        w,
        queries_per_group,
        rescale_executed,
        issue,
        trans,
        stall,
        simd,
        lds,
        l2,
        bound,
        wave_iters / simds,
        dram,
        seconds,
        flops / seconds / 1e12,
        gpu.dense_8bit_ops / 1e12,
    )


def format_prediction(name: str, pr: Prediction) -> str:
    b, h, s, d = pr.shape
    return (
        f"  {name}: PREDICTION for {pr.gpu}, B={b} H={h} S={s} D={d}, rescale "
        f"{'executed' if pr.rescale_executed else 'skipped'} every tile\n"
        f"    per wave-iteration: issue {pr.issue_clocks:.0f} clk (trans unit "
        f"{pr.trans_clocks:.0f}, exposed waits {pr.stall_clocks:.0f} over "
        f"{pr.waves_per_simd} waves) -> SIMD {pr.simd_clocks:.0f}, LDS {pr.lds_clocks:.0f}, "
        f"L2 {pr.l2_clocks:.0f} clk; bound: {pr.bound}\n"
        f"    {pr.seconds * 1e3:.2f} ms (DRAM floor {pr.dram_seconds * 1e3:.2f} ms) -> "
        f"{pr.tflops:.0f} TFLOPS of a {pr.roof_tflops:.0f} TOPS roof "
        f"({100 * pr.tflops / pr.roof_tflops:.0f} %)"
    )


def report(arch: str, sos: Optional[list] = None) -> dict:
    """{module .so path: [KernelReport]}, building the modules when `sos` is not given."""
    if sos:
        return {Path(s): analyze_so(Path(s), arch) for s in sos}
    return {so: analyze_so(so, arch) for so in build_modules(arch).values()}


def format_report(arch: str, results: dict) -> str:
    out = [f"ISA report for {arch}"]
    for so, kernels in results.items():
        out.append(f"\n{Path(so).name}")
        for k in kernels:
            out.append(f"  {k.name}")
            out.append(
                f"    VGPRs {k.vgprs}  SGPRs {k.sgprs}  LDS {k.lds_bytes} B  scratch "
                f"{k.scratch_bytes} B  spills v{k.vgpr_spills}/s{k.sgpr_spills}  "
                f"workgroup {k.max_threads} threads"
            )
            out.append(
                f"    waves/SIMD {k.waves_per_simd} (VGPR limit {k.waves_vgpr}, LDS limit "
                f"{k.waves_lds}, hw max {MAX_WAVES_PER_SIMD})"
            )
            lp = k.loop
            if lp is None:
                out.append("    main loop: none with WMMA")
                continue
            out.append(
                f"    main loop 0x{lp.start:x}-0x{lp.end:x}: {lp.instructions} instructions: "
                f"iu8 WMMA {lp.wmma_iu8}, fp8 WMMA {lp.wmma_fp8}, f16 WMMA {lp.wmma_f16}, "
                f"bf16 WMMA {lp.wmma_bf16}, "
                f"VALU {lp.valu}, "
                f"transcendental {lp.trans}, LDS {lp.lds}, global loads "
                f"{lp.global_load}, global stores {lp.global_store}, s_wait* "
                f"{lp.waitcnt}, barriers {lp.barrier}, SALU/other {lp.salu}, "
                f"scratch {lp.scratch}"
            )
            out.append(
                f"    VOPD (dual-issue) {lp.vopd}, s_delay_alu {lp.delay_alu}, skippable "
                f"rescale VALU {lp.rescale_valu}"
            )
            out.append(
                f"    estimated WMMA share of vector issue cycles: "
                f"{100 * lp.wmma_cycle_share():.1f}% with the rescale executed, "
                f"{100 * lp.wmma_cycle_share(skip_rescale=True):.1f}% skipped "
                f"(8 clk per 8-bit WMMA, 16 per 16-bit, 1 per other)"
            )
    return "\n".join(out)


def print_calibrated(args, results: dict) -> int:
    """The calibrated model's prediction (one `predicted_tflops: X` line, then its breakdown)
    for one kernel of `results`."""
    from . import perf_model

    b, h, s, d = (int(x) for x in args.shape.split(","))
    kernels = [k for ks in results.values() for k in ks if k.loop is not None and k.loop.wmma]
    if args.kernel:
        kernels = [k for k in kernels if k.name == args.kernel]
    if not kernels:
        print("no kernel with a WMMA main loop to model", file=sys.stderr)
        return 2
    gpu = perf_model.GPUS[args.model or "r9700"]
    pr = perf_model.predict(
        perf_model.Kernel.from_report(kernels[0]),
        gpu,
        perf_model.Shape(b, h, s, d, args.causal),
        args.queries_per_group,
        rescale=args.rescale,
    )
    print(pr.line())
    print(pr.breakdown())
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="gfx1201", choices=("gfx1201", "gfx1200"))
    ap.add_argument(
        "--so",
        action="append",
        help="module .so to analyze (repeatable); "
        "default: the csrc/gfx12 modules, built by the JIT",
    )
    ap.add_argument(
        "--model",
        choices=sorted(GPUS),
        help="also print the performance "
        "model's PREDICTION for this GPU (B=1, H=24, S=16384, D=128)",
    )
    ap.add_argument(
        "--source",
        action="append",
        default=[],
        help="a HIP source to compile "
        "for --arch with the gfx12 toolchain flags and analyze (repeatable)",
    )
    ap.add_argument(
        "--code-object",
        action="append",
        default=[],
        help="an amdgcn code object (ELF) to analyze (repeatable)",
    )
    ap.add_argument("--include", action="append", default=[], help="include dir for --source")
    ap.add_argument(
        "--queries-per-group",
        type=int,
        default=128,
        help="queries one workgroup owns, for the model of a foreign kernel (ours: 128)",
    )
    ap.add_argument(
        "--compute-queries",
        type=int,
        default=None,
        help="query granule that does matrix work (ours: 32, a query-less wave skips its "
        "WMMAs; default for --source/--code-object: --queries-per-group)",
    )
    ap.add_argument("--seq", type=int, default=16384, help="S for the model")
    ap.add_argument(
        "--shape",
        help="B,H,S,D: print the calibrated model's `predicted_tflops: X` and its breakdown "
        "(aiter_sage/perf_model.py) instead of the ISA report",
    )
    ap.add_argument("--causal", action="store_true", help="with --shape: causal attention")
    ap.add_argument(
        "--kernel", help="with --shape: the kernel to model (default: the first with a WMMA loop)"
    )
    ap.add_argument(
        "--rescale",
        choices=("always", "iid", "never"),
        default="always",
        help="with --shape: how often the loop's skippable rescale branch runs (iid: for "
        "independent random scores)",
    )
    ap.add_argument(
        "--rocm-codegen",
        action="store_true",
        help="--source: lower clang-19's bitcode with ROCm 7.2's AMDGPU backend "
        "(rocm-llvm-python; the calibration's toolchain)",
    )
    args = ap.parse_args(argv)
    missing = [
        t
        for t in ("llvm-objcopy", "llvm-objdump", "llvm-readelf", "clang-offload-bundler")
        if not tool(t)
    ]
    if missing:
        print(
            f"missing LLVM tools: {', '.join(missing)} (apt install clang-19 llvm-19)",
            file=sys.stderr,
        )
        return 2
    foreign = bool(args.source or args.code_object)
    compute_queries = args.compute_queries or (args.queries_per_group if foreign else 32)
    if foreign:
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for src in args.source:
                co = compile_source(
                    Path(src), args.arch, Path(tmp), args.include, args.rocm_codegen
                )
                results[Path(src)] = analyze_code_object(co, args.arch)
            for co in args.code_object:
                results[Path(co)] = analyze_code_object(Path(co), args.arch)
    else:
        results = report(args.arch, args.so)
    if args.shape:
        return print_calibrated(args, results)
    print(format_report(args.arch, results))
    if args.model:
        print(f"\nPerformance model ({args.model}): a PREDICTION from the ISA, not a measurement")
        for kernels in results.values():
            for k in kernels:
                if k.loop is None or k.loop.wmma == 0:
                    continue
                # our kernels name their head dim (_d64); a foreign kernel is taken as D = 128
                d = 64 if "_d64" in k.name else 128
                for rescale in (True, False):
                    pr = predict(
                        k,
                        GPUS[args.model],
                        s=args.seq,
                        d=d,
                        queries_per_group=args.queries_per_group,
                        compute_queries=compute_queries,
                        rescale_executed=rescale,
                    )
                    print(format_prediction(k.name, pr))
                tail = (
                    predict(
                        k,
                        GPUS[args.model],
                        s=513,
                        d=d,
                        h=24 * 32,
                        queries_per_group=args.queries_per_group,
                        compute_queries=compute_queries,
                    ).seconds
                    / predict(
                        k,
                        GPUS[args.model],
                        s=512,
                        d=d,
                        h=24 * 32,
                        queries_per_group=args.queries_per_group,
                        compute_queries=compute_queries,
                    ).seconds
                )
                print(f"    tail: S=513 costs {tail:.2f}x S=512 (H=768, so rounds are full)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
