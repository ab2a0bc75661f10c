#include "server/engine/page_allocator.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace mlaverify::engine {

PageAllocator::PageAllocator(int64_t num_pages) : total_(num_pages) {
  free_.reserve(num_pages);
  // Lowest ids on top of the stack: a fresh pool fills from page 0 upwards.
  for (int64_t p = num_pages - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
  allocated_.assign(num_pages, false);
}

absl::StatusOr<std::vector<int32_t>> PageAllocator::Allocate(int64_t count) {
  absl::MutexLock lock(&mu_);
  if (count < 0 || count > static_cast<int64_t>(free_.size())) {
    return absl::ResourceExhaustedError(absl::StrCat("KV pool exhausted: need ", count, " pages, ",
                                                     free_.size(), " of ", total_, " are free"));
  }
  std::vector<int32_t> pages(free_.end() - count, free_.end());
  free_.resize(free_.size() - count);
  for (int32_t p : pages) allocated_[p] = true;
  return pages;
}

void PageAllocator::Free(absl::Span<const int32_t> pages) {
  absl::MutexLock lock(&mu_);
  for (int32_t p : pages) {
    if (p < 0 || p >= total_ || !allocated_[p]) {
      // A page freed twice would be handed to two sequences: stop here.
      // stderr directly: the default logger may write to stdout or be async.
      std::fprintf(stderr, "page allocator: page %d freed but not allocated\n", p);
      spdlog::critical("page allocator: page {} freed but not allocated", p);
      std::abort();
    }
    allocated_[p] = false;
    free_.push_back(p);
  }
}

int64_t PageAllocator::free_pages() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(free_.size());
}

}  // namespace mlaverify::engine
