// aiter_sage: lane bookkeeping of the gfx12 kernels — how the attention kernel permutes
// channels and keys to make the WMMA operands (sage/arch/gfx12_wmma.h: the hardware's lane
// layout) contiguous, and where tiles live in LDS. Pure integer functions, usable on host and
// device, unit-tested on the host by op_tests/backends/test_gfx12_layout.py (every mapping covers
// each element exactly once, LDS accesses are bank-conflict free, and the layouts compose: the Sᵀ
// accumulator of one WMMA is the P operand of the next).
#pragma once
#include "sage/arch/gfx12_wmma.h"
#include "sage/params.h"
#include "sage/platform.h"

namespace sage {
namespace gfx12 {

// ------------------------------------------------------- attention: operand mapping ------
// Sᵀ = K·Qᵀ (iu8): A = K tile (rows = keys, K-dim = channels), B = Qᵀ (columns = queries).
// Oᵀ = V8ᵀ·P8ᵀ (fp8): A = Vᵀ tile (rows = channels, K-dim = keys), B = Pᵀ (columns = queries).
// The C/D layout of Sᵀ (lane = query, 8 keys) is the B layout of Pᵀ, so P goes from the
// softmax straight into the second WMMA; and Oᵀ's C/D layout keeps each query's accumulators
// in the lane that owns that query's softmax statistics (no shuffles for the rescale).
//
// A dot product does not care about the order of its terms, so both contractions use a
// permuted order that makes every lane's bytes contiguous in memory:
//  * QK contraction step kk (0..dim/16-1) over the `dim` channels (the kernel head dim, 64 or
//    128): lane half h holds channels (dim/2)h + 8kk + j, i.e. one lane reads dim/2 contiguous
//    bytes of its Q row / K row (16 bytes = two K-steps per load).
SAGE_HD constexpr int qk_channel(int kk, int half, int j, int dim) {
  return (dim / 2) * half + 8 * kk + j;
}
//  * A 32-key tile is contracted as two 16-key chunks kc; WMMA index m (the Sᵀ row, the P·V
//    K-dim) of chunk kc is tile key 16(m / 8) + 8kc + m % 8. Then the lane holding P keys
//    8h + j of both chunks needs V bytes of tile keys 16h .. 16h + 15: one 16-byte load.
SAGE_HD constexpr int tile_key(int kc, int m) { return 16 * (m >> 3) + 8 * kc + (m & 7); }

// ---------------------------------------------------------- attention: LDS tiles ------
// K tile: 32 keys x 128 channel bytes, row-major, 16-byte chunks XOR-swizzled per row so that
// the A-operand reads (16 lanes = 16 rows tile_key(kc, 0..15), same chunk) and the staging
// stores (16 lanes = 2 rows x 8 chunks) hit 16 distinct 16-byte slots of a 256-byte pass.
// (Reference only: the kernel uses the padded layout below, for both head dims.)
constexpr int kKTileKeys = 32;
constexpr int kKRowBytes = 128;
SAGE_HD constexpr int k_lds_swizzle(int row) { return ((row >> 1) & 3) | ((row >> 2) & 4); }
SAGE_HD constexpr int k_lds_offset(int row, int chunk16) {
  return row * kKRowBytes + 16 * (chunk16 ^ k_lds_swizzle(row));
}
// K tile of head dim `dim` (64 or 128: rows of C = dim/16 16-byte chunks), padded instead of
// swizzled (what the attention kernel uses): row `row` starts k_lds_row_pad(row, dim) 16-byte
// slots after row * dim, and its C chunks follow in order. Unlike the XOR swizzle above, a
// lane's chunk index then only ADDS to its address, so every K read of a tile is one per-lane
// base plus an immediate offset (ds_load_b128 offset:N, no VALU). A 256-byte pass holds
// 16 / C rows; the pad grows by one slot per such group of rows and by C/2 more at row 16:
//  * dim 128 (pad r/2 + 4(r/16)): reads: 16 lanes read rows tile_key(kc, 0..15) = {8kc..8kc+7,
//    16+8kc..16+8kc+7}, same chunk; their slots (8 row + pad + chunk) mod 16 are {p..p+3,
//    p+8..p+11} for the first 8 rows and the other 8 values for the next 8 (the pad grows by 4
//    at row 16): distinct. Staging stores: 16 lanes = rows 2i, 2i+1 (same pad) x 8 chunks.
//  * dim 64 (pad r/4 + 2(r/16)): reads: slots (4 row + pad) mod 16 of rows 8kc..8kc+7 are
//    {0,4,8,12}+{0,1} (+2kc), those of rows 16+8kc.. the same +2 (the pad grows by 2 at row
//    16): the 16 values are distinct. Staging stores: 16 lanes = rows 4i..4i+3 (same pad) x 4
//    chunks: 16 consecutive slots.
//  * rows never overlap (pad is non-decreasing), and the offsets are affine in the kernel's
//    loop indices: chunk kc + 1 of the reads is k_lds_chunk_stride(dim) further, staging slot
//    s + 1 (dim 128 only) k_lds_stage_slot_stride further (op_tests/backends/test_gfx12_layout.py
//    checks all of it for both head dims).
SAGE_HD constexpr int k_lds_row_pad(int row, int dim) {
  return row / (256 / dim) + (dim / 32) * (row >> 4);
}
SAGE_HD constexpr int k_lds_padded_offset(int row, int chunk16, int dim) {
  return row * dim + 16 * (k_lds_row_pad(row, dim) + chunk16);
}
constexpr int kKLdsChunkRows = 8;                    // tile_key(kc + 1, m) = tile_key(kc, m) + 8
SAGE_HD constexpr int k_lds_padded_bytes(int dim) {  // 4400 (dim 128), 2192 (dim 64)
  return k_lds_padded_offset(kKTileKeys - 1, dim / 16, dim);
}
SAGE_HD constexpr int k_lds_chunk_stride(int dim) {  // 1088, 544
  return k_lds_padded_offset(kKLdsChunkRows, 0, dim);
}
// Staging slot s + 1 of a 128-thread workgroup: 128 pieces = 128 / (dim/16) rows further
// (dim 128: 16 rows, 2240 B; dim 64 has one slot).
SAGE_HD constexpr int k_lds_stage_slot_stride(int dim) {
  return k_lds_padded_offset(128 / (dim / 16), 0, dim);
}

// V tile: dim channels x 32 key bytes (the transposed prepared layout), two 16-byte halves
// per row; the half index is flipped for channels with bit 3 set, so that 16 lanes reading
// channels r = 0..15 (same half) cover all 16 slots of a pass instead of 8 slots twice.
constexpr int kVRowBytes = 32;
SAGE_HD constexpr int v_lds_offset(int channel, int half16) {
  return channel * kVRowBytes + 16 * (half16 ^ ((channel >> 3) & 1));
}

// V tile of the FP16 P·V variant (pv_dtype FP16): dim channels x 32 keys x 2 bytes, a row of
// 4 16-byte slots; slot s holds keys 8s .. 8s + 7, i.e. the A operand of key chunk kc for lane
// half h is slot 2h + kc (tile keys 16h + 8kc + j = tile_key(kc, 8h + j): the keys of the P
// elements it meets). Rows are padded by one slot every 4 rows, so that 16 lanes reading
// channels r = 0..15 of one slot hit 16 distinct slots of a 256-byte pass ((4r + r/4 + s) mod
// 16 covers 0..15) and the staging stores (16 lanes = 4 channels x 4 slots) do too; like the
// K tile's pad, the slot and the 16-channel block only add immediates to a lane's address.
constexpr int kV16Slots = 4;                  // 16-byte slots per channel row
constexpr int kV16RowBytes = 16 * kV16Slots;  // 64: 32 keys x 2 bytes
constexpr int kV16PadRows = 4;                // one pad slot per this many rows
SAGE_HD constexpr int v16_lds_offset(int channel, int slot) {
  return channel * kV16RowBytes + 16 * (channel / kV16PadRows) + 16 * slot;
}
SAGE_HD constexpr int v16_lds_bytes(int dim) { return v16_lds_offset(dim, 0); }  // 8704 / 4352
// Staging: a 64-byte row is 4 pieces; piece p -> channel p / 4, slot p % 4.
SAGE_HD constexpr int v16_piece_channel(int piece) { return piece / kV16Slots; }
SAGE_HD constexpr int v16_piece_slot(int piece) { return piece % kV16Slots; }

// Staging: which 16-byte piece of the K / V tile thread `tid` of a `threads`-thread workgroup
// moves in its load slot `slot` (consecutive threads take consecutive 16-byte pieces, so a
// wave's global loads are contiguous).
SAGE_HD constexpr int stage_piece(int tid, int slot, int threads) { return tid + slot * threads; }
// K tile of head dim `dim`: dim/16 pieces per key row.
SAGE_HD constexpr int k_piece_row(int piece, int dim) { return piece / (dim / 16); }    // key
SAGE_HD constexpr int k_piece_chunk(int piece, int dim) { return piece % (dim / 16); }  // chunk
SAGE_HD constexpr int v_piece_channel(int piece) { return piece >> 1; }
SAGE_HD constexpr int v_piece_half(int piece) { return piece & 1; }  // keys 16*half..+15
// Mask of the bytes of 32-bit word `word` (bytes 4*word .. 4*word+3 of a 16-byte piece) that
// lie among the piece's first `n` bytes (n may be <= 0 or >= 16).
SAGE_HD constexpr uint32_t first_bytes_mask(int word, int n) {
  return n >= 4 * word + 4 ? 0xffffffffu : n <= 4 * word ? 0u : (1u << (8 * (n - 4 * word))) - 1u;
}

}  // namespace gfx12
}  // namespace sage
