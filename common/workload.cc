#include "common/workload.h"

#include <algorithm>

namespace mlaverify {

std::vector<int32_t> RandomDraftTree(std::mt19937_64& rng, int n) {
  std::vector<int32_t> parents(std::max(n, 0));
  std::bernoulli_distribution extend_chain(0.5);
  for (int i = 0; i < n; ++i) {
    if (extend_chain(rng)) {
      parents[i] = i - 1;  // -1 for the first draft: it hangs off the prefix
    } else {
      parents[i] = std::uniform_int_distribution<int32_t>(-1, i - 1)(rng);
    }
  }
  return parents;
}

std::vector<int32_t> PathToNode(absl::Span<const int32_t> parents, int32_t node) {
  std::vector<int32_t> path;
  for (int32_t v = node; v >= 0; v = parents[v]) path.push_back(v);
  std::reverse(path.begin(), path.end());
  return path;
}

std::vector<int> NodeDepths(absl::Span<const int32_t> parents) {
  std::vector<int> depth(parents.size());
  for (size_t i = 0; i < parents.size(); ++i) {
    // Parents precede children, so the parent's depth is known.
    depth[i] = parents[i] < 0 ? 1 : depth[parents[i]] + 1;
  }
  return depth;
}

std::vector<int32_t> RandomAcceptedPath(std::mt19937_64& rng, absl::Span<const int32_t> parents) {
  if (parents.empty()) return {};
  const int choice = std::uniform_int_distribution<int>(0, 3)(rng);
  if (choice == 0) return {};
  if (choice == 1) {
    const std::vector<int> depth = NodeDepths(parents);
    const auto deepest = std::max_element(depth.begin(), depth.end()) - depth.begin();
    return PathToNode(parents, static_cast<int32_t>(deepest));
  }
  const int32_t node =
      std::uniform_int_distribution<int32_t>(0, static_cast<int32_t>(parents.size()) - 1)(rng);
  return PathToNode(parents, node);
}

void FillUniformBf16(std::mt19937_64& rng, float lo, float hi, absl::Span<Bf16> values) {
  std::uniform_real_distribution<float> uniform(lo, hi);
  for (Bf16& v : values) v = FloatToBf16(uniform(rng));
}

std::vector<Bf16> RandomBf16(std::mt19937_64& rng, size_t n, float range) {
  std::vector<Bf16> v(n);
  FillUniformBf16(rng, -range, range, absl::MakeSpan(v));
  return v;
}

}  // namespace mlaverify
