#include "kernels/verify_attention_cuda.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda_status.h"
#include "kernels/verify_params.h"
#include "kernels/verify_workspace.h"

namespace mlaverify::kernels {
namespace {

int Log2(int v) {
  int r = 0;
  while ((1 << r) < v) ++r;
  return r;
}

absl::Status CheckWorkspace(const VerifyWorkspaceLayout& l, const void* workspace,
                            size_t workspace_bytes) {
  if (workspace == nullptr || workspace_bytes < l.bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("workspace of ", workspace_bytes, " bytes is too small: need ", l.bytes));
  }
  return absl::OkStatus();
}

// The fused combine's conditions for a batch whose grid has `grid_ctas` attention CTAs.
bool UsesFusedCombine(const VerifyLaunchConfig& c, int batch, int grid_ctas) {
  return batch <= c.fused_combine_max_batch && !c.programmatic_launch &&
         grid_ctas <= c.resident_ctas;
}

}  // namespace

bool LaunchUsesFusedCombine(const VerifyArguments& a, const VerifyLaunchConfig& c) {
  return UsesFusedCombine(c, a.batch, VerifyMaxWork(a, c));
}

absl::StatusOr<VerifyLaunchConfig> PrepareVerifyLaunch(int device) {
  VerifyLaunchConfig config;
  RETURN_IF_ERROR(CudaErrorToStatus(cudaSetDevice(device), "cudaSetDevice"));
  RETURN_IF_ERROR(CudaErrorToStatus(
      cudaDeviceGetAttribute(&config.num_sms, cudaDevAttrMultiProcessorCount, device),
      "cudaDeviceGetAttribute(MultiProcessorCount)"));
  int max_optin = 0;
  RETURN_IF_ERROR(CudaErrorToStatus(
      cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
      "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)"));
  const int needed = VerifyAttentionSharedBytes() + kVerifyStaticSharedBytes;
  if (max_optin < needed) {
    return absl::FailedPreconditionError(
        absl::StrCat("device ", device, " allows ", max_optin,
                     " bytes of shared memory per block; the verify kernels need ", needed));
  }
  RETURN_IF_ERROR(CudaErrorToStatus(PrepareVerifyKernels(), "cudaFuncSetAttribute"));
  config.resident_ctas = config.num_sms * FusedAttentionCtasPerSm();
  return config;
}

size_t VerifyWorkspaceBytes(const VerifyArguments& args, const VerifyLaunchConfig& config) {
  return VerifyWorkspaceLayoutFor(args, config).bytes;
}

absl::Status InitVerifyWorkspace(const VerifyArguments& args, const VerifyLaunchConfig& config,
                                 void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const VerifyWorkspaceLayout l = VerifyWorkspaceLayoutFor(args, config);
  RETURN_IF_ERROR(CheckWorkspace(l, workspace, workspace_bytes));
  auto* base = static_cast<uint8_t*>(workspace);
  return CudaErrorToStatus(
      LaunchInitFusedWorkspace(reinterpret_cast<unsigned int*>(base + l.split_arrivals),
                               reinterpret_cast<unsigned int*>(base + l.split_done),
                               VerifyTargetCtas(config),
                               reinterpret_cast<unsigned long long*>(base + l.fused_magic), stream),
      "verify workspace init");
}

absl::Status LaunchVerifyAttention(const VerifyArguments& a, const VerifyLaunchConfig& c,
                                   void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  RETURN_IF_ERROR(CanImplement(a, /*require_16b_alignment=*/true));
  if (c.num_sms < 1 || c.ctas_per_sm < 1 || c.min_chunk_tiles < 1) {
    return absl::InvalidArgumentError(
        "launch config needs num_sms, ctas_per_sm and "
        "min_chunk_tiles >= 1 (see PrepareVerifyLaunch)");
  }
  if (c.plan_in_warp_max_batch < 0 || c.plan_in_warp_max_batch > kPlanInWarpMaxBatch) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan_in_warp_max_batch = ", c.plan_in_warp_max_batch, ": must be in 0..",
                     kPlanInWarpMaxBatch));
  }
  const VerifyWorkspaceLayout l = VerifyWorkspaceLayoutFor(a, c);
  RETURN_IF_ERROR(CheckWorkspace(l, workspace, workspace_bytes));
  auto* base = static_cast<uint8_t*>(workspace);
  VerifyParams p{};
  p.q = reinterpret_cast<const uint16_t*>(a.q);
  p.q_token_stride = a.q_token_stride;
  p.q_head_stride = a.q_head_stride;
  p.pool = reinterpret_cast<const uint16_t*>(a.pool.data);
  p.fp8_pool = a.pool.dtype == KvDtype::kFp8 ? 1 : 0;
  p.num_pages = a.pool.num_pages;
  p.page_size_log2 = Log2(a.pool.page_size);
  p.page_table = a.page_table;
  p.page_table_stride = a.page_table_stride;
  p.page_table_offset = a.page_table_offset;
  p.prefix_len = a.prefix_len;
  p.draft_len = a.draft_len;
  p.layer = a.layer;
  p.softmax_scale = a.softmax_scale;
  p.default_softmax_scale = a.default_softmax_scale;
  p.visibility = a.visibility;
  p.batch = a.batch;
  p.num_heads = a.num_heads;
  p.out = reinterpret_cast<uint16_t*>(a.out);
  p.out_token_stride = a.out_token_stride;
  p.out_head_stride = a.out_head_stride;
  p.lse = a.lse;
  p.summary = reinterpret_cast<VerifyPlanSummary*>(base + l.summary);
  p.request_q_row = reinterpret_cast<int32_t*>(base + l.request_q_row);
  p.request_stream_start = reinterpret_cast<int32_t*>(base + l.request_stream_start);
  p.work = reinterpret_cast<VerifyWorkItem*>(base + l.work);
  p.partial_lse = reinterpret_cast<float*>(base + l.partial_lse);
  p.partial_out = reinterpret_cast<uint16_t*>(base + l.partial_out);
  p.max_work = VerifyMaxWork(a, c);
  p.target_ctas = VerifyTargetCtas(c);
  p.min_chunk_tiles = c.min_chunk_tiles;
  // reuse_plan: the attention CTAs read the workspace's plan (as after a plan
  // kernel) and no plan kernel is launched.
  p.plan_in_warp = !c.reuse_plan && a.batch <= c.plan_in_warp_max_batch ? 1 : 0;
  p.stream_plan = c.stream_plan ? 1 : 0;
  p.split_arrivals = reinterpret_cast<unsigned int*>(base + l.split_arrivals);
  p.split_done = reinterpret_cast<unsigned int*>(base + l.split_done);
  p.fused_magic = reinterpret_cast<const unsigned long long*>(base + l.fused_magic);
  p.fused_combine = UsesFusedCombine(c, a.batch, p.max_work) ? 1 : 0;
  return CudaErrorToStatus(
      LaunchVerifyKernels(p, c.programmatic_launch, /*launch_plan=*/!c.reuse_plan, stream),
      "verify launch");
}

absl::StatusOr<VerifyPlanSummary> ReadVerifyPlanSummary(const VerifyArguments& a,
                                                        const VerifyLaunchConfig& c,
                                                        const void* workspace,
                                                        cudaStream_t stream) {
  if (workspace == nullptr) return absl::InvalidArgumentError("no workspace");
  VerifyPlanSummary summary{};
  const auto* base = static_cast<const uint8_t*>(workspace);
  RETURN_IF_ERROR(
      CudaErrorToStatus(cudaMemcpyAsync(&summary, base + VerifyWorkspaceLayoutFor(a, c).summary,
                                        sizeof(summary), cudaMemcpyDeviceToHost, stream),
                        "cudaMemcpyAsync(plan summary)"));
  RETURN_IF_ERROR(CudaErrorToStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize"));
  return summary;
}

absl::Status SetVerifyPhaseStamps(unsigned long long* device_stamps) {
  if (!PhaseStampsCompiledIn()) {
    return absl::FailedPreconditionError(
        "phase stamps are not compiled in: configure with -DMLAVERIFY_PHASE_STAMPS=ON");
  }
  return CudaErrorToStatus(SetPhaseStampBuffer(device_stamps), "cudaMemcpyToSymbol(phase stamps)");
}

absl::Status LaunchWriteDraftKv(const DraftKvWriteArguments& a, cudaStream_t stream) {
  RETURN_IF_ERROR(CanImplementWrite(a, /*require_16b_alignment=*/true));
  DraftKvWriteParams p{};
  p.draft_kv = reinterpret_cast<const uint16_t*>(a.draft_kv);
  p.draft_kv_stride = a.draft_kv_stride;
  p.pool = reinterpret_cast<uint16_t*>(a.pool.data);
  p.row_elements = static_cast<int>(a.pool.RowElements());
  p.num_pages = a.pool.num_pages;
  p.page_size_log2 = Log2(a.pool.page_size);
  p.page_table = a.page_table;
  p.page_table_stride = a.page_table_stride;
  p.page_table_offset = a.page_table_offset;
  p.prefix_len = a.prefix_len;
  p.draft_len = a.draft_len;
  p.layer = a.layer;
  p.batch = a.batch;
  p.total_draft_capacity = a.total_draft_capacity;
  return CudaErrorToStatus(LaunchDraftKvWriteKernel(p, stream), "draft KV write launch");
}

absl::Status LaunchCopyRows(const KvPoolView& pool, const int32_t* page_table, int64_t start,
                            int64_t count, Bf16* rows, bool to_pool, cudaStream_t stream) {
  if (pool.data == nullptr || page_table == nullptr || rows == nullptr || start < 0 || count < 0) {
    return absl::InvalidArgumentError("row copy needs a pool, a page table, rows and a range");
  }
  RowCopyParams p{};
  p.pool = reinterpret_cast<uint16_t*>(pool.data);
  p.row_elements = static_cast<int>(pool.RowElements());
  p.num_layers = pool.num_layers;
  p.num_pages = pool.num_pages;
  p.page_size_log2 = Log2(pool.page_size);
  p.page_table = page_table;
  p.start = start;
  p.count = count;
  p.rows = reinterpret_cast<uint16_t*>(rows);
  return CudaErrorToStatus(LaunchRowCopyKernel(p, to_pool, stream), "row copy launch");
}

absl::Status LaunchGatherCopies(const GatherParams& params, cudaStream_t stream) {
  if (params.slots == nullptr || params.cursor == nullptr || params.list == nullptr ||
      params.num_slots < 1 || params.capacity < 1 || params.capacity > 65535 ||
      params.row_blocks < 1 || params.row_blocks > 65535) {
    return absl::InvalidArgumentError("gather copies: a null pointer or a grid out of range");
  }
  return CudaErrorToStatus(LaunchGatherKernel(params, stream), "gather launch");
}

absl::Status LaunchScatterCopies(const ScatterParams& params, cudaStream_t stream) {
  if (params.list == nullptr || params.capacity < 1 || params.capacity > 65535 ||
      params.row_blocks < 1 || params.row_blocks > 65535) {
    return absl::InvalidArgumentError("scatter copies: a null list or a grid out of range");
  }
  return CudaErrorToStatus(LaunchScatterKernel(params, stream), "scatter launch");
}

absl::Status LaunchCompactAcceptedKv(const CompactArguments& a, cudaStream_t stream) {
  RETURN_IF_ERROR(CanImplementCompact(a, /*require_16b_alignment=*/true));
  CompactParams p{};
  p.pool = reinterpret_cast<uint16_t*>(a.pool.data);
  p.row_elements = static_cast<int>(a.pool.RowElements());
  p.num_layers = a.pool.num_layers;
  p.num_pages = a.pool.num_pages;
  p.page_size_log2 = Log2(a.pool.page_size);
  p.page_table = a.page_table;
  p.page_table_stride = a.page_table_stride;
  p.prefix_len = a.prefix_len;
  p.accepted_len = a.accepted_len;
  p.accepted = a.accepted;
  p.batch = a.batch;
  return CudaErrorToStatus(LaunchCompactKernel(p, stream), "compaction launch");
}

}  // namespace mlaverify::kernels
