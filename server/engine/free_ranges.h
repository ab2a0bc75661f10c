// A free list of ranges kept as offset -> size, coalesced: shared by the
// host staging (bytes) and the device page-table arena (entries).
#ifndef MLAVERIFY_SERVER_ENGINE_FREE_RANGES_H_
#define MLAVERIFY_SERVER_ENGINE_FREE_RANGES_H_

#include <iterator>
#include <map>

namespace mlaverify::engine {

// Puts [offset, offset + size) back into `free`, merged with the free ranges
// it touches.
template <typename Int>
void InsertFreeRange(std::map<Int, Int>* free, Int offset, Int size) {
  auto next = free->lower_bound(offset);
  if (next != free->begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      size += prev->second;
      free->erase(prev);
    }
  }
  if (next != free->end() && offset + size == next->first) {
    size += next->second;
    free->erase(next);
  }
  free->emplace(offset, size);
}

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_FREE_RANGES_H_
