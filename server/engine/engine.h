// The engine: sequences, their pages and the verify/commit state machine,
// executed by one worker per device (device_worker.h). The one interface the
// transport calls; it knows nothing of gRPC or protobuf.
//
// Calls are asynchronous: Submit* validates the call, checks and changes the
// sequence's state, reserves pages and queues the device work, all before it
// returns; `done` runs once the work finished (on an engine thread), or at
// once, on the calling thread, for a call rejected before it was queued. No
// engine lock is held while `done` runs, so it may call the engine again; it
// must not block for long (it runs on a device worker's thread).
// Nothing in a Submit* blocks on a device, so no caller thread waits for
// another sequence's work. The synchronous forms submit and wait.
//
// Order: the calls of one sequence run on its devices in the order they were
// submitted (each device's queue is first in, first out; consecutive Verify
// items of different sequences or layers share a batch). A call's effects are
// visible to the calls submitted after it returned from Submit*.
//
// Sequence states:
//   idle     committed length P, no drafts. AppendKv and Verify allowed.
//   pending  a verify step with N drafts and a fixed tree is open: drafts sit
//            at P..P+N-1 in the layers verified so far. Verify (same tree,
//            any layer) and Commit allowed; AppendKv is not.
// Commit(accepted) returns to idle with P += |accepted|. A call rejected at
// submission changes nothing. A Verify or AppendKv whose deadline passes or
// that is cancelled while queued completes unrun with DEADLINE_EXCEEDED /
// CANCELLED; if it was the sequence's last call it is also undone (a step it
// opened is closed, an append is taken back). An admitted Commit or Release
// always runs.
//
// Pages freed by Commit, Release or expiry go back to the free list only once
// every device has passed the point in its queue where they were freed, so
// work still queued for the old owner never touches rows of a new one. (Pages
// taken back from a call that was not run, and was its sequence's last, go
// back at once: only that call would have written them.)
#ifndef MLAVERIFY_SERVER_ENGINE_ENGINE_H_
#define MLAVERIFY_SERVER_ENGINE_ENGINE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/bf16.h"
#include "server/engine/call_placement.h"
#include "server/engine/call_reservation.h"
#include "server/engine/calls.h"
#include "server/engine/device.h"
#include "server/engine/device_worker.h"
#include "server/engine/engine_config.h"
#include "server/engine/engine_observer.h"
#include "server/engine/host_staging.h"
#include "server/engine/page_allocator.h"
#include "server/engine/page_table_arena.h"
#include "server/engine/regions.h"
#include "server/engine/sequence.h"
#include "server/engine/steps.h"
#include "server/engine/tensor_ref.h"

namespace mlaverify::engine {

struct CommitResult {
  int64_t length = 0;
  int accepted_count = 0;
};

// Page accounting of one pool replica group: in tensor-parallel mode one
// allocator serves every device; in data-parallel mode each device has its own.
struct PoolStats {
  std::string devices;  // "cuda:0,cuda:1" or "cuda:1"
  int64_t total_pages = 0;
  int64_t free_pages = 0;
  int64_t live_sequences = 0;
};

struct EngineStats {
  KvDtype kv_dtype = KvDtype::kBf16;  // how the pools store a row
  int64_t kv_row_bytes = 0;           // bytes of one token's row of one layer
  int64_t total_pages = 0;
  int64_t free_pages = 0;
  int64_t live_sequences = 0;
  int64_t pending_steps = 0;           // sequences with an open verify step
  int64_t tokens_appended_total = 0;   // prompt tokens written by AppendKv
  int64_t tokens_committed_total = 0;  // accepted drafts
  int64_t drafts_verified_total = 0;   // draft tokens over all Verify items
  int64_t verify_items_total = 0;
  int64_t steps_committed_total = 0;
  int64_t sequences_created_total = 0;
  int64_t sequences_expired_total = 0;
  StepStats steps;            // device-driven steps (steps.h)
  int64_t queued_calls = 0;   // admitted and not finished
  int64_t queued_bytes = 0;   // tensor bytes those calls hold, and unread answers
  int64_t staging_bytes = 0;  // page-locked host staging (0: none needed)
  int64_t staging_bytes_in_use = 0;
  std::vector<PoolStats> pools;
};

class Engine {
 public:
  // Validates the config against the device list, starts one worker per
  // device (initialising its pool and recording its graphs) and returns when
  // all are ready. `observer` (may be null) outlives the engine.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(
      const EngineConfig& config, std::vector<std::unique_ptr<Device>> devices,
      EngineObserver* observer = nullptr);
  // Runs what is queued, then stops the workers.
  ~Engine();

  const EngineConfig& config() const { return config_; }
  // "cuda", "cpu" or "fake": what the devices are.
  const std::string& backend_name() const { return backend_name_; }
  std::vector<DeviceDescription> devices() const;
  // The workers' names by device index, unique ("cuda:0", "cuda:0#2").
  std::vector<std::string> device_names() const;
  int num_devices() const { return static_cast<int>(workers_.size()); }
  // Query heads each device computes (num_heads / devices in TP mode).
  int heads_per_device() const { return heads_per_device_; }
  // Random per engine (process): sequence ids name sequences of this
  // instance only; GetServerInfo reports it so clients can tell a restart.
  const std::string& instance_id() const { return instance_id_; }
  // Whether verify batches replay CUDA graphs (configured and supported).
  bool graphs_enabled() const { return workers_[0]->uses_graphs(); }
  EngineStats Stats() const;
  // Bytes the caller keeps for calls the engine has finished (a stream's
  // answers not yet read by its client): counted in queued_bytes like a
  // call's own, so that admission refuses new work while they are held.
  // Never refused; every Hold is paired with a Release of the same bytes.
  void HoldAnswerBytes(int64_t bytes) { admission_.HoldBytes(bytes); }
  void ReleaseAnswerBytes(int64_t bytes) { admission_.ReleaseBytes(bytes); }
  // OK, or the first device fault (after which device calls are refused).
  absl::Status fault() const;
  // Called once, on a worker thread, when a device first faults.
  void SetFaultListener(std::function<void(const absl::Status&)> listener);

  // A new, empty sequence. `label` shows in logs. RESOURCE_EXHAUSTED at the
  // live-sequence limit; INVALID_ARGUMENT for a label over the length limit.
  absl::StatusOr<uint64_t> CreateSequence(const std::string& label);

  void SubmitVerify(VerifyCall call, absl::AnyInvocable<void(absl::Status)> done);
  void SubmitAppendKv(AppendCall call, absl::AnyInvocable<void(absl::StatusOr<int64_t>)> done);
  // Ends the pending step of a sequence, keeping the accepted path.
  void SubmitCommit(uint64_t sequence_id, absl::Span<const int32_t> accepted,
                    absl::AnyInvocable<void(absl::StatusOr<CommitResult>)> done);
  // Frees the sequence; `done` gets the pages freed.
  void SubmitRelease(uint64_t sequence_id, absl::AnyInvocable<void(absl::StatusOr<int64_t>)> done);

  // Synchronous forms.
  absl::Status Verify(int layer, float softmax_scale, absl::Span<VerifyItem> items);
  absl::StatusOr<int64_t> AppendKv(uint64_t sequence_id, int64_t start_position, int64_t tokens,
                                   TensorRef kv);
  absl::StatusOr<CommitResult> Commit(uint64_t sequence_id, absl::Span<const int32_t> accepted);
  absl::StatusOr<int64_t> Release(uint64_t sequence_id);

  // Releases sequences idle for longer than the idle timeout (no-op when the
  // timeout is zero) and returns how many, once their pages are free again.
  // Called periodically by the server's janitor thread.
  int ExpireIdle(absl::Time now);

  // Device-driven verify steps (steps.h, docs/steps.md). OpenStep validates
  // the whole step once, claims its sequences, reserves their draft pages
  // and starts a lane per rank; the scheduler then rings layers without a
  // call. A claimed sequence takes no Verify or AppendKv until the step
  // ends; its Commit is accepted once every layer ran (one sent earlier
  // waits for that); ReleaseSequence aborts the step first. AbortStep's
  // `done` runs once the step ended, every sequence as before it.
  absl::StatusOr<StepOpened> OpenStep(const StepRequest& request);
  // OK when OpenStep takes doorbells of `kind` on every device, else why not.
  absl::Status DoorbellSupport(DoorbellKind kind) const;
  void SubmitAbortStep(uint64_t step_id, absl::AnyInvocable<void(absl::StatusOr<StepInfo>)> done);
  absl::StatusOr<StepInfo> GetStep(uint64_t step_id) const;
  // Synchronous form of SubmitAbortStep.
  absl::StatusOr<StepInfo> AbortStep(uint64_t step_id);

  // The shared-memory regions calls may reference (register, unregister,
  // status); the engine maps them onto its devices.
  RegionRegistry& regions() { return regions_; }
  const RegionRegistry& regions() const { return regions_; }

  // Reads positions [start, start+count) of every layer of a sequence from
  // its `replica`-th device (tests: TP replicas must agree), as the pool
  // stores them: `kv` holds num_layers * count * KvRowBytes(kv_dtype) bytes
  // (576 bf16 values per row, or the 656-byte fp8 row).
  absl::Status ReadKv(uint64_t sequence_id, int64_t start, int64_t count, absl::Span<Bf16> kv,
                      int replica = 0);

 private:
  class Call;
  class VerifyTask;
  class OpCall;
  class Mapper;
  class StepHostImpl;

  explicit Engine(const EngineConfig& config);
  // The bodies of the Submit* calls: OK once the call is queued (`done` moved
  // into it), else the rejection, which the caller reports after every lock
  // taken here is released.
  absl::Status StartVerify(VerifyCall& call, absl::AnyInvocable<void(absl::Status)>& done);
  absl::Status StartAppendKv(AppendCall& call,
                             absl::AnyInvocable<void(absl::StatusOr<int64_t>)>& done);
  // `step`: 0 for a client's Commit; a step's id when the step drops an
  // item it claimed (then only a sequence that step still holds).
  absl::Status StartCommit(uint64_t sequence_id, absl::Span<const int32_t> accepted,
                           absl::AnyInvocable<void(absl::StatusOr<CommitResult>)>& done,
                           uint64_t step = 0);
  // Releases a sequence no step holds (SubmitRelease's body).
  void ReleaseNow(const std::shared_ptr<Sequence>& seq,
                  absl::AnyInvocable<void(absl::StatusOr<int64_t>)> done);
  // StepHost's sequence side (steps.h).
  absl::StatusOr<std::vector<StepHost::Claimed>> ClaimForStep(uint64_t step,
                                                              absl::Span<const StepItemSpec> items);
  void UnclaimStep(uint64_t step, absl::Span<const StepItemSpec> items);
  absl::StatusOr<std::shared_ptr<Sequence>> Find(uint64_t id) const;
  absl::Status NotFound(uint64_t id) const;
  PageAllocator& AllocatorOf(const Sequence& seq);
  // An empty reservation over the engine's admission, pools and staging.
  CallReservation Reserve() { return CallReservation(admission_, allocators_, staging_.get()); }
  // The devices a sequence's KV lives on: all (TP) or its own (DP).
  std::vector<int> DevicesOf(const Sequence& seq) const;
  // OK, or UNAVAILABLE after a device fault: checked before a call is
  // admitted.
  absl::Status Serving() const;
  // Detaches a sequence's pages and marks it released (its lock held);
  // returns the pages, to be freed once the devices passed the release.
  std::vector<int32_t> ReleaseLocked(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Queues a barrier on the sequence's devices and frees `pages` (to its
  // allocator) once all passed it; then calls `then` (may be empty).
  void FreeAfterBarrier(const std::shared_ptr<Sequence>& seq, std::vector<int32_t> pages,
                        absl::AnyInvocable<void()> then);
  void OnDeviceFault(int device, const absl::Status& status);
  // `p` as worker `w`'s device addresses it (staged tensors: in `block`).
  uint64_t AddressOf(const PlacedTensor& p, int w, const HostStaging::Block& block) const;
  // Kicks every worker (after a submission released its locks).
  void KickAll(const std::vector<int>& devices);

  const EngineConfig config_;
  // Admitted calls and the host bytes they hold (--max-queued-calls,
  // --max-queued-bytes).
  AdmissionGate admission_;
  RegionRegistry regions_;
  // What placing a call reads of the engine (set once the staging exists).
  PlacementGeometry placement_;
  std::unique_ptr<Mapper> mapper_;
  // Host-resident tensors go through it where the devices cannot address
  // them (null where they can: host devices).
  std::unique_ptr<HostStaging> staging_;
  std::string instance_id_;
  std::string backend_name_;
  int heads_per_device_ = 0;
  EngineObserver* observer_ = nullptr;
  std::vector<std::unique_ptr<DeviceWorker>> workers_;
  // Device-driven steps: created after the workers started, destroyed
  // before they stop (open steps are aborted then).
  std::unique_ptr<StepHostImpl> step_host_;
  std::unique_ptr<StepRunner> steps_;
  // One allocator (TP) or one per device (DP).
  std::vector<std::unique_ptr<PageAllocator>> allocators_;

  mutable absl::Mutex table_mu_;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Sequence>> sequences_ ABSL_GUARDED_BY(table_mu_);
  // getrandom(2) on Linux: unpredictable sequence ids.
  std::random_device id_source_ ABSL_GUARDED_BY(table_mu_);
  std::vector<int64_t> live_per_pool_ ABSL_GUARDED_BY(table_mu_);
  // Recently expired ids, so that NOT_FOUND can say why.
  std::deque<uint64_t> expired_order_ ABSL_GUARDED_BY(table_mu_);
  absl::flat_hash_set<uint64_t> expired_ ABSL_GUARDED_BY(table_mu_);

  std::atomic<bool> faulted_{false};  // fault_ is set (read without the lock)
  mutable absl::Mutex fault_mu_;
  absl::Status fault_ ABSL_GUARDED_BY(fault_mu_);
  std::function<void(const absl::Status&)> fault_listener_ ABSL_GUARDED_BY(fault_mu_);

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
