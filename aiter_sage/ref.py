"""Executable specification of aiter_sage's numerics.

Every backend's ``gfx1201_sage_prepare`` must equal :func:`prepare` bit for bit, and every
backend's attention must sit inside :data:`BAND` of :func:`attention_fp32`. Prepare follows
upstream ROCm aiter's gfx1201 reference (``op_tests/ops/test_gfx1201_sage_prepare.py`` there)
step by step; the quantized attention is modelled in :func:`attention_from_prepared` so that a
reader can see where each rounding happens. Each step is one correctly rounded IEEE float32
operation unless stated.

Prepare
  * Q factor c = float32(softmax_scale * log2 e), the product formed in double and rounded
    once; Q' = float32(q) * c (the kernels then work in the exp2 domain). K' = float32(k).
  * Per (batch, head, 32-row block): s = amax|X'| / 127 (Q with ``q_scale_rows=16``: per
    16-row block, the same steps; K keeps 32-key blocks). Code t = X' / s, then
    trunc(t + (t >= 0 ? 0.5 : -0.5)) (float32 addition, then truncation: ties go away from
    zero), converted to int8 the way torch's ``.to(torch.int8)`` does (through int32, NaN -> 0;
    a quotient beyond +-127.5 needs a subnormal block scale and wraps as there). A block whose
    s is not > 0 (all zero, underflowing, or NaN) has zero codes and keeps s.
  * V, per (batch, head, channel): s_v = amax_s |v| * float32(1/448); t = v / s_v (0 where
    s_v is not > 0); v8 = e4m3fn(t) with round-to-nearest-even, saturating at +-448 like
    torch 2.13's converter (torch 2.11 gives NaN from 464 up; |t| <= 448 except with a
    subnormal s_v); stored transposed [B, H, 128, S_pad].
  * Sequence axes are padded to a multiple of SEQ_ALIGN (32) with zero rows; padding bytes
    of every prepared tensor are zero.
  * Optional fused QK RMSNorm then rotate-half RoPE (upstream's fused path): first
    ``F.rms_norm(x, (128,), weight, eps)`` on the BF16 input, FP32 inside and ONE rounding to
    BF16: ms = sum(x*x) / 128 in the pinned order of :func:`rms_sum_squares`, r = 1 / sqrt(ms +
    float32(eps)), y = bf16((x * r) * w). Then on the first rope_dim channels, in FP32,
    h*cos + rot(h)*sin with rot(h) = [-h[d/2:], h[:d/2]], each product and the sum rounded to
    FP32 (no fused multiply-add), one rounding to BF16; the other channels unchanged. Cos/sin
    tables are FP32 (BF16 tables are upcast exactly).

Attention (log2 domain; the kernels follow the same steps, their tile sizes may differ)
  * t = float32(dot_i32(q8, k8)) * (q_scale * k_scale); keys >= kv_len are masked (-inf),
    whatever the padded K/V rows hold.
  * Online softmax over KV tiles, the e4m3 scale folded into the exponent: per tile and row,
    d_max = rowmax dot, m_t = float32(d_max) * (q_scale * k_scale) (= rowmax t), m' = max(m,
    m_t) (NaN propagates); alpha = exp2(m - m'); bias = (m_t - m') + EXP_OFFSET; P' =
    exp2(fma(dot - d_max, q_scale * k_scale, bias)) (dot - d_max <= 0 is exact, the fma is
    rounded once); l = l * alpha + rowsum P' (from unquantized P'). P' is P * 2^EXP_OFFSET,
    P * 448 up to a factor 1 - 3.3e-6 that cancels in acc / l, and provably <= 448 (see
    EXP_OFFSET), so no clamp: a NaN score makes its row NaN.
  * P8 = e4m3fn(P'); acc = acc * alpha + P8 . V8 with FP32 accumulation of exact products.
  * O = acc / l * s_v, rounded to BF16 (round to nearest even), saturating (see "Finite
    input"): r = acc / l is the P-weighted mean of the V codes, so with e4m3 codes |r| <= 448;
    P's rounding (e4m3 P8, which l does not see) carries it up to ~0.8 % past that, so FP8 V
    first clamps r to +-448 (:func:`saturate_finite`: a projection onto an interval that holds
    the exact mean, which never adds error; without it, BF16 V at its maximum makes r * s_v
    overflow FP32). Then O = r * s_v is clamped to +-the largest finite value of the output
    dtype (FP16 65504, BF16 0x7f7f) and rounded. Rows >= the query length are zero in the
    padded output of ``gfx1201_sage_attention_fwd``.

Contract v2 (keyword-only options; each default is upstream's behaviour)
  * Q scale granularity (``q_scale_rows``, prepare and attention; default 32, upstream's):
    16 gives Q one scale per 16 rows, q_scale [B, Hq, Sq_pad / 16], each computed as a
    32-row block's scale is but over its 16 rows (amax, FP32 division, codes). K stays at
    32-key blocks. Attention reads a row's scale at row // (Sq_pad / q_scale.shape[-1]): the
    fwd op infers the granularity from q_scale's shape (Sq_pad is a multiple of 32, so the
    two shapes never coincide). SageAttention2 quantizes Q per 16 rows too (its "per_warp").
  * Head dim D: any multiple of 8 up to 128. Prepare zero-pads the channels to the kernel head
    dim Dp (64 for D <= 64, else 128): prepared Q/K are [B, S_pad, H, Dp], V [B, H, Dp, S_pad],
    V scales [B, H, Dp]; padded channels are zero codes with scale 0. The default
    softmax_scale is D**-0.5 (the real D); the output has D channels. Fused RMSNorm needs D a
    multiple of 32 (the pinned order runs D / 32 rounds) and normalises over the D channels;
    rope_dim is a multiple of 32 up to D.
  * FP16 inputs: read exactly; RMSNorm and RoPE round to FP16 where BF16 inputs round to BF16
    (F.rms_norm keeps the input dtype); the norm weights share the input dtype. The output has
    the input dtype (``gfx1201_sage_attention_fwd``: BF16 unless out_dtype says FP16).
  * GQA/MQA: query head h reads key/value head h // (Hq / Hkv); prepared K/V keep Hkv heads.
  * Causal (top-left, as SDPA's is_causal): query row i sees keys j <= i (and j < kv_len).
    A tile a row sees no key of leaves its state untouched (alpha = 1, no P), which is what
    skipping it does.
  * K smoothing: mean = the per-(batch, head, channel) FP32 mean of K' over the real keys in
    the pinned order of :func:`k_mean` (32 strided partial sums, then the partials in turn,
    then / kv_len); K is quantized as float32(K' - mean). Scores are unchanged up to a
    per-row constant, so the softmax is too.
  * LSE (natural log, FP32 [B, Hq, Sq]): ln2 * (m + log2(l) - EXP_OFFSET + corr) from the
    online softmax's final m and l (l sums P' = P * 2^EXP_OFFSET). With smoothing, prepare
    also gives corr = Q' . mean per query row (:class:`Smoothing`: the FP32 scaled query before
    quantization, so the term is exact up to FP32 rounding), the term the smoothing took out
    of every score of the row; the LSE is then that of the unsmoothed scores. Without
    smoothing corr = 0.

FP16 P.V (``pv_dtype="fp16"``, keyword-only on prepare and attention; default "fp8")
  * Prepare: the same per-channel s_v = amax_s |v| * float32(1/448); V is returned as float16
    codes fp16(v / s_v) (RNE, 0 where s_v is not > 0) in V8's layout [B, H, Dp, S_pad]. As
    |v / s_v| <= 448 (a little more only with a subnormal s_v), BF16 inputs cannot overflow
    FP16, and v_scale keeps its meaning (O = acc / l * s_v). Q/K are unchanged.
  * Attention: the fwd op reads the mode from the prepared V's dtype (e4m3 or its uint8 bits:
    FP8; float16: FP16). The steps are the FP8 mode's with P' rounded to FP16 (RNE) instead
    of e4m3: acc = acc * alpha + fp16(P') . V16, each FP16 x FP16 product exact in FP32, FP32
    accumulation. P' <= 448 and its FP16 rounding keeps 11 significant bits down to 2^-14
    (relative weights to ~1e-7 of the row max, where e4m3 flushes below 2^-9 / 448 = 4.4e-6):
    what keeps long rows (100k+ keys, many small weights) accurate.

Finite input (every backend and tier; op_tests/ops/test_long_and_guardrails.py)
  * Finite inputs give finite outputs. The exact attention of a row is a mean of its V rows,
    representable in the input dtype, yet the quantized P and V carry O a little past |V|'s
    maximum (FP16 V at 65504: up to 66000 with e4m3 P, which rounds to inf; BF16 V at its
    maximum: past FP32's range). Every backend therefore clamps the FP8 mode's code mean to
    +-448 and saturates O to +-the output dtype's largest finite value where it is finite,
    the steps of :func:`attention_from_prepared`; NaN stays NaN and +-inf stays +-inf (an inf
    comes only from a non-finite V scale, i.e. non-finite input, below).

Non-finite input (every backend and tier; op_tests/ops/test_long_and_guardrails.py)
  * A row that FP32 SDPA makes non-finite is non-finite in ours, and a row we return finite is
    in the band: never finite garbage. The quantization keeps it so by construction: a Q or K
    block whose amax is NaN or +inf gets scale NaN / +inf and zero codes (NaN and inf codes
    become 0), so every score of the block is 0 * (NaN or inf) = NaN: the block's query rows,
    or every row that sees one of the block's keys, become NaN (m, P and l propagate NaN; no
    max or clamp drops it). A V channel whose amax is NaN / inf gets a NaN / inf scale and its
    non-finite element a NaN code, so the channel is NaN (or inf) in every row. A quantization
    block may thus go non-finite as a whole (more rows than SDPA's), never wrong.
  * ``AITER_SAGE_CHECK=1`` (debug): the Python functions warn, naming (batch, head, row), about
    output rows that are not finite and LSE values out of range (aiter_sage.ops.check_output).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .contract import (  # noqa: F401  (re-exported: ref.SEQ_ALIGN, ...)
    EXP_OFFSET,
    FP8_MAX,
    HEAD_DIM_ALIGN,
    INT8_MAX,
    LN2,
    LOG2E,
    Q_SCALE_ROWS,
    Q_SCALE_ROWS_FINE,
    SCALE_BLOCK,
    SEQ_ALIGN,
)

HEAD_DIM = 128  # upstream's head dim, and the largest the kernels take
HEAD_DIMS = (64, 128)  # kernel head dims; other D <= 128 are zero-padded to the next one
NORM_CHANNELS_PER_ROUND = 32
MEAN_PARTIALS = 32
ROPE_DIMS = (32, 64, 96, 128)
# The attention kernels' KV tile (gfx12: one K scale block): the model at this tile is the
# kernels' own arithmetic up to exp2's last bit.
KERNEL_KV_TILE = 32
# The cpu amx tiers' int8 P.V (csrc/cpu/attention_tiles.inc): P and V are quantized per step of
# this many keys; P codes are rint(255 e), e = P / (the row's largest P of the step).
INT8_PV_TILE = 256
P_CODE_MAX = 255.0
LOG2_P_CODE_MAX = 7.994353436858858  # log2(255), rounded to float32 where it is used
# The amx tiers' exp2 for P codes (csrc/cpu/exp2_poly.h, kExp2Code*): 2^n times this degree-3
# polynomial of f = x - n, n = rint(x); relative error 7.5e-5. The model uses it so that code
# roundings match the kernel's (torch.exp2 moves ~2 % of the codes by one).
EXP2_CODE_POLY = (0.9999281167984009, 0.6932609677314758, 0.24261054396629333, 0.05517132207751274)

# Accuracy band against the FP32 reference (random inputs): upstream's, plus a relative-L2
# bound that sees a wrong output scale (cosine does not).
BAND = dict(
    atol=0.3,
    rtol=0.25,
    max_outside=0.005,
    min_cosine=0.998,
    min_median_row_cosine=0.99,
    max_rel_l2=0.06,
)


class Prepared(NamedTuple):
    """Output of prepare, as upstream returns it: what ``gfx1201_sage_attention_fwd`` takes.

    Dp = the kernel head dim (128 upstream); Hq query heads, Hkv key/value heads."""

    q_int8: torch.Tensor  # int8 [B, Sq_pad, Hq, Dp]
    q_scale: torch.Tensor  # float32 [B, Hq, Sq_pad / 32] (q_scale_rows 16: Sq_pad / 16)
    k_int8: torch.Tensor  # int8 [B, Skv_pad, Hkv, Dp]
    k_scale: torch.Tensor  # float32 [B, Hkv, Skv_pad / 32]
    v_fp8: torch.Tensor  # float8_e4m3fn [B, Hkv, Dp, Skv_pad] (pv_dtype "fp16": float16)
    v_scale: torch.Tensor  # float32 [B, Hkv, Dp]


def padded_head_dim(d: int) -> int:
    """The kernel head dim serving d channels (64 or 128)."""
    return HEAD_DIMS[0] if d <= HEAD_DIMS[0] else HEAD_DIMS[1]


def head_dim_supported(d: int) -> bool:
    return HEAD_DIM_ALIGN <= d <= HEAD_DIM and d % HEAD_DIM_ALIGN == 0


def padded_len(n: int) -> int:
    return (n + SEQ_ALIGN - 1) // SEQ_ALIGN * SEQ_ALIGN


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def q_prescale(softmax_scale: float) -> torch.Tensor:
    """float32(softmax_scale * log2 e), the product in double."""
    return _f32(float(softmax_scale) * LOG2E)


# ----------------------------------------------------------------------------------------------
# FP8 e4m3fn, bit level (independent of torch's converter; the tests compare the two)
# ----------------------------------------------------------------------------------------------
def e4m3_encode_sat(x: torch.Tensor) -> torch.Tensor:
    """float32 -> uint8 e4m3fn bits: RNE, saturate to +-448, NaN -> 0x7f with sign."""
    x = x.to(torch.float32)
    bits = x.view(torch.int32)
    sign = ((bits >> 24) & 0x80).to(torch.uint8)
    a = x.abs()
    ua = a.view(torch.int32)
    sub = torch.round(a * 512.0)  # below 2^-6: steps of 2^-9; 8 -> smallest normal 0x08
    e = (ua >> 23) - 127
    keep = (ua >> 20) & 7
    rem = ua & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((keep & 1) == 1))
    keep = keep + up.to(torch.int32)
    e = e + (keep == 8).to(torch.int32)
    keep = torch.where(keep == 8, 0, keep)
    normal = ((e + 7) << 3) | keep
    mag = torch.where(a < 0.015625, sub.to(torch.int32), normal)
    mag = torch.where(a >= FP8_MAX, 0x7E, mag)
    mag = torch.where(torch.isnan(x), 0x7F, mag)
    return sign | mag.to(torch.uint8)


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn bits -> float32 (exact)."""
    b = b.to(torch.int32)
    e = (b >> 3) & 15
    m = (b & 7).to(torch.float32)
    normal = (8.0 + m) * torch.exp2((e - 10).to(torch.float32))
    mag = torch.where(e == 0, m / 512.0, normal)
    mag = torch.where((e == 15) & ((b & 7) == 7), float("nan"), mag)
    return torch.where((b & 0x80) != 0, -mag, mag)


def fp8_bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits of a float8_e4m3fn (or uint8) tensor as uint8."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.to(torch.uint8)


# ----------------------------------------------------------------------------------------------
# Fused QK RMSNorm + RoPE (upstream: F.rms_norm, then RoPE in FP32)
# ----------------------------------------------------------------------------------------------
# The sum of squares of a 128-channel row in a pinned order: 4 accumulators of 8 lanes,
# accumulator a lane l summing channels 8a + l + 32i for i = 0..3 in turn; then
# ((a0 + a1) + a2) + a3 per lane, then lanes 0..7 in turn. This is the order torch's CPU
# reduction uses at its AVX2 capability, so ref.rmsnorm equals F.rms_norm there bit for bit
# (op_tests/ops/test_gfx1201_sage_prepare.py measures how often, on this machine's torch).
NORM_LANES = 8
NORM_ACCS = 4


def rms_sum_squares(xf: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (D, a multiple of 32) of xf*xf, float32, in the pinned order."""
    sq = xf * xf
    step = NORM_LANES * NORM_ACCS  # 32 channels per round
    accs = []
    for a in range(NORM_ACCS):
        acc = sq[..., NORM_LANES * a : NORM_LANES * (a + 1)]
        for i in range(1, xf.shape[-1] // step):
            acc = acc + sq[..., step * i + NORM_LANES * a : step * i + NORM_LANES * (a + 1)]
        accs.append(acc)
    lanes = accs[0]
    for acc in accs[1:]:
        lanes = lanes + acc
    total = lanes[..., 0]
    for lane in range(1, NORM_LANES):
        total = total + lanes[..., lane]
    return total


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, (D,), weight, eps) on BF16/FP16 x: FP32 inside, one rounding to x's dtype."""
    xf = x.float()
    ms = rms_sum_squares(xf) / float(x.shape[-1])
    # torch's vectorised float32 sqrt is not always correctly rounded; the square root of a
    # float32 computed in float64 and rounded once is (53 >= 2*24 + 2 bits).
    root = torch.sqrt((ms + _f32(eps)).double()).float()
    inv = torch.div(torch.ones_like(ms), root)
    return ((xf * inv[..., None]) * weight.float()).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Rotate-half RoPE on channels [0, rope_dim) of [B, S, H, D] in FP32, one rounding to x's
    dtype.

    cos/sin: [S, rope_dim], FP32 (BF16 tables are upcast exactly)."""
    half = rope_dim // 2
    head = x[..., :rope_dim].float()
    rot = torch.cat([-head[..., half:], head[..., :half]], dim=-1)
    c = cos.float()[None, :, None, :]
    s = sin.float()[None, :, None, :]
    out = head * c + rot * s  # two products and a sum, each rounded (separate kernels)
    return torch.cat([out.to(x.dtype), x[..., rope_dim:]], dim=-1)


def qk_norm_rope(x, norm_weight=None, eps=1e-6, cos=None, sin=None):
    """The unfused path: optional rmsnorm, then optional rope (rope_dim = cos.shape[-1])."""
    if norm_weight is not None:
        x = rmsnorm(x, norm_weight, eps)
    if cos is not None:
        x = rope(x, cos, sin, cos.shape[-1])
    return x


# ----------------------------------------------------------------------------------------------
# Prepare
# ----------------------------------------------------------------------------------------------
def _pad_seq(x: torch.Tensor, s_pad: int) -> torch.Tensor:
    """[B, S, H, D] -> [B, S_pad, H, D] with zero rows."""
    b, s, h, d = x.shape
    out = x.new_zeros((b, s_pad, h, d))
    out[:, :s] = x
    return out


def _pad_channels(x: torch.Tensor, d_pad: int) -> torch.Tensor:
    """[..., D] -> [..., d_pad] with zero channels."""
    return torch.nn.functional.pad(x, (0, d_pad - x.shape[-1]))


def to_int8_like_torch(t: torch.Tensor) -> torch.Tensor:
    """float32 integral values -> int8 as torch's .to(torch.int8) does on the CPU: through
    int32 (out of range and NaN give INT32_MIN), then the low byte."""
    ok = torch.isfinite(t) & (t.abs() < 2.0**31)
    i32 = torch.where(ok, t, torch.zeros_like(t)).to(torch.int32)
    i32 = torch.where(ok, i32, torch.full_like(i32, -(2**31)))
    return (i32 & 0xFF).to(torch.uint8).view(torch.int8)


def quantize_int8_blocks(
    xs: torch.Tensor, block: int = SCALE_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 [B, S, H, D] (already scaled) -> int8 [B, S_pad, H, D], scales [B, H, S_pad/block].
    ``block``: rows per scale (the contract's 32, or 16 for Q with q_scale_rows=16; other sizes
    for the format studies of op_benchmarks/quant_granularity.py, S_pad then a multiple of
    it)."""
    b, s, h, d = xs.shape
    s_pad = -(-padded_len(s) // block) * block
    xp = _pad_seq(xs, s_pad)
    blocks = xp.view(b, s_pad // block, block, h, d)
    amax = blocks.abs().amax(dim=(2, 4))  # [B, nb, H]; NaN propagates
    scale = torch.div(amax, torch.full_like(amax, INT8_MAX))
    sc = scale[:, :, None, :, None]
    t = torch.div(blocks, sc)
    t = t + torch.where(t >= 0, 0.5, -0.5)
    t = torch.where(sc > 0, t.trunc(), torch.zeros_like(t))
    x8 = to_int8_like_torch(t).view(b, s_pad, h, d)
    return x8, scale.transpose(1, 2).contiguous()


PV_DTYPES = ("fp8", "fp16")


def check_pv_dtype(pv_dtype: str) -> None:
    if pv_dtype not in PV_DTYPES:
        raise ValueError(f'pv_dtype must be "fp8" or "fp16", got {pv_dtype!r}')


def quantize_v(v: torch.Tensor, pv_dtype: str = "fp8") -> tuple[torch.Tensor, torch.Tensor]:
    """BF16/FP16 [B, S, H, D] -> e4m3fn (fp16 mode: float16) [B, H, D, S_pad], scales
    [B, H, D]."""
    check_pv_dtype(pv_dtype)
    b, s, h, d = v.shape
    vf = v.float()
    scale = vf.abs().amax(dim=1) * (_f32(1.0) / FP8_MAX)  # [B, H, D]
    sc = scale[:, None]
    t = torch.where(sc > 0, vf / sc, torch.zeros_like(vf))
    if pv_dtype == "fp16":
        out16 = torch.zeros((b, h, d, padded_len(s)), dtype=torch.float16)
        out16[..., :s] = t.to(torch.float16).permute(0, 2, 3, 1)
        return out16, scale
    bits = e4m3_encode_sat(t)  # [B, S, H, D]
    out = torch.zeros((b, h, d, padded_len(s)), dtype=torch.uint8)
    out[..., :s] = bits.permute(0, 2, 3, 1)
    return out.view(torch.float8_e4m3fn), scale


def k_mean(kf: torch.Tensor, lens: list[int] | None = None) -> torch.Tensor:
    """FP32 [B, S, H, D] -> [B, H, D]: the mean over S in the pinned order (32 partial sums,
    partial g summing rows g, g + 32, ... in turn from +0; the partials in turn; / S).

    ``lens`` (per batch entry, default S): entry b averages its first lens[b] rows only (rows
    past it do not enter, whatever they hold); an entry without keys has mean 0."""
    b, s, h, d = kf.shape
    n = torch.tensor([s] * b if lens is None else lens)
    partials = torch.zeros((MEAN_PARTIALS, b, h, d), dtype=torch.float32)
    for r in range(s):
        # Adding the +0 of a row past lens[b] leaves a partial's bits unchanged.
        row = torch.where((r < n)[:, None, None], kf[:, r], 0.0)
        partials[r % MEAN_PARTIALS] = partials[r % MEAN_PARTIALS] + row
    total = partials[0]
    for g in range(1, MEAN_PARTIALS):
        total = total + partials[g]
    count = n.to(torch.float32)[:, None, None]
    return torch.where(count > 0, total / count.clamp_min(1.0), 0.0)


def entry_lengths(lens, batch: int, full: int) -> list[int]:
    """Per-batch lengths (q_lens / kv_lens: a tensor or sequence of B ints; None: ``full`` for
    every entry), clamped to [0, full] as the kernels clamp them."""
    if lens is None:
        return [full] * batch
    values = [int(n) for n in (lens.tolist() if torch.is_tensor(lens) else lens)]
    if len(values) != batch:
        raise ValueError(f"lengths must have one value per batch entry ({batch}), got {values}")
    return [min(max(n, 0), full) for n in values]


def _rows_below(lens: list[int], s: int) -> torch.Tensor:
    """bool [B, S]: row < lens[b] (the real rows of each entry)."""
    return torch.arange(s)[None, :] < torch.tensor(lens)[:, None]


def _zero_padding_rows(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] with rows where ``real`` [B, S] is False set to zero (NaN there too)."""
    return torch.where(real[:, :, None, None], x, torch.zeros((), dtype=x.dtype))


def check_q_scale_rows(q_scale_rows) -> None:
    """q_scale_rows must be one of Q_SCALE_ROWS (32, upstream's, or 16)."""
    if isinstance(q_scale_rows, bool) or not isinstance(q_scale_rows, int):
        raise TypeError(
            f"q_scale_rows must be an int, one of {Q_SCALE_ROWS}, got {type(q_scale_rows).__name__}"
        )
    if q_scale_rows not in Q_SCALE_ROWS:
        raise ValueError(f"q_scale_rows must be one of {Q_SCALE_ROWS}, got {q_scale_rows}")


def q_rows_per_scale(p: Prepared) -> int:
    """Query rows per Q scale of prepared tensors (32 or 16), from q_scale's shape."""
    rows = p.q_int8.shape[1] // max(p.q_scale.shape[-1], 1)
    if p.q_scale.shape[-1] * rows != p.q_int8.shape[1] or rows not in Q_SCALE_ROWS:
        raise ValueError(
            f"q_scale {tuple(p.q_scale.shape)} holds neither one scale per 32 nor per 16 of the "
            f"{p.q_int8.shape[1]} padded query rows"
        )
    return rows


def check_head_dim(d: int) -> None:
    if not head_dim_supported(d):
        raise ValueError(f"head dim {d} is not a multiple of {HEAD_DIM_ALIGN} in [8, {HEAD_DIM}]")


def prepare(
    q,
    k,
    v,
    softmax_scale=None,
    query_weight=None,
    key_weight=None,
    cosine=None,
    sine=None,
    eps: float = 1e-6,
    *,
    smooth_k: bool = False,
    pv_dtype: str = "fp8",
    q_scale_rows: int = SCALE_BLOCK,
    return_smoothing: bool = False,
    q_lens=None,
    kv_lens=None,
):
    """Reference prepare on BF16/FP16 [B, S, H, D] inputs (any device; computed on the CPU).

    Same call form as the op; norm and RoPE are each optional (upstream: all four or none).
    Returns a :class:`Prepared`; with ``return_smoothing`` also a :class:`Smoothing`.

    ``q_lens`` / ``kv_lens`` (B ints, default the full lengths; see :func:`entry_lengths`):
    entry b's rows of Q at or past q_lens[b] and keys of K/V at or past kv_lens[b] are
    padding, whatever they hold: zero codes, and they enter no block scale, no V channel
    scale, not the K mean (the mean of the kv_lens[b] real keys) and not lse_corr (0 there).

    ``q_scale_rows`` (32 or 16): query rows per Q scale (K keeps 32-key blocks)."""
    d = q.shape[-1]
    check_head_dim(d)
    check_q_scale_rows(q_scale_rows)
    d_pad = padded_head_dim(d)
    if softmax_scale is None:
        softmax_scale = d**-0.5
    q, k, v = (t.detach().cpu() for t in (q, k, v))
    cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
    query_weight, key_weight, cosine, sine = map(cpu, (query_weight, key_weight, cosine, sine))
    q_real = _rows_below(entry_lengths(q_lens, q.shape[0], q.shape[1]), q.shape[1])
    kv_lens = entry_lengths(kv_lens, k.shape[0], k.shape[1])
    kv_real = _rows_below(kv_lens, k.shape[1])
    q = _zero_padding_rows(qk_norm_rope(q, query_weight, eps, cosine, sine), q_real)
    k = _zero_padding_rows(qk_norm_rope(k, key_weight, eps, cosine, sine), kv_real)
    kf = k.float()
    mean = k_mean(kf, kv_lens) if smooth_k else torch.zeros(kf.shape[0], kf.shape[2], d)
    if smooth_k:  # padded keys stay zero: they are not keys, so not moved by the mean
        kf = _zero_padding_rows(kf - mean[:, None], kv_real)
    q_scaled = q.float() * q_prescale(softmax_scale)
    q8, q_scale = quantize_int8_blocks(_pad_channels(q_scaled, d_pad), q_scale_rows)
    k8, k_scale = quantize_int8_blocks(_pad_channels(kf, d_pad))
    v8, v_scale = quantize_v(_pad_channels(_zero_padding_rows(v, kv_real), d_pad), pv_dtype)
    prep = Prepared(q8, q_scale, k8, k_scale, v8, v_scale)
    if not return_smoothing:
        return prep
    group = q.shape[2] // k.shape[2]
    mean_q = mean.repeat_interleave(group, dim=1)  # [B, Hq, D]
    corr = torch.einsum("bshd,bhd->bhs", q_scaled.double(), mean_q.double()).float()
    corr = torch.where(q_real[:, None, :], corr, 0.0)  # padded rows: 0, even for a NaN mean
    corr = torch.nn.functional.pad(corr, (0, padded_len(q.shape[1]) - q.shape[1]))
    return prep, Smoothing(_pad_channels(mean, d_pad), corr)


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------
class Smoothing(NamedTuple):
    """What K smoothing leaves besides the prepared tensors (zeros without smoothing)."""

    k_mean: torch.Tensor  # FP32 [B, Hkv, Dp]
    lse_corr: torch.Tensor  # FP32 [B, Hq, Sq_pad]: Q' . k_mean per query row (log2 units)


class AttentionResult(NamedTuple):
    out: torch.Tensor  # [B, rows, Hq, D] in out_dtype
    lse: torch.Tensor  # FP32 [B, Hq, rows], natural log; -inf for rows >= q_len


def attention_from_prepared(
    p: Prepared,
    q_len: int,
    kv_len: int | None = None,
    kv_tile: int = KERNEL_KV_TILE,
    fp8_p: bool = True,
    *,
    is_causal: bool = False,
    lse_corr: torch.Tensor | None = None,
    head_dim: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    return_lse: bool = False,
    int8_pv: bool = False,
    q_lens=None,
    kv_lens=None,
):
    """The quantized attention, step by step. Returns [B, q_len, Hq, head_dim] in out_dtype
    (head_dim defaults to the prepared Dp), or an :class:`AttentionResult` with
    ``return_lse``.

    ``fp8_p=False`` keeps P unquantized (what the cpu backend does); the default is the gfx12
    kernels' P rounding: e4m3, or FP16 when the prepared V is float16 (pv_dtype "fp16").
    ``lse_corr`` (:class:`Smoothing`'s, when prepare smoothed K) makes the
    LSE that of the unsmoothed scores. ``int8_pv=True`` models the cpu amx tiers' P.V on int8
    tiles (FP8 V only; see :func:`_int8_pv_step`), at their step of ``INT8_PV_TILE`` keys.

    ``q_lens`` / ``kv_lens`` (B ints, default q_len / kv_len; see :func:`entry_lengths`):
    entry b attends over its first kv_lens[b] keys only (with ``is_causal`` also j <= i);
    its rows at or past q_lens[b] are zero with LSE -inf; a row that sees no key at all
    (kv_lens[b] == 0) is NaN with LSE -inf, as SDPA gives for an all-masked boolean row."""
    kv_len = q_len if kv_len is None else kv_len
    if int8_pv:
        assert not fp8_p and p.v_fp8.dtype != torch.float16, "int8_pv models FP8 V, P unrounded"
        kv_tile = INT8_PV_TILE
    # One score scale per tile (the kernels' tile is one K scale block): the row max of
    # t = dot * scale is then taken on the exact integer dots.
    assert int8_pv or SCALE_BLOCK % kv_tile == 0, kv_tile
    hq, hkv = p.q_int8.shape[2], p.k_int8.shape[2]
    group = hq // hkv
    q8 = p.q_int8.cpu().float().transpose(1, 2)  # [B, Hq, Sq_pad, Dp]; dots below are exact
    k8 = p.k_int8.cpu().float().transpose(1, 2).repeat_interleave(group, dim=1)
    fp16_pv = p.v_fp8.dtype == torch.float16
    vd = p.v_fp8.cpu().float() if fp16_pv else e4m3_decode(fp8_bits(p.v_fp8.cpu()))  # exact
    v8 = vd.repeat_interleave(group, dim=1)  # [B, Hq, Dp, S]
    v8[..., kv_len:] = 0  # padded keys carry P = 0; their V may hold anything
    qs = p.q_scale.cpu().repeat_interleave(q_rows_per_scale(p), dim=-1)  # per row
    ks = p.k_scale.cpu().repeat_interleave(SCALE_BLOCK, dim=-1).repeat_interleave(group, dim=1)
    b, h, sq_pad, d = q8.shape
    q_lens = entry_lengths(q_lens, b, q_len)
    kv_lens = entry_lengths(kv_lens, b, kv_len)
    for e, n in enumerate(kv_lens):
        v8[e, ..., n:] = 0
    entry_keys = torch.tensor(kv_lens)[:, None, None, None]  # [B, 1, 1, 1]
    rows = torch.arange(sq_pad)[:, None]
    m = torch.full((b, h, sq_pad), -math.inf)
    l = torch.zeros((b, h, sq_pad))
    acc = torch.zeros((b, h, sq_pad, d))
    offset = torch.tensor(EXP_OFFSET, dtype=torch.float32)
    for j0 in range(0, kv_len, kv_tile):
        j1 = min(j0 + kv_tile, kv_len)
        keys = torch.arange(j0, j1)[None, :]
        seen = (keys <= rows) if is_causal else torch.ones(sq_pad, j1 - j0, dtype=torch.bool)
        seen = seen & (keys < entry_keys)  # [B, 1, Sq_pad, keys]
        any_seen = seen.any(-1)  # [B, 1, Sq_pad]: rows that see a key of this tile
        dot = q8 @ k8[:, :, j0:j1].transpose(-1, -2)
        if int8_pv:
            ss = qs[..., :, None] * ks[..., None, j0:j1]  # float32, per key
            m, l, acc = _int8_pv_step(dot, ss, seen, any_seen, v8[..., j0:j1], m, l, acc)
            continue
        dot = torch.where(seen, dot, -math.inf)
        ss = qs[..., :, None] * ks[..., None, j0:j1]  # float32 product; one value per tile
        d_max = dot.amax(-1, keepdim=True)
        d_max = torch.where(any_seen[..., None], d_max, 0.0)
        m_t = (d_max * ss[..., :1]).squeeze(-1)  # = rowmax of t = dot * ss
        m_t = torch.where(any_seen, m_t, -math.inf)
        m_new = torch.maximum(m, m_t)
        alpha = torch.where(any_seen, torch.exp2(m - m_new), 1.0)
        bias = (m_t - m_new) + offset
        # fma: the float64 product of an integer (< 2^23) and a float32 is exact; the sum is
        # rounded to float64 and then to float32 (a double rounding at most 2^-29 relative
        # away from the single-rounded fma).
        u = ((dot - d_max).double() * ss.double() + bias.double()[..., None]).float()
        pr = torch.where(seen & any_seen[..., None], torch.exp2(u), 0.0)
        l = l * alpha + pr.sum(-1)
        if fp8_p:
            pr = pr.half().float() if fp16_pv else e4m3_decode(e4m3_encode_sat(pr))
        acc = acc * alpha[..., None] + pr @ v8[..., j0:j1].transpose(-1, -2)
        m = m_new
    v_scale = p.v_scale.cpu().repeat_interleave(group, dim=1)
    code_mean = acc / l[..., None]
    if not fp16_pv:  # the mean of e4m3 codes (or of their int8 re-quantization) is <= 448
        code_mean = saturate_finite(code_mean, FP8_MAX)
    o = saturate_finite(code_mean * v_scale[:, :, None, :], torch.finfo(out_dtype).max)
    real = _rows_below(q_lens, sq_pad)[:, None, :]  # [B, 1, Sq_pad]: rows < q_lens[b]
    o = torch.where(real[..., None], o, 0.0)
    o = o[:, :, :q_len, : (head_dim or d)].permute(0, 2, 1, 3).to(out_dtype).contiguous()
    if not return_lse:
        return o
    lse2 = m + torch.log2(l) - (0.0 if int8_pv else offset)  # int8_pv's P carries no offset
    if lse_corr is not None:
        lse2 = lse2 + lse_corr.cpu().float()
    lse2 = torch.where(real, lse2, -math.inf)
    return AttentionResult(o, (lse2 * LN2)[:, :, :q_len].contiguous())


def saturate_finite(x: torch.Tensor, bound: float) -> torch.Tensor:
    """x clamped to [-bound, bound] where it is finite; +-inf and NaN pass unchanged (the
    kernels' sage::saturate_finite)."""
    return torch.where(torch.isfinite(x), x.clamp(-bound, bound), x)


def _exp2_code(x: torch.Tensor) -> torch.Tensor:
    """2^x as the amx tiers compute P codes (EXP2_CODE_POLY, float32 Horner steps)."""
    n = torch.round(x)
    f = x - n
    c = [_f32(v) for v in EXP2_CODE_POLY]
    p = ((c[3] * f + c[2]) * f + c[1]) * f + c[0]
    return torch.ldexp(p, n.clamp(-300, 300))


def _int8_pv_step(dot, ss, seen, any_seen, vd, m, l, acc):
    """One step of the cpu amx tiers' int8 P.V (csrc/cpu/attention_tiles.inc): dot the exact
    integer scores [B, H, Sq, keys], ss their float32 scales, vd the decoded V codes [B, H, D,
    keys] (0 past kv_len). Returns the new (m, l, acc).

    * t = float32(dot * ss); t_max the row max over the keys the row sees; m' = max(m, t_max);
      alpha = exp2(m - m'). t_ref = t_max (m' for a row that sees none of the keys), p_ref =
      exp2(t_ref - m') (0 for a row that sees none of the keys).
    * P code values c = 2^float32(dot * ss + (float32(log2 255) - t_ref)) (one fma; 2^ by
      :func:`_exp2_code`), 0 for
      the keys a row does not see; codes rint(c). l = l * alpha + sum(c) * float32(p_ref /
      255).
    * V per channel over the step's keys: s_v = amax / 127, codes rint(v * float32(127 /
      amax)) (0 where amax is 0; s_v NaN and codes 0 where a value is NaN).
    * acc = acc * alpha + (P codes . V codes) * (p_ref / 255 * s_v)."""
    f32 = torch.float32
    t = torch.where(seen, (dot * ss).to(f32), -math.inf)
    t_max = t.amax(-1)
    m_new = torch.maximum(m, t_max)
    alpha = torch.where(any_seen, torch.exp2(m - m_new), 1.0)
    t_ref = torch.where(t_max == -math.inf, m_new, t_max)
    # A row that sees none of the step's keys keeps its state (p_ref 0: no P, alpha 1), also
    # while it has seen no key at all (m' = -inf, where t_ref - m' would be NaN).
    p_ref = torch.where(any_seen, torch.exp2(t_ref - m_new), 0.0)
    bias = (_f32(LOG2_P_CODE_MAX) - t_ref).double()[..., None]
    c = _exp2_code((dot.double() * ss.double() + bias).to(f32))
    c = torch.where(seen, c, 0.0)
    p_scale = p_ref * _f32(1.0 / P_CODE_MAX)
    l = l * alpha + c.sum(-1) * p_scale
    amax = vd.abs().amax(-1, keepdim=True)  # NaN where a value is NaN
    nan = amax.isnan()
    inv = torch.where(amax > 0, _f32(INT8_MAX) / amax, 0.0)
    v_codes = torch.where(nan, 0.0, torch.round(vd * torch.where(nan, 0.0, inv)))
    v_scale = amax / _f32(INT8_MAX)  # NaN stays NaN
    pv = torch.round(c).double() @ v_codes.double().transpose(-1, -2)  # exact integers
    acc = acc * alpha[..., None] + pv.to(f32) * (p_scale[..., None] * v_scale.transpose(-1, -2))
    return m_new, l, acc


def sage_attention(
    q,
    k,
    v,
    softmax_scale=None,
    *args,
    is_causal: bool = False,
    smooth_k: bool = False,
    return_lse: bool = False,
    pv_dtype: str = "fp8",
    **prepare_kwargs,
):
    """Reference SageAttention: prepare, then the quantized attention model. Output in q's
    dtype with q's head dim; with ``return_lse`` an :class:`AttentionResult`."""
    prep, smoothing = prepare(
        q,
        k,
        v,
        softmax_scale,
        *args,
        smooth_k=smooth_k,
        pv_dtype=pv_dtype,
        return_smoothing=True,
        **prepare_kwargs,
    )
    return attention_from_prepared(
        prep,
        q.shape[1],
        k.shape[1],
        is_causal=is_causal,
        lse_corr=smoothing.lse_corr if smooth_k else None,
        head_dim=q.shape[-1],
        out_dtype=q.dtype,
        return_lse=return_lse,
    )


def attention_fp32(
    q, k, v, softmax_scale=None, chunk: int = 1024, *, is_causal: bool = False
) -> torch.Tensor:
    """Plain softmax attention in FP32 on [B, S, H, D] (GQA: Hq a multiple of Hkv); returns FP32
    [B, Sq, Hq, D]. Causal: top-left aligned, as SDPA's is_causal."""
    return _attention_fp32(q, k, v, softmax_scale, chunk, is_causal)[0]


def lse_fp32(q, k, softmax_scale=None, chunk: int = 1024, *, is_causal: bool = False):
    """Natural-log log-sum-exp of the FP32 scores, [B, Hq, Sq] (torch.logsumexp)."""
    return _attention_fp32(q, k, None, softmax_scale, chunk, is_causal)[1]


def _attention_fp32(q, k, v, softmax_scale, chunk, is_causal):
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    group = q.shape[2] // k.shape[2]
    qf = q.detach().cpu().float().transpose(1, 2)
    kf = k.detach().cpu().float().transpose(1, 2).repeat_interleave(group, dim=1)
    vf = None if v is None else v.detach().cpu().float().transpose(1, 2)
    if vf is not None:
        vf = vf.repeat_interleave(group, dim=1)
    outs, lses = [], []
    cols = torch.arange(kf.shape[2])[None, :]
    for i in range(0, qf.shape[2], chunk):
        s = (qf[:, :, i : i + chunk] @ kf.transpose(-1, -2)) * softmax_scale
        if is_causal:
            rows = torch.arange(i, i + s.shape[2])[:, None]
            s = s.masked_fill(cols > rows, -math.inf)
        lses.append(torch.logsumexp(s, dim=-1))
        if vf is not None:
            outs.append(torch.softmax(s, dim=-1) @ vf)
    out = torch.cat(outs, dim=2).transpose(1, 2).contiguous() if outs else None
    return out, torch.cat(lses, dim=2)


# ----------------------------------------------------------------------------------------------
# Accuracy metrics (the band)
# ----------------------------------------------------------------------------------------------
def accuracy(out: torch.Tensor, ref: torch.Tensor, atol=BAND["atol"], rtol=BAND["rtol"]) -> dict:
    """cosine, relative L2, fraction outside atol + rtol*|ref|, median per-row cosine."""
    o = out.detach().cpu().double().flatten(0, -2)
    r = ref.detach().cpu().double().flatten(0, -2)
    cos = torch.nn.functional.cosine_similarity(o.flatten(), r.flatten(), dim=0).item()
    rel_l2 = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
    outside = ((o - r).abs() > atol + rtol * r.abs()).double().mean().item()
    row_cos = torch.nn.functional.cosine_similarity(o, r, dim=-1, eps=1e-30)
    finite = bool(torch.isfinite(o).all())
    return dict(
        cosine=cos,
        rel_l2=rel_l2,
        outside=outside,
        median_row_cosine=row_cos.median().item(),
        finite=finite,
    )


def band_failures(acc: dict) -> list[str]:
    """The band rules an accuracy dict breaks (empty: in band)."""
    rules = [
        ("finite", acc["finite"]),
        (f"cosine >= {BAND['min_cosine']}", acc["cosine"] >= BAND["min_cosine"]),
        (f"outside <= {BAND['max_outside']}", acc["outside"] <= BAND["max_outside"]),
        (
            f"median row cosine >= {BAND['min_median_row_cosine']}",
            acc["median_row_cosine"] >= BAND["min_median_row_cosine"],
        ),
        (f"relative L2 <= {BAND['max_rel_l2']}", acc["rel_l2"] <= BAND["max_rel_l2"]),
    ]
    return [name for name, ok in rules if not ok]


def in_band(acc: dict) -> bool:
    return not band_failures(acc)
