// The engine: sequences, their pages and the verify/commit state machine,
// executed by one worker per device (device_worker.h). The one interface the
// transport calls; it knows nothing of gRPC or protobuf. This header is that
// interface only: the implementation (EngineImpl in engine_impl.h, with
// the workers and the sequence table; engine.cc's call classes) is private
// to the engine, so the transport's headers do not pull in the workers.
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

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/bf16.h"
#include "common/kv_dtype.h"
#include "server/engine/calls.h"
#include "server/engine/device.h"
#include "server/engine/engine_config.h"
#include "server/engine/engine_observer.h"
#include "server/engine/regions.h"
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
  virtual ~Engine() = default;

  virtual const EngineConfig& config() const = 0;
  // "cuda", "cpu" or "fake": what the devices are.
  virtual const std::string& backend_name() const = 0;
  virtual std::vector<DeviceDescription> devices() const = 0;
  // The workers' names by device index, unique ("cuda:0", "cuda:0#2").
  virtual std::vector<std::string> device_names() const = 0;
  virtual int num_devices() const = 0;
  // Query heads each device computes (num_heads / devices in TP mode).
  virtual int heads_per_device() const = 0;
  // Random per engine (process): sequence ids name sequences of this
  // instance only; GetServerInfo reports it so clients can tell a restart.
  virtual const std::string& instance_id() const = 0;
  // Whether verify batches replay CUDA graphs (configured and supported).
  virtual bool graphs_enabled() const = 0;
  virtual EngineStats Stats() const = 0;
  // Bytes the caller keeps for calls the engine has finished (a stream's
  // answers not yet read by its client): counted in queued_bytes like a
  // call's own, so that admission refuses new work while they are held.
  // Never refused; every Hold is paired with a Release of the same bytes.
  virtual void HoldAnswerBytes(int64_t bytes) = 0;
  virtual void ReleaseAnswerBytes(int64_t bytes) = 0;
  // OK, or the first device fault (after which device calls are refused).
  virtual absl::Status fault() const = 0;
  // Called once, on a worker thread, when a device first faults.
  virtual void SetFaultListener(std::function<void(const absl::Status&)> listener) = 0;

  // A new, empty sequence. `label` shows in logs. RESOURCE_EXHAUSTED at the
  // live-sequence limit; INVALID_ARGUMENT for a label over the length limit.
  virtual absl::StatusOr<uint64_t> CreateSequence(const std::string& label) = 0;

  virtual void SubmitVerify(VerifyCall call, absl::AnyInvocable<void(absl::Status)> done) = 0;
  virtual void SubmitAppendKv(AppendCall call,
                              absl::AnyInvocable<void(absl::StatusOr<int64_t>)> done) = 0;
  // Ends the pending step of a sequence, keeping the accepted path.
  virtual void SubmitCommit(uint64_t sequence_id, absl::Span<const int32_t> accepted,
                            absl::AnyInvocable<void(absl::StatusOr<CommitResult>)> done) = 0;
  // Frees the sequence; `done` gets the pages freed.
  virtual void SubmitRelease(uint64_t sequence_id,
                             absl::AnyInvocable<void(absl::StatusOr<int64_t>)> done) = 0;

  // Synchronous forms.
  absl::Status Verify(int layer, float softmax_scale, absl::Span<VerifyItem> items);
  absl::StatusOr<int64_t> AppendKv(uint64_t sequence_id, int64_t start_position, int64_t tokens,
                                   TensorRef kv);
  absl::StatusOr<CommitResult> Commit(uint64_t sequence_id, absl::Span<const int32_t> accepted);
  absl::StatusOr<int64_t> Release(uint64_t sequence_id);

  // Releases sequences idle for longer than the idle timeout (no-op when the
  // timeout is zero) and returns how many, once their pages are free again.
  // Called periodically by the server's janitor thread.
  virtual int ExpireIdle(absl::Time now) = 0;

  // Device-driven verify steps (steps.h, docs/steps.md). OpenStep validates
  // the whole step once, claims its sequences, reserves their draft pages
  // and starts a lane per rank; the scheduler then rings layers without a
  // call. A claimed sequence takes no Verify or AppendKv until the step
  // ends; its Commit is accepted once every layer ran (one sent earlier
  // waits for that); ReleaseSequence aborts the step first. AbortStep's
  // `done` runs once the step ended, every sequence as before it.
  virtual absl::StatusOr<StepOpened> OpenStep(const StepRequest& request) = 0;
  // OK when OpenStep takes doorbells of `kind` on every device, else why not.
  virtual absl::Status DoorbellSupport(DoorbellKind kind) const = 0;
  virtual void SubmitAbortStep(uint64_t step_id,
                               absl::AnyInvocable<void(absl::StatusOr<StepInfo>)> done) = 0;
  virtual absl::StatusOr<StepInfo> GetStep(uint64_t step_id) const = 0;
  // Synchronous form of SubmitAbortStep.
  absl::StatusOr<StepInfo> AbortStep(uint64_t step_id);

  // The shared-memory regions calls may reference (register, unregister,
  // status); the engine maps them onto its devices.
  virtual RegionRegistry& regions() = 0;
  virtual const RegionRegistry& regions() const = 0;

  // Reads positions [start, start+count) of every layer of a sequence from
  // its `replica`-th device (tests: TP replicas must agree), as the pool
  // stores them: `kv` holds num_layers * count * KvRowBytes(kv_dtype) bytes
  // (576 bf16 values per row, or the 656-byte fp8 row).
  virtual absl::Status ReadKv(uint64_t sequence_id, int64_t start, int64_t count,
                              absl::Span<Bf16> kv, int replica = 0) = 0;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_ENGINE_H_
