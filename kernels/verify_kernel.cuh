// Device code of the verify attention around the attention kernel
// (verify_pipelined_kernel.cuh): the plan kernel and the in-warp plan (work
// list from device-resident lengths), the segment loop every attention CTA
// runs, the pieces of the attention kernel's prologue and epilogue, and the
// combine that merges split partials by log-sum-exp (its own kernel, or
// folded into the attention kernel). Included by exactly one translation
// unit (verify_attention.cu).
#ifndef MLAVERIFY_KERNELS_VERIFY_KERNEL_CUH_
#define MLAVERIFY_KERNELS_VERIFY_KERNEL_CUH_

#include <cuda_bf16.h>

#include <climits>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/phase_stamps.h"
#include "kernels/ptx.cuh"
#include "kernels/verify_config.cuh"
#include "kernels/verify_params.h"

namespace mlaverify::kernels::verify {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
constexpr int PLAN_THREADS = 1024;  // one thread per request: batch <= 1024
static_assert(BLOCK_M == kVerifyRowsPerCta,
              "the host sizes partial buffers with kVerifyRowsPerCta");

__device__ __forceinline__ int CeilDiv(int a, int b) { return (a + b - 1) / b; }

// Phase stamps (kernels/phase_stamps.h): the caller picks the one thread that
// stamps. Without MLAVERIFY_PHASE_STAMPS this is empty and generates nothing.
#ifdef MLAVERIFY_PHASE_STAMPS
__device__ unsigned long long* g_phase_stamps = nullptr;  // [ctas][kPhaseSlots], or null: off
__device__ __forceinline__ void PhaseStamp(int slot) {
  unsigned long long* stamps = g_phase_stamps;
  if (stamps == nullptr) return;
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  stamps[blockIdx.x * kPhaseSlots + slot] = now;
  // Two stamps also keep the SM clock's count: the bench divides the cycles
  // by the nanoseconds between them (slot is a constant at every call site).
  if (slot == kStampEntry || slot == kStampPvDone) {
    unsigned long long cycles;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(cycles));
    stamps[blockIdx.x * kPhaseSlots +
           (slot == kStampEntry ? kStampClockEntry : kStampClockPvDone)] = cycles;
  }
}
// Adds a segment's KV tiles to the CTA's count (one thread per CTA calls it).
__device__ __forceinline__ void PhaseCountTiles(int tiles) {
  unsigned long long* stamps = g_phase_stamps;
  if (stamps != nullptr)
    stamps[blockIdx.x * kPhaseSlots + kStampTiles] += static_cast<unsigned>(tiles);
}
// A stamp taken once `value` has arrived (the asm consumes it).
__device__ __forceinline__ void PhaseStampAfter(int slot, int value) {
  asm volatile("" ::"r"(value) : "memory");
  PhaseStamp(slot);
}
#else
__device__ __forceinline__ void PhaseStamp(int) {}
__device__ __forceinline__ void PhaseStampAfter(int, int) {}
__device__ __forceinline__ void PhaseCountTiles(int) {}
#endif

// "No split": larger than any request's tile count (positions are int32).
constexpr int NO_SPLIT_CHUNK_TILES = (1 << 30) / BLOCK_N;

// First KV tile of split `split` when `tiles` tiles spread evenly over
// `splits` splits (every split gets floor or ceil of tiles / splits, >= 1).
__device__ __forceinline__ int SplitFirstTile(int split, int tiles, int splits) {
  return static_cast<int>(static_cast<long long>(split) * tiles / splits);
}

// ---------------------------------------------------------------------------
// Plan. Two ways to spread a launch's work over target_ctas CTAs (T):
//
// The chunk plan picks one chunk length c (in BLOCK_N tiles) so that the
// number of work items stays within T: with R = total row tiles,
//   items = sum_b row_tiles_b * ceil(tiles_b / c) <= cost / c + R <= T
// for c = ceil(cost / (T - R)) (the "safe" chunk); c = ceil(cost / T) is
// used instead when its item count happens to fit T (it fills every CTA). When
// R >= T the device is full without splitting and no request is split. Each
// request then spreads its tiles evenly over its ceil(tiles_b / c) splits
// (each gets at most c tiles, the item count is unchanged), so that no CTA
// carries a long chunk while its siblings carry a stub. One CTA, one item.
//
// The stream plan (stream-K style), for batches whose requests all have the
// same number of row tiles RT: the requests' KV tiles are laid end to end
// (length L) and cut into G = min(T / RT, L / min_chunk) equal ranges; CTA
// g * RT + rt attends row tile rt over range g, which may end inside one
// request and start inside another (then the CTA attends several segments in
// turn). Every row tile of a request has the same chunk boundaries, and the
// RT CTAs of a range run side by side, so their KV reads share L2 as the
// chunk plan's row tiles do. It fills G * RT CTAs with equal work where the
// chunk plan rounds each request up to whole chunks: B=32, L=64K, N=4 is 128
// items of 513 tiles under the chunk plan and 132 ranges of 497 under this
// one (bench/NOTES.md, "The stream plan"). The plan takes it when its longest range is
// shorter than the chunk plan's longest chunk times its waves by at least
// STREAM_MIN_GAIN_TILES.
//
// A split segment writes a partial: the chunk plan's item w to slot w; a
// stream CTA x has at most two split segments (the first and the last of its
// range) and writes them to slots 2x and 2x + 1.
//
// Two implementations of the same arithmetic (the helpers below): PlanKernel,
// one CTA of one thread per request, writes the whole plan; for batch
// <= kPlanInWarpMaxBatch the attention kernel plans in its first warp
// instead (PlanInWarp, no plan launch: bench/NOTES.md, "The plan in-warp").
// kernels/testing/models/plan_model.py mirrors both and checks coverage.
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

// Longest chunk of a request under the chunk plan (its tiles spread evenly).
__device__ __forceinline__ int LongestChunk(const RequestShape& r, int splits) {
  return splits > 0 ? CeilDiv(r.tiles, splits) : 0;
}

// What the plan's choice depends on, reduced over the batch. Row tiles are
// compared over requests with work only (padding requests have none).
// (No member initializers: PlanKernel keeps one in shared memory.)
struct PlanTotals {
  long long length;   // sum of tiles
  int min_row_tiles;  // over requests with tiles > 0 (INT_MAX if none)
  int max_row_tiles;
};

// The stream plan must shorten the longest CTA by this many tiles: a range
// that spans requests restarts the pipeline per segment and holds up to two
// split segments for the combine (B=8·L=16K·N=16·H=8: 125 instead of 129
// tiles measured 3 % slower; bench/NOTES.md, "The stream plan").
constexpr int STREAM_MIN_GAIN_TILES = 5;

// Ranges of the stream plan, or 0 for the chunk plan. chunk_items and
// longest_chunk describe the chunk plan's work list.
__device__ __forceinline__ int StreamGroups(const VerifyParams& p, const PlanTotals& t,
                                            long long chunk_items, int longest_chunk) {
  const int rt = t.max_row_tiles;
  if (!p.stream_plan || t.length == 0 || t.length > INT_MAX || t.min_row_tiles != rt ||
      rt > p.target_ctas) {
    return 0;
  }
  const long long by_chunk = (t.length + p.min_chunk_tiles - 1) / p.min_chunk_tiles;
  long long groups = p.target_ctas / rt;
  groups = groups < by_chunk ? groups : by_chunk;
  const long long stream_longest = (t.length + groups - 1) / groups;
  const long long waves = (chunk_items + p.target_ctas - 1) / p.target_ctas;
  return stream_longest + STREAM_MIN_GAIN_TILES <= waves * longest_chunk ? static_cast<int>(groups)
                                                                         : 0;
}

// First tile of stream range g, and the range holding tile `pos`
// (StreamRangeOf(pos) = g exactly when StreamStart(g) <= pos < StreamStart(g + 1)).
__device__ __forceinline__ int StreamStart(int g, const VerifyPlanSummary& s) {
  return static_cast<int>(static_cast<long long>(g) * s.stream_length / s.stream_groups);
}
__device__ __forceinline__ int StreamRangeOf(int pos, const VerifyPlanSummary& s) {
  return static_cast<int>((static_cast<long long>(pos + 1) * s.stream_groups - 1) /
                          s.stream_length);
}

// Item `local` of a request under the chunk plan (row tiles of one chunk are
// adjacent work items: their KV re-reads hit L2); `w` is its index.
__device__ __forceinline__ VerifyWorkItem MakeWorkItem(int request, int local, int row_tiles,
                                                       int kv_len, int chunk_tiles, int q_row,
                                                       int w) {
  const int tiles = CeilDiv(kv_len, BLOCK_N);
  const int splits = CeilDiv(tiles, chunk_tiles);
  const int split = local / row_tiles;
  VerifyWorkItem item;
  item.request = request;
  item.row_tile = local % row_tiles;
  item.split = split;
  item.kv_begin = SplitFirstTile(split, tiles, splits) * BLOCK_N;
  item.kv_end = min(kv_len, SplitFirstTile(split + 1, tiles, splits) * BLOCK_N);
  item.q_row = q_row;
  item.splits = splits;
  item.partial_slot = splits == 1 ? -1 : w;
  return item;
}

__device__ __forceinline__ VerifyWorkItem NoWork() {
  VerifyWorkItem item;
  item.request = -1;
  item.row_tile = item.split = item.kv_begin = item.kv_end = item.q_row = 0;
  item.splits = 0;
  item.partial_slot = -1;
  return item;
}

struct MinOp {
  __device__ int operator()(int a, int b) const { return min(a, b); }
};
struct MaxOp {
  __device__ int operator()(int a, int b) const { return max(a, b); }
};

__global__ void __launch_bounds__(PLAN_THREADS) PlanKernel(const VerifyParams p) {
  using IntScan = cub::BlockScan<int, PLAN_THREADS>;
  using LongReduce = cub::BlockReduce<long long, PLAN_THREADS>;
  using IntReduce = cub::BlockReduce<int, PLAN_THREADS>;
  __shared__ union {
    typename IntScan::TempStorage scan;
    typename LongReduce::TempStorage reduce;
    typename IntReduce::TempStorage int_reduce;
  } temp;
  __shared__ int s_work_base[PLAN_THREADS];
  __shared__ int s_kv_len[PLAN_THREADS];
  __shared__ int s_row_tiles[PLAN_THREADS];
  __shared__ int s_q_row[PLAN_THREADS];
  __shared__ int s_chunk_tiles;
  __shared__ int s_tight_chunk;
  __shared__ int s_safe_chunk;
  __shared__ int s_longest;
  __shared__ PlanTotals s_totals;

  // The attention grid may start launching now; it waits for this grid.
  ptx::GridDependencyLaunchDependents();

  const int b = threadIdx.x;
  const RequestShape req = ShapeOfRequest(p, b);
  int q_row = 0;
  IntScan(temp.scan).ExclusiveSum(req.n, q_row);
  __syncthreads();
  const long long total_cost =
      LongReduce(temp.reduce).Sum(static_cast<long long>(req.row_tiles) * req.tiles);
  __syncthreads();
  const long long total_row_tiles =
      LongReduce(temp.reduce).Sum(static_cast<long long>(req.row_tiles));
  __syncthreads();
  const long long length = LongReduce(temp.reduce).Sum(static_cast<long long>(req.tiles));
  __syncthreads();
  const int min_rt =
      IntReduce(temp.int_reduce).Reduce(req.tiles > 0 ? req.row_tiles : INT_MAX, MinOp());
  __syncthreads();
  const int max_rt = IntReduce(temp.int_reduce).Reduce(req.tiles > 0 ? req.row_tiles : 0, MaxOp());
  if (b == 0) {
    s_totals.length = length;
    s_totals.min_row_tiles = min_rt;
    s_totals.max_row_tiles = max_rt;
    // Two candidates: the tight chunk fills all T CTAs when the rounding of
    // the per-request splits allows it; the safe one always fits.
    ChunkCandidates(p, total_cost, total_row_tiles, &s_tight_chunk, &s_safe_chunk);
  }
  __syncthreads();
  const long long tight_items = LongReduce(temp.reduce).Sum(ItemsOfRequest(req, s_tight_chunk));
  if (b == 0) s_chunk_tiles = tight_items <= p.target_ctas ? s_tight_chunk : s_safe_chunk;
  __syncthreads();
  const int chunk_tiles = s_chunk_tiles;
  const int splits = req.tiles > 0 ? CeilDiv(req.tiles, chunk_tiles) : 0;
  const int longest = IntReduce(temp.int_reduce).Reduce(LongestChunk(req, splits), MaxOp());
  if (b == 0) s_longest = longest;
  __syncthreads();
  int work_base = 0, total_items = 0;
  IntScan(temp.scan).ExclusiveSum(req.row_tiles * splits, work_base, total_items);
  __syncthreads();
  const int groups = StreamGroups(p, s_totals, total_items, s_longest);
  // Stream positions: only the stream plan reads them (and then length <=
  // INT_MAX: no overflow). groups is the same in every thread.
  int stream_start = 0;
  if (groups > 0) IntScan(temp.scan).ExclusiveSum(req.tiles, stream_start);
  s_work_base[b] = work_base;
  s_kv_len[b] = req.kv_len;
  s_row_tiles[b] = req.row_tiles;
  s_q_row[b] = q_row;
  if (b < p.batch) {
    p.request_q_row[b] = q_row;
    p.request_stream_start[b] = stream_start;
  }
  if (b == 0) {
    VerifyPlanSummary s;
    s.total_work = groups > 0 ? groups * max_rt : total_items;
    s.stream_groups = groups;
    s.stream_row_tiles = groups > 0 ? max_rt : 0;
    s.stream_length = groups > 0 ? static_cast<int>(length) : 0;
    *p.summary = s;
  }
  if (groups > 0) return;  // the stream plan needs no work list
  __syncthreads();

  for (int w = threadIdx.x; w < p.max_work; w += PLAN_THREADS) {
    VerifyWorkItem item = NoWork();
    if (w < total_items) {
      // The request holding item w: the last one whose base is <= w (requests
      // with no items share their successor's base and are skipped by this).
      int lo = 0, hi = p.batch - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s_work_base[mid] <= w)
          lo = mid;
        else
          hi = mid - 1;
      }
      item = MakeWorkItem(lo, w - s_work_base[lo], s_row_tiles[lo], s_kv_len[lo], chunk_tiles,
                          s_q_row[lo], w);
    }
    p.work[w] = item;
  }
}

// The plan for batch <= kPlanInWarpMaxBatch, computed by one whole warp
// (lane b: request b) with the same arithmetic as PlanKernel. The CTA given
// `writer` writes the per-request arrays and the summary for the combine.
struct WarpPlan {
  VerifyPlanSummary summary;  // the same in every lane
  int stream_start;           // lane b: request b's
  int q_row;                  // lane b: request b's
  VerifyWorkItem item;        // chunk plan: item w (also written to p.work[w])
};

__device__ __forceinline__ WarpPlan PlanInWarp(const VerifyParams& p, int w, bool writer) {
  const unsigned all = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const RequestShape req = ShapeOfRequest(p, lane);
  if (lane == 0) PhaseStampAfter(kStampLengths, req.kv_len);
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
  PlanTotals totals;
  totals.length = sum_ll(req.tiles);
  totals.min_row_tiles = __reduce_min_sync(all, req.tiles > 0 ? req.row_tiles : INT_MAX);
  totals.max_row_tiles = __reduce_max_sync(all, req.tiles > 0 ? req.row_tiles : 0);
  if (lane == 0)
    PhaseStampAfter(kStampPlanTotals,
                    static_cast<int>(total_cost + totals.length) + totals.max_row_tiles);
  int tight = 0, safe = 0;
  ChunkCandidates(p, total_cost, total_row_tiles, &tight, &safe);
  const long long tight_items = sum_ll(ItemsOfRequest(req, tight));
  const int chunk_tiles = tight_items <= p.target_ctas ? tight : safe;
  if (lane == 0) PhaseStampAfter(kStampPlanChunk, chunk_tiles);
  const int splits = req.tiles > 0 ? CeilDiv(req.tiles, chunk_tiles) : 0;
  const int longest = __reduce_max_sync(all, LongestChunk(req, splits));
  const int items = req.row_tiles * splits;
  const int items_through = inclusive_scan(items);
  const int work_base = items_through - items;
  const int total_items = __shfl_sync(all, items_through, 31);
  const int groups = StreamGroups(p, totals, total_items, longest);
  if (lane == 0) PhaseStampAfter(kStampPlanItems, groups + total_items);

  WarpPlan out;
  out.summary.total_work = groups > 0 ? groups * totals.max_row_tiles : total_items;
  out.summary.stream_groups = groups;
  out.summary.stream_row_tiles = groups > 0 ? totals.max_row_tiles : 0;
  out.summary.stream_length = groups > 0 ? static_cast<int>(totals.length) : 0;
  // Only the stream plan reads it (and then length <= INT_MAX); groups is
  // the same in every lane.
  out.stream_start = groups > 0 ? inclusive_scan(req.tiles) - req.tiles : 0;
  out.q_row = q_row;
  if (writer && lane < p.batch) {
    p.request_q_row[lane] = q_row;
    p.request_stream_start[lane] = out.stream_start;
  }
  if (writer && lane == 0) *p.summary = out.summary;
  out.item = NoWork();
  if (groups == 0) {
    if (w < total_items) {
      // The request holding item w: the last lane (request) whose base is <= w.
      const unsigned at_or_below = __ballot_sync(all, lane < p.batch && work_base <= w);
      const int r = 31 - __clz(at_or_below);
      out.item =
          MakeWorkItem(r, w - __shfl_sync(all, work_base, r), __shfl_sync(all, req.row_tiles, r),
                       __shfl_sync(all, req.kv_len, r), chunk_tiles, __shfl_sync(all, q_row, r), w);
    }
    if (lane == 0) p.work[w] = out.item;
  }
  if (lane == 0) PhaseStampAfter(kStampPlanItem, out.item.kv_end);
  return out;
}

// ---- Segments of a stream-plan CTA ----

// The first request of the 32-request block from which CTA x's range can
// start: every request before it ends at or before the range does. One warp;
// `stream_start` is the per-request table (global, or shared for the warp plan).
__device__ __forceinline__ int FirstStreamBlock(const VerifyParams& p, const VerifyPlanSummary& s,
                                                const int32_t* stream_start, int x) {
  const int lane = threadIdx.x & 31;
  const int lo = StreamStart(x / s.stream_row_tiles, s);
  const int b = lane * 32;  // batch <= PLAN_THREADS = 32 * 32
  const bool at_or_before = b < p.batch && stream_start[b] <= lo;  // true for lane 0
  return 32 * (31 - __clz(__ballot_sync(0xffffffffu, at_or_before)));
}

// One warp: writes the segments of CTA x among requests b0..b0+31 to
// list[0..count) in request order and returns count; *next is b0 + 32 when a
// later request may still overlap the range, else -1.
__device__ __forceinline__ int CollectStreamSegments(const VerifyParams& p,
                                                     const VerifyPlanSummary& s,
                                                     const int32_t* stream_start,
                                                     const int32_t* q_rows, int x, int b0,
                                                     VerifyWorkItem* list, int* next) {
  const unsigned all = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const int g = x / s.stream_row_tiles;
  const int lo = StreamStart(g, s);
  const int hi = StreamStart(g + 1, s);
  const int b = b0 + lane;
  const RequestShape req = ShapeOfRequest(p, b);
  const int start = b < p.batch ? stream_start[b] : s.stream_length;
  const int end = start + req.tiles;
  const bool overlaps = req.tiles > 0 && start < hi && end > lo;
  VerifyWorkItem item;
  if (overlaps) {
    const int seg_lo = max(start, lo);
    const int seg_hi = min(end, hi);
    const int first = StreamRangeOf(start, s);
    item.request = b;
    item.row_tile = x % s.stream_row_tiles;
    item.split = g - first;
    item.kv_begin = (seg_lo - start) * BLOCK_N;
    item.kv_end = min((seg_hi - start) * BLOCK_N, req.kv_len);
    item.q_row = q_rows[b];
    item.splits = StreamRangeOf(end - 1, s) - first + 1;
    item.partial_slot = item.splits == 1 ? -1 : 2 * x + (seg_lo > lo ? 1 : 0);
  }
  const unsigned mask = __ballot_sync(all, overlaps);
  if (overlaps) list[__popc(mask & ((1u << lane) - 1u))] = item;
  const int last_end = __shfl_sync(all, end, 31);
  *next = b0 + 32 < p.batch && last_end < hi ? b0 + 32 : -1;
  return __popc(mask);
}

// The shared state of ForEachSegment: the kernel declares one and passes it
// to every call site (a __shared__ variable inside the template would be a
// different one per instantiation, i.e. per role's lambda).
struct SegmentSmem {
  VerifyWorkItem list[32];   // segments of this CTA, in order
  int32_t stream_start[32];  // warp plan: request b's first tile in the stream
  int32_t q_row[32];         // warp plan: request b's first token row
  VerifyPlanSummary summary;
  int count, next;  // entries in `list`; first request of the next refill, or -1
};
static_assert(sizeof(SegmentSmem) <= kVerifyStaticSharedBytes,
              "the sm_120 budget in verify_config.cuh counts this");

// One round of a stream-plan CTA's walk: its first warp collects the
// segments among requests b0..b0+31 into sm (list, count, next). The caller
// makes them visible with a block barrier.
__device__ __forceinline__ void CollectStreamRound(const VerifyParams& p,
                                                   const VerifyPlanSummary& s,
                                                   const int32_t* stream_start,
                                                   const int32_t* q_rows, int x, int b0,
                                                   SegmentSmem& sm) {
  if (threadIdx.x >= 32) return;
  int next = -1;
  const int count = CollectStreamSegments(p, s, stream_start, q_rows, x, b0, sm.list, &next);
  if (threadIdx.x == 0) {
    sm.count = count;
    sm.next = next;
  }
}

// Runs attend(item) for every segment of this CTA in order, with a block
// barrier between segments (shared memory is reused). Plans in the first warp
// (p.plan_in_warp) or reads the plan kernel's output. Every thread of the
// block must call it; warps of different roles may call it from different
// sites (its barriers are bar.sync 0 over the whole block).
// after(item), when given, runs in every thread after attend(item) (the
// fused combine's arrival).
struct NoSegmentHook {
  __device__ void operator()(const VerifyWorkItem&) const {}
};
// The Q rows are the last cold read before the first MMA at small batch:
// the score warps issue them after the plan and wait ~2 us for them (phase
// stamps, bench/NOTES.md, "L2 prefetches"). They depend on the lengths only, not on the
// plan: one warp (the second, idle until the plan's barrier) reads the draft
// counts itself, and the grid asks L2 for the batch's sum(N) x H rows of 576
// bf16 (nine 128-byte lines each), CTA x taking lines x*32 + lane, then
// + gridDim.x*32, ... up to kQueryPrefetchRounds rounds (all of them for
// small batches; larger batches have the time to read them cold).
constexpr int kQueryPrefetchRounds = 4;
__device__ __forceinline__ void PrefetchQueryRows(const VerifyParams& p) {
  const int lane = threadIdx.x & 31;
  int n = 0;
  for (int b = lane; b < p.batch; b += 32) n += p.draft_len[b];
  const unsigned tokens = __reduce_add_sync(0xffffffffu, static_cast<unsigned>(n));
  constexpr unsigned LINES_PER_ROW = D_QK * 2 / 128;  // 9
  const unsigned heads = static_cast<unsigned>(p.num_heads);
  const unsigned lines = tokens * heads * LINES_PER_ROW;
  const unsigned step = gridDim.x * 32u;
  unsigned line = blockIdx.x * 32u + lane;
#pragma unroll 1
  for (int round = 0; round < kQueryPrefetchRounds && line < lines; ++round, line += step) {
    const unsigned row = line / LINES_PER_ROW;
    const unsigned token = row / heads;
    const uint16_t* q_row = p.q + static_cast<int64_t>(token) * p.q_token_stride +
                            static_cast<int64_t>(row - token * heads) * p.q_head_stride;
    ptx::PrefetchL2(q_row + (line - row * LINES_PER_ROW) * 64);
  }
}

// kPrefetchQueries: the second warp prefetches the batch's Q rows during the
// warp plan (PrefetchQueryRows). The non-fused instances only: in the fused
// ones it measured B=1 0.6-1.3 us slower. Where it pays: the stream plan's
// segment restarts read a cold Q (B=32, L=64K, page 1: 677 -> 663 us;
// bench/NOTES.md, "L2 prefetches").
template <bool kPrefetchQueries, typename Attend, typename After = NoSegmentHook>
__device__ __forceinline__ void ForEachSegment(const VerifyParams& p, SegmentSmem& sm,
                                               Attend&& attend, After&& after = After{}) {
  const int x = blockIdx.x;
  const bool first_warp = threadIdx.x < 32;
  if (threadIdx.x == 0) PhaseStamp(kStampEntry);
  ptx::GridDependencyWait();  // the plan kernel's output (or the writes of the grid before)
  if (p.plan_in_warp) {       // batch <= kPlanInWarpMaxBatch (the host checks)
    if (first_warp) {
      const WarpPlan plan = PlanInWarp(p, x, x == 0);
      sm.stream_start[threadIdx.x] = plan.stream_start;
      sm.q_row[threadIdx.x] = plan.q_row;
      if (threadIdx.x == 0) {
        sm.summary = plan.summary;
        sm.list[0] = plan.item;
      }
    } else if (kPrefetchQueries && threadIdx.x < 64) {
      PrefetchQueryRows(p);
    }
  } else if (threadIdx.x == 0) {
    sm.summary = *p.summary;
    sm.list[0] = p.work[x];  // read beside the summary; stale (unused) under the stream plan
  }
  ptx::BlockBarrier();
  if (threadIdx.x == 0) PhaseStamp(kStampPlanned);
  const VerifyPlanSummary summary = sm.summary;
  if (x >= summary.total_work) return;
  ptx::GridDependencyLaunchDependents();
  if (summary.stream_groups == 0) {
    attend(sm.list[0]);
    after(sm.list[0]);
    return;
  }
  const int32_t* starts = p.plan_in_warp ? sm.stream_start : p.request_stream_start;
  const int32_t* q_rows = p.plan_in_warp ? sm.q_row : p.request_q_row;
  int b0 = 0;
  if (first_warp && !p.plan_in_warp) b0 = FirstStreamBlock(p, summary, starts, x);
  while (true) {
    CollectStreamRound(p, summary, starts, q_rows, x, b0, sm);
    ptx::BlockBarrier();
    const int count = sm.count;
    b0 = sm.next;
    for (int i = 0; i < count; ++i) {
      attend(sm.list[i]);
      after(sm.list[i]);
      ptx::BlockBarrier();
    }
    // A block of 32 padding requests has no segment: everyone must still have
    // read count and next before the first warp refills them.
    if (count == 0) ptx::BlockBarrier();
    if (b0 < 0) return;
  }
}

// ---------------------------------------------------------------------------
// Pieces of the attention kernel's prologue and epilogue.
// ---------------------------------------------------------------------------
// Byte offset of 16-byte chunk `chunk` of latent row `row` in a swizzled tile.
__device__ __forceinline__ uint32_t TileOffset(int row, int chunk) {
  return static_cast<uint32_t>(row * ROW_BYTES + SwizzledChunk(row, chunk) * 16);
}

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
// an unsplit row tile (partial_slot < 0) or to the segment's partial slot.
// `row_max` is log2-domain.
__device__ __forceinline__ void StoreRowStats(const VerifyParams& p, int partial_slot, int row,
                                              int r, int rows, int q_row, int heads, float row_max,
                                              float row_sum, float* inv_l) {
  inv_l[row] = row_sum > 0.0f ? 1.0f / row_sum : 0.0f;
  const float lse = row_sum > 0.0f ? (row_max + __log2f(row_sum)) * LN2 : -INFINITY;
  if (partial_slot < 0) {
    if (r < rows) p.lse[static_cast<int64_t>(q_row + r / heads) * heads + r % heads] = lse;
  } else {
    p.partial_lse[partial_slot * BLOCK_M + row] = lse;
  }
}

// The attention kernel's epilogue: a PV warp's slice of O (32 rows x kNTiles
// * 8 columns from column col0, mma fragment layout) times 1 / l, in bf16, to
// the output (unsplit row tile, partial_slot < 0) or the partial slot.
// Partials are bf16 (half the workspace of fp32): O / l is a convex
// combination of V rows, so bf16 keeps its range, and the merge adds one more
// bf16 rounding (2^-9 relative) before the output's own (bench/NOTES.md, "bf16 partials").
// 4-byte stores straight from the fragment layout cost ~2 us at B=1, L=4K
// (64 store instructions per thread, each touching eight rows: 2,048 sector
// requests per CTA whether the partial was fp32 or bf16; phase stamps,
// bench/NOTES.md, "bf16 partials"). So the warp first writes its slice to `staging`
// (shared memory no other warp uses: the caller's KV stages after the last
// tile), then stores whole rows with 16-byte stores. A padded pitch (16
// bytes) keeps both the fragment writes and the row reads free of bank
// conflicts. Output rows not 16-byte aligned (the API promises 4) are stored
// four bytes at a time from the same staging.
template <int kNTiles>
__device__ __forceinline__ void StoreOutputSliceStaged(const VerifyParams& p,
                                                       const float (&o_acc)[M_TILES][kNTiles][4],
                                                       const float* inv_l, int row_tile, int rows,
                                                       int q_row, int heads, int partial_slot,
                                                       int col0, uint8_t* staging) {
  constexpr int ROW_BYTES_OUT = kNTiles * 8 * 2;  // bf16 columns of the slice
  constexpr int PITCH = ROW_BYTES_OUT + 16;
  constexpr int LANES_PER_ROW = ROW_BYTES_OUT / 16;
  constexpr int ROWS_PER_STEP = 32 / LANES_PER_ROW;
  static_assert(32 % LANES_PER_ROW == 0 && BLOCK_M % ROWS_PER_STEP == 0,
                "whole rows per store step");
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t4 = lane & 3;
#pragma unroll
  for (int m = 0; m < M_TILES; ++m) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m * 16 + g + half * 8;
      const float inv = inv_l[row];
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) {
        *reinterpret_cast<uint32_t*>(staging + row * PITCH + (n * 8 + 2 * t4) * 2) =
            ptx::PackBf16x2(o_acc[m][n][2 * half] * inv, o_acc[m][n][2 * half + 1] * inv);
      }
    }
  }
  __syncwarp();
  const bool out_aligned =
      ((reinterpret_cast<uintptr_t>(p.out) | static_cast<uintptr_t>(p.out_token_stride * 2) |
        static_cast<uintptr_t>(p.out_head_stride * 2) | static_cast<uintptr_t>(col0 * 2)) &
       15) == 0;
  const int sub_row = lane / LANES_PER_ROW;
  const int chunk = lane % LANES_PER_ROW;
#pragma unroll 4
  for (int row0 = 0; row0 < BLOCK_M; row0 += ROWS_PER_STEP) {
    const int row = row0 + sub_row;
    const int r = row_tile * BLOCK_M + row;
    if (r >= rows) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(staging + row * PITCH + chunk * 16);
    if (partial_slot >= 0) {
      uint16_t* dst =
          p.partial_out + (static_cast<int64_t>(partial_slot) * BLOCK_M + row) * D_V + col0;
      reinterpret_cast<uint4*>(dst)[chunk] = v;
    } else {
      uint16_t* dst = p.out + static_cast<int64_t>(q_row + r / heads) * p.out_token_stride +
                      static_cast<int64_t>(r % heads) * p.out_head_stride + col0;
      if (out_aligned) {
        reinterpret_cast<uint4*>(dst)[chunk] = v;
      } else {
        uint32_t* d = reinterpret_cast<uint32_t*>(dst) + chunk * 4;
        d[0] = v.x;
        d[1] = v.y;
        d[2] = v.z;
        d[3] = v.w;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Combine: the CTAs holding the splits of a split row tile share its 32 rows
// (the CTA of split s takes rows s, s + splits, ...) and merge each row's
// partials:
//   lse = log sum_s exp(lse_s),  o = sum_s exp(lse_s - lse) * o_s.
// A row is merged by 1, 2, 4 or 8 warps (as many as the CTA's rows leave
// free: all eight when it has one row, one per row from eight rows up), the
// warps of a row taking its splits round robin, each lane 16 of the 512
// columns as four float4, with a running (max, sum, o) per warp that is
// rescaled once per round of COMBINE_UNROLL splits (bench/NOTES.md, "The
// merge"); a row's warps are merged through shared memory. All of a warp's loads for
// COMBINE_UNROLL splits go out together, so a CTA costs a few L2 round trips
// whatever its rows and splits (bench/NOTES.md, "The stream plan"). A combine CTA finds
// its split segments as the attention CTA of the same index did (the work
// list, or the stream ranges).
// ---------------------------------------------------------------------------
constexpr int COMBINE_THREADS = 256;
constexpr int COMBINE_WARPS = COMBINE_THREADS / 32;
// Splits per warp whose partials are in flight at once: 8 warps x 5 covers
// the 33 splits of a B=1 row in one round (4 left warp 0 a second round).
constexpr int COMBINE_UNROLL = 5;
static_assert(D_V == 32 * 16, "combine: 16 columns per lane, four float4");
static_assert(D_V == COMBINE_THREADS * 2, "combine merge: two output columns per thread");

// Shared memory of one merge: the combine kernel declares it statically, the
// fused attention kernel lays it over its (by then idle) KV stages.
struct MergeSmem {
  float4 acc[COMBINE_WARPS][D_V / 4];
  float max[COMBINE_WARPS];
  float sum[COMBINE_WARPS];
};

// Merges rows item.split, item.split + item.splits, ... of the item's row
// tile (`rows`: the request's draft tokens x heads). The partial of split s
// sits in slot slot_base + s * slot_stride + (s == 0 ? slot0_extra : 0).
// kL2Loads (the fused combine): partials are read through L2 (ld.global.cg):
// they were written by other CTAs of the same grid, and L1 is not coherent
// with those writes. The combine kernel reads them with plain loads (written
// by the grid before it; ld.global.cg there cost ptxas 37 more registers and
// a spill on sm_120).
template <bool kL2Loads>
__device__ __forceinline__ void MergeSplitRows(const VerifyParams& p, const VerifyWorkItem& item,
                                               int slot_base, int slot_stride, int slot0_extra,
                                               int rows, MergeSmem& ms) {
  float4(&s_acc)[COMBINE_WARPS][D_V / 4] = ms.acc;
  float(&s_max)[COMBINE_WARPS] = ms.max;
  float(&s_sum)[COMBINE_WARPS] = ms.sum;
  const int splits = item.splits;
  const int heads = p.num_heads;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const float* lse_of = p.partial_lse + static_cast<int64_t>(slot_base) * BLOCK_M;
  const uint16_t* out_of = p.partial_out + static_cast<int64_t>(slot_base) * BLOCK_M * D_V;
  const int64_t split_stride = static_cast<int64_t>(slot_stride) * BLOCK_M;
  const int64_t split0_extra = static_cast<int64_t>(slot0_extra) * BLOCK_M;
  // This CTA's rows of the tile: item.split, item.split + splits, ... below
  // the tile's end and the request's.
  const int tile_row0 = item.row_tile * BLOCK_M;
  const int row_end = min(BLOCK_M, rows - tile_row0);
  const int n_rows = item.split < row_end ? CeilDiv(row_end - item.split, splits) : 0;
  // Warps per row: all eight on one row when the CTA has one row (33 splits
  // at B=1, L=4K), one warp per row from eight rows up (B=32: 8 rows of 4
  // splits; done one row after the other they cost eight L2 round trips).
  int warps_per_row = COMBINE_WARPS;
  while (warps_per_row > 1 && warps_per_row * n_rows > COMBINE_WARPS) warps_per_row >>= 1;
  const int rows_per_round = COMBINE_WARPS / warps_per_row;
  const int sub = warp % warps_per_row;
  if (threadIdx.x == 0) PhaseStamp(kStampMergeStart);

  // Where row `row` of the tile goes: its output row (bf16) and its LSE.
  struct OutputRow {
    uint16_t* out;
    float* lse;
  };
  auto output_row = [&](int row) {
    const int r = tile_row0 + row;
    const int64_t token = item.q_row + r / heads;
    const int h = r % heads;
    return OutputRow{
        p.out + token * p.out_token_stride + static_cast<int64_t>(h) * p.out_head_stride,
        p.lse + token * heads + h};
  };
  // Output row `row` of the tile from a merged (max, sum, o).
  auto write_row = [&](int row, float m, float l, const float4(&acc)[4]) {
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const OutputRow dst_row = output_row(row);
    uint16_t* dst = dst_row.out;
    // 4-byte stores: the API guarantees 4-byte aligned output rows only
    // (CanImplement: even strides).
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      uint32_t* d = reinterpret_cast<uint32_t*>(dst + lane * 4 + k * 128);
      d[0] = ptx::PackBf16x2(acc[k].x * inv, acc[k].y * inv);
      d[1] = ptx::PackBf16x2(acc[k].z * inv, acc[k].w * inv);
    }
    if (lane == 0) *dst_row.lse = l > 0.0f ? m + __logf(l) : -INFINITY;
  };

  for (int round = 0; round < n_rows; round += rows_per_round) {  // uniform across the block
    const int i = round + warp / warps_per_row;
    const bool active = i < n_rows;
    const int row = item.split + i * splits;  // row within the tile
    // 1. This warp's splits of its row: online max / sum / weighted o. A
    // split that saw no visible key has LSE -inf and weight 0.
    float m = -INFINITY, l = 0.0f;
    float4 acc[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s0 = active ? sub : splits; s0 < splits; s0 += warps_per_row * COMBINE_UNROLL) {
      float lse_v[COMBINE_UNROLL];
      uint2 o_v[COMBINE_UNROLL][4];  // bf16 columns 4 lane + 128 k + {0..3}
#pragma unroll
      for (int u = 0; u < COMBINE_UNROLL; ++u) {
        // Past the last split, load split 0's row again and drop it: loads
        // under a condition became a branch around each of the 25.
        const int s = s0 + u * warps_per_row;
        const bool valid = s < splits;
        const int64_t slot_row =
            valid ? s * split_stride + (s == 0 ? split0_extra : 0) + row : split0_extra + row;
        const uint2* row_out = reinterpret_cast<const uint2*>(out_of + slot_row * D_V + lane * 4);
        if constexpr (kL2Loads) {
          lse_v[u] = __ldcg(lse_of + slot_row);
#pragma unroll
          for (int k = 0; k < 4; ++k) o_v[u][k] = __ldcg(row_out + k * 32);
        } else {
          lse_v[u] = lse_of[slot_row];
#pragma unroll
          for (int k = 0; k < 4; ++k) o_v[u][k] = row_out[k * 32];
        }
        if (!valid) {
          lse_v[u] = -INFINITY;
#pragma unroll
          for (int k = 0; k < 4; ++k) o_v[u][k] = make_uint2(0u, 0u);
        }
      }
      // One reference per round, the largest LSE among its splits and the
      // rounds before (the same in every lane): the earlier rounds' sums
      // rescale once, and each split adds w o with one FFMA per column. (An
      // online max per split, rescaling before every split, was 2.5x the
      // code, and the combine kernel's merge waits on its code streaming in:
      // -1 to -1.5 us, bench/NOTES.md, "The merge".)
      // No branch on the LSEs (v17 had `continue` while all were -inf): a
      // reference of 0 then keeps every weight and scale 0 (v17.1: -0.1 to
      // -0.3 us in the fused merge, bench/NOTES.md, "The merge").
      float m_new = m;
#pragma unroll
      for (int u = 0; u < COMBINE_UNROLL; ++u) m_new = fmaxf(m_new, lse_v[u]);
      const float ref = m_new == -INFINITY ? 0.0f : m_new;
      const float scale = __expf(m - ref);  // m = -inf: 0
      l *= scale;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        acc[k].x *= scale;
        acc[k].y *= scale;
        acc[k].z *= scale;
        acc[k].w *= scale;
      }
      if (threadIdx.x == 0 && round == 0 && s0 == 0) {
        PhaseStampAfter(kStampMergeLoaded,
                        __float_as_int(lse_v[0]) ^ o_v[0][0].x ^ o_v[COMBINE_UNROLL - 1][3].y);
      }
#pragma unroll
      for (int u = 0; u < COMBINE_UNROLL; ++u) {
        const float w = __expf(lse_v[u] - ref);  // a split with no visible key (or none): 0
        l += w;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          // bf16 -> fp32: the 16 bits are the top half of the float.
          acc[k].x = fmaf(w, __uint_as_float(o_v[u][k].x << 16), acc[k].x);
          acc[k].y = fmaf(w, __uint_as_float(o_v[u][k].x & 0xffff0000u), acc[k].y);
          acc[k].z = fmaf(w, __uint_as_float(o_v[u][k].y << 16), acc[k].z);
          acc[k].w = fmaf(w, __uint_as_float(o_v[u][k].y & 0xffff0000u), acc[k].w);
        }
      }
      m = m_new;
    }
    if (threadIdx.x == 0 && round == 0)
      PhaseStampAfter(kStampMergeSummed, __float_as_int(acc[3].w + l));
    if (warps_per_row == 1) {
      if (active) write_row(row, m, l, acc);
      continue;
    }
    // 2. Merge the row's warps through shared memory, each of them taking
    // 16 / warps_per_row adjacent columns per lane (s_acc[w] read as floats
    // is o by column: float4 lane + 32k holds columns 4 lane + 128 k ..).
#pragma unroll
    for (int k = 0; k < 4; ++k) s_acc[warp][lane + k * 32] = acc[k];
    if (lane == 0) {
      s_max[warp] = m;
      s_sum[warp] = l;
    }
    __syncthreads();
    if (threadIdx.x == 0 && round == 0) PhaseStamp(kStampMergeShared);
    if (active) {
      // Loops over the row's warps are unrolled to all eight with a guard:
      // with a run-time trip count ptxas emitted unrolled copies plus
      // remainder loops, code the merge streams in before it can run.
      const int w0 =
          warp - sub;  // the row's first warp; every access below is under j < warps_per_row
      float max_all = -INFINITY;
#pragma unroll
      for (int j = 0; j < COMBINE_WARPS; ++j) {
        if (j < warps_per_row) max_all = fmaxf(max_all, s_max[w0 + j]);
      }
      const float ref = max_all == -INFINITY ? 0.0f : max_all;
      float e[COMBINE_WARPS];  // the warps' weights (a warp with no split or no visible key: 0)
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < COMBINE_WARPS; ++j) {
        e[j] = 0.0f;
        if (j < warps_per_row) {
          e[j] = __expf(s_max[w0 + j] - ref);
          sum += e[j] * s_sum[w0 + j];
        }
      }
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      const int cols = 16 / warps_per_row;  // 2, 4 or 8
      const int col0 = (sub * 32 + lane) * cols;
      const OutputRow dst_row = output_row(row);
      uint16_t* dst = dst_row.out;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (2 * i >= cols) break;  // uniform
        const int c = col0 + 2 * i;
        float2 o = make_float2(0.0f, 0.0f);
#pragma unroll
        for (int j = 0; j < COMBINE_WARPS; ++j) {
          if (j < warps_per_row) {
            const float2 a =
                *reinterpret_cast<const float2*>(reinterpret_cast<const float*>(s_acc[w0 + j]) + c);
            o.x += e[j] * a.x;
            o.y += e[j] * a.y;
          }
        }
        *reinterpret_cast<uint32_t*>(dst + c) = ptx::PackBf16x2(o.x * inv, o.y * inv);
      }
      if (sub == 0 && lane == 0) *dst_row.lse = sum > 0.0f ? ref + __logf(sum) : -INFINITY;
    }
    __syncthreads();  // s_acc, s_max, s_sum are reused by the next round
  }
}

// ---------------------------------------------------------------------------
// Fused combine (VerifyLaunchConfig::fused_combine, bench/NOTES.md, "Fused combine"): the
// attention CTAs merge the partials themselves, as the combine kernel's CTA
// of the same index would. After each segment a CTA counts its split
// segments in on the row tile's arrival counter; after its last segment it
// waits, for each split segment, until every split of that row tile has
// arrived and merges its share of the rows. The waits need every CTA of the
// grid resident: the host launches the kernel cooperatively and only when
// the grid fits.
//
// Counters (workspace, zeroed once by InitVerifyWorkspace, which also writes
// kFusedWorkspaceMagic): arrivals[key] and done[key] per split row tile. A
// CTA past its wait adds itself to done[key]; the last of the row tile's
// splits (every one of them is past its wait, so nobody reads arrivals[key]
// again in this launch) sets both back to 0 for the next launch, which is
// stream-ordered after this one. Plain atomicAdd throughout: tagged
// counters updated by compare-and-swap loops cost 23-42 us per launch with
// 132 CTAs retrying CAS on one word (bench/NOTES.md, "Fused combine").
// Keys: a split row tile is identified by its split-0 slot base, below
// target_ctas under both plans (see SplitTileKey).
// ---------------------------------------------------------------------------
constexpr unsigned long long kFusedWorkspaceMagic = 0x6d6c61766572696full;  // "mlaverio"

__device__ __forceinline__ unsigned int LoadAcquireGpu(const unsigned int* addr) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(addr) : "memory");
  return v;
}

// The key of a split segment's row tile (the combine's slot base, divided
// by two under the stream plan): every split of a row tile computes the same.
__device__ __forceinline__ int SplitTileKey(const VerifyParams& p, const VerifyPlanSummary& s,
                                            const VerifyWorkItem& item, int x) {
  if (s.stream_groups == 0) {
    const int row_tiles = CeilDiv(p.draft_len[item.request] * p.num_heads, BLOCK_M);
    return item.partial_slot - item.split * row_tiles;
  }
  const int rt_count = s.stream_row_tiles;
  return (x / rt_count - item.split) * rt_count + item.row_tile;
}

// Called by every thread after a segment: its partial (if any) is written.
// All threads fence their stores before the barrier; thread 0 then arrives.
__device__ __forceinline__ void ArriveSplit(const VerifyParams& p, const VerifyPlanSummary& s,
                                            const VerifyWorkItem& item) {
  __threadfence();
  ptx::BlockBarrier();
  if (threadIdx.x == 0 && item.splits > 1) {
    atomicAdd(p.split_arrivals + SplitTileKey(p, s, item, blockIdx.x), 1u);
  }
}

// The merge work of CTA x, shared by the combine kernel (kFused false) and
// the fused attention kernel (kFused true: check the workspace mark, then
// before each merge wait for the row tile's partials and count the CTA in
// on done[key]). `starts`: the requests' stream starts (the plan-in-warp
// copy in shared memory, or the plan kernel's array).
template <bool kFused>
__device__ __forceinline__ void MergeCtaSplits(const VerifyParams& p,
                                               const VerifyPlanSummary& summary,
                                               const VerifyWorkItem& chunk_item,
                                               const int32_t* starts, const int32_t* q_rows,
                                               SegmentSmem& sm, MergeSmem& ms) {
  const int x = blockIdx.x;
  if constexpr (kFused) {
    // Checked here, after the segment loop, not at the arrivals: a trap (or a
    // printf call) in the loop around the attention body made ptxas put
    // WARPSYNC.ALL before the tile loops' warp-wide instructions and cost 4 %
    // (bench/NOTES.md, "Reading an A/B"). An uninitialised workspace's arrivals counted
    // into garbage; no CTA has waited on them yet.
    if (threadIdx.x == 0 && *p.fused_magic != kFusedWorkspaceMagic) {
      printf(
          "mlaverify: the verify workspace was not initialised (InitVerifyWorkspace) before a "
          "fused-combine launch\n");
      __trap();
    }
  }
  auto merge = [&](const VerifyWorkItem& item, int slot_base, int slot_stride, int extra) {
    if (item.splits <= 1) return;
    // Fused: thread 0 counts the CTA in on done[key] once past its wait. The
    // count's old value is only looked at after the merge, so the atomic's
    // round trip to L2 overlaps the merge instead of holding the whole CTA
    // at the barrier below (0.6-0.7 us of the 2.9 us fused merge at B=1,
    // L=4K; bench/NOTES.md, "The merge"). The last split's CTA resets both
    // counters then: every split is past its wait by then, as before.
    [[maybe_unused]] unsigned int done_before = 0;
    [[maybe_unused]] int key = 0;
    // The request's rows (tokens x heads), read before the wait so that the
    // merge does not start with this load's round trip (fused, B=1, L=4K:
    // ~0.5 us after the wait; bench/NOTES.md, "The merge").
    const int rows = p.draft_len[item.request] * p.num_heads;
    if constexpr (kFused) {
      if (threadIdx.x == 0) {
        key = SplitTileKey(p, summary, item, x);
        while (LoadAcquireGpu(p.split_arrivals + key) != static_cast<unsigned int>(item.splits))
          __nanosleep(32);
        PhaseStamp(kStampMergeWaited);
        done_before = atomicAdd(p.split_done + key, 1u);
      }
      __syncthreads();
    }
    if (item.split < BLOCK_M) {  // uniform: else no row of this split
      MergeSplitRows<kFused>(p, item, slot_base, slot_stride, extra, rows, ms);
      if (threadIdx.x == 0) PhaseStamp(kFused ? kStampMergeDone : kStampCombineDone);
    }
    if constexpr (kFused) {
      if (threadIdx.x == 0 && done_before == static_cast<unsigned int>(item.splits) - 1) {
        p.split_arrivals[key] = 0;  // the row tile's last split past its wait
        p.split_done[key] = 0;
      }
    }
  };
  if (summary.stream_groups == 0) {
    // Chunk plan: item w = base_b + split * row_tiles_b + row_tile in slot w.
    const VerifyWorkItem item = chunk_item;
    const int row_tiles = CeilDiv(p.draft_len[item.request] * p.num_heads, BLOCK_M);
    merge(item, item.partial_slot - item.split * row_tiles, row_tiles, 0);
  } else {
    // Stream plan: split s of a request's row tile rt is held by CTA
    // (first + s) * RT + rt (first: the range where the request starts) in its
    // slot 2x, except split 0 when the request starts inside that range
    // (the CTA's second split segment): 2x + 1.
    const int rt_count = summary.stream_row_tiles;
    int b0 = 0;
    if (threadIdx.x < 32 && !p.plan_in_warp) b0 = FirstStreamBlock(p, summary, starts, x);
    while (true) {
      CollectStreamRound(p, summary, starts, q_rows, x, b0, sm);
      __syncthreads();
      const int count = sm.count;
      b0 = sm.next;
      for (int i = 0; i < count; ++i) {
        const VerifyWorkItem item = sm.list[i];
        const int first = x / rt_count - item.split;
        const int extra = starts[item.request] > StreamStart(first, summary) ? 1 : 0;
        merge(item, 2 * (first * rt_count + item.row_tile), 2 * rt_count, extra);
      }
      __syncthreads();  // sm.list is refilled
      if (b0 < 0) break;
    }
  }
}

// Zeroes the fused combine's counters and marks the workspace initialised.
__global__ void InitFusedWorkspaceKernel(unsigned int* arrivals, unsigned int* done, int keys,
                                         unsigned long long* magic) {
  for (int i = threadIdx.x; i < keys; i += blockDim.x) {
    arrivals[i] = 0;
    done[i] = 0;
  }
  if (threadIdx.x == 0) *magic = kFusedWorkspaceMagic;
}

__global__ void __launch_bounds__(COMBINE_THREADS) CombineKernel(const VerifyParams p) {
  __shared__ SegmentSmem sm;
  __shared__ MergeSmem ms;
  if (threadIdx.x == 0) PhaseStamp(kStampCombineEntry);
  ptx::GridDependencyWait();  // the attention kernel's partials
  const int x = blockIdx.x;
  // Both loads go out together (one L2 round trip fewer on the small-batch
  // critical path); the item is stale and unused under the stream plan.
  const VerifyPlanSummary summary = *p.summary;
  const VerifyWorkItem chunk_item = p.work[x];
  if (x >= summary.total_work) return;
  if (threadIdx.x == 0) PhaseStamp(kStampCombineReady);
  MergeCtaSplits<false>(p, summary, chunk_item, p.request_stream_start, p.request_q_row, sm, ms);
}

}  // namespace mlaverify::kernels::verify

#endif  // MLAVERIFY_KERNELS_VERIFY_KERNEL_CUH_
