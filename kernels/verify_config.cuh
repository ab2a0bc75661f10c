// Tile shape of the verify attention kernel and the shared-memory budget it
// implies. Every constant that another depends on is checked here, so a
// change that breaks the sm_120 budget (99 KB per block) fails to compile.
#ifndef MLAVERIFY_KERNELS_VERIFY_CONFIG_CUH_
#define MLAVERIFY_KERNELS_VERIFY_CONFIG_CUH_

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
// Page ids of the KV rows the PV warps will load, fetched with cp.async
// PAGE_AHEAD tiles before their tile is loaded: [PAGE_RING][BLOCK_N] int32.
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

__host__ __device__ constexpr int SwizzledChunk(int row, int chunk) {
  return (chunk & ~7) | ((chunk ^ row) & 7);
}

}  // namespace mlaverify::kernels::verify

#endif  // MLAVERIFY_KERNELS_VERIFY_CONFIG_CUH_
