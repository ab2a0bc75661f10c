// Host API of the CUDA verify path: workspace sizing, argument checks and
// stream launches. Launch functions allocate nothing and never synchronise
// the host, so they may be captured into CUDA graphs; everything that
// depends on lengths is computed on the GPU by the plan (the plan kernel, or
// for small batches the attention kernel's first warp).
#ifndef MLAVERIFY_KERNELS_VERIFY_ATTENTION_CUDA_H_
#define MLAVERIFY_KERNELS_VERIFY_ATTENTION_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/kv_cache.h"
#include "kernels/verify_attention.h"
#include "kernels/verify_params.h"

namespace mlaverify::kernels {

struct VerifyLaunchConfig {
  int num_sms = 0;          // multiprocessors of the device
  int ctas_per_sm = 1;      // attention CTAs resident per SM (1: shared memory ~95 KB)
  int min_chunk_tiles = 2;  // smallest KV chunk of a split, in 32-token tiles
  // Programmatic dependent launch between plan, attention and combine (sm_90+).
  // Off by default: on the H200 it made every anchor shape slower but three
  // H=128 rows (within 0.2 %; B=1, L=4K: 31.1 vs 27.3 us; bench/NOTES.md, "PDL off"), for
  // reasons not yet understood.
  bool programmatic_launch = false;
  // Batches up to this size skip the plan kernel: each attention CTA computes
  // the (same) plan in its first warp and takes its own item, one launch
  // fewer (0..32; 0 always launches the plan kernel; bench/NOTES.md, "The plan in-warp").
  int plan_in_warp_max_batch = 32;
  // Let the plan cut the batch's KV into equal stream ranges when every
  // request has the same number of 32-row tiles and that beats whole chunks
  // per request (verify_kernel.cuh, "Plan"; bench/NOTES.md, "The stream plan"). Off: always
  // the chunk plan.
  bool stream_plan = true;
  // Merge the split rows' partials inside the attention kernel instead of a
  // combine kernel for batches of up to this many requests (0: never;
  // verify_kernel.cuh, "Fused combine"; bench/NOTES.md, "Fused combine"):
  // every CTA of a split row tile waits for the tile's partials, then merges
  // its share of the rows. Needs every CTA resident at once, so it is used
  // only without programmatic launch and when the grid fits `resident_ctas`; the kernel is then
  // launched cooperatively (the launch fails rather than deadlocks if the grid could not be
  // resident). Otherwise the combine kernel runs as before. The workspace
  // must have gone through InitVerifyWorkspace.
  // Default 4: on the H200 (v9.2) it saves 2.1 us at B=1, L=4K and 1.5 us at
  // B=4, L=4K, and costs 1-2 % at B=8..32 on the long shapes (its instance's
  // PV loop has 13 % more instructions), where the combine launch is noise.
  int fused_combine_max_batch = 4;
  // CTAs of the fused attention kernel the device holds at once (SMs x CTAs
  // per SM); set by PrepareVerifyLaunch from the occupancy calculator. 0: no
  // fused launch.
  int resident_ctas = 0;
  // Plan once, attend many times (FlashInfer's plan/run, FlashMLA's metadata):
  // the 61 layers of a verify step share their lengths, so only the first
  // launch of a step needs to plan. true: this launch neither launches the
  // plan kernel nor plans in the attention kernel; it reads the plan the
  // previous launch on the same workspace left there (every launch leaves
  // its plan there, whichever way it planned). The caller guarantees that
  // that launch had the same batch, the same device lengths (the contents
  // of prefix_len and draft_len) and the same launch config; the other
  // arguments (q, layer, page table, visibility words, scale, outputs) may
  // differ. Nothing checks that: with other lengths, batch or config, or
  // with no planning launch on the workspace before, the result is wrong
  // and the launch may read out of bounds (a stale stream plan did in the
  // GPU test's first version). Measured -1.6 to -1.8 us per launch up to
  // B=8 (B=1, L=4K: 18.6 -> 16.8 us), +1 us at B=32 (bench/NOTES.md, "Plan once per verify step").
  bool reuse_plan = false;
};

// Whether LaunchVerifyAttention with these arguments and config merges the
// partials inside the attention kernel (see fused_combine).
bool LaunchUsesFusedCombine(const VerifyArguments& args, const VerifyLaunchConfig& config);

// Reads the device's multiprocessor count and raises the attention kernel's
// shared-memory limit on it. Call once per device before launching.
absl::StatusOr<VerifyLaunchConfig> PrepareVerifyLaunch(int device);

// Bytes of device workspace LaunchVerifyAttention needs for arguments of this
// shape (batch, heads, max_draft_len); independent of lengths, so one
// workspace serves every replay of a graph.
size_t VerifyWorkspaceBytes(const VerifyArguments& args, const VerifyLaunchConfig& config);

// Prepares a newly allocated workspace for LaunchVerifyAttention (zeroes the
// fused combine's counters, which every launch then leaves zero, and marks it
// initialised), on `stream`. Call once per allocation, with the shape the
// workspace was sized for (VerifyWorkspaceBytes) and the launches' config;
// launches of any batch up to that shape's then find it initialised. A fused
// launch on a workspace that was not initialised stops the kernel with a
// device-side error.
absl::Status InitVerifyWorkspace(const VerifyArguments& args, const VerifyLaunchConfig& config,
                                 void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Enqueues [plan +] attention + combine on `stream`. `workspace` must hold
// VerifyWorkspaceBytes() bytes, have gone through InitVerifyWorkspace once,
// and stay untouched until the launch completes.
// Returns INVALID_ARGUMENT for arguments CanImplement() rejects and INTERNAL
// for a CUDA launch error. Per-request values are trusted: validate them on the
// host (ValidateRequests) before they reach the device.
absl::Status LaunchVerifyAttention(const VerifyArguments& args, const VerifyLaunchConfig& config,
                                   void* workspace, size_t workspace_bytes, cudaStream_t stream);

// The plan the last launch on this workspace chose (device-resident, written
// by the plan): copies it to the host and synchronises the stream. For tests
// and the benchmark's report, not for the serving path.
absl::StatusOr<VerifyPlanSummary> ReadVerifyPlanSummary(const VerifyArguments& args,
                                                        const VerifyLaunchConfig& config,
                                                        const void* workspace, cudaStream_t stream);

// Diagnostics (kernels/phase_stamps.h): from the next launch on, every
// attention and combine CTA writes its phase times to `device_stamps`
// ([grid CTAs][kPhaseSlots] uint64 ns; null stops it). FAILED_PRECONDITION
// in a build without the CMake option MLAVERIFY_PHASE_STAMPS. Not for serving:
// the stamps build's kernels differ from the default build's.
absl::Status SetVerifyPhaseStamps(unsigned long long* device_stamps);

absl::Status LaunchWriteDraftKv(const DraftKvWriteArguments& args, cudaStream_t stream);

// Copies rows [num_layers, count, 576] (device memory) into (to_pool) or out
// of positions start..start+count-1 of one sequence, every layer of `pool`.
// Into an fp8 pool the bf16 rows are quantized (common/kv_dtype.h); out of
// one they come as stored ([num_layers, count, 656 bytes]).
// `page_table` is the sequence's device-resident page list.
absl::Status LaunchCopyRows(const KvPoolView& pool, const int32_t* page_table, int64_t start,
                            int64_t count, Bf16* rows, bool to_pool, cudaStream_t stream);
absl::Status LaunchCompactAcceptedKv(const CompactArguments& args, cudaStream_t stream);

// The copy-list kernels (copy_list.h): the gather runs the list in the ring
// slot its cursor names and advances the cursor; the scatter runs a list in
// device memory. INVALID_ARGUMENT for a null pointer or a grid beyond CUDA's
// limits.
absl::Status LaunchGatherCopies(const GatherParams& params, cudaStream_t stream);
absl::Status LaunchScatterCopies(const ScatterParams& params, cudaStream_t stream);

}  // namespace mlaverify::kernels

#endif  // MLAVERIFY_KERNELS_VERIFY_ATTENTION_CUDA_H_
