// Page accounting of the KV pool: which page ids are free. Storage belongs to
// the backend; the engine hands page ids out to sequences through this.
// Thread-safe.
#ifndef MLAVERIFY_SERVER_ENGINE_PAGE_ALLOCATOR_H_
#define MLAVERIFY_SERVER_ENGINE_PAGE_ALLOCATOR_H_

#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace mlaverify::engine {

class PageAllocator {
 public:
  explicit PageAllocator(int64_t num_pages);

  // `count` pages, all or nothing: RESOURCE_EXHAUSTED with the numbers when
  // fewer are free. The most recently freed pages come back first (warm in
  // caches).
  absl::StatusOr<std::vector<int32_t>> Allocate(int64_t count);
  // Returns pages. Freeing a page that is not allocated is a programming
  // error and aborts.
  void Free(absl::Span<const int32_t> pages);

  int64_t total_pages() const { return total_; }
  int64_t free_pages() const;
  int64_t used_pages() const { return total_ - free_pages(); }

 private:
  const int64_t total_;
  mutable absl::Mutex mu_;
  std::vector<int32_t> free_ ABSL_GUARDED_BY(mu_);    // stack of free ids
  std::vector<bool> allocated_ ABSL_GUARDED_BY(mu_);  // double-free detection
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_PAGE_ALLOCATOR_H_
