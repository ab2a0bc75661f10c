// The client's own check of the server's answers: a mirror of each sequence's
// committed latent KV (what the client sent and the server should hold), and
// the comparison of a Verify result with kernels/cpu_reference computed over
// that mirror. Used by `mlaverify-client demo`.
#ifndef MLAVERIFY_CLIENT_REFERENCE_CHECK_H_
#define MLAVERIFY_CLIENT_REFERENCE_CHECK_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/wire.h"
#include "common/bf16.h"
#include "common/kv_dtype.h"

namespace mlaverify::client {

// One sequence's committed KV as the server should hold it: per layer the
// rows of positions 0..length-1, each 576 bf16.
class SequenceMirror {
 public:
  explicit SequenceMirror(int num_layers) : layers_(num_layers) {}

  int num_layers() const { return static_cast<int>(layers_.size()); }
  int64_t length() const { return length_; }
  // [length, 576] rows of `layer`.
  absl::Span<const Bf16> layer_rows(int layer) const { return layers_[layer]; }

  // Mirrors AppendKv: kv [num_layers, tokens, 576].
  void AppendPrompt(absl::Span<const Bf16> kv, int64_t tokens);

  // Mirrors Commit: appends rows accepted[0..k-1] of each layer's draft KV
  // (draft_kv_per_layer[layer] is that layer's [N, 576] as sent to Verify),
  // in path order, to every layer.
  void AppendAccepted(const std::vector<std::vector<Bf16>>& draft_kv_per_layer,
                      absl::Span<const int32_t> accepted);

 private:
  std::vector<std::vector<Bf16>> layers_;
  int64_t length_ = 0;
};

struct ReferenceComparison {
  double rel_err = 0.0;          // ||out - ref|| / ||ref||, in double
  double lse_max_abs_err = 0.0;  // max |lse - ref_lse|
  int64_t non_finite = 0;        // NaN/Inf values in the server's out and lse

  // NaN compares false, so a NaN error never passes.
  bool ok(double max_rel_err, double max_lse_err) const {
    return non_finite == 0 && rel_err <= max_rel_err && lse_max_abs_err <= max_lse_err;
  }
};

// Recomputes one Verify item of `layer` on the CPU (fp32, from
// kernels::VerifyAttentionRowsCpu over the mirror's prefix followed by the
// item's draft rows, each stored as a pool of `kv_dtype` stores it: an fp8
// server's rows are quantized with the same common/kv_dtype.h code) and
// compares the server's `result` with it.
// FAILED_PRECONDITION when the server's prefix_len is not the mirror's length
// (the two disagree on what is committed); INVALID_ARGUMENT when the item
// itself is malformed.
absl::StatusOr<ReferenceComparison> CompareWithReference(
    const SequenceMirror& mirror, int layer, const VerifyItemInput& item, float softmax_scale,
    const VerifyItemResult& result, int num_threads = 0, KvDtype kv_dtype = KvDtype::kBf16);

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_REFERENCE_CHECK_H_
