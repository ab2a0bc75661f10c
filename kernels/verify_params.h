// What the CUDA kernels see: plain structs of pointers, strides in elements
// and shape comments, built by the host launchers (verify_attention_cuda.cc)
// from the validated argument structs. No Abseil, no STL: this header is
// compiled by nvcc into device code.
#ifndef MLAVERIFY_KERNELS_VERIFY_PARAMS_H_
#define MLAVERIFY_KERNELS_VERIFY_PARAMS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/copy_list.h"

namespace mlaverify::kernels {

// Query rows one attention CTA owns (BLOCK_M of verify_config.cuh, which
// checks the two agree): the host sizes the workspace with it.
inline constexpr int kVerifyRowsPerCta = 32;
// Largest batch the attention kernel can plan in one warp (a lane per request).
inline constexpr int kPlanInWarpMaxBatch = 32;
// Upper bound of the attention kernel's static shared memory (the segment
// list and plan table; verify_config.cuh checks it), on top of the dynamic
// bytes of VerifyAttentionSharedBytes.
inline constexpr int kVerifyStaticSharedBytes = 1536;

// One segment of attention work: a CTA attends the 32 query rows `row_tile`
// of request `request` over the KV positions [kv_begin, kv_end). `split`
// numbers the KV chunks of that row tile (0..splits-1). An unsplit row tile
// (splits == 1) writes the output directly; a split one writes its partial to
// slot `partial_slot` of the workspace, which the combine merges.
// The chunk plan gives each CTA one segment (work list entry blockIdx.x); the
// stream plan gives a CTA a contiguous range of KV tiles that may span several
// requests, i.e. several segments (verify_kernel.cuh, "Plan").
struct VerifyWorkItem {
  int32_t request;       // -1: no work
  int32_t row_tile;      // query rows [32*row_tile, 32*row_tile + 32) of the request
  int32_t split;         // 0..splits-1
  int32_t kv_begin;      // first KV position of the chunk
  int32_t kv_end;        // one past the last
  int32_t q_row;         // first token row of the request in q
  int32_t splits;        // KV chunks of this row tile
  int32_t partial_slot;  // -1 when splits == 1
};
static_assert(sizeof(VerifyWorkItem) == 32, "work items are read as two 16-byte vectors");

// What the plan decided for a launch, written by the plan (device memory).
// stream_groups == 0: the chunk plan (total_work items in `work`). Otherwise
// the stream plan: the requests' KV tiles (32 tokens) laid end to end,
// stream_length in all, are cut into stream_groups equal ranges; every
// request has stream_row_tiles row tiles, and CTA g * stream_row_tiles + rt
// attends row tile rt over range g.
struct VerifyPlanSummary {
  int32_t total_work;  // CTAs with work
  int32_t stream_groups;
  int32_t stream_row_tiles;
  int32_t stream_length;
};

struct VerifyParams {
  // ---- inputs (read only) ----
  const uint16_t* q;       // [total_draft, num_heads, 576] bf16
  int64_t q_token_stride;  // elements
  int64_t q_head_stride;   // elements
  // [num_layers, num_pages, page_size, 576] bf16, or with fp8_pool
  // [num_layers, num_pages, page_size, 328]: the 656-byte rows of common/kv_dtype.h
  const uint16_t* pool;
  int fp8_pool;  // 1: fp8 rows (the launcher picks the kernel instance that converts them)
  int64_t num_pages;
  int page_size_log2;                // page_size = 1 << page_size_log2
  const int32_t* page_table;         // request b's page ids: VerifyArguments::PageRow(b)
  int64_t page_table_stride;         // b * stride from page_table, unless page_table_offset is set
  const int64_t* page_table_offset;  // [batch] offsets from page_table, or nullptr
  const int32_t* prefix_len;         // [batch]
  const int32_t* draft_len;          // [batch]
  const int32_t* layer;              // [batch]
  const float* softmax_scale;        // [batch] or nullptr
  float default_softmax_scale;
  const uint64_t* visibility;  // [total_draft]
  int batch;
  int num_heads;

  // ---- outputs ----
  uint16_t* out;  // [total_draft, num_heads, 512] bf16
  int64_t out_token_stride;
  int64_t out_head_stride;
  float* lse;  // [total_draft, num_heads]

  // ---- workspace: the plan (written by the plan kernel, read by the others) ----
  VerifyPlanSummary* summary;  // [1]
  int32_t* request_q_row;      // [batch] first token row of each request in q
  int32_t*
      request_stream_start;  // [batch] first KV tile of the request in the stream (stream plan)
  VerifyWorkItem* work;      // [max_work]
  // ---- workspace: partial results of split row tiles ----
  float* partial_lse;     // [2 * target_ctas, 32] natural log
  uint16_t* partial_out;  // [2 * target_ctas, 32, 512] bf16, normalised (NOTES.md, "bf16 partials")
  int max_work;           // grid of the attention and combine kernels
  int target_ctas;        // CTAs the split aims to fill the device with
  int min_chunk_tiles;    // smallest KV chunk, in 32-token tiles
  int plan_in_warp;  // 1: no plan kernel; each attention CTA plans in its first warp (batch <= 32)
  int stream_plan;   // 1: the plan may choose stream ranges (verify_kernel.cuh, "Plan")
  // ---- workspace: the combine folded into the attention kernel (fused_combine) ----
  // Zeroed once by InitVerifyWorkspace; every launch leaves them zero
  // ("Fused combine" in verify_kernel.cuh).
  unsigned int* split_arrivals;           // [target_ctas] per split row tile: partials written
  unsigned int* split_done;               // [target_ctas] per split row tile: CTAs past their wait
  const unsigned long long* fused_magic;  // [1] kFusedWorkspaceMagic once initialised
  int fused_combine;  // 1: the attention CTAs merge the partials (cooperative launch, no combine
                      // kernel)
};

struct DraftKvWriteParams {
  const uint16_t* draft_kv;  // [total_draft, 576]
  int64_t draft_kv_stride;
  uint16_t* pool;    // [num_layers, num_pages, page_size, row_elements]
  int row_elements;  // 576 (bf16 rows), 328 (fp8 rows: quantized as they are written)
  int64_t num_pages;
  int page_size_log2;
  const int32_t* page_table;  // [batch, page_table_stride]
  int64_t page_table_stride;
  const int64_t* page_table_offset;  // [batch] offsets from page_table, or nullptr
  const int32_t* prefix_len;         // [batch]
  const int32_t* draft_len;          // [batch]
  const int32_t* layer;              // [batch]
  int batch;
  int total_draft_capacity;  // grid size
};

struct CompactParams {
  uint16_t* pool;    // [num_layers, num_pages, page_size, row_elements]
  int row_elements;  // 576 or 328: rows move as stored
  int num_layers;
  int64_t num_pages;
  int page_size_log2;
  const int32_t* page_table;  // [batch, page_table_stride]
  int64_t page_table_stride;
  const int32_t* prefix_len;    // [batch]
  const int32_t* accepted_len;  // [batch]
  const int32_t* accepted;      // [batch, 64]
  int batch;
};

// Copies rows [num_layers, count, 576] to or from positions
// start..start+count-1 of one sequence in every layer (AppendKv, debugging).
struct RowCopyParams {
  uint16_t* pool;  // [num_layers, num_pages, page_size, row_elements]
  // 576, or 328 for fp8 rows: bf16 rows are quantized into the pool; out of
  // it, rows come as stored ([num_layers, count, 328]).
  int row_elements;
  int num_layers;
  int64_t num_pages;
  int page_size_log2;
  const int32_t* page_table;  // [pages of the sequence]
  int64_t start;
  int64_t count;
  uint16_t* rows;  // [num_layers, count, 576]
};

// Launchers defined in the .cu files: they enqueue kernels on `stream` and
// return the launch error; no allocation, no host synchronisation.
// launch_plan false with params.plan_in_warp 0: no plan kernel either, the
// attention reads the plan already in the workspace (VerifyLaunchConfig::reuse_plan).
cudaError_t LaunchVerifyKernels(const VerifyParams& params, bool programmatic_launch,
                                bool launch_plan, cudaStream_t stream);
cudaError_t LaunchDraftKvWriteKernel(const DraftKvWriteParams& params, cudaStream_t stream);
cudaError_t LaunchCompactKernel(const CompactParams& params, cudaStream_t stream);
// to_pool: rows -> pool, else pool -> rows.
cudaError_t LaunchRowCopyKernel(const RowCopyParams& params, bool to_pool, cudaStream_t stream);
// The copy-list kernels (copy_list.h).
cudaError_t LaunchGatherKernel(const GatherParams& params, cudaStream_t stream);
cudaError_t LaunchScatterKernel(const ScatterParams& params, cudaStream_t stream);
// Raises the dynamic shared-memory limit of the attention kernel on the
// current device; idempotent.
cudaError_t PrepareVerifyKernels();
// Zeroes the fused combine's counters (`keys` of each) and writes the
// initialised mark, on `stream`.
cudaError_t LaunchInitFusedWorkspace(unsigned int* arrivals, unsigned int* done, int keys,
                                     unsigned long long* magic, cudaStream_t stream);
// CTAs of the fused-combine attention kernel one SM holds at once (the
// occupancy calculator; 0 on error). Call after PrepareVerifyKernels.
int FusedAttentionCtasPerSm();
// Phase stamps (kernels/phase_stamps.h): whether this build records them, and
// the device buffer the kernels write them to (null: none). Not supported
// (cudaErrorNotSupported) in a build without MLAVERIFY_PHASE_STAMPS.
bool PhaseStampsCompiledIn();
cudaError_t SetPhaseStampBuffer(unsigned long long* stamps);
// Dynamic shared memory of the attention kernel, in bytes.
int VerifyAttentionSharedBytes();

}  // namespace mlaverify::kernels

#endif  // MLAVERIFY_KERNELS_VERIFY_PARAMS_H_
