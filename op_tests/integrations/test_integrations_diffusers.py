"""The "aiter_sage" diffusers attention backend (diffusers==0.42.1, installed by .ci/install).

* a tiny randomly initialised FluxTransformer2DModel (1 double + 1 single block, head dim 64;
  nothing downloaded) with the aiter_sage backend against diffusers' native backend;
* the same model under context parallelism, Ulysses degree 2 and ring degree 2, in two
  processes over torch.distributed (gloo, CPU), against the single-process aiter_sage output;
* the backend function itself: GQA, causal, FP16, the LSE diffusers' ring merge reads
  ([B, S, H], natural log), and the SDPA fallback for masks (diffusers' 2-D mask rule).

Accuracy is judged with the band of aiter_sage/ref.py. The model's output has unit scale
(mean |x| about 0.5), so the band's absolute tolerance (0.3 + 0.25 |ref|) fits it.
"""

import multiprocessing
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from aiter_sage import backends, ref
from aiter_sage.integrations import router

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
import integrations_flux as flux
from common import run_as_script, skip_no_hardware

DIFFUSERS_VERSION = "0.42.1"
try:
    import diffusers

    import aiter_sage.integrations.diffusers as aiter_diffusers
except ImportError:
    diffusers = aiter_diffusers = None


@pytest.fixture(scope="module", autouse=True)
def needs_diffusers():
    # A per-test skip (not a module-level one) so that under CI=true ci_policy turns it into a
    # failure: .ci/install installs diffusers.
    if diffusers is None:
        pytest.skip(f"diffusers is not installed (pip install diffusers=={DIFFUSERS_VERSION})")


def assert_band(out, want):
    acc = ref.accuracy(out, want)
    assert not ref.band_failures(acc), (ref.band_failures(acc), acc)
    return acc


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls that reach the kernels (not SDPA)."""
    calls = []
    real = router.kernel_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(router, "kernel_attention", counting)
    return calls


@pytest.fixture(scope="module")
def model():
    return flux.build()


@pytest.fixture(scope="module")
def single_process_out(model):
    with torch.no_grad():
        return flux.run(model, "aiter_sage")


def test_version_and_registration():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    assert diffusers.__version__ == DIFFUSERS_VERSION
    member = aiter_diffusers.register()
    assert member is AttentionBackendName("aiter_sage") is AttentionBackendName.AITER_SAGE
    assert "aiter_sage" in {m.value for m in AttentionBackendName.__members__.values()}
    assert _AttentionBackendRegistry._backends[member] is aiter_diffusers.aiter_sage_attention
    assert _AttentionBackendRegistry._is_context_parallel_available(member)
    assert aiter_diffusers.register() is member  # idempotent


def test_flux_matches_native(model, single_process_out, kernel_calls):
    native = flux.run(model, "native")
    assert not kernel_calls
    ours = flux.run(model, "aiter_sage")
    assert len(kernel_calls) == 2  # one per block: every attention call ran the kernels
    assert torch.equal(ours, single_process_out)
    acc = assert_band(ours, native)
    assert acc["cosine"] >= 0.99


def test_attention_backend_context_manager(single_process_out):
    from diffusers import attention_backend

    fresh = flux.build()  # no set_attention_backend: the active backend decides
    with attention_backend("aiter_sage"), torch.no_grad():
        out = fresh(**flux.inputs())[0]
    assert torch.equal(out, single_process_out)


def _cp_output(mode, tmp_path, device="cpu"):
    """What each rank of a 2-rank context-parallel run (Ulysses or ring) saved."""
    init, out = f"file://{tmp_path}/init", str(tmp_path / "out.pt")
    # Forking after CUDA is initialised is unsafe: GPU ranks start fresh.
    if device == "cpu" and "fork" in multiprocessing.get_all_start_methods():
        # Forked ranks inherit the imported torch/diffusers/aiter_sage (seconds, not tens).
        ctx = multiprocessing.get_context("fork")
        procs = [ctx.Process(target=flux.worker, args=(mode, r, 2, init, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        for p in procs:
            if p.is_alive():
                p.kill()
        codes = [p.exitcode for p in procs]
    else:
        script = os.path.join(os.path.dirname(__file__), "integrations_flux.py")
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    script,
                    "--mode",
                    mode,
                    "--rank",
                    str(r),
                    "--init",
                    init,
                    "--out",
                    out,
                    "--device",
                    device,
                ]
            )
            for r in (0, 1)
        ]
        codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0], f"context-parallel ranks exited with {codes}"
    return [torch.load(f"{out}.{r}") for r in (0, 1)]


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_context_parallel_matches_single_process(mode, single_process_out, tmp_path):
    _check_context_parallel(mode, _cp_output(mode, tmp_path), single_process_out, "cpu")


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_context_parallel_on_two_gpus(mode, tmp_path):
    """The same over NCCL, rank r on GPU r, against the one-GPU output (on two GPUs that a
    backend serves, e.g. two H200s: the cuda backend)."""
    if torch.cuda.device_count() < 2 or not backends.BY_NAME["cuda"].serves(torch.device("cuda")):
        skip_no_hardware("two GPUs of a kind a backend serves")
    with torch.no_grad():
        single = flux.run(flux.build().to("cuda:0"), "aiter_sage", "cuda:0").cpu()
    _check_context_parallel(mode, _cp_output(mode, tmp_path, "cuda"), single, "cuda:0")


def _check_context_parallel(mode, ranks, single_process_out, device):
    # The model: every rank holds the gathered output.
    for r in ranks:
        assert r["model"].shape == single_process_out.shape
        assert_band(r["model"], single_process_out)
    # The attention op alone (peaky scores, GQA): the rows of both ranks together against the
    # single-process op, the FP32 truth, and the LSE of the scaled scores.
    q, k, v = flux.attention_inputs(device=device)
    with torch.no_grad():
        single, single_lse = aiter_diffusers.aiter_sage_attention(q, k, v, return_lse=True)
    single, single_lse = single.cpu(), single_lse.cpu()
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    cp = torch.cat([r["attn"] for r in ranks], dim=1)
    cp_lse = torch.cat([r["lse"] for r in ranks], dim=1)
    want, want_lse = truth(q, k, v)
    assert cp.shape == q.shape and cp_lse.shape == single_lse.shape == (1, flux.IMG, 4)
    assert_band(cp, single)
    assert_band(cp, want)
    # INT8 scores move this LSE (scores of std ~3) by up to ~0.1, the same on one process.
    single_err = (single_lse - want_lse).abs().max()
    assert (cp_lse - want_lse).abs().max() <= max(1.5 * single_err, 5e-2), single_err
    if mode == "ulysses":  # each rank runs whole sequences of half the heads: same numbers
        assert torch.equal(cp, single) and torch.equal(cp_lse, single_lse)
        causal = torch.cat([r["causal"] for r in ranks], dim=1)
        with torch.no_grad():
            want_causal = aiter_diffusers.aiter_sage_attention(
                *(t.to(device) for t in (q, k, v)), is_causal=True
            ).cpu()
        assert torch.equal(causal, want_causal)
        assert_band(causal, truth(q, k, v, is_causal=True)[0])


# ------------------------------------------------------------------------ the backend function
def bshd(b, sq, skv, hq, hkv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((b, sq, hq, d), generator=g).to(dtype)
    k = torch.randn((b, skv, hkv, d), generator=g).to(dtype)
    v = torch.randn((b, skv, hkv, d), generator=g).to(dtype)
    return q, k, v


def truth(q, k, v, *, is_causal=False, attn_mask=None):
    qt, kt, vt = (t.float().transpose(1, 2) for t in (q, k, v))
    gqa = qt.shape[1] != kt.shape[1]
    out = F.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=gqa
    )
    lse = router.torch_lse(qt, kt, is_causal=is_causal, attn_mask=attn_mask)
    return out.transpose(1, 2), lse.transpose(1, 2)


@pytest.mark.parametrize(
    "sq,skv,hq,hkv,d,causal,dtype",
    [
        (64, 64, 4, 4, 128, False, torch.bfloat16),
        (48, 80, 4, 2, 64, True, torch.float16),
        (40, 40, 6, 1, 64, False, torch.bfloat16),
    ],
)
def test_backend_function(sq, skv, hq, hkv, d, causal, dtype, kernel_calls):
    q, k, v = bshd(2, sq, skv, hq, hkv, d, dtype, seed=sq)
    want, want_lse = truth(q, k, v, is_causal=causal)
    fn = aiter_diffusers.aiter_sage_attention
    with torch.no_grad():
        out = fn(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
        out2, lse = fn(q, k, v, is_causal=causal, enable_gqa=hq != hkv, return_lse=True)
    assert len(kernel_calls) == 2
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, sq, hq) and lse.dtype == torch.float32  # what the ring merge reads
    assert_band(out, want)
    assert_band(out2, want)
    assert (lse - want_lse).abs().max() <= 5e-2


def test_backend_key_mask_runs_on_the_kernels_like_native(kernel_calls):
    """diffusers' [B, Skv] padding mask: the kernels with per-entry key lengths, in the band of
    the native backend (which broadcasts it to [B, 1, 1, Skv]), LSE of the kept keys."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    q, k, v = bshd(2, 32, 48, 2, 2, 64, seed=3)
    mask = torch.ones(2, 48, dtype=torch.bool)
    mask[0, 40:] = False  # [B, Skv]: diffusers' padding mask
    kw = dict(attn_mask=mask)
    native = dispatch_attention_fn(q, k, v, **kw, backend=AttentionBackendName.NATIVE)
    with torch.no_grad():
        ours = dispatch_attention_fn(q, k, v, **kw, backend=AttentionBackendName("aiter_sage"))
    assert len(kernel_calls) == 1
    assert_band(ours, native)
    with torch.no_grad():
        _, lse = aiter_diffusers.aiter_sage_attention(q, k, v, attn_mask=mask, return_lse=True)
    _, want_lse = truth(q, k, v, attn_mask=mask[:, None, None, :])
    assert (lse - want_lse).abs().max() <= 5e-2


def test_backend_reads_every_attention_kwarg(kernel_calls, monkeypatch):
    """diffusers' dispatcher drops a backend's unknown attention_kwargs unread; ours sees them
    all: flash-attn's names are read, SageAttention's tuning keywords ignored, anything else is
    a TypeError, and an unknown AITER_SAGE_BACKEND a ValueError (not an SDPA fallback)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    ours = AttentionBackendName("aiter_sage")
    q, k, v = bshd(1, 48, 48, 2, 2, 64, seed=5)
    with torch.no_grad():
        named = dispatch_attention_fn(q, k, v, is_causal=True, scale=0.3, backend=ours)
        alias = dispatch_attention_fn(
            q, k, v, attention_kwargs=dict(causal=True, softmax_scale=0.3), backend=ours
        )
        tuned = dispatch_attention_fn(
            q, k, v, is_causal=True, scale=0.3, attention_kwargs=dict(smooth_v=True), backend=ours
        )
    assert len(kernel_calls) == 3
    assert torch.equal(named, alias) and torch.equal(named, tuned)
    with pytest.raises(TypeError, match="'window_size'"):
        dispatch_attention_fn(q, k, v, attention_kwargs=dict(window_size=(8, 8)), backend=ours)
    with pytest.raises(TypeError, match="and its alias"):
        dispatch_attention_fn(
            q, k, v, is_causal=True, attention_kwargs=dict(causal=True), backend=ours
        )
    monkeypatch.setenv("AITER_SAGE_BACKEND", "bogus")
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        dispatch_attention_fn(q, k, v, backend=ours)


if __name__ == "__main__":
    run_as_script(__file__)
