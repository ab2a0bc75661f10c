// One device's worker: the only code that touches its Device. Two threads,
// both bound to the device:
//   - the launch thread takes work in arrival order. Consecutive verify shards
//     become one batch (up to the largest batch bucket; different sequences
//     and layers mix), packed into a free staging set, padded to the smallest
//     graph bucket that holds them, and launched as that bucket's graph (or
//     eagerly where no graph applies). Pool operations (row writes, reads,
//     compactions, barriers) run between batches, in order.
//   - the completion thread waits for each launched batch, copies its outputs
//     to the callers' buffers and completes its shards.
// With several staging sets (EngineConfig::staging_sets), the next batch is
// packed and launched while the previous one runs and an earlier one's
// outputs are copied out.
//
// The queue has no bound of its own: the engine admits work (with limits)
// before it enqueues. A device error fails the work it touched and every later
// piece of work with INTERNAL naming the device; the worker then stays faulted.
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
#include "absl/types/span.h"
#include "common/bf16.h"
#include "server/engine/batch_plan.h"
#include "server/engine/device.h"
#include "server/engine/engine_observer.h"
#include "server/engine/parallel_runner.h"

namespace mlaverify::engine {

class ShardOwner;

// One verify item as one device computes it. The pointers stay valid until
// the owner's ShardDone for it has returned.
struct VerifyShard {
  ShardOwner* owner = nullptr;
  int index = 0;                         // the owner's number for this shard
  uint64_t sequence = 0;                 // two shards of one sequence and layer never share a batch
  absl::Span<const int32_t> page_table;  // covers positions 0..prefix_len+draft_len-1
  int32_t prefix_len = 0;
  int32_t draft_len = 0;
  int32_t layer = 0;
  float scale = 0;
  const uint64_t* visibility = nullptr;  // [draft_len]
  // This device's heads of token 0; token i is q + i * q_token_stride (elements).
  const Bf16* q = nullptr;
  int64_t q_token_stride = 0;
  const Bf16* draft_kv = nullptr;  // [draft_len, 576]
  // Where this device's heads of the outputs go, token i at + i * stride.
  Bf16* out = nullptr;
  int64_t out_token_stride = 0;
  float* lse = nullptr;
  int64_t lse_token_stride = 0;
  // q, draft_kv, out and lse are in device memory this device can copy from
  // and to (a client's CUDA shared memory), not host memory.
  bool device_resident = false;
};

// How a shard went, for the owner's timing split.
struct ShardTiming {
  absl::Time taken;           // the launch thread took it from the queue
  double device_seconds = 0;  // device time of its batch
  int batch_requests = 0;     // real requests in its batch
};

// The engine's side of a shard.
class ShardOwner {
 public:
  virtual ~ShardOwner() = default;
  // Asked once per shard, when the launch thread takes it: OK to run it, or
  // the status to complete it with unrun (cancelled, deadline passed, its
  // sequence released). The first shard of a call decides for all of them.
  virtual absl::Status AdmitShard(int index) = 0;
  // The shard ran (its outputs are written) or failed or was not admitted.
  // Called exactly once per enqueued shard, on a worker thread; must not block.
  virtual void ShardDone(int index, const absl::Status& status, const ShardTiming& timing) = 0;
};

// A pool operation, run on the launch thread between batches.
struct DeviceOp {
  enum class Kind { kWriteRows, kReadRows, kCompact, kBarrier };
  Kind kind = Kind::kBarrier;
  absl::Span<const int32_t> page_table;
  int64_t start = 0;                   // kWriteRows / kReadRows: first position
  int64_t count = 0;                   // tokens
  const Bf16* rows_in = nullptr;       // kWriteRows: [num_layers, count, 576]
  Bf16* rows_out = nullptr;            // kReadRows
  int64_t prefix_len = 0;              // kCompact
  absl::Span<const int32_t> accepted;  // kCompact
  // Asked when the op is taken: OK to run it, else the status to complete it
  // with unrun. Empty: always run.
  absl::AnyInvocable<absl::Status()> admit;
  // Called once, on the launch thread, with the op's outcome.
  absl::AnyInvocable<void(const absl::Status&)> done;
};

struct WorkerOptions {
  std::vector<int> batch_buckets;
  std::vector<int> draft_buckets;
  bool use_graphs = true;
  absl::Duration max_queue_delay = absl::ZeroDuration();
  int copy_threads = 1;
  // Before the launch thread sleeps on an empty queue it polls it this long
  // (a wake-up from sleep costs microseconds per call).
  absl::Duration spin = absl::ZeroDuration();
  // Copy a batch's inputs while the previous batch runs (LaunchOptions::overlap_input).
  bool overlap_inputs = false;
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

  // Initialises the device, records every bucket's graph on every staging set
  // (logging the time and memory it took), then starts the threads. Work may
  // be enqueued only after it returned OK.
  absl::Status Start(const DeviceGeometry& geometry);
  // Runs what is queued, waits for what is in flight, joins the threads.
  // Idempotent.
  void Stop();

  void Enqueue(VerifyShard shard);
  void Enqueue(DeviceOp op);

  int index() const { return index_; }
  const std::string& name() const { return name_; }
  DeviceDescription Describe() const { return device_->Describe(); }
  // Device::PinHostMemory / UnpinHostMemory (any thread).
  absl::Status PinHostMemory(void* data, size_t bytes) {
    return device_->PinHostMemory(data, bytes);
  }
  void UnpinHostMemory(void* data) { device_->UnpinHostMemory(data); }
  // Device::OpenIpcMemory / CloseIpcMemory / cuda_ordinal (any thread).
  absl::StatusOr<void*> OpenIpcMemory(absl::string_view handle) {
    return device_->OpenIpcMemory(handle);
  }
  void CloseIpcMemory(void* data) { device_->CloseIpcMemory(data); }
  int cuda_ordinal() const { return device_->cuda_ordinal(); }
  // The Device's own name ("cuda:0"; workers over one device share it).
  std::string device_name() const { return device_->name(); }
  // The device's error once it faulted (then all work fails), else OK.
  absl::Status fault() const;
  // Verify shards and ops queued and not yet taken.
  int queued() const;
  // Whether verify batches replay captured graphs (set by Start).
  bool uses_graphs() const { return uses_graphs_; }

 private:
  struct Entry {
    bool is_op = false;
    VerifyShard shard;
    DeviceOp op;
  };
  // A launched batch on its way to the completion thread.
  struct InFlight {
    int set = 0;
    BatchShape shape;
    std::vector<VerifyShard> shards;
    std::vector<int> first_row;  // token row of each shard in staging
    absl::Time taken;
    BatchReport report;
  };

  void LaunchLoop();
  void CompletionLoop();
  // Takes the next batch of verify shards from the head of the queue (the
  // caller saw one there): up to the largest batch bucket, stopping at an op
  // or at a second shard of a sequence and layer already in the batch.
  std::vector<VerifyShard> TakeBatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunBatch(std::vector<VerifyShard> shards, absl::Time taken);
  void RunOp(DeviceOp op);
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
  ParallelRunner pack_runner_, unpack_runner_;
  PlanFingerprint plan_;  // launch thread only

  mutable absl::Mutex mu_;
  std::deque<Entry> queue_ ABSL_GUARDED_BY(mu_);
  // queue_.size(), readable without the lock (the launch thread's spin).
  std::atomic<int> queue_size_{0};
  int queued_shards_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<InFlight> in_flight_ ABSL_GUARDED_BY(mu_);
  int running_batches_ ABSL_GUARDED_BY(mu_) = 0;  // launched, Wait not yet returned
  std::vector<int> free_sets_ ABSL_GUARDED_BY(mu_);
  absl::Status fault_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool launch_done_ ABSL_GUARDED_BY(mu_) = false;
  bool started_ = false;
  bool uses_graphs_ = false;
  std::thread launch_thread_, completion_thread_;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_DEVICE_WORKER_H_
