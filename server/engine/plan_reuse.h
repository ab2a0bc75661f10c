// When a verify launch may reuse the plan the previous launch left in the
// workspace (kernels::VerifyLaunchConfig::reuse_plan).
//
// The kernel's plan depends on the batch, the requests' prefix and draft
// lengths, the heads, the workspace's shape and the launch config. A backend
// fixes all but the first three for its lifetime, so consecutive launches on
// its workspace with equal lengths share one plan: the 61 layers of one
// verify step of one batch. Any other launch in between (another sequence,
// the next step) changes the lengths and plans again. A launch that failed
// leaves no plan anyone may trust.
#ifndef MLAVERIFY_SERVER_ENGINE_PLAN_REUSE_H_
#define MLAVERIFY_SERVER_ENGINE_PLAN_REUSE_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace mlaverify::engine {

class PlanReuseTracker {
 public:
  // Whether the workspace holds the plan of a launch with these lengths.
  bool CanReuse(absl::Span<const int32_t> prefix_len, absl::Span<const int32_t> draft_len) const {
    return valid_ && prefix_len == absl::MakeConstSpan(prefix_len_) &&
           draft_len == absl::MakeConstSpan(draft_len_);
  }
  // A launch with these lengths was enqueued and completed: its plan is in
  // the workspace.
  void Planned(absl::Span<const int32_t> prefix_len, absl::Span<const int32_t> draft_len) {
    prefix_len_.assign(prefix_len.begin(), prefix_len.end());
    draft_len_.assign(draft_len.begin(), draft_len.end());
    valid_ = true;
  }
  // A launch failed (or never ran): plan the next one.
  void Invalidate() { valid_ = false; }

 private:
  bool valid_ = false;
  std::vector<int32_t> prefix_len_;
  std::vector<int32_t> draft_len_;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_PLAN_REUSE_H_
