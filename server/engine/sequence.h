// One sequence of the engine: its committed length, its pages, the verify
// step open on it and what its devices know of its page list. Every field
// that changes is guarded by `mu`; the methods that need it say so, and the
// thread-safety analysis checks their callers (SequenceLocks, taken in a
// loop, is the one place beyond it: code under it asserts each lock).
#ifndef MLAVERIFY_SERVER_ENGINE_SEQUENCE_H_
#define MLAVERIFY_SERVER_ENGINE_SEQUENCE_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/engine/page_table_arena.h"

namespace mlaverify::engine {

int64_t NowNanos();

struct Sequence {
  Sequence(uint64_t id_in, std::string label_in, int pool_in)
      : id(id_in), label(std::move(label_in)), pool(pool_in) {}

  const uint64_t id;
  const std::string label;  // as the client sent it: escape before logging
  const int pool;           // allocator (and, in DP mode, device) index
  // Read without the lock by ExpireIdle's scan; re-checked under it.
  std::atomic<int64_t> last_used_ns{NowNanos()};
  // Calls submitted for this sequence and not finished: a sequence with work
  // in flight is never idle, however long that work runs.
  std::atomic<int> calls_in_flight{0};

  absl::Mutex mu;
  bool released ABSL_GUARDED_BY(mu) = false;
  // Not OK once a device failed in a way that left the KV unlike what the
  // calls said (a lost write): every later call gets this status.
  absl::Status broken ABSL_GUARDED_BY(mu);
  int64_t length ABSL_GUARDED_BY(mu) = 0;  // committed tokens P
  std::vector<int32_t> pages ABSL_GUARDED_BY(mu);
  // Device calls submitted for this sequence (numbers them: a call queued as
  // number k is the last one iff ops_submitted == k).
  uint64_t ops_submitted ABSL_GUARDED_BY(mu) = 0;
  // The open verify step, if any.
  bool pending ABSL_GUARDED_BY(mu) = false;
  uint64_t step ABSL_GUARDED_BY(mu) = 0;  // numbers steps; increments as one opens
  std::vector<int32_t> parents ABSL_GUARDED_BY(mu);
  std::shared_ptr<const std::vector<uint64_t>> visibility ABSL_GUARDED_BY(mu);
  std::vector<bool> layer_verified ABSL_GUARDED_BY(mu);
  int layers_verified ABSL_GUARDED_BY(mu) = 0;
  int64_t step_pages ABSL_GUARDED_BY(mu) = 0;  // pages the open step added
  // The device-driven step (steps.h) that claimed the sequence; 0: none.
  // While set, no Verify or AppendKv reaches the sequence, and Commit only
  // once every layer of the step ran.
  uint64_t owner_step ABSL_GUARDED_BY(mu) = 0;
  // The devices' copy of `pages` (page_table_arena.h): the length they know
  // of after the work queued so far, and the shortest `pages` has been since
  // the last change was sent (entries below it are as they have them).
  int64_t device_pages ABSL_GUARDED_BY(mu) = 0;
  int64_t low_water ABSL_GUARDED_BY(mu) = 0;

  // The pages a step of `n` drafts needs beyond those held, or
  // RESOURCE_EXHAUSTED when P + n passes `max_sequence_len`.
  absl::StatusOr<int64_t> PagesToOpenStep(int64_t n, int page_size, int64_t max_sequence_len) const
      ABSL_SHARED_LOCKS_REQUIRED(mu);
  // Opens a step of `parents` (with their visibility words) over `fresh`,
  // the pages PagesToOpenStep asked for; no layer verified yet. Shared by a
  // first Verify and a device-driven step's claim.
  void OpenStep(absl::Span<const int32_t> fresh, absl::Span<const int32_t> parents,
                std::shared_ptr<const std::vector<uint64_t>> visibility, int num_layers)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Closes the open step unrun: its pages come off the end of `pages` and
  // are returned (free them at once: nothing ran on them).
  std::vector<int32_t> CloseStepUnrun() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // The page-list change the sequence's next device work carries (null:
  // none); the devices' copy then counts as up to date.
  std::shared_ptr<const TableDelta> TakeDelta() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Marks the sequence released and detaches its pages (freed once the
  // devices passed the release). `*had_step`: a step was open.
  std::vector<int32_t> MarkReleased(bool* had_step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // `pages` lost its entries from `size` on.
  void Trimmed(size_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    low_water = std::min(low_water, static_cast<int64_t>(size));
  }

  void Touch() { last_used_ns.store(NowNanos(), std::memory_order_relaxed); }
  // A call on the sequence was submitted (under `mu`) / finished.
  void CallStarted() {
    Touch();
    calls_in_flight.fetch_add(1, std::memory_order_relaxed);
  }
  void CallEnded() {
    Touch();  // the end of a long call is use too; seen by whoever sees the count drop
    calls_in_flight.fetch_sub(1, std::memory_order_release);
  }
  // Unused since `cutoff` (nanoseconds) with nothing in flight.
  bool IdleSince(int64_t cutoff) const {
    return calls_in_flight.load(std::memory_order_acquire) == 0 &&
           last_used_ns.load(std::memory_order_relaxed) < cutoff;
  }
};

// Holds the locks of several sequences, taken in id order (no deadlock with
// another call locking an overlapping set). Locks taken in a loop are beyond
// the thread-safety analysis: code under them asserts each one it relies on.
class SequenceLocks {
 public:
  explicit SequenceLocks(const std::vector<std::shared_ptr<Sequence>>& seqs)
      ABSL_NO_THREAD_SAFETY_ANALYSIS : seqs_(seqs) {
    std::vector<Sequence*> order;
    for (const auto& seq : seqs_) order.push_back(seq.get());
    std::sort(order.begin(), order.end(),
              [](const Sequence* a, const Sequence* b) { return a->id < b->id; });
    for (Sequence* seq : order) seq->mu.Lock();
  }
  ~SequenceLocks() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    for (const auto& seq : seqs_) seq->mu.Unlock();
  }
  SequenceLocks(const SequenceLocks&) = delete;
  SequenceLocks& operator=(const SequenceLocks&) = delete;

 private:
  const std::vector<std::shared_ptr<Sequence>>& seqs_;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_SEQUENCE_H_
