"""One rank of the distributed-engine tests (test_integrations_engines.py), 2 gloo processes:

* yunchang's ``LongContextAttention`` (its real code, ``pip install yunchang``) with
  ``attn_type=AttnType.SAGE_AUTO``: yunchang imports ``sageattention`` at import time, which
  the shim answers, and calls ``sageattention.sageattn(q, k, v, tensor_layout="NHD",
  return_lse=True, dropout_p=, softmax_scale=, causal=, window_size=, softcap=,
  alibi_slopes=, return_softmax=)`` at every ring step; Ulysses (degree 2) and ring (degree 2),
  causal and not;
* xDiT's ring attention: torch's ``_templated_ring_attention`` driven as xfuser's ``ring_attn``
  drives it (load balancing off, seq_dim 1, the attention function called with
  ``dropout_p``/``is_causal``/``joint_attn_kwargs``/``attention_kwargs``), with the
  function xDiT's registry holds for ``--attention_backend sage_rdna4`` (xfuser itself
  needs triton to import: the registry here is a stand-in with its documented shape).

Each rank saves its rows of every output, and the number of router calls that ran the kernels
and that fell back to SDPA.
"""

from __future__ import annotations

import enum
import os
import sys
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
import _op_tests  # noqa: E402,F401  (op_tests/: common.py)

B, S, H, D = 1, 128, 4, 64  # S splits over 2 ranks, H over 2 Ulysses ranks
SCALE = 0.15
XDIT_NAME = "sage_rdna4"  # what a user passes to --attention_backend


def inputs(seed=7):
    """[B, S, H, D] BF16 q, k, v; scores of std ~2.4 (peakier than randn alone)."""
    g = torch.Generator().manual_seed(seed)
    q = (2.0 * torch.randn(B, S, H, D, generator=g)).bfloat16()
    k = torch.randn(B, S, H, D, generator=g).bfloat16()
    v = torch.randn(B, S, H, D, generator=g).bfloat16()
    return q, k, v


def xdit_standin():
    """xfuser.core.distributed.attention_backend's two names, as xDiT documents them: the
    enum ``--attention_backend`` names (upper-cased) and the registry of functions."""
    names = {"SDPA": "SDPA", "SAGE": "Sage Attention", "AITER_SAGE": "AITER Sage"}
    return types.SimpleNamespace(
        AttentionBackendType=enum.Enum("AttentionBackendType", names),
        ATTENTION_FUNCTION_REGISTRY={},
    )


def xdit_attention_function(module, backend_name: str):
    """What xDiT's USP runs for ``--attention_backend backend_name``: the registry's function
    for ``AttentionBackendType[name.upper()]``, called as its joint-tensor wrapper calls it
    (no joint tensors here)."""
    func = module.ATTENTION_FUNCTION_REGISTRY[module.AttentionBackendType[backend_name.upper()]]

    def wrapper(*args, **kwargs):
        q, k, v = args[:3]
        return func(
            q,
            k,
            v,
            dropout_p=kwargs.get("dropout_p"),
            is_causal=kwargs.get("is_causal"),
            attention_kwargs=kwargs.get("attention_kwargs"),
        )

    return wrapper


def yunchang_outputs(rank: int, world: int) -> dict:
    import sageattention
    import yunchang.globals
    from yunchang import LongContextAttention, set_seq_parallel_pg
    from yunchang.kernels import AttnType

    assert sageattention.__aiter_sage_shim__ and yunchang.globals.HAS_SAGE_ATTENTION
    q, k, v = inputs()
    rows = slice(rank * S // world, (rank + 1) * S // world)
    degrees = {"ulysses": (world, 1), "ring": (1, world)}
    saved = {}
    for mode, (ulysses, ring) in degrees.items():
        set_seq_parallel_pg(ulysses, ring, rank, world)
        attn = LongContextAttention(ring_impl_type="basic", attn_type=AttnType.SAGE_AUTO)
        for causal in (False, True):
            with torch.no_grad():
                out = attn(q[:, rows], k[:, rows], v[:, rows], causal=causal, softmax_scale=SCALE)
            saved[("yunchang", mode, causal)] = out.clone()
    return saved


def xdit_ring_outputs(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._attention import (
        _cp_options,
        _templated_ring_attention,
    )

    from aiter_sage.integrations import xdit

    module = xdit_standin()
    xdit.register(module)
    fn = xdit_attention_function(module, XDIT_NAME)
    q, k, v = (t.transpose(1, 2) for t in inputs())  # xDiT's USP works on [B, H, S, D]
    rows = slice(rank * S // world, (rank + 1) * S // world)
    _cp_options.enable_load_balance = False
    saved = {}
    for causal in (False, True):
        with torch.no_grad():
            out, lse, *_ = _templated_ring_attention(
                dist.group.WORLD,
                1,
                fn,
                q[:, :, rows],
                k[:, :, rows],
                v[:, :, rows],
                dropout_p=0.0,
                is_causal=causal,
                joint_attn_kwargs=None,
                attention_kwargs=None,
            )
        saved[("xdit", "ring", causal)] = out.clone()
        saved[("xdit_lse", "ring", causal)] = lse.clone()
    return saved


def worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from aiter_sage.integrations import enable_sageattention_shim

    from common import count_router_calls

    torch.set_num_threads(1)  # two ranks on a 2-core machine
    enable_sageattention_shim()  # before yunchang is imported: it looks for sageattention
    seen = count_router_calls()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        saved = yunchang_outputs(rank, world)
        saved.update(xdit_ring_outputs(rank, world))
        saved["calls"] = seen
        torch.save(saved, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--init", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    worker(a.rank, a.world, a.init, a.out)
