"""aiter_sage.guards: a call that cannot fit is refused before anything is allocated, the byte
counts agree with what the binding allocates, and AITER_SAGE_CHECK=1 names the 32-row Q/K blocks
(16-row Q blocks with q_scale_rows=16) whose INT8 scale one outlier row sets."""

import warnings

import pytest
import torch

import aiter_sage
from aiter_sage import guards, ref

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import BACKENDS, child_json, run_as_script


def bshd(b, s, h, d=128, *, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((b, s, h, d), generator=g).to(dtype)


# ------------------------------------------------------------------------ refusing what can't fit
# The case in a child whose address space is capped a little above what it holds: an
# entry point that allocates before checking fails there with torch's allocator error (and
# without the cap would fill the machine until the OOM killer came); a guarded one raises
# aiter_sage's MemoryError first.
_HUGE_SCRIPT = """
import json, resource, sys, torch, aiter_sage
vm_kb = int(next(ln for ln in open("/proc/self/status") if ln.startswith("VmSize")).split()[1])
resource.setrlimit(resource.RLIMIT_AS, ((vm_kb + 4 * 1024 * 1024) * 1024,) * 2)
S = 1 << 24
q = torch.randn(1, 64, 8, 128).bfloat16()
k = torch.zeros(1, 1, 1, 128, dtype=torch.bfloat16).expand(1, S, 8, 128)
calls = {
    "gfx1201_sage_attention": lambda: aiter_sage.gfx1201_sage_attention(q, k, k),
    "gfx1201_sage_prepare": lambda: aiter_sage.gfx1201_sage_prepare(q, k, k),
    "sageattn": lambda: aiter_sage.sageattn(q, k, k, tensor_layout="NHD"),
    "sdpa": lambda: aiter_sage.sdpa(*(t.transpose(1, 2) for t in (q, k, k))),
    "torch.ops": lambda: torch.ops.aiter.gfx1201_sage_attention(q, k, k),
    "compiled": lambda: torch.compile(aiter_sage.gfx1201_sage_attention, backend="eager")(q, k, k),
}
res = {}
for name, call in calls.items():
    try:
        call()
        res[name] = ["ran", ""]
    except BaseException as e:
        res[name] = [type(e).__name__, str(e)]
print(json.dumps(res))
"""


def test_a_call_that_cannot_fit_is_refused_before_allocating():
    res = child_json(_HUGE_SCRIPT)
    for name, (kind, msg) in res.items():
        assert kind == "MemoryError", (name, kind, msg)
        assert msg.startswith("aiter_sage: ") and "would allocate 32.0 GiB" in msg, (name, msg)
        assert "of host memory is free" in msg and "nothing was allocated" in msg, (name, msg)


@pytest.fixture
def budgets(monkeypatch):
    """The byte counts the binding reports to its memory guard, one (op, Budget) per call."""
    seen = []
    real = guards.check_fits

    def recording(budget, device, op):
        seen.append((op, budget))
        return real(budget, device, op)

    monkeypatch.setattr(guards, "check_fits", recording)
    return seen


def test_the_limit_is_the_free_memory(monkeypatch, budgets):
    """Below the free memory a call runs; above it the same call is refused, naming both;
    direct torch.ops calls are guarded as the Python functions are."""
    q = bshd(1, 64, 2, seed=1)
    with torch.no_grad():
        aiter_sage.gfx1201_sage_attention(q, q, q)
    need = budgets[-1][1].total
    monkeypatch.setattr(guards, "host_free_bytes", lambda: (need, "test"))
    with torch.no_grad():
        aiter_sage.gfx1201_sage_attention(q, q, q)
    monkeypatch.setattr(guards, "host_free_bytes", lambda: (need - 1, "test"))
    with pytest.raises(MemoryError, match=r"but only .* of host memory is free \(test\)"):
        aiter_sage.gfx1201_sage_attention(q, q, q)
    with pytest.raises(MemoryError):
        torch.ops.aiter.gfx1201_sage_attention(q, q, q)
    with pytest.raises(MemoryError):
        aiter_sage.sageattn(q, q, q, tensor_layout="NHD")
    monkeypatch.setattr(guards, "host_free_bytes", lambda: (1 << 40, "test"))
    p = aiter_sage.gfx1201_sage_prepare(q[:, :32], q[:, :32], q[:, :32])
    monkeypatch.setattr(guards, "host_free_bytes", lambda: (0, "test"))
    with pytest.raises(MemoryError, match="gfx1201_sage_attention_fwd would allocate"):
        aiter_sage.gfx1201_sage_attention_fwd(*p, 32)


def test_gpu_free_memory_reads_the_allocator_only_when_the_driver_falls_short(monkeypatch):
    """device_free_bytes: the driver's free figure, plus what torch's caching allocator holds
    unused when a call needs more than the driver has free. Reading the allocator builds torch's
    whole memory_stats dict (twice): 160 us per call on an H100 host, more than the attention
    kernel's host budget at S 4096, so a call that fits the driver's figure must not read it."""
    reads = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (100, 1000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: reads.append(d) or 70)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 30)
    dev = torch.device("cuda", 0)
    assert guards.device_free_bytes(dev, need=100)[0] == 100 and not reads
    assert guards.device_free_bytes(dev, need=101)[0] == 140 and reads
    assert guards.device_free_bytes(dev)[0] == 140
    guards.check_fits(guards.Budget(60, 40, 0), dev, "op")  # 100: the driver's figure
    guards.check_fits(guards.Budget(100, 40, 0), dev, "op")  # 140 with the allocator's 40
    with pytest.raises(MemoryError, match=r"141 B .* but only 140 B of memory on cuda:0"):
        guards.check_fits(guards.Budget(101, 40, 0), dev, "op")


def test_validation_comes_before_the_memory_check():
    """An input the contract refuses gets its own error, whatever its size would need."""
    q = bshd(1, 32, 2, seed=2)
    too_long = q[:, :1].expand(1, 2**26, 2, 128)
    with pytest.raises(ValueError, match="sequence lengths must be <="):
        aiter_sage.gfx1201_sage_attention(too_long, q, q)


@pytest.mark.parametrize(
    "sq,skv,hq,hkv,d,pv,smooth,q_rows",
    [
        (40, 70, 4, 2, 128, "fp8", False, 32),
        (33, 33, 2, 2, 72, "fp16", True, 32),
        (64, 96, 3, 1, 64, "fp8", True, 32),
        (40, 70, 4, 2, 128, "fp8", True, 16),  # 16-row Q scales: twice q_scale's bytes
    ],
)
def test_budgets_count_what_the_binding_returns(budgets, sq, skv, hq, hkv, d, pv, smooth, q_rows):
    """The prepared tensors a call returns are exactly the budget's, less the scratch that
    stays inside the binding (the GPU prepare's V amax partials, the smoothing's K mean and
    LSE term); the output is exactly the budget's output."""
    q, k, v = bshd(2, sq, hq, d, seed=2), bshd(2, skv, hkv, d, seed=3), bshd(2, skv, hkv, d, seed=4)
    kw = dict(smooth_k=smooth, q_scale_rows=q_rows)
    prepared = aiter_sage.gfx1201_sage_prepare(q, k, v, pv_dtype=pv, **kw)
    assert prepared.q_scale.shape[-1] == ref.padded_len(sq) // q_rows
    op, b = budgets[-1]
    assert op == "gfx1201_sage_prepare"
    dp = ref.padded_head_dim(d)
    scratch = 2 * hkv * 16 * dp * 4  # SAGE_V_AMAX_SPLITS partial maxima per channel
    if smooth:
        scratch += 2 * hkv * dp * 4 + 2 * hq * ref.padded_len(sq) * 4
    assert b.prepared - scratch == sum(t.nbytes for t in prepared) and b.copies == 0
    out, lse = aiter_sage.gfx1201_sage_attention(q, k, v, return_lse=True, **kw)
    op, a = budgets[-1]
    assert op == "gfx1201_sage_attention" and a.output == out.nbytes + lse.nbytes
    assert a.prepared == b.prepared or pv == "fp16"  # the attention's own prepare is FP8 P.V
    fwd = aiter_sage.gfx1201_sage_attention_fwd(*prepared, sq, kv_len=skv, return_lse=True)
    op, f = budgets[-1]
    assert op == "gfx1201_sage_attention_fwd" and f.output == sum(t.nbytes for t in fwd)
    assert f.prepared == 0


def test_alignment_copies_are_counted_where_the_binding_makes_them(budgets):
    if "emu" not in BACKENDS:
        pytest.skip("the emulator backend is not present")
    x = bshd(1, 64, 2, 72, seed=5)
    view = x[..., 1:65]  # rows at a 2-byte offset: copied for the 128-bit loads of emu / GPUs
    aiter_sage.gfx1201_sage_prepare(view, view, view, backend="cpu")
    assert budgets[-1][1].copies == 0
    aiter_sage.gfx1201_sage_prepare(view, view, view, backend="emu")
    assert budgets[-1][1].copies == 3 * view.numel() * 2
    # an expanded key (stride 0 on the sequence) meets the rule: read in place, not copied
    fresh = bshd(1, 64, 2, 64, seed=6)
    expanded = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16).expand(1, 4096, 2, 64)
    aiter_sage.gfx1201_sage_prepare(fresh, expanded, expanded, backend="emu")
    assert budgets[-1][1].copies == 0


# ------------------------------------------------------------------------------ outlier blocks
def _with_outlier(seed=7, row=37, times=30.0):
    q = bshd(1, 96, 2, seed=seed)
    q[0, row, 1] = (q[0, row, 1].float() * times).bfloat16()
    return q


def test_outlier_blocks_finds_the_block_of_a_scaled_row():
    q = _with_outlier()
    hits = guards.outlier_blocks(q)
    assert [(b, h, blk) for b, h, blk, _ in hits] == [(0, 1, 1)]  # row 37: block 1 of head 1
    assert 15 < hits[0][3] < 60
    assert guards.outlier_blocks(bshd(1, 96, 2, seed=7)) == []  # randn rows: no block
    zero = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    zero[0, 3] = 1.0  # one row in zeros: no other row of its block has anything to lose
    assert guards.outlier_blocks(zero) == []


def test_the_outlier_costs_what_the_warning_says():
    """The other 31 rows of the outlier's block lose INT8 precision (rel L2 several times
    the rest): the property the warning is about, measured on the cpu kernels."""
    q = _with_outlier()
    k, v = bshd(1, 96, 2, seed=8), bshd(1, 96, 2, seed=9)
    with torch.no_grad():
        out = aiter_sage.gfx1201_sage_attention(q, k, v).float()
    want = ref.attention_fp32(q, k, v)

    def rel(rows):
        d = out[0, rows, 1] - want[0, rows, 1]
        return float(d.norm() / want[0, rows, 1].norm())

    block = [r for r in range(32, 64) if r != 37]
    assert rel(block) > 3 * rel(list(range(64, 96)))


def test_16_row_q_scales_keep_the_outlier_in_its_half():
    """With q_scale_rows=16 the outlier (row 37) sets the scale of rows 32-47 only: their
    error stays several times the rest, rows 48-63 are as accurate as the rows of other blocks
    (about 3x better than at 32-row scales), and the check names the 16-row block."""
    q = _with_outlier()
    k, v = bshd(1, 96, 2, seed=8), bshd(1, 96, 2, seed=9)
    want = ref.attention_fp32(q, k, v)

    def rel(out, rows):
        d = out[0, rows, 1].float() - want[0, rows, 1]
        return float(d.norm() / want[0, rows, 1].norm())

    with torch.no_grad():
        out32 = aiter_sage.gfx1201_sage_attention(q, k, v)
        out16 = aiter_sage.gfx1201_sage_attention(q, k, v, q_scale_rows=16)
    near = [r for r in range(32, 48) if r != 37]
    far, other = list(range(48, 64)), list(range(64, 96))
    assert rel(out16, near) > 3 * rel(out16, other)
    assert rel(out16, far) < 1.5 * rel(out16, other) and rel(out16, far) < rel(out32, far) / 2
    hits = guards.outlier_blocks(q, block=16)
    assert [(b, h, blk) for b, h, blk, _ in hits] == [(0, 1, 2)]  # rows 32-47


def test_check_warns_naming_outlier_blocks(monkeypatch):
    q = _with_outlier()
    k = bshd(1, 96, 2, seed=10)
    monkeypatch.setenv("AITER_SAGE_CHECK", "1")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with torch.no_grad():
            aiter_sage.gfx1201_sage_attention(q, k, k)
            aiter_sage.sageattn(q, k, k, tensor_layout="NHD")
    msgs = [str(w.message) for w in got if issubclass(w.category, guards.SageOutlierWarning)]
    assert len(msgs) == 2, msgs
    # the op's 32-row block, then the routed call's 16-row one (router.ROUTED_Q_SCALE_ROWS)
    for m, rows in zip(msgs, ("32-63", "32-47")):
        assert "1 query block(s)" in m and f"(batch 0, head 1, rows {rows}:" in m, m
    # 16-row Q scales: the 16-row block is named
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with torch.no_grad():
            aiter_sage.gfx1201_sage_attention(q, k, k, q_scale_rows=16)
    msgs = [str(w.message) for w in got if issubclass(w.category, guards.SageOutlierWarning)]
    assert len(msgs) == 1 and "(batch 0, head 1, rows 32-47:" in msgs[0], msgs
    # K outliers are named as key blocks; without AITER_SAGE_CHECK nothing is said.
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with torch.no_grad():
            aiter_sage.gfx1201_sage_attention(k, q, k)
    msgs = [str(w.message) for w in got if issubclass(w.category, guards.SageOutlierWarning)]
    assert len(msgs) == 1 and "1 key block(s)" in msgs[0], msgs
    monkeypatch.delenv("AITER_SAGE_CHECK")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with torch.no_grad():
            aiter_sage.gfx1201_sage_attention(q, k, k)
    assert not [w for w in got if issubclass(w.category, guards.SageOutlierWarning)]


def test_check_looks_at_what_prepare_quantizes(monkeypatch):
    """With the norm's weights, rows are normalized before quantization: a scaled row is no
    outlier there, and no warning is given."""
    monkeypatch.setenv("AITER_SAGE_CHECK", "1")
    q = _with_outlier()
    w = torch.ones(128, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with torch.no_grad():
            aiter_sage.gfx1201_sage_attention(q, q, q, query_weight=w, key_weight=w)
    assert not [w for w in got if issubclass(w.category, guards.SageOutlierWarning)]


def test_emu_backend_is_guarded_too(monkeypatch):
    if "emu" not in BACKENDS:
        pytest.skip("the emulator backend is not present")
    q = bshd(1, 32, 1, seed=11)
    monkeypatch.setattr(guards, "host_free_bytes", lambda: (0, "test"))
    with pytest.raises(MemoryError):
        aiter_sage.gfx1201_sage_attention(q, q, q, backend="emu")


if __name__ == "__main__":
    run_as_script(__file__)
