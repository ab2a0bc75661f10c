// The page tables of one device's sequences, kept on the device: one int32
// arena in device memory in which every sequence has a contiguous range
// (capacity a power of two, at least 16 entries), and this host-side mirror
// of it that decides where each sequence's range is and which entries a
// launch must write.
//
// The engine tells the worker how a sequence's page list changed since its
// previous device work (a TableDelta, carried by that work in queue order);
// Apply brings the mirror up to date and queues the device writes: the new
// entries (values the worker stages in the launch's slot) and, when the list
// outgrew its range, a move of the kept entries to a range twice as large
// (a device-to-device copy). A range given up (a move, a release) is reused
// only by launches after the current one: batches run in stream order, so no
// launch still reads it then. Should the arena be too fragmented for a new
// range, Compact() lays every sequence out again from the mirror and the
// worker uploads the whole arena (rare: the arena has room for twice every
// page of the pool).
//
// Used by one device worker's launcher only (not thread-safe).
#ifndef MLAVERIFY_SERVER_ENGINE_PAGE_TABLE_ARENA_H_
#define MLAVERIFY_SERVER_ENGINE_PAGE_TABLE_ARENA_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"

namespace mlaverify::engine {

// How a sequence's page list changed since the last delta sent for it:
// entries [0, keep) are as the devices have them, then `values` follow; the
// list is keep + values.size() long. Shared by the devices of a sequence.
struct TableDelta {
  int64_t keep = 0;
  std::vector<int32_t> values;
};

// A device write the launch must make before the kernels read the tables.
struct TableWrite {
  int64_t at = 0;      // arena entry written first
  int64_t count = 0;   // entries
  int64_t from = -1;   // >= 0: copy `count` entries from arena entry `from` (a move)
  int64_t value = -1;  // else: the values are entries [value, value + count) of values()
};

class PageTableArena {
 public:
  explicit PageTableArena(int64_t entries);

  // The entries the arena for `num_pages` pool pages, `max_sequences` live
  // sequences and lists of `max_pages_per_sequence` pages holds.
  static int64_t EntriesFor(int64_t num_pages, int64_t max_sequences,
                            int64_t max_pages_per_sequence);

  // Brings `sequence`'s list up to date. Never fails for lack of room: when
  // the arena is too fragmented it compacts (needs_full_upload() then).
  // INTERNAL when the delta contradicts the mirror (a bug).
  absl::Status Apply(uint64_t sequence, const TableDelta& delta);
  // Forgets a released sequence.
  void Release(uint64_t sequence);

  // Where `sequence`'s entries start (-1: unknown sequence).
  int64_t OffsetOf(uint64_t sequence) const;
  // The sequence's entries as the mirror has them (nullptr: unknown), and
  // where they start in `offset` when given (one lookup for both).
  const std::vector<int32_t>* Entries(uint64_t sequence, int64_t* offset = nullptr) const;

  // The writes queued since the last TakeWrites, and the values they name.
  // Taking them ends the launch they belong to: ranges given up before it
  // become reusable.
  void TakeWrites(std::vector<TableWrite>* writes, std::vector<int32_t>* values);
  // After a compaction: the whole arena must be uploaded (entries() below)
  // before the next launch; queued writes are void. Cleared by TakeWrites.
  bool needs_full_upload() const { return full_upload_; }
  // The arena as the mirror has it (for the full upload; entries of no
  // sequence are 0).
  std::vector<int32_t> Snapshot() const;

  int64_t entries() const { return entries_; }
  int64_t sequences() const { return static_cast<int64_t>(sequences_.size()); }
  int64_t used_entries() const { return used_; }

 private:
  struct Sequence {
    int64_t offset = -1;
    int64_t capacity = 0;
    std::vector<int32_t> list;
  };
  // A free range of `capacity`, or -1.
  int64_t Allocate(int64_t capacity);
  void FreeLater(int64_t offset, int64_t capacity);
  void FreeNow(int64_t offset, int64_t capacity);
  // False when the ranges do not fit even back to back (a sizing bug).
  bool Compact();

  const int64_t entries_;
  absl::flat_hash_map<uint64_t, Sequence> sequences_;
  std::map<int64_t, int64_t> free_;                         // offset -> entries, coalesced
  std::vector<std::pair<int64_t, int64_t>> freed_pending_;  // reusable after this launch
  std::vector<TableWrite> writes_;
  std::vector<int32_t> values_;
  bool full_upload_ = false;
  int64_t used_ = 0;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_PAGE_TABLE_ARENA_H_
