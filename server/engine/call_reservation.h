// The second room of a call's life: what a call holds from the moment it is
// admitted until it is queued, and, once queued, until it finished.
//
// AdmissionGate bounds the work queued or running (--max-queued-calls,
// --max-queued-bytes). CallReservation is one call's claim on the gate, on
// fresh pages of the pools and on a host staging block, taken in that order
// and given back together, in reverse, by its destructor: a submission that
// fails half way unwinds nothing by hand. Commit() hands what it holds to the
// call, which gives it back when it finished.
#ifndef MLAVERIFY_SERVER_ENGINE_CALL_RESERVATION_H_
#define MLAVERIFY_SERVER_ENGINE_CALL_RESERVATION_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/engine/host_staging.h"
#include "server/engine/page_allocator.h"

namespace mlaverify::engine {

// Counts the calls admitted and not finished and the host bytes they (and
// answers not yet read) hold. Lock-free: every call passes it twice.
class AdmissionGate {
 public:
  AdmissionGate(int64_t max_calls, int64_t max_bytes)
      : max_calls_(max_calls), max_bytes_(max_bytes) {}

  // Room for one call holding `bytes`: INVALID_ARGUMENT when the call is
  // bigger than the whole byte budget (it could never be admitted),
  // RESOURCE_EXHAUSTED when the queue is full now. Every OK is paired with
  // one Leave(bytes).
  absl::Status Enter(int64_t bytes);
  void Leave(int64_t bytes);
  // A call that holds no bytes and must never be refused (a release's
  // barrier); paired with Leave(0).
  void EnterUnrefused() { calls_.fetch_add(1); }
  // Bytes a caller keeps for finished calls (a stream's unread answers).
  void HoldBytes(int64_t bytes) { bytes_.fetch_add(bytes); }
  void ReleaseBytes(int64_t bytes) { bytes_.fetch_sub(bytes); }

  int64_t calls() const { return calls_.load(); }
  int64_t bytes() const { return bytes_.load(); }

 private:
  const int64_t max_calls_;
  const int64_t max_bytes_;
  std::atomic<int64_t> calls_{0};
  std::atomic<int64_t> bytes_{0};
};

class CallReservation {
 public:
  // `pools`: the engine's allocators, indexed as ReservePages counts them;
  // `staging`: null where nothing is staged. All outlive the reservation.
  CallReservation(AdmissionGate& gate, absl::Span<const std::unique_ptr<PageAllocator>> pools,
                  HostStaging* staging)
      : gate_(gate), pools_(pools), staging_(staging), pages_(pools.size()) {}
  // Gives back whatever was reserved and not committed.
  ~CallReservation();
  CallReservation(const CallReservation&) = delete;
  CallReservation& operator=(const CallReservation&) = delete;

  // Each at most once, in this order; an error leaves the earlier ones held
  // (the destructor gives them back).
  absl::Status Admit(int64_t bytes);
  // A block of `bytes` (> 0) of the staging; `what` names the call in the
  // RESOURCE_EXHAUSTED message.
  absl::Status ReserveStaging(size_t bytes, const char* what);
  // `per_pool[p]` fresh pages of pool p, all or none (RESOURCE_EXHAUSTED).
  absl::Status ReservePages(absl::Span<const int64_t> per_pool);

  int64_t admitted_bytes() const { return admitted_bytes_; }
  const HostStaging::Block& staging() const { return block_; }
  const std::vector<int32_t>& pages(int pool) const { return pages_[pool]; }

  // What a committed reservation hands to its call.
  struct Held {
    int64_t admitted_bytes = 0;
    HostStaging::Block staging;
    std::vector<std::vector<int32_t>> pages;  // by pool
  };
  // The reservation now belongs to the call (nothing is given back here);
  // the call leaves the gate and frees the staging when it finished, and
  // its pages belong to its sequences.
  Held Commit();

 private:
  AdmissionGate& gate_;
  const absl::Span<const std::unique_ptr<PageAllocator>> pools_;
  HostStaging* const staging_;
  bool admitted_ = false;
  int64_t admitted_bytes_ = 0;
  HostStaging::Block block_;
  bool has_block_ = false;
  std::vector<std::vector<int32_t>> pages_;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_CALL_RESERVATION_H_
