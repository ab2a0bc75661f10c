// Tile shape of the verify attention kernel and the shared-memory budget it
// implies. Every constant that another depends on is checked here, so a
// change that breaks the sm_120 budget (99 KB per block) fails to compile.
#ifndef MLAVERIFY_KERNELS_VERIFY_CONFIG_CUH_
#define MLAVERIFY_KERNELS_VERIFY_CONFIG_CUH_

#include "common/kv_dtype.h"
#include "kernels/verify_params.h"

namespace mlaverify::kernels::verify {

constexpr int D_QK = 576;  // latent row: 512 (kv_lora_rank, also V) + 64 (rope)
constexpr int D_V = 512;

// A CTA owns BLOCK_M query rows ((draft token, head) pairs of one request).
// The plan measures KV ranges in BLOCK_N-token tiles (the attention kernel
// itself walks them in 16-token tiles, pipelined::BLOCK_N).
constexpr int BLOCK_M = 32;
constexpr int BLOCK_N = 32;
// 16-row groups of a row tile (mma.m16n8k16's M).
constexpr int ROW_GROUPS = BLOCK_M / 16;
constexpr int M_TILES = BLOCK_M / 16;

// Shared memory. Latent rows are 72 chunks of 16 bytes; chunk c of row r sits
// at chunk (c & ~7) | ((c ^ r) & 7) so that the 8 rows an ldmatrix reads hit 8
// different bank groups (row pitch 1152 B is a multiple of 128 B).
constexpr int ROW_CHUNKS = D_QK / 8;
constexpr int ROW_BYTES = D_QK * 2;
constexpr int Q_TILE_BYTES = BLOCK_M * ROW_BYTES;

__host__ __device__ constexpr int SwizzledChunk(int row, int chunk) {
  return (chunk & ~7) | ((chunk ^ row) & 7);
}

constexpr int SM120_MAX_SMEM_PER_BLOCK = 101376;  // 99 KB: the production target's limit
// The attention kernel's static shared memory is ForEachSegment's
// SegmentSmem (verify_kernel.cuh): at most kVerifyStaticSharedBytes
// (verify_params.h; ptxas reports 1,408 B).

static_assert(D_QK % 64 == 0 && D_V % 64 == 0, "latent split into 64-wide chunks");
static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0, "mma.m16n8k16 tiles");

// ---------------------------------------------------------------------------
// The attention kernel (PipelinedAttentionKernel, verify_pipelined_kernel.cuh):
// warp-specialised, 4 + 4 warps (one warp per role per SM sub-partition) in
// two roles that run one KV tile apart:
//   score warps, warp = (row_group, key half): Q[16 rows, 576 dims] in 144
//     registers, S of the half's 8 keys of a 16-key tile over all 576 dims,
//     the online softmax of those scores, P(t) written to shared memory. The
//     pair of a row group only agrees on changes of a row's exponent
//     reference (ScoreTilesKeySplit).
//   PV warps: O[32 rows, 512 / PV_WARPS columns] in registers;
//     O = alpha O + P(t) V(t) while the score warps already work on tile t+1.
//     They also issue the KV loads, which keeps address arithmetic off the
//     score warps (ncu, bench/NOTES.md, "Warp-specialised, not split-K").
// They hand over through named barriers (double-buffered P and alpha), so
// the tensor pipe stays busy during the softmax. KV tiles are 16 tokens so
// that five stages fit 99 KB.
// ---------------------------------------------------------------------------
namespace pipelined {
constexpr int BLOCK_N = 16;
// Loaders: the score warps load Q and the first tiles, the PV warps the rest,
// 128 threads of a role with 8 threads per KV row (9 chunks of 16 bytes each).
constexpr int LOADER_THREADS = 128;
constexpr int LOADER_THREADS_PER_ROW = 8;
constexpr int STAGE_BYTES = BLOCK_N * ROW_BYTES;
constexpr int P_PITCH = BLOCK_N + 8;  // bf16; 48-byte rows: ldmatrix and stores conflict-free
constexpr int P_BUFFER_BYTES = BLOCK_M * P_PITCH * 2;
// FP8 pools (the 656-byte row of common/kv_dtype.h). Each loader thread
// copies its share of a raw fp8 row by cp.async into the stage of the tile,
// into the very 16-byte slots of the bf16 row that it will itself write, and
// converts them there after its wait_group (ConvertFp8Row,
// verify_pipelined_kernel.cuh): the MMA path, the stages and the hand-over
// stay those of bf16, no shared memory is added, and no thread reads bytes
// another thread wrote. Lane l (of the row's 8) takes code chunks q = l + 8m
// (m < 4: 16 codes of group m, which become bf16 chunks 2q and 2q + 1), the
// scale chunk (all four scales) and rope chunk l (already bf16: it lands in
// its final place).
constexpr int FP8_ROW_BYTES = kFp8RowBytes;                                        // 656
constexpr int FP8_CODE_CHUNKS_PER_LANE = kValueDim / 16 / LOADER_THREADS_PER_ROW;  // 4
// Where lane l's raw pieces wait, as chunk indices of the bf16 row (before the
// swizzle): code chunk m at 2l + 16m, the first bf16 chunk that it becomes;
// the scales at 2l + 49, the last chunk the lane writes (after reading them).
__host__ __device__ constexpr int Fp8CodeSlot(int lane, int m) { return 2 * lane + 16 * m; }
__host__ __device__ constexpr int Fp8ScaleSlot(int lane) {
  return Fp8CodeSlot(lane, FP8_CODE_CHUNKS_PER_LANE - 1) + 1;
}
static_assert(FP8_ROW_BYTES == kValueDim + 16 + kRopeDim * 2 && kFp8ScaleOffset == kValueDim &&
                  kFp8RopeOffset == kValueDim + 16 && kFp8Groups == FP8_CODE_CHUNKS_PER_LANE &&
                  kFp8GroupSize == 16 * LOADER_THREADS_PER_ROW,
              "a row is 32 code chunks (8 per 128-value group), one scale chunk, 8 rope chunks: "
              "lane l's code chunk l + 8m is in group m");
static_assert(kRopeDim * 2 == 16 * LOADER_THREADS_PER_ROW && ROW_CHUNKS == 64 + 8,
              "one rope chunk per loader lane, bf16 chunk 64 + l");
// The kernel addresses those slots from one byte offset per thread, A = the
// swizzled place of chunk 2l: code slot m at A + 256 m, the chunk after
// it (2l + 1 + 16 m) at (A ^ 16) + 256 m, the scales at (A ^ 16) + 768.
constexpr bool Fp8SlotsFollowTheBase() {
  for (int row = 0; row < 16; ++row)
    for (int lane = 0; lane < LOADER_THREADS_PER_ROW; ++lane) {
      const int a = SwizzledChunk(row, Fp8CodeSlot(lane, 0)) * 16;
      for (int m = 0; m < FP8_CODE_CHUNKS_PER_LANE; ++m) {
        if (SwizzledChunk(row, Fp8CodeSlot(lane, m)) * 16 != a + 256 * m) return false;
        if (SwizzledChunk(row, Fp8CodeSlot(lane, m) + 1) * 16 != (a ^ 16) + 256 * m) return false;
      }
      if (SwizzledChunk(row, Fp8ScaleSlot(lane)) * 16 != (a ^ 16) + 768) return false;
    }
  return (ROW_BYTES % 32) == 0;  // row bases leave bit 4 to the chunk
}
// Page ids of the KV rows the PV warps will load// Page ids of the KV rows the PV warps will load,
// fetched with cp.async PAGE_AHEAD tiles before their tile is loaded: [PAGE_RING][BLOCK_N] int32.
constexpr int PAGE_AHEAD = 4;
constexpr int PAGE_RING = 8;
// Page sizes below 2^RING_BELOW_PAGE_LOG2 tokens take the ring; from there up
// a 16-token tile lies in one page and the PV warps read its id into a
// register one step ahead (bench/NOTES.md, "Page ids: ring or register").
constexpr int RING_BELOW_PAGE_LOG2 = 4;
static_assert((1 << RING_BELOW_PAGE_LOG2) >= BLOCK_N, "a register-path tile must lie in one page");
// The softmax keeps a row's exponent reference while no new score exceeds it
// by more than this (log2 domain): P stays <= 256.
constexpr float REFERENCE_SLACK = 8.0f;

// Named barriers (0 is __syncthreads).
constexpr int BAR_SCORE = 1;    // score warps: a KV tile is visible to all of them
constexpr int BAR_PAIR = 2;     // + row_group: the score pair's reduction and exchanges
constexpr int BAR_P_FULL = 4;   // + (tile & 1): P(t), alpha(t) written (score -> PV)
constexpr int BAR_P_EMPTY = 6;  // + (tile & 1): PV(t) done with P buffer and alpha slot
constexpr int BAR_FINAL = 8;    // 1 / l and lse of every row written (score -> PV)
constexpr int BAR_KV_FULL = 9;  // + (tile & 1): a KV tile loaded by the PV warps has landed
constexpr int BAR_SCORE_MMA_DONE =
    11;  // the score warps issued S(t+1)'s MMAs: PV(t) may issue its own

struct Shape {
  static constexpr int KEY_HALVES = 2;  // score warps per row group, 8 of a tile's keys each
  static constexpr int SCORE_WARPS = ROW_GROUPS * KEY_HALVES;
  static constexpr int SCORE_THREADS = SCORE_WARPS * 32;
  static constexpr int PV_WARPS = SCORE_WARPS;
  static constexpr int PV_THREADS = PV_WARPS * 32;
  static constexpr int NUM_THREADS = SCORE_THREADS + PV_THREADS;
  static constexpr int NUM_STAGES = 5;
  static constexpr int Q_STAGE = NUM_STAGES - 2;  // Q is staged in the last two stages
  static constexpr int V_COLS_PER_WARP = D_V / PV_WARPS;
  static constexpr int O_N_TILES = V_COLS_PER_WARP / 8;
  // The score pairs' exchange area: tile maxima, row sums and the per-half
  // references (1,056 bytes used; ScoreTilesKeySplit checks what it lays
  // there). 2,048 bytes, a float4 per lane per score warp, is the layout the
  // kernel's figures were measured with: a smaller area moves P, alpha and
  // the page ring.
  static constexpr int EXCHANGE_BYTES = SCORE_WARPS * 32 * 16;

  static constexpr int SMEM_KV_OFFSET = 0;
  static constexpr int SMEM_EXCHANGE_OFFSET = SMEM_KV_OFFSET + NUM_STAGES * STAGE_BYTES;
  static constexpr int SMEM_P_OFFSET = SMEM_EXCHANGE_OFFSET + EXCHANGE_BYTES;  // [2] P buffers
  static constexpr int SMEM_ALPHA_OFFSET =
      SMEM_P_OFFSET + 2 * P_BUFFER_BYTES;  // [2][BLOCK_M] float
  static constexpr int SMEM_INV_L_OFFSET = SMEM_ALPHA_OFFSET + 2 * BLOCK_M * 4;  // [BLOCK_M] float
  static constexpr int SMEM_PAGE_RING_OFFSET = SMEM_INV_L_OFFSET + BLOCK_M * 4;
  static constexpr int SMEM_BYTES = SMEM_PAGE_RING_OFFSET + PAGE_RING * BLOCK_N * 4;

  static_assert(SCORE_THREADS >= LOADER_THREADS && PV_THREADS >= LOADER_THREADS &&
                    LOADER_THREADS == BLOCK_N * LOADER_THREADS_PER_ROW && ROW_CHUNKS % 8 == 0,
                "loaders: 128 threads of each role cover a tile's 16 rows, 8 threads per row "
                "(one swizzle group)");
  static_assert((BLOCK_M * LOADER_THREADS_PER_ROW) % SCORE_THREADS == 0,
                "the score warps stage Q's 32 rows in whole passes");
  static_assert(2 * STAGE_BYTES >= Q_TILE_BYTES, "Q is staged in the last two KV stages");
  static_assert(NUM_STAGES >= 4 && NUM_STAGES <= 5,
                "two tiles in use (score t+1, PV t) plus two or three loading; the score "
                "warps' prologue wait (a switch over pending groups) covers up to five");
  static_assert(O_N_TILES % 2 == 0 && O_N_TILES <= 16,
                "ldmatrix.x4.trans loads two n8 tiles of V at a time; at most two groups of "
                "four pairs (the offsets trick)");
  static_assert(PAGE_AHEAD >= NUM_STAGES - 2 && PAGE_RING > PAGE_AHEAD,
                "a page id is fetched in the group of an earlier step that the PV warps' "
                "wait_group has already completed when its tile is loaded");
  // + the static segment list and plan table of ForEachSegment (verify_kernel.cuh).
  static_assert(SMEM_BYTES + kVerifyStaticSharedBytes <= SM120_MAX_SMEM_PER_BLOCK,
                "over the sm_120 shared-memory limit");
};
static_assert(BLOCK_N == 16 && Shape::KEY_HALVES * 8 == BLOCK_N,
              "a score pair holds the tile's two n8 key halves; P is one k16 step of PV");
static_assert(Shape::NUM_THREADS <= 384, "one CTA per SM at > 168 registers per thread");
}  // namespace pipelined

static_assert(pipelined::Fp8SlotsFollowTheBase(), "the fp8 slots' offsets from the thread's base");

}  // namespace mlaverify::kernels::verify

#endif  // MLAVERIFY_KERNELS_VERIFY_CONFIG_CUH_
