// module_gfx1201_sage_attention for NVIDIA Hopper (sm_90a): the contract's quantized attention
// with wgmma. S = Q8 . K8^T with s8 x s8 -> s32 wgmma (both operands from shared memory), online
// softmax in the exp2 domain with the e4m3 scale folded into the exponent (ref.py EXP_OFFSET),
// P rounded to e4m3 in registers, O += P8 . V8 with e4m3 x e4m3 -> f32 wgmma (P from registers,
// V from shared memory), FP32 accumulation (O moved every 16 tiles into an FP32 home in shared
// memory: Traits::kOHomeTiles), O = acc / l * v_scale (saturated: sage::output_value).
// pv_dtype FP16 (ref.py "FP16 P.V"): the same steps with P rounded to FP16 (RNE) and FP16 V codes,
// O += P16 . V16 with f16 x f16 -> f32 wgmma m64nNk16: a template variant of its own (kPv16), so
// the FP8 kernels are unchanged.
//
// Two schedules (Traits::kSerial has the measurements behind the choice):
//   serial (FP8 P.V, the default there): one CTA = 64 query rows of one (batch, query head),
//                    one warpgroup, three CTAs per SM at Dp 128, four at Dp 64. Per KV tile:
//                    QK wgmma, softmax, PV wgmma in turn; thread 0 copies the next K tile by
//                    TMA once the QK retired and the next V tile once the PV did, into the
//                    CTA's one shared-memory stage.
//   overlapped (FP16 P.V, and the measurement knobs): one CTA = 128 query rows, three
//                    warpgroups (the FP8 kernel at Dp 64: 192 rows, four; Traits::kWgs):
//   warpgroup 0      producer: one thread issues TMA copies (cp.async.bulk.tensor, tensor maps
//                    encoded on the host at each launch and passed as __grid_constant__
//                    parameters) of the Q tile and of each 128-key K/V tile into a
//                    kStages-deep ring of shared-memory stages, completion signalled on
//                    mbarriers (arrive.expect_tx + complete_tx); the warpgroup gives most of
//                    its registers to the consumers (setmaxnreg).
//   warpgroups 1..   consumers, 64 query rows each. Per KV tile j the QK wgmma of tile j is in
//                    flight while the PV wgmma of tile j-1 runs, and the softmax of tile j
//                    overlaps the PV of tile j-1 (two wgmma groups in flight); P is packed to
//                    e4m3 only once that PV retired (no register of an in-flight wgmma is
//                    written: ptxas would serialize the wgmmas, warning C7513).
//                    With 192-key tiles (Traits::kDoubleP, AITER_SAGE_CUDA_SCHEDULE=overlap192)
//                    P is double-buffered and packed during the softmax (key_loop_double_p).
//
// Layouts in shared memory (all K-major, the only major-ness wgmma takes for 8-bit operands):
//   Q tile  [128 rows][Dp bytes], K tile [128 keys][Dp bytes], V tile [Dp channels][128 keys]
//   (V arrives transposed from prepare: [B, Hkv, Dp, S_pad]). Rows of Dp = 128 bytes use the
//   128-byte swizzle, rows of 64 bytes the 64-byte swizzle: 16-byte chunk c of row n is stored
//   at chunk c ^ ((n * row_bytes / 128) % (row_bytes / 16)). An FP16 V tile has 256-byte rows
//   (128 keys x 2 bytes), more than one 128-byte swizzle atom holds: it is stored as two
//   [Dp][64 keys] halves of 128-byte rows, keys 0-63 then 64-127.
//   These are the TMA's own 128-/64-byte swizzle modes (each tile starts on a 1024-byte atom).
//   Tensor maps (innermost dim first; each copy's box is one tile or half of one):
//     Q   3-D (Hq*Dp bytes, q_len_pad rows, B), box (Dp, 128, 1) at (hq*Dp, q0, b): rows past
//         q_len_pad are zero-filled (out of bounds).
//     K   FP8 kernels: 5-D (Hkv*Dp bytes; e: 4 rows, stride 1 row; t: 4, stride 4 rows;
//         G: kv_len_pad/16, stride 16 rows; B), box (Dp, 2, 4, 8, 1) at (hkv*Dp, 2i, 0,
//         key0/16, b) for i = 0, 1: copy i fills shared rows 64i + 8G + 2t + e with key
//         16G + 4t + 2i + e (the permutation below; two copies because one box would need
//         the 2-row stride after the 4-row one, which the tensor-map rules do not list).
//         FP16 P.V kernels: 3-D like Q (natural key order).
//     V   3-D (kv_len keys, Hkv*Dp rows of kv_len_pad keys, B), box (128 keys, Dp, 1) (FP8) or
//         (64 keys, Dp, 1) twice (FP16 codes, one copy per half; FP8 192-key tiles: three
//         times, 64-byte swizzle, Traits::kVSwizzleBytes): keys >= kv_len are
//         zero-filled by the TMA. They must be: padded keys get P = 0, but their V codes may be
//         anything (NaN codes included), and 0 * NaN is NaN in the MMA.
//         Keys in [kv_lens[b], kv_len) of a shorter entry are inside the map and are read:
//         their P is 0 and prepare wrote +0 codes there (SageParams::kv_lens), so prepared
//         tensors from gfx1201_sage_prepare never carry a NaN into them.
//   Keys >= kv_len_pad are zero-filled K rows; all of a tile's keys >= kv_len get S = -inf.
//   The TMA writes through the async proxy, which the wgmmas read: the mbarrier's completion
//   is all the ordering they need (no proxy fence).
//
// P from registers without shuffles: the wgmma accumulator of S gives thread (g = lane / 4,
// t = lane % 4) columns 8n + 2t + e of rows g, g + 8 of each 8-column chunk n, while the A
// register fragment of a k32 step wants k positions 4t + i and 16 + 4t + i. A dot product does
// not care about its order, so K rows are loaded permuted: shared K row 64j + 8G + 2t + e
// (S chunk n = 8j + G) holds key 16G + 4t + 2j + e. Then every S column of a thread scores a
// key that P's k position 16G + 4t + 2j + e of the same thread meets in V (natural order),
// and four accumulator values of a row pack straight into one A register. The softmax reads
// the accumulator of S chunk n = 8j + G into its chunk c = 2G + j (keys in order of their
// 16-key group G: the order of the row sums), so its keys are s_col_key's.
// FP16 P.V needs no permutation: the A fragment of an f16 k16 step wants k positions 2t + e and
// 8 + 2t + e of rows g, g + 8, which are exactly the S accumulator's columns 8j + 2t + e of the
// step's two 8-column chunks; K rows are loaded in natural order and S column c scores key c.
#include <cuda.h>  // CUtensorMap and its enums (types only: libcuda is not linked)
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "sage/check.h"
#include "sage/layout.h"
#include "sage/static_switch.h"
#include "sage/module_abi.h"
#include "sage/params.h"
#include "sage/platform.h"
#include "sage/quant.h"
#include "cuda/sm90_wgmma.h"

namespace sage {
namespace sm90 {

// Keys per KV tile (Traits::kBlockN): 128 for every kernel so far. The layout math below takes
// any multiple of 64 (two permuted TMA halves of K, see s_chunk) for wider tiles.
constexpr int kDefaultBlockN = 128;
constexpr int kWgRows = 64;  // query rows per consumer warpgroup
constexpr int kWgThreads = 128;
// setmaxnreg: the producer warpgroup (one thread issues the TMA copies) keeps few registers,
// the consumer warpgroups share the rest (Traits::kConsumerRegs).
constexpr int kProducerRegs = 24;
constexpr int kRegisterFile = 65536;
constexpr int kSwizzleBytes = 128;  // row bytes of the widest swizzle (one swizzle atom's row)

// Consumer warpgroups per CTA: 2 (128 query rows), or 3 (192 rows) for the FP8 kernel at Dp
// 64, where a tile's wgmmas are half as long and the softmax, the same length, needs more warps
// per scheduler to hide its latency; three fit its registers (160 each), not the FP16 P.V
// kernel's (twice the P fragments: it spilled). Ping-pong takes turns between exactly two.
template <int kDp, bool kPingPong, bool kPv16>
constexpr int default_consumer_wgs() {
  return kDp == 64 && !kPingPong && !kPv16 ? 3 : 2;
}

// O's FP32 home (FP8 P.V, two consumer warpgroups): every kOHomeTiles key tiles each consumer
// thread adds its O accumulators into a copy of O in shared memory, and the next P.V restarts
// them. Hopper's e4m3 wgmma adds into its accumulator at reduced precision (fewer mantissa bits
// than FP32), so one accumulator over a whole long key loop drifts from the exact sum (H200,
// randn, kernel vs exact arithmetic on the same prepared tensors: 0.0022 / 0.0038 / 0.0053 at
// S 4k / 16k / 32k; with the home 0.0018-0.0019 for 4, 8 or 16 tiles alike; README, NVIDIA
// section). Shared memory rather than a second register accumulator per tile (SageAttention2's
// way): at D = 128 those 64 registers made ptxas spill and cost 10 %. The three-warpgroup
// D = 64 kernel has no home (at 128 registers it measured slower with one, and its rel L2 is
// 0.0390 without); FP16 P.V accumulates in FP32 already (and has no shared memory to spare).
constexpr int kOHomeTiles = 16;

template <int kDp, int kStages_, bool kPingPong_ = false, bool kPv16_ = false,
          int kWgs_ = default_consumer_wgs<kDp, kPingPong_, kPv16_>(),
          int kOHomeTiles_ = kPv16_ || kWgs_ != 2 ? 0 : kOHomeTiles, bool kSerial_ = false,
          int kBlockN_ = kDefaultBlockN>
struct Traits {
  static constexpr int kDim = kDp;
  static constexpr int kStages = kStages_;
  static constexpr int kWgs = kWgs_;               // consumer warpgroups
  static constexpr int kBlockM = kWgRows * kWgs;   // query rows per CTA
  static constexpr int kBlockN = kBlockN_;         // keys per KV tile
  static constexpr int kTileScores = kBlockN / 2;  // S values per consumer thread (64 rows / 128)
  static constexpr int kScaleBlocks = kBlockN / SAGE_SCALE_BLOCK;  // K scale blocks per tile
  // The key loop's schedule (consume). Overlapped (kSerial false): a producer warpgroup's
  // thread copies K/V into a ring of stages, and each of kWgs consumer warpgroups keeps the QK
  // wgmma of tile j in flight with the PV of tile j-1, the softmax of j beside that PV; that
  // holds S of j, P and O of j-1 at once (~240 registers per thread), one CTA per SM.
  // Serial (kSerial): each warpgroup runs QK, softmax and PV of a tile in turn, no producer
  // (the last of the CTA's warpgroups done with a stage's K copies the next K into it, likewise
  // V), S/P and O alone live: 168 registers, so three warpgroups (twelve warps computing) share
  // an SM and fill each other's gaps: three CTAs of one (the default) at D 128, four at D 64.
  // With kWgs warpgroups in one CTA (a ring of kStages) they share the K/V copies
  // (KernelTraitsOf has what that measured). H200, Nsight Compute at B1 H24 S8192 D128: the
  // overlapped kernel had 8 computing warps per SM, 0.55 eligible per scheduler and cycle and
  // 42 % of issue slots busy; SageAttention2's kernel, built this serial way, 0.96 and 52 % on
  // the same instruction count.
  static constexpr bool kSerial = kSerial_;
  static_assert(!kSerial || (!kPingPong_ && !kPv16_), "the serial schedule is FP8 P.V's alone");
  static constexpr int kProducerWgs = kSerial ? 0 : 1;
  static constexpr int kThreads = kWgThreads * (kWgs + kProducerWgs);
  // __launch_bounds__' minimum: serial warpgroups per SM, three of 168 registers at D 128, four
  // of 128 at D 64 (O is 32 registers), in CTAs of kWgs.
  // A wider key tile (kBlockN 256: S alone is 128 registers) leaves one CTA per SM.
  static constexpr bool kWide = kBlockN > kDefaultBlockN;
  // P in two register buffers (the overlapped kernel with wider tiles, key_loop_double_p): the
  // softmax of tile j packs P(j) into the buffer P.V(j - 2) read, while P.V(j - 1) still reads
  // the other. So P is packed as the numerators come (kPackInSoftmax) even with a P.V in flight,
  // and no tile's numerators are all live at once: S 96 + P 2 x 24 + O 64 registers at 192 keys.
  static constexpr bool kDoubleP = !kSerial && kWide;
  static_assert(!kDoubleP || (!kPingPong_ && !kPv16_), "double-buffered P is FP8 P.V's alone");
  static constexpr int kCtasPerSm = kSerial && !kWide ? (kDp == 64 ? 4 : 3) / kWgs : 1;
  static_assert(!kSerial || kWide || kCtasPerSm * kWgs == (kDp == 64 ? 4 : 3), "");
  static constexpr int kConsumerWarps = 4 * kWgs;
  // The largest multiple of 8 that fits: 240 for two consumer warpgroups, 160 for three.
  static constexpr int kConsumerRegs = (kRegisterFile / kWgThreads - kProducerRegs) / kWgs / 8 * 8;
  static_assert(kSerial || (kConsumerRegs <= 256 && kWgs >= 2), "setmaxnreg takes 24 .. 256");
  static_assert(!kPingPong_ || kWgs == 2, "ping-pong alternates two consumer warpgroups");
  // The two consumer warpgroups take turns issuing their wgmmas (named barriers 1 and 2), so
  // one warpgroup's softmax runs while the other's GEMMs occupy the tensor cores.
  static constexpr bool kPingPong = kPingPong_;
  // P.V operands: FP16 (pv_dtype FP16: P rounded to FP16, V16 codes) or e4m3.
  static constexpr bool kPv16 = kPv16_;
  static constexpr int kVElemBytes = kPv16 ? 2 : 1;
  static constexpr int kPvK = kPv16 ? 16 : 32;  // keys per P.V wgmma (its k: 32 bytes of A)
  static constexpr int kPvSteps = kBlockN / kPvK;
  // Bytes of one channel's keys in a V tile, and the swizzled parts they are stored in: rows of
  // 128 bytes (the widest swizzle), or of 64 where a row is no whole number of 128 bytes (192
  // e4m3 keys: three parts of 64 keys).
  static constexpr int kVRowBytes = kBlockN * kVElemBytes;
  static constexpr int kVSwizzleBytes = kVRowBytes % kSwizzleBytes == 0 ? kSwizzleBytes : 64;
  static constexpr int kVParts = kVRowBytes / kVSwizzleBytes;
  static constexpr int kVPartBytes = kDp * kVSwizzleBytes;
  static constexpr int kQBytes = kBlockM * kDp;
  static constexpr int kKBytes = kBlockN * kDp;
  static constexpr int kVBytes = kVParts * kVPartBytes;  // = kDp * kVRowBytes
  static constexpr int kStageBytes = kKBytes + kVBytes;
  // O's FP32 home after the stages (0: none): one float per O accumulator of each consumer
  // thread, then the two running maxima (of its two rows) it was last merged at.
  static constexpr int kOHomeTiles = kOHomeTiles_;
  static constexpr int kOHomeOffset = kQBytes + kStages * kStageBytes;
  static constexpr int kOHomeMaxOffset = kOHomeOffset + kBlockM * kDp * 4;
  static constexpr int kOHomeBytes = kOHomeTiles ? kBlockM * kDp * 4 + kWgs * kWgThreads * 8 : 0;
  // Load a tile's K scales one loop step ahead (load_k_scales) rather than after the QK wait:
  // two consumer warpgroups only (H200, D = 128, loading them at the top of their own step:
  // 731 -> 769 TFLOPS at S 16k; the three-warpgroup D = 64 kernel, at 128 registers per thread,
  // measured 540 -> 514). A step ahead, their global load has a whole tile to land (Nsight
  // Compute put 0.89 long-scoreboard stalls per issued instruction on the load at the top).
  static constexpr bool kEarlyKScales = kWgs == 2;
  // The folded exponent argument (kFoldMaxScale): the serial kernel only (no measurable change
  // on the overlapped D = 128 one; the three-warpgroup D = 64 one spilled its addends).
  static constexpr bool kFoldScoreBias = kSerial || kDoubleP;
  // softmax_tile packs P into the PV wgmma's A registers a k step at a time, as the numerators
  // come (pack_p_step): the serial kernel only, where no PV wgmma is in flight during the
  // softmax. Packed after the softmax, ptxas built the 16 A registers of a tile with 32 F2FP and
  // 16 PRMT (64 numerators live at once); packed as they come, 32 F2FP and no PRMT (H100, B1 H24
  // sage_core, alternating with the previous build in one call: S 32k 835 -> 847 TFLOPS, D 64
  // S 16k 571 -> 575).
  static constexpr bool kPackInSoftmax = kSerial || kDoubleP;
  // softmax_tile scales O by alpha (rescale_o) as soon as alpha is known, before the
  // numerators, so that the vote, its branch and the FMULs overlap the exponentials rather than
  // follow them: the serial kernel only, where no PV wgmma (O's writer) is in flight during the
  // softmax. H100 B1 H24 sage_core, five builds alternating in one call: D 64 S 16k 577 -> 588
  // and 576 -> 587 TFLOPS, D 128 level (837 -> 840 and 834 -> 835 at 16k, 857 -> 854 and
  // 851 -> 852 at 32k).
  static constexpr bool kRescaleInSoftmax = kSerial;
  // Barriers after the tiles: fullQ, fullK[s], fullV[s], empty[s]; then the serial kernels'
  // release counters (Smem::released), one 8-byte slot each for stage s's K and V.
  static constexpr int kBarOffset = kOHomeOffset + kOHomeBytes;
  // + empty_k[s] (kDoubleP) and the alignment
  static constexpr int kSmemBytes = kBarOffset + 8 * (1 + (kDoubleP ? 6 : 5) * kStages) + 1024;
  static_assert(kDp == 64 || kDp == 128, "");
  static_assert(kBlockN % 64 == 0 && kBlockN <= 256, "two permuted K halves; wgmma n <= 256");
  static_assert(kVRowBytes % kVSwizzleBytes == 0, "V tile rows are whole swizzle rows");
  // Each swizzled part starts on a 1024-byte swizzle atom (the stage and the Q tile are
  // multiples of it too).
  static_assert(kVPartBytes % 1024 == 0 && kStageBytes % 1024 == 0 && kQBytes % 1024 == 0, "");
  static_assert(kSmemBytes <= 227 * 1024, "an sm_90 CTA has at most 227 KiB of shared memory");
  // An SM has 228 KiB of shared memory, 1 KiB of each CTA's reserved by the system.
  static_assert(kCtasPerSm * (kSmemBytes + 1024) <= 228 * 1024, "kCtasPerSm CTAs must fit");
};

// The kernel a call runs (sage_attention_run). FP8 P.V runs the serial schedule, one warpgroup
// (64 query rows) per CTA: three CTAs per SM at D = 128, four at D = 64 (H200, B1 H24 S16384
// D64, sage_core 530 -> 567 TFLOPS against the overlapped three-consumer-warpgroup kernel,
// SageAttention2's call 555 in the same run). FP16 P.V runs the overlapped one. The
// measurement knobs (AITER_SAGE_CUDA_SCHEDULE) select the others.
enum Schedule : int {
  kScheduleDefault,
  kScheduleOverlap,     // the overlapped FP8 kernels
  kSchedulePingPong,    // the overlapped FP8 kernels, warpgroups taking turns
  kScheduleShared192,   // D = 128: the serial FP8 kernel with three warpgroups (192 rows) per CTA
  kScheduleWide256,     // D = 128: two serial warpgroups (128 rows) per CTA, 256-key tiles
  kScheduleOverlap192,  // the overlapped FP8 kernels on 192-key tiles, P double-buffered
  kSchedules
};
// AITER_SAGE_CUDA_SCHEDULE's value of each Schedule, in its order.
constexpr const char* kScheduleNames[kSchedules] = {"default",   "overlap", "pingpong",
                                                    "shared192", "wide256", "overlap192"};
template <int kDp, bool kPv16, int kSchedule>
struct KernelTraitsOf {
  using type = Traits<kDp, 4, kSchedule == kSchedulePingPong && !kPv16, kPv16>;
};
template <int kDp>
struct KernelTraitsOf<kDp, false, kScheduleDefault> {
  using type = Traits<kDp, 1, false, false, 1, kOHomeTiles, true>;
};
// Three warpgroups share each K/V copy on a two-stage ring (Traits::kSerial). H100, sage_core
// in one call beside the default: level at S 8k-32k (800 vs 807 at 16k, 825-829 both at 32k),
// 2 % behind at S 4096 and 10 % at Flux's S 4608 (626 vs 690: one CTA per SM leaves the last
// wave's SMs idle where three 64-row CTAs refill them one by one). D = 64 keeps one warpgroup
// per CTA (the default kernel). With its warpgroups taking turns at the wgmma issues (round
// robin on named barriers, to stagger their softmaxes) it measured 10 % slower (740 vs 819 at
// S 16k, H100), and that schedule was removed.
template <int kDp>
struct KernelTraitsOf<kDp, false, kScheduleShared192> {
  static constexpr int kWgs = kDp == 128 ? 3 : 1;
  using type = Traits<kDp, kWgs == 1 ? 1 : 2, false, false, kWgs, kOHomeTiles, true>;
};
// 256-key tiles move O home every 8 tiles: the 2048 keys per accumulator run that the drift
// figures above were measured at.
constexpr int kWideOHomeTiles = kOHomeTiles / 2;
// Two serial warpgroups of 64 rows sharing each 256-key K/V copy on a two-stage ring, one CTA per
// SM (up to 255 registers a thread: S is 128 of them). FlashAttention-3's FP8 kernel runs 7-9 %
// faster with its 224-key tiles than with 128 (docs/perf/2026-12-06-cuda-fa3-fp8.md): the
// softmax's per-tile work (maxima, shuffles, alpha, the wgmma issues and waits) spread over
// twice the keys. D = 64 keeps the default kernel. Measured slower (H100 sage_core, alternating
// with the default in one call, TFLOPS: S 4608 631 vs 724, 16k 801 vs 846, 32k 848 vs 865,
// causal 16k 747 vs 771): 13 % fewer instructions, but eight computing warps per SM kept 42 % of
// the issue slots busy against the default's twelve at 52 % (Nsight Compute, S 8192, the same
// tiles in CTAs of one warpgroup). And a row's maximum over 256 keys at a time moves P off the
// contract's rounding grid (the first 128 keys of a tile round against a maximum that rose in
// the second): 0.0053 rel L2 from the exact arithmetic on the long key loop of test_cuda.py,
// whose bound is 0.0028, and 0.0052 with O moved home every 2 tiles (so not accumulation).
template <int kDp>
struct KernelTraitsOf<kDp, false, kScheduleWide256> {
  using type =
      std::conditional_t<kDp == 128, Traits<kDp, 2, false, false, 2, kWideOHomeTiles, true, 256>,
                         typename KernelTraitsOf<kDp, false, kScheduleDefault>::type>;
};
// 192-key tiles move O home every 10 tiles (1920 keys per accumulator run, as near the 2048
// of the 128-key kernels as whole tiles come).
constexpr int kOverlap192OHomeTiles = 10;
// The overlapped schedule (a producer warpgroup's TMA copies, Q.K^T of tile j in flight beside
// P.V of tile j - 1) on 192-key tiles with P double-buffered (Traits::kDoubleP), two consumer
// warpgroups of 64 rows: FlashAttention-3's FP8 structure (its tile is 224 keys), which runs
// 1.11-1.26x our default kernel (docs/perf/2026-12-06-cuda-fa3-fp8.md). A row's running
// maximum is taken per 192-key tile: the rounding grid of P is the kernel's tile (ref.py: "the
// kernels follow the same steps, their tile sizes may differ"), so its exact-arithmetic
// reference is accuracy_floor's at kv_tile 192. Two stages at D 128 (48 KiB each beside O's
// 64 KiB home), four at D 64. H100, B1 H24 sage_core beside the default in one call (TFLOPS):
// S 32k 854 vs 851, 16k 802 vs 837, Flux's 4608 659 vs 714, causal 16k 749 vs 779, D 64 446 vs
// 588. Its steady state per key is ~7 % faster than the default's, but each CTA (one per SM)
// pays ~10 us of fill and epilogue alone that three CTAs per SM hide behind each other.
// Measured slower on top of it: the warpgroups taking turns at the wgmma issues (named
// barriers, FlashAttention-3's scheduler barrier: 760 / 812 at S 16k / 32k), V copied a tile
// behind K (level), and the kernel persistent (one CTA per SM over the items, the producer
// copying the next item's Q and K/V during the epilogue: 742 / 793 at S 16k / 32k, and 741 /
// 790 with its spills gone and the items handed out dynamically; two patches in docs/perf):
// what a CTA pays alone is its consumers' own work at its ends, not the copies' latency.
template <int kDp>
struct KernelTraitsOf<kDp, false, kScheduleOverlap192> {
  using type = Traits<kDp, kDp == 128 ? 2 : 4, false, false, 2, kOverlap192OHomeTiles, false, 192>;
};
template <int kDp, bool kPv16, int kSchedule>
using KernelTraits = typename KernelTraitsOf<kDp, kPv16, kSchedule>::type;

// ------------------------------------------------------------------ PTX helpers ------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// One arrival that also announces `bytes` more of transaction (the TMA copies' complete_tx).
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void tma_prefetch(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// TMA tile copies global -> shared (this CTA), completing `bar`'s transaction bytes.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}
// Named barriers 1 + wg: "warpgroup wg may issue its wgmmas". 256 threads: the 128 of the
// waiting warpgroup (bar.sync) and the 128 of the other one (bar.arrive).
__device__ __forceinline__ void named_sync(int id) {
  asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory");
}
__device__ __forceinline__ void named_arrive(int id) {
  asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory");
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of a wgmma operand register across a fence.
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void reg_fence(int (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void reg_fence(uint64_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+l"(r[i])::"memory");
}
template <int M, int N>
__device__ __forceinline__ void reg_fence(uint32_t (&r)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}
template <int kRegs>
__device__ __forceinline__ void set_max_regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void set_max_regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
// blockIdx.y read anew at each call (volatile: not merged with an earlier read).
__device__ __forceinline__ int ctaid_y() {
  int y;
  asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(y));
  return y;
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// Four floats -> four e4m3 bytes (a in the low byte), round to nearest even, saturating at 448.
// Both halves in one asm, so ptxas can write the high half into the low half's register
// (F2FP ... MERGE_C) instead of joining two 16-bit results with a PRMT.
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
  uint32_t r;
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}"
      : "=r"(r)
      : "f"(a), "f"(b), "f"(c), "f"(d));
  return r;
}

// wgmma shared-memory descriptor of a K-major tile with `row_bytes` (64 or 128) swizzled rows,
// in two words: the high one (8-row group stride, swizzle mode) is fixed per row size, the low
// one holds the address (bits 4..17) and the unused leading offset 1. Shared addresses stay
// below 2^18, so a byte offset `off` (a multiple of 16) moves the low word by off / 16 without
// a carry: the descriptors of a tile's k-steps and of the ring's stages are one base each plus
// constants, added in the key loop instead of rebuilt from addresses (H200: the loop's head
// held ~120 instructions of descriptor arithmetic per tile).
__host__ __device__ constexpr uint32_t desc_hi(int row_bytes) {
  return uint32_t((8 * row_bytes) >> 4) | (uint32_t(row_bytes == 128 ? 1 : 2) << 30);
}
__device__ __forceinline__ uint32_t desc_lo(uint32_t addr) {
  return ((addr & 0x3ffff) >> 4) | (1u << 16);
}
__device__ __forceinline__ uint64_t make_desc(uint32_t lo, int row_bytes) {
  return (uint64_t(desc_hi(row_bytes)) << 32) | lo;
}
__host__ __device__ constexpr uint32_t desc_step(int bytes) { return uint32_t(bytes) >> 4; }
// The S accumulator chunk (8 columns) that holds the keys of softmax chunk c (0..kN/8 - 1, keys
// s_col_key(c, ...)) of a kN-key tile: with the FP8 kernels' permuted K rows chunk kN/16 * j + G
// for c = 2G + j (TMA copy j of the tile fills shared K rows kN/2 * j .. kN/2 * (j + 1) - 1),
// natural order otherwise.
template <bool kPermutedK, int kN>
__host__ __device__ constexpr int s_chunk(int c) {
  return kPermutedK ? kN / 16 * (c & 1) + (c >> 1) : c;
}
// Tile key of softmax chunk c, element e, for thread t: with the FP8 kernels' permuted
// K rows, or (kPermutedK false, the FP16 P.V kernels) natural ones. Chunk c is P's: its four
// values of a row pack into the A fragments in this order (pack_p).
template <bool kPermutedK = true>
__host__ __device__ constexpr int s_col_key(int c, int t, int e) {
  return kPermutedK ? 16 * (c >> 1) + 4 * t + 2 * (c & 1) + e : 8 * c + 2 * t + e;
}
// Shared K row of (S accumulator) chunk n, thread t, element e holds tile key s_col_key of the
// softmax chunk that reads it: checked at compile time. FP8 kernels, tile row 0..kN - 1 (the
// TMA copy of K, load_k / encode_maps, puts key 16G + 4t + 2j + e at row kN/2 * j + 8G + 2t + e).
template <int kN>
__host__ __device__ constexpr int k_row_key(int row) {
  return 16 * ((row % (kN / 2)) >> 3) + 4 * ((row >> 1) & 3) + 2 * (row / (kN / 2)) + (row & 1);
}
template <int kN>
__host__ __device__ constexpr bool k_permutation_ok() {
  for (int c = 0; c < kN / 8; ++c)
    for (int t = 0; t < 4; ++t)
      for (int e = 0; e < 2; ++e)
        if (k_row_key<kN>(8 * s_chunk<true, kN>(c) + 2 * t + e) != s_col_key(c, t, e)) return false;
  return true;
}
static_assert(k_permutation_ok<128>() && k_permutation_ok<192>() && k_permutation_ok<256>(),
              "K rows, S chunks and P fragments disagree");

template <class T>
struct Smem {
  uint8_t* base;
  __device__ uint8_t* q() const { return base; }
  __device__ uint8_t* k(int s) const { return base + T::kQBytes + s * T::kStageBytes; }
  __device__ uint8_t* v(int s) const { return k(s) + T::kKBytes; }
  // O's home of the calling consumer thread: thread `tid` of consumer warpgroup `wg` owns
  // floats 4 * (q * kWgThreads + tid) + 0..3 of its warpgroup's part (q < kOAcc / 4): a warp's
  // float4s are contiguous, conflict-free. Found from threadIdx at each use (a pointer kept
  // live across the key loop made the D = 64 kernel spill).
  __device__ float4* o_home() const {
    const int wg = int(threadIdx.x) / kWgThreads - T::kProducerWgs;
    const int tid = int(threadIdx.x) % kWgThreads;
    return reinterpret_cast<float4*>(base + T::kOHomeOffset) + wg * (kWgRows * T::kDim / 4) + tid;
  }
  __device__ float2* o_home_max() const {
    return reinterpret_cast<float2*>(base + T::kOHomeMaxOffset) + int(threadIdx.x) -
           T::kProducerWgs * kWgThreads;
  }
  __device__ uint32_t bar(int i) const { return smem_u32(base + T::kBarOffset + 8 * i); }
  __device__ uint32_t full_q() const { return bar(0); }
  __device__ uint32_t full_k(int s) const { return bar(1 + s); }
  __device__ uint32_t full_v(int s) const { return bar(1 + T::kStages + s); }
  __device__ uint32_t empty(int s) const { return bar(1 + 2 * T::kStages + s); }
  // Traits::kDoubleP: stage s's K slot free (its Q.K^T retired); empty(s) then frees its V.
  __device__ uint32_t empty_k(int s) const { return bar(1 + 5 * T::kStages + s); }
  __device__ int* released(int s, int kv) const {  // warpgroups done with stage s's K / V
    return reinterpret_cast<int*>(base + T::kBarOffset + 8 * (1 + 3 * T::kStages + 2 * s + kv));
  }
};

struct Work {
  int b, hq, hkv, q0, n_tiles;
  int q_len, kv_len;  // the entry's real rows and keys (SageParams::q_lens / kv_lens)
};

template <class T>
__device__ __forceinline__ Work work_of(const SageParams& p) {
  Work w;
  const int q_tiles = int(gridDim.x);
  w.q0 = (q_tiles - 1 - int(blockIdx.x)) * T::kBlockM;  // longest causal rows first
  w.hq = int(blockIdx.y);
  w.b = int(blockIdx.z);
  w.hkv = kv_head_of(p, w.hq);
  w.q_len = entry_q_len(p, w.b);
  w.kv_len = entry_kv_len(p, w.b);
  // Rows past the entry's q_len see nothing; a block of such rows only, or an entry without
  // keys, still runs one tile, all of it masked (P = 0, l = 0: rows past q_len are written as
  // zeros, real rows of an entry without keys come out NaN with LSE -inf, SDPA's all-masked
  // row), so producer and consumers keep one schedule.
  const int rows = w.q_len - w.q0 < T::kBlockM ? w.q_len - w.q0 : T::kBlockM;
  const int64_t keys = rows > 0 ? keys_for_rows(p, w.q0, rows, w.kv_len) : 0;
  w.n_tiles = max(int((keys + T::kBlockN - 1) / T::kBlockN), 1);
  return w;
}

// ------------------------------------------------------------------ producer -------
// The tensor maps of one launch (see the file comment); a kernel parameter.
struct Maps {
  CUtensorMap q, k, v;
};

template <class T>
__device__ __forceinline__ void load_q(const Maps& m, const Work& w, const Smem<T>& sm) {
  tma_prefetch(&m.q);
  tma_prefetch(&m.k);
  tma_prefetch(&m.v);
  mbar_expect_tx(sm.full_q(), T::kQBytes);
  tma_load_3d(smem_u32(sm.q()), &m.q, sm.full_q(), w.hq * T::kDim, w.q0, w.b);
}
// The copies of key tile j's K (and V) into its stage. Boxes past the tensor bounds are
// zero-filled and still count their whole size in transaction bytes.
template <class T>
__device__ __forceinline__ void load_k(const Maps& m, const Work& w, const Smem<T>& sm, int j) {
  const int s = j % T::kStages, key0 = j * T::kBlockN;
  mbar_expect_tx(sm.full_k(s), T::kKBytes);
  if constexpr (T::kPv16) {
    tma_load_3d(smem_u32(sm.k(s)), &m.k, sm.full_k(s), w.hkv * T::kDim, key0, w.b);
  } else {
    // FP8 P.V: copy i gets keys 16G + 4t + 2i + e into shared rows kBlockN/2 * i + 8G + 2t + e.
#pragma unroll
    for (int i = 0; i < 2; ++i)
      tma_load_5d(smem_u32(sm.k(s) + i * (T::kBlockN / 2) * T::kDim), &m.k, sm.full_k(s),
                  w.hkv * T::kDim, 2 * i, 0, key0 / 16, w.b);
  }
}
template <class T>
__device__ __forceinline__ void load_v(const Maps& m, const Work& w, const Smem<T>& sm, int j) {
  const int s = j % T::kStages, key0 = j * T::kBlockN;
  mbar_expect_tx(sm.full_v(s), T::kVBytes);
#pragma unroll
  for (int part = 0; part < T::kVParts; ++part)
    tma_load_3d(smem_u32(sm.v(s) + part * T::kVPartBytes), &m.v, sm.full_v(s),
                key0 + part * (T::kBlockN / T::kVParts), w.hkv * T::kDim, w.b);
}

// The producer warpgroup's one thread (overlapped schedule): the Q tile, then each K/V tile
// once its stage is free.
template <class T>
__device__ void produce(const Maps& m, const Work& w, const Smem<T>& sm) {
  load_q(m, w, sm);
  for (int j = 0; j < w.n_tiles; ++j) {
    const int s = j % T::kStages;
    const int phase = ((j / T::kStages) - 1) & 1;
    // kDoubleP: K and V freed apart (empty_k once the stage's Q.K^T retired, empty once its
    // P.V did), so the next K lands while the previous tile's P.V runs. With one barrier for
    // both and two stages, each step waited for its K copy (H100, B1 H24 S 8192, Nsight
    // Compute: 1.69 -> 0.74 long-scoreboard stalls per issued instruction, issue slots busy
    // 34.6 -> 44.6 %; sage_core 637 -> 804 TFLOPS at S 16k, 638 -> 850 at 32k).
    if (j >= T::kStages) mbar_wait(T::kDoubleP ? sm.empty_k(s) : sm.empty(s), phase);
    load_k(m, w, sm, j);
    if (T::kDoubleP && j >= T::kStages) mbar_wait(sm.empty(s), phase);
    load_v(m, w, sm, j);
  }
}

// ------------------------------------------------------------------ consumers ------
template <class T>
struct Consumer {
  static constexpr int kDim = T::kDim;
  static constexpr int kOAcc = kDim / 2;  // f32 accumulators of O per thread
  int g, t, warp;                         // lane / 4, lane % 4, warp within the warpgroup
  int row0;                               // query row of this thread's first row (g)
  float qs;                               // Q scale of the thread's rows (row0, row0 + 8)
  float m[2], l[2];                       // running max (log2 units), partial row sums
  float o[kOAcc];
  uint32_t pa[T::kPvSteps][4];  // P (e4m3 or FP16) as A fragments, one per P.V k step
};

// An integer score as FP32, exactly, without I2F: the float with bits 0x4B400000 + s is
// 1.5 * 2^23 + s for |s| < 2^22, so subtracting 1.5 * 2^23 leaves s. I2F issues at the quarter
// rate of the unit that also runs ex2 (MUFU); an integer add and an FADD run at full rate
// (H200, B1 H24 D128: 728 -> 750 TFLOPS at S 16k, 777 -> 792 at 32k; same bits).
constexpr int kMaxAbsScore = 128 * 128 * SAGE_MAX_HEAD_DIM;  // |q8 . k8| over Dp channels
static_assert(kMaxAbsScore < (1 << 22), "scores must stay below 2^22 for score_f32");
constexpr int kScoreBiasBits = 0x4B400000;  // the float 1.5 * 2^23
constexpr float kScoreBias = 12582912.0f;
__device__ __forceinline__ float score_biased(int s) { return __int_as_float(s + kScoreBiasBits); }
__device__ __forceinline__ float score_f32(int s) { return score_biased(s) - kScoreBias; }

// Traits::kFoldScoreBias: the exponent's argument s * sc + neg in one FFMA of the biased score,
// (1.5 * 2^23 + s) * sc + (neg - 1.5 * 2^23 * sc), the bias's product folded into a
// per-(block, row) addend (8 FFMAs a tile instead of an FADD per score: H200, the serial D =
// 128 kernel, sage_core 786 -> 889 TFLOPS at S 16k, 807 -> 861 at 32k, in two runs). The addend
// is rounded once: an absolute error up to 2^-24 * 1.5 * 2^23 * sc = 0.75 sc in the log2
// domain, shared by a block's 32 keys. Only unmasked tiles whose every scale is below
// kFoldMaxScale fold (a warp-uniform choice): there P moves by a factor within 2^(+-0.00073), far
// inside its e4m3 rounding (randn inputs have sc ~ 2e-4; Q and K block maxima up to ~11 stay
// below). Larger scales (outlier channels, 1e4-sized activations, NaN) take the exact two-step
// path; without that guard the row maximum's numerator could land anywhere near 2^(+-0.75 sc) and
// overflow.
constexpr float kFoldMaxScale = 1.0f / 1024;

// The factor that takes a sum kept at running max m_from (log2 units) to running max m_to:
// exp2(m_from - m_to), and 0 for an empty sum (m_from = -inf; m_to = -inf too while a row has
// seen only masked keys).
__device__ __forceinline__ float rescale_factor(float m_from, float m_to) {
  return ex2(m_from - (m_to == -INFINITY ? 0.0f : m_to));
}

// The K scales of the tile at key0 (its four 32-key blocks; 0 past kv_len_pad). Traits::
// kEarlyKScales loads them one loop step ahead: the softmax needs them right after the QK wait,
// and a load issued after it exposes its whole latency (the wgmma fences and waits are compiler
// barriers: no hoisting).
template <class T>
__device__ __forceinline__ void load_k_scales(const SageParams& p, int key0,
                                              float (&ks)[T::kScaleBlocks]) {
#pragma unroll
  for (int blk = 0; blk < T::kScaleBlocks; ++blk) {
    const int kb = key0 / SAGE_SCALE_BLOCK + blk;
    ks[blk] = kb < p.kv_len_pad / SAGE_SCALE_BLOCK ? p.k_scale[kb] : 0.0f;
  }
}

// P (f32, the softmax numerators) -> e4m3 (or FP16) A fragments of the PV wgmma, one k step
// (kb) at a time: its A registers hold numerators [kb * kPStepValues, (kb + 1) * kPStepValues).
// Runs only once no PV wgmma is in flight: the A registers of an in-flight wgmma must not be
// written (ptxas does not extend their live range to the wait, so a write there would serialize
// the wgmmas, C7513).
template <class T>
constexpr int kPStepValues = T::kTileScores / T::kPvSteps;
template <class T>
__device__ __forceinline__ void pack_p_step(const float (&f)[T::kTileScores],
                                            uint32_t (&pa)[T::kPvSteps][4], int kb) {
  if constexpr (T::kPv16) {
    // A register r of k16 step kb: row half r & 1, chunk 2kb + (r >> 1), elements e = 0, 1
    // (low half first): accumulators 8kb + 2r + e. RNE, as ref.py's pr.half(); P' <= 448.
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const __half2 h = __floats2half2_rn(f[8 * kb + 2 * r], f[8 * kb + 2 * r + 1]);
      pa[kb][r] = *reinterpret_cast<const uint32_t*>(&h);
    }
  } else {
    // Accumulator index of (chunk ch, row half h, element e) is 4ch + 2h + e; A register r of
    // k32 step kb: row half r & 1, chunks 4kb + 2(r >> 1) + {0, 1}.
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int h = r & 1, ch = 4 * kb + 2 * (r >> 1);
      pa[kb][r] = e4m3x4(f[4 * ch + 2 * h], f[4 * ch + 2 * h + 1], f[4 * (ch + 1) + 2 * h],
                         f[4 * (ch + 1) + 2 * h + 1]);
    }
  }
}
template <class T>
__device__ __forceinline__ void pack_p(const float (&f)[T::kTileScores],
                                       uint32_t (&pa)[T::kPvSteps][4]) {
#pragma unroll
  for (int kb = 0; kb < T::kPvSteps; ++kb) pack_p_step<T>(f, pa, kb);
}

// O *= alpha only where a row's running max moved (alpha = exp2(0) = 1 exactly otherwise, and
// x * 1 = x): a warp-uniform branch, taken on a minority of tiles once the max has settled
// (H200, B1 H24 D128: 718 -> 728 TFLOPS at S 16k, 757 -> 777 at 32k). Unconditional, as
// SageAttention2 does it, the serial kernel measured 2-3 % slower (H100 sage_core, on a build with
// the masked tiles in a loop of their own: S 16k 826 -> 808 and 812, 32k 847 -> 824 and 845 ->
// 823). No PV wgmma may be in flight (O is its accumulator).
template <class T>
__device__ __forceinline__ void rescale_o(Consumer<T>& c, const float (&alpha)[2]) {
  if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
    for (int i = 0; i < Consumer<T>::kOAcc; ++i) c.o[i] *= alpha[(i >> 1) & 1];
  }
}

// The largest of n floats as a pairwise tree (its depth, not n, is the latency).
template <int kN>
__device__ __forceinline__ float tree_max(const float* v) {
  if constexpr (kN == 1)
    return v[0];
  else
    return fmaxf(tree_max<kN / 2>(v), tree_max<kN - kN / 2>(v + kN / 2));
}

// Scores of one tile -> P fragments (into pa with Traits::kPackInSoftmax, else left in f);
// returns alpha for the two rows. `masked`: apply the key/causal masks (only tiles that reach
// past kv_len or the diagonal need it).
//
// Unmasked tiles (nearly all) take the row maximum on the integer scores of each 32-key
// scale block and scale only those 4 maxima: the scales are >= 0 (or NaN, which fmaxf drops
// either way) and round-to-nearest is monotonic, so max(RN(s * sc)) = RN(max(s) * sc), the same
// bits as scaling every score first. The exponent's argument is then one FFMA, s * sc + neg,
// with a single rounding where scale-then-add had two (H200, B1 H24 D128: 706 -> 720 TFLOPS
// at S 16k, 733 -> 755 at 32k, 596 -> 613 at 4k; rel L2 unchanged). Masked tiles take the same
// steps over their kept keys (`kept`). ks: the tile's K scales (load_k_scales).
template <class T, bool kMasked>
__device__ __forceinline__ void softmax_tile(const SageParams& p, Consumer<T>& c,
                                             int (&s)[T::kTileScores], int key0,
                                             const float (&ks)[T::kScaleBlocks], float (&alpha)[2],
                                             float (&f)[T::kTileScores],
                                             uint32_t (&pa)[T::kPvSteps][4]) {
  float sc[T::kScaleBlocks];
#pragma unroll
  for (int blk = 0; blk < T::kScaleBlocks; ++blk) sc[blk] = c.qs * ks[blk];
  // Score i = 4 * ch + 2 * h + e of the thread (row half h, chunk ch, element e).
  const auto score = [&](int i) { return s[4 * s_chunk<!T::kPv16, T::kBlockN>(i >> 2) + (i & 3)]; };
  // Masked tiles run the same steps with each score's key kept or not: a block's maximum over
  // its kept scores (INT_MIN: none kept; |s| < 2^22 never is INT_MIN), and 0 as the numerator of
  // a masked key (what exp2(-inf) gave). One code path keeps the masked tiles' registers those
  // of the unmasked ones (the serial kernel has no more to spare).
  const auto kept = [&](int i) {
    if constexpr (!kMasked) return true;
    const int key = key0 + s_col_key<!T::kPv16>(i >> 2, c.t, i & 1);
    const int row = c.row0 + 8 * ((i >> 1) & 1);
    return key < p.kv_len && !(p.mask == SAGE_MASK_CAUSAL && key > row);
  };
  float mx[2] = {-INFINITY, -INFINITY};
  {
    int block_max[T::kScaleBlocks][2];
#pragma unroll
    for (int blk = 0; blk < T::kScaleBlocks; ++blk) block_max[blk][0] = block_max[blk][1] = INT_MIN;
#pragma unroll
    for (int i = 0; i < T::kTileScores; ++i) {
      int& bm = block_max[i >> 4][(i >> 1) & 1];
      if (kept(i)) bm = max(bm, score(i));
    }
#pragma unroll
    for (int blk = 0; blk < T::kScaleBlocks; ++blk)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int bm = block_max[blk][h];
        if (!kMasked || bm != INT_MIN) mx[h] = fmaxf(mx[h], float(bm) * sc[blk]);
      }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
  }
  float neg[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float mn = fmaxf(c.m[h], mx[h]);
    alpha[h] = rescale_factor(c.m[h], mn);  // 0 on the first tile
    c.m[h] = mn;
    neg[h] = kExpOffset - (mn == -INFINITY ? 0.0f : mn);
  }
  if constexpr (T::kRescaleInSoftmax) rescale_o(c, alpha);
  // Each row half's sum in four partial chains (chunk ch goes to chain ch % 4): one chain of 32
  // dependent FADDs waited out the FADD latency at every step.
  float sum[2][4] = {};
  // Masked tiles (one or two per row block) always take the exact path: one variant fewer of
  // the 64 numerators in the key loop's code (2403 -> 2051 instructions with the packing above).
  const bool fold = !kMasked && T::kFoldScoreBias &&
                    __all_sync(0xffffffffu, tree_max<T::kScaleBlocks>(sc) < kFoldMaxScale);
  // The numerators and their row sums, from the exponent's argument arg(i) of score i.
  const auto numerators = [&](auto arg) {
#pragma unroll
    for (int i = 0; i < T::kTileScores; ++i) {
      const int h = (i >> 1) & 1;
      f[i] = ex2(arg(i, h));
      if (!kept(i)) f[i] = 0.0f;
      sum[h][(i >> 2) & 3] += f[i];
      // A k step's A registers as soon as its numerators are there (Traits::kPackInSoftmax)
      if constexpr (T::kPackInSoftmax)
        if ((i + 1) % kPStepValues<T> == 0) pack_p_step<T>(f, pa, i / kPStepValues<T>);
    }
  };
  if (fold) {
    float add[2];
    numerators([&](int i, int h) {
      if (i % 16 == 0)  // a block's two addends, formed at its first score
        for (int r = 0; r < 2; ++r) add[r] = fmaf(-kScoreBias, sc[i >> 4], neg[r]);
      return fmaf(score_biased(score(i)), sc[i >> 4], add[h]);
    });
  } else {
    numerators([&](int i, int h) { return fmaf(score_f32(score(i)), sc[i >> 4], neg[h]); });
  }
#pragma unroll
  for (int h = 0; h < 2; ++h)
    c.l[h] = c.l[h] * alpha[h] + ((sum[h][0] + sum[h][1]) + (sum[h][2] + sum[h][3]));
}

// Descriptors of one tile's wgmmas, computed before the wgmma fence (ptxas serializes wgmmas
// whose inputs are defined inside the pipeline stage) from the low words of the CTA's Q slice
// and of stage 0's K and V (DescBase, found once).
struct DescBase {
  uint32_t q, k, v;
};
template <class T>
__device__ __forceinline__ DescBase desc_base(const Smem<T>& sm, int wg) {
  return {desc_lo(smem_u32(sm.q() + wg * kWgRows * T::kDim)), desc_lo(smem_u32(sm.k(0))),
          desc_lo(smem_u32(sm.v(0)))};
}
template <class T>
struct QkDesc {
  uint64_t a[T::kDim / 32], b[T::kDim / 32];
};
template <class T>
__device__ __forceinline__ QkDesc<T> qk_desc(const DescBase& base, int stage) {
  QkDesc<T> d;
  const uint32_t k = base.k + uint32_t(stage) * desc_step(T::kStageBytes);
#pragma unroll
  for (int kb = 0; kb < T::kDim / 32; ++kb) {
    d.a[kb] = make_desc(base.q + desc_step(32 * kb), T::kDim);
    d.b[kb] = make_desc(k + desc_step(32 * kb), T::kDim);
  }
  return d;
}
// One k step of Q.K^T over a kN-key tile: the first one writes S, the others add to it.
template <int kN>
__device__ __forceinline__ void qk_step(int (&s)[kN / 2], uint64_t a, uint64_t b, bool first) {
  static_assert(kN == 128 || kN == 192 || kN == 256, "gen_wgmma.py has n 128, 192 and 256");
  if constexpr (kN == 256) {
    if (first)
      wgmma_m64n256k32_s32_s8s8_init(s, a, b);
    else
      wgmma_m64n256k32_s32_s8s8(s, a, b, 1);
  } else if constexpr (kN == 192) {
    if (first)
      wgmma_m64n192k32_s32_s8s8_init(s, a, b);
    else
      wgmma_m64n192k32_s32_s8s8(s, a, b, 1);
  } else {
    if (first)
      wgmma_m64n128k32_s32_s8s8_init(s, a, b);
    else
      wgmma_m64n128k32_s32_s8s8(s, a, b, 1);
  }
}
template <class T>
__device__ __forceinline__ void issue_qk(const QkDesc<T>& d, int (&s)[T::kTileScores]) {
#pragma unroll
  for (int kb = 0; kb < T::kDim / 32; ++kb) qk_step<T::kBlockN>(s, d.a[kb], d.b[kb], kb == 0);
}
template <class T>
struct PvDesc {
  uint64_t b[T::kPvSteps];
};
template <class T>
__device__ __forceinline__ PvDesc<T> pv_desc(const DescBase& base, int stage) {
  PvDesc<T> d;
  const uint32_t v = base.v + uint32_t(stage) * desc_step(T::kStageBytes);
  // Each k step reads 32 bytes of every V row: k step kb lies in swizzled part
  // kb / kStepsPerPart at byte 32 * (kb % kStepsPerPart) (one part for FP8 at 128 keys).
  constexpr int kStepBytes = 32;
  constexpr int kStepsPerPart = T::kVSwizzleBytes / kStepBytes;
#pragma unroll
  for (int kb = 0; kb < T::kPvSteps; ++kb)
    d.b[kb] = make_desc(
        v + desc_step((kb / kStepsPerPart) * T::kVPartBytes + kStepBytes * (kb % kStepsPerPart)),
        T::kVSwizzleBytes);
  return d;
}
// restart: O = P . V, dropping what O held (it is in O's home); otherwise O += P . V.
template <class T>
__device__ __forceinline__ void issue_pv(const PvDesc<T>& d, float (&o)[T::kDim / 2],
                                         const uint32_t (&pa)[T::kPvSteps][4], bool restart) {
#pragma unroll
  for (int kb = 0; kb < T::kPvSteps; ++kb) {
    const int acc = kb > 0 || !restart;
    if constexpr (T::kPv16 && T::kDim == 128)
      wgmma_m64n128k16_f32_f16(o, pa[kb], d.b[kb], acc);
    else if constexpr (T::kPv16)
      wgmma_m64n64k16_f32_f16(o, pa[kb], d.b[kb], acc);
    else if constexpr (T::kDim == 128)
      wgmma_m64n128k32_f32_e4m3(o, pa[kb], d.b[kb], acc);
    else
      wgmma_m64n64k32_f32_e4m3(o, pa[kb], d.b[kb], acc);
  }
}

// O's home (T::kOHomeTiles; Traits has why). Step j of the key loop (j > 0, a multiple of
// kOHomeTiles) moves O to its home once O holds tiles ..j-1 at the rows' running max; the next
// P.V (tile j) then restarts O from zero (the wgmma's accumulate predicate: no register of O
// is written outside the wgmmas).
template <class T>
__device__ __forceinline__ bool o_moves_home_at(int j) {
  if constexpr (T::kOHomeTiles > 0)
    return j > 0 && j % T::kOHomeTiles == 0;
  else
    return false;
}
// home = home * exp2(m_home - m) + o in FP32, with o at the rows' running max m. kToHome (in
// the key loop): store that in the home; otherwise (the epilogue) leave the total in o.
// Accumulator i belongs to row half (i >> 1) & 1, so float4 q holds row half 0's (4q, 4q + 1)
// and row half 1's (4q + 2, 4q + 3).
template <class T, bool kToHome>
__device__ __forceinline__ void merge_o_home(const Smem<T>& sm, Consumer<T>& c) {
  float4* const home = sm.o_home();
  float2* const home_max = sm.o_home_max();
  const float2 mh = *home_max;
  const float r[2] = {rescale_factor(mh.x, c.m[0]), rescale_factor(mh.y, c.m[1])};
  if constexpr (kToHome) *home_max = make_float2(c.m[0], c.m[1]);
#pragma unroll
  for (int q = 0; q < Consumer<T>::kOAcc / 4; ++q) {
    float* o = c.o + 4 * q;
    float4 v = home[q * kWgThreads];
    v.x = fmaf(v.x, r[0], o[0]);
    v.y = fmaf(v.y, r[0], o[1]);
    v.z = fmaf(v.z, r[1], o[2]);
    v.w = fmaf(v.w, r[1], o[3]);
    if constexpr (kToHome) {
      home[q * kWgThreads] = v;
    } else {
      o[0] = v.x;
      o[1] = v.y;
      o[2] = v.z;
      o[3] = v.w;
    }
  }
}

// `p`: the consumer's view, kv_len the entry's.
template <class T>
__device__ __forceinline__ bool tile_needs_mask(const SageParams& p, int key0, int wg_row0) {
  return key0 + T::kBlockN > p.kv_len ||
         (p.mask == SAGE_MASK_CAUSAL && key0 + T::kBlockN - 1 > wg_row0);
}

// softmax_tile with the key/causal masks where the tile needs them (tile_needs_mask).
template <class T>
__device__ __forceinline__ void softmax_any_tile(const SageParams& pk, Consumer<T>& c,
                                                 int (&s)[T::kTileScores], int key0, int wg_row0,
                                                 const float (&ks)[T::kScaleBlocks],
                                                 float (&alpha)[2], float (&f)[T::kTileScores],
                                                 uint32_t (&pa)[T::kPvSteps][4]) {
  if (tile_needs_mask<T>(pk, key0, wg_row0))
    softmax_tile<T, true>(pk, c, s, key0, ks, alpha, f, pa);
  else
    softmax_tile<T, false>(pk, c, s, key0, ks, alpha, f, pa);
}

// The overlapped loops' first Q.K^T (tile 0, stage 0), issued once Q and K have landed;
// `turn` runs right before its wgmma fence (the ping-pong turn).
template <class T, class Turn>
__device__ __forceinline__ void first_qk(const Smem<T>& sm, const DescBase& db,
                                         int (&s)[T::kTileScores], Turn turn) {
  mbar_wait(sm.full_q(), 0);
  mbar_wait(sm.full_k(0), 0);
  QkDesc<T> qd = qk_desc<T>(db, 0);
  reg_fence(qd.a);
  reg_fence(qd.b);
  turn();
  wgmma_fence();
  issue_qk<T>(qd, s);
  wgmma_commit();
}

// The overlapped loops' last P.V (P in `pa`), once the last tile's V has landed; `turn` runs
// right before its wgmma fence, `committed` right after its commit (the ping-pong turns).
template <class T, class Turn, class Committed>
__device__ __forceinline__ void last_pv(const Smem<T>& sm, const DescBase& db, const Work& w,
                                        Consumer<T>& c, uint32_t (&pa)[T::kPvSteps][4], int lane,
                                        Turn turn, Committed committed) {
  const int last = (w.n_tiles - 1) % T::kStages;
  mbar_wait(sm.full_v(last), ((w.n_tiles - 1) / T::kStages) & 1);
  PvDesc<T> vd = pv_desc<T>(db, last);
  reg_fence(vd.b);
  reg_fence(pa);
  reg_fence(c.o);
  turn();
  wgmma_fence();
  issue_pv<T>(vd, c.o, pa, o_moves_home_at<T>(w.n_tiles - 1));
  wgmma_commit();
  committed();
  wgmma_wait<0>();
  reg_fence(c.o);
  if (lane == 0) mbar_arrive(sm.empty(last));
}

// The overlapped key loop (Traits::kSerial false): QK of tile j in flight with PV of tile j-1.
template <class T>
__device__ __forceinline__ void key_loop_overlapped(const SageParams& pk, const Work& w,
                                                    const Smem<T>& sm, Consumer<T>& c, int wg,
                                                    int wg_row0, int lane) {
  int s[T::kTileScores];
  float alpha[2];
  // Turns (T::kPingPong): each warpgroup issues n_tiles + 1 wgmma blocks (QK of tile 0, one
  // QK + PV per loop step, the last PV), each between my_turn() and pass(). Warpgroup 0 goes
  // first: warpgroup 1 hands it the first turn, and skips its own last hand-over, so every
  // barrier gets exactly as many arrivals as syncs.
  const auto my_turn = [&] {
    if constexpr (T::kPingPong) named_sync(1 + wg);
  };
  const auto pass = [&] {
    if constexpr (T::kPingPong) named_arrive(1 + (wg ^ 1));
  };
  if (T::kPingPong && wg == 1) named_arrive(1);
  const DescBase db = desc_base(sm, wg);
  float ks[T::kScaleBlocks], ks_next[T::kScaleBlocks];
  load_k_scales<T>(pk, 0, ks);
  if constexpr (T::kEarlyKScales) load_k_scales<T>(pk, T::kBlockN, ks_next);
  first_qk<T>(sm, db, s, my_turn);
  pass();
  wgmma_wait<0>();
  reg_fence(s);
  float f[T::kTileScores];
  softmax_any_tile<T>(pk, c, s, 0, wg_row0, ks, alpha, f, c.pa);
  pack_p<T>(f, c.pa);

  for (int j = 1; j < w.n_tiles; ++j) {
    const int st = j % T::kStages, prev = (j - 1) % T::kStages;
    const int key0 = j * T::kBlockN;
    if constexpr (T::kEarlyKScales) {
#pragma unroll
      for (int blk = 0; blk < T::kScaleBlocks; ++blk) ks[blk] = ks_next[blk];
      load_k_scales<T>(pk, key0 + T::kBlockN, ks_next);
    }
    mbar_wait(sm.full_k(st), (j / T::kStages) & 1);
    mbar_wait(sm.full_v(prev), ((j - 1) / T::kStages) & 1);
    QkDesc<T> qd = qk_desc<T>(db, st);
    PvDesc<T> vd = pv_desc<T>(db, prev);
    reg_fence(qd.a);
    reg_fence(qd.b);
    reg_fence(vd.b);
    reg_fence(c.pa);
    reg_fence(c.o);
    my_turn();
    wgmma_fence();
    issue_qk<T>(qd, s);
    wgmma_commit();
    issue_pv<T>(vd, c.o, c.pa, o_moves_home_at<T>(j - 1));
    wgmma_commit();
    pass();
    wgmma_wait<1>();  // QK of tile j done; PV of tile j-1 still running
    reg_fence(s);
    if constexpr (!T::kEarlyKScales) load_k_scales<T>(pk, key0, ks);
    softmax_any_tile<T>(pk, c, s, key0, wg_row0, ks, alpha, f, c.pa);
    wgmma_wait<0>();
    reg_fence(c.o);
    reg_fence(c.pa);
    reg_fence(f);
    if (lane == 0) mbar_arrive(sm.empty(prev));
    rescale_o(c, alpha);
    pack_p<T>(f, c.pa);
    // After P's packing: f is dead there.
    if (o_moves_home_at<T>(j)) merge_o_home<T, true>(sm, c);
  }
  last_pv<T>(sm, db, w, c, c.pa, lane, my_turn, [&] {
    if (wg == 0) pass();
  });
}

// The overlapped key loop with P double-buffered (Traits::kDoubleP): as key_loop_overlapped
// (Q.K^T of tile j in flight with P.V of tile j - 1, the softmax of j beside that P.V), but the
// softmax packs P(j) into the other buffer as its numerators come, and folds the exponent's
// bias (Traits::kFoldScoreBias); O is rescaled once P.V(j - 1) retired. The buffers alternate
// with the tiles' parity (c.pa the even tiles', pb the odd ones'): the loop runs two tiles a
// turn so that each buffer is a fixed set of registers.
template <class T>
__device__ __forceinline__ void key_loop_double_p(const SageParams& pk, const Work& w,
                                                  const Smem<T>& sm, Consumer<T>& c, int wg,
                                                  int wg_row0, int lane) {
  static_assert(T::kPackInSoftmax && !T::kRescaleInSoftmax, "");
  using PFrag = uint32_t[T::kPvSteps][4];
  const DescBase db = desc_base(sm, wg);
  int s[T::kTileScores];
  float alpha[2], f[T::kTileScores], ks[T::kScaleBlocks];
  PFrag pb;
  load_k_scales<T>(pk, 0, ks);
  const auto none = [] {};  // no turns between the warpgroups
  first_qk<T>(sm, db, s, none);
  wgmma_wait<0>();
  if (lane == 0) mbar_arrive(sm.empty_k(0));
  reg_fence(s);
  softmax_any_tile<T>(pk, c, s, 0, wg_row0, ks, alpha, f, c.pa);
  // Step j: Q.K^T(j) and P.V(j - 1) (P in `prev`), the softmax of j into `cur`.
  const auto step = [&](int j, PFrag& prev, PFrag& cur) {
    // j opaque here and again at the step's end: the stage and barrier values derived from it
    // are then formed where they are used, not kept (or spilled) across the softmax.
    asm volatile("" : "+r"(j));
    const int st = j % T::kStages, pst = (j - 1) % T::kStages;
    const int key0 = j * T::kBlockN;
    mbar_wait(sm.full_k(st), (j / T::kStages) & 1);
    mbar_wait(sm.full_v(pst), ((j - 1) / T::kStages) & 1);
    // The descriptors from the base words anew each step: hoisted out of the loop as
    // invariants (Q's), they held 8 registers across it and were spilled.
    DescBase b = db;
    asm volatile("" : "+r"(b.q), "+r"(b.k), "+r"(b.v));
    QkDesc<T> qd = qk_desc<T>(b, st);
    PvDesc<T> vd = pv_desc<T>(b, pst);
    reg_fence(qd.a);
    reg_fence(qd.b);
    reg_fence(vd.b);
    reg_fence(prev);
    reg_fence(c.o);
    wgmma_fence();
    issue_qk<T>(qd, s);
    wgmma_commit();
    issue_pv<T>(vd, c.o, prev, o_moves_home_at<T>(j - 1));
    wgmma_commit();
    // The K scales load under the wgmmas (as the serial kernel's): held from before their
    // issue, they were six more registers live where S, both P.V operands and O are.
    load_k_scales<T>(pk, key0, ks);
    wgmma_wait<1>();  // Q.K^T of tile j done; P.V of tile j - 1 still running
    reg_fence(s);
    if (lane == 0) mbar_arrive(sm.empty_k(st));
    softmax_any_tile<T>(pk, c, s, key0, wg_row0, ks, alpha, f, cur);
    wgmma_wait<0>();
    // prev stays live to here: its registers must not take the softmax's values while the
    // P.V reads them.
    reg_fence(c.o);
    reg_fence(prev);
    asm volatile("" : "+r"(j));
    if (lane == 0) mbar_arrive(sm.empty((j - 1) % T::kStages));
    rescale_o(c, alpha);
    if (o_moves_home_at<T>(j)) merge_o_home<T, true>(sm, c);
  };
  for (int j = 1;; j += 2) {
    if (j >= w.n_tiles) {
      last_pv<T>(sm, db, w, c, c.pa, lane, none, none);
      break;
    }
    step(j, c.pa, pb);
    if (j + 1 >= w.n_tiles) {
      last_pv<T>(sm, db, w, c, pb, lane, none, none);
      break;
    }
    step(j + 1, pb, c.pa);
  }
}

// Counts one more warpgroup done with a stage's K or V; true for the kWgs-th of each use. Acquire
// and release order the others' finished wgmma reads before the refill this one then issues.
template <class T>
__device__ __forceinline__ bool last_to_release(int* counter) {
  if constexpr (T::kWgs == 1) return true;
  unsigned old;
  asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], 1;"
               : "=r"(old)
               : "r"(smem_u32(counter))
               : "memory");
  return old % T::kWgs == T::kWgs - 1;
}

// The serial key loop (Traits::kSerial): per tile QK, softmax and PV in turn, nothing in
// flight across the softmax. Stage st = j % kStages is refilled with tile j + kStages by the
// last of the CTA's warpgroups done with it (last_to_release: no warpgroup waits for another):
// its K once that warpgroup's QK retired, its V once its PV did (a wgmma is one operation of the
// whole warpgroup: its retirement in one warp is the end of its shared-memory reads). The phase
// parity of a stage's barriers is enough: no warpgroup gets kStages tiles ahead of the slowest,
// whose release the refill waits for. O moves to its home at the top of a step, before the QK,
// where S's registers are not live yet.
template <class T>
__device__ __forceinline__ void key_loop_serial(const SageParams& pk, const Maps& maps,
                                                const Work& w, const Smem<T>& sm, Consumer<T>& c) {
  static_assert(T::kPackInSoftmax && T::kRescaleInSoftmax,
                "the serial loop leaves P's packing and O's rescale to softmax_tile");
  const int wg = T::kWgs == 1 ? 0 : int(threadIdx.x) / kWgThreads;
  const DescBase db = desc_base(sm, wg);
  int s[T::kTileScores];
  float alpha[2], f[T::kTileScores], ks[T::kScaleBlocks];
  mbar_wait(sm.full_q(), 0);
  for (int j = 0; j < w.n_tiles; ++j) {
    const int st = unsigned(j) % T::kStages, phase = (unsigned(j) / T::kStages) & 1;
    const int key0 = j * T::kBlockN;
    const bool next = (threadIdx.x % kWgThreads) == 0 && j + T::kStages < w.n_tiles;
    if (o_moves_home_at<T>(j)) merge_o_home<T, true>(sm, c);
    mbar_wait(sm.full_k(st), phase);
    {
      QkDesc<T> qd = qk_desc<T>(db, st);
      reg_fence(qd.a);
      reg_fence(qd.b);
      wgmma_fence();
      issue_qk<T>(qd, s);
    }
    wgmma_commit();
    // The K scales load under the QK wgmma, not ahead of its fence (H100 B1 H24 sage_core, the
    // two builds alternating in one call: 818 -> 822 TFLOPS at S 16k, 837 -> 839 at 32k).
    load_k_scales<T>(pk, key0, ks);
    wgmma_wait<0>();
    reg_fence(s);
    if (next && last_to_release<T>(sm.released(st, 0))) load_k(maps, w, sm, j + T::kStages);
    // The softmax, P packed and O rescaled with it; the warpgroup's first row from c.row0, not
    // kept across the loop (with three warpgroups per CTA that cost a spill).
    softmax_any_tile<T>(pk, c, s, key0, c.row0 - 16 * c.warp - c.g, ks, alpha, f, c.pa);
    mbar_wait(sm.full_v(st), phase);
    {
      PvDesc<T> vd = pv_desc<T>(db, st);
      reg_fence(vd.b);
      reg_fence(c.pa);
      reg_fence(c.o);
      wgmma_fence();
      issue_pv<T>(vd, c.o, c.pa, o_moves_home_at<T>(j));
    }
    wgmma_commit();
    wgmma_wait<0>();
    reg_fence(c.o);
    if (next && last_to_release<T>(sm.released(st, 1))) load_v(maps, w, sm, j + T::kStages);
  }
}

template <class T>
__device__ void consume(const SageParams& p, const Maps& maps, const Work& w, const Smem<T>& sm,
                        int wg, int tid) {
  Consumer<T> c;
  const int lane = tid & 31;
  c.warp = (tid >> 5) & 3;
  c.g = lane >> 2;
  c.t = lane & 3;
  const int wg_row0 = w.q0 + wg * kWgRows;
  c.row0 = wg_row0 + 16 * c.warp + c.g;
  const int64_t hq_lin = head_index(p.heads_q, w.b, w.hq);
  const int64_t hkv_lin = head_index(p.heads_kv, w.b, w.hkv);
  // Rows row0 and row0 + 8 lie in the warp's 16 rows: one Q scale block whether it is 32 rows
  // or, with q_scale_rows 16, 16 (q_scale_offset).
  c.qs = c.row0 < p.q_len_pad ? p.q_scale[q_scale_offset(p, hq_lin, c.row0)] : 0.0f;
  SageParams pk = p;  // k_scale of this kv head, kv_len of this entry (the masks' bound)
  pk.k_scale = p.k_scale + hkv_lin * scale_blocks(p.kv_len_pad);
  pk.kv_len = w.kv_len;
  c.m[0] = c.m[1] = -INFINITY;
  c.l[0] = c.l[1] = 0.0f;
#pragma unroll
  for (int i = 0; i < Consumer<T>::kOAcc; ++i) c.o[i] = 0.0f;
  // O's home, where O will move (a key loop longer than kOHomeTiles tiles), starts empty:
  // zeros (shared memory may hold NaN bit patterns, and 0 * NaN is NaN) at running max -inf.
  const bool o_home_used = T::kOHomeTiles > 0 && w.n_tiles > T::kOHomeTiles;
  if (o_home_used) {
    float4* const home = sm.o_home();
#pragma unroll
    for (int q = 0; q < Consumer<T>::kOAcc / 4; ++q)
      home[q * kWgThreads] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    *sm.o_home_max() = make_float2(-INFINITY, -INFINITY);
  }

  if constexpr (T::kSerial)
    key_loop_serial<T>(pk, maps, w, sm, c);
  else if constexpr (T::kDoubleP)
    key_loop_double_p<T>(pk, w, sm, c, wg, wg_row0, lane);
  else
    key_loop_overlapped<T>(pk, w, sm, c, wg, wg_row0, lane);
  if (o_home_used) merge_o_home<T, false>(sm, c);

  // Epilogue: full row sums over the quad, O = acc / l * v_scale saturated (output_value: the
  // code mean acc / l clamped to +-448 with e4m3 V, the product to +-out_dtype's maximum where
  // finite), LSE.
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = c.l[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    c.l[h] = l;
    inv[h] = 1.0f / l;
  }
  // The KV head again, from a fresh read of the block index (ctaid_y), not kept from the
  // prologue: its integer division's result stayed live across the key loop and, at the four
  // CTAs per SM of the D = 64 serial kernel (128 registers), was spilled.
  const int64_t hkv_out = head_index(p.heads_kv, w.b, kv_head_of(p, ctaid_y()));
  const float* vs = p.v_scale + hkv_out * T::kDim;
  uint16_t* out = halves(p.out);
  const bool fp16 = p.out_dtype == SAGE_DTYPE_FP16;
  const float mean_bound = code_mean_bound(T::kPv16);
  const float out_max = half_max(p.out_dtype);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = c.row0 + 8 * h;
    if (row >= p.out_rows) continue;
    const bool real = row < w.q_len;
    uint16_t* orow =
        out + bshd_offset(p.out_stride_b, p.out_stride_s, p.out_stride_h, w.b, row, w.hq);
#pragma unroll
    for (int ch = 0; ch < T::kDim / 8; ++ch) {
      const int d = 8 * ch + 2 * c.t;
      if (d >= p.head_dim) continue;
      float x0 = 0.0f, x1 = 0.0f;
      if (real) {
        x0 = output_value(c.o[4 * ch + 2 * h] * inv[h], vs[d], mean_bound, out_max);
        x1 = output_value(c.o[4 * ch + 2 * h + 1] * inv[h], vs[d + 1], mean_bound, out_max);
      }
      uint32_t bits;
      if (fp16) {
        const __half2 v = __floats2half2_rn(x0, x1);
        bits = *reinterpret_cast<const uint32_t*>(&v);
      } else {
        const __nv_bfloat162 v = __floats2bfloat162_rn(x0, x1);
        bits = *reinterpret_cast<const uint32_t*>(&v);
      }
      *reinterpret_cast<uint32_t*>(orow + d) = bits;
    }
    if (p.lse && c.t == 0) {
      float lse = -INFINITY;
      if (real) {
        float l2 = c.m[h] + log2f(c.l[h]) - kExpOffset;
        if (p.lse_corr) l2 += p.lse_corr[lse_corr_offset(hq_lin, p.q_len_pad, row)];
        lse = l2 * kLn2;
      }
      p.lse[lse_offset(p, w.b, w.hq, row)] = lse;
    }
  }
}

template <class T>
__global__ void __launch_bounds__(T::kThreads, T::kCtasPerSm)
    attention_kernel(const __grid_constant__ SageParams p, const __grid_constant__ Maps maps) {
  extern __shared__ uint8_t smem_raw[];
  Smem<T> sm;
  // Aligned by an offset from the shared array itself (not through an integer cast), so that the
  // compiler keeps the shared state space: O's home is read and written with LDS/STS, not
  // generic LD/ST (which wait on the long scoreboard).
  sm.base = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const Work w = work_of<T>(p);
  const int tid = int(threadIdx.x);
  const int wg = tid / kWgThreads;
  if (tid == 0) {
    mbar_init(sm.full_q(), 1);
    for (int s = 0; s < T::kStages; ++s) {
      mbar_init(sm.full_k(s), 1);
      mbar_init(sm.full_v(s), 1);
      mbar_init(sm.empty(s), T::kConsumerWarps);
      if (T::kDoubleP) mbar_init(sm.empty_k(s), T::kConsumerWarps);
      *sm.released(s, 0) = *sm.released(s, 1) = 0;
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // Launched after prior work in the stream (programmatic dependent launch: prepare's v_quant
  // lets its dependents start): nothing global is read or written before that work is done.
  sage_wait_for_prior_grid();
  if constexpr (T::kSerial) {  // no producer: thread 0 issues the first copies itself
    if (tid == 0) {
      load_q(maps, w, sm);
      for (int j = 0; j < T::kStages && j < w.n_tiles; ++j) {
        load_k(maps, w, sm, j);
        load_v(maps, w, sm, j);
      }
    }
    consume<T>(p, maps, w, sm, T::kWgs == 1 ? 0 : wg, T::kWgs == 1 ? tid : tid % kWgThreads);
  } else if (wg == 0) {
    set_max_regs_dec<kProducerRegs>();
    if (tid == 0) produce<T>(maps, w, sm);
  } else {
    set_max_regs_inc<T::kConsumerRegs>();
    consume<T>(p, maps, w, sm, wg - 1, tid - kWgThreads);
  }
}

}  // namespace sm90
}  // namespace sage

SAGE_DEFINE_MODULE_ABI("module_gfx1201_sage_attention target=cuda sm_90a")

namespace {
// All of contract v2, FP16 P.V (the kPv16 kernels) and 16-row Q scales included. The cuda
// prepare is csrc/simt/prepare.hip's and checks its own features.
constexpr sage::Features kCudaFeatures = sage::kAllFeatures;

// cuTensorMapEncodeTiled, from the driver through the runtime's entry-point query (the module
// links the CUDA runtime only, not libcuda). Null if the driver has none.
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiledFn encode_tiled_fn() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                           cudaEnableDefault, &found);
#else
    const cudaError_t e =
        cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &found);
#endif
    return e == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<EncodeTiledFn>(f)
               : nullptr;
  }();
  return fn;
}

// One tiled tensor map (dims innermost first, strides in bytes of dims 1.., no OOB fill value:
// boxes past the bounds read zeros). Returns 0 or sets the error.
template <int kRank>
int encode(CUtensorMap* map, const char* what, CUtensorMapDataType type, const void* base,
           const cuuint64_t (&dims)[kRank], const cuuint64_t (&strides)[kRank - 1],
           const cuuint32_t (&box)[kRank], CUtensorMapSwizzle swizzle) {
  const EncodeTiledFn fn = encode_tiled_fn();
  if (!fn)
    return sage::set_error("sage_attention_launch: the CUDA driver has no cuTensorMapEncodeTiled");
  if (reinterpret_cast<uintptr_t>(base) % 16)
    return sage::set_error("sage_attention_launch: the prepared %s is not 16-byte aligned", what);
  cuuint32_t elem_strides[kRank];
  for (int i = 0; i < kRank; ++i) elem_strides[i] = 1;
  const CUresult r = fn(map, type, kRank, const_cast<void*>(base), dims, strides, box, elem_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return sage::set_error("sage_attention_launch: cuTensorMapEncodeTiled (%s) failed: %d", what,
                           int(r));
  return 0;
}

// The launch's tensor maps (the file comment has their shapes). Encoded at each launch into
// the kernel's parameters, so a captured CUDA graph holds them by value.
template <class T>
int encode_maps(const SageParams& p, sage::sm90::Maps* m) {
  using u64 = cuuint64_t;
  constexpr cuuint32_t kDp = T::kDim, kM = T::kBlockM, kN = T::kBlockN;
  const CUtensorMapSwizzle qk_swizzle =
      kDp == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  const u64 b = u64(p.batch), q_row = u64(p.heads_q) * kDp, k_row = u64(p.heads_kv) * kDp;
  const u64 q_pad = u64(p.q_len_pad), kv_pad = u64(p.kv_len_pad);
  if (encode<3>(&m->q, "Q", CU_TENSOR_MAP_DATA_TYPE_UINT8, p.q8, {q_row, q_pad, b},
                {q_row, q_pad * q_row}, {kDp, kM, 1}, qk_swizzle))
    return 1;
  if (T::kPv16) {
    if (encode<3>(&m->k, "K", CU_TENSOR_MAP_DATA_TYPE_UINT8, p.k8, {k_row, kv_pad, b},
                  {k_row, kv_pad * k_row}, {kDp, kN, 1}, qk_swizzle))
      return 1;
  } else {
    // Rows e + 4t + 16G of a batch: box (2, 4, 8) at e = 0 or 2 (the permutation).
    if (encode<5>(&m->k, "K", CU_TENSOR_MAP_DATA_TYPE_UINT8, p.k8, {k_row, 4, 4, kv_pad / 16, b},
                  {k_row, 4 * k_row, 16 * k_row, kv_pad * k_row}, {kDp, 2, 4, kN / 16, 1},
                  qk_swizzle))
      return 1;
  }
  const u64 v_elem = T::kVElemBytes, v_rows = u64(p.heads_kv) * kDp;
  const cuuint32_t v_box = kN / T::kVParts;  // keys of one swizzled row
  const CUtensorMapSwizzle v_swizzle =
      T::kVSwizzleBytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  if (encode<3>(&m->v, "V",
                T::kPv16 ? CU_TENSOR_MAP_DATA_TYPE_UINT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8,
                T::kPv16 ? static_cast<const void*>(p.v16) : static_cast<const void*>(p.v8),
                {u64(p.kv_len), v_rows, b}, {kv_pad * v_elem, v_rows * kv_pad * v_elem},
                {v_box, kDp, 1}, v_swizzle))
    return 1;
  return 0;
}

template <class T>
int launch(const SageParams& p, cudaStream_t stream) {
  auto kernel = sage::sm90::attention_kernel<T>;
  static bool configured = false;  // per instantiation; benign race (idempotent)
  if (!configured) {
    cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
    // Several CTAs per SM (the serial kernel) need the largest shared-memory carve-out.
    if (e == cudaSuccess && T::kCtasPerSm > 1)
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               int(cudaSharedmemCarveoutMaxShared));
    if (e != cudaSuccess)
      return sage::set_error("sage_attention_launch: cannot reserve %d bytes of shared memory: %s",
                             T::kSmemBytes, cudaGetErrorString(e));
    configured = true;
  }
  sage::sm90::Maps maps;
  if (encode_maps<T>(p, &maps)) return 1;
  const unsigned q_tiles = unsigned((p.out_rows + T::kBlockM - 1) / T::kBlockM);
  // Programmatic dependent launch: the CTAs may start (barriers set up) while the kernel before
  // in the stream finishes, if it allows it (prepare's v_quant); the kernel waits for it before
  // any global access (sage_wait_for_prior_grid).
  const int rc = sage_launch_after_prior_smem(
      kernel, sage_dim3{q_tiles, unsigned(p.heads_q), unsigned(p.batch)}, T::kThreads,
      T::kSmemBytes, stream, p, maps);
  if (rc)
    return sage::set_error("sage_attention_launch: launch failed: %s",
                           cudaGetErrorString(static_cast<cudaError_t>(rc)));
  return 0;
}

// The device of the current context must be a Hopper GPU (sm_90): the module holds sm_90a code
// only, so any other arch gets this message instead of "no kernel image".
bool check_arch() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess)
    return !sage::set_error("sage_attention_launch: no CUDA device");
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (major != 9 || minor != 0)
    return !sage::set_error(
        "sage_attention_launch: the cuda backend is built for Hopper (sm_90a); this GPU is "
        "sm_%d%d",
        major, minor);
  return true;
}
// The one place where the head dim and the P.V mode become template arguments
// (sage/static_switch.h), for one schedule.
template <int kSchedule>
int launch_schedule(const SageParams& p, cudaStream_t stream) {
  namespace s9 = sage::sm90;
  return SAGE_BOOL_SWITCH(p.pv_dtype == SAGE_PV_FP16, kPv16, [&] {
    return SAGE_HEAD_DIM_SWITCH(p.head_dim_pad, kDp, [&] {
      return launch<s9::KernelTraits<kDp, kPv16, kSchedule>>(p, stream);
    });
  });
}
}  // namespace

SAGE_EXPORT int sage_attention_run(const SageParams* params, void* stream) {
  namespace s9 = sage::sm90;
  if (!sage::check_features(params, sage::Launch::kAttention, kCudaFeatures, "cuda")) return 1;
  const SageParams& p = *params;
  if ((p.out_stride_s | p.out_stride_h | p.out_stride_b) & 1 ||
      (reinterpret_cast<uintptr_t>(p.out) & 3))
    return sage::set_error(
        "sage_attention_launch: the cuda backend needs an output with even "
        "strides and a 4-byte aligned base");
  if (!check_arch()) return 1;
  auto st = static_cast<cudaStream_t>(stream);
  // AITER_SAGE_CUDA_SCHEDULE (measurements only): `overlap` runs the FP8 kernels with the
  // overlapped schedule instead of the serial one (Traits::kSerial has why); `pingpong` the
  // overlapped FP8 kernels with their two consumer warpgroups taking turns to issue wgmmas (a
  // loss on an H200, TMA producer: 5.11 vs 4.69-4.75 ms at S = 16k, D = 128, 4.42 vs
  // 4.37-4.40 ms at D = 64); `shared192` the serial D = 128 FP8 kernel with three warpgroups
  // per CTA sharing its K/V copies; `wide256` two such warpgroups on 256-key tiles. Read once
  // per process.
  static const int schedule = [] {
    const char* e = getenv("AITER_SAGE_CUDA_SCHEDULE");
    if (!e || !*e) return int(s9::kScheduleDefault);
    for (int i = 0; i < s9::kSchedules; ++i)
      if (strcmp(e, s9::kScheduleNames[i]) == 0) return i;
    return -1;
  }();
  if (schedule < 0) {
    char names[128] = "";
    for (int i = 0; i < s9::kSchedules; ++i)
      snprintf(names + strlen(names), sizeof(names) - strlen(names), "%s%s", i ? ", " : "",
               s9::kScheduleNames[i]);
    return sage::set_error("sage_attention_launch: AITER_SAGE_CUDA_SCHEDULE is %s; it takes %s",
                           getenv("AITER_SAGE_CUDA_SCHEDULE"), names);
  }
  switch (schedule) {
    case s9::kScheduleOverlap:
      return launch_schedule<s9::kScheduleOverlap>(p, st);
    case s9::kSchedulePingPong:
      return launch_schedule<s9::kSchedulePingPong>(p, st);
    case s9::kScheduleShared192:
      return launch_schedule<s9::kScheduleShared192>(p, st);
    case s9::kScheduleWide256:
      return launch_schedule<s9::kScheduleWide256>(p, st);
    case s9::kScheduleOverlap192:
      return launch_schedule<s9::kScheduleOverlap192>(p, st);
    default:
      return launch_schedule<s9::kScheduleDefault>(p, st);
  }
}
SAGE_DEFINE_CHECKED_LAUNCH(attention, kAttention)
