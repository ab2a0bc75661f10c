// How LaunchVerifyAttention carves its device workspace: the fused combine's
// state, the plan arrays and the split partials. Host arithmetic only (no
// CUDA calls), shared by the launchers (verify_attention_cuda.cc) and the
// tests that pin the layout's contract down without a GPU.
#ifndef MLAVERIFY_KERNELS_VERIFY_WORKSPACE_H_
#define MLAVERIFY_KERNELS_VERIFY_WORKSPACE_H_

#include <cstddef>

#include "kernels/verify_attention.h"
#include "kernels/verify_attention_cuda.h"

namespace mlaverify::kernels {

// Byte offsets of the regions, each aligned to 256 bytes, and the total.
// The fused combine's mark and counters come first, at offsets that depend on
// the config only: InitVerifyWorkspace runs once for the largest shape a
// workspace was sized for, and every later launch, of any smaller batch, must
// find them where it wrote them. (They used to follow the batch-sized arrays:
// the engine, which sizes for max_batch and launches the batch at hand, then
// read the mark from the wrong place and trapped; bench/NOTES.md, "Workspace layout".)
struct VerifyWorkspaceLayout {
  size_t fused_magic;           // u64 kFusedWorkspaceMagic once initialised
  size_t split_arrivals;        // u32 [target_ctas]
  size_t split_done;            // u32 [target_ctas]
  size_t summary;               // VerifyPlanSummary
  size_t request_q_row;         // i32 [batch]
  size_t request_stream_start;  // i32 [batch]
  size_t work;                  // VerifyWorkItem [max_work]
  size_t partial_lse;           // f32 [2 * target_ctas, 32]
  size_t partial_out;           // bf16 [2 * target_ctas, 32, 512]
  size_t bytes;
};

// CTAs the split aims to fill the device with (SMs x CTAs per SM).
int VerifyTargetCtas(const VerifyLaunchConfig& config);
// Grid of the attention and combine kernels for a launch of this shape:
// target_ctas, or one CTA per row tile when the batch has more.
int VerifyMaxWork(const VerifyArguments& args, const VerifyLaunchConfig& config);
VerifyWorkspaceLayout VerifyWorkspaceLayoutFor(const VerifyArguments& args,
                                               const VerifyLaunchConfig& config);

}  // namespace mlaverify::kernels

#endif  // MLAVERIFY_KERNELS_VERIFY_WORKSPACE_H_
