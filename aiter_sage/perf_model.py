"""Performance model of gfx12 (RDNA4) attention kernels, calibrated on measured kernels.

A PREDICTION from the code object, not a measurement. It reads what ``aiter_sage.isa`` reads
(the main loop's instruction mix, VGPRs, LDS, scratch, the workgroup size from the kernel's
metadata) and charges, per loop iteration of one wave, in SIMD clocks:

  busy  = 16 per 16-bit WMMA + 8 per 8-bit WMMA + 1 per VALU (a VOPD pair is one)
          + TRANS_CLOCKS per transcendental
  vmem  = A_VMEM per vector-memory instruction (global loads/stores and scratch: spills are
          vector memory) + its bytes at VMEM_BYTES_PER_CLK
  lds   = A_LDS per LDS instruction + its bytes at LDS_BYTES_PER_CLK
  lat   = L_VMEM per wait on vector memory + L_LDS per wait on LDS + L_BARRIER per barrier
          instruction of a multi-wave workgroup + DELAY_ALU_CLOCKS per s_delay_alu

and a wave-iteration takes max(busy, vmem, lds, (busy + lat) / w), where w is the number of
waves the SIMD interleaves: the occupancy (VGPRs, LDS), or fewer when the grid does not fill
the GPU. Workgroups run in rounds of SIMDs x occupancy waves; a launch costs LAUNCH_SECONDS.
Floors: K/V through L2 once per CU's resident workgroups of a head (the L1 reuse), and DRAM
once per head.

A_VMEM, A_LDS, L_VMEM, L_LDS and L_BARRIER are fitted (``fit``) on carlushuang/gcnasm's
opus_attn_gfx1201 v0-v11, measured on an RX 9070 XT, with a held-out protocol
(op_benchmarks/hip/calibrate_model.py; data in op_tests/data/opus_attn_gfx1201.json). The
fitted kernels use 16-bit WMMA at 15-25 % of the WMMA peak: predictions for 8-bit WMMA kernels
near the peak extrapolate the WMMA rate from the vendor's figure (2048 ops/clk/CU), which no
measurement here covers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

# ---------------------------------------------------------------------------------------------
# The GPUs: vendor figures and measurements side by side.
# ---------------------------------------------------------------------------------------------
WAVE_SIZE = 32
SIMDS_PER_CU = 2
FLOPS_16BIT_PER_CLK_PER_CU = 1024  # vendor: FP16/BF16 matrix (AMD RDNA4 ISA / product pages)
FLOPS_8BIT_PER_CLK_PER_CU = 2048  # vendor: INT8/FP8 matrix
WMMA_FLOPS = 2 * 16 * 16 * 16  # one 16x16x16 WMMA


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU. `vendor_*` are AMD's published figures; `measured_*` are measurements on that
    board (None: none published); `clock_hz` is the clock the model runs at."""

    key: str
    name: str
    cus: int
    vendor_boost_hz: float
    vendor_16bit_tflops: float  # dense matrix FP16/BF16
    vendor_8bit_tops: float  # dense matrix INT8/FP8
    vendor_dram_gbs: float
    measured_16bit_tflops: Optional[float]
    measured_exp2_per_s: Optional[float]
    source: str

    @property
    def simds(self) -> int:
        return self.cus * SIMDS_PER_CU

    @property
    def clock_hz(self) -> float:
        """The clock the WMMA unit ran at: from the measured 16-bit WMMA rate where there is
        one (the RX 9070 XT's ubench: 200 TFLOPS at 1024 flops/clk/CU = 3.05 GHz, above the
        2.97 GHz boost figure), else the vendor boost scaled by the same measured/vendor ratio
        (an assumption: same die, same boost behaviour)."""
        if self.measured_16bit_tflops:
            return self.measured_16bit_tflops * 1e12 / (self.cus * FLOPS_16BIT_PER_CLK_PER_CU)
        return self.vendor_boost_hz * (RX9070XT.clock_hz / RX9070XT.vendor_boost_hz)

    @property
    def peak_16bit_tflops(self) -> float:
        return self.cus * FLOPS_16BIT_PER_CLK_PER_CU * self.clock_hz / 1e12

    @property
    def peak_8bit_tops(self) -> float:
        return self.cus * FLOPS_8BIT_PER_CLK_PER_CU * self.clock_hz / 1e12


RX9070XT = Gpu(
    key="rx9070xt",
    name="Radeon RX 9070 XT",
    cus=64,
    vendor_boost_hz=2.97e9,
    vendor_16bit_tflops=194.6,
    vendor_8bit_tops=389.0,
    vendor_dram_gbs=640.0,
    measured_16bit_tflops=200.0,
    measured_exp2_per_s=3.28e12,
    source="vendor: AMD RX 9070 XT specifications (64 CUs, 2970 MHz boost, 194.6 TFLOPS FP16 "
    "and 389 TOPS INT8 dense matrix, 256-bit GDDR6 20 Gbps = 640 GB/s); measured: "
    "carlushuang/gcnasm opus_attn_gfx1201 README (ubench: 16-bit WMMA 200 TFLOPS, v_exp2_f32 "
    "3.28 T/s, 1 exp per WMMA takes the WMMA rate 200 -> 164 TFLOPS)",
)
R9700 = Gpu(
    key="r9700",
    name="Radeon AI PRO R9700",
    cus=64,
    vendor_boost_hz=2.92e9,
    vendor_16bit_tflops=191.0,
    vendor_8bit_tops=383.0,
    vendor_dram_gbs=640.0,
    measured_16bit_tflops=None,
    measured_exp2_per_s=None,
    source="vendor: AMD Radeon AI PRO R9700 specifications (64 CUs, 2920 MHz boost, 191 "
    "TFLOPS FP16 and 383 TOPS INT8/FP8 dense matrix, 640 GB/s); no published measurement: "
    "clock scaled from the RX 9070 XT's measured/vendor ratio",
)
GPUS = {g.key: g for g in (RX9070XT, R9700)}

# ---------------------------------------------------------------------------------------------
# Fixed (sourced) costs and the fitted ones.
# ---------------------------------------------------------------------------------------------
WMMA16_CLOCKS = 16  # 8192 flops / (1024 / 2 SIMDs) per clock
WMMA8_CLOCKS = 8  # 8192 flops / (2048 / 2 SIMDs) per clock (vendor rate, not measured)
# One v_exp_f32 beside a WMMA: ubench's interleave took the 16-bit WMMA rate from 200 to
# 164 TFLOPS at one exp per WMMA = 16 * (200 / 164 - 1) = 3.5 clocks of the SIMD per exp.
TRANS_CLOCKS = 16 * (200 / 164 - 1)
DELAY_ALU_CLOCKS = 4  # s_delay_alu: a VALU dependency (typical RDNA latency, an assumption)
# Bandwidths per SIMD (a CU's 2 SIMDs share them): LDS 128 B/clk per CU (64 banks x 4 B per
# WGP of 2 CUs, RDNA4 ISA guide), vector memory 64 B/clk per CU (RDNA whitepaper, L0 vector
# cache line per clock; an assumption for RDNA4).
LDS_BYTES_PER_CLK = 128 / SIMDS_PER_CU
VMEM_BYTES_PER_CLK = 64 / SIMDS_PER_CU
LAUNCH_SECONDS = 5e-6  # kernel launch and ramp (an assumption, typical of HIP launches)
# L2 -> CU bandwidth: 16 channels x 64 B/clk for the 256-bit GDDR6 interface (an assumption
# after the RDNA whitepapers' 64 B/clk L2 channel; AMD gives no RDNA4 figure).
L2_BYTES_PER_CLK = 16 * 64


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The fitted costs (SIMD clocks): per vector-memory instruction, per LDS instruction,
    latency per vector-memory wait, per LDS wait, per barrier instruction."""

    a_vmem: float
    a_lds: float
    l_vmem: float
    l_lds: float
    l_barrier: float

    @classmethod
    def from_vector(cls, x: Sequence[float]) -> "Calibration":
        return cls(*[float(v) for v in x])

    def vector(self) -> list:
        return [self.a_vmem, self.a_lds, self.l_vmem, self.l_lds, self.l_barrier]


# Final fit on all of opus_attn_gfx1201 v0-v11 x 3 shapes (ROCm 7.2 backend statistics), from
# `python3 op_benchmarks/hip/calibrate_model.py`; op_tests/backends/test_perf_model.py refits the
# committed data and checks these. HELD_OUT_ERROR: median |error| on the held-out versions
# when fitted without them, the band quoted with every prediction.
CALIBRATED = Calibration(a_vmem=11.0, a_lds=8.8, l_vmem=178.6, l_lds=69.1, l_barrier=306.8)
HELD_OUT_ERROR = 0.19


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Kernel:
    """What the model needs of one kernel: its occupancy, workgroup size and main loop (a
    KernelReport from aiter_sage.isa, or the record of one in the calibration data)."""

    name: str
    vgprs: int
    waves_per_simd: int
    threads: int
    loop: dict  # aiter_sage.isa.LoopMix fields

    @classmethod
    def from_report(cls, k) -> "Kernel":
        return cls(k.name, k.vgprs, k.waves_per_simd, k.max_threads, dataclasses.asdict(k.loop))

    @property
    def waves_per_group(self) -> int:
        return -(-self.threads // WAVE_SIZE)


@dataclasses.dataclass(frozen=True)
class Shape:
    b: int
    h: int
    s: int
    d: int
    causal: bool = False

    @property
    def flops(self) -> float:
        """4 B H S^2 D, halved when causal (the FLOPs a causal kernel need do)."""
        full = 4.0 * self.b * self.h * self.s * self.s * self.d
        return full / 2 if self.causal else full


@dataclasses.dataclass
class Prediction:
    gpu: str
    kernel: str
    shape: Shape
    busy: float  # SIMD clocks per wave-iteration, by part
    vmem: float
    lds: float
    latency: float
    waves: float  # waves the SIMD interleaves
    per_iteration: float
    bound: str
    keys_per_iteration: float
    seconds: float
    l2_floor_seconds: float
    tflops: float
    band: float

    def line(self) -> str:
        return f"predicted_tflops: {self.tflops:.1f}"

    def breakdown(self) -> str:
        s = self.shape
        return (
            f"  PREDICTION for {self.gpu}: {self.kernel}, B={s.b} H={s.h} S={s.s} D={s.d}"
            f"{' causal' if s.causal else ''}; band +-{100 * self.band:.0f} % (median held-out "
            f"error of the calibration)\n"
            f"  per wave-iteration ({self.keys_per_iteration:.0f} keys): busy {self.busy:.0f} clk, "
            f"vector memory {self.vmem:.0f}, LDS {self.lds:.0f}, exposed latency "
            f"{self.latency:.0f} over {self.waves:.1f} waves -> {self.per_iteration:.0f} clk; "
            f"bound: {self.bound}\n"
            f"  {self.seconds * 1e3:.3f} ms (K/V L2/DRAM floor "
            f"{self.l2_floor_seconds * 1e3:.3f} ms) -> "
            f"{self.tflops:.1f} TFLOPS ({self.tflops * (1 - self.band):.0f}-"
            f"{self.tflops * (1 + self.band):.0f})"
        )


def loop_costs(
    loop: dict, cal: Calibration, multi_wave: bool, rescale_fraction: float = 1.0
) -> tuple:
    """(busy, vmem, lds, latency) SIMD clocks of one wave-iteration of `loop`, its skippable
    rescale branch (isa.LoopMix.rescale_valu) executed in `rescale_fraction` of them."""
    w16 = loop.get("wmma_f16", 0) + loop.get("wmma_bf16", 0)
    w8 = loop.get("wmma_iu8", 0) + loop.get("wmma_fp8", 0) + loop.get("wmma_other", 0)
    valu = loop["valu"] - (1.0 - rescale_fraction) * loop.get("rescale_valu", 0)
    busy = w16 * WMMA16_CLOCKS + w8 * WMMA8_CLOCKS + valu + loop["trans"] * TRANS_CLOCKS
    vm_ops = loop["global_load"] + loop["global_store"] + loop["scratch"]
    vm_bytes = WAVE_SIZE * (loop["vmem_bytes"] + loop["scratch_bytes"])
    vmem = cal.a_vmem * vm_ops + vm_bytes / VMEM_BYTES_PER_CLK
    lds = cal.a_lds * loop["lds"] + WAVE_SIZE * loop["lds_bytes"] / LDS_BYTES_PER_CLK
    latency = (
        cal.l_vmem * loop["wait_vmem"]
        + cal.l_lds * loop["wait_lds"]
        + (cal.l_barrier * loop["barrier"] if multi_wave else 0.0)
        + DELAY_ALU_CLOCKS * loop["delay_alu"]
    )
    return busy, vmem, lds, latency


def iid_rescale_fraction(keys: int, keys_per_tile: int, queries_per_wave: int) -> float:
    """Share of key tiles in which some query of a wave raises its running max, for scores
    independent and identically distributed (the random inputs of the accuracy tests; real
    attention's structure can differ): tile t holds the max of its first (t + 1) tiles with
    probability 1 / (t + 1) per query, so some of the wave's queries with 1 - (1 - 1/(t+1))^q."""
    tiles = max(1, -(-keys // keys_per_tile))
    q = max(1, round(queries_per_wave))
    return sum(1.0 - (1.0 - 1.0 / (t + 1)) ** q for t in range(tiles)) / tiles


def wmma_flops_per_iteration(loop: dict) -> int:
    w = sum(loop.get(f, 0) for f in ("wmma_iu8", "wmma_fp8", "wmma_f16", "wmma_bf16", "wmma_other"))
    return w * WMMA_FLOPS


def predict(
    k: Kernel,
    gpu: Gpu,
    shape: Shape,
    queries_per_group: int,
    cal: Calibration = CALIBRATED,
    band: float = HELD_OUT_ERROR,
    rescale: str = "always",
) -> Prediction:
    """Time and TFLOPS of `k` on `gpu` for `shape`, each workgroup owning `queries_per_group`
    queries (its waves split them evenly). `rescale`: how often a loop's skippable rescale
    branch runs: "always" (the bound the tables quote), "iid" (iid_rescale_fraction) or
    "never"."""
    if wmma_flops_per_iteration(k.loop) == 0:
        raise ValueError(f"{k.name}: no WMMA main loop to model")
    wpg = k.waves_per_group
    queries_per_wave = queries_per_group / wpg
    # the loop's WMMA flops cover queries_per_wave x keys x 4 D (Q.K^T and P.V)
    keys = wmma_flops_per_iteration(k.loop) / (4 * shape.d * queries_per_wave)
    groups_per_head = -(-shape.s // queries_per_group)
    if shape.causal:  # group g sees keys [0, (g + 1) q): the mean over the groups
        mean_keys = (groups_per_head + 1) / 2 * queries_per_group
        iterations = -(-min(mean_keys, shape.s) // keys)
    else:
        iterations = -(-shape.s // keys)
    waves = shape.b * shape.h * groups_per_head * wpg
    occupancy = max(k.waves_per_simd, 1)
    slots = gpu.simds * occupancy
    w = min(occupancy, waves / gpu.simds)
    if rescale == "iid":
        fraction = iid_rescale_fraction(round(iterations * keys), round(keys), queries_per_wave)
    else:
        fraction = {"always": 1.0, "never": 0.0}[rescale]
    busy, vmem, lds, latency = loop_costs(k.loop, cal, wpg > 1, fraction)
    parts = {"SIMD issue": busy, "vector memory": vmem, "LDS": lds, "latency": (busy + latency) / w}
    bound = max(parts, key=parts.get)
    per_iteration = parts[bound]
    if waves > slots:  # full rounds of `occupancy` waves per SIMD, the last one charged whole
        seconds = math.ceil(waves / slots) * occupancy * iterations * per_iteration
    else:
        seconds = w * iterations * per_iteration
    seconds = seconds / gpu.clock_hz + LAUNCH_SECONDS
    l2_floor = l2_floor_seconds(k, gpu, shape, groups_per_head, iterations * keys)
    seconds = max(seconds, l2_floor)
    return Prediction(
        gpu.name,
        k.name,
        shape,
        busy,
        vmem,
        lds,
        latency,
        w,
        per_iteration,
        bound,
        keys,
        seconds,
        l2_floor,
        shape.flops / seconds / 1e12,
        band,
    )


def kv_traffic(k: Kernel, shape: Shape, groups_per_head: int, keys: float) -> tuple:
    """(L2 bytes, DRAM bytes) of K/V. Every workgroup streams `keys` keys of its head's K and V
    (1 byte per element under 8-bit WMMA, else 2). The workgroups of one head resident on one
    CU share those lines in the CU's vector cache (the L1 reuse that opus_attn_gfx1201's notes
    found: its one-wave groups' redundant reads never reached L2), so L2 serves each CU's share
    once; DRAM serves each head once (Q, O and K/V of a head fit the 8 MB L2 / 64 MB Infinity
    Cache while its groups run)."""
    lp = k.loop
    k_bytes = 1 if lp.get("wmma_iu8", 0) else 2
    v_bytes = 1 if lp.get("wmma_fp8", 0) else 2
    groups = shape.b * shape.h * groups_per_head
    groups_per_cu = max(1, k.waves_per_simd * SIMDS_PER_CU // k.waves_per_group)
    reuse = min(groups_per_cu, groups_per_head)
    l2_bytes = groups * keys * shape.d * (k_bytes + v_bytes) / reuse
    dram_bytes = shape.b * shape.h * shape.s * shape.d * (k_bytes + v_bytes + 2 + 2)
    return l2_bytes, dram_bytes


def l2_floor_seconds(k: Kernel, gpu: Gpu, shape: Shape, groups_per_head: int, keys: float) -> float:
    """The K/V floor: kv_traffic at L2_BYTES_PER_CLK and at the vendor DRAM rate, the larger."""
    l2_bytes, dram_bytes = kv_traffic(k, shape, groups_per_head, keys)
    return max(
        l2_bytes / (L2_BYTES_PER_CLK * gpu.clock_hz), dram_bytes / (gpu.vendor_dram_gbs * 1e9)
    )


def memory_bound_seconds(bytes_moved: float, gpu: Gpu) -> float:
    """A memory-bound kernel (prepare) at the vendor DRAM rate: a floor, not a fit."""
    return bytes_moved / (gpu.vendor_dram_gbs * 1e9) + LAUNCH_SECONDS


# ---------------------------------------------------------------------------------------------
# Calibration: fit the five costs on measured points (log error, Nelder-Mead in log space)
# ---------------------------------------------------------------------------------------------
INITIAL = Calibration(a_vmem=4.0, a_lds=2.0, l_vmem=50.0, l_lds=30.0, l_barrier=100.0)


@dataclasses.dataclass(frozen=True)
class Point:
    kernel: Kernel
    shape: Shape
    queries_per_group: int
    measured_tflops: float
    label: str


def log_loss(cal: Calibration, points: Sequence[Point], gpu: Gpu) -> float:
    return sum(
        math.log(
            predict(p.kernel, gpu, p.shape, p.queries_per_group, cal).tflops / p.measured_tflops
        )
        ** 2
        for p in points
    )


def _nelder_mead(f, x0: list, step: float = 0.7, iterations: int = 2000) -> tuple:
    n = len(x0)
    simplex = [list(x0)] + [
        [x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)
    ]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        centre = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]

        def towards(t, centre=centre, worst=worst):
            return [c + t * (c - w) for c, w in zip(centre, worst)]

        xr = towards(1.0)
        fr = f(xr)
        if fr < values[0]:
            xe = towards(2.0)
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = towards(-0.5)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:  # shrink towards the best
                best = simplex[0]
                simplex = [best] + [
                    [b + 0.5 * (x - b) for b, x in zip(best, s)] for s in simplex[1:]
                ]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    i = min(range(n + 1), key=values.__getitem__)
    return simplex[i], values[i]


# Deterministic restarts (offsets in log space) so that a refit gives the same numbers.
RESTARTS = (
    (0, 0, 0, 0, 0),
    (0.5, -0.5, 0.5, -0.5, 0.5),
    (-0.5, 0.5, 1.0, 0.5, -0.5),
    (1, 1, 1, 1, 1),
)


def fit(points: Sequence[Point], gpu: Gpu = RX9070XT) -> Calibration:
    """The calibration minimizing the squared log error of `points` (best of RESTARTS)."""
    base = [math.log(v) for v in INITIAL.vector()]

    def objective(x):
        return log_loss(Calibration.from_vector([math.exp(v) for v in x]), points, gpu)

    best = None
    for offset in RESTARTS:
        x, val = _nelder_mead(objective, [b + o for b, o in zip(base, offset)])
        if best is None or val < best[1]:
            best = (x, val)
    return Calibration.from_vector([math.exp(v) for v in best[0]])


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(xs):
        order = sorted(range(len(xs)), key=xs.__getitem__)
        r = [0.0] * len(xs)
        i = 0
        while i < len(xs):
            j = i
            while j + 1 < len(xs) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for t in range(i, j + 1):
                r[order[t]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(list(a)), ranks(list(b))
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb)
