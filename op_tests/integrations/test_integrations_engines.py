"""The distributed DiT engines' attention paths, each with its real code where it installs here:

* yunchang (``pip install --no-deps yunchang==0.6.4``, installed by .ci/install): its real
  ``LongContextAttention``, Ulysses and ring, causal and not, over 2 gloo processes, with
  ``AttnType.SAGE_AUTO`` reaching aiter_sage through the ``sageattention`` shim;
* xDiT's ring attention: torch's real ``_templated_ring_attention`` driven as xfuser drives
  it, with the function registered for ``--attention_backend sage_rdna4``; xfuser itself
  cannot be imported here (it needs triton), so its registry is a stand-in of the documented
  shape (op_tests/integrations/integrations_engines.py) — a faithful call, not xfuser's code;
* vLLM-Omni (needs vLLM and its own torch: not installed): the plugin entry point from
  pyproject.toml loaded as vLLM-Omni loads its ``vllm_omni.general_plugins``, against a
  stand-in of ``register_diffusion_backend``'s documented interface, and the backend class
  called as vLLM-Omni's attention layer calls it — a faithful call.

Results are judged against FP32 SDPA with the band of aiter_sage/ref.py, and every call is
checked to have run the kernels (no SDPA fallback) where the kernels serve it.
"""

import importlib.metadata
import os
import subprocess
import sys
import types

import pytest
import tomllib
import torch
import torch.nn.functional as F

import aiter_sage
from aiter_sage import ref
from aiter_sage.integrations import router, vllm_omni, xdit

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
import integrations_engines as engines
from common import REPO, count_router_calls, run_as_script

YUNCHANG_VERSION = "0.6.4"
WORLD = 2


def assert_band(out, want):
    acc = ref.accuracy(out, want)
    assert not ref.band_failures(acc), (ref.band_failures(acc), acc)
    return acc


def truth_nhd(q, k, v, *, is_causal=False, scale=None, attn_mask=None):
    qt, kt, vt = (t.float().transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        qt, kt, vt, is_causal=is_causal, scale=scale, attn_mask=attn_mask, enable_gqa=True
    )
    return out.transpose(1, 2)


@pytest.fixture
def calls(monkeypatch):
    return count_router_calls(monkeypatch)


# ------------------------------------------------------------------ 2 gloo processes
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' saved outputs (integrations_engines.py, fresh interpreters: yunchang
    must be imported after the shim is enabled)."""
    try:
        importlib.metadata.version("yunchang")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            f"yunchang is not installed (pip install --no-deps yunchang=={YUNCHANG_VERSION})"
        )
    tmp = tmp_path_factory.mktemp("engines")
    init, out = f"file://{tmp}/init", str(tmp / "out.pt")
    script = os.path.join(os.path.dirname(__file__), "integrations_engines.py")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                script,
                "--rank",
                str(r),
                "--world",
                str(WORLD),
                "--init",
                init,
                "--out",
                out,
            ],
            env=env,
        )
        for r in range(WORLD)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:  # a rank that hangs (its peer died) must not outlive the test
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * WORLD, f"ranks exited with {codes}"
    return [torch.load(f"{out}.{r}") for r in range(WORLD)]


def test_every_rank_call_ran_the_kernels(ranks):
    # yunchang: Ulysses 1 call per (causal), ring 2 steps non-causal and rank+1 causal; xDiT ring
    # the same: rank 0 makes 1 + 1 + 2 + 1 + 2 + 1 = 8 calls, rank 1 1 + 1 + 2 + 2 + 2 + 2 = 10.
    assert [r["calls"]["kernel"] for r in ranks] == [8, 10]
    assert all(not r["calls"]["fallback"] for r in ranks)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_yunchang_long_context_attention(ranks, mode, causal):
    q, k, v = engines.inputs()
    out = torch.cat([r[("yunchang", mode, causal)] for r in ranks], dim=1)
    assert out.shape == q.shape and out.dtype == q.dtype
    with torch.no_grad():
        single = aiter_sage.sageattn(
            q, k, v, tensor_layout="NHD", is_causal=causal, sm_scale=engines.SCALE
        )
    want = truth_nhd(q, k, v, is_causal=causal, scale=engines.SCALE)
    acc, single_acc = assert_band(out, want), ref.accuracy(single, want)
    if mode == "ulysses":  # whole sequences of half the heads per rank: the same numbers
        assert torch.equal(out, single)
    else:  # the LSE merge of 2 partial results is as good as one process
        assert acc["rel_l2"] <= 1.1 * single_acc["rel_l2"], (acc, single_acc)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_xdit_ring_attention(ranks, causal):
    q, k, v = engines.inputs()
    out = torch.cat([r[("xdit", "ring", causal)] for r in ranks], dim=2).transpose(1, 2)
    lse = torch.cat([r[("xdit_lse", "ring", causal)] for r in ranks], dim=2)
    want = truth_nhd(q, k, v, is_causal=causal)  # xDiT passes no scale: D^-0.5
    acc = assert_band(out, want)
    with torch.no_grad():
        single = aiter_sage.sageattn(q, k, v, tensor_layout="NHD", is_causal=causal)
    assert acc["rel_l2"] <= 1.1 * ref.accuracy(single, want)["rel_l2"]
    qt, kt = q.float().transpose(1, 2), k.float().transpose(1, 2)
    want_lse = router.torch_lse(qt, kt, is_causal=causal)
    assert lse.shape == want_lse.shape and (lse - want_lse).abs().max() < 5e-2


# ------------------------------------------------------------------ xDiT, one process
def test_xdit_registry(calls):
    module = engines.xdit_standin()
    before = list(module.AttentionBackendType)
    member = xdit.register(module)
    assert xdit.register(module) is member  # idempotent
    assert member is module.AttentionBackendType[engines.XDIT_NAME.upper()]
    assert member is module.AttentionBackendType(xdit.BACKEND_VALUE)
    assert list(module.AttentionBackendType) == [*before, member]
    assert module.ATTENTION_FUNCTION_REGISTRY == {member: xdit.attention}
    fn = engines.xdit_attention_function(module, engines.XDIT_NAME)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 72, 64, generator=g).bfloat16()  # [B, H, S, D], GQA 4:2
    k, v = (torch.randn(1, 2, 72, 64, generator=g).bfloat16() for _ in range(2))
    with torch.no_grad():
        out, lse = fn(q, k, v, dropout_p=0.0, is_causal=True, joint_attn_kwargs=None)
    assert calls["kernel"] == 1 and not calls["fallback"]
    nhd = [t.transpose(1, 2) for t in (q, k, v)]
    assert_band(out.transpose(1, 2), truth_nhd(*nhd, is_causal=True))
    assert lse.shape == (1, 4, 72) and lse.dtype == torch.float32
    # A key mask in attention_kwargs is honoured (SDPA today, the kernels once they take masks).
    mask = torch.ones(1, 1, 1, 72, dtype=torch.bool)
    mask[..., 60:] = False
    with torch.no_grad():
        masked, _ = fn(
            q, k, v, dropout_p=0.0, is_causal=False, attention_kwargs={"attn_mask": mask}
        )
    assert_band(masked.transpose(1, 2), truth_nhd(*nhd, attn_mask=mask))
    with pytest.raises(ValueError, match="indices_k"):
        fn(
            q,
            k,
            v,
            dropout_p=0.0,
            is_causal=False,
            attention_kwargs={"indices_k": torch.arange(60)},
        )


# ------------------------------------------------------------------ vLLM-Omni
def write_vllm_omni_standin(root):
    """``vllm_omni.diffusion.attention.backends.registry`` with the documented interface: the
    backend enum whose values are class paths, ``register_diffusion_backend(backend,
    class_path)`` recording an override, and ``get_class()`` honouring it."""
    pkg = root / "vllm_omni" / "diffusion" / "attention" / "backends"
    pkg.mkdir(parents=True)
    for d in (pkg, *pkg.parents[:3]):
        (d / "__init__.py").write_text("")
    (pkg / "registry.py").write_text(
        "import enum, importlib\n"
        "OVERRIDES = {}\n"
        "class DiffusionAttentionBackendEnum(enum.Enum):\n"
        "    TORCH_SDPA = 'vllm_omni.diffusion.attention.backends.sdpa.SDPABackend'\n"
        "    SAGE_ATTN = 'vllm_omni.diffusion.attention.backends.sage_attn.SageAttentionBackend'\n"
        "    def get_path(self):\n"
        "        return OVERRIDES.get(self, self.value)\n"
        "    def get_class(self):\n"
        "        mod, _, cls = self.get_path().rpartition('.')\n"
        "        return getattr(importlib.import_module(mod), cls)\n"
        "def register_diffusion_backend(backend, class_path=None):\n"
        "    OVERRIDES[backend] = class_path\n"
    )


@pytest.fixture
def vllm_omni_standin(tmp_path, monkeypatch):
    write_vllm_omni_standin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] == "vllm_omni"]:
        monkeypatch.delitem(sys.modules, name)
    yield tmp_path
    for name in [m for m in sys.modules if m.split(".")[0] == "vllm_omni"]:
        del sys.modules[name]


def plugin_entry_point():
    """The entry point pyproject.toml declares, as importlib.metadata hands it to vLLM-Omni."""
    with open(REPO / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    ((name, value),) = project["entry-points"]["vllm_omni.general_plugins"].items()
    return importlib.metadata.EntryPoint(name=name, value=value, group="vllm_omni.general_plugins")


def test_vllm_omni_plugin_backend(vllm_omni_standin, calls):
    from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

    assert plugin_entry_point().load()() is True  # what load_omni_general_plugins does
    cls = DiffusionAttentionBackendEnum["SAGE_ATTN"].get_class()
    assert cls is vllm_omni.AiterSageAttentionBackend and cls.get_name() == "SAGE_ATTN"
    assert 64 in cls.get_supported_head_sizes() and 256 not in cls.get_supported_head_sizes()
    impl = cls.get_impl_cls()(
        num_heads=4, head_size=64, softmax_scale=0.11, causal=True, num_kv_heads=2, prefix="blk.0"
    )
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 80, 4, 64, generator=g).bfloat16()  # [B, S, H, D]
    k, v = (torch.randn(2, 80, 2, 64, generator=g).bfloat16() for _ in range(2))
    with torch.no_grad():
        out = impl.forward(q, k, v, None)
        assert torch.equal(impl.forward_hip(q, k, v), out)
    assert calls["kernel"] == 2 and not calls["fallback"]
    assert out.shape == q.shape
    assert_band(out, truth_nhd(q, k, v, is_causal=True, scale=0.11))
    # attn_metadata.attn_mask: a [B, Skv] key-padding mask, honoured.
    mask = torch.ones(2, 80, dtype=torch.bool)
    mask[1, 50:] = False
    full = cls.get_impl_cls()(num_heads=4, head_size=64, softmax_scale=0.11, num_kv_heads=2)
    with torch.no_grad():
        masked = full.forward(q, k, v, types.SimpleNamespace(attn_mask=mask))
    assert_band(masked, truth_nhd(q, k, v, scale=0.11, attn_mask=mask[:, None, None, :]))
    with pytest.raises(TypeError, match="'bogus'"):
        cls.get_impl_cls()(4, 64, 0.11, backend_kwargs={"bogus": 1})


def test_vllm_omni_plugin_leaves_a_real_sageattention(vllm_omni_standin, tmp_path, monkeypatch):
    real = tmp_path / "real"
    (real / "sageattention").mkdir(parents=True)
    (real / "sageattention" / "__init__.py").write_text("def sageattn(*a, **k):\n    pass\n")
    monkeypatch.syspath_prepend(str(real))
    from vllm_omni.diffusion.attention.backends import registry

    assert plugin_entry_point().load()() is False
    assert registry.OVERRIDES == {}


# ------------------------------------------------------------------ flash-attn's keywords
def test_flash_attn_neutral_keywords(calls):
    """What yunchang's ring passes beside q, k, v: read, accepted at their neutral values."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 48, 2, 64, generator=g).bfloat16() for _ in range(3))
    neutral = dict(window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_softmax=False)
    with torch.no_grad():
        plain = aiter_sage.sageattn(q, k, v, tensor_layout="NHD", is_causal=True)
        flash = aiter_sage.sageattn(q, k, v, tensor_layout="NHD", causal=True, **neutral)
    assert torch.equal(plain, flash) and calls["kernel"] == 2
    for name, value in (("window_size", (16, 0)), ("softcap", 50.0), ("return_softmax", True)):
        with pytest.raises(TypeError, match=f"'{name}'"):
            aiter_sage.sageattn(q, k, v, tensor_layout="NHD", **{name: value})
    with pytest.raises(TypeError, match="'alibi_slopes'"):
        aiter_sage.sdpa(q, k, v, alibi_slopes=torch.ones(2))


if __name__ == "__main__":
    run_as_script(__file__)
