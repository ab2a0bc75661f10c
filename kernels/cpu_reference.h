// CPU implementations of the kernels' math: the CPU backend's compute path and
// the oracle every GPU test compares against. They take the same argument
// structs as the CUDA launches, with host pointers.
#ifndef MLAVERIFY_KERNELS_CPU_REFERENCE_H_
#define MLAVERIFY_KERNELS_CPU_REFERENCE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/kv_cache.h"
#include "kernels/verify_attention.h"

namespace mlaverify::kernels {

// Verify attention with fp32 accumulation over the bf16 queries and the pool
// rows as stored (an fp8 pool's rows dequantized, common/kv_dtype.h) and a
// natural-log LSE. Validates the arguments first (CanImplement +
// ValidateRequests); writes out/lse only on success. `num_threads` <= 0 uses
// every hardware thread.
absl::Status VerifyAttentionCpu(const VerifyArguments& args, int num_threads = 0);

// A query row of one request: the draft's row in q (sum of earlier draft_len
// plus the draft's index) and the head.
struct ReferenceRow {
  int64_t token_row;
  int head;
};

// fp32 outputs of selected rows of request b, for spot checks of problems too
// large to compute whole: out receives [rows.size(), 512], lse [rows.size()].
// The request's keys are converted once; rows run in parallel. Arguments must
// already be valid.
void VerifyAttentionRowsCpu(const VerifyArguments& args, int b, absl::Span<const ReferenceRow> rows,
                            float* out, float* lse, int num_threads = 0);

// Writes each request's draft rows into the pool at positions P..P+N-1 of its
// layer, quantized when the pool is fp8 (StoreLatentRow). Validates first; the
// caller has checked the rows are finite.
absl::Status WriteDraftKvCpu(const DraftKvWriteArguments& args);

// Moves each request's accepted drafts to P..P+k-1 in every layer.
// Validates first.
absl::Status CompactAcceptedKvCpu(const CompactArguments& args);

}  // namespace mlaverify::kernels

#endif  // MLAVERIFY_KERNELS_CPU_REFERENCE_H_
