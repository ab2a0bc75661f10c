// The engine's implementation behind the Engine interface (engine.h): the
// sequence table, the admission gate, the region registry's mapper and the
// device workers, and CallHost, all that engine.cc's call classes see of it.
// Only engine.cc includes it; everything else sees engine.h.
#ifndef MLAVERIFY_SERVER_ENGINE_ENGINE_IMPL_H_
#define MLAVERIFY_SERVER_ENGINE_ENGINE_IMPL_H_

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
#include "server/engine/engine.h"
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

// What a call in flight (the call types of engine.cc: OpCall, VerifyTask)
// needs of the engine, and no more: where its device work goes, the device
// address of a tensor it placed, and what it gives back or reports when it
// ends. EngineImpl implements it; the call types see nothing else of it.
class CallHost {
 public:
  virtual ~CallHost() = default;
  // Device `device`'s address of a placed tensor (its staging block's copy,
  // or the region's mapping on that device).
  virtual uint64_t AddressOf(const PlacedTensor& tensor, int device,
                             const HostStaging::Block& staging) const = 0;
  virtual void EnqueueOp(int device, DeviceOp op) = 0;
  // A finished call's staging block and admitted bytes, given back.
  virtual void FreeStaging(const HostStaging::Block& staging) = 0;
  virtual void LeaveAdmission(int64_t bytes) = 0;
  // A verify step a call opened was closed unrun: its draft pages go back
  // to the sequence's pool at once (only that call would have written them).
  virtual void StepClosedUnrun(const Sequence& seq, std::vector<int32_t> pages) = 0;
  // A Verify call that ran to OK: its items and drafts counted, its timing
  // reported.
  virtual void VerifySucceeded(int items, int64_t drafts, const VerifyTiming& timing) = 0;
};

class EngineImpl final : public Engine, private CallHost {
 public:
  ~EngineImpl() override;

  const EngineConfig& config() const override { return config_; }
  const std::string& backend_name() const override { return backend_name_; }
  std::vector<DeviceDescription> devices() const override;
  std::vector<std::string> device_names() const override;
  int num_devices() const override { return static_cast<int>(workers_.size()); }
  int heads_per_device() const override { return heads_per_device_; }
  const std::string& instance_id() const override { return instance_id_; }
  bool graphs_enabled() const override { return workers_[0]->uses_graphs(); }
  EngineStats Stats() const override;
  void HoldAnswerBytes(int64_t bytes) override { admission_.HoldBytes(bytes); }
  void ReleaseAnswerBytes(int64_t bytes) override { admission_.ReleaseBytes(bytes); }
  absl::Status fault() const override;
  void SetFaultListener(std::function<void(const absl::Status&)> listener) override;

  absl::StatusOr<uint64_t> CreateSequence(const std::string& label) override;

  void SubmitVerify(VerifyCall call, absl::AnyInvocable<void(absl::Status)> done) override;
  void SubmitAppendKv(AppendCall call,
                      absl::AnyInvocable<void(absl::StatusOr<int64_t>)> done) override;
  void SubmitCommit(uint64_t sequence_id, absl::Span<const int32_t> accepted,
                    absl::AnyInvocable<void(absl::StatusOr<CommitResult>)> done) override;
  void SubmitRelease(uint64_t sequence_id,
                     absl::AnyInvocable<void(absl::StatusOr<int64_t>)> done) override;

  int ExpireIdle(absl::Time now) override;

  absl::StatusOr<StepOpened> OpenStep(const StepRequest& request) override;
  absl::Status DoorbellSupport(DoorbellKind kind) const override;
  void SubmitAbortStep(uint64_t step_id,
                       absl::AnyInvocable<void(absl::StatusOr<StepInfo>)> done) override;
  absl::StatusOr<StepInfo> GetStep(uint64_t step_id) const override;

  RegionRegistry& regions() override { return regions_; }
  const RegionRegistry& regions() const override { return regions_; }

  absl::Status ReadKv(uint64_t sequence_id, int64_t start, int64_t count, absl::Span<Bf16> kv,
                      int replica) override;

 private:
  class Mapper;
  class StepHostImpl;

  explicit EngineImpl(const EngineConfig& config);
  friend class Engine;  // Create builds one

  // CallHost.
  uint64_t AddressOf(const PlacedTensor& p, int w, const HostStaging::Block& block) const override;
  void EnqueueOp(int device, DeviceOp op) override;
  void FreeStaging(const HostStaging::Block& staging) override;
  void LeaveAdmission(int64_t bytes) override { admission_.Leave(bytes); }
  void StepClosedUnrun(const Sequence& seq, std::vector<int32_t> pages) override;
  void VerifySucceeded(int items, int64_t drafts, const VerifyTiming& timing) override;

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

#endif  // MLAVERIFY_SERVER_ENGINE_ENGINE_IMPL_H_
