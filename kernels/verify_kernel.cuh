// Device code of the verify attention: the plan kernel (work list from
// device-resident lengths), the split-KV attention kernel, and the combine
// kernel that merges split partials by log-sum-exp. Included by exactly one
// translation unit (verify_attention.cu).
#ifndef MLAVERIFY_KERNELS_VERIFY_KERNEL_CUH_
#define MLAVERIFY_KERNELS_VERIFY_KERNEL_CUH_

#include <cuda_bf16.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/ptx.cuh"
#include "kernels/verify_config.cuh"
#include "kernels/verify_params.h"

namespace mlaverify::kernels::verify {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr int PLAN_THREADS = 1024;  // one thread per request: batch <= 1024
static_assert(BLOCK_M == kVerifyRowsPerCta, "the host sizes partial buffers with kVerifyRowsPerCta");

__device__ __forceinline__ int CeilDiv(int a, int b) { return (a + b - 1) / b; }

// "No split": larger than any request's tile count (positions are int32).
constexpr int NO_SPLIT_CHUNK_TILES = (1 << 30) / BLOCK_N;

// First KV tile of split `split` when `tiles` tiles spread evenly over
// `splits` splits (every split gets floor or ceil of tiles / splits, >= 1).
__device__ __forceinline__ int SplitFirstTile(int split, int tiles, int splits) {
  return static_cast<int>(static_cast<long long>(split) * tiles / splits);
}

// ---------------------------------------------------------------------------
// Plan. Picks one chunk length c (in BLOCK_N tiles) for the launch so that the
// number of work items stays within target_ctas: with T = target_ctas and
// R = total row tiles,
//   items = sum_b row_tiles_b * ceil(tiles_b / c) <= cost / c + R <= T
// for c = ceil(cost / (T - R)) (the "safe" chunk); c = ceil(cost / T) is
// used instead when its item count happens to fit T (it fills every CTA). When
// R >= T the device is full without splitting and no request is split. Each
// request then spreads its tiles evenly over its ceil(tiles_b / c) splits
// (each gets at most c tiles, the item count is unchanged), so that no CTA
// carries a long chunk while its siblings carry a stub.
// Two implementations of the same arithmetic (the helpers below): PlanKernel,
// one CTA of one thread per request, writes the whole work list; for batch
// <= kPlanInWarpMaxBatch the attention kernels plan in their first warp
// instead (PlanInWarp, no plan launch: bench/NOTES.md v6).
// ---------------------------------------------------------------------------
static_assert(kPlanInWarpMaxBatch == 32, "PlanInWarp: one lane per request");

struct RequestShape {
  int n = 0, kv_len = 0, row_tiles = 0, tiles = 0;
};

__device__ __forceinline__ RequestShape ShapeOfRequest(const VerifyParams& p, int b) {
  RequestShape r;
  if (b < p.batch) {
    r.n = p.draft_len[b];
    r.kv_len = p.prefix_len[b] + r.n;
    r.row_tiles = CeilDiv(r.n * p.num_heads, BLOCK_M);
    r.tiles = r.n > 0 ? CeilDiv(r.kv_len, BLOCK_N) : 0;
  }
  return r;
}

// The tight and safe chunk lengths (tiles) for the launch's totals.
__device__ __forceinline__ void ChunkCandidates(const VerifyParams& p, long long total_cost,
                                                long long total_row_tiles, int* tight, int* safe) {
  auto clamp = [&](long long c) {
    c = c < p.min_chunk_tiles ? p.min_chunk_tiles : c;
    return static_cast<int>(c < NO_SPLIT_CHUNK_TILES ? c : NO_SPLIT_CHUNK_TILES);
  };
  *safe = NO_SPLIT_CHUNK_TILES;
  *tight = NO_SPLIT_CHUNK_TILES;
  if (total_row_tiles < p.target_ctas) {
    const long long spare = p.target_ctas - total_row_tiles;
    *safe = clamp((total_cost + spare - 1) / spare);
    *tight = clamp((total_cost + p.target_ctas - 1) / p.target_ctas);
  }
}

__device__ __forceinline__ long long ItemsOfRequest(const RequestShape& r, int chunk_tiles) {
  return r.tiles > 0 ? static_cast<long long>(r.row_tiles) * CeilDiv(r.tiles, chunk_tiles) : 0;
}

// Item `local` of a request (row tiles of one chunk are adjacent work items:
// their KV re-reads hit L2).
__device__ __forceinline__ VerifyWorkItem MakeWorkItem(int request, int local, int row_tiles,
                                                       int kv_len, int chunk_tiles) {
  const int tiles = CeilDiv(kv_len, BLOCK_N);
  const int splits = CeilDiv(tiles, chunk_tiles);
  const int split = local / row_tiles;
  VerifyWorkItem item{-1, 0, 0, 0, 0, {0, 0, 0}};
  item.request = request;
  item.row_tile = local % row_tiles;
  item.split = split;
  item.kv_begin = SplitFirstTile(split, tiles, splits) * BLOCK_N;
  item.kv_end = min(kv_len, SplitFirstTile(split + 1, tiles, splits) * BLOCK_N);
  return item;
}

__global__ void __launch_bounds__(PLAN_THREADS) PlanKernel(const VerifyParams p) {
  using IntScan = cub::BlockScan<int, PLAN_THREADS>;
  using CostReduce = cub::BlockReduce<long long, PLAN_THREADS>;
  __shared__ union {
    typename IntScan::TempStorage scan;
    typename CostReduce::TempStorage reduce;
  } temp;
  __shared__ int s_work_base[PLAN_THREADS];
  __shared__ int s_kv_len[PLAN_THREADS];
  __shared__ int s_row_tiles[PLAN_THREADS];
  __shared__ int s_chunk_tiles;

  // The attention grid may start launching now; it waits for this grid.
  ptx::GridDependencyLaunchDependents();

  const int b = threadIdx.x;
  const RequestShape req = ShapeOfRequest(p, b);
  int q_row = 0;
  IntScan(temp.scan).ExclusiveSum(req.n, q_row);
  __syncthreads();
  const long long total_cost =
      CostReduce(temp.reduce).Sum(static_cast<long long>(req.row_tiles) * req.tiles);
  __syncthreads();
  const long long total_row_tiles = CostReduce(temp.reduce).Sum(static_cast<long long>(req.row_tiles));
  // Two candidates: the tight chunk fills all T CTAs when the rounding of the
  // per-request splits allows it; the safe one always fits.
  __shared__ int s_tight_chunk;
  __shared__ int s_safe_chunk;
  if (b == 0) ChunkCandidates(p, total_cost, total_row_tiles, &s_tight_chunk, &s_safe_chunk);
  __syncthreads();
  const long long tight_items = CostReduce(temp.reduce).Sum(ItemsOfRequest(req, s_tight_chunk));
  if (b == 0) s_chunk_tiles = tight_items <= p.target_ctas ? s_tight_chunk : s_safe_chunk;
  __syncthreads();
  const int chunk_tiles = s_chunk_tiles;
  const int splits = req.tiles > 0 ? CeilDiv(req.tiles, chunk_tiles) : 0;
  int work_base = 0, total_work = 0;
  IntScan(temp.scan).ExclusiveSum(req.row_tiles * splits, work_base, total_work);
  s_work_base[b] = work_base;
  s_kv_len[b] = req.kv_len;
  s_row_tiles[b] = req.row_tiles;
  if (b < p.batch) {
    p.request_q_row[b] = q_row;
    p.request_splits[b] = splits;
    p.request_row_tiles[b] = req.row_tiles;
    p.request_work_base[b] = work_base;
  }
  if (b == 0) *p.total_work = total_work;
  __syncthreads();

  for (int w = threadIdx.x; w < p.max_work; w += PLAN_THREADS) {
    VerifyWorkItem item{-1, 0, 0, 0, 0, {0, 0, 0}};
    if (w < total_work) {
      // The request holding item w: the last one whose base is <= w (requests
      // with no items share their successor's base and are skipped by this).
      int lo = 0, hi = p.batch - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s_work_base[mid] <= w) lo = mid; else hi = mid - 1;
      }
      item = MakeWorkItem(lo, w - s_work_base[lo], s_row_tiles[lo], s_kv_len[lo], chunk_tiles);
    }
    p.work[w] = item;
  }
}

// What an attention CTA needs from the plan.
struct PlannedWork {
  VerifyWorkItem item;  // request -1: no work for this CTA
  int q_row;            // first token row of the request in q
  int splits;           // KV chunks of the request's row tiles
};

// The plan for batch <= kPlanInWarpMaxBatch, computed by one whole warp
// (lane b: request b) with the same arithmetic as PlanKernel. Returns work
// item `w`; writes it to p.work[w] for the combine, and the CTA given
// `writer` writes the per-request arrays and the item count.
__device__ __forceinline__ PlannedWork PlanInWarp(const VerifyParams& p, int w, bool writer) {
  const unsigned all = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const RequestShape req = ShapeOfRequest(p, lane);
  auto sum_ll = [&](long long v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(all, v, o);
    return v;
  };
  auto inclusive_scan = [&](int v) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(all, v, o);
      if (lane >= o) v += y;
    }
    return v;
  };
  const int q_row = inclusive_scan(req.n) - req.n;
  const long long total_cost = sum_ll(static_cast<long long>(req.row_tiles) * req.tiles);
  const long long total_row_tiles = sum_ll(req.row_tiles);
  int tight = 0, safe = 0;
  ChunkCandidates(p, total_cost, total_row_tiles, &tight, &safe);
  const long long tight_items = sum_ll(ItemsOfRequest(req, tight));
  const int chunk_tiles = tight_items <= p.target_ctas ? tight : safe;
  const int splits = req.tiles > 0 ? CeilDiv(req.tiles, chunk_tiles) : 0;
  const int items = req.row_tiles * splits;
  const int items_through = inclusive_scan(items);
  const int work_base = items_through - items;
  const int total_work = __shfl_sync(all, items_through, 31);
  if (writer && lane < p.batch) {
    p.request_q_row[lane] = q_row;
    p.request_splits[lane] = splits;
    p.request_row_tiles[lane] = req.row_tiles;
    p.request_work_base[lane] = work_base;
  }
  if (writer && lane == 0) *p.total_work = total_work;
  PlannedWork out{{-1, 0, 0, 0, 0, {0, 0, 0}}, 0, 0};
  if (w < total_work) {
    // The request holding item w: the last lane (request) whose base is <= w.
    const unsigned at_or_below = __ballot_sync(all, lane < p.batch && work_base <= w);
    const int r = 31 - __clz(at_or_below);
    const int r_base = __shfl_sync(all, work_base, r);
    out.item = MakeWorkItem(r, w - r_base, __shfl_sync(all, req.row_tiles, r),
                            __shfl_sync(all, req.kv_len, r), chunk_tiles);
    out.q_row = __shfl_sync(all, q_row, r);
    out.splits = __shfl_sync(all, splits, r);
  }
  if (lane == 0) p.work[w] = out.item;
  return out;
}

// The work of this CTA: from PlanKernel's list, or planned here (first warp;
// p.plan_in_warp) and handed to the others through shared memory. Every
// thread of the block must call it.
__device__ __forceinline__ PlannedWork FetchWorkItem(const VerifyParams& p) {
  __shared__ PlannedWork s_planned;
  ptx::GridDependencyWait();  // the plan kernel's work list (or the writes of the grid before)
  if (p.plan_in_warp) {  // batch <= kPlanInWarpMaxBatch (the host checks)
    if (threadIdx.x < 32) {
      const PlannedWork planned = PlanInWarp(p, blockIdx.x, blockIdx.x == 0);
      if (threadIdx.x == 0) s_planned = planned;
    }
    __syncthreads();
    return s_planned;
  }
  PlannedWork planned{{-1, 0, 0, 0, 0, {0, 0, 0}}, 0, 0};
  if (static_cast<int>(blockIdx.x) < *p.total_work) {
    planned.item = p.work[blockIdx.x];
    planned.q_row = p.request_q_row[planned.item.request];
    planned.splits = p.request_splits[planned.item.request];
  }
  return planned;
}

// ---------------------------------------------------------------------------
// Attention: one CTA per work item, WarpLayout<kWarps>::NUM_THREADS threads.
// ---------------------------------------------------------------------------
struct AttentionSmem {
  uint8_t* base;
  __device__ uint32_t KvStage(int stage) const {
    return ptx::SmemAddress(base + SMEM_KV_OFFSET + stage * KV_STAGE_BYTES);
  }
  __device__ float* Scores() const { return reinterpret_cast<float*>(base + SMEM_SCORE_OFFSET); }
  __device__ __nv_bfloat16* Probs() const {
    return reinterpret_cast<__nv_bfloat16*>(base + SMEM_P_OFFSET);
  }
  __device__ float* Alpha() const { return reinterpret_cast<float*>(base + SMEM_ALPHA_OFFSET); }
  __device__ float* InvL() const { return reinterpret_cast<float*>(base + SMEM_INV_L_OFFSET); }
};

// Byte offset of 16-byte chunk `chunk` of latent row `row` in a swizzled tile.
__device__ __forceinline__ uint32_t TileOffset(int row, int chunk) {
  return static_cast<uint32_t>(row * ROW_BYTES + SwizzledChunk(row, chunk) * 16);
}

// ---- Pieces both attention variants share ----

// Issues the cp.async of query row `row` of the CTA's tile (request row `r`:
// draft token r / heads, head r % heads) into a swizzled tile at `tile`, chunks
// ld_lane + 8k; a row past the request's end is zero-filled.
__device__ __forceinline__ void StageQueryRow(const VerifyParams& p, uint32_t tile, int row, int r,
                                              int ld_lane, int rows, int q_row, int heads) {
  const bool valid = r < rows;
  const uint16_t* src = valid ? p.q + static_cast<int64_t>(q_row + r / heads) * p.q_token_stride +
                                    static_cast<int64_t>(r % heads) * p.q_head_stride
                              : p.q;
#pragma unroll
  for (int k = 0; k < ROW_CHUNKS / 8; ++k) {
    const int chunk = ld_lane + 8 * k;
    ptx::CpAsync16(tile + TileOffset(row, chunk), valid ? src + chunk * 8 : p.q, valid);
  }
}

// Row `row` of the tile (request row `r`) after its last KV tile: 1 / l into
// `inv_l` for the output stores, and the LSE (natural log) to the output for
// an unsplit row tile or to this CTA's partial slot. `row_max` is log2-domain.
__device__ __forceinline__ void StoreRowStats(const VerifyParams& p, int splits, int row, int r,
                                              int rows, int q_row, int heads, float row_max,
                                              float row_sum, float* inv_l) {
  inv_l[row] = row_sum > 0.0f ? 1.0f / row_sum : 0.0f;
  const float lse = row_sum > 0.0f ? (row_max + __log2f(row_sum)) * LN2 : -INFINITY;
  if (splits == 1) {
    if (r < rows) p.lse[static_cast<int64_t>(q_row + r / heads) * heads + r % heads] = lse;
  } else {
    p.partial_lse[blockIdx.x * BLOCK_M + row] = lse;
  }
}

// A warp's slice of O (columns col0 + n*8 + {0,1}, rows of the mma fragment
// layout) times 1 / l: bf16 to the output for an unsplit row tile, fp32 to
// this CTA's partial slot otherwise. Rows past the request's end are skipped.
template <int kNTiles>
__device__ __forceinline__ void StoreOutputSlice(const VerifyParams& p,
                                                 const float (&o_acc)[M_TILES][kNTiles][4],
                                                 const float* inv_l, int row_tile, int rows,
                                                 int q_row, int heads, int splits, int col0, int g) {
#pragma unroll
  for (int m = 0; m < M_TILES; ++m) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m * 16 + g + half * 8;
      const int r = row_tile * BLOCK_M + row;
      if (r >= rows) continue;
      const float inv = inv_l[row];
      if (splits == 1) {
        uint16_t* dst = p.out + static_cast<int64_t>(q_row + r / heads) * p.out_token_stride +
                        static_cast<int64_t>(r % heads) * p.out_head_stride + col0;
#pragma unroll
        for (int n = 0; n < kNTiles; ++n) {
          *reinterpret_cast<uint32_t*>(dst + n * 8) =
              ptx::PackBf16x2(o_acc[m][n][2 * half] * inv, o_acc[m][n][2 * half + 1] * inv);
        }
      } else {
        float* dst = p.partial_out + (static_cast<int64_t>(blockIdx.x) * BLOCK_M + row) * D_V + col0;
#pragma unroll
        for (int n = 0; n < kNTiles; ++n) {
          *reinterpret_cast<float2*>(dst + n * 8) =
              make_float2(o_acc[m][n][2 * half] * inv, o_acc[m][n][2 * half + 1] * inv);
        }
      }
    }
  }
}

template <int kWarps>
__global__ void __launch_bounds__(WarpLayout<kWarps>::NUM_THREADS, 1)
    AttentionKernel(const VerifyParams p) {
  using Layout = WarpLayout<kWarps>;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const AttentionSmem smem{smem_raw};

  const PlannedWork planned = FetchWorkItem(p);
  const VerifyWorkItem item = planned.item;
  if (item.request < 0) return;
  ptx::GridDependencyLaunchDependents();

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int b = item.request;
  const int heads = p.num_heads;
  const int n_draft = p.draft_len[b];
  const int prefix = p.prefix_len[b];
  const int rows = n_draft * heads;
  const int q_row = planned.q_row;
  const int splits = planned.splits;
  const int kv_begin = item.kv_begin;
  const int kv_end = item.kv_end;
  const int num_tiles = CeilDiv(kv_end - kv_begin, BLOCK_N);
  const float scale = p.softmax_scale != nullptr ? p.softmax_scale[b] : p.default_softmax_scale;
  const float scale_log2 = scale * LOG2E;

  // ---- loader role (threads < ROLE_THREADS): one row of each 32-row tile,
  // chunks ld_lane + 8k ----
  const bool has_role = tid < ROLE_THREADS;
  const int ld_row = (tid >> 3) & (BLOCK_N - 1);
  const int ld_lane = tid & 7;
  const int32_t* pages = p.page_table + b * p.page_table_stride;
  const int page_mask = (1 << p.page_size_log2) - 1;
  const uint16_t* layer_base =
      p.pool + static_cast<int64_t>(p.layer[b]) * p.num_pages * (int64_t{D_QK} << p.page_size_log2);
  auto load_page = [&](int tile) -> int {
    const int j = kv_begin + tile * BLOCK_N + ld_row;
    return has_role && j < kv_end ? pages[j >> p.page_size_log2] : 0;
  };
  auto issue_kv_tile = [&](int tile, int page, int stage) {
    if (!has_role) return;
    const int j = kv_begin + tile * BLOCK_N + ld_row;
    const bool valid = j < kv_end;
    const uint16_t* src =
        layer_base + ((static_cast<int64_t>(page) << p.page_size_log2) + (j & page_mask)) * D_QK;
    const uint32_t dst = smem.KvStage(stage);
#pragma unroll
    for (int k = 0; k < ROW_CHUNKS / 8; ++k) {
      const int chunk = ld_lane + 8 * k;
      ptx::CpAsync16(dst + TileOffset(ld_row, chunk), valid ? src + chunk * 8 : p.pool, valid);
    }
  };

  // ---- prologue: Q tile into stage 1, KV tile 0 into stage 0 ----
  if (has_role) {
    StageQueryRow(p, smem.KvStage(1), ld_row, item.row_tile * BLOCK_M + ld_row, ld_lane, rows,
                  q_row, heads);
  }
  ptx::CpAsyncCommit();
  issue_kv_tile(0, load_page(0), 0);
  ptx::CpAsyncCommit();
  int next_page = num_tiles > 1 ? load_page(1) : 0;

  // ---- softmax role: thread owns query row sm_row (== ld_row), columns sm_col..+3 ----
  const int sm_row = ld_row;
  const int sm_col = ld_lane * 4;
  const int sm_r = item.row_tile * BLOCK_M + sm_row;
  const bool sm_row_valid = has_role && sm_r < rows;
  const uint64_t visible_drafts = sm_row_valid ? p.visibility[q_row + sm_r / heads] : 0;
  float row_max = -INFINITY;  // running max of scores, log2 domain
  float row_sum = 0.0f;       // running sum of 2^(s - row_max)

  // ---- Q fragments: warp (row_group, k_group) keeps Q[16 rows, 144 dims];
  // warps of different n_groups hold the same Q and score other tokens ----
  const int k_group = warp % K_GROUPS;
  const int row_group = (warp / K_GROUPS) % ROW_GROUPS;
  const int n_group = warp / (K_GROUPS * ROW_GROUPS);
  const int token_base = n_group * Layout::TOKENS_PER_N_GROUP;
  uint32_t q_frag[K_STEPS_PER_GROUP][4];
  ptx::CpAsyncWait<0>();
  __syncthreads();
  {
    const uint32_t q_tile = smem.KvStage(1);
    const int row = row_group * 16 + (lane & 15);
#pragma unroll
    for (int s = 0; s < K_STEPS_PER_GROUP; ++s) {
      const int chunk = (k_group * K_PER_GROUP + s * 16) / 8 + (lane >> 4);
      ptx::LdMatrixX4(q_frag[s], q_tile + TileOffset(row, chunk));
    }
  }

  float o_acc[M_TILES][Layout::O_N_TILES][4];
#pragma unroll
  for (int m = 0; m < M_TILES; ++m)
#pragma unroll
    for (int n = 0; n < Layout::O_N_TILES; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o_acc[m][n][e] = 0.0f;

  float* scores = smem.Scores();
  __nv_bfloat16* probs = smem.Probs();
  float* alpha_s = smem.Alpha();
  const int g = lane >> 2;  // mma fragment row
  const int t4 = lane & 3;  // mma fragment column pair

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = tile & 1;
    ptx::CpAsyncWait<0>();
    __syncthreads();  // tile ready; everyone is done with the other stage and with Q staging
    if (tile + 1 < num_tiles) {
      issue_kv_tile(tile + 1, next_page, stage ^ 1);
      if (tile + 2 < num_tiles) next_page = load_page(tile + 2);
    }
    ptx::CpAsyncCommit();
    const uint32_t kv = smem.KvStage(stage);

    // ---- partial scores over this warp's 144 dimensions and token group ----
    float s_acc[Layout::S_N_TILES][4];
#pragma unroll
    for (int n = 0; n < Layout::S_N_TILES; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s_acc[n][e] = 0.0f;
#pragma unroll
    for (int s = 0; s < K_STEPS_PER_GROUP; ++s) {
      const int chunk = (k_group * K_PER_GROUP + s * 16) / 8 + ((lane >> 3) & 1);
#pragma unroll
      for (int np = 0; np < Layout::S_N_TILES / 2; ++np) {
        const int token = token_base + np * 16 + (lane & 7) + ((lane >> 4) << 3);
        uint32_t kf[4];
        ptx::LdMatrixX4(kf, kv + TileOffset(token, chunk));
        ptx::MmaBf16(s_acc[2 * np], q_frag[s], kf[0], kf[1]);
        ptx::MmaBf16(s_acc[2 * np + 1], q_frag[s], kf[2], kf[3]);
      }
    }
    {
      float* part = scores + (k_group * BLOCK_M + row_group * 16) * SCORE_PITCH + token_base;
#pragma unroll
      for (int n = 0; n < Layout::S_N_TILES; ++n) {
        *reinterpret_cast<float2*>(part + g * SCORE_PITCH + n * 8 + 2 * t4) =
            make_float2(s_acc[n][0], s_acc[n][1]);
        *reinterpret_cast<float2*>(part + (g + 8) * SCORE_PITCH + n * 8 + 2 * t4) =
            make_float2(s_acc[n][2], s_acc[n][3]);
      }
    }
    __syncthreads();

    // ---- online softmax over the tile: 8 threads per row (first 256 threads) ----
    if (has_role) {
      float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int kg = 0; kg < K_GROUPS; ++kg) {
        const float4 v =
            *reinterpret_cast<const float4*>(scores + (kg * BLOCK_M + sm_row) * SCORE_PITCH + sm_col);
        s[0] += v.x;
        s[1] += v.y;
        s[2] += v.z;
        s[3] += v.w;
      }
      const int j0 = kv_begin + tile * BLOCK_N + sm_col;
      float tile_max = -INFINITY;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = j0 + e;
        // Prefix keys need no mask; draft keys use the tree's visibility word.
        const bool visible = sm_row_valid && j < kv_end &&
                             (j < prefix || ((visible_drafts >> (j - prefix)) & 1u) != 0);
        s[e] = visible ? s[e] * scale_log2 : -INFINITY;
        tile_max = fmaxf(tile_max, s[e]);
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 4));
      const float new_max = fmaxf(row_max, tile_max);
      // A row that has seen no visible key yet keeps max -inf: use 0 as the
      // reference so that exp2(-inf - ref) is 0 rather than NaN.
      const float ref = new_max == -INFINITY ? 0.0f : new_max;
      const float alpha = exp2f(row_max - ref);
      float pr[4];
      float tile_sum = 0.0f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        pr[e] = exp2f(s[e] - ref);
        tile_sum += pr[e];
      }
      tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);
      tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 2);
      tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 4);
      row_sum = row_sum * alpha + tile_sum;
      row_max = new_max;
      uint2 packed;
      packed.x = ptx::PackBf16x2(pr[0], pr[1]);
      packed.y = ptx::PackBf16x2(pr[2], pr[3]);
      *reinterpret_cast<uint2*>(probs + sm_row * P_PITCH + sm_col) = packed;
      if (ld_lane == 0) alpha_s[sm_row] = alpha;
    }
    __syncthreads();

    // ---- O[:, cols of this warp] = alpha * O + P V ----
    {
#pragma unroll
      for (int m = 0; m < M_TILES; ++m) {
        const float a_lo = alpha_s[m * 16 + g];
        const float a_hi = alpha_s[m * 16 + g + 8];
#pragma unroll
        for (int n = 0; n < Layout::O_N_TILES; ++n) {
          o_acc[m][n][0] *= a_lo;
          o_acc[m][n][1] *= a_lo;
          o_acc[m][n][2] *= a_hi;
          o_acc[m][n][3] *= a_hi;
        }
      }
      const uint32_t probs_addr = ptx::SmemAddress(probs);
#pragma unroll
      for (int ks = 0; ks < BLOCK_N / 16; ++ks) {
        uint32_t p_frag[M_TILES][4];
#pragma unroll
        for (int m = 0; m < M_TILES; ++m) {
          const int row = m * 16 + (lane & 15);
          const int col = ks * 16 + ((lane >> 4) << 3);
          ptx::LdMatrixX4(p_frag[m], probs_addr + (row * P_PITCH + col) * 2);
        }
        const int token = ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
        for (int np = 0; np < Layout::O_N_TILES / 2; ++np) {
          const int chunk = warp * (Layout::V_COLS_PER_WARP / 8) + np * 2 + (lane >> 4);
          uint32_t vf[4];
          ptx::LdMatrixX4Trans(vf, kv + TileOffset(token, chunk));
#pragma unroll
          for (int m = 0; m < M_TILES; ++m) {
            ptx::MmaBf16(o_acc[m][2 * np], p_frag[m], vf[0], vf[1]);
            ptx::MmaBf16(o_acc[m][2 * np + 1], p_frag[m], vf[2], vf[3]);
          }
        }
      }
    }
  }

  // ---- epilogue ----
  float* inv_l = smem.InvL();
  if (has_role && ld_lane == 0) {
    StoreRowStats(p, splits, sm_row, sm_r, rows, q_row, heads, row_max, row_sum, inv_l);
  }
  __syncthreads();
  StoreOutputSlice(p, o_acc, inv_l, item.row_tile, rows, q_row, heads, splits,
                   warp * Layout::V_COLS_PER_WARP + 2 * t4, g);
}

// ---------------------------------------------------------------------------
// Combine: the CTAs of a split row tile share its 32 rows (CTA of split s takes
// rows s, s + splits, ...) and merge that row's partials:
//   lse = log sum_s exp(lse_s),  o = sum_s exp(lse_s - lse) * o_s.
// The eight warps of a CTA take the splits round robin (warp w: splits w,
// w + 8, ...), each lane 16 of the 512 columns as four float4, and keep an
// online (max, sum, o) per warp; the warps' results are merged through
// shared memory. All of a warp's loads for COMBINE_UNROLL splits go out
// together: at small batch (33 splits per row at B=1, L=4K) the kernel costs
// one or two L2 round trips instead of one per eight splits plus a max pass
// (bench/NOTES.md v6).
// ---------------------------------------------------------------------------
constexpr int COMBINE_THREADS = 256;
constexpr int COMBINE_WARPS = COMBINE_THREADS / 32;
constexpr int COMBINE_UNROLL = 4;  // splits per warp whose partials are in flight at once
static_assert(D_V == 32 * 16, "combine: 16 columns per lane, four float4");
static_assert(D_V == COMBINE_THREADS * 2, "combine merge: two output columns per thread");

__global__ void __launch_bounds__(COMBINE_THREADS) CombineKernel(const VerifyParams p) {
  __shared__ float4 s_acc[COMBINE_WARPS][D_V / 4];
  __shared__ float s_max[COMBINE_WARPS];
  __shared__ float s_sum[COMBINE_WARPS];
  ptx::GridDependencyWait();  // the attention kernel's partials
  if (static_cast<int>(blockIdx.x) >= *p.total_work) return;
  const VerifyWorkItem item = p.work[blockIdx.x];
  const int b = item.request;
  const int splits = p.request_splits[b];
  if (splits == 1 || item.split >= BLOCK_M) return;
  const int rows = p.draft_len[b] * p.num_heads;
  const int row_tiles = p.request_row_tiles[b];
  const int base = p.request_work_base[b];
  const int q_row = p.request_q_row[b];
  const int heads = p.num_heads;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  // Partials of split s of this row tile sit in slot base + s * row_tiles + row_tile.
  const float* lse_of = p.partial_lse + static_cast<int64_t>(base + item.row_tile) * BLOCK_M;
  const float* out_of = p.partial_out + static_cast<int64_t>(base + item.row_tile) * BLOCK_M * D_V;
  const int64_t split_stride = static_cast<int64_t>(row_tiles) * BLOCK_M;
  for (int row = item.split; row < BLOCK_M; row += splits) {
    const int r = item.row_tile * BLOCK_M + row;
    if (r >= rows) break;  // uniform across the block
    // 1. This warp's splits: online max / sum / weighted o. A split that saw
    // no visible key has LSE -inf and weight 0.
    float m = -INFINITY, l = 0.0f;
    float4 acc[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s0 = warp; s0 < splits; s0 += COMBINE_WARPS * COMBINE_UNROLL) {
      float lse_v[COMBINE_UNROLL];
      float4 o_v[COMBINE_UNROLL][4];
#pragma unroll
      for (int u = 0; u < COMBINE_UNROLL; ++u) {
        const int s = s0 + u * COMBINE_WARPS;
        const bool valid = s < splits;
        const float* o = out_of + (s * split_stride + row) * D_V + lane * 4;
        lse_v[u] = valid ? lse_of[s * split_stride + row] : -INFINITY;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          o_v[u][k] = valid ? *reinterpret_cast<const float4*>(o + k * 128) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
      }
#pragma unroll
      for (int u = 0; u < COMBINE_UNROLL; ++u) {
        const float m_new = fmaxf(m, lse_v[u]);
        if (m_new == -INFINITY) continue;  // uniform: lse is the same in every lane
        const float scale = __expf(m - m_new);  // m = -inf: 0
        const float w = __expf(lse_v[u] - m_new);
        l = l * scale + w;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          acc[k].x = acc[k].x * scale + w * o_v[u][k].x;
          acc[k].y = acc[k].y * scale + w * o_v[u][k].y;
          acc[k].z = acc[k].z * scale + w * o_v[u][k].z;
          acc[k].w = acc[k].w * scale + w * o_v[u][k].w;
        }
        m = m_new;
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) s_acc[warp][lane + k * 32] = acc[k];
    if (lane == 0) {
      s_max[warp] = m;
      s_sum[warp] = l;
    }
    __syncthreads();
    // 2. Merge the warps: thread t writes columns 2t, 2t + 1.
    float max_all = s_max[0];
#pragma unroll
    for (int w = 1; w < COMBINE_WARPS; ++w) max_all = fmaxf(max_all, s_max[w]);
    const float ref = max_all == -INFINITY ? 0.0f : max_all;
    float sum = 0.0f;
    float2 o = make_float2(0.0f, 0.0f);
    const int col = threadIdx.x * 2;
#pragma unroll
    for (int w = 0; w < COMBINE_WARPS; ++w) {
      const float e = __expf(s_max[w] - ref);  // a warp with no split or no visible key: 0
      sum += e * s_sum[w];
      const float2 a = reinterpret_cast<const float2*>(&s_acc[w][0])[threadIdx.x];
      o.x += e * a.x;
      o.y += e * a.y;
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int64_t token = q_row + r / heads;
    const int h = r % heads;
    uint16_t* dst = p.out + token * p.out_token_stride + static_cast<int64_t>(h) * p.out_head_stride;
    *reinterpret_cast<uint32_t*>(dst + col) = ptx::PackBf16x2(o.x * inv, o.y * inv);
    if (threadIdx.x == 0) p.lse[token * heads + h] = sum > 0.0f ? ref + __logf(sum) : -INFINITY;
    __syncthreads();  // s_acc, s_max, s_sum are reused by the next row
  }
}

}  // namespace mlaverify::kernels::verify

#endif  // MLAVERIFY_KERNELS_VERIFY_KERNEL_CUH_
