"""Tiny HunyuanVideo, QwenImage and LTX transformers (diffusers' test configurations, built in
code) with padded prompts: every attention call runs on the kernels — none on torch SDPA —
through aiter_sage.integrations.diffusers.enable(), and the output is in the band of
diffusers' native backend."""

import integrations_masked_models as mm
import pytest
import torch

from aiter_sage import ref
from aiter_sage.integrations import diffusers as aiter_diffusers
from aiter_sage.integrations import router

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import count_router_calls, run_as_script


@pytest.fixture
def routes(monkeypatch):
    """The router's kernel calls and SDPA fallback reasons."""
    return count_router_calls(monkeypatch)


@pytest.mark.parametrize("name", sorted(mm.MODELS))
def test_padded_prompts_run_on_the_kernels(name, routes):
    model, inputs = mm.MODELS[name]()
    assert not bool(
        inputs.get("encoder_attention_mask", inputs.get("encoder_hidden_states_mask")).all()
    )
    model.set_attention_backend("native")
    with torch.no_grad():
        native = model(**inputs)[0]
    assert not routes["kernel"]
    handle = aiter_diffusers.enable(model)
    try:
        with torch.no_grad():
            ours = model(**inputs)[0]
    finally:
        handle.remove()
    assert routes["kernel"] and not routes["fallback"], routes["fallback"]
    acc = ref.accuracy(ours.float(), native.float())
    assert not ref.band_failures(acc), (ref.band_failures(acc), acc)
    assert acc["cosine"] >= 0.99, acc


def test_enable_removes_cleanly(routes):
    model, inputs = mm.MODELS["qwen_image"]()
    aiter_diffusers.enable(model).remove()
    with torch.no_grad():
        model(**inputs)
    assert not routes["kernel"]  # the default backend again, and no route_sdpa left behind
    assert torch.nn.functional.scaled_dot_product_attention is not router.sdpa


def test_enable_takes_a_pipeline_like_object(routes):
    model, inputs = mm.MODELS["ltx"]()

    class Pipe:
        components = {"transformer": model, "scheduler": object()}

    handle = aiter_diffusers.enable(Pipe())
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    assert routes["kernel"]
    with pytest.raises(TypeError, match="pipeline or a torch.nn.Module"):
        aiter_diffusers.enable(object())


if __name__ == "__main__":
    run_as_script(__file__)
