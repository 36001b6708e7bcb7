"""The host block cache of the binding's large CPU tensors (csrc/binding/host_blocks.h):
the class's rules on the host, then the ops on it — reused blocks never alias a live tensor,
results are the same with the cache on and off, and freed blocks are reused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import aiter_sage
from aiter_sage import ref

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import REPO, build_host_program

MIB = 1 << 20


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    exe = tmp_path_factory.mktemp("host_blocks") / "host_blocks_probe"
    build_host_program(exe, REPO / "op_tests" / "cpp" / "host_blocks_probe.cpp")
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    values = {}
    for line in out.splitlines():
        words = line.split()
        for name, value in zip(words[::2], words[1::2]):
            values[name] = int(value)
    return values


def test_blocks_are_aligned_rounded_and_reused(probe):
    assert probe["capacity"] == 6  # 5 MiB + 1 byte -> whole 2 MiB pages
    assert probe["aligned"] == 1
    assert probe["cached_after_give"] == 6
    assert probe["reused_same_block"] == 1
    assert (probe["hits"], probe["misses"]) == (1, 1)


def test_best_fit_within_twice_the_request(probe):
    assert probe["best_fit_16"] == 1
    assert probe["no_oversized_block"] == 1


def test_limit_evicts_oldest_first(probe):
    assert (probe["limited_blocks"], probe["bytes"]) == (2, 8)
    assert probe["kept_newest"] == 1
    assert probe["trimmed"] == 0
    assert probe["zero_limit_cached"] == 0


def _inputs(seed, s=4096, h=8, d=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, h, d, generator=g).bfloat16() for _ in range(3)]


def test_prepared_tensors_never_alias_live_ones():
    """q8 at S 4096 H 8 D 128 is 4 MiB: a cached block. A second prepare while the first's
    tensors live must not touch them; each matches ref.prepare of its own inputs."""
    q1, k1, v1 = _inputs(1)
    first = aiter_sage.gfx1201_sage_prepare(q1, k1, v1, backend="cpu")
    assert first.q_int8.nbytes >= 4 * MIB
    kept = [t.clone() for t in first]
    q2, k2, v2 = _inputs(2)
    second = aiter_sage.gfx1201_sage_prepare(q2, k2, v2, backend="cpu")
    for a, b in zip(first, kept):
        assert torch.equal(
            a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
            b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b,
        )
    for got, q, k, v in ((first, q1, k1, v1), (second, q2, k2, v2)):
        want = ref.prepare(q, k, v)
        assert torch.equal(got.q_int8, want.q_int8)
        assert torch.equal(got.k_int8, want.k_int8)
        assert torch.equal(got.v_fp8.view(torch.uint8), want.v_fp8.view(torch.uint8))


def test_freed_blocks_are_reused_by_the_next_call():
    q, k, v = _inputs(3)
    out = aiter_sage.gfx1201_sage_prepare(q, k, v, backend="cpu")
    del out
    before = aiter_sage.host_cache_stats()
    assert before["cached_bytes"] >= 3 * 4 * MIB  # q8, k8, v8 came back
    out = aiter_sage.gfx1201_sage_prepare(q, k, v, backend="cpu")
    after = aiter_sage.host_cache_stats()
    assert after["hits"] - before["hits"] >= 3
    del out
    aiter_sage.empty_host_cache()
    assert aiter_sage.host_cache_stats()["cached_blocks"] == 0


_CHILD = """
import torch, aiter_sage
g = torch.Generator().manual_seed(4)
q, k, v = (torch.randn(1, 1024, 16, 128, generator=g).bfloat16() for _ in range(3))
outs = [aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu") for _ in range(2)]
assert torch.equal(outs[0], outs[1])
torch.save(outs[0].clone(), {path!r})
del outs  # their blocks go back (or, with the cache off, are unmapped)
print(aiter_sage.host_cache_stats()["cached_blocks"])
"""


@pytest.mark.parametrize("limit_mb", ["0", "1024"])
def test_attention_same_bits_with_cache_on_and_off(tmp_path, monkeypatch, limit_mb):
    """The fused op's output (4 MiB here) and temporaries: the same bits whatever the cache
    does; with AITER_SAGE_HOST_CACHE_MB=0 nothing stays cached."""
    monkeypatch.setenv("AITER_SAGE_HOST_CACHE_MB", limit_mb)
    path = tmp_path / "out.pt"
    res = subprocess.run(
        [sys.executable, "-c", _CHILD.format(path=str(path))],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    cached = int(res.stdout.strip().splitlines()[-1])
    assert (cached == 0) == (limit_mb == "0")
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1024, 16, 128, generator=g).bfloat16() for _ in range(3))
    assert torch.equal(torch.load(path), aiter_sage.gfx1201_sage_attention(q, k, v, backend="cpu"))


def test_forked_child_uses_the_cache():
    """A child forked after the parent used (and filled) the cache prepares correctly from it:
    the cache's lock is held across fork() (pthread_atfork) and released on both sides. The
    child runs no torch compute of its own (torch's OpenMP pool does not survive a fork): it
    compares bytes through numpy with what the parent computed."""
    q, k, v = _inputs(5)
    want = ref.prepare(q, k, v).q_int8.numpy().tobytes()
    prepared = aiter_sage.gfx1201_sage_prepare(q, k, v, backend="cpu")
    del prepared  # its blocks go back to the cache
    before = aiter_sage.host_cache_stats()
    assert before["cached_blocks"] >= 3
    pid = os.fork()
    if pid == 0:  # child: report through the exit status only
        ok = False
        try:
            got = aiter_sage.gfx1201_sage_prepare(q, k, v, backend="cpu")
            ok = got.q_int8.numpy().tobytes() == want
            ok = ok and aiter_sage.host_cache_stats()["hits"] - before["hits"] >= 3
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    got = aiter_sage.gfx1201_sage_prepare(q, k, v, backend="cpu")  # the parent's cache still works
    assert got.q_int8.numpy().tobytes() == want
