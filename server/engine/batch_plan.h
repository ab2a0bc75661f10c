// Pure decisions of a device worker, kept apart so they are tested alone:
// which graph bucket a batch runs in, and whether a launch may reuse the plan
// of the launch before it.
#ifndef MLAVERIFY_SERVER_ENGINE_BATCH_PLAN_H_
#define MLAVERIFY_SERVER_ENGINE_BATCH_PLAN_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/types/span.h"
#include "server/engine/device.h"

namespace mlaverify::engine {

// The smallest (batch bucket, draft bucket) pair that holds `requests`
// requests of at most `max_draft_len` drafts: the bucket a graph replay pads
// the batch up to. nullopt when none does (more requests than the largest
// batch bucket, or a longer draft than the largest draft bucket). Buckets are
// strictly increasing.
std::optional<BatchShape> ChooseBucket(absl::Span<const int> batch_buckets,
                                       absl::Span<const int> draft_buckets, int requests,
                                       int max_draft_len);

// What the attention's plan depends on besides the device and its config
// (kernels::VerifyLaunchConfig::reuse_plan): the launch shape and every
// request's prefix and draft length, padding included. The layers of one
// verify step of one batch share it; anything in between changes it.
class PlanFingerprint {
 public:
  // Whether the workspace holds the plan a launch of `shape` with these
  // lengths would make (the previous launch had the same).
  bool Matches(BatchShape shape, absl::Span<const int32_t> prefix_len,
               absl::Span<const int32_t> draft_len) const;
  // A launch with these was issued; later launches on the same workspace
  // find its plan there.
  void Record(BatchShape shape, absl::Span<const int32_t> prefix_len,
              absl::Span<const int32_t> draft_len);
  // A launch failed or the workspace is in an unknown state: plan again.
  void Clear() { valid_ = false; }

 private:
  bool valid_ = false;
  BatchShape shape_;
  std::vector<int32_t> prefix_len_, draft_len_;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_BATCH_PLAN_H_
