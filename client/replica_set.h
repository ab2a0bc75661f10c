// Several mlaverify servers (replicas) behind one client. Replicas share no
// state: a sequence's KV lives in the replica that created it, so
// CreateSequence picks a replica and every later call of that sequence goes
// to it (PlacedSequence carries the owner). New sequences go to the healthy
// replica with the most free pages. A replica whose call fails with
// UNAVAILABLE is marked down: it gets no new sequences, and calls for its
// sequences fail at once with UNAVAILABLE naming it, without a network round
// trip. With several connections per replica the UNAVAILABLE is confirmed
// first by a health check (one lost connection fails only its own calls and
// is opened again; the replica is down when it is not SERVING on another).
// A down replica is probed again (GetServerInfo) at most once per
// `retry_down_after`; if it answers, it takes new sequences again (after a
// restart its old sequences are NOT_FOUND, which the server says).
#ifndef MLAVERIFY_CLIENT_REPLICA_SET_H_
#define MLAVERIFY_CLIENT_REPLICA_SET_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client.h"

namespace mlaverify::client {

// A sequence and the replica (index into the ReplicaSet) that owns it.
struct PlacedSequence {
  int replica = -1;
  uint64_t id = 0;
};

struct ReplicaState {
  std::string target;
  bool up = true;
  std::string down_reason;        // the failure that marked it down
  int64_t sequences_created = 0;  // through this ReplicaSet
  int64_t live_sequences = 0;     // created and not yet released through it
  int64_t free_pages = -1;        // from the last GetServerInfo; -1: never answered
  std::string instance_id;        // from the first GetServerInfo that answered
};

class ReplicaSet {
 public:
  // One VerifyClient per target (same options). INVALID_ARGUMENT for no
  // targets or a repeated one.
  static absl::StatusOr<std::unique_ptr<ReplicaSet>> Create(
      const std::vector<std::string>& targets, const ClientOptions& options,
      absl::Duration retry_down_after = absl::Seconds(1));

  int size() const { return static_cast<int>(clients_.size()); }
  VerifyClient& replica(int index) { return *clients_[index]; }
  // "replica 1 (127.0.0.1:50052)".
  std::string Name(int index) const;

  // A new sequence on a healthy replica: the most free pages (server info
  // refreshed for each pick; counts within a tenth of each other tie), then
  // the fewest live sequences this client placed there, then round robin. UNAVAILABLE naming every
  // replica when none is up; a replica's own error when it refused (e.g. its sequence limit), after
  // trying the others.
  absl::StatusOr<PlacedSequence> CreateSequence(absl::string_view label);

  // The calls of one placed sequence, sent to its owner. UNAVAILABLE
  // "replica i (target) is down: ..." at once when the owner is marked down;
  // otherwise the owner's answer, its message prefixed with the replica's
  // name when there are several.
  absl::StatusOr<AppendKvResult> AppendKv(const PlacedSequence& seq, int64_t start_position,
                                          int num_layers, int64_t tokens, absl::Span<const Bf16> kv,
                                          const ShmStaging* staging = nullptr,
                                          const std::function<void(int64_t)>& on_chunk = nullptr);
  // Items must all be of sequences on `owner`.
  absl::StatusOr<std::vector<VerifyItemResult>> Verify(int owner, int layer,
                                                       absl::Span<const VerifyItemInput> items,
                                                       float softmax_scale = 0.0f);
  absl::StatusOr<CommitResult> Commit(const PlacedSequence& seq,
                                      absl::Span<const int32_t> accepted);
  absl::StatusOr<int64_t> ReleaseSequence(const PlacedSequence& seq);

  // For calls made on replica(i) directly (e.g. a VerifyStream): UNAVAILABLE
  // when it is down, else OK; and the outcome of such a call (marks the
  // replica down on UNAVAILABLE, confirmed by a health check when the
  // client has several connections; returns `status` named).
  absl::Status CheckUp(int index);
  absl::Status Observe(int index, absl::Status status);

  std::vector<ReplicaState> States() const;

 private:
  ReplicaSet(std::vector<std::unique_ptr<VerifyClient>> clients, absl::Duration retry_down_after);

  // Refreshes one replica's info (probing a down one when its retry time
  // came); true when it is up afterwards.
  bool Refresh(int index);

  std::vector<std::unique_ptr<VerifyClient>> clients_;
  const absl::Duration retry_down_after_;
  mutable absl::Mutex mu_;
  std::vector<ReplicaState> states_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Time> down_since_ ABSL_GUARDED_BY(mu_);
  int next_turn_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_REPLICA_SET_H_
