"""What the Python entry points check before and after the binding runs a call.

* :func:`check_bytes` — the binding counts the bytes a validated call will allocate (prepared
  tensors, outputs, copies) and asks here before its first allocation; a call that cannot fit
  in the memory its device has free is refused with a :class:`MemoryError` (it would otherwise
  fill the machine until the OOM killer ends the process: an expanded ``[1, 2**24, 8, 128]``
  key is 16 GiB of INT8 codes and 16 GiB of V).
* :func:`warn_outlier_blocks` — under ``AITER_SAGE_CHECK=1``, a 32-row Q or K block (a
  16-row Q block with ``q_scale_rows=16``) whose largest row dwarfs its typical row is named:
  per-block INT8 gives every row of a block the step of its largest, so one row ×30 puts the
  other 31 at rel L2 0.19 (0.028 elsewhere).

The byte counts follow the binding's allocations (``csrc/binding/sage_torch.cpp``:
``run_prepare``, ``run_attention``); a test compares them with the tensors a call returns.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from . import ref


# ----------------------------------------------------------------------------------------------
# Memory: what a call allocates (counted by the binding), against what its device has free
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Budget:
    """Bytes of one call, by what holds them (the binding's Budget, csrc/binding)."""

    prepared: int = 0  # INT8 Q/K, V codes and their scales (+ the smoothing's terms, scratch)
    output: int = 0  # the attention output and its LSE
    copies: int = 0  # inputs copied to meet the kernels' 16-byte alignment (or FP32 RoPE tables)

    @property
    def total(self) -> int:
        return self.prepared + self.output + self.copies


_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # v2
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


@functools.lru_cache(None)
def _kept_open(path: str) -> Optional[int]:
    """A descriptor of a kernel status file, opened once and read from its start on every call
    (the kernel regenerates such a file for each read at offset 0); None if it cannot be opened.
    Opening /proc/meminfo and the cgroup files again on every call cost ~20 us of a ~66 us
    tiny attention call. Kept for the process's life, across fork too (the files are the
    machine's and the cgroup's, not the process's)."""
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return None


def _read_now(path: str) -> Optional[bytes]:
    fd = _kept_open(path)
    if fd is None:
        return None
    try:
        return os.pread(fd, 1 << 14, 0)
    except OSError:
        return None


@functools.lru_cache(None)
def _cgroup_files() -> Optional[tuple[str, str]]:
    """This machine's cgroup memory limit and usage files (v2, else v1), looked for once: which
    of them exist does not change while the process runs (their values do: read every call)."""
    for limit_file, usage_file in _CGROUP_FILES:
        if os.path.isfile(limit_file) and os.path.isfile(usage_file):
            return limit_file, usage_file
    return None


def _cgroup_free_bytes() -> Optional[int]:
    """Memory left under this process's cgroup limit, None if unlimited (or unreadable)."""
    files = _cgroup_files()
    if files is None:
        return None
    limit, usage = (_read_now(f) for f in files)
    if limit is None or usage is None:
        return None
    limit = limit.strip()
    if limit == b"max" or not limit.isdigit() or int(limit) >= 1 << 60:
        return None
    try:
        return max(int(limit) - int(usage.strip()), 0)
    except ValueError:
        return None


def _mem_available() -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes, None where there is none (not Linux)."""
    text = _read_now("/proc/meminfo")
    at = -1 if text is None else text.find(b"MemAvailable:")
    if at < 0:
        return None
    return int(text[at + len(b"MemAvailable:") : text.index(b"kB", at)]) * 1024


def host_free_bytes() -> tuple[int, str]:
    """Host memory a call can still take, and where the figure comes from: MemAvailable
    (/proc/meminfo), lowered to the cgroup's remaining limit, raised by the binding's cached
    host blocks (they are reused before new memory is mapped)."""
    free, source = _mem_available(), "MemAvailable"
    if free is None:  # not Linux's /proc: what sysconf says is free
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        source = "free physical pages"
    cg = _cgroup_free_bytes()
    if cg is not None and cg < free:
        free, source = cg, "the cgroup's memory limit"
    try:
        from . import ops

        if ops._binding is not None:
            free += int(ops.host_cache_stats().get("cached_bytes", 0))
    except Exception:  # noqa: BLE001 - the estimate stands without the cache's share
        pass
    return free, source


def device_free_bytes(device: torch.device, need: Optional[int] = None) -> tuple[int, str]:
    """Free memory of a GPU: the driver's figure plus what torch's caching allocator holds
    unused, which it hands out first. With ``need`` the allocator's share is read only when
    the driver's figure falls short of it: reading it builds torch's whole memory_stats dict,
    twice, which cost a call on an H100 host more than its attention kernel at S 4096."""
    free, _ = torch.cuda.mem_get_info(device)
    if need is not None and need <= free:
        return int(free), "free device memory"
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(cached, 0)), "free device memory"


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def check_fits(budget: Budget, device: torch.device, op: str) -> None:
    """Raises MemoryError naming the size and the limit when ``budget`` exceeds what
    ``device`` has free (host memory or a GPU's; other devices are not checked). The binding
    calls it at run time only: fakes and meta tensors never reach it."""
    if device.type == "cpu":
        free, source = host_free_bytes()
        where = "host memory"
    elif device.type == "cuda":
        free, source = device_free_bytes(device, need=budget.total)
        where = f"memory on {device}"
    else:
        return
    if budget.total <= free:
        return
    parts = [f"{_fmt(budget.prepared)} of prepared tensors"]
    if budget.output:
        parts.append(f"{_fmt(budget.output)} of output")
    if budget.copies:
        parts.append(f"{_fmt(budget.copies)} of aligned input copies")
    raise MemoryError(
        f"aiter_sage: {op} would allocate {_fmt(budget.total)} ({', '.join(parts)}) but only "
        f"{_fmt(free)} of {where} is free ({source}); nothing was allocated. Split the call "
        f"(fewer heads or batch entries at a time) or free memory"
    )


def check_bytes(op: str, prepared: int, output: int, copies: int, device: str) -> None:
    """The binding's memory guard (``set_memory_guard``): called with a validated call's byte
    counts before its first allocation, in every entry point (the Python functions, direct
    ``torch.ops.aiter`` calls, compiled graphs)."""
    check_fits(Budget(prepared, output, copies), torch.device(device), op)


# ----------------------------------------------------------------------------------------------
# AITER_SAGE_CHECK=1: blocks whose INT8 step is set by one outlier row
# ----------------------------------------------------------------------------------------------
# A block is named when its largest row amax exceeds the median row amax of the block by more
# than this factor. Random rows differ by about 1.5x; a factor of 8 costs the block's other
# rows 8x the INT8 error of their own scale (DiT "massive activations" are 100x and more).
OUTLIER_FACTOR = 8.0
OUTLIER_MAX_NAMED = 8  # blocks named per warning


class SageCheckWarning(RuntimeWarning):
    """AITER_SAGE_CHECK=1 found something wrong or fragile in a call (``ops`` names rows)."""


class SageOutlierWarning(SageCheckWarning):
    """AITER_SAGE_CHECK=1 found a Q or K block whose INT8 scale one outlier row sets."""


def outlier_blocks(
    x: torch.Tensor, factor: float = OUTLIER_FACTOR, block: int = ref.SCALE_BLOCK
) -> list[tuple]:
    """(batch, head, block, ratio) of every ``block``-row block (32, or 16: Q with
    q_scale_rows=16) of ``x`` ``[B, S, H, D]`` whose largest row amax exceeds ``factor`` times
    the block's median row amax (rows past S do not count)."""
    b, s, h, _ = x.shape
    rows = x.detach().float().abs().amax(dim=-1).transpose(1, 2)  # [B, H, S]
    s_pad = ref.padded_len(s)
    rows = torch.nn.functional.pad(rows, (0, s_pad - s), value=math.nan)
    blocks = rows.reshape(b, h, s_pad // block, block)
    top = blocks.nan_to_num(nan=-math.inf).amax(dim=-1)
    median = blocks.nanmedian(dim=-1).values
    ratio = top / median
    hit = (median > 0) & torch.isfinite(top) & (ratio > factor)  # zero rows lose nothing
    idx = hit.nonzero().tolist()
    return [(bi, hi, ki, float(ratio[bi, hi, ki])) for bi, hi, ki in idx]


def warn_outlier_blocks(
    query,
    key,
    *,
    smooth_k=False,
    query_weight=None,
    key_weight=None,
    eps=1e-6,
    q_scale_rows=ref.SCALE_BLOCK,
    op="",
) -> dict:
    """Warns (:class:`SageOutlierWarning`) naming the Q and K blocks :func:`outlier_blocks`
    finds in what prepare quantizes (after the RMSNorm when its weights are given; K minus its
    mean with ``smooth_k``; Q blocks of ``q_scale_rows`` rows). Returns ``{"query": [...],
    "key": [...]}``."""
    q, k = query, key
    if query_weight is not None:
        q = torch.nn.functional.rms_norm(q.float(), (q.shape[-1],), query_weight.float(), eps)
        k = torch.nn.functional.rms_norm(k.float(), (k.shape[-1],), key_weight.float(), eps)
    if smooth_k:
        k = k.float() - k.float().mean(dim=1, keepdim=True)
    rows = {"query": q_scale_rows, "key": ref.SCALE_BLOCK}
    found = {"query": outlier_blocks(q, block=q_scale_rows), "key": outlier_blocks(k)}
    for what, hits in found.items():
        if not hits:
            continue
        n = rows[what]
        named = ", ".join(
            f"(batch {b}, head {h}, rows {blk * n}-{blk * n + n - 1}: {r:.0f}x)"
            for b, h, blk, r in hits[:OUTLIER_MAX_NAMED]
        )
        more = f" and {len(hits) - OUTLIER_MAX_NAMED} more" if len(hits) > OUTLIER_MAX_NAMED else ""
        hint = " (smooth_k=True removes a common key offset)" if what == "key" else ""
        warnings.warn(
            f"aiter_sage: {op}: {len(hits)} {what} block(s) whose largest row amax exceeds "
            f"{OUTLIER_FACTOR:g}x the block's median row amax; the block's other rows lose INT8 "
            f"precision{hint}: {named}{more}",
            SageOutlierWarning,
            stacklevel=4,
        )
    return found
