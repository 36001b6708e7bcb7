"""The README's main job, the benchmark, runs end to end with its default providers on the best
backend present, and with every problem option; its accuracy columns hold the band. (Timings
are the benchmark's business, not asserted here.)"""

import csv
import math
import subprocess
import sys
from collections import Counter

import pytest

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import REPO, build_host_program, cpu_has_tier, run_as_script

BENCH = REPO / "op_benchmarks" / "bench_gfx1201_sage_attention.py"
TINY = ["-b", "1", "-s", "96", "--warmup", "0", "--iters", "1", "--rounds", "1"]


def _run(tmp_path, *extra, in_band=True):
    """The rows of one tiny run; `in_band=False`: the run must report an output outside the
    band (exit 1, the rows still written)."""
    out = tmp_path / "rows.csv"
    proc = subprocess.run(
        [sys.executable, str(BENCH), *TINY, "--compare_to_ref", "-o", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == (0 if in_band else 1), proc.stdout + proc.stderr
    with open(out) as f:
        return list(csv.DictReader(f))


def test_default_providers_run_and_are_in_band(tmp_path):
    rows = _run(tmp_path, "-n", "2")
    assert [r["provider"] for r in rows] == ["sage", "sage_core", "sdpa_bf16"]
    assert all(r["in_band"] == "True" for r in rows), rows


@pytest.mark.parametrize(
    "options,expect",
    [
        (
            ["-n", "4", "--gqa", "2", "--causal", "--dtype", "fp16", "--head_dim", "64"],
            dict(H="4", gqa="2", causal="True", dtype="fp16", D="64"),
        ),
        (["-n", "1", "--head_dim", "72"], dict(D="72", causal="False", dtype="bf16")),
        (["-n", "2", "--pv_dtype", "fp16"], dict(pv_dtype="fp16", dtype="bf16")),
        (["-n", "2", "--q_scale_rows", "16"], dict(q_scale_rows="16", dtype="bf16")),
    ],
)
def test_problem_options_are_columns(tmp_path, options, expect):
    rows = _run(tmp_path, *options)
    assert rows and all(r["in_band"] == "True" for r in rows), rows
    for r in rows:
        assert {k: r[k] for k in expect} == expect, r
    assert rows[-1]["provider"] == f"sdpa_{expect.get('dtype', 'bf16')}"


def test_dit_inputs_are_where_smoothing_matters(tmp_path):
    """--dit gives every key of a head one large per-channel offset and a few outlier query
    channels. There our output leaves the accuracy band without --smooth_k (the offset is what
    K's INT8 scale loses to; the benchmark says FAIL) and is back in it with smoothing; both
    settings are CSV columns."""
    sys.path.insert(0, str(BENCH.parent))
    import bench_gfx1201_sage_attention as bench

    q, k, _ = bench.make_inputs(1, 2, 512, "cpu", dit=True)
    offset = k.float().mean(dim=1)  # [1, H, D]: per-channel mean over the keys
    spread = (k.float() - offset[:, None]).std()
    assert offset.abs().mean() > 2 * spread  # a shared offset several times the keys' spread
    q_std = q.float().std(dim=(0, 1, 2))
    outliers = (q_std > 4 * q_std.median()).sum().item()
    assert outliers == bench.DIT_Q_OUTLIERS
    plain = _run(tmp_path, "-n", "2", "--dit", "--providers", "sage", in_band=False)
    smooth = _run(tmp_path, "-n", "2", "--dit", "--smooth_k", "--providers", "sage")
    assert (plain[0]["dit"], plain[0]["smooth_k"], smooth[0]["smooth_k"]) == (
        "True",
        "False",
        "True",
    )
    assert (plain[0]["in_band"], smooth[0]["in_band"]) == ("False", "True"), (plain, smooth)
    assert float(smooth[0]["rel_l2"]) < float(plain[0]["rel_l2"]), (plain, smooth)


def test_smooth_k_reaches_the_kept_key_providers(tmp_path):
    """--smooth_k with --mask-pad: the unmasked runs on the kept keys smooth too (on DiT-like
    inputs they leave the band without it)."""
    rows = _run(
        tmp_path, "-n", "2", "--dit", "--smooth_k", "--mask-pad", "0.25",
        "--providers", "sage", "sage_kept", "sage_core_kept",
    )  # fmt: skip
    assert [r["provider"] for r in rows] == ["sage", "sage_kept", "sage_core_kept"]
    assert all(r["in_band"] == "True" and r["smooth_k"] == "True" for r in rows), rows


def test_q_scale_rows_reaches_every_sage_provider(tmp_path):
    """--q_scale_rows 16 reaches all four sage providers (the kept-key ones of --mask-pad
    too): each one's output, scored against the FP32 reference, moves from the 32-row run's,
    stays in band, and its row says 16. (Unread, an option would leave every output's bits.)"""
    common = ("-n", "2", "--dit", "--smooth_k", "--mask-pad", "0.25",
              "--providers", "sage", "sage_core", "sage_kept", "sage_core_kept")  # fmt: skip
    rows32 = _run(tmp_path, *common)
    rows16 = _run(tmp_path, *common, "--q_scale_rows", "16")
    assert [r["provider"] for r in rows16] == ["sage", "sage_core", "sage_kept", "sage_core_kept"]
    for a, b in zip(rows32, rows16):
        assert (a["q_scale_rows"], b["q_scale_rows"]) == ("32", "16"), (a, b)
        assert b["in_band"] == "True" and a["rel_l2"] != b["rel_l2"], (a, b)


def test_external_providers_say_why_they_are_absent(tmp_path):
    """Without SageAttention2 and FlashAttention-3 (or off a Hopper GPU) their providers are
    left out with the reason printed; the other providers still run."""
    out = tmp_path / "rows.csv"
    proc = subprocess.run(
        [sys.executable, str(BENCH), *TINY, "-n", "2", "--providers", "sage", "sage2",
         "sage2_nosmooth", "fa3_fp8", "-o", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sage2, sage2_nosmooth, fa3_fp8: skipped (needs SageAttention2" in proc.stdout
    assert "FlashAttention-3's flash_attn_interface" in proc.stdout
    with open(out) as f:
        assert [r["provider"] for r in csv.DictReader(f)] == ["sage"]


@pytest.mark.parametrize("rotate,lead_in", [(True, 2), (False, 0)])
def test_timing_rounds_rotate_and_lead_in_with_the_providers_own_calls(rotate, lead_in):
    """Each round times every provider once, its `lead_in` untimed calls right before its
    `iters` timed ones; with `rotate` the rounds follow round_order, so over as many rounds as
    providers each provider runs once in every position (fixed: always the listed order)."""
    sys.path.insert(0, str(REPO / "op_benchmarks"))
    import bench_gfx1201_sage_attention as bench

    names, iters, warmup = ["a", "b", "c", "d"], 3, 1
    log = []
    calls = {n: (lambda n=n: log.append(n)) for n in names}
    times = bench.time_interleaved(calls, "cpu", warmup, iters, len(names), rotate, lead_in)
    assert sorted(times) == names and all(t >= 0 for t in times.values())
    assert log[: warmup * len(names)] == names  # warm-up, in the listed order
    runs = log[warmup * len(names) :]
    per = lead_in + iters
    assert len(runs) == per * len(names) ** 2
    blocks = [runs[i : i + per] for i in range(0, len(runs), per)]
    assert all(len(set(b)) == 1 for b in blocks), blocks  # one provider's calls back to back
    order = [b[0] for b in blocks]
    rounds = [order[i : i + len(names)] for i in range(0, len(order), len(names))]
    assert all(sorted(r) == names for r in rounds)
    if rotate:
        for pos in range(len(names)):
            assert sorted(r[pos] for r in rounds) == names
        assert rounds == [bench.round_order(names, r) for r in range(len(names))]
    else:
        assert all(r == names for r in rounds)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_round_order_balances_positions_and_predecessors(n):
    """round_order is a Williams design: over n rounds (2n for odd n) every provider runs equally
    often in every position and right after every other provider, so no provider is always
    timed behind the same one (a power-capped GPU's clocks carry over from the provider before)."""
    sys.path.insert(0, str(REPO / "op_benchmarks"))
    import bench_gfx1201_sage_attention as bench

    names = [f"p{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    rows = [bench.round_order(names, r) for r in range(cycle)]
    assert all(sorted(row) == names for row in rows)
    positions = Counter((p, i) for row in rows for i, p in enumerate(row))
    assert set(positions.values()) == {cycle // n}
    assert len(positions) == n * n
    if n > 1:
        pairs = Counter(pair for row in rows for pair in zip(row, row[1:]))
        assert len(pairs) == n * (n - 1)  # every ordered pair of distinct providers
        assert set(pairs.values()) == {cycle // n}
    assert bench.round_order(names, cycle) == rows[0]  # periodic
    assert bench.round_order([], 3) == []


def test_timing_window_fills_lead_in_and_timed_calls_to_its_length():
    """With a window, each provider's lead-in and its timed calls of a round are each as many
    calls as the window holds at its fastest warm-up call (never fewer than asked): the fast
    provider's many, the slow one's few."""
    import time

    sys.path.insert(0, str(REPO / "op_benchmarks"))
    import bench_gfx1201_sage_attention as bench

    log = []

    def call(name, secs):
        def fn():
            t0 = time.perf_counter()
            time.sleep(secs)
            log.append((name, time.perf_counter() - t0))

        return fn

    calls = {"fast": call("fast", 0.001), "slow": call("slow", 0.004)}
    window, iters, warmup, rounds = 0.012, 2, 2, 2
    bench.time_interleaved(calls, "cpu", warmup, iters, rounds, False, 1, window)
    warm, runs = log[: warmup * len(calls)], log[warmup * len(calls) :]
    counts = {}
    for name in calls:
        fastest = min(t for n, t in warm if n == name)  # a little under the bench's own timing
        n = len([1 for r, _ in runs if r == name]) // (2 * rounds)  # lead-in = timed calls
        assert n >= iters and n * fastest >= 0.9 * window, (name, n, fastest)
        assert n <= window / fastest + 1, (name, n, fastest)
        counts[name] = n
    assert [r for r, _ in runs] == [
        name for _ in range(rounds) for name in calls for _ in range(2 * counts[name])
    ]
    assert counts["fast"] > counts["slow"]


def test_cpu_phase_harness_is_thread_count_and_executor_invariant(tmp_path):
    """op_benchmarks/cpu/bench_cpu_phases.cpp (the cpu backend's prepare and attention timed
    through their C ABI) builds against today's headers and runs on the JIT's cpu modules. Every
    prepared and output byte (its hash) is the same at 1 and 2 threads on the modules' own pool
    and through a caller's SageCpuExecutor (sage/module_abi.h) that runs the workers one after
    another in reverse order, or on threads of its own: the work split and the threads change,
    the arithmetic does not. The executors check that each launch calls every worker once; a
    stream argument that is not an executor is refused with a clear error."""
    from aiter_sage import jit_driver

    exe = tmp_path / "bench_cpu_phases"
    build_host_program(
        exe, REPO / "op_benchmarks" / "cpu" / "bench_cpu_phases.cpp", "-ldl", "-pthread"
    )
    mods = [
        str(jit_driver.ensure_module(m, "cpu"))
        for m in ("module_gfx1201_sage_prepare", "module_gfx1201_sage_attention")
    ]
    sums, hashes = [], []
    for threads, executor in (("1", "pool"), ("2", "pool"), ("3", "serial"), ("3", "threads")):
        proc = subprocess.run(
            [str(exe), *mods, "96", "2", threads, "2", executor],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = dict(x.split(" ", 1) for x in proc.stdout.splitlines() if " " in x)
        assert "attention TFLOPS" in proc.stdout, proc.stdout
        sums.append(float(out["checksum"]))
        hashes.append(out["hash"])
        if executor != "pool":  # 3 calls of 2 prepare phases and an attention
            assert out["executor"] == "launches 9", proc.stdout
    # equal, finite and not the checksum of an all-zero output
    assert len(set(hashes)) == 1 and len(set(sums)) == 1, (hashes, sums)
    assert math.isfinite(sums[0]) and sums[0] != 0.0, sums
    # a stream argument that is not an executor is refused with a message, never followed
    bad = subprocess.run(
        [str(exe), *mods, "96", "2", "2", "1", "bad"], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "the stream argument is not a SageCpuExecutor" in bad.stderr, bad.stderr


def test_cpu_ceiling_harness_runs_each_kind_exactly_where_the_backend_runs_its_tier(tmp_path):
    """op_benchmarks/cpu/bench_cpu_ceiling.cpp (the arithmetic units' thread-scaling ceiling)
    runs a kind exactly on the machines where the cpu backend runs the tier of that name,
    reporting a positive aggregate rate that is the per-thread rate times the thread count;
    elsewhere it exits 1 naming what the CPU lacks (never a SIGILL)."""
    exe = tmp_path / "bench_cpu_ceiling"
    build_host_program(exe, REPO / "op_benchmarks" / "cpu" / "bench_cpu_ceiling.cpp", "-pthread")
    for kind in ("amx", "avx512", "avx2"):
        proc = subprocess.run(
            [str(exe), kind, "1", "2"], capture_output=True, text=True, timeout=300
        )
        if not cpu_has_tier(kind):
            assert proc.returncode == 1 and "lacks" in proc.stderr, (kind, proc)
            continue
        assert proc.returncode == 0, (kind, proc.stdout + proc.stderr)
        lines = [x.split() for x in proc.stdout.splitlines()]
        assert [x[1] for x in lines] == ["threads=1", "threads=2"], proc.stdout
        for x in lines:
            threads, total, each = int(x[1].split("=")[1]), float(x[3]), float(x[6])
            assert total > 0 and math.isfinite(total), proc.stdout
            assert abs(total - threads * each) <= 1e-3 * total + 2e-3, proc.stdout
    bad = subprocess.run([str(exe), "sse9", "1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown kind" in bad.stderr


if __name__ == "__main__":
    run_as_script(__file__)


def test_accuracy_floor_exact_pass_equals_reference_model():
    """accuracy_floor.py's float64 pass over the prepared tensors is ref.py's quantized
    attention (the float32 model) up to arithmetic, on the model's 32-key tiles; both sit at the
    format's error against FP32 attention; and the script's table runs."""
    import torch

    from aiter_sage import ref

    sys.path.insert(0, str(REPO / "op_benchmarks"))
    import accuracy_floor

    s = 320
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, s, 2, 128, generator=g).to(torch.bfloat16) for _ in range(3))
    p = ref.prepare(q, k, v)
    exact = accuracy_floor.exact_from_prepared(p, s, kv_tile=ref.KERNEL_KV_TILE)
    model = ref.attention_from_prepared(p, s, s).double()
    want = ref.attention_fp32(q, k, v).double()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(exact, model) < 2e-3, rel(exact, model)  # a few e4m3 ties, BF16 output
    assert 0.02 < rel(exact, want) < 0.06 and 0.02 < rel(model, want) < 0.06
    proc = subprocess.run(
        [sys.executable, str(REPO / "op_benchmarks" / "accuracy_floor.py"), "-s", "96"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "| 96 | 8 |" in proc.stdout, proc.stdout + proc.stderr


def test_quant_granularity_model_is_the_contract_at_32_rows():
    """quant_granularity.py's model at Q / K blocks of 32 rows is exactly accuracy_floor's
    float64 pass over ref.prepare's tensors (smooth_k too), at 16 / 32 over those of
    ref.prepare(q_scale_rows=16), and on DiT-like inputs (outlier Q channels) Q blocks of 16
    rows leave a smaller error than the contract's 32."""
    import torch

    from aiter_sage import ref

    sys.path.insert(0, str(REPO / "op_benchmarks"))
    import accuracy_floor
    import bench_gfx1201_sage_attention as bench
    import quant_granularity as qg

    s = 512
    q, k, v = bench.make_inputs(1, 2, s, "cpu", dit=True)
    contract = accuracy_floor.exact_from_prepared(ref.prepare(q, k, v, smooth_k=True), s)
    model = qg.floor_at(q, k, v, 32, 32, smooth_k=True)
    assert torch.equal(model, contract)
    fine = accuracy_floor.exact_from_prepared(
        ref.prepare(q, k, v, smooth_k=True, q_scale_rows=16), s
    )
    assert torch.equal(qg.floor_at(q, k, v, 16, 32, smooth_k=True), fine)
    want = accuracy_floor.fp64_attention(q, k, v)
    e32, e16 = (
        accuracy_floor.rel_l2(qg.floor_at(q, k, v, b, 32, smooth_k=True), want) for b in (32, 16)
    )
    assert e16 < e32 - 0.001, (e16, e32)


def test_side_by_side_sweeps_report_the_median_and_the_spread():
    """side_by_side.py --sweeps: each provider's median TFLOPS over the sweeps, and our full
    call's speedup over SageAttention2 as its median with the lowest and highest sweep, so that
    "at least level" is read across sweeps rather than from one."""
    sys.path.insert(0, str(REPO / "op_benchmarks" / "nvidia"))
    import side_by_side as sbs

    rows = []
    for sweep, (ours, sa2, speedup) in enumerate(
        ((500, 510, 0.98), (530, 515, 1.03), (520, 512, 1.01))
    ):
        rows.append(
            {
                "shape": "D64",
                "provider": "sage",
                "tflops": ours,
                "rel_l2": 0.04,
                "speedup_vs_sage2": speedup,
                "sweep": sweep,
            }
        )
        rows.append(
            {"shape": "D64", "provider": "sage2", "tflops": sa2, "rel_l2": 0.05, "sweep": sweep}
        )
    merged = {r["provider"]: r for r in sbs.merge_sweeps(rows)}
    assert merged["sage"]["tflops"] == 520 and merged["sage2"]["tflops"] == 512
    assert merged["sage"]["speedups_vs_sage2"] == [0.98, 1.03, 1.01]
    assert sbs.speedup_cell(merged["sage"]) == "1.01× (0.98–1.03)"
    assert sbs.speedup_cell(rows[0]) == "0.98×" and sbs.speedup_cell(merged["sage2"]) == "–"
    text = sbs.table(list(merged.values()), ["sage", "sage2"], lambda r: f"{r['tflops']:.0f}")
    assert "| D64 | 520 | 512 |" in text
    with pytest.raises(SystemExit):  # a --shapes filter that picks nothing is an error, not a no-op
        sbs.main(["--shapes", "no such shape"])


def test_side_by_side_csv_merges_like_the_rows_it_was_written_from(tmp_path):
    """render_figures.py reads side_by_side.py's CSV back (read_rows) and merges its sweeps: the
    medians from the file equal those from the rows in memory, also over an even number of
    sweeps (a median of two cells of text cannot be taken) and for a provider whose rows have no
    speedup (empty cells in the file)."""
    sys.path.insert(0, str(REPO / "op_benchmarks" / "nvidia"))
    import side_by_side as sbs

    rows = []
    for sweep, (ours, sa2, speedup) in enumerate(((500.5, 510.0, 0.98), (531.0, 515.25, 1.03))):
        common = {"shape": "D64", "gpu": "card", "sweep": sweep}
        rows.append(
            {**common, "provider": "sage", "tflops": ours, "rel_l2": 0.0391,
             "speedup_vs_sage2": speedup}
        )  # fmt: skip
        rows.append({**common, "provider": "sage2", "tflops": sa2, "rel_l2": 0.0386})
    path = tmp_path / "side_by_side.csv"
    sbs.write_rows(path, rows)
    from_file = {r["provider"]: r for r in sbs.merge_sweeps(sbs.read_rows(path))}
    in_memory = {r["provider"]: r for r in sbs.merge_sweeps(rows)}
    for provider, want in in_memory.items():
        got = from_file[provider]
        for key in ("tflops", "rel_l2", "speedup_vs_sage2", "speedups_vs_sage2"):
            assert got.get(key) == want.get(key), (provider, key, got.get(key), want.get(key))
    assert from_file["sage"]["tflops"] == 515.75 and "speedup_vs_sage2" not in from_file["sage2"]
