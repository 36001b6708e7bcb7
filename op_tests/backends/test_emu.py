"""Tests of the gfx12 wave emulator (csrc/emu) through its generic runner (aiter_sage/emu.py).

Run: python -m pytest op_tests/backends/test_emu.py -q   or   python op_tests/backends/test_emu.py

- WMMA lane layouts and numerics against scalar numpy matmuls (all iu8 signedness combos,
  clamp on/off with int32 overflow, fp8 with subnormals / NaN / +-448),
- v_cvt_pk_fp8_f32 model over all 256 codes and the RNE / overflow boundaries, against an
  independent nearest-value search (and torch.float8_e4m3fn where torch agrees),
- cross-lane and math builtins,
- the checks: LDS race, barrier divergence, LDS out of bounds, and a clean probe,
- the probes compile for real gfx1201 and contain the expected WMMA instructions,
- one probe under AddressSanitizer (clean run + a caught global overflow),
- launches that cannot get their lane stacks fail with an error instead of aborting.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from aiter_sage import emu, jit_driver

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import REPO as ROOT
from common import child_json, run_as_script

PROBES = ROOT / "op_tests" / "emu_probes"
WMMA_PROBE = PROBES / "wmma_probe.hip"
CHECKS_PROBE = PROBES / "checks_probe.hip"
HAVE_CLANG = shutil.which("clang++-19") is not None or shutil.which("clang++") is not None


def _skip(reason):
    pytest.skip(reason)


def _module(path):
    if not HAVE_CLANG:
        _skip("clang++ not installed")
    return emu.load_module(path)


# ---------------------------------------------------------------- independent references
def fp8_decode_ref(code: int) -> float:
    """OCP e4m3fn by the spec's formula: (-1)^s * 2^(e-7) * (1 + m/8), subnormal 2^-6 * m/8."""
    code = int(code)
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 7
    if e == 0xF and m == 7:
        return math.nan
    mag = math.ldexp(m / 8.0, -6) if e == 0 else math.ldexp(1.0 + m / 8.0, e - 7)
    return -mag if s else mag


_POS_VALUES = [(fp8_decode_ref(c), c) for c in range(0x7F)] + [(480.0, 0x7F)]  # 480: overflow slot


def fp8_encode_ref(x: float) -> int:
    """Nearest e4m3fn value by exhaustive search, ties to the even code; past 448 -> NaN."""
    x = float(np.float32(x))
    if math.isnan(x) or math.isinf(x):
        return 0x7F | (0x80 if math.copysign(1.0, x) < 0 else 0)
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if a > 480.0:
        return sign | 0x7F
    best = min(_POS_VALUES, key=lambda vc: (abs(vc[0] - a), vc[1] & 1))
    return sign | best[1]


def f32(x):
    return np.float32(x)


def _fp8_matmul_ref(a8, b8, c):
    """Exact products and sums in float64, one rounding to float32 (what the model claims)."""
    dec = np.array([fp8_decode_ref(i) for i in range(256)], dtype=np.float64)
    A, B = dec[a8], dec[b8]
    return (A @ B + c.astype(np.float64)).astype(np.float32)


# ---------------------------------------------------------------- WMMA
IU8_COMBOS = [("ss", True, True), ("su", True, False), ("us", False, True), ("uu", False, False)]


def _run_wmma_iu8(kernel, a, b, c):
    mod = _module(WMMA_PROBE)
    d = np.zeros((16, 16), np.int32)
    res = mod.run(
        kernel, (1, 1, 1), 32, [a.view(np.int8), np.ascontiguousarray(b.T).view(np.int8), c, d]
    )
    assert res.ok, (res.error, res.reports)
    return d


def _iu8_ref(a, b, c, sa, sb, clamp):
    A = a.view(np.int8 if sa else np.uint8).astype(np.int64)
    B = b.view(np.int8 if sb else np.uint8).astype(np.int64)
    s = A @ B + c.astype(np.int64)
    if clamp:
        return np.clip(s, -(2**31), 2**31 - 1).astype(np.int32)
    return (s & 0xFFFFFFFF).astype(np.uint32).view(np.int32)


def test_wmma_iu8_layout_and_signedness():
    rng = np.random.default_rng(1)
    for tag, sa, sb in IU8_COMBOS:
        a = rng.integers(0, 256, (16, 16), dtype=np.uint8)
        b = rng.integers(0, 256, (16, 16), dtype=np.uint8)
        c = rng.integers(-1000, 1000, (16, 16), dtype=np.int32)
        for clamp in (False, True):
            kernel = f"probe_wmma_iu8_{tag}" + ("_clamp" if clamp else "")
            d = _run_wmma_iu8(kernel, a, b, c)
            np.testing.assert_array_equal(d, _iu8_ref(a, b, c, sa, sb, clamp), err_msg=kernel)
    # the default entry point is signed x signed without clamp
    d = _run_wmma_iu8("probe_wmma_iu8_default", a, b, c)
    np.testing.assert_array_equal(d, _iu8_ref(a, b, c, True, True, False))


def test_wmma_iu8_single_elements_locate_layout():
    # One non-zero A(m,k) and B(k,n) must land exactly at D(m,n): pins every lane mapping.
    for m, k, n in [(0, 0, 0), (15, 15, 15), (3, 9, 12), (8, 7, 1), (12, 8, 4)]:
        a = np.zeros((16, 16), np.uint8)
        b = np.zeros((16, 16), np.uint8)
        a[m, k], b[k, n] = 3, 5
        d = _run_wmma_iu8("probe_wmma_iu8_ss", a, b, np.zeros((16, 16), np.int32))
        expect = np.zeros((16, 16), np.int32)
        expect[m, n] = 15
        np.testing.assert_array_equal(d, expect, err_msg=f"A[{m},{k}] B[{k},{n}]")


def test_wmma_iu8_overflow_wraps_or_saturates():
    # C within 50000 of the int32 limits plus random products (|sum| up to 16*255*255): the
    # exact result leaves int32 in many places; clamp saturates there, no clamp wraps.
    rng = np.random.default_rng(5)
    for tag, sa, sb in IU8_COMBOS:
        a = rng.integers(0, 256, (16, 16), dtype=np.uint8)
        b = rng.integers(0, 256, (16, 16), dtype=np.uint8)
        near = rng.integers(0, 50000, (16, 16))
        c = np.where(rng.random((16, 16)) < 0.5, 2**31 - 1 - near, -(2**31) + near).astype(np.int32)
        exact = (
            a.view(np.int8 if sa else np.uint8).astype(np.int64)
            @ b.view(np.int8 if sb else np.uint8).astype(np.int64)
            + c
        )
        overflow = (exact > 2**31 - 1) | (exact < -(2**31))
        assert overflow.sum() > 10, tag  # the case really overflows
        for clamp in (False, True):
            kernel = f"probe_wmma_iu8_{tag}" + ("_clamp" if clamp else "")
            d = _run_wmma_iu8(kernel, a, b, c)
            np.testing.assert_array_equal(d, _iu8_ref(a, b, c, sa, sb, clamp), err_msg=kernel)
            if clamp:
                assert (d[exact > 2**31 - 1] == 2**31 - 1).all()
                assert (d[exact < -(2**31)] == -(2**31)).all()
            else:
                np.testing.assert_array_equal(
                    d[overflow], (exact[overflow] & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
                )


def test_wmma_fp8_random_and_specials():
    mod = _module(WMMA_PROBE)
    rng = np.random.default_rng(2)
    finite = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], np.uint8)
    subnormal = np.array([c for c in range(256) if (c & 0x78) == 0], np.uint8)
    for trial in range(4):
        a = rng.choice(finite, (16, 16)).astype(np.uint8)
        b = rng.choice(finite, (16, 16)).astype(np.uint8)
        if trial == 1:  # all-subnormal operands: products of 2^-9 steps
            a = rng.choice(subnormal, (16, 16)).astype(np.uint8)
        if trial == 2:  # +-448 everywhere
            a = rng.choice(np.array([0x7E, 0xFE], np.uint8), (16, 16))
            b = rng.choice(np.array([0x7E, 0xFE, 0x38], np.uint8), (16, 16))
        c = rng.standard_normal((16, 16)).astype(np.float32) * (1000 if trial == 2 else 1)
        d = np.zeros((16, 16), np.float32)
        res = mod.run("probe_wmma_fp8", (1, 1, 1), 32, [a, np.ascontiguousarray(b.T), c, d])
        assert res.ok, res.reports
        np.testing.assert_array_equal(d, _fp8_matmul_ref(a, b, c), err_msg=f"trial {trial}")
    # NaN code in one A element poisons exactly row m of D
    a = rng.choice(finite, (16, 16)).astype(np.uint8)
    b = rng.choice(finite, (16, 16)).astype(np.uint8)
    a[5, 11] = 0xFF
    d = np.zeros((16, 16), np.float32)
    res = mod.run(
        "probe_wmma_fp8",
        (1, 1, 1),
        32,
        [a, np.ascontiguousarray(b.T), np.zeros((16, 16), np.float32), d],
    )
    assert res.ok
    assert np.isnan(d[5]).all() and not np.isnan(np.delete(d, 5, axis=0)).any()


def test_fp8_decode_all_codes_through_wmma():
    # D = A x I: row m of A comes back as f32, so all 256 codes are decoded by the model.
    mod = _module(WMMA_PROBE)
    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    eye = np.zeros((16, 16), np.uint8)
    np.fill_diagonal(eye, 0x38)  # 1.0
    d = np.zeros((16, 16), np.float32)
    res = mod.run(
        "probe_wmma_fp8",
        (1, 1, 1),
        32,
        [codes, np.ascontiguousarray(eye.T), np.zeros((16, 16), np.float32), d],
    )
    assert res.ok
    ref = np.array([fp8_decode_ref(c) for c in range(256)], np.float32).reshape(16, 16)
    # NaN x 0 = NaN: the rows holding 0x7F (row 7) and 0xFF (row 15) come back all NaN.
    nan_rows = np.isnan(ref).any(axis=1)
    assert list(np.nonzero(nan_rows)[0]) == [7, 15] and np.isnan(d[nan_rows]).all()
    ok = ~nan_rows
    np.testing.assert_array_equal(d[ok], ref[ok])
    assert d[7, 14] != d[7, 14] and ref[7, 14] == 448.0  # (row 7 is NaN through code 0x7F)
    # 0x7E / 0xFE (+-448) and the rest of rows 7 / 15 once more, without the NaN column
    codes2 = codes.copy()
    codes2[7, 15], codes2[15, 15] = 0x00, 0x80
    res = mod.run(
        "probe_wmma_fp8",
        (1, 1, 1),
        32,
        [codes2, np.ascontiguousarray(eye.T), np.zeros((16, 16), np.float32), d],
    )
    assert res.ok
    ref2 = np.array([fp8_decode_ref(c) for c in codes2.reshape(-1)], np.float32).reshape(16, 16)
    np.testing.assert_array_equal(d, ref2)
    assert d[7, 14] == 448.0 and d[15, 14] == -448.0 and d[0, 1] == 2.0**-9
    import torch

    tref = torch.from_numpy(codes2.reshape(-1)).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(d.reshape(-1), tref)
    tnan = torch.tensor([0x7F, 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.isnan(tnan).all() and math.isnan(fp8_decode_ref(0x7F))


# ---------------------------------------------------------------- v_cvt_pk_fp8_f32
def _cvt_inputs():
    vals = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        448.0,
        -448.0,
        449.0,
        463.99997,
        464.0,
        464.00003,
        465.0,
        480.0,
        1e6,
        -1e6,
        math.inf,
        -math.inf,
        math.nan,
        2.0**-9,
        2.0**-10,
        2.0**-10 * 1.0000001,
        3 * 2.0**-10,
        5 * 2.0**-11,
        2.0**-6,
        2.0**-6 - 2.0**-10,
        2.0**-6 - 2.0**-11,
        1e-30,
        1.4e-45,
        -(2.0**-10),
        0.0625 * 1.0625,
        1.0 + 1 / 16,
        1.0 + 3 / 16,
        240.0,
        248.0,
        256.0,
    ]
    # every code's value and the exact midpoints (ties) and their float32 neighbours
    pos = sorted(v for v, c in _POS_VALUES if c != 0x7F)
    for v in pos:
        vals += [v, -v]
    for lo, hi in zip(pos, pos[1:] + [480.0]):
        mid = (lo + hi) / 2
        vals += [
            mid,
            -mid,
            float(np.nextafter(f32(mid), f32(0))),
            float(np.nextafter(f32(mid), f32(1e9))),
        ]
    rng = np.random.default_rng(3)
    vals += list(
        (rng.standard_normal(2000) * np.exp2(rng.integers(-12, 10, 2000))).astype(np.float32)
    )
    while len(vals) % 4:
        vals.append(0.0)
    return np.array(vals, np.float32)


def test_cvt_pk_fp8_rne_overflow_nan_and_halves():
    mod = _module(WMMA_PROBE)
    x = _cvt_inputs()
    n = len(x) // 4
    out = np.zeros(2 * n, np.int32)
    res = mod.run("probe_cvt_pk_fp8", ((n + 255) // 256, 1, 1), 256, [x, out, n])
    assert res.ok, res.reports
    words = out.view(np.uint32).reshape(n, 2)
    lo, both = words[:, 0], words[:, 1]
    assert ((lo >> 16) == 0xCAFE).all(), "low-half write must keep the high half of old"
    assert ((both & 0xFFFF) == (lo & 0xFFFF)).all(), "high-half write must keep the low half"
    got = np.stack([lo & 0xFF, (lo >> 8) & 0xFF, (both >> 16) & 0xFF, both >> 24], 1).reshape(-1)
    ref = np.array([fp8_encode_ref(v) for v in x], np.uint32)
    bad = np.nonzero(got != ref)[0]
    assert bad.size == 0, [(float(x[i]), hex(int(got[i])), hex(int(ref[i]))) for i in bad[:10]]
    # spot checks of the documented boundaries
    table = dict(zip(map(float, x), map(int, got)))
    assert table[448.0] == 0x7E and table[464.0] == 0x7E and table[465.0] == 0x7F
    assert table[-1e6] == 0xFF and table[2.0**-10] == 0x00 and table[3 * 2.0**-10] == 0x02
    # torch agrees wherever no overflow is involved (its overflow policy differs by version)
    import torch

    finite = np.abs(x) <= 448
    t = torch.from_numpy(x[finite]).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(got[finite], t)


# ---------------------------------------------------------------- lanes and math
def test_cross_lane_and_math_builtins():
    mod = _module(WMMA_PROBE)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(64) * 4).astype(np.float32)
    out = np.full((64, 8), -7.0, np.float32)
    res = mod.run("probe_lanes", (1, 1, 1), 64, [x, out])
    assert res.ok, res.reports
    for t in range(64):
        lane, w = t % 32, t // 32

        def alive(ln, w=w):
            return not (w == 1 and ln >= 28)

        if not alive(lane):
            assert (out[t] == -7.0).all()
            continue

        def src(ln, w=w):
            return x[32 * w + ln] if alive(ln) else 0.0  # ds_bpermute reads 0 from dead lanes

        assert out[t, 0] == src(lane ^ 1)
        assert out[t, 1] == src(lane ^ 16)
        assert out[t, 2] == (32 * w + (lane ^ 5) if alive(lane ^ 5) else 0)
        assert out[t, 3] == x[32 * w + 3]
        e = np.exp2(np.float64(x[t]))
        assert abs(out[t, 4] - e) <= 2 * abs(float(np.spacing(np.float32(e))))  # v_exp_f32: 1 ulp
        assert out[t, 5] == np.float32(1.0) / x[t]
        assert out[t, 6] == np.sqrt(np.abs(x[t]))
        assert out[t, 7] == max(np.rint(x[t]), min(x[t], np.float32(0.5)))


# ---------------------------------------------------------------- checks
def _run_check(kernel):
    mod = _module(CHECKS_PROBE)
    x = np.arange(100, 164, dtype=np.int32)
    out = np.zeros(64, np.int32)
    args = [x, out] if kernel != "probe_global_oob" else [x, out, 64]
    return mod.run(kernel, (2, 1, 1), 64, args), x, out


def test_clean_probe_reports_nothing():
    res, x, out = _run_check("probe_lds_exchange")
    assert res.rc == 0 and res.reports == []
    np.testing.assert_array_equal(out, x[np.arange(64) ^ 32])
    res, x, out = _run_check("probe_divergence_ok")
    assert res.rc == 0 and res.reports == [], res.reports
    t = np.arange(64)
    keep = t % 32 < 24
    np.testing.assert_array_equal(out[keep], x[(t // 32) * 32][keep])
    assert (out[~keep] == 0).all()


def test_missing_barrier_is_a_race():
    res, _, _ = _run_check("probe_lds_race")
    assert res.rc != 0
    races = [r for r in res.reports if r.startswith("[lds-race]")]
    assert races, res.reports
    assert "probe_lds_race" in races[0] and "LDS byte offset" in races[0]
    assert "wave 0" in races[0] and "wave 1" in races[0]
    assert "sage_emu" in res.error and "probe_lds_race" in res.error  # sage::set_error summary


def test_divergent_barriers_are_reported():
    res, _, _ = _run_check("probe_barrier_exit")
    assert res.rc != 0 and res.kinds() == ["barrier-divergence"], res.reports
    assert "already returned" in res.reports[0]
    res, _, _ = _run_check("probe_barrier_sites")
    assert res.rc != 0 and res.kinds() == ["barrier-divergence"], res.reports
    assert "different barriers" in res.reports[0]


def test_lds_out_of_bounds_is_reported_not_performed():
    res, x, out = _run_check("probe_lds_oob")
    assert res.rc != 0 and res.kinds() == ["lds-out-of-bounds"], res.reports
    assert "'buf'" in res.reports[0] and "256 bytes" in res.reports[0]
    assert out[63] == 0 and (out[:63] == x[:63]).all()  # rejected load reads zero


def test_launch_config_errors():
    mod = _module(CHECKS_PROBE)
    x = np.zeros(64, np.int32)
    res = mod.run("probe_lds_exchange", (1, 1, 1), 128, [x, x])  # max_threads is 64
    assert res.rc != 0 and "max_threads" in res.error
    res = mod.run("probe_lds_exchange", (0, 1, 1), 64, [x, x])
    assert res.rc != 0 and "empty grid" in res.error


def test_attention_shaped_probe_runs_clean():
    # ~64 WMMAs + ~100 other API calls per lane per 64-key tile, S = 512, H = 2, one thread.
    # (Its speed is measured by op_benchmarks, not asserted here.)
    mod = _module(PROBES / "bench_probe.hip")
    rng = np.random.default_rng(6)
    S, H, D = 512, 2, 128
    q8 = rng.integers(-127, 128, (H, S, D), dtype=np.int8)
    k8 = rng.integers(-127, 128, (H, S, D), dtype=np.int8)
    v8 = rng.integers(0, 0x7E, (H, D, S), dtype=np.uint8)
    out = np.zeros((H, S, D), np.float32)
    res = mod.run("bench_attention_like", (S // 64, H, 1), 128, [q8, k8, v8, out, S], threads=1)
    assert res.ok, res.reports
    assert np.isfinite(out).all() and np.abs(out).sum() > 0


# ---------------------------------------------------------------- real gfx1201 compile
def _gfx1201_asm(path):
    try:  # the JIT's own gfx1201 compile, stopped at device assembly
        tc = jit_driver.toolchain_for("gfx1201")
    except jit_driver.CompilerNotFound as e:
        _skip(str(e))
    r = subprocess.run(
        [tc.compiler, *tc.cflags, "--cuda-device-only", "-S", str(path), "-o", "-"],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0 and "hip_runtime.h" in r.stderr:
        _skip("HIP headers not installed (libamdhip64-dev)")
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


def test_probes_compile_for_gfx1201():
    asm = _gfx1201_asm(WMMA_PROBE)
    assert "v_wmma_i32_16x16x16_iu8" in asm
    assert "v_wmma_f32_16x16x16_fp8_fp8" in asm
    assert "v_cvt_pk_fp8_f32" in asm
    for insn in ("ds_bpermute_b32", "v_readlane_b32", "v_exp_f32", "v_rcp_f32"):
        assert insn in asm, insn
    asm = _gfx1201_asm(CHECKS_PROBE)
    assert "s_barrier" in asm and "ds_store" in asm and "ds_load" in asm
    asm = _gfx1201_asm(PROBES / "bench_probe.hip")  # the speed probe: 64 WMMAs, no scratch
    assert asm.count("v_wmma_i32_16x16x16_iu8") >= 32 and asm.count("v_wmma_f32_16x16x16_fp8") >= 32
    assert "ScratchSize: 0" in asm


# ---------------------------------------------------------------- AddressSanitizer
_ASAN_SCRIPT = textwrap.dedent("""
    import sys, types, numpy as np
    pkg = types.ModuleType("aiter_sage")  # the emulator alone: skip torch and the op binding
    pkg.__path__ = [{pkgdir!r}]
    sys.modules["aiter_sage"] = pkg
    from aiter_sage import emu
    mod = emu.load_module({src!r}, sanitize="address")
    x = np.arange(64, dtype=np.int32); out = np.zeros(64, np.int32)
    kernel = sys.argv[1]
    args = [x, out, 64] if kernel == "probe_global_oob" else [x, out]
    res = mod.run(kernel, (4, 1, 1), 64, args, threads=2)
    print("RC", res.rc, res.kinds())
""")


def test_asan_probe():
    if not HAVE_CLANG:
        _skip("clang++ not installed")
    try:
        env = emu.asan_env()
    except emu.EmuError as e:
        _skip(str(e))
    script = _ASAN_SCRIPT.format(pkgdir=str(ROOT / "aiter_sage"), src=str(CHECKS_PROBE))

    def run(kernel):
        return subprocess.run(
            [sys.executable, "-c", script, kernel],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    r = run("probe_divergence_ok")  # fibers, barriers, LDS: must be ASan-clean
    assert r.returncode == 0 and "RC 0 []" in r.stdout, r.stdout + r.stderr[-4000:]
    r = run("probe_lds_race")  # checks work the same under ASan
    assert "lds-race" in r.stdout, r.stdout + r.stderr[-4000:]
    r = run("probe_global_oob")  # global-memory overflow: ASan's job
    assert r.returncode != 0 and "heap-buffer-overflow" in r.stderr, r.stdout + r.stderr[-4000:]
    assert "probe_global_oob" in r.stderr


_PRODUCT_ASAN_SCRIPT = textwrap.dedent("""
    import torch, aiter_sage
    from aiter_sage import ref
    q, k, v = (torch.randn(2, 200, 2, 128).bfloat16() for _ in range(3))
    p = aiter_sage.gfx1201_sage_prepare(q, k, v, backend="emu")
    r = ref.prepare(q, k, v, 128 ** -0.5)
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(p, r))
    out = aiter_sage.gfx1201_sage_attention_fwd(*p, 200, backend="emu")[:, :200]
    assert ref.in_band(ref.accuracy(out, ref.attention_fp32(q, k, v, 128 ** -0.5)))
    print("PRODUCT-OK")
""")


def test_product_modules_under_asan():
    """The shipped gfx12 prepare/attention, built with ASan, run clean on the emulator."""
    if not HAVE_CLANG or not (ROOT / "csrc" / "gfx12" / "attention.hip").exists():
        _skip("clang++ or the gfx12 sources missing")
    try:
        env = emu.asan_env()
    except emu.EmuError as e:
        _skip(str(e))
    env["AITER_SAGE_EMU_ASAN"] = "1"
    r = subprocess.run(
        [sys.executable, "-c", _PRODUCT_ASAN_SCRIPT],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0 and "PRODUCT-OK" in r.stdout, r.stdout + r.stderr[-4000:]
    assert "AddressSanitizer" not in r.stderr, r.stderr[-4000:]


def test_cli_runs_a_kernel_and_reports(tmp_path):
    """python -m aiter_sage.emu: arrays in/out through .npy files, exit 1 on reports."""
    if not HAVE_CLANG:
        _skip("clang++ not installed")
    src, dst = tmp_path / "in.npy", tmp_path / "out.npy"
    np.save(src, np.arange(64, dtype=np.int32))
    np.save(dst, np.zeros(64, np.int32))

    def cli(kernel):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "aiter_sage.emu",
                str(CHECKS_PROBE),
                kernel,
                "--grid",
                "1",
                "--block",
                "64",
                "--arg",
                str(src),
                "--arg",
                str(dst),
                "--write-back",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )

    ok = cli("probe_lds_exchange")
    assert ok.returncode == 0 and "ok: probe_lds_exchange" in ok.stdout, ok.stdout + ok.stderr
    assert np.load(dst).any()  # written back
    race = cli("probe_lds_race")
    assert race.returncode == 1 and "[lds-race]" in race.stdout, race.stdout + race.stderr


# Run in a child: before the fix these settings aborted the process (rc 134).
_STACK_SCRIPT = textwrap.dedent("""
    import json, os, resource, sys
    import numpy as np
    from aiter_sage import emu
    mod = emu.load_module(sys.argv[1])
    x, out = np.arange(100, 164, dtype=np.int32), np.zeros(64, np.int32)

    def run(stack_kb):
        os.environ["AITER_SAGE_EMU_STACK_KB"] = stack_kb
        res = mod.run("probe_lds_exchange", (2, 1, 1), 64, [x, out], threads=1)
        return [res.rc, res.error]

    results = {v: run(v) for v in ("2147483647", "abc", "8", "64")}
    # Address space for Python and a little more, not for 64 lanes x 64 MiB of stacks.
    vm_kb = int(next(ln for ln in open("/proc/self/status") if ln.startswith("VmSize")).split()[1])
    resource.setrlimit(resource.RLIMIT_AS, ((vm_kb + 512 * 1024) * 1024,) * 2)
    results["65536 under RLIMIT_AS"] = run("65536")
    print(json.dumps(results))
""")


def test_lane_stacks_that_cannot_exist_fail_the_launch():
    """A stack size out of range (or not a number) and a failed stack mapping make the launch
    return an error naming the cause; the process lives on and a good setting still runs."""
    if not HAVE_CLANG:
        _skip("clang++ not installed")
    _module(CHECKS_PROBE)  # built here, in the shared cache
    env = dict(os.environ, AITER_SAGE_LAZY_REGISTER="1")
    res = child_json(_STACK_SCRIPT, str(CHECKS_PROBE), env=env)
    for bad in ("2147483647", "abc", "8"):
        rc, error = res[bad]
        assert rc != 0 and f"AITER_SAGE_EMU_STACK_KB={bad} is not a lane stack size" in error, res
    assert res["64"] == [0, ""], res
    rc, error = res["65536 under RLIMIT_AS"]
    assert rc != 0 and "cannot allocate 64 lane stacks of 65536 KiB" in error, res


if __name__ == "__main__":
    run_as_script(__file__)
