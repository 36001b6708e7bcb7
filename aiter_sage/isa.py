"""ISA report for the gfx12 kernel modules.

    python -m aiter_sage.isa --arch gfx1201 [--so PATH ...]

Without ``--so`` it builds csrc/gfx12/{prepare,attention}.hip for ``--arch`` through the JIT
driver (hipcc, else clang++ --offload-arch; cached like a first call's build). It then extracts the code object for ``--arch`` from each module's fat binary,
reads the kernel metadata and disassembles it, and prints per kernel: VGPRs, SGPRs, LDS bytes,
scratch bytes, estimated waves per SIMD, and the instruction mix of the main loop (the innermost
backward branch whose body contains WMMAs).

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
import os
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


def build_modules(arch: str) -> dict:
    """{module name: .so} of the gfx12 kernel modules for `arch`, built (or taken from the
    cache) by the JIT driver exactly as a first call on that GPU would build them."""
    table = jit_driver.module_table()
    return {name: jit_driver.ensure_module(name, arch) for name in table.KERNEL_MODULES}


def _has_section(so: Path, section: str) -> bool:
    out = subprocess.run([tool("llvm-readelf"), "-S", "-W", str(so)], check=True,
                         capture_output=True, text=True).stdout
    return section in out.split()


def extract_code_object(so: Path, arch: str, work: Path) -> Path:
    """The amdgcn ELF for `arch` from a module .so: a hipcc/clang build carries a clang bundle
    in .hip_fatbin, a hiprtc build (aiter_sage/hiprtc.py) the code object itself in
    .sage_code_object."""
    if _has_section(so, ".sage_code_object"):
        co = work / f"{so.stem}.{arch}.co"
        subprocess.run([tool("llvm-objcopy"), f"--dump-section=.sage_code_object={co}", str(so),
                        str(work / f"{so.stem}.stripped")], check=True, capture_output=True)
        return co
    fatbin = work / f"{so.stem}.fatbin"
    subprocess.run([tool("llvm-objcopy"), f"--dump-section=.hip_fatbin={fatbin}", str(so),
                    str(work / f"{so.stem}.stripped")], check=True, capture_output=True)
    listing = subprocess.run([tool("clang-offload-bundler"), "--list", "--type=o",
                              f"--input={fatbin}"], check=True, capture_output=True, text=True)
    targets = [t for t in listing.stdout.split() if t.endswith(f"--{arch}")]
    if not targets:
        raise RuntimeError(f"{so}: no code object for {arch} (bundle has {listing.stdout.split()})")
    co = work / f"{so.stem}.{arch}.co"
    subprocess.run([tool("clang-offload-bundler"), "--unbundle", "--type=o",
                    f"--input={fatbin}", f"--targets={targets[0]}", f"--output={co}"],
                   check=True, capture_output=True)
    return co


@dataclasses.dataclass
class LoopMix:
    start: int
    end: int
    instructions: int = 0
    wmma_iu8: int = 0
    wmma_fp8: int = 0
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

    @property
    def wmma(self) -> int:
        return self.wmma_iu8 + self.wmma_fp8 + self.wmma_other

    def wmma_cycle_share(self, wmma_cycles: int = 8) -> float:
        """Share of the SIMD's vector issue cycles spent in WMMA, assuming a 16x16x16 8-bit
        WMMA occupies the SIMD `wmma_cycles` clocks (2048 8-bit ops/clk/CU, 2 SIMDs per CU:
        8192 ops / 1024 per clock) and every other vector instruction one clock."""
        vec = self.valu + self.trans
        busy = self.wmma * wmma_cycles
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
    notes = subprocess.run([tool("llvm-readelf"), "--notes", str(co)], check=True,
                           capture_output=True, text=True).stdout
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
    text = subprocess.run([tool("llvm-objdump"), "-d", f"--mcpu={arch}", str(co)], check=True,
                          capture_output=True, text=True).stdout
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


def classify(mix: LoopMix, mnem: str) -> None:
    mix.instructions += 1
    if mnem.startswith("v_wmma"):
        if "iu8" in mnem:
            mix.wmma_iu8 += 1
        elif "fp8" in mnem or "bf8" in mnem:
            mix.wmma_fp8 += 1
        else:
            mix.wmma_other += 1
    elif mnem.startswith(_TRANS):
        mix.trans += 1
    elif mnem.startswith("v_"):
        mix.valu += 1
    elif mnem.startswith("ds_"):
        mix.lds += 1
    elif mnem.startswith(("global_load", "buffer_load", "flat_load")):
        mix.global_load += 1
    elif mnem.startswith(("global_store", "buffer_store", "flat_store")):
        mix.global_store += 1
    elif mnem.startswith("scratch_"):
        mix.scratch += 1
    elif mnem.startswith(("s_waitcnt", "s_wait_")):  # gfx12 split counters: s_wait_loadcnt, ...
        mix.waitcnt += 1
    elif mnem.startswith("s_barrier"):
        mix.barrier += 1
    elif mnem.startswith("s_"):
        mix.salu += 1


def main_loop(insns: list) -> Optional[LoopMix]:
    """The innermost backward branch whose body [target, branch] contains a WMMA."""
    best = None
    for addr, _, _, tgt in insns:
        if tgt is None or tgt > addr:
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
    return mix


def analyze_so(so: Path, arch: str) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        co = extract_code_object(Path(so), arch, Path(tmp))
        meta = kernel_metadata(co)
        code = disassemble(co, arch)
    reports = []
    for name, md in meta.items():
        vgprs, lds = md.get("vgpr_count", 0), md.get("group_segment_fixed_size", 0)
        threads = md.get("max_flat_workgroup_size", 1024)
        reports.append(KernelReport(
            name=name, vgprs=vgprs, sgprs=md.get("sgpr_count", 0), lds_bytes=lds,
            scratch_bytes=md.get("private_segment_fixed_size", 0),
            vgpr_spills=md.get("vgpr_spill_count", 0), sgpr_spills=md.get("sgpr_spill_count", 0),
            max_threads=threads, waves_vgpr=waves_per_simd_for_vgprs(vgprs),
            waves_lds=waves_per_simd_for_lds(lds, threads),
            loop=main_loop(code.get(name, []))))
    return reports


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
            out.append(f"    VGPRs {k.vgprs}  SGPRs {k.sgprs}  LDS {k.lds_bytes} B  scratch "
                       f"{k.scratch_bytes} B  spills v{k.vgpr_spills}/s{k.sgpr_spills}  "
                       f"workgroup {k.max_threads} threads")
            out.append(f"    waves/SIMD {k.waves_per_simd} (VGPR limit {k.waves_vgpr}, LDS limit "
                       f"{k.waves_lds}, hw max {MAX_WAVES_PER_SIMD})")
            lp = k.loop
            if lp is None:
                out.append("    main loop: none with WMMA")
                continue
            out.append(f"    main loop 0x{lp.start:x}-0x{lp.end:x}: {lp.instructions} instructions: "
                       f"iu8 WMMA {lp.wmma_iu8}, fp8 WMMA {lp.wmma_fp8}, VALU {lp.valu}, "
                       f"transcendental {lp.trans}, LDS {lp.lds}, global loads "
                       f"{lp.global_load}, global stores {lp.global_store}, s_wait* "
                       f"{lp.waitcnt}, barriers {lp.barrier}, SALU/other {lp.salu}, "
                       f"scratch {lp.scratch}")
            out.append(f"    estimated WMMA share of vector issue cycles: "
                       f"{100 * lp.wmma_cycle_share():.0f}% (8 clk per WMMA, 1 per other)")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="gfx1201", choices=("gfx1201", "gfx1200"))
    ap.add_argument("--so", action="append", help="module .so to analyze (repeatable); "
                    "default: the csrc/gfx12 modules, built by the JIT")
    args = ap.parse_args(argv)
    missing = [t for t in ("llvm-objcopy", "llvm-objdump", "llvm-readelf",
                           "clang-offload-bundler") if not tool(t)]
    if missing:
        print(f"missing LLVM tools: {', '.join(missing)} (apt install clang-19 llvm-19)",
              file=sys.stderr)
        return 2
    print(format_report(args.arch, report(args.arch, args.so)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
