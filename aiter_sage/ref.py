"""Executable specification of aiter_sage's numerics.

Every backend's ``gfx1201_sage_prepare`` must equal :func:`prepare` bit for bit, and every
backend's attention must sit inside :data:`BAND` of :func:`attention_fp32`. The quantized
attention is modelled step by step in :func:`attention_from_prepared` so that a reader can see
where each rounding happens. Rounding choices (each a single correctly rounded IEEE float32
operation unless stated):

Prepare
  * Q' = float32(q) * c with c = float32(float32(softmax_scale) * float32(log2 e)); the kernel
    then works in the exp2 domain. K' = float32(k) (no factor).
  * Per (batch, head, 32-row block): s = amax|X'| / 127; a block whose s is not > 0 (all zero
    or underflowing) uses s = 1 and quantizes to zeros. x8 = clamp(rne(X' / s), -127, 127)
    (true division, ties to even; NaN quotients map to -127).
  * V: per (batch, head, channel) s_v = amax_s |v| / 448 (same zero rule);
    v8 = e4m3fn(v / s_v) with round-to-nearest-even and saturation to +-448, stored
    transposed [B, H, 128, S_pad]; padding bytes are +0.
  * Sequence axes are padded to a multiple of SEQ_ALIGN (128) with zero rows.
  * Optional fused QK RMSNorm then rotate-half RoPE, rounded like the eager BF16 PyTorch
    sequence ``rmsnorm`` then ``rope`` below: the sum of squares uses a pinned order (16
    partial sums of 8 consecutive channels, each sequential, then pairwise halving
    p[j] + p[j + n/2]); mean = sum / 128; inv = 1 / sqrt(mean + eps); y = bf16(x * inv);
    out = bf16(y * w). RoPE: out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)) on the
    first rope_dim channels, the rest unchanged.

Attention (log2 domain; the kernels follow the same steps, their tile sizes may differ)
  * t = float32(dot_i32(q8, k8)) * (q_scale * k_scale); keys >= kv_len are masked (-inf).
  * Online softmax over KV tiles: m' = max(m, rowmax t); alpha = exp2(m - m');
    P = exp2(t - m'); l = l * alpha + rowsum P (from unquantized P).
  * P8 = e4m3fn(P * 448) (P <= 1, so no saturation is needed); acc = acc * alpha + P8 . V8
    with FP32 accumulation of exact products.
  * O = acc / (l * 448) * s_v, rounded to BF16.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

HEAD_DIM = 128
SCALE_BLOCK = 32
SEQ_ALIGN = 128
INT8_MAX = 127.0
FP8_MAX = 448.0
LOG2E = float(torch.tensor(math.log2(math.e), dtype=torch.float32))
NORM_PARTIALS = 16
ROPE_DIMS = (32, 64, 96, 128)
DEFAULT_KV_TILE = 64

# Accuracy band against the FP32 reference (random inputs).
BAND = dict(atol=0.3, rtol=0.25, max_outside=0.005, min_cosine=0.998, min_median_row_cosine=0.99)


class Prepared(NamedTuple):
    """Output of prepare: what ``gfx1201_sage_attention_fwd`` consumes."""

    q8: torch.Tensor  # int8 [B, H, Sq_pad, 128]
    q_scale: torch.Tensor  # float32 [B, H, Sq_pad / 32]
    k8: torch.Tensor  # int8 [B, H, Skv_pad, 128]
    k_scale: torch.Tensor  # float32 [B, H, Skv_pad / 32]
    v8: torch.Tensor  # float8_e4m3fn [B, H, 128, Skv_pad]
    v_scale: torch.Tensor  # float32 [B, H, 128]
    q_len: int
    kv_len: int


def padded_len(n: int) -> int:
    return (n + SEQ_ALIGN - 1) // SEQ_ALIGN * SEQ_ALIGN


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def q_prescale(softmax_scale: float) -> torch.Tensor:
    """float32(float32(softmax_scale) * float32(log2 e))."""
    return _f32(softmax_scale) * _f32(LOG2E)


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
# Fused QK RMSNorm + RoPE, as the eager BF16 PyTorch sequence
# ----------------------------------------------------------------------------------------------
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """BF16 RMSNorm over the last dim (128) with the pinned reduction order."""
    xf = x.float()
    parts = (xf * xf).unflatten(-1, (NORM_PARTIALS, HEAD_DIM // NORM_PARTIALS))
    p = parts[..., 0]
    for i in range(1, parts.shape[-1]):
        p = p + parts[..., i]
    n = NORM_PARTIALS
    while n > 1:
        n //= 2
        p = p[..., :n] + p[..., n : 2 * n]
    mean = p[..., 0] / float(HEAD_DIM)
    # torch's vectorised float32 sqrt is not always correctly rounded; the square root of a
    # float32 computed in float64 and rounded once is (53 >= 2*24 + 2 bits).
    root = torch.sqrt((mean + _f32(eps)).double()).float()
    inv = torch.div(torch.ones_like(mean), root)
    y = (xf * inv[..., None]).to(torch.bfloat16)
    return y * weight.to(torch.bfloat16)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Rotate-half RoPE on channels [0, rope_dim) of BF16 [B, S, H, D]; cos/sin BF16 [S, rope_dim]."""
    half = rope_dim // 2
    xr = x[..., :rope_dim]
    rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    c = cos.to(torch.bfloat16)[None, :, None, :]
    s = sin.to(torch.bfloat16)[None, :, None, :]
    out = xr * c + rot * s
    return torch.cat([out, x[..., rope_dim:]], dim=-1)


def qk_norm_rope(x, norm_weight=None, eps=1e-6, rope_cos=None, rope_sin=None):
    """The unfused path: optional rmsnorm, then optional rope (rope_dim = cos.shape[-1])."""
    if norm_weight is not None:
        x = rmsnorm(x, norm_weight, eps)
    if rope_cos is not None:
        x = rope(x, rope_cos, rope_sin, rope_cos.shape[-1])
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


def _block_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    s = amax / qmax
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize_int8_blocks(xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 [B, S, H, D] (already scaled) -> int8 [B, H, S_pad, D], scales [B, H, S_pad/32]."""
    b, s, h, d = xs.shape
    s_pad = padded_len(s)
    xp = _pad_seq(xs, s_pad)
    blocks = xp.unflatten(1, (s_pad // SCALE_BLOCK, SCALE_BLOCK))  # [B, nb, 32, H, D]
    amax = blocks.abs().amax(dim=(2, 4))  # [B, nb, H]
    scale = _block_scale(amax, INT8_MAX)
    r = torch.round(blocks / scale[:, :, None, :, None])
    r = torch.where(torch.isnan(r), -INT8_MAX, r).clamp(-INT8_MAX, INT8_MAX)
    x8 = r.to(torch.int8).flatten(1, 2).permute(0, 2, 1, 3).contiguous()
    return x8, scale.permute(0, 2, 1).contiguous()


def quantize_v(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 [B, S, H, D] -> e4m3fn [B, H, D, S_pad], scales [B, H, D]."""
    b, s, h, d = v.shape
    vf = v.float()
    scale = _block_scale(vf.abs().amax(dim=1), FP8_MAX)  # [B, H, D]
    bits = e4m3_encode_sat(vf / scale[:, None])  # [B, S, H, D]
    out = torch.zeros((b, h, d, padded_len(s)), dtype=torch.uint8)
    out[..., :s] = bits.permute(0, 2, 3, 1)
    return out.view(torch.float8_e4m3fn), scale


def prepare(q, k, v, softmax_scale: float, q_norm_weight=None, k_norm_weight=None,
            norm_eps: float = 1e-6, rope_cos=None, rope_sin=None) -> Prepared:
    """Reference prepare on BF16 [B, S, H, 128] inputs (any device; computed on the CPU)."""
    q, k, v = (t.detach().cpu() for t in (q, k, v))
    if q_norm_weight is not None:
        q_norm_weight, k_norm_weight = q_norm_weight.cpu(), k_norm_weight.cpu()
    if rope_cos is not None:
        rope_cos, rope_sin = rope_cos.cpu(), rope_sin.cpu()
    q = qk_norm_rope(q, q_norm_weight, norm_eps, rope_cos, rope_sin)
    k = qk_norm_rope(k, k_norm_weight, norm_eps, rope_cos, rope_sin)
    q8, q_scale = quantize_int8_blocks(q.float() * q_prescale(softmax_scale))
    k8, k_scale = quantize_int8_blocks(k.float())
    v8, v_scale = quantize_v(v)
    return Prepared(q8, q_scale, k8, k_scale, v8, v_scale, q.shape[1], k.shape[1])


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------
def attention_from_prepared(p: Prepared, kv_tile: int = DEFAULT_KV_TILE) -> torch.Tensor:
    """The quantized attention, step by step. Returns BF16 [B, Sq, H, 128]."""
    q8 = p.q8.float()  # integer-valued: every dot below is exact in FP32 (|dot| < 2^24)
    k8 = p.k8.float()
    v8 = e4m3_decode(fp8_bits(p.v8))  # [B, H, D, Skv_pad]
    qs = p.q_scale.repeat_interleave(SCALE_BLOCK, dim=-1)  # per row
    ks = p.k_scale.repeat_interleave(SCALE_BLOCK, dim=-1)
    b, h, sq_pad, d = q8.shape
    skv_pad = k8.shape[2]
    m = torch.full((b, h, sq_pad), -math.inf)
    l = torch.zeros((b, h, sq_pad))
    acc = torch.zeros((b, h, sq_pad, d))
    for j0 in range(0, skv_pad, kv_tile):
        j1 = min(j0 + kv_tile, skv_pad)
        dot = q8 @ k8[:, :, j0:j1].transpose(-1, -2)
        t = dot * (qs[..., :, None] * ks[..., None, j0:j1])
        keys = torch.arange(j0, j1)
        t = t.masked_fill(keys >= p.kv_len, -math.inf)
        m_new = torch.maximum(m, t.amax(-1))
        alpha = torch.exp2(m - m_new)
        pr = torch.exp2(t - m_new[..., None])
        l = l * alpha + pr.sum(-1)
        p8 = e4m3_decode(e4m3_encode_sat(pr * FP8_MAX))
        acc = acc * alpha[..., None] + p8 @ v8[..., j0:j1].transpose(-1, -2)
        m = m_new
    o = acc / (l * FP8_MAX)[..., None] * p.v_scale[:, :, None, :]
    return o[:, :, : p.q_len].permute(0, 2, 1, 3).to(torch.bfloat16).contiguous()


def sage_attention(q, k, v, softmax_scale: float, **prepare_kwargs) -> torch.Tensor:
    return attention_from_prepared(prepare(q, k, v, softmax_scale, **prepare_kwargs))


def attention_fp32(q, k, v, softmax_scale: float, chunk: int = 1024) -> torch.Tensor:
    """Plain softmax attention in FP32 on [B, S, H, D]; returns FP32 [B, Sq, H, D]."""
    qf, kf, vf = (t.detach().cpu().float().transpose(1, 2) for t in (q, k, v))
    outs = []
    for i in range(0, qf.shape[2], chunk):
        s = (qf[:, :, i : i + chunk] @ kf.transpose(-1, -2)) * softmax_scale
        outs.append(torch.softmax(s, dim=-1) @ vf)
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


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
    return dict(cosine=cos, rel_l2=rel_l2, outside=outside,
                median_row_cosine=row_cos.median().item(), finite=finite)


def in_band(acc: dict) -> bool:
    return (acc["finite"] and acc["cosine"] >= BAND["min_cosine"]
            and acc["outside"] <= BAND["max_outside"]
            and acc["median_row_cosine"] >= BAND["min_median_row_cosine"])
