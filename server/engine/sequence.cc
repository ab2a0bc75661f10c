#include "server/engine/sequence.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace mlaverify::engine {

int64_t NowNanos() { return absl::ToUnixNanos(absl::Now()); }

absl::StatusOr<int64_t> Sequence::PagesToOpenStep(int64_t n, int page_size,
                                                  int64_t max_sequence_len) const {
  if (length + n > max_sequence_len) {
    return absl::ResourceExhaustedError(absl::StrCat("sequence ", id, " would reach ", length + n,
                                                     " tokens; max_sequence_len is ",
                                                     max_sequence_len));
  }
  const int64_t needed = (length + n + page_size - 1) / page_size;
  return std::max<int64_t>(0, needed - static_cast<int64_t>(pages.size()));
}

void Sequence::OpenStep(absl::Span<const int32_t> fresh, absl::Span<const int32_t> step_parents,
                        std::shared_ptr<const std::vector<uint64_t>> step_visibility,
                        int num_layers) {
  pages.insert(pages.end(), fresh.begin(), fresh.end());
  step_pages = static_cast<int64_t>(fresh.size());
  pending = true;
  ++step;
  parents.assign(step_parents.begin(), step_parents.end());
  visibility = std::move(step_visibility);
  layer_verified.assign(num_layers, false);
  layers_verified = 0;
}

std::vector<int32_t> Sequence::CloseStepUnrun() {
  std::vector<int32_t> freed(pages.end() - step_pages, pages.end());
  pages.resize(pages.size() - step_pages);
  Trimmed(pages.size());
  step_pages = 0;
  pending = false;
  parents.clear();
  visibility.reset();
  layer_verified.clear();
  layers_verified = 0;
  return freed;
}

std::shared_ptr<const TableDelta> Sequence::TakeDelta() {
  const int64_t size = static_cast<int64_t>(pages.size());
  if (low_water == device_pages && device_pages == size) return nullptr;
  auto delta = std::make_shared<TableDelta>();
  delta->keep = std::min(low_water, device_pages);
  delta->values.assign(pages.begin() + delta->keep, pages.end());
  device_pages = low_water = size;
  return delta;
}

std::vector<int32_t> Sequence::MarkReleased(bool* had_step) {
  *had_step = pending;
  std::vector<int32_t> detached = std::move(pages);
  pages.clear();
  pending = false;
  released = true;
  return detached;
}

}  // namespace mlaverify::engine
