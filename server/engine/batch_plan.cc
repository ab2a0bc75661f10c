#include "server/engine/batch_plan.h"

#include <algorithm>

namespace mlaverify::engine {

std::optional<BatchShape> ChooseBucket(absl::Span<const int> batch_buckets,
                                       absl::Span<const int> draft_buckets, int requests,
                                       int max_draft_len) {
  const auto b = std::lower_bound(batch_buckets.begin(), batch_buckets.end(), requests);
  const auto n = std::lower_bound(draft_buckets.begin(), draft_buckets.end(), max_draft_len);
  if (b == batch_buckets.end() || n == draft_buckets.end()) return std::nullopt;
  return BatchShape{*b, *n};
}

bool PlanFingerprint::Matches(BatchShape shape, absl::Span<const int32_t> prefix_len,
                              absl::Span<const int32_t> draft_len) const {
  return valid_ && shape == shape_ && prefix_len == absl::MakeConstSpan(prefix_len_) &&
         draft_len == absl::MakeConstSpan(draft_len_);
}

void PlanFingerprint::Record(BatchShape shape, absl::Span<const int32_t> prefix_len,
                             absl::Span<const int32_t> draft_len) {
  shape_ = shape;
  prefix_len_.assign(prefix_len.begin(), prefix_len.end());
  draft_len_.assign(draft_len.begin(), draft_len.end());
  valid_ = true;
}

}  // namespace mlaverify::engine
