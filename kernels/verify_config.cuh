// Tile shape of the verify attention kernel and the shared-memory budget it
// implies. Every constant that another depends on is checked here, so a
// change that breaks the sm_120 budget (99 KB per block) fails to compile.
#ifndef MLAVERIFY_KERNELS_VERIFY_CONFIG_CUH_
#define MLAVERIFY_KERNELS_VERIFY_CONFIG_CUH_

namespace mlaverify::kernels::verify {

constexpr int D_QK = 576;  // latent row: 512 (kv_lora_rank, also V) + 64 (rope)
constexpr int D_V = 512;

// A CTA owns BLOCK_M query rows ((draft token, head) pairs of one request) and
// walks a chunk of the KV positions BLOCK_N tokens at a time.
constexpr int BLOCK_M = 32;
constexpr int BLOCK_N = 32;
constexpr int NUM_STAGES = 2;  // KV tiles in flight: the tile in use and the next
constexpr int NUM_WARPS = 8;
constexpr int NUM_THREADS = NUM_WARPS * 32;

// Scores S = Q K^T: warp (row_group, k_group) holds Q[16 rows, 144 dims] in
// registers for the whole CTA and computes a partial S[16, BLOCK_N] over its
// 144 dimensions; the four k_groups' partials are summed in shared memory.
constexpr int ROW_GROUPS = BLOCK_M / 16;
constexpr int K_GROUPS = NUM_WARPS / ROW_GROUPS;
constexpr int K_PER_GROUP = D_QK / K_GROUPS;
constexpr int K_STEPS_PER_GROUP = K_PER_GROUP / 16;
constexpr int N_TILES = BLOCK_N / 8;  // n8 tiles of S per warp
// Output O += P V: warp w owns O[BLOCK_M, 64 columns] (one 64-wide latent chunk).
constexpr int V_COLS_PER_WARP = D_V / NUM_WARPS;
constexpr int M_TILES = BLOCK_M / 16;

// Shared memory. Latent rows are 72 chunks of 16 bytes; chunk c of row r sits
// at chunk (c & ~7) | ((c ^ r) & 7) so that the 8 rows an ldmatrix reads hit 8
// different bank groups (row pitch 1152 B is a multiple of 128 B).
constexpr int ROW_CHUNKS = D_QK / 8;
constexpr int ROW_BYTES = D_QK * 2;
constexpr int KV_STAGE_BYTES = BLOCK_N * ROW_BYTES;
constexpr int Q_TILE_BYTES = BLOCK_M * ROW_BYTES;  // staged in KV stage 1 before the loop
constexpr int SCORE_PITCH = BLOCK_N + 8;           // floats; +8 keeps float2 stores conflict-free
constexpr int SCORE_BYTES = K_GROUPS * BLOCK_M * SCORE_PITCH * 4;
constexpr int P_PITCH = BLOCK_N + 8;               // bf16; 80-byte rows: ldmatrix conflict-free
constexpr int P_BYTES = BLOCK_M * P_PITCH * 2;

constexpr int SMEM_KV_OFFSET = 0;
constexpr int SMEM_SCORE_OFFSET = SMEM_KV_OFFSET + NUM_STAGES * KV_STAGE_BYTES;
constexpr int SMEM_P_OFFSET = SMEM_SCORE_OFFSET + SCORE_BYTES;
constexpr int SMEM_ALPHA_OFFSET = SMEM_P_OFFSET + P_BYTES;       // [BLOCK_M] float
constexpr int SMEM_INV_L_OFFSET = SMEM_ALPHA_OFFSET + BLOCK_M * 4;  // [BLOCK_M] float
constexpr int SMEM_BYTES = SMEM_INV_L_OFFSET + BLOCK_M * 4;

constexpr int SM120_MAX_SMEM_PER_BLOCK = 101376;  // 99 KB: the production target's limit

static_assert(D_QK % 64 == 0 && D_V % 64 == 0, "latent split into 64-wide chunks");
static_assert(BLOCK_M % 16 == 0 && BLOCK_N % 16 == 0, "mma.m16n8k16 tiles");
static_assert(NUM_WARPS % ROW_GROUPS == 0, "warps tile rows x k-groups");
static_assert(D_QK % (K_GROUPS * 16) == 0, "each k-group holds whole k16 steps");
static_assert(V_COLS_PER_WARP == 64, "PV assumes one 64-wide chunk per warp");
static_assert(NUM_THREADS == BLOCK_M * 8, "softmax: 8 threads per query row, 4 columns each");
static_assert(BLOCK_N == 32, "softmax: 8 threads x 4 columns cover one KV tile");
static_assert(NUM_THREADS == BLOCK_N * 8 && ROW_CHUNKS % 8 == 0,
              "loader: 8 threads per KV row, 9 chunks each");
static_assert(Q_TILE_BYTES <= KV_STAGE_BYTES, "the Q tile is staged in one KV stage");
static_assert(NUM_STAGES == 2, "the main loop alternates two stages");
static_assert(SMEM_BYTES <= SM120_MAX_SMEM_PER_BLOCK, "over the sm_120 shared-memory limit");

__host__ __device__ constexpr int SwizzledChunk(int row, int chunk) {
  return (chunk & ~7) | ((chunk ^ row) & 7);
}

}  // namespace mlaverify::kernels::verify

#endif  // MLAVERIFY_KERNELS_VERIFY_CONFIG_CUH_
