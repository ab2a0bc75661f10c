#include "server/engine/host_staging.h"

#include <utility>

#include "absl/strings/str_format.h"
#include "server/engine/free_ranges.h"

namespace mlaverify::engine {
namespace {

constexpr size_t kAlign = 256;

std::string Size(size_t bytes) {
  if (bytes < (size_t{1} << 20)) {
    return absl::StrFormat("%.1f KiB", static_cast<double>(bytes) / (1 << 10));
  }
  return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1 << 20));
}

}  // namespace

HostStaging::HostStaging(uint8_t* memory, size_t bytes, std::vector<uint64_t> device,
                         std::function<void(uint8_t*)> release)
    : memory_(memory), bytes_(bytes), device_(std::move(device)), release_(std::move(release)) {
  absl::MutexLock lock(&mu_);
  if (bytes_ > 0) free_.emplace(0, bytes_);
}

HostStaging::~HostStaging() {
  if (release_) release_(memory_);
}

absl::StatusOr<HostStaging::Block> HostStaging::Allocate(size_t bytes, const char* what) {
  const size_t need = (std::max<size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
  absl::MutexLock lock(&mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const size_t offset = it->first;
    const size_t left = it->second - need;
    free_.erase(it);
    if (left > 0) free_.emplace(offset + need, left);
    in_use_ += need;
    return Block{memory_ + offset, need};
  }
  return absl::ResourceExhaustedError(absl::StrFormat(
      "pinned staging full: %s needs %s of page-locked host memory, %s of %s are in use by "
      "calls in flight (--pinned-staging-bytes): retry later, or use shared memory",
      what, Size(need), Size(in_use_), Size(bytes_)));
}

void HostStaging::Free(const Block& block) {
  if (block.host == nullptr) return;
  absl::MutexLock lock(&mu_);
  in_use_ -= block.bytes;
  InsertFreeRange(&free_, static_cast<size_t>(block.host - memory_), block.bytes);
}

size_t HostStaging::in_use() const {
  absl::MutexLock lock(&mu_);
  return in_use_;
}

}  // namespace mlaverify::engine
