"""A tiny, randomly initialised diffusers FluxTransformer2DModel and its inputs (nothing is
downloaded), shared by test_integrations_diffusers.py and its context-parallel workers.

Run as a script it is one rank of a context-parallel run over torch.distributed (gloo on CPU,
or NCCL with rank r on GPU r with --device cuda):

    python3 op_tests/integrations/integrations_flux.py --mode ulysses|ring --rank R --world 2 \
        --init file:///tmp/x --out out.pt [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
import _op_tests  # noqa: E402,F401  (op_tests/: common.py)

IMG, TXT = 128, 32  # image and text tokens: both split evenly over 2 ranks


def build(
    seed=0, dtype=torch.bfloat16, heads=4, head_dim=64, layers=1, single_layers=1, qk_gain=3.0
):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=layers,
        num_single_layers=single_layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        guidance_embeds=False,
        axes_dims_rope=(16, 24, 24) if head_dim == 64 else (16, 56, 56),
    )
    # Sharpen the attention (random init gives near-uniform softmax rows): QK-norm weights of 3
    # give scores of std ~9, closer to a trained model's. The residual stream still dominates
    # the block outputs, so the context-parallel workers also check the attention op alone.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split(".")[-2] in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
                p.fill_(qk_gain)
    return model.to(dtype).eval()


def inputs(seed=1, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    img_ids = torch.zeros(IMG, 3)
    img_ids[:, 1] = torch.arange(IMG) // 16
    img_ids[:, 2] = torch.arange(IMG) % 16
    tensors = dict(
        hidden_states=torch.randn(1, IMG, 16, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(1, TXT, 64, generator=g).to(dtype),
        pooled_projections=torch.randn(1, 32, generator=g).to(dtype),
        timestep=torch.tensor([0.5]).to(dtype),
        img_ids=img_ids,
        txt_ids=torch.zeros(TXT, 3),
    )
    # return_dict=False: the context-parallel output hook expects tensors.
    return {**{n: t.to(device) for n, t in tensors.items()}, "return_dict": False}


def run(model, backend: str, device="cpu"):
    model.set_attention_backend(backend)
    with torch.no_grad():
        return model(**inputs(device=device))[0]


def attention_inputs(seed=2, s=IMG, heads=4, kv_heads=2, d=64, device="cpu"):
    """Peaky [B, S, H, D] attention inputs (scores of std ~3) with GQA, for the op alone."""
    g = torch.Generator().manual_seed(seed)
    q = (3 * torch.randn(1, s, heads, d, generator=g)).bfloat16()
    k = torch.randn(1, s, kv_heads, d, generator=g).bfloat16()
    v = torch.randn(1, s, kv_heads, d, generator=g).bfloat16()
    return q.to(device), k.to(device), v.to(device)


def worker(mode: str, rank: int, world: int, init: str, out: str, device: str = "cpu") -> None:
    """One rank. device "cpu": gloo; "cuda": NCCL, rank r on GPU r."""
    import torch.distributed as dist
    from diffusers import ContextParallelConfig

    import aiter_sage.integrations.diffusers  # noqa: F401  (registers "aiter_sage")

    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        torch.set_num_threads(1)  # two ranks on a 2-core machine
        # diffusers' enable_parallelism places rank r on device r %
        # torch.accelerator.device_count(), which is 0 without an accelerator: count the CPU as
        # the one device.
        if torch.accelerator.device_count() == 0:
            torch.accelerator.device_count = lambda: 1
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        model = build().to(device)
        model.set_attention_backend("aiter_sage")
        cfg = (
            ContextParallelConfig(ulysses_degree=world)
            if mode == "ulysses"
            else ContextParallelConfig(ring_degree=world)
        )
        model.enable_parallelism(config=cfg)
        with torch.no_grad():
            result = model(**inputs(device=device))[0]
        if hasattr(result, "wait"):  # the gathered output is an AsyncCollectiveTensor
            result = result.wait()
        result = torch.Tensor(result).clone().cpu()
        # The backend op alone under the model's context-parallel config: this rank's share of
        # the sequence in, this rank's rows of the output and of the merged LSE out.
        from aiter_sage.integrations.diffusers import aiter_sage_attention

        q, k, v = attention_inputs(device=device)
        rows = slice(rank * IMG // world, (rank + 1) * IMG // world)
        with torch.no_grad():
            o, lse = aiter_sage_attention(
                q[:, rows],
                k[:, rows],
                v[:, rows],
                return_lse=True,
                _parallel_config=model._parallel_config,
            )
        saved = dict(model=result, attn=o.cpu(), lse=lse.cpu())
        if mode == "ulysses":  # causal: whole sequences per rank, so it is supported
            with torch.no_grad():
                saved["causal"] = aiter_sage_attention(
                    q[:, rows],
                    k[:, rows],
                    v[:, rows],
                    is_causal=True,
                    _parallel_config=model._parallel_config,
                ).cpu()
        torch.save(saved, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("ulysses", "ring"), required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--init", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = ap.parse_args()
    worker(a.mode, a.rank, a.world, a.init, a.out, a.device)
