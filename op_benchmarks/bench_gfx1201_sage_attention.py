#!/usr/bin/env python3
"""Benchmark gfx1201_sage_attention against torch SDPA, side by side in one run.

Providers
  sage       prepare + attention (what a model calls)
  sage_core  the attention kernel alone on prepared tensors
  sage_kept, sage_core_kept
             with --mask-pad: the same two, unmasked, on the kept keys alone (what the masked
             call must not be slower than)
  sdpa_bf16  torch.nn.functional.scaled_dot_product_attention on [B, H, S, D] in the input
             dtype (named sdpa_fp16 with --dtype fp16; same causal and GQA options), torch's own
             choice of SDPA backend
  sdpa_cudnn, sdpa_flash, sdpa_efficient
             the same, pinned to one torch SDPA backend (torch.nn.attention.sdpa_kernel;
             CUDA GPUs). On NVIDIA: --providers sage sage_core sdpa_cudnn sdpa_flash
  sage2, sage2_nosmooth
             SageAttention2's Hopper kernel, sageattn_qk_int8_pv_fp8_cuda_sm90 (INT8 Q.K per
             warp, FP8 P.V, "fp32+fp32" accumulation; its quantization included), with its
             smooth_k on and off, when the real `sageattention` package is importable on a
             Hopper GPU (run_h200.sh builds it from a given copy of its source); timed exactly
             like the others
  fa3_fp8    FlashAttention-3's FP8 forward kernel alone (flash_attn_interface.flash_attn_func on
             e4m3 copies of q, k, v made before timing, descale 1; it transposes V inside its
             kernel), when FlashAttention-3 is importable on a Hopper GPU (build_fa3.sh builds
             one): the fastest public FP8 attention kernel, the ceiling to read sage_core
             against (its accuracy is not the contract's: Q and K in e4m3, unscaled)

Problem options: --dtype, --head_dim, --causal, --gqa (query heads per key/value head),
--pv_dtype (fp8: upstream's FP8 P·V; fp16: FP16 P·V, the sage providers' pv_dtype), --smooth_k
(the sage providers quantize K minus its mean), --q_scale_rows (32: upstream's Q scale per 32
rows; 16: the sage providers' q_scale_rows=16), --dit (DiT-like inputs, see make_inputs), each a
CSV column. Timing: warm-up calls, then `--rounds` rounds in which every provider runs `--iters`
timed calls in turn (interleaved, so drift hits all alike), in an order that changes every round
so that each provider runs in every position and after every other (round_order); on a GPU each
provider's timed calls follow untimed calls of its own, and both last at least `--window_ms`
(GPU_WINDOW_MS): a power-capped GPU's clocks depend on what ran just before, and short bursts
after an idle gap run above the clocks of sustained use. The median per-call time over rounds is
reported. TFLOPS = 4 * B * H * S^2 * D / t (halved for causal: the work a causal kernel does).
With --compare_to_ref each provider's output is also scored against the FP32 reference: cosine,
relative L2, and % of elements outside the band (atol 0.3, rtol 0.25).

The backend is the best present (an RDNA4 or Hopper GPU, else the CPU); --backend picks one.
On a GPU the FP32 reference of --compare_to_ref runs on the GPU (SDPA in float32 through the
memory-efficient backend, TF32 off) so that long sequences stay cheap; on the CPU it is
ref.attention_fp32. Timing is per call with the device synchronised around each round. On a
GPU a round is timed by device events around its calls, queued behind a short device-side
wait (QUEUE_AHEAD_CYCLES) so that the host's latency to its first launch is not counted: the
calls run back to back, as in a model's forward.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiter_sage  # noqa: E402
from aiter_sage import backends, env, ref  # noqa: E402

PROVIDERS = (
    "sage",
    "sage_core",
    "sage_kept",
    "sage_core_kept",
    "sdpa",
    "sdpa_cudnn",
    "sdpa_flash",
    "sdpa_efficient",
    "sage2",
    "sage2_nosmooth",
    "fa3_fp8",
)
EXTERNAL_PROVIDERS = ("sage2", "sage2_nosmooth", "fa3_fp8")  # other projects' kernels
SAGE2_PROVIDERS = {"sage2": True, "sage2_nosmooth": False}  # name -> smooth_k
SAGE2_Q_SCALE_ROWS = 16  # its per_warp Q granularity on sm90 (the q_scale_rows column)
SDPA_BACKENDS = {
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
}
GPU_BACKENDS = tuple(b.name for b in backends.BACKENDS if b.device_type != "cpu")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Default shapes per backend, sized so a run takes about a minute there.
DEFAULT_SHAPES = {
    "gfx12": dict(batch=1, heads=24, seqs=[1024, 4096, 8192, 16384]),
    "cuda": dict(batch=1, heads=24, seqs=[4096, 16384, 32768]),
    "cpu": dict(batch=1, heads=8, seqs=[1024, 2048, 4096]),
    "emu": dict(batch=1, heads=2, seqs=[256, 512]),
}


def cpu_name() -> str:
    """The CPU model and whether it has the AVX-512 VNNI/BF16 the widest cpu tier uses."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    model = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")),
        "unknown",
    )
    wide = "avx512_vnni" in text and "avx512_bf16" in text
    return f"'{model}' ({'AVX-512 VNNI/BF16' if wide else 'no AVX-512 VNNI/BF16'})"


def best_backend() -> str:
    present = aiter_sage.available_backends()
    for b in GPU_BACKENDS:
        if b in present:
            return b
    return "cpu"


def synchronize(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


# --dit: what the activations of video/image diffusion transformers look like to the INT8
# quantizer: every key of a head carries a shared per-channel offset (N(0, DIT_K_OFFSET) per
# channel, several times the keys' own spread: the common component smooth_k removes), and a
# few query channels (DIT_Q_OUTLIERS of them, the same in every head) are DIT_Q_OUTLIER_GAIN
# times larger than the rest (they set every Q block's scale).
DIT_K_OFFSET = 4.0
DIT_Q_OUTLIERS = 4
DIT_Q_OUTLIER_GAIN = 8.0


def make_inputs(b, h, s, device, *, d=128, dtype=torch.bfloat16, gqa=1, seed=0, dit=False):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, s, h, d), (b, s, h // gqa, d), (b, s, h // gqa, d))
    q, k, v = (torch.randn(sh, generator=g) for sh in shapes)
    if dit:
        k += DIT_K_OFFSET * torch.randn((1, 1, h // gqa, d), generator=g)
        q[..., torch.randperm(d, generator=g)[:DIT_Q_OUTLIERS]] *= DIT_Q_OUTLIER_GAIN
    return tuple(t.to(dtype).to(device) for t in (q, k, v))


def sage2_module():
    """SageAttention2's package if the real one is importable and has its Hopper kernel (not
    aiter_sage's own `sageattention` shim), else None."""
    try:
        import sageattention
    except Exception:  # absent, or built for another GPU / torch
        return None
    fn = getattr(sageattention, "sageattn_qk_int8_pv_fp8_cuda_sm90", None)
    if fn is None or "aiter_sage" in str(getattr(sageattention, "__file__", "")):
        return None
    return sageattention


def fa3_module():
    """FlashAttention-3's Python interface (flash_attn_interface, with its flash_attn_3._C
    kernels) if importable, else None."""
    try:
        import flash_attn_interface
    except Exception:  # absent, or built for another GPU / torch
        return None
    return flash_attn_interface if hasattr(flash_attn_interface, "flash_attn_func") else None


def pad_mask(b, s, kept, device):
    """Keys padded at the end: the first `kept` of each entry's `s` keys are real. Returns the
    per-entry lengths (int32 [B], the kernels' form) and SDPA's boolean [B, 1, 1, S] mask."""
    kv_lens = torch.full((b,), kept, dtype=torch.int32, device=device)
    mask = (torch.arange(s, device=device) < kept).expand(b, 1, 1, s)
    return kv_lens, mask


def provider_calls(
    q, k, v, scale, backend, causal, pv_dtype="fp8", kept=None, smooth_k=False, q_scale_rows=32
):
    """name -> zero-argument callable returning the output in [B, S, H, D]. `kept`: the keys
    are padded past `kept` (--mask-pad): the sage providers get per-entry key lengths, SDPA the
    same mask, and `sage_kept` / `sage_core_kept` run the unmasked kernels on the kept keys.
    `smooth_k`, `q_scale_rows`: the sage providers' prepare options (SageAttention2's have
    their own settings; the fwd op reads the Q granularity from the prepared q_scale)."""
    masked = kept is not None
    lens, mask = pad_mask(q.shape[0], k.shape[1], kept, q.device) if masked else (None, None)
    extra = dict(kv_lens=lens) if masked else {}
    if smooth_k:
        extra["smooth_k"] = True
    if q_scale_rows != ref.SCALE_BLOCK:
        extra["q_scale_rows"] = q_scale_rows
    prepared = aiter_sage.gfx1201_sage_prepare(
        q, k, v, scale, pv_dtype=pv_dtype, backend=backend, **extra
    )
    prepare_only = ("smooth_k", "q_scale_rows")
    fwd_extra = {n: x for n, x in extra.items() if n not in prepare_only}
    s, d = q.shape[1], q.shape[3]
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # SDPA's own layout
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gqa = q.shape[2] != k.shape[2]
    sdpa_kw = dict(scale=scale, is_causal=causal, enable_gqa=gqa, attn_mask=mask)

    def core():
        out = aiter_sage.gfx1201_sage_attention_fwd(
            *prepared, s, is_causal=causal, out_dtype=q.dtype, backend=backend, **fwd_extra
        )
        return out[:, :s, :, :d]

    def pinned(which):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def call():
            with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[which])):
                return sdpa(qh, kh, vh, **sdpa_kw).transpose(1, 2)

        return call

    def sage():
        return aiter_sage.gfx1201_sage_attention(
            q, k, v, scale, is_causal=causal, pv_dtype=pv_dtype, backend=backend, **extra
        )

    calls = {
        **{n: pinned(n) for n in SDPA_BACKENDS},
        "sage": sage,
        "sage_core": core,
        "sdpa": lambda: sdpa(qh, kh, vh, **sdpa_kw).transpose(1, 2),
    }
    sa2 = sage2_module() if q.is_cuda and not masked else None
    for name, smooth in SAGE2_PROVIDERS.items():
        if sa2 is not None:
            calls[name] = lambda smooth=smooth: sa2.sageattn_qk_int8_pv_fp8_cuda_sm90(
                q, k, v, tensor_layout="NHD", is_causal=causal, qk_quant_gran="per_warp",
                sm_scale=scale, pv_accum_dtype="fp32+fp32", smooth_k=smooth,
            )  # fmt: skip
    fa3 = fa3_module() if q.is_cuda and not masked else None
    if fa3 is not None:
        q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        calls["fa3_fp8"] = lambda: fa3.flash_attn_func(
            q8, k8, v8, softmax_scale=scale, causal=causal
        )
    if masked:
        kk, vk = k[:, :kept], v[:, :kept]
        kept_kw = dict(pv_dtype=pv_dtype, backend=backend)
        kept_kw.update({n: extra[n] for n in prepare_only if n in extra})  # smooth_k, q rows
        calls["sage_kept"] = lambda: aiter_sage.gfx1201_sage_attention(
            q, kk, vk, scale, is_causal=causal, **kept_kw
        )
        kept_prepared = aiter_sage.gfx1201_sage_prepare(q, kk, vk, scale, **kept_kw)
        calls["sage_core_kept"] = lambda: aiter_sage.gfx1201_sage_attention_fwd(
            *kept_prepared, s, kv_len=kept, is_causal=causal, out_dtype=q.dtype, backend=backend
        )[:, :s, :, :d]
    return calls


# The GPU's lead-in and timed window per provider and round: an H200 running attention
# back to back reaches its 700 W cap and steady clocks (1.74-1.80 GHz) within it, where 3 calls
# after an idle gap ran at up to 1.97 GHz and ~360 W at S 16k, and each provider's clocks
# depended on the one before it (docs/perf/2026-12-02-cuda-h200-sage2.md, "Sixth run").
GPU_WINDOW_MS = 100.0

# A device-side wait (~2.5 ms at 2 GHz) queued before a GPU round: the host enqueues the
# round's calls meanwhile, so the events time the calls alone.
QUEUE_AHEAD_CYCLES = 5_000_000


def round_order(names, r):
    """The providers of round r, a Williams design: row r of a Latin square whose first row
    takes the providers 0, 1, n-1, 2, n-2, ... and whose later rows add r (mod n) to each; with
    an odd count n, rounds n..2n-1 run those rows reversed. Over n rounds (2n when n is odd)
    each provider runs once (twice) in every position and right after each other provider once
    (twice): a power-capped GPU's clocks depend on what ran just before, and a plain rotation
    kept each provider behind the same one in nearly every round."""
    n = len(names)
    if n == 0:
        return []
    first = [0]
    for i in range(1, n):
        first.append((i + 1) // 2 if i % 2 else n - i // 2)
    row = [names[(x + r) % n] for x in first]
    return row[::-1] if n % 2 and (r // n) % 2 else row


def time_interleaved(calls, device, warmup, iters, rounds, rotate=True, lead_in=0, window=None):
    """Median seconds per call of each provider. Round r runs the providers in round_order(r)
    (or as listed, without `rotate`), each `lead_in` untimed calls and then `iters` timed ones.
    `window` (seconds): at least that long each, by the fastest warm-up call's time: a
    power-capped GPU reaches its steady clocks only after some tens of milliseconds of load."""
    counts = {}
    for name, fn in calls.items():
        fastest = math.inf
        for _ in range(warmup):
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            fastest = min(fastest, time.perf_counter() - t0)
        fill = 0 if window is None or not math.isfinite(fastest) else math.ceil(window / fastest)
        counts[name] = (max(lead_in, fill), max(iters, fill))
    samples = {name: [] for name in calls}
    for r in range(rounds):
        for name in round_order(list(calls), r) if rotate else list(calls):
            fn, (lead, timed) = calls[name], counts[name]
            synchronize(device)
            if device == "cpu":
                for _ in range(lead):
                    fn()
                t0 = time.perf_counter()
                for _ in range(timed):
                    fn()
                samples[name].append((time.perf_counter() - t0) / timed)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
            for _ in range(lead):
                fn()
            start.record()
            for _ in range(timed):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / 1e3 / timed)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def gpu_reference(q, k, v, scale, causal):
    """FP32 attention on the GPU (memory-efficient SDPA in float32, no TF32), [B, S, H, D]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                qf, kf, vf, scale=scale, is_causal=causal, enable_gqa=q.shape[2] != k.shape[2]
            )
        return out.transpose(1, 2).contiguous()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def run(args):
    backend = args.backend or best_backend()
    device = "cuda" if backend in GPU_BACKENDS else "cpu"
    defaults = DEFAULT_SHAPES[backend]
    batch = args.batch or defaults["batch"]
    heads = args.heads or defaults["heads"]
    seqs = args.seqs or defaults["seqs"]
    # torch's default SDPA everywhere; its pinned NVIDIA kernels (cuDNN, flash, efficient)
    # only where they exist.
    default = (
        PROVIDERS
        if backend == "cuda"
        else tuple(p for p in PROVIDERS if p not in SDPA_BACKENDS and p not in EXTERNAL_PROVIDERS)
    )
    providers = args.providers or list(default)
    dtype = DTYPES[args.dtype]
    d = args.head_dim
    if heads % args.gqa:
        raise SystemExit(f"--gqa {args.gqa} must divide the head count {heads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"# aiter_sage benchmark: backend={backend} device={device} "
        f"threads={torch.get_num_threads()} torch={torch.__version__} cpu={cpu_name()} "
        f"cpu_tier={env.get('AITER_SAGE_CPU_ISA', 'auto')}"
    )
    sdpa_name = f"sdpa_{args.dtype}"
    if device != "cpu":
        print(f"# gpu={torch.cuda.get_device_name()} cuda={torch.version.cuda}")
    rows = []
    if args.mask_pad is not None and not 0 <= args.mask_pad < 1:
        raise SystemExit(f"--mask-pad {args.mask_pad}: a fraction of the keys, 0 <= f < 1")
    if args.mask_pad is not None and args.causal:
        raise SystemExit("--mask-pad with --causal: SDPA takes a mask or is_causal, not both")
    for s in seqs:
        q, k, v = make_inputs(batch, heads, s, device, d=d, dtype=dtype, gqa=args.gqa, dit=args.dit)
        scale = d**-0.5
        kept = None if args.mask_pad is None else max(1, s - round(args.mask_pad * s))
        options = (args.causal, args.pv_dtype, kept, args.smooth_k, args.q_scale_rows)
        calls = {
            n: f
            for n, f in provider_calls(q, k, v, scale, backend, *options).items()
            if n in providers
        }
        missing = [n for n in EXTERNAL_PROVIDERS if n in providers and n not in calls]
        if missing and s == seqs[0]:
            print(
                f"# {', '.join(missing)}: skipped (needs SageAttention2's sageattention package "
                "with its sm90 kernel, or FlashAttention-3's flash_attn_interface, on a Hopper "
                "GPU, and no --mask-pad)"
            )
        window_ms = args.window_ms
        if window_ms is None:
            window_ms = 0.0 if device == "cpu" else GPU_WINDOW_MS
        times = time_interleaved(
            calls,
            device,
            args.warmup,
            args.iters,
            args.rounds,
            not args.fixed_order,
            args.lead_in,
            window_ms / 1e3 if window_ms > 0 else None,
        )
        keys = s if kept is None else kept  # FLOPs of the keys that count
        flops = 4.0 * batch * heads * s * keys * d * (0.5 if args.causal else 1.0)
        reference = None
        if args.compare_to_ref:
            kr, vr = (k, v) if kept is None else (k[:, :kept], v[:, :kept])  # = the pad mask
            reference = (
                gpu_reference(q, kr, vr, scale, args.causal)
                if device != "cpu"
                else ref.attention_fp32(q, kr, vr, scale, is_causal=args.causal)
            )
        for name in calls:
            row = dict(
                backend=backend,
                B=batch,
                H=heads,
                S=s,
                D=d,
                dtype=args.dtype,
                causal=args.causal,
                gqa=args.gqa,
                kept_keys=keys,
                pv_dtype=args.pv_dtype,
                smooth_k=SAGE2_PROVIDERS.get(
                    name, args.smooth_k and name not in EXTERNAL_PROVIDERS
                ),
                q_scale_rows=SAGE2_Q_SCALE_ROWS if name in SAGE2_PROVIDERS else args.q_scale_rows,
                dit=args.dit,
                provider=sdpa_name if name == "sdpa" else name,
                ms=times[name] * 1e3,
                tflops=flops / times[name] / 1e12,
            )
            base = next((n for n in ("sdpa", "sdpa_cudnn") if n in times), None)
            if base:
                row[f"speedup_vs_{base}"] = times[base] / times[name]
            sa2 = [times[n] for n in SAGE2_PROVIDERS if n in times]
            if sa2:  # against the faster of SageAttention2's two settings
                row["speedup_vs_sage2"] = min(sa2) / times[name]
            if reference is not None:
                acc = ref.accuracy(calls[name](), reference)
                row.update(
                    cosine=acc["cosine"],
                    rel_l2=acc["rel_l2"],
                    outside_pct=100 * acc["outside"],
                    in_band=ref.in_band(acc),
                )
            rows.append(row)
    return rows


def fmt(v):
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def print_markdown(rows):
    cols = list(dict.fromkeys(c for r in rows for c in r))
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("-b", "--batch", type=int, help="batch size")
    p.add_argument("-n", "--heads", type=int, help="number of heads")
    p.add_argument("-s", "--seqs", type=int, nargs="+", help="sequence lengths")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS)
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="input (and output) dtype")
    p.add_argument("--head_dim", type=int, default=128, help="head dim D (<= 128)")
    p.add_argument("--causal", action="store_true", help="causal attention (is_causal=True)")
    p.add_argument("--gqa", type=int, default=1, help="query heads per key/value head")
    p.add_argument(
        "--mask-pad",
        type=float,
        default=None,
        metavar="FRACTION",
        help="pad this fraction of the keys at the end (a key-padding mask; SDPA gets the same "
        "mask, sage_kept runs the unmasked kernels on the kept keys; TFLOPS count kept keys)",
    )
    p.add_argument(
        "--pv_dtype",
        choices=ref.PV_DTYPES,
        default="fp8",
        help="P·V operands of the sage providers",
    )
    p.add_argument(
        "--smooth_k", action="store_true", help="the sage providers quantize K minus its mean"
    )
    p.add_argument(
        "--q_scale_rows",
        type=int,
        choices=ref.Q_SCALE_ROWS,
        default=ref.SCALE_BLOCK,
        help="query rows per Q scale of the sage providers (16: q_scale_rows=16)",
    )
    p.add_argument(
        "--dit",
        action="store_true",
        help="DiT-like inputs: a shared per-channel key offset and a few outlier query "
        "channels (where smoothing matters)",
    )
    p.add_argument("--backend", choices=aiter_sage.BACKENDS, help="default: best present")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=3, help="timed calls per provider per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--fixed_order",
        action="store_true",
        help="every round in the providers' listed order (shows the order's effect)",
    )
    p.add_argument(
        "--lead_in",
        type=int,
        default=0,
        help="untimed calls of a provider right before its timed ones in each round",
    )
    p.add_argument(
        "--window_ms",
        type=float,
        help="lead-in and timed calls of at least this many milliseconds each, counted from the "
        f"fastest warm-up call (default: {GPU_WINDOW_MS:g} on a GPU, 0 = off on the CPU)",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--compare_to_ref", action="store_true", help="score outputs against the FP32 reference"
    )
    p.add_argument("-o", "--output", help="also write the rows as CSV")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    rows = run(args)
    print_markdown(rows)
    if args.output:
        with open(args.output, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(c for r in rows for c in r)))
            w.writeheader()
            w.writerows(rows)
    ours = [
        r
        for r in rows
        if r["provider"].startswith("sage") and r["provider"] not in EXTERNAL_PROVIDERS
    ]
    if args.compare_to_ref and not all(r["in_band"] for r in ours):
        print("# FAIL: an aiter_sage output is outside the accuracy band", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
