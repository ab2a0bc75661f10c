// The draft tree of one verify step: validation and the per-row visibility
// words the attention kernels consume.
#ifndef MLAVERIFY_COMMON_DRAFT_TREE_H_
#define MLAVERIFY_COMMON_DRAFT_TREE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/geometry.h"

namespace mlaverify {

// Checks that `parents` describes a forest whose parents come before their
// children (parents[i] in {-1, 0..i-1}) and that it holds 1..kMaxDraftLen
// drafts. Returns INVALID_ARGUMENT naming the first offending index.
absl::Status ValidateDraftTree(absl::Span<const int32_t> parents);

// For a valid tree, returns one word per draft: bit a of word i is set when
// draft a is draft i itself or one of its ancestors, i.e. when the key at
// position P + a is visible to query token i. A chain (parents[i] = i - 1)
// gives the causal lower triangle.
absl::StatusOr<std::vector<uint64_t>> BuildVisibility(absl::Span<const int32_t> parents);

// Checks that `accepted` is a path that starts at a root of the tree and
// steps from each node to one of its children (accepted[0] has parent -1,
// parents[accepted[t]] == accepted[t-1]). An empty path is valid (nothing
// accepted). INVALID_ARGUMENT otherwise.
absl::Status ValidateAcceptedPath(absl::Span<const int32_t> parents,
                                  absl::Span<const int32_t> accepted);

}  // namespace mlaverify

#endif  // MLAVERIFY_COMMON_DRAFT_TREE_H_
