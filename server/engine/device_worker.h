// One device's worker: the only code that launches work on its Device.
//
// Work arrives in a first-in, first-out queue (verify shards and pool
// operations) and is launched in that order by whichever thread holds the
// worker's launch lock:
//   - on an asynchronous device (a GPU): on an idle device (nothing in
//     flight), the thread that submitted the work (Kick, called by the engine
//     once its locks are released): no hand-off; on a busy device, the
//     device thread, which polls the oldest launch and launches what queued
//     meanwhile as soon as a slot is free (the submitters only enqueue);
//   - on a synchronous device (the CPU backend), and whenever a queue delay
//     is configured, the worker's launch thread.
// Consecutive verify shards become one batch (up to the largest batch
// bucket; different sequences and layers mix), padded to the smallest graph
// bucket that holds them and launched as that bucket's graph (or eagerly
// where no graph applies). A launch's bytes are described by the copy lists
// it writes into its slot (device.h); the device's page tables are kept up
// to date by the table changes the shards and operations carry
// (page_table_arena.h). At most `slots` launches are in flight.
//
// The device thread takes each launch in order once it finished and, while
// launches are in flight, polls rather than sleeps (launching what queued as
// soon as a slot frees), then completes the finished launch's shards or
// operation (staged outputs copied out, the callers' callbacks run). With
// WorkerOptions::completion_thread a completion thread does that instead:
// the device thread hands it finished launches in order, one wake-up per
// hand-off however many calls it carries, and goes back to the device at
// once, so that under load completing calls no longer holds the next launch
// back; with nothing else queued or in flight and nothing being completed,
// the device thread still completes a launch itself (no hand-off to wait
// for when one call is in flight). Completions run in launch order either
// way.
//
// The queue has no bound of its own: the engine admits work (with limits)
// before it enqueues. A device error fails the work it touched and every
// later piece of work with INTERNAL naming the device; the worker then stays
// faulted.
#ifndef MLAVERIFY_SERVER_ENGINE_DEVICE_WORKER_H_
#define MLAVERIFY_SERVER_ENGINE_DEVICE_WORKER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/bf16.h"
#include "server/engine/batch_plan.h"
#include "server/engine/device.h"
#include "server/engine/engine_observer.h"
#include "server/engine/page_table_arena.h"
#include "server/engine/parallel_runner.h"
#include "server/engine/slot_writer.h"

namespace mlaverify::engine {

class ShardOwner;

// One verify item as one device computes it. The pointers stay valid until
// the owner's ShardDone for it has returned.
struct VerifyShard {
  ShardOwner* owner = nullptr;
  int index = 0;          // the owner's number for this shard
  uint64_t sequence = 0;  // two shards of one sequence and layer never share a batch
  int32_t prefix_len = 0;
  int32_t draft_len = 0;
  int32_t layer = 0;
  float scale = 0;
  const uint64_t* visibility = nullptr;  // [draft_len]
  // How the sequence's page list changed since its previous device work
  // (null: it did not). Applied whether or not the shard runs.
  std::shared_ptr<const TableDelta> table;
  ShardTensor q;         // this device's heads of [N, H, 576]
  ShardTensor draft_kv;  // [N, 576]
  ShardTensor out;       // this device's heads of [N, H, 512]
  ShardTensor lse;       // this device's heads of [N, H]
  // Bytes its call copies out of the host staging when it completes (a
  // hint: batches that copy much complete on several threads).
  uint32_t copy_out_bytes = 0;
};

// How a shard went, for the owner's timing split.
struct ShardTiming {
  absl::Time taken;           // a launcher took it from the queue
  double device_seconds = 0;  // device time of its batch
  int batch_requests = 0;     // real requests in its batch
};

// The engine's side of a shard.
class ShardOwner {
 public:
  virtual ~ShardOwner() = default;
  // Asked once per shard, when a launcher takes it: OK to run it, or the
  // status to complete it with unrun (cancelled, deadline passed, its
  // sequence released). The first shard of a call decides for all of them.
  virtual absl::Status AdmitShard(int index) = 0;
  // The shard ran (its outputs are written) or failed or was not admitted.
  // Called exactly once per enqueued shard, on a worker thread; must not block.
  virtual void ShardDone(int index, const absl::Status& status, const ShardTiming& timing) = 0;
};

// A pool operation, launched between batches in queue order.
struct DeviceOp {
  // kStep: starts a device-driven step's lane (StepLaunch) after everything
  // before it; done once it is started (its layers run as they are rung).
  enum class Kind { kWriteRows, kReadRows, kCompact, kBarrier, kStep };
  Kind kind = Kind::kBarrier;
  uint64_t sequence = 0;
  // How the sequence's page list changed since its previous device work
  // (null: it did not); applied whether or not the op runs.
  std::shared_ptr<const TableDelta> table;
  // The sequence is gone (released or expired): its table is forgotten.
  bool release_table = false;
  int64_t start = 0;                   // kWriteRows / kReadRows: first position
  int64_t count = 0;                   // tokens
  uint64_t rows_in = 0;                // kWriteRows: [num_layers, count, 576] (device address)
  Bf16* rows_out = nullptr;            // kReadRows: host memory
  int64_t prefix_len = 0;              // kCompact
  absl::Span<const int32_t> accepted;  // kCompact
  StepLaunch step;                     // kStep
  // Asked when the op is taken: OK to run it, else the status to complete it
  // with unrun. Empty: always run.
  absl::AnyInvocable<absl::Status()> admit;
  // Called once, on a worker thread, with the op's outcome.
  absl::AnyInvocable<void(const absl::Status&)> done;
};

struct WorkerOptions {
  std::vector<int> batch_buckets;
  std::vector<int> draft_buckets;
  bool use_graphs = true;
  absl::Duration max_queue_delay = absl::ZeroDuration();
  // Threads (the completion thread included) that complete a large batch's
  // calls, copying their staged outputs out.
  int copy_threads = 1;
  // False: the device thread completes every launch itself (no completion
  // thread).
  bool completion_thread = false;
  // EngineConfig::poll_launches.
  bool poll_launches = true;
};

class DeviceWorker {
 public:
  // `index` numbers the device in the engine's list; `name` is unique among
  // the engine's workers (logs, metrics, errors); `observer` and `on_fault`
  // (may be empty) outlive the worker.
  DeviceWorker(int index, std::unique_ptr<Device> device, std::string name,
               const WorkerOptions& options, EngineObserver* observer,
               std::function<void(int, const absl::Status&)> on_fault);
  ~DeviceWorker();  // Stop()
  DeviceWorker(const DeviceWorker&) = delete;
  DeviceWorker& operator=(const DeviceWorker&) = delete;

  // Initialises the device, records every bucket's graph (logging the time
  // and memory it took), then starts the threads. Work may be enqueued only
  // after it returned OK.
  absl::Status Start(const DeviceGeometry& geometry);
  // Runs what is queued, waits for what is in flight, joins the threads.
  // Idempotent.
  void Stop();

  void Enqueue(VerifyShard shard);
  void Enqueue(DeviceOp op);
  // Called after enqueueing, with no engine lock held: on an idle
  // asynchronous device the calling thread launches what is queued (a busy
  // one's device thread does); the launch thread needs no telling.
  void Kick();

  int index() const { return index_; }
  const std::string& name() const { return name_; }
  // The device, for the engine's memory functions (thread-safe ones only).
  Device& device() { return *device_; }
  DeviceDescription Describe() const { return device_->Describe(); }
  // The Device's own name ("cuda:0"; workers over one device share it).
  std::string device_name() const { return device_->name(); }
  // The device's error once it faulted (then all work fails), else OK.
  absl::Status fault() const;
  // Whether verify batches replay captured graphs (set by Start).
  bool uses_graphs() const { return uses_graphs_; }

 private:
  struct Entry {
    bool is_op = false;
    VerifyShard shard;
    DeviceOp op;
  };
  // A launch on its way to the device and then to completion.
  struct InFlight {
    int slot = 0;
    bool is_op = false;
    std::vector<VerifyShard> shards;  // a batch
    DeviceOp op;                      // an op
    absl::Time taken;
    BatchReport report;
    // Set once the device finished it: its device time or error, and when.
    absl::StatusOr<double> device_seconds = 0.0;
    absl::Time finished;
  };

  void LaunchThreadLoop();
  // The device thread: polls the oldest launch, launches what queued, hands
  // finished launches on (or completes them itself when nothing else is
  // going on).
  void DeviceLoop();
  // The completion thread: completes what the device thread handed over, in
  // order.
  void CompletionLoop();
  // Completes a finished launch's shards (or op) and reports the batch.
  void Complete(InFlight& f);
  // Launches while the lock is free and something can launch; re-checks after
  // letting go, so work queued by a thread that found the lock held is not
  // left behind.
  void LaunchWhilePossible();
  // With launch_mu_ held: launches queued work until the queue is empty or
  // no slot is free.
  void LaunchQueued() ABSL_EXCLUSIVE_LOCKS_REQUIRED(launch_mu_);
  // Whether the head of the queue can be launched now.
  bool Launchable() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes the next batch of verify shards from the head of the queue: up to
  // the largest batch bucket, stopping at an op or at a second shard of a
  // sequence and layer already in the batch.
  std::vector<VerifyShard> TakeBatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunBatch(std::vector<VerifyShard> shards, absl::Time taken)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(launch_mu_);
  void RunOp(DeviceOp op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(launch_mu_);
  // Applies a piece of work's page-table change; a failure faults the device.
  void ApplyTable(uint64_t sequence, const std::shared_ptr<const TableDelta>& delta, bool release)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(launch_mu_);
  // Starts slot `slot`'s gather list with the page-table writes queued in the
  // arena (or uploads the whole arena when they do not fit).
  absl::Status BeginSlot(int slot, SlotWriter* writer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(launch_mu_);
  // Records a launch in flight on the next slot.
  void PushInFlight(InFlight f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(launch_mu_);
  int NextSlot() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(launch_mu_) {
    return static_cast<int>(launch_count_ % geometry_.slots);
  }
  // Records the device's first error, tells the engine once.
  void Fault(const absl::Status& status);
  void FailShards(absl::Span<const VerifyShard> shards, const absl::Status& status,
                  const ShardTiming& timing);

  const int index_;
  const std::unique_ptr<Device> device_;
  const std::string name_;
  const WorkerOptions options_;
  EngineObserver* const observer_;
  const std::function<void(int, const absl::Status&)> on_fault_;
  DeviceGeometry geometry_;
  BatchTarget target_;  // the batch buffers and geometry PackBatch needs
  ParallelRunner completion_runner_;
  bool asynchronous_ = false;
  bool uses_graphs_ = false;
  bool launch_thread_launches_ = false;

  // The launcher's state.
  absl::Mutex launch_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  PlanFingerprint plan_ ABSL_GUARDED_BY(launch_mu_);
  // Slot launches ever: the next takes slot launch_count_ % slots.
  int64_t launch_count_ ABSL_GUARDED_BY(launch_mu_) = 0;
  std::unique_ptr<PageTableArena> tables_ ABSL_GUARDED_BY(launch_mu_);
  std::vector<TableWrite> writes_ ABSL_GUARDED_BY(launch_mu_);     // scratch
  std::vector<int32_t> values_ ABSL_GUARDED_BY(launch_mu_);        // scratch
  std::vector<PackedRequest> packed_ ABSL_GUARDED_BY(launch_mu_);  // scratch: a batch's requests

  mutable absl::Mutex mu_;
  std::deque<Entry> queue_ ABSL_GUARDED_BY(mu_);
  int queued_shards_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<InFlight> in_flight_ ABSL_GUARDED_BY(mu_);
  absl::Status fault_ ABSL_GUARDED_BY(mu_);
  // Readable without mu_ (the fast paths of Kick and the device thread's
  // polling): queue entries, launches in flight, whether fault_ is set.
  std::atomic<int> queue_size_{0};
  std::atomic<int> in_flight_size_{0};
  std::atomic<bool> faulted_{false};
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool launching_ ABSL_GUARDED_BY(mu_) = false;  // a launcher holds launch_mu_
  bool launch_thread_done_ ABSL_GUARDED_BY(mu_) = false;
  // Finished launches handed to the completion thread, in launch order.
  absl::Mutex done_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::deque<InFlight> finished_ ABSL_GUARDED_BY(done_mu_);
  bool completing_ ABSL_GUARDED_BY(done_mu_) = false;  // the completion thread is busy
  bool device_thread_done_ ABSL_GUARDED_BY(done_mu_) = false;
  bool started_ = false;
  std::thread launch_thread_, device_thread_, completion_thread_;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_DEVICE_WORKER_H_
