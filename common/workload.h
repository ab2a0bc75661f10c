// Random speculative-decoding workloads for the client's demo and load
// generator, the engine benchmark and the tests: draft trees, accepted paths
// and bf16 fills. Deterministic for a
// given std::mt19937_64 state, so a failing run can be replayed by its seed.
#ifndef MLAVERIFY_COMMON_WORKLOAD_H_
#define MLAVERIFY_COMMON_WORKLOAD_H_

#include <cstdint>
#include <random>
#include <vector>

#include "absl/types/span.h"
#include "common/bf16.h"

namespace mlaverify {

// A random draft forest of n >= 1 nodes with parents before children:
// parents[i] = i - 1 with probability 1/2 (long chains, as real drafters
// produce), else uniform in {-1, 0..i-1} (branching and extra roots).
std::vector<int32_t> RandomDraftTree(std::mt19937_64& rng, int n);

// The root-to-node path ending at `node` (node included), root first: what a
// scheduler commits when `node` is the last accepted draft.
std::vector<int32_t> PathToNode(absl::Span<const int32_t> parents, int32_t node);

// Depth of each node (roots have depth 1).
std::vector<int> NodeDepths(absl::Span<const int32_t> parents);

// A random accepted path: empty (every draft rejected) with probability 1/4,
// the longest root-to-node path with probability 1/4, else the path to a
// uniformly chosen node. Always valid for mlaverify::ValidateAcceptedPath.
std::vector<int32_t> RandomAcceptedPath(std::mt19937_64& rng, absl::Span<const int32_t> parents);

// Fills `values` with bf16 roundings of uniform draws from [lo, hi].
void FillUniformBf16(std::mt19937_64& rng, float lo, float hi, absl::Span<Bf16> values);

// `n` bf16 roundings of uniform draws from [-range, range].
std::vector<Bf16> RandomBf16(std::mt19937_64& rng, size_t n, float range);

}  // namespace mlaverify

#endif  // MLAVERIFY_COMMON_WORKLOAD_H_
