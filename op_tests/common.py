"""Shared pieces of the op tests: which backends are present, inputs, and the script runner.

Every test file runs under pytest and as `python op_tests/test_x.py` (which calls pytest on
itself). Backends are the ones present: `cpu` wherever a C++ compiler exists, `emu` where
clang and the gfx12 sources exist, `gfx12` on an RDNA4 GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable from a checkout without installing
    sys.path.insert(0, str(REPO))

import aiter_sage  # noqa: E402
from aiter_sage import jit_driver  # noqa: E402

# Shapes the emulator can run quickly (it executes every lane of every wave on the CPU).
EMU_MAX_SEQ = 512


def present_backends() -> list[str]:
    found = aiter_sage.available_backends()
    gfx12 = jit_driver.csrc_dir() / "gfx12"
    if "emu" in found and not (gfx12 / "prepare.hip").exists():
        found.remove("emu")
    return found


BACKENDS = present_backends()


def backend_params():
    return [pytest.param(b, id=b) for b in BACKENDS]


def device_for(backend: str) -> str:
    return "cuda" if backend == "gfx12" else "cpu"


def skip_no_hardware(what: str) -> None:
    """Skip because a piece of hardware is absent: the only skip CI allows (ci_policy.py)."""
    from ci_policy import HARDWARE_PREFIX

    pytest.skip(HARDWARE_PREFIX + what)


def skip_if_too_big(backend: str, *seq_lens: int, heads: int = 1, batch: int = 1) -> None:
    if backend == "emu" and (max(seq_lens) > EMU_MAX_SEQ or heads > 2 or batch > 2):
        pytest.skip("shape too large for the emulator in CI (B,H <= 2, S <= 512)")


def randn_bshd(b, s, h, *, seed, scale=1.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((b, s, h, 128), generator=g) * scale
    return x.to(torch.bfloat16).to(device)


def qkv(b, sq, skv, h, *, seed=0, device="cpu"):
    return (randn_bshd(b, sq, h, seed=seed, device=device),
            randn_bshd(b, skv, h, seed=seed + 1, device=device),
            randn_bshd(b, skv, h, seed=seed + 2, device=device))


def rope_tables(s, rope_dim, *, base=10000.0):
    """HF-style cos/sin tables (BF16 [S, rope_dim]) as diffusion transformers build them."""
    half = rope_dim // 2
    inv = 1.0 / (base ** (torch.arange(half, dtype=torch.float32) / half))
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)


def norm_weights(seed=7):
    g = torch.Generator().manual_seed(seed)
    return ((1 + 0.1 * torch.randn(128, generator=g)).to(torch.bfloat16),
            (1 + 0.1 * torch.randn(128, generator=g)).to(torch.bfloat16))


def run_as_script(file: str) -> None:
    sys.exit(pytest.main([file, "-q", *sys.argv[1:]]))
