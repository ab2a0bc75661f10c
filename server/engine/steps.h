// Device-driven verify steps (docs/steps.md): one call opens a verify step
// for a batch of sequences, naming where every layer's q, draft_kv, out and
// lse live in registered regions; from then on the scheduler rings a
// doorbell per layer and waits on a completion slot, and no RPC crosses per
// layer. Commit (per item, once every layer ran) or AbortStep closes it.
//
// Per rank (a device: every device in TP mode, the items' device in DP
// mode) a step runs on one lane of the device (device.h, LaneGeometry): the
// runner writes every layer's slot and the lane's page table when the step
// opens, and the device worker starts the lane in its queue order (so the
// lane sees every earlier write of its sequences). From then on the device
// runs layer l once the rank's doorbell holds base + l + 1 and stores base +
// l + 1 into the rank's completion slot; with GPU doorbells neither host is
// involved per layer. The runner's one thread watches the open steps
// (progress, timeouts, aborts) from host-visible progress words (on a GPU
// with one cudaEventQuery per lane to see that its work drained).
//
// A step's sequences are claimed for its life: their draft pages are
// reserved and their state is "pending" as after a first Verify, but plain
// Verify and AppendKv calls on them are refused until the step ends. An
// aborted step (AbortStep, a timeout, the deadline, a release of one of its
// sequences, a device fault, shutdown) ends its lanes early (doorbell and
// completion past the last layer: every wait on either side passes), waits
// until they ran out, then drops every item not yet committed: each
// sequence is left exactly as before the step.
#ifndef MLAVERIFY_SERVER_ENGINE_STEPS_H_
#define MLAVERIFY_SERVER_ENGINE_STEPS_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/engine/device.h"
#include "server/engine/engine_config.h"
#include "server/engine/regions.h"

namespace mlaverify::engine {

// Where one tensor of an item sits in every layer: layer l's tensor starts at
// `offset + l * layer_stride` of `region`. A stride of 0 keeps one place for
// every layer (the scheduler writes the next layer's input, or reads the
// last layer's output, between the doorbells); else it must be at least the
// tensor's size.
struct StepTensorPlacement {
  std::string region;
  uint64_t offset = 0;
  uint64_t layer_stride = 0;
};

// One item's tensors as one rank sees them (H_r: that rank's heads).
struct StepItemPlacement {
  StepTensorPlacement q;         // bf16 [N, H_r, 576]
  StepTensorPlacement draft_kv;  // bf16 [N, 576]
  StepTensorPlacement out;       // bf16 [N, H_r, 512], written
  StepTensorPlacement lse;       // fp32 [N, H_r], written
};

// One rank of a step: TP mode, one per device in the engine's device order,
// rank r computing heads [r * H/T, (r + 1) * H/T); DP mode, the one device
// of the step's items, all heads.
struct StepRankRequest {
  std::vector<StepItemPlacement> items;  // one per item, in item order
  // DoorbellKind::kHost: the two 16-byte slots (common/host_doorbell.h) in a
  // registered system region. The server zeroes both when the step opens.
  std::string doorbell_region;
  uint64_t doorbell_offset = 0;
  uint64_t completion_offset = 0;
};

struct StepItemSpec {
  uint64_t sequence_id = 0;
  std::vector<int32_t> parents;  // the draft tree, N entries
};

struct StepRequest {
  std::vector<StepItemSpec> items;
  std::vector<StepRankRequest> ranks;
  DoorbellKind doorbell_kind = DoorbellKind::kHost;
  float softmax_scale = 0;  // <= 0: the configured default
  // Zero: the server's default; over its maximum: INVALID_ARGUMENT.
  absl::Duration layer_timeout = absl::ZeroDuration();
  absl::Duration max_duration = absl::ZeroDuration();
};

// Where one rank's slots are and how their values count.
struct StepRankDoorbell {
  int device = 0;        // index in the engine's device list
  int cuda_device = -1;  // its CUDA ordinal (GPU doorbells)
  // Layer l is rung once the doorbell holds base + l + 1 or more, and has
  // run once the completion does; base + layers + 1 in the completion: the
  // step ended without running every layer (so did any larger value).
  uint64_t base = 0;
  // GPU doorbells: the device's doorbell arena (its IPC handle and size) and
  // the two words' offsets in it; `*_address` as the device addresses them
  // (for callers in this process: tests, benchmarks).
  std::string arena_ipc_handle;
  uint64_t arena_bytes = 0;
  uint64_t doorbell_offset = 0, completion_offset = 0;
  uint64_t doorbell_address = 0, completion_address = 0;
  // Host devices' arenas are host memory: the words in this process.
  uint8_t* arena_host = nullptr;
};

struct StepOpened {
  uint64_t step_id = 0;
  int num_layers = 0;
  std::vector<int64_t> prefix_len;  // per item: P the drafts attend to
  std::vector<StepRankDoorbell> ranks;
  absl::Duration layer_timeout;  // what applies
  absl::Duration max_duration;
};

enum class StepState {
  kRunning,     // layers are rung and run
  kLayersDone,  // every layer ran on every rank; the items' Commits are due
  kAborting,    // ending early: lanes running out, then items dropped
  kCommitted,   // every item committed: ended
  kAborted,     // ended without completing: every sequence as before the step
};
const char* StepStateName(StepState state);
bool StepEnded(StepState state);

// Why a step was aborted (a metrics label).
enum class StepAbortReason {
  kNone,
  kAbortCall,         // AbortStep
  kLayerTimeout,      // no layer completed (or no Commit came) within the layer timeout
  kDeadline,          // the step's maximum duration passed
  kSequenceReleased,  // one of its sequences was released
  kDeviceFault,       // a device faulted
  kLaneStopped,       // a lane ran out early (a device error)
  kShutdown,          // the server stopped
};
inline constexpr int kStepAbortReasons = 8;
const char* StepAbortReasonName(StepAbortReason reason);

struct StepInfo {
  uint64_t step_id = 0;
  StepState state = StepState::kRunning;
  int num_layers = 0;
  int layers_done = 0;  // on every rank
  int items = 0;
  int items_committed = 0;
  StepAbortReason abort_reason = StepAbortReason::kNone;
  absl::Status status;  // why it was aborted (OK otherwise)
};

struct StepStats {
  int64_t open = 0;  // not ended
  int64_t opened_total = 0;
  int64_t committed_total = 0;
  int64_t aborted_total[kStepAbortReasons] = {};
  int64_t lanes = 0;       // over all devices
  int64_t lanes_busy = 0;  // running a step or running out
};

// A finished step, for metrics (EngineObserver::OnStepEnded).
struct StepReport {
  StepState state = StepState::kCommitted;
  StepAbortReason abort_reason = StepAbortReason::kNone;
  int items = 0;
  int layers_done = 0;
  double seconds = 0;  // open to end
  // Per rank and layer, where the device measured them.
  std::vector<LayerTiming> layers;
};

// What the runner needs of the engine (Engine implements it). Thread-safe.
class StepHost {
 public:
  virtual ~StepHost() = default;
  virtual const EngineConfig& config() const = 0;
  virtual int num_devices() const = 0;
  virtual int heads_per_device() const = 0;
  // Device `d` (its thread-safe members and lanes) and whether its worker
  // replays graphs.
  virtual Device& device(int d) = 0;
  virtual bool uses_graphs(int d) const = 0;
  virtual const std::string& device_name(int d) const = 0;
  virtual RegionRegistry& regions() = 0;
  // OK, or the first device fault.
  virtual absl::Status fault() const = 0;

  // The device the items live on in DP mode (all on one), -1 in TP mode;
  // NOT_FOUND / INVALID_ARGUMENT as for Verify. Changes nothing.
  virtual absl::StatusOr<int> DeviceOfItems(absl::Span<const StepItemSpec> items) = 0;
  struct Claimed {
    int64_t prefix_len = 0;
    std::vector<int32_t> pages;  // the sequence's page list, drafts included
  };
  // Claims the items' sequences for step `step` and reserves their draft
  // pages (all or none): FAILED_PRECONDITION (another step, a pending
  // step of plain Verify calls), NOT_FOUND, RESOURCE_EXHAUSTED (pages,
  // max_sequence_len).
  virtual absl::StatusOr<std::vector<Claimed>> Claim(uint64_t step,
                                                     absl::Span<const StepItemSpec> items) = 0;
  // Gives back a claim no device work used yet (the step failed to open).
  virtual void Unclaim(uint64_t step, absl::Span<const StepItemSpec> items) = 0;
  // Drops item `sequence` of step `step` (as a Commit of an empty path);
  // `done` once its pages are back (OK also when it was no longer the
  // step's: released meanwhile).
  virtual void Drop(uint64_t step, uint64_t sequence,
                    absl::AnyInvocable<void(const absl::Status&)> done) = 0;
  // Queues the start of a step's lane on device `d` in the worker's order;
  // `done` once it was launched (or failed).
  virtual void EnqueueStepLaunch(int d, const StepLaunch& launch,
                                 absl::AnyInvocable<void(const absl::Status&)> done) = 0;
  virtual void OnStepEnded(const StepReport& report) = 0;
};

// Opens and drives the device-driven steps of one engine. Thread-safe.
class StepRunner {
 public:
  // `host` outlives the runner; lanes as the devices have them (Init done).
  explicit StepRunner(StepHost* host);
  // Aborts every open step (kShutdown), waits until they ended.
  ~StepRunner();
  StepRunner(const StepRunner&) = delete;
  StepRunner& operator=(const StepRunner&) = delete;

  // Validates everything once (items, trees, every tensor of every layer and
  // rank, the slots, the sequences' state), claims the sequences, reserves
  // their draft pages, writes every layer's slot and starts a lane per rank.
  // INVALID_ARGUMENT / NOT_FOUND / OUT_OF_RANGE / FAILED_PRECONDITION as for
  // Verify and its references; RESOURCE_EXHAUSTED when a device has no free
  // lane (the message has the numbers) or no pages; FAILED_PRECONDITION when
  // the doorbell kind cannot be used here; UNAVAILABLE while stopping.
  absl::StatusOr<StepOpened> Open(const StepRequest& request);
  // Aborts a step; `done` once it ended (its lanes ran out, its items were
  // dropped) with its final info. A step that already ended is reported as
  // it ended. NOT_FOUND: no such step (or forgotten).
  void Abort(uint64_t step_id, absl::AnyInvocable<void(absl::StatusOr<StepInfo>)> done);
  absl::StatusOr<StepInfo> Get(uint64_t step_id) const;
  StepStats Stats() const;

  // ---- the engine's hooks ----
  // A Commit of `sequence_id` while its step still runs layers: `make` is
  // called (under the runner's lock) for the commit, which runs once every
  // layer ran (with OK) or the step was aborted (with why), on the runner's
  // thread with no runner lock held, and this returns true; false when the
  // sequence is in no running step (commit at once; `make` is not called).
  bool DeferCommit(uint64_t sequence_id,
                   absl::FunctionRef<absl::AnyInvocable<void(absl::Status)>()> make);
  // Whether an item of step `step_id` may be committed now: OK once every
  // layer ran on every rank, else FAILED_PRECONDITION / ABORTED saying why.
  // Called with the sequence's lock held (takes the runner's locks only).
  absl::Status CommitAllowed(uint64_t step_id) const;
  // Item `sequence_id` of step `step_id` was committed by the client.
  // Called with the sequence's lock held.
  void OnItemCommitted(uint64_t step_id, uint64_t sequence_id);
  // The sequence is being released while step `step_id` holds it: the step
  // is aborted and `then` runs once it ended (its items dropped).
  void AbortForRelease(uint64_t step_id, absl::AnyInvocable<void()> then);

 private:
  struct Step;
  struct Rank;

  void WatchLoop();
  // One look at a step: progress, timeouts, the abort's stages. Work that
  // calls into the engine goes to actions_ (run without the lock). Returns
  // true when the step ended (the caller ends it: EndStep).
  bool Poll(Step& step, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees the ended step's lanes and claims, moves it to the history and
  // queues what must run without the lock (waiters, its report).
  void EndStep(uint64_t id, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void BeginAbort(Step& step, StepAbortReason reason, absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  StepInfo InfoOf(const Step& step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeLanes(Step& step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes the lane's page table and every layer's slot for one rank.
  absl::Status WriteLane(const std::vector<StepHost::Claimed>& claimed,
                         const std::vector<std::vector<uint64_t>>& visibility, float scale,
                         int max_n, Rank& rank);

  StepHost* const host_;
  const StepOptions options_;
  SlotLayout lane_slot_;  // as the devices' LaneGeometry has it
  std::atomic<uint64_t> next_id_{1};

  mutable absl::Mutex mu_;
  absl::CondVar wake_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Step>> open_ ABSL_GUARDED_BY(mu_);
  // Sequence -> the open step that claimed it.
  absl::flat_hash_map<uint64_t, uint64_t> claimed_ ABSL_GUARDED_BY(mu_);
  std::deque<StepInfo> ended_ ABSL_GUARDED_BY(mu_);
  // Per device: which lanes are busy; per device and lane: the doorbell
  // words' rotation and the next base value of each pair (GPU doorbells).
  std::vector<std::vector<bool>> lane_busy_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<uint32_t>> pair_turn_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<uint64_t>> pair_base_ ABSL_GUARDED_BY(mu_);
  StepStats stats_ ABSL_GUARDED_BY(mu_);
  // Calls into the engine (or a caller's callback) that the watcher makes
  // once it let go of the lock.
  std::vector<absl::AnyInvocable<void()>> actions_ ABSL_GUARDED_BY(mu_);
  std::thread watcher_;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_STEPS_H_
