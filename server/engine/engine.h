// The engine: sequences, their pages and the verify/commit state machine over
// one backend. The narrow interface the transport calls; it knows nothing of
// gRPC or protobuf. Thread-safe: calls on different sequences run
// concurrently, calls on one sequence serialise.
//
// Sequence states:
//   idle     committed length P, no drafts. AppendKv and Verify allowed.
//   pending  a verify step with N drafts and a fixed tree is open: drafts sit
//            at P..P+N-1 in the layers verified so far. Verify (same tree,
//            any layer) and Commit allowed; AppendKv is not.
// Commit(accepted) returns to idle with P += |accepted|. Every failed call
// leaves the sequences it named as they were.
#ifndef MLAVERIFY_SERVER_ENGINE_ENGINE_H_
#define MLAVERIFY_SERVER_ENGINE_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/bf16.h"
#include "server/engine/backend.h"
#include "server/engine/engine_config.h"
#include "server/engine/page_allocator.h"

namespace mlaverify::engine {

// One item of a Verify call. Inputs and outputs are caller-owned buffers
// (the transport points them into the request and response messages).
struct VerifyItem {
  uint64_t sequence_id = 0;
  absl::Span<const int32_t> parents;  // N
  absl::Span<const Bf16> q;           // [N, H, 576]
  absl::Span<const Bf16> draft_kv;    // [N, 576]
  absl::Span<Bf16> out;               // [N, H, 512], written on success
  absl::Span<float> lse;              // [N, H], written on success
  int64_t prefix_len = 0;             // set on success: P the drafts attended to
};

struct CommitResult {
  int64_t length = 0;
  int accepted_count = 0;
};

struct EngineStats {
  int64_t total_pages = 0;
  int64_t free_pages = 0;
  int64_t live_sequences = 0;
  int64_t pending_steps = 0;             // sequences with an open verify step
  int64_t tokens_appended_total = 0;     // prompt tokens written by AppendKv
  int64_t tokens_committed_total = 0;    // accepted drafts
  int64_t drafts_verified_total = 0;     // draft tokens over all Verify items
  int64_t verify_items_total = 0;
  int64_t steps_committed_total = 0;
  int64_t sequences_created_total = 0;
  int64_t sequences_expired_total = 0;
};

class Engine {
 public:
  // Validates the config, sizes the pool and initialises the backend.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineConfig& config,
                                                        std::unique_ptr<Backend> backend);
  ~Engine();

  const EngineConfig& config() const { return config_; }
  std::string backend_name() const { return backend_->name(); }
  std::vector<DeviceDescription> devices() const { return backend_->devices(); }
  EngineStats Stats() const;

  // A new, empty sequence. `label` shows in logs.
  absl::StatusOr<uint64_t> CreateSequence(const std::string& label);

  // Appends `tokens` prompt tokens of every layer, kv [num_layers, tokens,
  // 576], at start_position (must equal the current length). Returns the new
  // length.
  absl::StatusOr<int64_t> AppendKv(uint64_t sequence_id, int64_t start_position, int64_t tokens,
                                   absl::Span<const Bf16> kv);

  // Verify attention of `layer` for every item (distinct sequences). A
  // softmax_scale <= 0 uses the configured default.
  absl::Status Verify(int layer, float softmax_scale, absl::Span<VerifyItem> items);

  // Ends the pending step of a sequence, keeping the accepted path.
  absl::StatusOr<CommitResult> Commit(uint64_t sequence_id, absl::Span<const int32_t> accepted);

  // Frees the sequence; returns the pages freed.
  absl::StatusOr<int64_t> Release(uint64_t sequence_id);

  // Releases sequences idle for longer than the idle timeout (no-op when the
  // timeout is zero). Returns how many. Called periodically by the server.
  int ExpireIdle(absl::Time now);

  // Reads positions [start, start+count) of every layer of a sequence (tests).
  absl::Status ReadKv(uint64_t sequence_id, int64_t start, int64_t count, absl::Span<Bf16> kv);

 private:
  struct Sequence;

  Engine(const EngineConfig& config, std::unique_ptr<Backend> backend);
  absl::StatusOr<std::shared_ptr<Sequence>> Find(uint64_t id) const;
  absl::Status NotFound(uint64_t id) const;
  // Releases a locked sequence's pages and marks it released.
  int64_t ReleaseLocked(Sequence& seq);

  const EngineConfig config_;
  std::unique_ptr<Backend> backend_;
  PageAllocator pages_;

  mutable absl::Mutex table_mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(table_mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(table_mu_) = 1;
  // Recently expired ids, so that NOT_FOUND can say why.
  std::deque<uint64_t> expired_order_ ABSL_GUARDED_BY(table_mu_);
  absl::flat_hash_set<uint64_t> expired_ ABSL_GUARDED_BY(table_mu_);

  std::atomic<int64_t> pending_steps_{0};
  std::atomic<int64_t> tokens_appended_{0};
  std::atomic<int64_t> tokens_committed_{0};
  std::atomic<int64_t> drafts_verified_{0};
  std::atomic<int64_t> verify_items_{0};
  std::atomic<int64_t> steps_committed_{0};
  std::atomic<int64_t> sequences_created_{0};
  std::atomic<int64_t> sequences_expired_{0};
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_ENGINE_H_
