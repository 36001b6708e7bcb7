"""The cuda (NVIDIA Hopper, sm_90) backend.

Without a GPU (CI): both cuda modules compile with nvcc for sm_90a through the JIT's own
toolchain flags; the attention kernel's PTX issues wgmma (s8 x s8, e4m3 x e4m3 and, for
pv_dtype="fp16", f16 x f16) and ptxas reports no local-memory spills for every kernel variant;
prepare is built without multiply-add contraction and its default-path kernels do not spill; the
hardware e4m3 encoder's probe compiles (and, on an sm_90 GPU, matches the bit-level one over
every float).
On an sm_90 GPU: graph capture and replay, a non-default stream, torch.compile and opcheck, and
compute-sanitizer memcheck/racecheck on a small shape. (The op tests of
test_gfx1201_sage_prepare.py, test_gfx1201_sage_attention.py and test_contract_v2.py run on the
cuda backend too: it is one of the present backends there.)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import aiter_sage
from aiter_sage import jit_driver, ref
from aiter_sage.builder import paths

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import (  # noqa: F401  (puts the repo on sys.path)
    REPO,
    child_json,
    cuda_attention_kernels,
    nvcc_module,
    nvcc_or_fail,
    skip_no_hardware,
)


@pytest.fixture(scope="module")
def attention_build(tmp_path_factory):
    nvcc_or_fail()
    tmp = tmp_path_factory.mktemp("cuda_attention")
    log = nvcc_module(
        "module_gfx1201_sage_attention", ("-cubin", "--resource-usage", "-o", "a.cubin"), tmp
    )
    nvcc_module("module_gfx1201_sage_attention", ("-ptx", "-o", "a.ptx"), tmp)
    return log, (tmp / "a.ptx").read_text()


SPILL_LINE = (
    r"Function properties for (\S+)\n\s*"
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)


def _frames(log: str) -> dict[str, tuple[int, int, int]]:
    """kernel -> (stack frame, spill store, spill load bytes) from ptxas --resource-usage."""
    return {name: tuple(map(int, rest)) for name, *rest in re.findall(SPILL_LINE, log)}


def test_attention_ptx_uses_wgmma(attention_build):
    _, ptx = attention_build
    kernels = cuda_attention_kernels(ptx)
    # the default FP8 kernels are the serial ones (one warpgroup per CTA); the overlapped ones
    # (128-key tiles, and 192-key tiles with P double-buffered) and D 128's three-warpgroup and
    # two-warpgroup (256-key tiles) serial kernels stay for the AITER_SAGE_CUDA_SCHEDULE knob
    assert set(kernels) == {
        (64, False, True, 1, 128), (64, False, False, 3, 128), (128, False, True, 3, 128),
        (128, False, True, 1, 128), (128, False, True, 2, 256), (128, False, False, 2, 128),
        (64, True, False, 2, 128), (128, True, False, 2, 128), (64, False, False, 2, 192),
        (128, False, False, 2, 192),
    }  # fmt: skip
    wgmma = r"wgmma\.mma_async\.sync\.aligned\."
    for (d, fp16_pv, serial, wgs, n), body in kernels.items():
        wide = n > 128
        assert re.search(wgmma + rf"m64n{n}k32\.s32\.s8\.s8", body), d  # Q.K^T
        pv = rf"m64n{d}k16\.f32\.f16\.f16" if fp16_pv else rf"m64n{d}k32\.f32\.e4m3\.e4m3"
        other = rf"m64n{d}k32\.f32\.e4m3" if fp16_pv else rf"m64n{d}k16\.f32\.f16"
        assert re.search(wgmma + pv, body), (d, fp16_pv)
        assert not re.search(wgmma + other, body), (d, fp16_pv)  # one P.V mode per kernel
        assert ("e4m3x2" in body) != fp16_pv  # P is rounded to e4m3 in the FP8 kernels only
        # K/V/Q tiles arrive by TMA (tensor maps) on mbarriers
        assert "cp.async.bulk.tensor.5d" in body or fp16_pv, (d, fp16_pv)  # permuted K rows
        assert "cp.async.bulk.tensor.3d" in body and "expect_tx" in body, (d, fp16_pv)
        assert "cp.async.cg" not in body, (d, fp16_pv)
        # the overlapped kernels' producer warpgroup hands its registers to the consumers; the
        # serial ones have no producer and size for three warpgroups per SM at D 128 (three
        # CTAs of 64 rows, or one of 192 sharing its K/V copies), four CTAs of one at D 64, and
        # one CTA of two with 256-key tiles (S alone is 128 registers)
        assert ("setmaxnreg" in body) != serial, (d, fp16_pv, serial)
        if serial:
            warpgroups_per_sm = 2 if wide else 3 if d == 128 else 4
            assert re.search(rf"\.minnctapersm {warpgroups_per_sm // wgs}\b", body), (d, wgs)
            assert re.search(rf"\.maxntid {128 * wgs}, 1, 1", body), (d, wgs)


def test_attention_has_no_spills(attention_build):
    log, _ = attention_build
    frames = _frames(log)
    # Dp 64 and 128 with FP8 and with FP16 P.V (and the FP8 ping-pong variants)
    variants = {re.search(r"TraitsILi(\d+)ELi\d+ELb[01]ELb([01])E", n).groups() for n in frames}
    assert variants == {("64", "0"), ("128", "0"), ("64", "1"), ("128", "1")}, log
    assert all(f == (0, 0, 0) for f in frames.values()), log


def test_attention_wgmmas_are_not_serialized(attention_build):
    """ptxas serializes a kernel's wgmmas (a wait right after each one's issue, every k step of
    Q.K^T and P.V alike) when it cannot keep them in flight, and says so only in an info line:
    C7513, a non-wgmma instruction defining an input register of an in-flight wgmma (the
    overlapped kernel lost the overlap of Q.K^T(j) and the softmax with P.V(j-1): sage_core at
    S = 16k, D = 128 on an H200, 394 TFLOPS serialized, 557-572 without); C7512, too few
    registers for the wgmma pipeline (the serial kernel with its P.V issued while the softmax
    still ran, at 168 registers: it would have lost the overlap of every k step)."""
    log, _ = attention_build
    assert "C7513" not in log, log
    assert "wgmma.mma_async instructions are serialized" not in log, log


def test_prepare_compiles_without_contraction(tmp_path):
    nvcc_or_fail()
    spec = jit_driver.module_table().MODULES["module_gfx1201_sage_prepare"]
    assert "--fmad=false" in paths._spec_flags(spec, "cuda")
    log = nvcc_module("module_gfx1201_sage_prepare", ("-ptx", "-o", "p.ptx"), tmp_path)
    ptx = (tmp_path / "p.ptx").read_text()
    # quant.h's fma_exact (v_quant's exact residual) is the one FMA asked for, in marked asm
    exact = re.compile(r"\{ // sage: fma_exact\s*fma\.rn\.f32[^;]*;\s*\}")
    assert exact.search(ptx), log
    assert "fma.rn.f32" not in exact.sub("", ptx), log
    for name in ("sage_prepare_v_scale_kernel", "sage_prepare_qk_d64_f16_kernel"):
        assert f".entry {name}" in ptx


def test_prepare_default_path_has_no_spills(tmp_path):
    """The kernels of an upstream-style call (qk_plain, v_scale, v_quant) and of a call with
    smooth_k (v_scale_smooth, qk_smooth) keep everything in registers under their NVIDIA caps:
    the qk kernel with the fused steps compiled in spilled its norm weights at 64 registers and
    issued ~54 instructions per element (H200, B1 H24 S16384: 210 us), which is why those calls
    get builds without them. The fused qk kernels (RMSNorm / RoPE asked for) are the only ones
    allowed to spill."""
    nvcc_or_fail()
    log = nvcc_module(
        "module_gfx1201_sage_prepare", ("-cubin", "--resource-usage", "-o", "p.cubin"), tmp_path
    )
    frames = _frames(log)
    suffixes = ("_", "_d64_", "_f16_", "_d64_f16_")
    fused = {f"sage_prepare_qk{s}kernel" for s in suffixes}
    kinds = ("qk_plain", "qk_smooth", "v_scale", "v_scale_smooth", "v_quant", "v_quant16")
    default = {f"sage_prepare_{k}{s}kernel" for s in suffixes for k in kinds}
    assert set(frames) == fused | default, log
    for name in default:
        assert frames[name] == (0, 0, 0), (name, log)


def test_e4m3_hardware_encoder_matches_bit_level(tmp_path):
    """sage_e4m3_sat (cvt.rn.satfinite + the NaN sign) == quant.h's f32_to_e4m3_sat for all
    2^32 floats: the CUDA v_quant uses the former, the host tests hold the latter to ref.py.
    Compiled everywhere; run on an sm_90 GPU."""
    nvcc = nvcc_or_fail()
    exe = tmp_path / "e4m3_probe"
    src = REPO / "op_tests" / "cuda_probes" / "e4m3_probe.cu"
    inc = REPO / "csrc" / "include"
    build = subprocess.run(
        [nvcc, "-std=c++17", "-arch=sm_90a", f"-I{inc}", str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    _need_sm90()
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "mismatches 0 " in run.stdout, run.stdout + run.stderr


def test_gpu_archs_parse_sm90():
    mods = jit_driver.module_table()
    assert mods.parse_archs("sm_90; gfx1201") == ["sm_90", "gfx1201"]
    assert mods.parse_archs("sm_90a") == ["sm_90"]
    pairs = mods.modules_for_archs(["sm_90"])
    assert pairs == [
        ("module_gfx1201_sage_prepare", "sm_90"),
        ("module_gfx1201_sage_attention", "sm_90"),
    ]
    assert jit_driver.toolchain_for("sm_90").kind == "cuda"
    with pytest.raises(ValueError, match="Hopper"):
        jit_driver.toolchain_for("sm_80")


# ------------------------------------------------------------------ on an H100 / H200 ------
def _need_sm90():
    if not (torch.cuda.is_available() and torch.version.cuda and not torch.version.hip):
        skip_no_hardware("no NVIDIA GPU")
    if torch.cuda.get_device_capability() != (9, 0):
        skip_no_hardware("no sm_90 (Hopper) GPU")


def _inputs(b=1, s=333, h=3, d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g).to(torch.bfloat16).cuda() for _ in range(3))


def test_cuda_is_the_automatic_backend():
    _need_sm90()
    assert "cuda" in aiter_sage.available_backends()
    q, k, v = _inputs()
    out = aiter_sage.gfx1201_sage_attention(q, k, v)  # no backend named
    torch.testing.assert_close(
        out, aiter_sage.gfx1201_sage_attention(q, k, v, backend="cuda"), rtol=0, atol=0
    )


def test_non_default_stream():
    _need_sm90()
    q, k, v = _inputs(seed=1)
    want = aiter_sage.gfx1201_sage_attention(q, k, v, backend="cuda", is_causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = aiter_sage.gfx1201_sage_attention(q, k, v, backend="cuda", is_causal=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def test_cuda_graph_capture_and_replay():
    _need_sm90()
    q, k, v = _inputs(seed=2)
    static = [t.clone() for t in (q, k, v)]
    fn = lambda: aiter_sage.gfx1201_sage_attention(*static, backend="cuda", return_lse=True)  # noqa
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (module load) outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fn()
    for seed in (3, 4):
        fresh = _inputs(seed=seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want, want_lse = aiter_sage.gfx1201_sage_attention(*fresh, backend="cuda", return_lse=True)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        acc = ref.accuracy(out, ref.attention_fp32(*fresh))
        assert ref.in_band(acc), acc


def test_torch_compile_and_opcheck():
    _need_sm90()
    q, k, v = _inputs(seed=5, s=200)
    f = torch.compile(
        lambda a, b, c: aiter_sage.gfx1201_sage_attention(a, b, c, backend="cuda"), fullgraph=True
    )
    assert torch.equal(f(q, k, v), aiter_sage.gfx1201_sage_attention(q, k, v, backend="cuda"))
    torch.library.opcheck(
        torch.ops.aiter.gfx1201_sage_attention.default, (q, k, v), {"backend": "cuda"}
    )
    torch.library.opcheck(
        torch.ops.aiter.gfx1201_sage_prepare.default, (q, k, v), {"backend": "cuda"}
    )


LONG_KEY_LOOP_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {repo!r})
    sys.path.insert(0, {repo!r} + "/op_benchmarks")
    import aiter_sage
    from accuracy_floor import exact_from_prepared
    g = torch.Generator().manual_seed(6)
    s = 16384
    q, k, v = (torch.randn(1, s, 2, 128, generator=g).to(torch.bfloat16).cuda() for _ in range(3))
    p = aiter_sage.gfx1201_sage_prepare(q, k, v, backend="cuda")
    out = aiter_sage.gfx1201_sage_attention_fwd(*p, s, backend="cuda")[:, :s].double()
    exact = exact_from_prepared(p, s, kv_tile={kv_tile})
    print(json.dumps(((out - exact).norm() / exact.norm()).item()))
    """
)


# (schedule, its key tile: the grid a row's maximum, and so P's rounding, is taken on)
@pytest.mark.parametrize("schedule, kv_tile", [("default", 128), ("overlap192", 192)])
def test_long_key_loop_keeps_the_formats_exact_result(schedule, kv_tile):
    """A 16k-key loop moves O to its FP32 home in shared memory every 16 tiles (every 10 on the
    192-key tiles of overlap192): the kernel stays as close to the exact-arithmetic result of its
    own prepared tensors and e4m3 P, on its own tile's rounding grid, as over a short loop. With
    O accumulated in the e4m3 wgmma alone for all 128 tiles it drifted (H200, randn, kernel vs
    exact: 0.0022 at 4k keys, 0.0038 at 16k, 0.0053 at 32k; with the home 0.0018-0.0019 at all
    three). One child process per schedule (the kernels read AITER_SAGE_CUDA_SCHEDULE once)."""
    _need_sm90()
    env = {**os.environ, "AITER_SAGE_CUDA_SCHEDULE": schedule}
    drift = child_json(LONG_KEY_LOOP_CHILD.format(repo=str(REPO), kv_tile=kv_tile), env=env)
    assert drift < 0.0028, (schedule, drift)


# (head dim, causal, S). 2200 rows: the last 192-row CTA has 88 (one warpgroup full, one
# partly, one past q_len); 18 key tiles, so O moves to its home (and D 64 causal: masked
# tiles over 18 key tiles in the D 64 kernels).
SCHEDULE_CASES = ((128, False, 2200), (128, True, 2200), (64, False, 700), (64, True, 2200))
SCHEDULE_CHILD = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {repo!r})
    import aiter_sage
    g = torch.Generator().manual_seed(7)
    outs = []
    for d, causal, s in {cases!r}:
        q, k, v = (
            torch.randn(2, s, 3, d, generator=g).to(torch.bfloat16).cuda() for _ in range(3)
        )
        outs.append(aiter_sage.gfx1201_sage_attention(q, k, v, backend="cuda", is_causal=causal))
    torch.save([o.cpu() for o in outs], sys.argv[1])
    print("{{}}")
    """
)


def _schedule_outputs(schedule: str, folder) -> list[torch.Tensor]:
    path = folder / f"{schedule}.pt"
    env = {**os.environ, "AITER_SAGE_CUDA_SCHEDULE": schedule}
    child_json(SCHEDULE_CHILD.format(repo=str(REPO), cases=SCHEDULE_CASES), str(path), env=env)
    return torch.load(path)


@pytest.fixture(scope="module")
def default_schedule_outputs(tmp_path_factory):
    """The default kernels' outputs on SCHEDULE_CASES, computed once for every schedule."""
    _need_sm90()
    return _schedule_outputs("default", tmp_path_factory.mktemp("schedules"))


@pytest.mark.parametrize("schedule", ["shared192", "overlap", "pingpong", "wide256", "overlap192"])
def test_measurement_schedules_compute_the_default_result(
    schedule, default_schedule_outputs, tmp_path
):
    """AITER_SAGE_CUDA_SCHEDULE's kernels against the default ones on the same inputs. The
    192-row serial kernel (shared192) does the default kernel's arithmetic per row (its three
    warpgroups share only the K/V copies): the same bits without causal; under causal
    the warpgroups of a CTA's earlier rows run its later rows' tiles too, masked (P = 0), and O
    moves to its home at steps where the 64-row CTA had ended. The overlapped kernels form the
    exponent's argument in two steps (no folded bias). The 256- and 192-key tiles (wide256,
    overlap192) take a row's running maximum over more keys at a time, so P's first keys of a
    tile round against a later maximum where it rose in the rest. On a 192-key grid the tiles
    also end at other keys than the default's 128-key ones (H100: 0.007-0.016 from the default
    on these cases, while both are 0.0386-0.0391 from the FP32 reference at S 4k-32k): bound
    0.02; test_long_key_loop_keeps_the_formats_exact_result checks that kernel against the
    format's exact result on its own grid."""
    _need_sm90()
    other = _schedule_outputs(schedule, tmp_path)
    for case, a, b in zip(SCHEDULE_CASES, default_schedule_outputs, other, strict=True):
        causal = case[1]
        assert torch.isfinite(b).all(), (schedule, case)
        if schedule == "shared192" and not causal:
            torch.testing.assert_close(b, a, rtol=0, atol=0)
        else:
            rel = ((b.float() - a.float()).norm() / a.float().norm()).item()
            assert rel < (0.02 if schedule == "overlap192" else 0.01), (schedule, case, rel)


SANITIZED = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {repo!r})
    import aiter_sage
    g = torch.Generator().manual_seed(0)
    # 2200 keys: 18 key tiles, so O moves to its shared-memory home (every 16 tiles)
    for d, causal, s in ((128, False, 200), (64, True, 200), (128, False, 2200), (64, True, 2200)):
        q, k, v = (
            torch.randn(1, s, 2, d, generator=g).to(torch.bfloat16).cuda() for _ in range(3)
        )
        out = aiter_sage.gfx1201_sage_attention(q, k, v, backend="cuda", is_causal=causal,
                                                smooth_k=True, return_lse=True)
        # FP16 P.V, prepare (v_quant16) and attention: 200 keys, so the second 128-key
        # tile is partly past kv_len (zero-filled V16 chunks)
        out = aiter_sage.gfx1201_sage_attention(q, k, v, backend="cuda", is_causal=causal,
                                                pv_dtype="fp16", return_lse=True)
    torch.cuda.synchronize()
    print("sanitized run done")
    """
)


# overlap192: the overlapped kernel on 192-key tiles (2200 keys: 12 tiles, O home every 10)
@pytest.mark.parametrize("schedule", ["default", "overlap192"])
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_compute_sanitizer(tool, schedule, tmp_path):
    _need_sm90()
    sanitizer = shutil.which("compute-sanitizer") or (
        "/usr/local/cuda/bin/compute-sanitizer"
        if os.path.exists("/usr/local/cuda/bin/compute-sanitizer")
        else None
    )
    if not sanitizer:
        skip_no_hardware("no compute-sanitizer on this GPU machine")
    # Build the modules first (outside the sanitizer).
    aiter_sage.gfx1201_sage_attention(*_inputs(s=64), backend="cuda")
    script = tmp_path / "s.py"
    script.write_text(SANITIZED.format(repo=str(REPO)))
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", "3", sys.executable, str(script)]
    if tool == "racecheck":
        cmd[3:3] = ["--racecheck-report", "all"]
    env = {**os.environ, "AITER_SAGE_CUDA_SCHEDULE": schedule}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    text = proc.stdout + proc.stderr
    if os.environ.get("SAGE_SANITIZER_LOG_DIR"):  # the whole report, for a device run's $OUT
        log = os.path.join(os.environ["SAGE_SANITIZER_LOG_DIR"], f"{tool}_{schedule}.log")
        with open(log, "w") as f:
            f.write(text)
    assert proc.returncode == 0 and "sanitized run done" in text, text[-4000:]
    assert "ERROR SUMMARY: 0 errors" in text or "RACECHECK SUMMARY: 0 hazards" in text, text[-4000:]
