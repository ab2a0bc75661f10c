#include "common/draft_tree.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace mlaverify {

absl::Status ValidateDraftTree(absl::Span<const int32_t> parents) {
  if (parents.empty()) {
    return absl::InvalidArgumentError("draft tree is empty: need at least one draft");
  }
  if (parents.size() > static_cast<size_t>(kMaxDraftLen)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "draft tree has ", parents.size(), " drafts; at most ", kMaxDraftLen, " are supported"));
  }
  for (size_t i = 0; i < parents.size(); ++i) {
    const int32_t p = parents[i];
    if (p < -1 || p >= static_cast<int32_t>(i)) {
      return absl::InvalidArgumentError(
          absl::StrCat("parents[", i, "] = ", p,
                       ": a parent must be -1 (hangs off the prefix) or an earlier draft in 0..",
                       static_cast<int64_t>(i) - 1));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint64_t>> BuildVisibility(absl::Span<const int32_t> parents) {
  RETURN_IF_ERROR(ValidateDraftTree(parents));
  std::vector<uint64_t> words(parents.size());
  for (size_t i = 0; i < parents.size(); ++i) {
    // Parents precede children, so the parent's word is already complete.
    const uint64_t self = uint64_t{1} << i;
    words[i] = parents[i] < 0 ? self : (words[parents[i]] | self);
  }
  return words;
}

absl::Status ValidateAcceptedPath(absl::Span<const int32_t> parents,
                                  absl::Span<const int32_t> accepted) {
  const int32_t n = static_cast<int32_t>(parents.size());
  int32_t previous = -1;
  for (size_t t = 0; t < accepted.size(); ++t) {
    const int32_t a = accepted[t];
    if (a < 0 || a >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("accepted[", t, "] = ", a, " is not a draft index in 0..", n - 1));
    }
    if (parents[a] != previous) {
      return absl::InvalidArgumentError(absl::StrCat(
          "accepted[", t, "] = ", a, " has parent ", parents[a], " but the path needs parent ",
          previous, ": the accepted drafts must form a path from a root of the tree"));
    }
    previous = a;
  }
  return absl::OkStatus();
}

}  // namespace mlaverify
