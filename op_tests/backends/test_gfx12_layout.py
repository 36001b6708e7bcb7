"""Host tests of gfx12/fragments.h and simt/prepare_layout.h: the gfx12 kernels' lane and LDS
layouts.

A tiny C++ program includes the header (plain host C++: the functions are SAGE_HD) and dumps
every mapping; the checks here prove that each mapping covers its elements exactly once, that
the LDS access patterns are bank-conflict free, and that the layouts compose as
csrc/gfx12/README.md ("gfx12 WMMA facts") says: simulating the two WMMAs with those lane
semantics, the Sᵀ accumulator of K·Qᵀ fed as the P operand of Vᵀ·Pᵀ gives exactly P·V.
Runnable as a script or under pytest."""

import json
import random
import subprocess
import tempfile
from pathlib import Path

import pytest

import _op_tests  # noqa: F401  (op_tests/ and its groups on sys.path)
from common import build_host_program, run_as_script

WAVE = 32

DUMP_SRC = r"""
#include <stdio.h>
#include "gfx12/fragments.h"
#include "simt/prepare_layout.h"
using namespace sage::gfx12;
int main() {
  printf("{\"a\":[");
  for (int l = 0; l < 32; ++l) for (int j = 0; j < 8; ++j)
    printf("%s[%d,%d,%d,%d]", l || j ? "," : "", l, j, a_row(l), a_col(l, j));
  printf("],\"b\":[");
  for (int l = 0; l < 32; ++l) for (int j = 0; j < 8; ++j)
    printf("%s[%d,%d,%d,%d]", l || j ? "," : "", l, j, b_row(l, j), b_col(l));
  printf("],\"c\":[");
  for (int l = 0; l < 32; ++l) for (int j = 0; j < 8; ++j)
    printf("%s[%d,%d,%d,%d]", l || j ? "," : "", l, j, c_row(l, j), c_col(l));
  printf("],\"qk_channel\":{");
  for (int dim = 64; dim <= 128; dim += 64) {
    printf("%s\"%d\":[", dim == 64 ? "" : ",", dim);
    for (int kk = 0; kk < dim / 16; ++kk) for (int h = 0; h < 2; ++h) for (int j = 0; j < 8; ++j)
      printf("%s[%d,%d,%d,%d]", kk || h || j ? "," : "", kk, h, j, qk_channel(kk, h, j, dim));
    printf("]");
  }
  printf("},\"tile_key\":[");
  for (int kc = 0; kc < 2; ++kc) for (int m = 0; m < 16; ++m)
    printf("%s[%d,%d,%d]", kc || m ? "," : "", kc, m, tile_key(kc, m));
  printf("],\"k_lds\":[");
  for (int r = 0; r < kKTileKeys; ++r) for (int c = 0; c < 8; ++c)
    printf("%s[%d,%d,%d]", r || c ? "," : "", r, c, k_lds_offset(r, c));
  printf("],\"k_lds_padded\":{");
  for (int dim = 64; dim <= 128; dim += 64) {
    printf("%s\"%d\":{\"bytes\":%d,\"chunk_stride\":%d,\"slot_stride\":%d,\"off\":[",
           dim == 64 ? "" : ",", dim, k_lds_padded_bytes(dim), k_lds_chunk_stride(dim),
           k_lds_stage_slot_stride(dim));
    for (int r = 0; r < kKTileKeys; ++r) for (int c = 0; c < dim / 16; ++c)
      printf("%s[%d,%d,%d]", r || c ? "," : "", r, c, k_lds_padded_offset(r, c, dim));
    printf("],\"stage\":[");
    for (int t = 0; t < 128; ++t) for (int s = 0; s < dim / 64; ++s) {
      int p = stage_piece(t, s, 128);
      printf("%s[%d,%d,%d,%d]", t || s ? "," : "", t, s, k_piece_row(p, dim),
             k_piece_chunk(p, dim));
    }
    printf("]}");
  }
  printf("}");
  printf(",\"v_lds\":[");
  for (int ch = 0; ch < 128; ++ch) for (int hf = 0; hf < 2; ++hf)
    printf("%s[%d,%d,%d]", ch || hf ? "," : "", ch, hf, v_lds_offset(ch, hf));
  printf("],\"stage\":[");
  for (int t = 0; t < 128; ++t) for (int s = 0; s < 2; ++s) {
    int p = stage_piece(t, s, 128);
    printf("%s[%d,%d,%d,%d,%d,%d,%d]", t || s ? "," : "", t, s, p, k_piece_row(p, 128),
           k_piece_chunk(p, 128), v_piece_channel(p), v_piece_half(p));
  }
  printf("],\"prep\":[");
  for (int t = 0; t < 128; ++t) for (int pass = 0; pass < 4; ++pass)
    printf("%s[%d,%d,%d,%d]", t || pass ? "," : "", t, pass, prep_row(t, pass, 128), prep_chunk(t));
  printf("],\"prep_half\":[");
  for (int dp = 64; dp <= 128; dp += 64) {
    const int lanes = prep_lanes_per_row(dp);
    for (int t = 0; t < 128; ++t) for (int pass = 0; pass < 32 / (128 / lanes); ++pass)
      printf("%s[%d,%d,%d,%d,%d]", dp == 64 && !t && !pass ? "" : ",", dp, t, pass,
             prep_row(t, pass, 128, lanes), prep_half(pass, 128, lanes));
  }
  printf("],\"qk_grid\":[");
  int qk_first = 1;
  for (int per = 1; per <= 4; per *= 2) for (int group = 1; group <= 3; group += 2)
    for (int qb = 1; qb <= 5; qb += 2) for (int kb = 1; kb <= 7; kb += 3) {
      const int heads_q = 2 * group, xs = qk_workgroups(qb, kb, group, per);
      for (int x = 0; x < xs; ++x) for (int hq = 0; hq < heads_q; ++hq)
        for (int rep = 0; rep < per; ++rep) {
          printf("%s[%d,%d,%d,%d,%d,%d,%d,%d,%d]", qk_first ? "" : ",", per, group, qb, kb, x, hq,
                 rep, x < qk_q_workgroups(qb, per), qk_block(x, hq, rep, qb, group, per));
          qk_first = 0;
        }
    }
  printf("],\"km\":[");
  for (int dp = 64; dp <= 128; dp += 64) {
    const int lanes = km_slice_lanes(dp);
    for (int z = 0; z < SAGE_K_MEAN_SLICES; ++z) for (int t = 0; t < 32 * lanes; ++t)
      printf("%s[%d,%d,%d,%d,%d]", dp == 64 && !z && !t ? "" : ",", dp, z, t,
             km_group(t, lanes), km_chunk(t, z, lanes));
  }
  printf("],\"rope\":[");
  int first = 1;
  for (int rd = 32; rd <= 128; rd += 32) for (int c = 0; c < rd / 8; ++c) {
    printf("%s[%d,%d,%d]", first ? "" : ",", rd, c, rope_partner_chunk(c, rd)); first = 0;
  }
  printf("],\"mask\":[");
  for (int n = -2; n <= 18; ++n) for (int w = 0; w < 4; ++w)
    printf("%s[%d,%d,%u]", n > -2 || w ? "," : "", n, w, first_bytes_mask(w, n));
  printf("],\"vt\":{\"keys\":%d,\"row\":%d,\"row16\":%d,\"off\":[", kVtKeys,
         vt_row_bytes(1), vt_row_bytes(2));
  for (int ch = 0; ch < 128; ++ch) printf("%s%d", ch ? "," : "", vt_lds_offset(ch, 0));
  printf("],\"off16\":[");
  for (int ch = 0; ch < 128; ++ch) printf("%s%d", ch ? "," : "", vt_lds_offset(ch, 3, 2));
  printf("]},\"k16\":[");
  for (int l = 0; l < 32; ++l) for (int j = 0; j < 8; ++j)
    printf("%s[%d,%d,%d]", l || j ? "," : "", l, j, k16_interleaved(l, j));
  printf("],\"v16\":{\"bytes128\":%d,\"bytes64\":%d,\"off\":[", v16_lds_bytes(128),
         v16_lds_bytes(64));
  for (int ch = 0; ch < 128; ++ch) for (int sl = 0; sl < kV16Slots; ++sl)
    printf("%s[%d,%d,%d]", ch || sl ? "," : "", ch, sl, v16_lds_offset(ch, sl));
  printf("],\"stage\":[");
  for (int t = 0; t < 128; ++t) for (int sl = 0; sl < 4; ++sl) {
    int p = stage_piece(t, sl, 128);
    printf("%s[%d,%d,%d,%d]", t || sl ? "," : "", t, sl, v16_piece_channel(p), v16_piece_slot(p));
  }
  printf("]},\"pass_bytes\":%d,\"bank_bytes\":%d}\n", kLdsPassBytes, kLdsBankBytes);
  return 0;
}
"""


_CACHE = {}


def layouts():
    if "d" not in _CACHE:
        with tempfile.TemporaryDirectory() as tmp:
            src, exe = Path(tmp) / "dump.cpp", Path(tmp) / "dump"
            src.write_text(DUMP_SRC)
            build_host_program(exe, src)
            _CACHE["d"] = json.loads(
                subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
            )
    return _CACHE["d"]


def _bijective(pairs, domain_size):
    vals = [v for v in pairs]
    return sorted(vals) == list(range(domain_size))


# ------------------------------------------------------------------ WMMA lane layouts ----
def test_wmma_layouts_match_design_section_4():
    d = layouts()
    for key in ("a", "b", "c"):
        cells = [(row, col) for _, _, row, col in d[key]]
        assert sorted(cells) == [(r, c) for r in range(16) for c in range(16)], key
    for lane, j, row, col in d["a"]:  # A: row r, K = 8h + j
        assert (row, col) == (lane % 16, 8 * (lane // 16) + j)
    for lane, j, row, col in d["b"]:  # B: column r, K = 8h + j
        assert (row, col) == (8 * (lane // 16) + j, lane % 16)
    for lane, j, row, col in d["c"]:  # C/D: column r, rows 8h + j
        assert (row, col) == (8 * (lane // 16) + j, lane % 16)
    # The point of Sᵀ = K·Qᵀ: C/D element (lane, j) sits where the B operand expects it.
    assert [(r, c) for _, _, r, c in d["c"]] == [(r, c) for _, _, r, c in d["b"]]


def test_qk_channel_permutation():
    d = layouts()
    for dim in (64, 128):
        qc = d["qk_channel"][str(dim)]
        assert _bijective([ch for *_, ch in qc], dim)
        # a lane's dim/16 K-steps are dim/2 contiguous channels: 16-byte loads
        for kk, h, j, ch in qc:
            assert ch == (dim // 2) * h + 8 * kk + j


def test_tile_key_permutation_makes_v_reads_contiguous():
    d = layouts()
    tk = {(kc, m): key for kc, m, key in d["tile_key"]}
    assert _bijective(tk.values(), 32)
    for h in range(2):  # the lane half h holds P keys 8h + j of both chunks:
        keys = [tk[(kc, 8 * h + j)] for kc in range(2) for j in range(8)]
        assert keys == list(range(16 * h, 16 * h + 16))  # = one 16-byte V read


# ------------------------------------------------------------------------ LDS tiles -----
def _slot_conflicts(addresses, pass_bytes):
    """16-byte accesses: number of 16-lane groups that hit a 16-byte slot twice per pass."""
    bad = 0
    for g in range(0, len(addresses), 16):
        slots = [(a % pass_bytes) // 16 for a in addresses[g : g + 16]]
        bad += len(slots) != len(set(slots))
    return bad


def test_k_lds_tile():
    d = layouts()
    off = {(r, c): o for r, c, o in d["k_lds"]}
    assert sorted(off.values()) == list(range(0, 32 * 128, 16))  # a permutation of 16B slots
    tk = {(kc, m): key for kc, m, key in d["tile_key"]}
    # A-operand reads: lane (r, h) reads row tile_key(kc, r), chunk 4h + kk/2
    for kc in range(2):
        for m4 in range(4):
            addrs = [off[(tk[(kc, lane % 16)], 4 * (lane // 16) + m4)] for lane in range(WAVE)]
            assert _slot_conflicts(addrs, d["pass_bytes"]) == 0, (kc, m4)
    # staging stores
    st = {(t, s): (kr, kch) for t, s, _, kr, kch, _, _ in d["stage"]}
    for s in range(2):
        for w in range(4):
            addrs = [off[st[(32 * w + l, s)]] for l in range(WAVE)]
            assert _slot_conflicts(addrs, d["pass_bytes"]) == 0


@pytest.mark.parametrize("dim", (64, 128))
def test_k_lds_padded_tile(dim):
    """The padded K layout of the attention kernel, per head dim: no overlap, conflict-free
    reads and staging stores, and the affine identities that let the kernel use immediate
    offsets (per-lane base + chunk stride / 16-byte step / staging slot stride)."""
    d = layouts()
    kp = d["k_lds_padded"][str(dim)]
    chunks = dim // 16
    off = {(r, c): o for r, c, o in kp["off"]}
    vals = sorted(off.values())
    assert len(set(vals)) == 32 * chunks and all(v % 16 == 0 for v in vals)
    for r in range(32):  # each row is `dim` contiguous bytes, rows in order, no overlap
        assert [off[(r, c)] for c in range(chunks)] == [off[(r, 0)] + 16 * c for c in range(chunks)]
        if r:
            assert off[(r, 0)] >= off[(r - 1, 0)] + dim
    assert kp["bytes"] == off[(31, chunks - 1)] + 16 == {128: 4400, 64: 2192}[dim]
    tk = {(kc, m): key for kc, m, key in d["tile_key"]}
    # A-operand reads: lane (r, h) reads row tile_key(kc, r), chunk (dim/32)h + kk/2
    half_chunks = dim // 32
    for kc in range(2):
        for m in range(half_chunks):
            addrs = [
                off[(tk[(kc, lane % 16)], half_chunks * (lane // 16) + m)] for lane in range(WAVE)
            ]
            assert _slot_conflicts(addrs, d["pass_bytes"]) == 0, (kc, m)
            for lane in range(WAVE):  # lane base (kc = 0, first chunk) + an immediate
                base = off[(tk[(0, lane % 16)], half_chunks * (lane // 16))]
                assert addrs[lane] == base + kc * kp["chunk_stride"] + 16 * m
    st = {(t, s): (kr, kch) for t, s, kr, kch in kp["stage"]}
    assert sorted(st.values()) == [(r, c) for r in range(32) for c in range(chunks)]
    for s in range(dim // 64):
        for w in range(4):
            addrs = [off[st[(32 * w + l, s)]] for l in range(WAVE)]
            assert _slot_conflicts(addrs, d["pass_bytes"]) == 0
        for t in range(128):
            assert off[st[(t, s)]] == off[st[(t, 0)]] + s * kp["slot_stride"]


def test_v_lds_tile_offsets_are_affine():
    """What the kernel's immediate offsets rely on: channel block cb adds 512 bytes to the
    read address of channel r, and staging slot s adds 2048 to the store address."""
    d = layouts()
    off = {(ch, hf): o for ch, hf, o in d["v_lds"]}
    for cb in range(8):
        for lane in range(WAVE):
            assert off[(16 * cb + lane % 16, lane // 16)] == off[(lane % 16, lane // 16)] + 512 * cb
    st = {(t, s): (vc, vh) for t, s, _, _, _, vc, vh in d["stage"]}
    for t in range(128):
        assert off[st[(t, 1)]] == off[st[(t, 0)]] + 2048


def test_v_lds_tile():
    """Both head dims: the D = 64 tile is the first 64 channels (reads cb < 4, staging slot
    0), each a subset of what is checked here."""
    d = layouts()
    off = {(ch, hf): o for ch, hf, o in d["v_lds"]}
    assert sorted(off.values()) == list(range(0, 128 * 32, 16))
    assert sorted(o for (ch, _), o in off.items() if ch < 64) == list(range(0, 64 * 32, 16))
    for cb in range(8):  # A-operand reads: lane reads channel 16cb + r, half h
        addrs = [off[(16 * cb + lane % 16, lane // 16)] for lane in range(WAVE)]
        assert _slot_conflicts(addrs, d["pass_bytes"]) == 0, cb
    st = {(t, s): (vc, vh) for t, s, _, _, _, vc, vh in d["stage"]}
    for s in range(2):
        for w in range(4):
            addrs = [off[st[(32 * w + l, s)]] for l in range(WAVE)]
            assert _slot_conflicts(addrs, d["pass_bytes"]) == 0


def test_staging_covers_tiles_once():
    d = layouts()
    k = sorted((kr, kc) for _, _, _, kr, kc, _, _ in d["stage"])
    v = sorted((vc, vh) for _, _, _, _, _, vc, vh in d["stage"])
    assert k == [(r, c) for r in range(32) for c in range(8)]
    assert v == [(c, h) for c in range(128) for h in range(2)]
    # consecutive lanes take consecutive 16-byte pieces (contiguous global loads)
    for t, s, p, *_ in d["stage"]:
        assert p == t + 128 * s


# ------------------------------------------------------- composition (gfx12 WMMA facts) ------
def _wmma(a_frag, b_frag, c_frag, d):
    """D = A x B + C on lane fragments, with the lane semantics of csrc/gfx12/README.md."""
    A = [[0] * 16 for _ in range(16)]
    B = [[0] * 16 for _ in range(16)]
    C = [[0] * 16 for _ in range(16)]
    for lane, j, r, c in d["a"]:
        A[r][c] = a_frag[lane][j]
    for lane, j, r, c in d["b"]:
        B[r][c] = b_frag[lane][j]
    for lane, j, r, c in d["c"]:
        C[r][c] = c_frag[lane][j]
    D = [
        [C[m][n] + sum(A[m][k] * B[k][n] for k in range(16)) for n in range(16)] for m in range(16)
    ]
    out = [[0] * 8 for _ in range(WAVE)]
    for lane, j, r, c in d["c"]:
        out[lane][j] = D[r][c]
    return out


@pytest.mark.parametrize("dim", (64, 128))
def test_scores_feed_pv_without_shuffles(dim):
    """One wave, one 16-query block, one 32-key tile, the kernel's fragment recipes."""
    d = layouts()
    rnd = random.Random(dim)
    Q = [[rnd.randint(-127, 127) for _ in range(dim)] for _ in range(16)]
    K = [[rnd.randint(-127, 127) for _ in range(dim)] for _ in range(32)]
    V = [[rnd.randint(-8, 8) for _ in range(dim)] for _ in range(32)]  # [key][channel]
    ch = {(kk, h, j): c for kk, h, j, c in d["qk_channel"][str(dim)]}
    tk = {(kc, m): key for kc, m, key in d["tile_key"]}
    S = []
    for kc in range(2):  # Sᵀ = K·Qᵀ, A = K rows tile_key(kc, r), B = Q of query r
        acc = [[0] * 8 for _ in range(WAVE)]
        for kk in range(dim // 16):
            a = [[K[tk[(kc, l % 16)]][ch[(kk, l // 16, j)]] for j in range(8)] for l in range(WAVE)]
            b = [[Q[l % 16][ch[(kk, l // 16, j)]] for j in range(8)] for l in range(WAVE)]
            acc = _wmma(a, b, acc, d)
        S.append(acc)
    for kc in range(2):  # lane = query r, element j = key tile_key(kc, 8h + j)
        for lane in range(WAVE):
            for j in range(8):
                key = tk[(kc, 8 * (lane // 16) + j)]
                assert S[kc][lane][j] == sum(Q[lane % 16][c] * K[key][c] for c in range(dim))
    P = [[[s % 5 for s in S[kc][lane]] for lane in range(WAVE)] for kc in range(2)]  # any P
    for cb in range(dim // 16):  # Oᵀ = Vᵀ·Pᵀ: A = V channel 16cb + r, keys 16h.. (one read)
        acc = [[0] * 8 for _ in range(WAVE)]
        for kc in range(2):
            a = [
                [V[16 * (l // 16) + 8 * kc + j][16 * cb + l % 16] for j in range(8)]
                for l in range(WAVE)
            ]
            acc = _wmma(a, P[kc], acc, d)  # P straight from the Sᵀ registers
        for lane in range(WAVE):
            q = lane % 16
            for j in range(8):
                c = 16 * cb + 8 * (lane // 16) + j
                want = sum(
                    P[kc][l][jj] * V[tk[(kc, 8 * (l // 16) + jj)]][c]
                    for kc in range(2)
                    for l in (q, q + 16)
                    for jj in range(8)
                )
                assert acc[lane][j] == want


# ------------------------------------------------------- FP16 P·V (pv_dtype "fp16") ------
def test_v16_lds_tile():
    """The FP16 V tile (v16_lds_offset): every 16-byte slot of 128 channels x 4 slots once,
    16-byte aligned, within 8704 bytes (D = 64: the first 64 channels, 4352); the A reads
    (lane = channel 16cb + r, slot 2h + kc) and the staging stores (consecutive threads =
    consecutive 16-byte pieces) are conflict free; and the kernel's immediates hold: slot
    + 1 = +16 bytes, channel block + 1 = +1088, staging slot + 1 = +2176."""
    d = layouts()
    v16 = d["v16"]
    off = {(ch, sl): o for ch, sl, o in v16["off"]}
    assert len(set(off.values())) == 512 and all(o % 16 == 0 for o in off.values())
    # the stage's V size: where channel 128 (64) would start, the last pad slot included
    assert max(off.values()) + 16 <= v16["bytes128"] == 8704
    assert max(o for (ch, _), o in off.items() if ch < 64) + 16 <= v16["bytes64"] == 4352
    for cb in range(8):
        for kc in range(2):
            addrs = [off[(16 * cb + lane % 16, 2 * (lane // 16) + kc)] for lane in range(WAVE)]
            assert _slot_conflicts(addrs, d["pass_bytes"]) == 0, (cb, kc)
            for lane in range(WAVE):
                base = off[(lane % 16, 2 * (lane // 16))]
                assert addrs[lane] == base + 1088 * cb + 16 * kc
    st = {(t, sl): (c, k) for t, sl, c, k in v16["stage"]}
    assert sorted(st.values()) == [(c, k) for c in range(128) for k in range(4)]
    for sl in range(4):
        for w in range(4):
            addrs = [off[st[(32 * w + lane, sl)]] for lane in range(WAVE)]
            assert _slot_conflicts(addrs, d["pass_bytes"]) == 0, (sl, w)
        for t in range(128):
            assert off[st[(t, sl)]] == off[st[(t, 0)]] + 2176 * sl


def _wmma16(a_frag, b_frag, c_frag, d, k_of):
    """A 16-bit WMMA whose A and B operands share the K map k_of(lane, j); C/D as 8-bit."""
    A = [[0] * 16 for _ in range(16)]
    B = [[0] * 16 for _ in range(16)]
    for lane in range(WAVE):
        for j in range(8):
            A[lane % 16][k_of(lane, j)] = a_frag[lane][j]
            B[k_of(lane, j)][lane % 16] = b_frag[lane][j]
    C = [[0] * 16 for _ in range(16)]
    for lane, j, r, c in d["c"]:
        C[r][c] = c_frag[lane][j]
    out = [[0] * 8 for _ in range(WAVE)]
    for lane, j, r, c in d["c"]:
        out[lane][j] = C[r][c] + sum(A[r][k] * B[k][c] for k in range(16))
    return out


@pytest.mark.parametrize("reading", ["contiguous", "interleaved"])
def test_fp16_pv_composes_for_either_16bit_reading(reading):
    """The FP16 P·V kernel's recipe (P element j of key chunk kc straight from the Sᵀ
    accumulator: tile key tile_key(kc, 8h + j); V's A operand: slot 2h + kc of channel
    16cb + r, tile keys 16h + 8kc + j) gives exactly P·V under BOTH published readings of
    the 16-bit operand layout (sage/arch/gfx12_wmma.h): 8h + j, and K interleaved by 4
    (k16_interleaved, what the emulator models; first checked to be a bijection)."""
    d = layouts()
    k16 = {(lane, j): k for lane, j, k in d["k16"]}
    for r in range(16):
        assert sorted(k16[(r + 16 * h, j)] for h in range(2) for j in range(8)) == list(range(16))

    def k_of(lane, j):
        return 8 * (lane // 16) + j if reading == "contiguous" else k16[(lane, j)]

    tk = {(kc, m): key for kc, m, key in d["tile_key"]}
    rnd = random.Random(7)
    V = [[rnd.randint(-8, 8) for _ in range(32)] for _ in range(32)]  # [key][channel]
    Pkq = [[rnd.randint(0, 9) for _ in range(16)] for _ in range(32)]  # [tile key][query]
    # P as it sits in the Sᵀ registers: lane = query r, element j = key tile_key(kc, 8h + j)
    P = [
        [[Pkq[tk[(kc, 8 * (lane // 16) + j)]][lane % 16] for j in range(8)] for lane in range(WAVE)]
        for kc in range(2)
    ]
    for cb in range(2):
        acc = [[0] * 8 for _ in range(WAVE)]
        for kc in range(2):
            a = [
                [V[16 * (lane // 16) + 8 * kc + j][16 * cb + lane % 16] for j in range(8)]
                for lane in range(WAVE)
            ]
            acc = _wmma16(a, P[kc], acc, d, k_of)
        for lane, j, r, c in d["c"]:  # Oᵀ: row = channel 16cb + r, column = query c
            want = sum(Pkq[key][c] * V[key][16 * cb + r] for key in range(32))
            assert acc[lane][j] == want, (reading, cb, lane, j)


# ------------------------------------------------------------------------- prepare ------
def test_prepare_qk_mapping():
    d = layouts()
    cells = sorted((row, c) for _, _, row, c in d["prep"])
    assert cells == [(r, c) for r in range(32) for c in range(16)]
    # the 16 lanes of a row form one half-wave with chunk = lane % 16, so the RMSNorm
    # butterfly (shfl_xor 8, 4, 2, 1) stays inside the row
    lanes = {}
    for t, _, row, c in d["prep"]:
        assert c == t % 16
        lanes.setdefault(row, set()).add(t)
    for ts in lanes.values():
        t0 = min(ts)
        assert t0 % 16 == 0 and ts == set(range(t0, t0 + 16))


def test_prepare_q_scale_halves():
    """q_scale_rows 16 (simt/prepare_layout.h prep_half): at Dp 128 (4 passes of 8 rows) and
    Dp 64 (2 passes of 16 rows) every row of a pass lies in the 16-row half prep_half names,
    and each half is covered by the passes that name it, every row once."""
    d = layouts()
    for dp, passes in ((128, 4), (64, 2)):
        entries = [e[1:] for e in d["prep_half"] if e[0] == dp]
        assert len(entries) == 128 * passes
        covered = {0: set(), 1: set()}
        for t, pass_, row, half in entries:
            assert row // 16 == half, (dp, t, pass_, row, half)
            covered[half].add((row, t % (dp // 8)))
        for half, cells in covered.items():
            rows = range(16 * half, 16 * half + 16)
            assert cells == {(r, c) for r in rows for c in range(dp // 8)}, (dp, half)
        assert [h for _, p, _, h in entries if p == 0][0] == 0  # pass 0 starts the block


def test_k_mean_slices_hold_each_partial_of_each_chunk_once():
    """K mean slices (simt/prepare_layout.h km_*): over the slices' active threads, every
    (row group g < 32, chunk) of a Dp-channel row exactly once, so every channel's 32 partials
    of quant.h's pinned order are each one thread's sequential sum; a slice's chunks are
    contiguous (one 16 * lanes-byte piece of each row) and a row group's lanes are adjacent
    threads."""
    d = layouts()
    for dp in (64, 128):
        entries = [e[1:] for e in d["km"] if e[0] == dp]
        assert sorted((g, c) for _, _, g, c in entries) == [
            (g, c) for g in range(32) for c in range(dp // 8)
        ], dp
        by_slice = {}
        for z, t, g, c in entries:
            by_slice.setdefault(z, set()).add(c)
            assert g == t // (len([e for e in entries if e[0] == z]) // 32)
        chunks = sorted(by_slice.values(), key=min)
        width = len(chunks[0])
        assert all(cs == set(range(min(cs), min(cs) + width)) for cs in chunks), dp
        assert width * len(chunks) == dp // 8


def test_qk_grid_covers_every_scale_block_once():
    """The qk grid (simt/prepare_layout.h qk_workgroups / qk_block) with one, two or four blocks
    per workgroup (four: the plain BF16 build at Dp 64): every Q block of every query head and
    every K block of every key/value head (GQA groups 1 and 3: K blocks dealt round robin to the
    group's query heads) exactly once, a workgroup's blocks consecutive in rep order, and nothing
    but blocks past the last skipped."""
    d = layouts()
    cases = {}
    for per, group, qb, kb, x, hq, rep, is_q, blk in d["qk_grid"]:
        cases.setdefault((per, group, qb, kb), []).append((x, hq, rep, is_q, blk))
    assert len(cases) == 3 * 2 * 3 * 3
    for (per, group, qb, kb), rows in cases.items():
        q = [(hq, blk) for x, hq, rep, is_q, blk in rows if is_q and blk < qb]
        k = [(hq // group, blk) for x, hq, rep, is_q, blk in rows if not is_q and blk < kb]
        assert sorted(q) == [(h, b) for h in range(2 * group) for b in range(qb)], (per, group)
        assert sorted(k) == [(h, b) for h in range(2) for b in range(kb)], (per, group, qb, kb)
        by_wg = {}
        for x, hq, rep, is_q, blk in rows:
            by_wg.setdefault((x, hq), []).append((rep, blk, is_q))
        for blocks in by_wg.values():
            blks = [b for _, b, _ in sorted(blocks)]
            step = 1 if blocks[0][2] else group
            assert blks == [blks[0] + step * r for r in range(per)]
        # a workgroup whose first block is past the last has nothing to do: at most one per
        # query head and role (the rounding up of the grid)
        idle = [
            (hq, is_q)
            for (x, hq), b in by_wg.items()
            for rep, blk, is_q in b
            if rep == 0 and blk >= (qb if is_q else kb)
        ]
        assert len(idle) == len(set(idle)), (per, group, qb, kb)


def test_rope_partner():
    d = layouts()
    for rd, c, pc in d["rope"]:
        half_chunks = rd // 16
        assert pc == (c + half_chunks if c < half_chunks else c - half_chunks)
        assert 0 <= pc < rd // 8
    part = {(rd, c): pc for rd, c, pc in d["rope"]}
    assert all(part[(rd, pc)] == c for (rd, c), pc in part.items())  # an involution


def test_v_transpose_tile():
    d = layouts()
    vt, row = d["vt"], d["vt"]["row"]
    assert vt["off"] == [ch * row for ch in range(128)] and row >= vt["keys"] and row % 4 == 0
    # FP16 codes (v_quant16): rows of 2 x 128 key bytes + one word, key k at byte 2k
    row16 = vt["row16"]
    assert row16 >= 2 * vt["keys"] and row16 % 4 == 0
    assert vt["off16"] == [ch * row16 + 6 for ch in range(128)]
    # column writes: 16 lanes = channel chunks c (rows 8c + i), same 4-key word: count banks
    banks = d["pass_bytes"] // d["bank_bytes"]
    for i in range(8):
        b = [((8 * c + i) * row // 4) % banks for c in range(16)]
        assert max(b.count(x) for x in set(b)) <= 2  # at most 2-way (memory-bound kernel)


def test_first_bytes_mask_keeps_exactly_the_first_n_bytes():
    """The last KV tile zeroes V bytes of keys >= kv_len with these masks."""
    for n, w, mask in layouts()["mask"]:
        want = 0
        for byte in range(4):
            if 4 * w + byte < n:
                want |= 0xFF << (8 * byte)
        assert mask == want, (n, w, hex(mask))


if __name__ == "__main__":
    run_as_script(__file__)
