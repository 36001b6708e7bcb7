"""Every CPU tier (AITER_SAGE_CPU_ISA=scalar|avx2|avx512|amx|amx_model) is bit-exact in prepare
and in band. amx_model runs the amx tier's tile code on a C++ model of the AMX instructions, so
CI covers the amx kernel on CPUs without AMX; amx itself runs where the CPU and OS allow it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import aiter_sage
from aiter_sage import ref

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import (
    AUTO_CPU_TIERS,
    BACKENDS,
    INT8_PV_TIERS,
    REPO,
    build_host_program,
    cpu_model,
    norm_weights,
    qkv,
    rope_tables,
    run_as_script,
    use_cpu_tier,
    with_garbage_padding,
)
from test_gfx1201_sage_prepare import assert_prepared_equal

pytestmark = pytest.mark.skipif("cpu" not in BACKENDS, reason="no C++ compiler for the cpu backend")


TIERS = ["scalar", "avx2", "avx512", "amx", "amx_model"]
AUTO_TIERS = list(AUTO_CPU_TIERS)  # amx_model is never picked by default
# A forked child runs one small attention: seconds, unless it hangs.
FORK_TIMEOUT_S = 120


@pytest.fixture(params=TIERS)
def tier(request, monkeypatch):
    use_cpu_tier(monkeypatch, request.param)
    return request.param


def test_tier_ignores_garbage_in_padded_keys(tier):
    """Padding holds NaN V codes, junk K/Q and NaN scales: every tier (the BF16 key-pair
    tiers included, whose last pair straddles kv_len) must give the clean output."""
    q, k, v = qkv(1, 96, 96, 2, seed=10)
    prep = aiter_sage.gfx1201_sage_prepare(q, k, v, backend="cpu")
    clean = aiter_sage.gfx1201_sage_attention_fwd(*prep, 50, kv_len=45, backend="cpu")
    dirty = with_garbage_padding(prep, 50, 45)
    got = aiter_sage.gfx1201_sage_attention_fwd(*dirty, 50, kv_len=45, backend="cpu")
    assert torch.equal(got, clean)


def test_tier_prepare_bit_exact(tier):
    s = 200
    q, k, v = qkv(2, s, s, 2, seed=5)
    fused = (*norm_weights(), *rope_tables(s, 96))
    got = aiter_sage.gfx1201_sage_prepare(q, k, v, 0.09, *fused, backend="cpu")
    assert_prepared_equal(got, ref.prepare(q, k, v, 0.09, *fused))
    q, k, v = qkv(1, 257, 31, 2, seed=6)
    assert_prepared_equal(
        aiter_sage.gfx1201_sage_prepare(q, k, v, 0.1, backend="cpu"), ref.prepare(q, k, v, 0.1)
    )


def test_tier_attention_in_band(tier):
    q, k, v = qkv(1, 300, 257, 2, seed=7)
    out = aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu")
    acc = ref.accuracy(out, ref.attention_fp32(q, k, v, 128**-0.5))
    assert ref.in_band(acc), acc


def _nonfinite_rows(x):
    return ~torch.isfinite(x.float()).all(-1)


@pytest.mark.parametrize("where", ["k_neg_inf", "k_nan", "q_nan", "v_inf"])
def test_tier_non_finite_inputs_agree_with_ref(tier, where):
    """Every tier makes exactly ref.py's rows non-finite, and its finite rows match ref's
    model (the SIMD max and exp2 used to drop a NaN score and return finite wrong rows)."""
    q, k, v = qkv(1, 128, 128, 1, seed=8)
    tensor, value = {
        "k_neg_inf": (k, -float("inf")),
        "k_nan": (k, float("nan")),
        "q_nan": (q, float("nan")),
        "v_inf": (v, float("inf")),
    }[where]
    tensor[0, 5, 0, 7] = value
    out = aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu")
    prep = ref.prepare(q, k, v)
    want = cpu_model(prep, 128)
    bad = _nonfinite_rows(want)
    assert bad.any()
    assert torch.equal(_nonfinite_rows(out), bad)
    if not bad.all():
        assert ref.accuracy(out[~bad], want[~bad])["rel_l2"] < 5e-3


def test_tier_keeps_subnormal_outputs(tier):
    """V of BF16 subnormals: the outputs are subnormal too, not flushed to zero."""
    q, k, v = qkv(1, 64, 64, 1, seed=9)
    v = (v.float() * 1e-39).to(torch.bfloat16)
    out = aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu")
    want = cpu_model(ref.prepare(q, k, v), 64)
    assert out.float().abs().max() > 0
    assert ref.accuracy(out, want)["rel_l2"] < 2e-2


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (33, 31), (130, 129), (257, 300)])
def test_tier_tails_match_ref(tier, q_len, kv_len):
    """Lengths off every block size (the amx tiers work on 256-row blocks and 256-key tiles
    padded with zero rows and keys): the same attention as ref.py's model of the kernel."""
    q, k, v = qkv(1, q_len, kv_len, 2, seed=q_len + kv_len)
    out = aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu")
    want = cpu_model(ref.prepare(q, k, v), q_len, kv_len)
    assert out.shape == want.shape
    assert ref.accuracy(out, want)["rel_l2"] < 5e-3


@pytest.mark.parametrize("amx_tier", INT8_PV_TIERS)
def test_amx_int8_pv_matches_its_model(monkeypatch, amx_tier):
    """The amx tiers' FP8 mode runs P.V on int8 tiles: within 1e-3 of ref's model of those
    steps (int8_pv=True), which the unrounded-P model is over 3x that far from; V has outlier
    keys, a zero channel and a tail off the 256-key steps. FP16 V keeps BF16 P.V: within 5e-3
    of the unrounded-P model, as on the other tiers."""
    use_cpu_tier(monkeypatch, amx_tier)
    q, k, v = qkv(1, 300, 600, 2, seed=14)
    v = v.float()
    v[:, ::97] *= 30  # a few large keys: each 256-key step's V scale differs
    v[..., 3] = 0  # a channel whose int8 scale is 0
    v = v.to(torch.bfloat16)
    for pv_dtype, int8 in (("fp8", True), ("fp16", False)):
        prep = ref.prepare(q, k, v, pv_dtype=pv_dtype)
        out = aiter_sage.gfx1201_sage_attention_fwd(*prep, 300, kv_len=600, backend="cpu")[:, :300]
        want = ref.attention_from_prepared(prep, 300, 600, fp8_p=False, int8_pv=int8)
        # FP16 V codes are rounded to BF16 in the tiles (the tier's P.V type)
        assert ref.accuracy(out, want)["rel_l2"] < (1e-3 if int8 else 5e-3), pv_dtype
        assert out[..., 3].abs().max() == 0
        if int8:
            exact_p = ref.attention_from_prepared(prep, 300, 600, fp8_p=False)
            assert ref.accuracy(exact_p, want)["rel_l2"] > 3e-3


@pytest.mark.parametrize("amx_tier", INT8_PV_TIERS)
def test_amx_int8_v_codes_decode_every_e4m3_value(monkeypatch, amx_tier):
    """The amx tiers decode e4m3 V codes arithmetically before their int8 rounding: every
    finite code (subnormals and both signs included) against ref's table decode, through
    channels whose 256-key steps hold only subnormal, only small or any finite codes (a
    step's own amax sets the int8 scale, so each range gets the full 8 bits)."""
    use_cpu_tier(monkeypatch, amx_tier)
    q, k, v = qkv(1, 64, 512, 1, seed=15)
    prep = ref.prepare(q, k, v)
    g = torch.Generator().manual_seed(16)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    ranges = {
        "subnormal": finite[(finite & 0x78) == 0],
        "small": finite[((finite & 0x78) > 0) & ((finite & 0x78) <= 0x18)],  # exponents 1-3
        "any": finite,
    }
    bits = ref.fp8_bits(prep.v_fp8).clone()  # [B, Hkv, Dp, S]
    for i, codes in enumerate(ranges.values()):
        pick = torch.randint(len(codes), bits[0, 0, 8 * i : 8 * i + 8].shape, generator=g)
        bits[0, 0, 8 * i : 8 * i + 8] = codes[pick]
    prep = prep._replace(v_fp8=bits.view(torch.float8_e4m3fn))
    out = aiter_sage.gfx1201_sage_attention_fwd(*prep, 64, kv_len=512, backend="cpu")[:, :64]
    want = ref.attention_from_prepared(prep, 64, 512, fp8_p=False, int8_pv=True)
    for i, name in enumerate(ranges):
        ch = slice(8 * i, 8 * i + 8)
        assert ref.accuracy(out[..., ch], want[..., ch])["rel_l2"] < 2e-3, name


def test_tier_results_do_not_depend_on_threads(tier):
    """Work is split over threads by (head, query block): any split gives the same bits."""
    q, k, v = qkv(2, 300, 280, 3, seed=13)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu")
        torch.set_num_threads(3)
        three = aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, three)


# ---- contract v2 on every tier: head dims, FP16, GQA, smooth_k, causal, LSE --------------------
def _qkv_v2(b, sq, skv, hq, hkv, d, dtype, seed):
    """BF16/FP16 [B, S, H, D] inputs; K with a common offset (what smoothing removes)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k = (torch.randn(b, skv, hkv, d, generator=g) + 0.5).to(dtype)
    v = torch.randn(b, skv, hkv, d, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize(
    "d,dtype,hq,hkv,smooth_k,fused",
    [
        (40, torch.bfloat16, 2, 2, False, False),  # D64 kernel, zero-filled channels
        (64, torch.float16, 4, 2, True, True),  # FP16, GQA, smoothing, norm/rope over 64
        (96, torch.bfloat16, 3, 1, True, True),  # MQA, D128 kernel, 3 norm rounds
        (72, torch.float16, 2, 2, True, False),
    ],
)
@pytest.mark.parametrize("q_scale_rows", [32, 16])
def test_tier_prepare_v2_bit_exact(tier, d, dtype, hq, hkv, smooth_k, fused, q_scale_rows):
    q, k, v = _qkv_v2(2, 70, 45, hq, hkv, d, dtype, seed=d)
    extra = ()
    if fused:
        g = torch.Generator().manual_seed(1)
        w = [(torch.rand(d, generator=g) + 0.5).to(dtype) for _ in range(2)]
        extra = (*w, *rope_tables(70, 32))
        k = torch.cat([k, k], dim=1)[:, :70]  # RoPE needs q_len == kv_len
        v = torch.cat([v, v], dim=1)[:, :70]
    kw = dict(smooth_k=smooth_k, q_scale_rows=q_scale_rows)
    got = aiter_sage.gfx1201_sage_prepare(q, k, v, 0.1, *extra, **kw, backend="cpu")
    assert_prepared_equal(got, ref.prepare(q, k, v, 0.1, *extra, **kw))


@pytest.mark.parametrize(
    "sq,skv,hq,hkv,d,dtype,causal,smooth_k,q_scale_rows",
    [
        (150, 150, 2, 2, 64, torch.bfloat16, True, False, 32),
        (97, 130, 4, 2, 40, torch.float16, True, True, 32),  # causal with q_len != kv_len
        (130, 97, 2, 1, 128, torch.bfloat16, True, False, 32),
        (70, 300, 3, 1, 96, torch.float16, False, True, 32),
        (150, 150, 2, 2, 64, torch.bfloat16, True, False, 16),  # 16-row Q scales
        (70, 300, 3, 1, 96, torch.float16, False, True, 16),
    ],
)
def test_tier_attention_v2_in_band_with_lse(
    tier, sq, skv, hq, hkv, d, dtype, causal, smooth_k, q_scale_rows
):
    """Output in the inputs' dtype with D channels, in band against FP32 attention; the LSE
    matches ref's model of the prepared tensors (common.cpu_model: the tier's P.V) to 1e-4,
    the smoothing term added back."""
    q, k, v = _qkv_v2(1, sq, skv, hq, hkv, d, dtype, seed=sq + d)
    kw = dict(smooth_k=smooth_k, q_scale_rows=q_scale_rows)
    out, lse = aiter_sage.gfx1201_sage_attention(
        q, k, v, is_causal=causal, return_lse=True, backend="cpu", **kw
    )
    assert out.dtype == dtype and out.shape == q.shape
    assert ref.band_failures(ref.accuracy(out, ref.attention_fp32(q, k, v, is_causal=causal))) == []
    prep, smoothing = ref.prepare(q, k, v, return_smoothing=True, **kw)
    want = cpu_model(
        prep,
        sq,
        skv,
        is_causal=causal,
        lse_corr=smoothing.lse_corr if smooth_k else None,
        head_dim=d,
        out_dtype=dtype,
        return_lse=True,
    )
    assert ref.accuracy(out, want.out)["rel_l2"] < 5e-3
    assert torch.allclose(lse, want.lse, atol=1e-4, rtol=0)


def test_tier_causal_fwd_pads_and_ignores_future_keys(tier):
    """Causal through the prepared-tensor op: padded output rows are zero and their LSE -inf;
    changing keys that no query sees (key i > every row) to other finite values changes
    nothing. (A NaN V there may reach the rows on the tile tiers, whose P.V steps cover whole
    32-key groups: 0 * NaN is NaN, as in ref's model, which multiplies every key.)"""
    q, k, v = _qkv_v2(1, 50, 50, 2, 2, 128, torch.bfloat16, seed=3)
    prep = aiter_sage.gfx1201_sage_prepare(q, k, v, backend="cpu")
    out, lse = aiter_sage.gfx1201_sage_attention_fwd(
        *prep, 40, kv_len=50, is_causal=True, return_lse=True, backend="cpu"
    )
    assert torch.all(out[:, 40:] == 0) and torch.all(lse[..., 40:] == -float("inf"))
    assert torch.isfinite(lse[..., :40]).all()
    dirty = [t.clone() for t in prep]
    dirty[2][:, 40:50] = 77  # keys 40..49: seen by no row < 40
    dirty[4].view(torch.uint8)[..., 40:50] = 0x7E  # 448, the largest e4m3 value
    again = aiter_sage.gfx1201_sage_attention_fwd(
        *dirty, 40, kv_len=50, is_causal=True, backend="cpu"
    )
    assert torch.equal(again, out)


def test_unknown_tier_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("AITER_SAGE_CPU_ISA", "sse9")
    q, k, v = qkv(1, 8, 8, 1, seed=0)
    with pytest.raises(
        RuntimeError,
        match="AITER_SAGE_CPU_ISA=sse9: expected scalar, avx2, avx512, amx or amx_model",
    ):
        aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu")


def _cpuinfo_flags():
    """The CPU's feature flags as the Linux kernel reports them (independent of our CPUID code)."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _attention_with(monkeypatch, isa, q, k, v):
    if isa is None:
        monkeypatch.delenv("AITER_SAGE_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("AITER_SAGE_CPU_ISA", isa)
    return aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu")


def test_amx_request_runs_or_is_a_clear_error(monkeypatch):
    """AITER_SAGE_CPU_ISA=amx runs where the kernel reports AMX; elsewhere it is an error that
    names the tier (never a crash on the first tile instruction)."""
    q, k, v = qkv(1, 64, 64, 1, seed=11)
    flags = _cpuinfo_flags()
    has_amx = flags is not None and {"amx_tile", "amx_int8", "amx_bf16", "avx512_bf16"} <= flags
    if has_amx:
        out = _attention_with(monkeypatch, "amx", q, k, v)
        assert ref.in_band(ref.accuracy(out, ref.attention_fp32(q, k, v, 128**-0.5)))
    else:
        with pytest.raises(RuntimeError, match="AITER_SAGE_CPU_ISA=amx: this CPU .*the amx tier"):
            _attention_with(monkeypatch, "amx", q, k, v)


def test_default_tier_is_the_widest_usable(monkeypatch):
    """With no request the backend runs the first tier of amx, avx512, avx2, scalar that an
    explicit request accepts (so without AMX, or without the OS's permission, the next tier
    runs): bit-identical outputs to that tier's."""
    q, k, v = qkv(1, 200, 150, 2, seed=12)
    for isa in AUTO_TIERS:
        try:
            want = _attention_with(monkeypatch, isa, q, k, v)
        except RuntimeError as e:
            assert "lacks" in str(e)
            continue
        break
    assert torch.equal(_attention_with(monkeypatch, None, q, k, v), want)


if __name__ == "__main__":
    run_as_script(__file__)


# ---- the worker pool (cpu_runtime.cpp): threads persist between launches -----------------------
def _with_threads(n, fn):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(before)


def test_cpu_workers_run_in_parallel_on_torchs_threads():
    """Where torch runs its intra-op work on OpenMP, the cpu ops run their workers on those
    threads (the binding's SageCpuExecutor): two 20 ms workers at two torch threads take two
    distinct threads. (A binding built without OpenMP would run them one after another on one
    thread, 10x slower at 16 threads; the modules' own pool would compete with torch's spinning
    threads.)"""
    from aiter_sage.ops import binding

    if not torch.backends.openmp.is_available():
        pytest.skip("this torch has no OpenMP intra-op threads; the modules use their own pool")
    aiter_sage.gfx1201_sage_prepare(*qkv(1, 32, 32, 1), backend="cpu")  # loads the binding
    assert _with_threads(2, lambda: binding().cpu_executor_threads(2)) == 2
    assert _with_threads(1, lambda: binding().cpu_executor_threads(3)) == 1


def test_cpu_ops_start_no_threads_of_their_own_beside_torchs():
    """In a fresh process whose torch has run an op on its threads, cpu attention and prepare
    leave the process's thread count as it was: their workers ran on torch's threads, not on a
    pool of the modules' own."""
    if not torch.backends.openmp.is_available():
        pytest.skip("this torch has no OpenMP intra-op threads; the modules use their own pool")
    code = (
        "import os, torch, aiter_sage\n"
        "torch.set_num_threads(2)\n"
        "a = torch.randn(256, 256); a @ a\n"
        "q, k, v = (torch.randn(1, 300, 2, 128).to(torch.bfloat16) for _ in range(3))\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "for _ in range(3): aiter_sage.gfx1201_sage_attention(q, k, v, backend='cpu')\n"
        "print(before, len(os.listdir('/proc/self/task')))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=str(REPO)
    )
    assert run.returncode == 0, run.stderr
    before, after = map(int, run.stdout.split()[-2:])
    assert after == before, run.stdout


def test_worker_pool_runs_each_worker_once_when_thread_counts_alternate(tmp_path):
    """op_tests/cpp/worker_pool_probe.cpp: 20000 launches straight through the pool whose
    thread counts alternate between small and large (as prepare's phases and attention do when
    their work items are few), so pool threads sit one launch out and are needed by the next.
    Every launch must run each worker index exactly once and return only after all of them.
    (Before the worker count moved into the generation word, this failed within a second on
    2 cores: a skipped worker, a crash, or a launch waiting forever.)"""
    exe = tmp_path / "worker_pool_probe"
    build_host_program(
        exe,
        REPO / "op_tests" / "cpp" / "worker_pool_probe.cpp",
        REPO / "csrc" / "cpu" / "cpu_runtime.cpp",
        "-pthread",
    )
    for max_threads in (3, 4, 8):
        run = subprocess.run(
            [str(exe), "20000", str(max_threads)], capture_output=True, text=True, timeout=120
        )
        assert (run.returncode, run.stdout.strip()) == (0, "ok"), (max_threads, run)


def test_concurrent_launches_from_python_threads_match_sequential_ones():
    """Launches from several Python threads give the bits of the same launches one after
    another (where they overlap, one owns the worker pool and the others start their own
    threads)."""
    import threading

    inputs = [qkv(1, 200, 170, 2, seed=40 + i) for i in range(3)]
    run = lambda i: aiter_sage.gfx1201_sage_attention(*inputs[i], backend="cpu")  # noqa: E731
    want = _with_threads(3, lambda: [run(i) for i in range(len(inputs))])
    got = [None] * len(inputs)
    errors = []

    def worker(i):
        try:
            for _ in range(3):
                got[i] = run(i)
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)

    def launch_all():
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    _with_threads(3, launch_all)
    assert not errors, errors
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_runs_the_cpu_backend():
    """A child forked after the parent's pool started has none of the parent's pool threads: it
    must start its own (a child that waited for the parent's workers would hang), and compute
    the parent's bits."""
    q, k, v = qkv(1, 100, 90, 2, seed=44)
    want = _with_threads(2, lambda: aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu"))
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 = same bits, 1 = other bits or an error
        code = 1
        try:
            got = _with_threads(
                2, lambda: aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu")
            )
            code = 0 if torch.equal(got, want) else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + FORK_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child did not finish within {FORK_TIMEOUT_S} s")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
