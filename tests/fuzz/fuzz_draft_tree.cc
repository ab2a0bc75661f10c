// libFuzzer target: any bytes as a draft tree (int8 parents) and an accepted
// path. Whatever BuildVisibility accepts must give every draft a word with
// its own bit and only earlier drafts' bits, equal to its parent's word plus
// itself; ValidateAcceptedPath must accept exactly the root-to-node paths.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/draft_tree.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const size_t n = data[0] % 80;  // up to 79 drafts: over the limit too
  if (size < 1 + n) return 0;
  std::vector<int32_t> parents(n);
  for (size_t i = 0; i < n; ++i) parents[i] = static_cast<int8_t>(data[1 + i]);
  std::vector<int32_t> accepted;
  for (size_t i = 1 + n; i < size && accepted.size() < 80; ++i) {
    accepted.push_back(static_cast<int8_t>(data[i]));
  }
  auto words = mlaverify::BuildVisibility(parents);
  const bool valid = mlaverify::ValidateDraftTree(parents).ok();
  if (words.ok() != valid) __builtin_trap();
  if (!valid) return 0;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t self = uint64_t{1} << i;
    const uint64_t expected = parents[i] < 0 ? self : ((*words)[parents[i]] | self);
    if ((*words)[i] != expected || ((*words)[i] & ~(self | (self - 1))) != 0) __builtin_trap();
  }
  // A path from a root, each node the child of the previous one.
  bool is_path = true;
  for (size_t t = 0; t < accepted.size(); ++t) {
    const int32_t a = accepted[t];
    if (a < 0 || a >= static_cast<int32_t>(n)) {
      is_path = false;
      break;
    }
    if (parents[a] != (t == 0 ? -1 : accepted[t - 1])) {
      is_path = false;
      break;
    }
  }
  if (mlaverify::ValidateAcceptedPath(parents, accepted).ok() != is_path) __builtin_trap();
  return 0;
}
