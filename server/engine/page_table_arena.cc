#include "server/engine/page_table_arena.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/engine/free_ranges.h"

namespace mlaverify::engine {
namespace {

constexpr int64_t kMinCapacity = 16;

int64_t CapacityFor(int64_t count) {
  int64_t capacity = kMinCapacity;
  while (capacity < count) capacity *= 2;
  return capacity;
}

}  // namespace

PageTableArena::PageTableArena(int64_t entries) : entries_(entries) {
  if (entries_ > 0) free_.emplace(0, entries_);
}

int64_t PageTableArena::EntriesFor(int64_t num_pages, int64_t max_sequences,
                                   int64_t max_pages_per_sequence) {
  // A range is at most max(16, 2 x its list), and every page belongs to one
  // list: the sum of all ranges fits, so a compaction always succeeds; the
  // last term leaves room for the moves of one batch before the ranges they
  // give up are reused.
  return 2 * num_pages + kMinCapacity * max_sequences + 4 * CapacityFor(max_pages_per_sequence);
}

absl::Status PageTableArena::Apply(uint64_t sequence, const TableDelta& delta) {
  Sequence& s = sequences_[sequence];
  if (delta.keep < 0 || delta.keep > static_cast<int64_t>(s.list.size())) {
    return absl::InternalError(absl::StrCat("page table of sequence ", sequence,
                                            ": a change keeps ", delta.keep, " entries of ",
                                            s.list.size()));
  }
  used_ -= static_cast<int64_t>(s.list.size());
  s.list.resize(static_cast<size_t>(delta.keep));
  s.list.insert(s.list.end(), delta.values.begin(), delta.values.end());
  used_ += static_cast<int64_t>(s.list.size());
  const int64_t count = static_cast<int64_t>(s.list.size());
  if (count > s.capacity) {
    const int64_t capacity = CapacityFor(count);
    int64_t offset = Allocate(capacity);
    if (offset < 0) {
      // Too fragmented: lay everything out again (this sequence with its new
      // capacity too) and upload the whole arena.
      FreeLater(s.offset, s.capacity);
      s.offset = -1;
      s.capacity = capacity;
      if (!Compact()) {
        return absl::InternalError(absl::StrCat("page-table arena of ", entries_,
                                                " entries cannot hold the live sequences' tables"));
      }
      return absl::OkStatus();
    }
    if (s.offset >= 0 && delta.keep > 0 && !full_upload_) {
      writes_.push_back({offset, delta.keep, s.offset, -1});
    }
    FreeLater(s.offset, s.capacity);
    s.offset = offset;
    s.capacity = capacity;
  }
  if (!delta.values.empty() && !full_upload_) {
    writes_.push_back({s.offset + delta.keep, static_cast<int64_t>(delta.values.size()), -1,
                       static_cast<int64_t>(values_.size())});
    values_.insert(values_.end(), delta.values.begin(), delta.values.end());
  }
  return absl::OkStatus();
}

void PageTableArena::Release(uint64_t sequence) {
  const auto it = sequences_.find(sequence);
  if (it == sequences_.end()) return;
  used_ -= static_cast<int64_t>(it->second.list.size());
  FreeLater(it->second.offset, it->second.capacity);
  sequences_.erase(it);
}

int64_t PageTableArena::OffsetOf(uint64_t sequence) const {
  const auto it = sequences_.find(sequence);
  return it == sequences_.end() ? -1 : it->second.offset;
}

const std::vector<int32_t>* PageTableArena::Entries(uint64_t sequence, int64_t* offset) const {
  const auto it = sequences_.find(sequence);
  if (it == sequences_.end()) return nullptr;
  if (offset != nullptr) *offset = it->second.offset;
  return &it->second.list;
}

void PageTableArena::TakeWrites(std::vector<TableWrite>* writes, std::vector<int32_t>* values) {
  writes->clear();
  values->clear();
  writes->swap(writes_);
  values->swap(values_);
  for (const auto& [offset, capacity] : freed_pending_) FreeNow(offset, capacity);
  freed_pending_.clear();
  full_upload_ = false;
}

std::vector<int32_t> PageTableArena::Snapshot() const {
  std::vector<int32_t> out(static_cast<size_t>(entries_), 0);
  for (const auto& [id, s] : sequences_) {
    if (s.offset >= 0) std::copy(s.list.begin(), s.list.end(), out.begin() + s.offset);
  }
  return out;
}

int64_t PageTableArena::Allocate(int64_t capacity) {
  // Best fit: the smallest free range that holds it.
  auto best = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second >= capacity && (best == free_.end() || it->second < best->second)) best = it;
  }
  if (best == free_.end()) return -1;
  const int64_t offset = best->first;
  const int64_t left = best->second - capacity;
  free_.erase(best);
  if (left > 0) free_.emplace(offset + capacity, left);
  return offset;
}

void PageTableArena::FreeLater(int64_t offset, int64_t capacity) {
  if (offset >= 0 && capacity > 0) freed_pending_.emplace_back(offset, capacity);
}

void PageTableArena::FreeNow(int64_t offset, int64_t capacity) {
  InsertFreeRange(&free_, offset, capacity);
}

bool PageTableArena::Compact() {
  // Every range is given a new place, back to back from entry 0; the upload
  // of the whole arena replaces every write queued so far.
  std::vector<Sequence*> order;
  for (auto& [id, s] : sequences_) {
    if (s.capacity > 0) order.push_back(&s);
  }
  std::sort(order.begin(), order.end(),
            [](const Sequence* a, const Sequence* b) { return a->capacity > b->capacity; });
  int64_t at = 0;
  for (Sequence* s : order) {
    s->offset = at;
    at += s->capacity;
  }
  free_.clear();
  freed_pending_.clear();
  if (at < entries_) free_.emplace(at, entries_ - at);
  writes_.clear();
  values_.clear();
  full_upload_ = true;
  return at <= entries_;
}

}  // namespace mlaverify::engine
