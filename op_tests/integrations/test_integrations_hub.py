"""The Kernels Hub build (python3 -m aiter_sage.hub build DIR), loaded by the real ``kernels``
library (kernels==0.17.2, installed by .ci/install), offline:

* the layout and metadata as ``kernels`` parses them (variants, archs from jit/modules.py);
* ``get_local_kernel``, ``get_kernel(..., version=3)`` through ``LOCAL_KERNELS``, and the
  Hugging Face cache route (``get_kernel`` offline, ``load_kernel`` with a ``kernels.lock``);
* a tiny Flux transformer through diffusers' own ``sage_hub`` and ``aiter_fa2_hub`` backends,
  every attention call on the kernels (no SDPA fallback), against diffusers' native backend;
* a clear ImportError where aiter_sage is missing, and no OpNamespaceConflict when the Hub
  package is what first imports aiter_sage.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import aiter_sage
from aiter_sage import hub, jit_driver, ref
from aiter_sage.integrations import router

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
import integrations_flux as flux
from common import REPO, count_router_calls, run_as_script

KERNELS_VERSION = "0.17.2"
SAGE_REPO = "SageAttention/sage-attention"  # what diffusers' sage_hub loads (version 3)
FA2_REPO = "kernels-community/aiter-flash-attn-ck"  # what aiter_fa2_hub loads
try:
    import kernels
    from kernels import _rust as kernels_rust
except ImportError:
    kernels = kernels_rust = None


@pytest.fixture(scope="module", autouse=True)
def needs_kernels():
    # Per test (not at module level) so that under CI=true ci_policy fails the skip.
    if kernels is None:
        pytest.skip(f"kernels is not installed (pip install kernels=={KERNELS_VERSION})")


@pytest.fixture
def offline(monkeypatch):
    """No network: kernels and diffusers read huggingface_hub's offline flag."""
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def local_kernels(monkeypatch, **repos):
    from kernels import load

    value = ":".join(f"{repo}={path}" for repo, path in repos.items())
    monkeypatch.setenv("LOCAL_KERNELS", value)
    load._parse_local_kernel_overrides.cache_clear()


@pytest.fixture
def repo(tmp_path):
    hub.build(tmp_path / "repo")
    return tmp_path / "repo"


@pytest.fixture
def calls(monkeypatch):
    return count_router_calls(monkeypatch)


def qkv(b=1, s=96, h=4, d=64, layout="HND", seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (b, h, s, d) if layout == "HND" else (b, s, h, d)
    return tuple(torch.randn(shape, generator=g).bfloat16() for _ in range(3))


def assert_band(out, want):
    acc = ref.accuracy(out, want)
    assert not ref.band_failures(acc), (ref.band_failures(acc), acc)


# ------------------------------------------------------------------------------ the layout
def test_layout_and_metadata(repo):
    from kernels.variants import parse_variant, resolve_variant

    table = jit_driver.module_table()
    want_archs = {"rocm": list(table.GFX12_ARCHS), "cuda": ["9.0a"], "cpu": None}
    ids = set()
    for backend, archs in want_archs.items():
        vdir = repo / "build" / f"torch-{backend}"
        md = kernels_rust.Metadata.read_from_file(vdir / "metadata.json")
        assert str(md.backend.backend_type) == backend and md.backend.archs == archs
        assert md.version == hub.KERNEL_VERSION == 3 and md.license == "MIT"
        assert md.python_depends == []  # kernels' allow-list; aiter_sage is checked at import
        assert md.name.python_name == "aiter_sage_attention"
        assert (vdir / "aiter_sage_attention" / "__init__.py").is_file()
        assert parse_variant(vdir.name).variant_str == vdir.name
        ids.add(md.id)
    assert len(ids) == 3 and not any(i.split(".")[0] == "aiter_sage" for i in ids)
    # On this CPU-only torch the resolver picks the cpu variant.
    variants = [parse_variant(f"torch-{b}") for b in want_archs]
    chosen, _ = resolve_variant(variants)
    torch_backend = "rocm" if torch.version.hip else "cuda" if torch.version.cuda else "cpu"
    assert chosen.variant_str == f"torch-{torch_backend}"
    card = (repo / "README.md").read_text()
    assert "Requires the aiter_sage Python package" in card and "LOCAL_KERNELS" in card


def test_cli_build(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "aiter_sage.hub", "build", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "r" / "build" / "torch-cpu" / "metadata.json").is_file()
    assert "torch-rocm" in res.stdout


def test_cli_cache_prints_the_lock_entry(repo, tmp_path, capsys):
    argv = ["cache", str(repo), "--repo-id", SAGE_REPO, "--cache-dir", str(tmp_path / "c")]
    assert hub.main(argv) == 0
    printed = capsys.readouterr().out
    lock = kernels_rust.KernelLocks.from_json(printed[printed.index("[") :])
    commit = hub.tree_commit(repo)
    assert [(d.repo_id, lk.commit) for d, lk in lock.items()] == [(SAGE_REPO, commit)]
    snapshot = tmp_path / "c" / "kernels--SageAttention--sage-attention"
    assert (snapshot / "refs" / "v3").read_text() == commit
    assert (snapshot / "snapshots" / commit / "build" / "torch-cpu" / "metadata.json").is_file()


# ------------------------------------------------------------------------------ loading
def check_module(mod, calls):
    assert mod.sageattn is aiter_sage.sageattn
    assert mod.__aiter_sage_version__ == aiter_sage.__version__
    q, k, v = qkv()
    with torch.no_grad():
        out = mod.sageattn(q, k, v, tensor_layout="HND", is_causal=True, sm_scale=0.1)
    assert calls["kernel"] == 1 and not calls["fallback"]
    want = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, scale=0.1
    )
    assert_band(out, want)


def test_get_local_kernel(repo, offline, calls):
    from kernels import get_local_kernel

    check_module(get_local_kernel(repo), calls)


def test_get_kernel_version_3_through_local_kernels(repo, offline, calls, monkeypatch):
    from kernels import get_kernel

    local_kernels(monkeypatch, **{SAGE_REPO: repo})
    check_module(get_kernel(SAGE_REPO, version=3), calls)


def test_cache_snapshot_get_kernel_and_lockfile(repo, offline, calls, monkeypatch, tmp_path):
    """The repository as a Hugging Face cache snapshot: get_kernel(version=3) offline finds it
    by its v3 ref, load_kernel finds it by a kernels.lock."""
    from kernels import get_kernel, load_kernel, resolver

    cache = tmp_path / "cache"
    monkeypatch.setenv("KERNELS_CACHE", str(cache))
    monkeypatch.setattr(resolver, "CACHE_DIR", str(cache))
    monkeypatch.delenv("LOCAL_KERNELS", raising=False)
    commit = hub.install_into_cache(repo, SAGE_REPO, version=3)
    assert commit == hub.tree_commit(repo) and len(commit) == 40
    mod = get_kernel(SAGE_REPO, version=3)
    assert Path(mod.__file__).is_relative_to(cache / "kernels--SageAttention--sage-attention")
    check_module(mod, calls)
    lock = tmp_path / "kernels.lock"
    lock.write_text(hub.lock_json(SAGE_REPO, 3, commit))
    parsed = kernels_rust.KernelLocks.from_json(lock.read_text())
    assert [lk.commit for lk in parsed.values()] == [commit]
    assert load_kernel(SAGE_REPO, lockfile=lock).sageattn is aiter_sage.sageattn


def test_missing_aiter_sage_is_named(tmp_path, offline, monkeypatch):
    from kernels import get_local_kernel

    hub.build(tmp_path / "r")  # a fresh folder: kernels caches loaded variants by path
    monkeypatch.setitem(sys.modules, "aiter_sage", None)  # import aiter_sage now fails
    with pytest.raises(ImportError, match="needs the aiter_sage Python package installed"):
        get_local_kernel(tmp_path / "r")


def test_hub_package_first_import_no_namespace_conflict(repo):
    """The Hub package imports aiter_sage (registering torch.ops.aiter.*) before the program
    does, twice, under two module names: one registration, the installed package's."""
    code = f"""
        import sys
        from pathlib import Path
        import kernels
        assert "aiter_sage" not in sys.modules
        a = kernels.get_local_kernel(Path({str(repo)!r}))
        import shutil; shutil.copytree({str(repo)!r}, {str(repo)!r} + "_copy")
        b = kernels.get_local_kernel(Path({str(repo)!r} + "_copy"))
        import aiter_sage, torch
        assert a is not b and a.sageattn is b.sageattn is aiter_sage.sageattn
        q = torch.randn(1, 40, 2, 64).bfloat16()
        # registers and runs the ops; routed calls take 16-row Q scales (ROUTED_Q_SCALE_ROWS)
        out = aiter_sage.gfx1201_sage_attention(q, q, q, q_scale_rows=16)
        assert torch.equal(a.sageattn(q, q, q, tensor_layout="NHD", smooth_k=False), out)
        print("ONE", aiter_sage.__file__)
        """
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OpNamespaceConflict" not in res.stderr
    assert f"ONE {REPO / 'aiter_sage' / '__init__.py'}" in res.stdout


# ------------------------------------------------------------------------------ diffusers
@pytest.fixture
def diffusers_hub(repo, offline, monkeypatch):
    """diffusers' hub backends pointed at the built folder; their loaded-kernel cache reset."""
    ad = pytest.importorskip("diffusers.models.attention_dispatch")
    monkeypatch.setattr(ad, "HF_HUB_OFFLINE", True)
    for member in (ad.AttentionBackendName.SAGE_HUB, ad.AttentionBackendName.AITER_FA2_HUB):
        monkeypatch.setattr(ad._HUB_KERNELS_REGISTRY[member], "kernel_fn", None)
    local_kernels(monkeypatch, **{SAGE_REPO: repo, FA2_REPO: repo})
    return ad


@pytest.mark.parametrize("backend", ["sage_hub", "aiter_fa2_hub"])
def test_flux_through_diffusers_hub_backend(backend, diffusers_hub, calls):
    model = flux.build()
    native = flux.run(model, "native")
    assert calls["kernel"] == 0
    out = flux.run(model, backend)
    assert calls["kernel"] == 2 and not calls["fallback"]  # both blocks on the kernels
    acc = ref.accuracy(out, native)
    assert not ref.band_failures(acc) and acc["cosine"] >= 0.99, acc
    import aiter_sage.integrations.diffusers  # noqa: F401  (the registered backend)

    assert torch.equal(out, flux.run(model, "aiter_sage"))  # the same kernel calls
    from aiter_sage.integrations.flash_attn import flash_attn_func

    loaded = diffusers_hub._HUB_KERNELS_REGISTRY[diffusers_hub.AttentionBackendName(backend)]
    assert loaded.kernel_fn is {"sage_hub": aiter_sage.sageattn}.get(backend, flash_attn_func)


def test_flash_attn_func_call_forms(calls):
    from aiter_sage.integrations.flash_attn import flash_attn_func

    q, k, v = qkv(s=80, h=4, layout="NHD", seed=3)
    k, v = k[:, :, :2], v[:, :, :2]  # GQA: 2 key/value heads
    with torch.no_grad():
        out, lse = flash_attn_func(q=q, k=k, v=v, softmax_scale=0.2, causal=True, return_lse=True)
        out3 = flash_attn_func(q, k, v, 0.0, 0.2, True, return_attn_probs=True)
    assert calls["kernel"] == 2 and not calls["fallback"]
    assert torch.equal(out3[0], out) and torch.equal(out3[1], lse) and out3[2] is None
    qt, kt, vt = (t.float().transpose(1, 2) for t in (q, k, v))
    want = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=0.2, enable_gqa=True)
    assert_band(out, want.transpose(1, 2))
    want_lse = router.torch_lse(qt, kt, scale=0.2, is_causal=True)
    assert lse.shape == (1, 4, 80) and (lse - want_lse).abs().max() < 5e-2
    for bad, match in (
        (dict(window_size=(8, 8)), "window_size"),
        (dict(softcap=30.0), "softcap"),
        (dict(alibi_slopes=torch.ones(4)), "alibi"),
    ):
        with pytest.raises(ValueError, match=match):
            flash_attn_func(q, k, v, **bad)
    assert json.loads(hub.lock_json("a/b", 3, "0" * 40))[0]["lock"]["commit"] == "0" * 40


if __name__ == "__main__":
    run_as_script(__file__)
