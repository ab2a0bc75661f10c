#include "server/engine/call_reservation.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/byte_size_text.h"

namespace mlaverify::engine {

absl::Status AdmissionGate::Enter(int64_t bytes) {
  // A call bigger than the whole budget could never be admitted: saying
  // "retry later" would have a client retry forever.
  if (bytes > max_bytes_) {
    return absl::InvalidArgumentError(
        absl::StrCat("this call holds ", ByteSizeText(bytes), ", more than --max-queued-bytes (",
                     ByteSizeText(max_bytes_), ") admits at once; split it into smaller calls"));
  }
  // Taken first, given back when over a limit: concurrent admissions never
  // exceed the limits together.
  const int64_t calls = calls_.fetch_add(1) + 1;
  const int64_t held = bytes_.fetch_add(bytes) + bytes;
  if (calls > max_calls_ || held > max_bytes_) {
    Leave(bytes);
    return absl::ResourceExhaustedError(
        absl::StrCat("server queue full: ", calls - 1,
                     " calls queued or running and answers not yet read by their streams hold ",
                     ByteSizeText(held - bytes), ", this one needs ", ByteSizeText(bytes),
                     "; limits ", max_calls_, " calls and ", ByteSizeText(max_bytes_),
                     " (--max-queued-calls, --max-queued-bytes): retry later"));
  }
  return absl::OkStatus();
}

void AdmissionGate::Leave(int64_t bytes) {
  calls_.fetch_sub(1);
  bytes_.fetch_sub(bytes);
}

CallReservation::~CallReservation() {
  for (size_t p = 0; p < pages_.size(); ++p) {
    if (!pages_[p].empty()) pools_[p]->Free(pages_[p]);
  }
  if (has_block_) staging_->Free(block_);
  if (admitted_) gate_.Leave(admitted_bytes_);
}

absl::Status CallReservation::Admit(int64_t bytes) {
  absl::Status entered = gate_.Enter(bytes);
  if (!entered.ok()) return entered;
  admitted_ = true;
  admitted_bytes_ = bytes;
  return absl::OkStatus();
}

absl::Status CallReservation::ReserveStaging(size_t bytes, const char* what) {
  absl::StatusOr<HostStaging::Block> block = staging_->Allocate(bytes, what);
  if (!block.ok()) return block.status();
  block_ = *block;
  has_block_ = true;
  return absl::OkStatus();
}

absl::Status CallReservation::ReservePages(absl::Span<const int64_t> per_pool) {
  for (size_t p = 0; p < pools_.size(); ++p) {
    if (per_pool[p] == 0) continue;
    absl::StatusOr<std::vector<int32_t>> got = pools_[p]->Allocate(per_pool[p]);
    if (!got.ok()) {
      // All or none: the pools taken so far go back at once.
      for (size_t q = 0; q < p; ++q) {
        pools_[q]->Free(pages_[q]);
        pages_[q].clear();
      }
      return got.status();
    }
    pages_[p] = *std::move(got);
  }
  return absl::OkStatus();
}

CallReservation::Held CallReservation::Commit() {
  Held held;
  held.admitted_bytes = admitted_bytes_;
  held.staging = block_;
  held.pages = std::move(pages_);
  pages_.assign(pools_.size(), {});
  admitted_ = false;
  has_block_ = false;
  block_ = {};
  return held;
}

}  // namespace mlaverify::engine
