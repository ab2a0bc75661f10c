#include "server/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/draft_tree.h"
#include "common/geometry.h"
#include "common/kv_dtype.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"

namespace mlaverify::engine {
namespace {

// How many recently expired ids NOT_FOUND can still explain.
constexpr size_t kExpiredIdsRemembered = 4096;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t NowNanos() { return absl::ToUnixNanos(absl::Now()); }

// CANCELLED or DEADLINE_EXCEEDED when the caller no longer wants the call,
// else OK.
absl::Status UnwantedStatus(const CallContext& context) {
  if (context.is_cancelled && context.is_cancelled()) {
    return absl::CancelledError("the client cancelled the call while it was queued");
  }
  if (absl::Now() > context.deadline) {
    return absl::DeadlineExceededError("the call's deadline passed while it was queued");
  }
  return absl::OkStatus();
}

std::string FormatBytes(int64_t bytes) {
  if (bytes < (1 << 20)) return absl::StrCat(bytes, " bytes");
  return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1 << 20));
}

}  // namespace

struct Engine::Sequence {
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
class Engine::SequenceLocks {
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

// What every asynchronous call shares: admission bytes, the one decision
// whether it runs (asked by the first piece of device work taken), and the
// count of pieces still out.
class Engine::Call {
 public:
  Call(Engine* engine, CallContext context, int64_t bytes)
      : engine_(engine), context_(std::move(context)), bytes_(bytes), submitted_(absl::Now()) {}
  virtual ~Call() = default;

  void SetPieces(int pieces) {
    absl::MutexLock lock(&mu_);
    remaining_ = pieces;
  }

  // The call's one decision whether it runs, made by the first piece taken
  // (a piece taken meanwhile on another device waits for it). Skip() runs
  // without the call's lock: it takes sequence locks, which submissions hold
  // while they take a call's lock.
  absl::Status Decide() {
    {
      absl::MutexLock lock(&mu_);
      if (deciding_) {
        mu_.Await(absl::Condition(&decided_));
        return decision_;
      }
      deciding_ = true;
    }
    absl::Status decision = Skip();
    absl::MutexLock lock(&mu_);
    decision_ = decision;
    decided_ = true;
    return decision;
  }

 protected:
  // OK to run the call, else the status it completes with unrun; an
  // override may undo the call's effects before saying so. Called once.
  virtual absl::Status Skip() { return ContextStatus(); }

  absl::Status ContextStatus() const { return UnwantedStatus(context_); }

  // Records a piece's outcome; true when it was the last piece.
  bool PieceDone(const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    if (!status.ok() && status_.ok()) status_ = status;
    return --remaining_ == 0;
  }
  absl::Status status() {
    absl::MutexLock lock(&mu_);
    return status_;
  }
  // Whether the call's work ran (it was admitted to run when taken).
  bool ran() {
    absl::MutexLock lock(&mu_);
    return decided_ && decision_.ok();
  }

  // The staging block's tensors copied out to their caller memory (after
  // the call ran), then the block and the region leases let go.
  void CopyOutAndRelease(bool copy_out) {
    if (copy_out) {
      for (const StagedOutput& o : staged_outputs) {
        const uint8_t* from = staging.host + o.staging_offset;
        if (o.grow != nullptr) {
          // One pass: allocated and filled here, never zero-filled first.
          o.grow->assign(reinterpret_cast<const char*>(from), o.bytes);
        } else {
          std::memcpy(o.to, from, o.bytes);
        }
      }
    }
    if (engine_->staging_ != nullptr) engine_->staging_->Free(staging);
    staging = {};
    leases.Clear();
  }

  void SetBytes(int64_t bytes) { bytes_ = bytes; }

  Engine* const engine_;
  const CallContext context_;
  int64_t bytes_;  // admitted tensor bytes, set before the call is queued
  const absl::Time submitted_;

 public:
  // Filled while the call is submitted, then read only.
  struct StagedOutput {
    size_t staging_offset = 0;
    uint8_t* to = nullptr;        // caller memory, or
    std::string* grow = nullptr;  // an output string given its bytes at the copy out
    size_t bytes = 0;
  };
  RegionLeases leases;
  HostStaging::Block staging;
  std::vector<StagedOutput> staged_outputs;

 private:
  absl::Mutex mu_;
  int remaining_ ABSL_GUARDED_BY(mu_) = 0;
  bool deciding_ ABSL_GUARDED_BY(mu_) = false;
  bool decided_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status decision_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// Where one tensor of a call is, once checked.
struct Engine::Placed {
  enum class Where {
    kHost,    // caller memory the devices address as it is (host devices)
    kStaged,  // caller memory copied through the call's staging block
    kRegion,  // a region the devices address in place
  };
  Where where = Where::kHost;
  uint8_t* host = nullptr;         // the bytes in this process (null: device memory)
  const Region* region = nullptr;  // kRegion
  uint64_t offset = 0;             // kRegion: from the region's start
  size_t bytes = 0;
  size_t staging_offset = 0;    // kStaged: in the call's block
  std::string* grow = nullptr;  // an output string filled once the call passed its checks
};

namespace {

// An fp8 pool derives each row's scales from its values: a NaN or an
// infinity would poison a whole 128-value group, so rows that hold one are
// refused before anything is written. The check reads the bytes in this
// process; rows in device memory cannot be checked here.
absl::Status CheckRowsFinite(KvDtype dtype, const uint8_t* host, size_t bytes,
                             absl::string_view what) {
  if (dtype == KvDtype::kBf16) return absl::OkStatus();
  if (host == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": rows in device memory cannot be checked for NaN/Inf before an ",
        KvDtypeName(dtype), " pool stores them; send them inline or in system shared memory"));
  }
  const auto* values = reinterpret_cast<const Bf16*>(host);
  const int64_t count = static_cast<int64_t>(bytes / sizeof(Bf16));
  for (int64_t row = 0; row * kLatentDim < count; ++row) {
    if (!AllFinite(values + row * kLatentDim, kLatentDim)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": row ", row, " holds a NaN or an infinity, which an ",
                       KvDtypeName(dtype), " pool cannot store (its scales come from the values)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

// RegionMapper over the engine's workers: host memory is page-locked once
// (for every device of the process) and addressed by each; exported device
// memory is opened once per physical device.
class Engine::Mapper final : public RegionMapper {
 public:
  explicit Mapper(Engine* engine) : engine_(engine) {}

  absl::StatusOr<HostMapping> MapHost(void* data, size_t bytes) override {
    auto& workers = engine_->workers_;
    Device& first = workers[0]->device();
    HostMapping mapping;
    mapping.pinned = !first.addresses_host_memory();
    if (mapping.pinned) RETURN_IF_ERROR(first.PinHost(data, bytes));
    for (const auto& w : workers) {
      absl::StatusOr<uint64_t> address = w->device().AddressOfHost(data);
      if (!address.ok()) {
        if (mapping.pinned) first.UnpinHost(data);
        return address.status();
      }
      mapping.device.push_back(*address);
    }
    return mapping;
  }

  void UnmapHost(void* data) override { engine_->workers_[0]->device().UnpinHost(data); }

  absl::StatusOr<std::vector<uint64_t>> OpenCuda(absl::string_view handle, int device_id) override {
    RETURN_IF_ERROR(CheckCudaDevice(device_id));
    auto& workers = engine_->workers_;
    // Workers over the same device share one mapping (a handle opens once
    // per device and process).
    std::vector<uint64_t> out(workers.size(), 0);
    std::vector<std::pair<std::string, uint64_t>> opened;
    for (size_t k = 0; k < workers.size(); ++k) {
      const std::string device = workers[k]->device_name();
      for (const auto& [name, address] : opened) {
        if (name == device) out[k] = address;
      }
      if (out[k] != 0) continue;
      absl::StatusOr<uint64_t> address = workers[k]->device().OpenIpcMemory(handle);
      if (!address.ok()) {
        CloseCuda(out);
        return address.status();
      }
      out[k] = *address;
      opened.emplace_back(device, *address);
    }
    return out;
  }

  void CloseCuda(const std::vector<uint64_t>& addresses) override {
    auto& workers = engine_->workers_;
    std::vector<std::string> closed;
    for (size_t k = 0; k < addresses.size() && k < workers.size(); ++k) {
      const std::string device = workers[k]->device_name();
      if (addresses[k] == 0 || std::find(closed.begin(), closed.end(), device) != closed.end()) {
        continue;
      }
      workers[k]->device().CloseIpcMemory(addresses[k]);
      closed.push_back(device);
    }
  }

  absl::StatusOr<std::vector<uint64_t>> AddressLocalDevice(uint64_t address,
                                                           int device_id) override {
    RETURN_IF_ERROR(CheckCudaDevice(device_id));
    std::vector<uint64_t> out;
    for (const auto& w : engine_->workers_) {
      ASSIGN_OR_RETURN(uint64_t a, w->device().AddressOfDeviceMemory(address, device_id));
      out.push_back(a);
    }
    return out;
  }

 private:
  absl::Status CheckCudaDevice(int device_id) const {
    auto& workers = engine_->workers_;
    if (workers[0]->device().cuda_ordinal() < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "CUDA shared memory needs the CUDA backend; this server runs ", engine_->backend_name_));
    }
    for (const auto& w : workers) {
      if (w->device().cuda_ordinal() == device_id) return absl::OkStatus();
    }
    return absl::InvalidArgumentError(
        absl::StrCat("device_id ", device_id, " is none of this server's devices (",
                     absl::StrJoin(engine_->device_names(), ", "), ")"));
  }

  Engine* const engine_;
};

// A call made of device ops (AppendKv, Commit, Release, ReadKv): one op per
// device the sequence lives on; `finish` runs once all are done.
class Engine::OpCall final : public Call {
 public:
  using SkipFn = absl::AnyInvocable<absl::Status()>;
  using FinishFn = absl::AnyInvocable<void(const absl::Status& status, bool ran)>;

  OpCall(Engine* engine, CallContext context, int64_t bytes, SkipFn skip, FinishFn finish)
      : Call(engine, std::move(context), bytes),
        skip_(std::move(skip)),
        finish_(std::move(finish)) {}

  // Queues `op` (admit and done filled in here; `rows_in` from `rows` as
  // each device addresses it) on each of `devices`.
  void Enqueue(const std::vector<int>& devices, const DeviceOp& op, const Placed* rows = nullptr) {
    SetPieces(static_cast<int>(devices.size()));
    for (int d : devices) {
      DeviceOp copy;
      copy.kind = op.kind;
      copy.sequence = op.sequence;
      copy.table = op.table;
      copy.release_table = op.release_table;
      copy.start = op.start;
      copy.count = op.count;
      copy.rows_in = rows != nullptr ? engine_->AddressOf(*rows, d, staging) : 0;
      copy.rows_out = op.rows_out;
      copy.prefix_len = op.prefix_len;
      copy.accepted = accepted;
      copy.admit = [this] { return Decide(); };
      copy.done = [this](const absl::Status& status) {
        if (PieceDone(status)) Finish();
      };
      engine_->workers_[d]->Enqueue(std::move(copy));
    }
  }

  // Storage the ops point into, owned by the call.
  std::vector<int32_t> accepted;

 protected:
  absl::Status Skip() override { return skip_ ? skip_() : absl::OkStatus(); }

 private:
  void Finish() {
    const absl::Status s = status();
    const bool r = ran();
    CopyOutAndRelease(false);
    engine_->Unadmit(bytes_);
    finish_(s, r);
    delete this;
  }

  SkipFn skip_;
  FinishFn finish_;
};

// A Verify call: one shard per item and device.
class Engine::VerifyTask final : public Call, public ShardOwner {
 public:
  struct Item {
    std::shared_ptr<Sequence> seq;
    int n = 0;
    bool opened = false;  // this call opened the step
    uint64_t step = 0;
    uint64_t op = 0;  // its number among the sequence's calls
    std::shared_ptr<const std::vector<uint64_t>> visibility;
  };

  VerifyTask(Engine* engine, CallContext context, int64_t bytes, int layer, VerifyTiming* timing,
             absl::AnyInvocable<void(absl::Status)> done)
      : Call(engine, std::move(context), bytes),
        layer_(layer),
        timing_(timing),
        done_(std::move(done)) {}

  std::vector<Item> items;

  // The call passed its checks and was admitted for `bytes`.
  void Accept(int64_t bytes, absl::AnyInvocable<void(absl::Status)> done) {
    SetBytes(bytes);
    done_ = std::move(done);
  }

  absl::Status AdmitShard(int) override { return Decide(); }

  void ShardDone(int, const absl::Status& status, const ShardTiming& timing) override {
    {
      absl::MutexLock lock(&timing_mu_);
      last_taken_ = std::max(last_taken_, timing.taken);
      device_seconds_ = std::max(device_seconds_, timing.device_seconds);
    }
    if (PieceDone(status)) Finish();
  }

 protected:
  absl::Status Skip() override {
    absl::Status skip = ContextStatus();
    if (skip.ok()) {
      for (const Item& item : items) {
        // Under the sequence's lock, as RollBackOpenedSteps below: Skip runs
        // with no call or queue lock held (Decide).
        bool released = false;
        {
          absl::MutexLock lock(&item.seq->mu);
          released = item.seq->released;
        }
        if (released) {
          skip = absl::NotFoundError(
              absl::StrCat("sequence ", item.seq->id, " was released while this call was queued"));
          break;
        }
      }
    }
    if (skip.ok()) return skip;
    RollBackOpenedSteps();
    return skip;
  }

 private:
  // For a call that did not complete: a step it opened is closed again (its
  // pages freed) if nothing was submitted for the sequence after it.
  void RollBackOpenedSteps() {
    for (const Item& item : items) {
      if (!item.opened) continue;
      Sequence& s = *item.seq;
      std::vector<int32_t> freed;
      {
        absl::MutexLock lock(&s.mu);
        if (s.released || !s.pending || s.step != item.step || s.ops_submitted != item.op ||
            s.layers_verified != 0) {
          continue;
        }
        freed.assign(s.pages.end() - s.step_pages, s.pages.end());
        s.pages.resize(s.pages.size() - s.step_pages);
        s.Trimmed(s.pages.size());
        s.step_pages = 0;
        s.pending = false;
        s.parents.clear();
        s.visibility.reset();
        s.layer_verified.clear();
        engine_->pending_steps_.fetch_sub(1);
      }
      // At once: the pages were taken by this call and only it would have
      // written them; no work queued before it owns them.
      engine_->AllocatorOf(s).Free(freed);
    }
  }

  void Finish() {
    const absl::Status s = status();
    if (!s.ok() && ran()) RollBackOpenedSteps();
    for (const Item& item : items) {
      Sequence& seq = *item.seq;
      seq.CallEnded();
      absl::MutexLock lock(&seq.mu);
      if (seq.released || !seq.pending || seq.step != item.step) continue;
      if (s.ok()) {
        if (!seq.layer_verified[layer_]) {
          seq.layer_verified[layer_] = true;
          ++seq.layers_verified;
        }
        seq.Touch();
      } else if (ran() && seq.layer_verified[layer_]) {
        // The layer's draft rows may be half rewritten: verify it again.
        seq.layer_verified[layer_] = false;
        --seq.layers_verified;
      }
    }
    int64_t drafts = 0;
    for (const Item& item : items) drafts += item.n;
    if (s.ok()) {
      engine_->verify_items_.fetch_add(static_cast<int64_t>(items.size()));
      engine_->drafts_verified_.fetch_add(drafts);
    }
    CopyOutAndRelease(s.ok());
    engine_->Unadmit(bytes_);
    VerifyTiming t;
    t.items = static_cast<int>(items.size());
    {
      absl::MutexLock lock(&timing_mu_);
      t.queue_seconds = std::max(0.0, absl::ToDoubleSeconds(last_taken_ - submitted_));
      t.device_seconds = device_seconds_;
    }
    t.total_seconds = absl::ToDoubleSeconds(absl::Now() - submitted_);
    if (timing_ != nullptr) *timing_ = t;
    if (engine_->observer_ != nullptr && s.ok()) engine_->observer_->OnVerifyDone(t);
    done_(s);
    delete this;
  }

  const int layer_;
  VerifyTiming* const timing_;
  absl::AnyInvocable<void(absl::Status)> done_;
  absl::Mutex timing_mu_;
  absl::Time last_taken_ ABSL_GUARDED_BY(timing_mu_) = absl::InfinitePast();
  double device_seconds_ ABSL_GUARDED_BY(timing_mu_) = 0;
};

// The engine as the step runner sees it (steps.h).
class Engine::StepHostImpl final : public StepHost {
 public:
  explicit StepHostImpl(Engine* engine) : e_(engine) {
    for (const auto& w : e_->workers_) names_.push_back(w->name());
  }

  const EngineConfig& config() const override { return e_->config_; }
  int num_devices() const override { return e_->num_devices(); }
  int heads_per_device() const override { return e_->heads_per_device_; }
  Device& device(int d) override { return e_->workers_[d]->device(); }
  bool uses_graphs(int d) const override { return e_->workers_[d]->uses_graphs(); }
  const std::string& device_name(int d) const override { return names_[d]; }
  RegionRegistry& regions() override { return e_->regions_; }
  absl::Status fault() const override { return e_->fault(); }

  absl::StatusOr<int> DeviceOfItems(absl::Span<const StepItemSpec> items) override {
    if (e_->config_.parallel_mode == ParallelMode::kTensorParallel) return -1;
    int device = -1;
    for (size_t k = 0; k < items.size(); ++k) {
      ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, e_->Find(items[k].sequence_id));
      if (device >= 0 && seq->pool != device) {
        return absl::InvalidArgumentError(absl::StrCat(
            "items[", k, "] (sequence ", items[k].sequence_id, ") lives on device ",
            e_->workers_[seq->pool]->name(), ", items[0] on ", e_->workers_[device]->name(),
            ": in data-parallel mode a step's items must share a device"));
      }
      device = seq->pool;
    }
    return device;
  }

  absl::StatusOr<std::vector<Claimed>> Claim(uint64_t step,
                                             absl::Span<const StepItemSpec> items) override {
    return e_->ClaimForStep(step, items);
  }
  void Unclaim(uint64_t step, absl::Span<const StepItemSpec> items) override {
    e_->UnclaimStep(step, items);
  }

  void Drop(uint64_t step, uint64_t sequence,
            absl::AnyInvocable<void(const absl::Status&)> done) override {
    absl::AnyInvocable<void(absl::StatusOr<CommitResult>)> finish =
        [done = std::move(done)](absl::StatusOr<CommitResult> r) mutable { done(r.status()); };
    const std::vector<int32_t> empty;
    absl::Status rejected = e_->StartCommit(sequence, empty, finish, step);
    if (!rejected.ok()) {
      // Released (or dropped) meanwhile: nothing of the step's is left there.
      if (absl::IsNotFound(rejected) || absl::IsFailedPrecondition(rejected)) {
        rejected = absl::OkStatus();
      }
      finish(rejected);
      return;
    }
    for (auto& w : e_->workers_) w->Kick();
  }

  void EnqueueStepLaunch(int d, const StepLaunch& launch,
                         absl::AnyInvocable<void(const absl::Status&)> done) override {
    DeviceOp op;
    op.kind = DeviceOp::Kind::kStep;
    op.step = launch;
    op.done = std::move(done);
    e_->workers_[d]->Enqueue(std::move(op));
    e_->workers_[d]->Kick();
  }

  void OnStepEnded(const StepReport& report) override {
    if (e_->observer_ != nullptr) e_->observer_->OnStepEnded(report);
  }

 private:
  Engine* const e_;
  std::vector<std::string> names_;
};

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineConfig& config,
                                                       std::vector<std::unique_ptr<Device>> devices,
                                                       EngineObserver* observer) {
  const int num_devices = static_cast<int>(devices.size());
  RETURN_IF_ERROR(config.Validate(num_devices));
  for (const auto& d : devices) {
    if (d == nullptr) return absl::InvalidArgumentError("null device");
  }
  std::unique_ptr<Engine> e(new Engine(config));
  e->observer_ = observer;
  const std::string first = devices[0]->name();
  e->backend_name_ = first.substr(0, first.find(':'));  // "cuda", "cpu", "fake"
  const bool tp = config.parallel_mode == ParallelMode::kTensorParallel;
  e->heads_per_device_ = tp ? config.num_heads / num_devices : config.num_heads;

  DeviceGeometry geometry;
  geometry.num_layers = config.num_layers;
  geometry.num_pages = config.num_pages();
  geometry.page_size = config.page_size;
  geometry.kv_dtype = config.kv_dtype;
  geometry.num_heads = e->heads_per_device_;
  geometry.max_batch = config.max_batch();
  geometry.max_draft_len = config.max_draft_len();
  geometry.slots = config.batches_in_flight;
  geometry.table_entries = PageTableArena::EntriesFor(config.num_pages(), config.max_live_sequences,
                                                      config.max_pages_per_sequence());
  geometry.slot = SlotLayout::For(config.max_batch(), config.max_draft_len(), config.page_size,
                                  config.max_pages_per_sequence());
  geometry.lanes.lanes = config.steps.lanes_per_device;
  // A lane's slots carry no page-table writes (its table goes up whole).
  geometry.lanes.slot =
      SlotLayout::For(config.max_batch(), config.max_draft_len(), config.page_size, 0);
  geometry.lanes.table_entries =
      static_cast<int64_t>(config.max_batch()) * config.max_pages_per_sequence();
  WorkerOptions options;
  options.batch_buckets = config.batch_buckets;
  options.draft_buckets = config.draft_buckets;
  options.use_graphs = config.use_graphs;
  options.max_queue_delay = config.max_queue_delay;
  options.copy_threads = config.copy_threads;
  options.completion_thread = config.completion_thread;
  Engine* raw = e.get();
  // Names unique in this engine: a device listed twice is "cuda:0" and "cuda:0#2".
  absl::flat_hash_map<std::string, int> seen;
  for (int d = 0; d < num_devices; ++d) {
    const std::string base = devices[d]->name();
    const int n = ++seen[base];
    std::string name = n == 1 ? base : absl::StrCat(base, "#", n);
    e->workers_.push_back(std::make_unique<DeviceWorker>(
        d, std::move(devices[d]), std::move(name), options, observer,
        [raw](int device, const absl::Status& status) { raw->OnDeviceFault(device, status); }));
  }
  for (auto& w : e->workers_) RETURN_IF_ERROR(w->Start(geometry));
  Device& first_device = e->workers_[0]->device();
  if (!first_device.addresses_host_memory()) {
    const size_t bytes = static_cast<size_t>(config.pinned_staging_bytes);
    ASSIGN_OR_RETURN(uint8_t * memory, first_device.AllocateHostStaging(bytes));
    std::vector<uint64_t> addresses;
    for (auto& w : e->workers_) {
      absl::StatusOr<uint64_t> a = w->device().AddressOfHost(memory);
      if (!a.ok()) {
        first_device.FreeHostStaging(memory);
        return a.status();
      }
      addresses.push_back(*a);
    }
    e->staging_ = std::make_unique<HostStaging>(
        memory, bytes, std::move(addresses),
        [&first_device](uint8_t* m) { first_device.FreeHostStaging(m); });
  }
  e->mapper_ = std::make_unique<Mapper>(raw);
  e->regions_.SetMapper(e->mapper_.get());
  e->step_host_ = std::make_unique<StepHostImpl>(raw);
  e->steps_ = std::make_unique<StepRunner>(e->step_host_.get());
  const int pools = tp ? 1 : num_devices;
  for (int p = 0; p < pools; ++p) {
    e->allocators_.push_back(std::make_unique<PageAllocator>(config.num_pages()));
  }
  {
    absl::MutexLock lock(&e->table_mu_);
    e->live_per_pool_.assign(pools, 0);
  }
  std::vector<std::string> names;
  for (const auto& w : e->workers_) names.push_back(w->name());
  spdlog::info(
      "engine: {} on {} ({} mode), {} layers, {} heads ({} per device), page size {}, "
      "{} KV ({} bytes per row), {} pages per {} ({}), max draft {}, max batch {}, "
      "{} launches in flight, {} host staging",
      e->backend_name_, absl::StrJoin(names, ","), ParallelModeName(config.parallel_mode),
      config.num_layers, config.num_heads, e->heads_per_device_, config.page_size,
      KvDtypeName(config.kv_dtype), KvRowBytes(config.kv_dtype), config.num_pages(),
      tp ? "replica" : "device", FormatBytes(config.pool_bytes), config.max_draft_len(),
      config.max_batch(), config.batches_in_flight,
      e->staging_ != nullptr ? FormatBytes(config.pinned_staging_bytes) : "no");
  return e;
}

Engine::Engine(const EngineConfig& config) : config_(config), regions_(config.shared_memory) {
  absl::MutexLock lock(&table_mu_);
  instance_id_ = absl::StrFormat("%08x%08x", id_source_(), id_source_());
}

Engine::~Engine() {
  steps_.reset();  // aborts open steps while the workers still run
  for (auto& w : workers_) w->Stop();
  // Regions and staging go while the devices that mapped them are still here.
  regions_.ReleaseAll();
  staging_.reset();
}

std::vector<DeviceDescription> Engine::devices() const {
  std::vector<DeviceDescription> out;
  for (const auto& w : workers_) out.push_back(w->Describe());
  return out;
}

std::vector<std::string> Engine::device_names() const {
  std::vector<std::string> out;
  for (const auto& w : workers_) out.push_back(w->name());
  return out;
}

absl::Status Engine::fault() const {
  if (!faulted_.load(std::memory_order_acquire)) return absl::OkStatus();
  absl::MutexLock lock(&fault_mu_);
  return fault_;
}

void Engine::SetFaultListener(std::function<void(const absl::Status&)> listener) {
  absl::MutexLock lock(&fault_mu_);
  fault_listener_ = std::move(listener);
}

void Engine::OnDeviceFault(int, const absl::Status& status) {
  std::function<void(const absl::Status&)> listener;
  {
    absl::MutexLock lock(&fault_mu_);
    if (!fault_.ok()) return;
    fault_ = status;
    faulted_.store(true, std::memory_order_release);
    listener = fault_listener_;
  }
  if (listener) listener(status);
}

EngineStats Engine::Stats() const {
  EngineStats s;
  s.kv_dtype = config_.kv_dtype;
  s.kv_row_bytes = KvRowBytes(config_.kv_dtype);
  const bool tp = config_.parallel_mode == ParallelMode::kTensorParallel;
  std::vector<int64_t> live;
  {
    absl::MutexLock lock(&table_mu_);
    s.live_sequences = static_cast<int64_t>(sequences_.size());
    live = live_per_pool_;
  }
  for (size_t p = 0; p < allocators_.size(); ++p) {
    PoolStats pool;
    if (tp) {
      std::vector<std::string> names;
      for (const auto& w : workers_) names.push_back(w->name());
      pool.devices = absl::StrJoin(names, ",");
    } else {
      pool.devices = workers_[p]->name();
    }
    pool.total_pages = allocators_[p]->total_pages();
    pool.free_pages = allocators_[p]->free_pages();
    pool.live_sequences = p < live.size() ? live[p] : 0;
    s.total_pages += pool.total_pages;
    s.free_pages += pool.free_pages;
    s.pools.push_back(std::move(pool));
  }
  s.queued_calls = queued_calls_.load();
  s.queued_bytes = queued_bytes_.load();
  if (staging_ != nullptr) {
    s.staging_bytes = static_cast<int64_t>(staging_->capacity());
    s.staging_bytes_in_use = static_cast<int64_t>(staging_->in_use());
  }
  s.pending_steps = pending_steps_.load();
  s.tokens_appended_total = tokens_appended_.load();
  s.tokens_committed_total = tokens_committed_.load();
  s.drafts_verified_total = drafts_verified_.load();
  s.verify_items_total = verify_items_.load();
  s.steps_committed_total = steps_committed_.load();
  s.sequences_created_total = sequences_created_.load();
  s.sequences_expired_total = sequences_expired_.load();
  if (steps_ != nullptr) s.steps = steps_->Stats();
  return s;
}

PageAllocator& Engine::AllocatorOf(const Sequence& seq) { return *allocators_[seq.pool]; }

absl::StatusOr<std::vector<std::vector<int32_t>>> Engine::AllocateInEveryPool(
    const std::vector<int64_t>& pages) {
  std::vector<std::vector<int32_t>> got(allocators_.size());
  for (size_t p = 0; p < allocators_.size(); ++p) {
    absl::StatusOr<std::vector<int32_t>> pool = allocators_[p]->Allocate(pages[p]);
    if (!pool.ok()) {
      for (size_t q = 0; q < p; ++q) allocators_[q]->Free(got[q]);
      return pool.status();
    }
    got[p] = *std::move(pool);
  }
  return got;
}

std::vector<int> Engine::DevicesOf(const Sequence& seq) const {
  if (config_.parallel_mode == ParallelMode::kDataParallel) return {seq.pool};
  std::vector<int> all(workers_.size());
  for (size_t d = 0; d < all.size(); ++d) all[d] = static_cast<int>(d);
  return all;
}

void Engine::KickAll(const std::vector<int>& devices) {
  for (int d : devices) workers_[d]->Kick();
}

absl::Status Engine::Admit(int64_t bytes) {
  if (absl::Status f = fault(); !f.ok()) {
    return absl::UnavailableError(
        absl::StrCat(f.message(), "; this server no longer serves device work"));
  }
  // A call bigger than the whole budget could never be admitted: saying
  // "retry later" would have a client retry forever.
  if (bytes > config_.max_queued_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "this call holds ", FormatBytes(bytes), ", more than --max-queued-bytes (",
        FormatBytes(config_.max_queued_bytes), ") admits at once; split it into smaller calls"));
  }
  // Taken first, given back when over a limit: concurrent admissions never
  // exceed the limits together.
  const int64_t calls = queued_calls_.fetch_add(1) + 1;
  const int64_t held = queued_bytes_.fetch_add(bytes) + bytes;
  if (calls > config_.max_queued_calls || held > config_.max_queued_bytes) {
    Unadmit(bytes);
    return absl::ResourceExhaustedError(absl::StrCat(
        "server queue full: ", calls - 1,
        " calls queued or running and answers not yet "
        "read by their streams hold ",
        FormatBytes(held - bytes), ", this one needs ", FormatBytes(bytes), "; limits ",
        config_.max_queued_calls, " calls and ", FormatBytes(config_.max_queued_bytes),
        " (--max-queued-calls, --max-queued-bytes): retry later"));
  }
  return absl::OkStatus();
}

void Engine::Unadmit(int64_t bytes) {
  queued_calls_.fetch_sub(1);
  queued_bytes_.fetch_sub(bytes);
}

absl::StatusOr<uint64_t> Engine::CreateSequence(const std::string& label) {
  if (static_cast<int64_t>(label.size()) > config_.max_label_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("label of ", label.size(), " bytes; at most ", config_.max_label_bytes));
  }
  uint64_t id;
  {
    absl::MutexLock lock(&table_mu_);
    if (static_cast<int64_t>(sequences_.size()) >= config_.max_live_sequences) {
      return absl::ResourceExhaustedError(absl::StrCat("server holds ", sequences_.size(),
                                                       " live sequences, the limit (",
                                                       "--max-live-sequences): release one first"));
    }
    // Random 64-bit ids from the OS's cryptographic generator: an id from
    // another replica or an earlier run of this one names no sequence here
    // (NOT_FOUND), never someone else's, and one client cannot guess
    // another's.
    do {
      id = (static_cast<uint64_t>(id_source_()) << 32) | id_source_();
    } while (id == 0 || sequences_.contains(id) || expired_.contains(id));
    int pool = 0;
    if (config_.parallel_mode == ParallelMode::kDataParallel) {
      // The device with the most free pages, then the fewest sequences.
      for (int p = 1; p < static_cast<int>(allocators_.size()); ++p) {
        const int64_t free_p = allocators_[p]->free_pages(),
                      free_best = allocators_[pool]->free_pages();
        if (free_p > free_best ||
            (free_p == free_best && live_per_pool_[p] < live_per_pool_[pool])) {
          pool = p;
        }
      }
    }
    sequences_.emplace(id, std::make_shared<Sequence>(id, label, pool));
    ++live_per_pool_[pool];
  }
  sequences_created_.fetch_add(1);
  spdlog::debug("seq {} created (label \"{}\")", id, absl::CHexEscape(label));
  return id;
}

absl::StatusOr<std::shared_ptr<Engine::Sequence>> Engine::Find(uint64_t id) const {
  {
    absl::ReaderMutexLock lock(&table_mu_);
    auto it = sequences_.find(id);
    if (it != sequences_.end()) return it->second;
  }
  return NotFound(id);
}

absl::Status Engine::NotFound(uint64_t id) const {
  absl::MutexLock lock(&table_mu_);
  if (expired_.contains(id)) {
    return absl::NotFoundError(absl::StrCat("sequence ", id, " expired after being idle for ",
                                            absl::FormatDuration(config_.idle_timeout)));
  }
  return absl::NotFoundError(absl::StrCat("sequence ", id, " not found on server instance ",
                                          instance_id_,
                                          " (never created here, released, or created before a "
                                          "restart: the instance id changes with every start)"));
}

std::shared_ptr<const TableDelta> Engine::TakeDelta(Sequence& s) {
  const int64_t size = static_cast<int64_t>(s.pages.size());
  if (s.low_water == s.device_pages && s.device_pages == size) return nullptr;
  auto delta = std::make_shared<TableDelta>();
  delta->keep = std::min(s.low_water, s.device_pages);
  delta->values.assign(s.pages.begin() + delta->keep, s.pages.end());
  s.device_pages = s.low_water = size;
  return delta;
}

void Engine::FreeAfterBarrier(const std::shared_ptr<Sequence>& seq, std::vector<int32_t> pages,
                              absl::AnyInvocable<void()> then) {
  PageAllocator* allocator = &AllocatorOf(*seq);
  auto* call = new OpCall(this, CallContext{}, 0, nullptr,
                          [allocator, pages = std::move(pages), then = std::move(then)](
                              const absl::Status&, bool) mutable {
                            allocator->Free(pages);
                            if (then) then();
                          });
  // Not counted against the limits: it holds no tensor bytes, and a
  // release must never be refused.
  queued_calls_.fetch_add(1);
  DeviceOp barrier;
  barrier.kind = DeviceOp::Kind::kBarrier;
  barrier.sequence = seq->id;
  barrier.release_table = true;  // the sequence is gone from every device
  const std::vector<int> devices = DevicesOf(*seq);
  call->Enqueue(devices, barrier);
  KickAll(devices);
}

namespace {

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBf16:
      return "DTYPE_BF16";
    case DType::kFp32:
      return "DTYPE_FP32";
    default:
      return "DTYPE_UNSPECIFIED";
  }
}

size_t DTypeBytes(DType dtype) { return dtype == DType::kFp32 ? 4 : 2; }

std::string ShapeText(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Elements of a shape, or -1 when a dimension is negative or the product
// exceeds 2^40 (no tensor of the contract is near that: the check keeps the
// arithmetic from overflowing on hostile shapes).
int64_t Elements(std::initializer_list<int64_t> shape) {
  constexpr int64_t kMaxElements = int64_t{1} << 40;
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > kMaxElements / d)) return -1;
    n *= d;
  }
  return n;
}

constexpr size_t kStagingAlign = 256;

size_t Aligned(size_t bytes) { return (bytes + kStagingAlign - 1) / kStagingAlign * kStagingAlign; }

}  // namespace

absl::StatusOr<Engine::Placed> Engine::Sized(DType dtype, std::initializer_list<int64_t> shape,
                                             const TensorName& name) {
  const int64_t n = Elements(shape);
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name.str(), ": shape ", ShapeText(shape), " is negative or too large"));
  }
  Placed p;
  p.bytes = static_cast<size_t>(n) * DTypeBytes(dtype);
  return p;
}

absl::StatusOr<Engine::Placed> Engine::PlaceInput(const TensorRef& ref, DType dtype,
                                                  std::initializer_list<int64_t> shape,
                                                  RegionLeases& leases, const TensorName& name) {
  if (ref.dtype != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        name.str(), ": dtype ", ref.dtype == DType::kOther ? ref.dtype_name : DTypeName(ref.dtype),
        ", expected ", DTypeName(dtype)));
  }
  if (ref.has_shape &&
      !std::equal(ref.shape.begin(), ref.shape.end(), shape.begin(), shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat(name.str(), ": shape ", ShapeText(ref.shape),
                                                   ", expected ", ShapeText(shape)));
  }
  ASSIGN_OR_RETURN(Placed p, Sized(dtype, shape, name));
  if (ref.in_region) {
    RETURN_IF_ERROR(PlaceInRegion(ref.range, dtype, /*is_output=*/false, leases, name, &p));
    return p;
  }
  if (ref.bytes.size() != p.bytes) {
    return absl::InvalidArgumentError(absl::StrCat(name.str(), ": ", ref.bytes.size(),
                                                   " bytes of data, shape ", ShapeText(shape),
                                                   " needs ", p.bytes));
  }
  p.host = const_cast<uint8_t*>(ref.bytes.data());
  p.where = staging_ != nullptr ? Placed::Where::kStaged : Placed::Where::kHost;
  return p;
}

absl::StatusOr<Engine::Placed> Engine::PlaceOutput(const OutputRef& ref, DType dtype,
                                                   std::initializer_list<int64_t> shape,
                                                   RegionLeases& leases, const TensorName& name) {
  ASSIGN_OR_RETURN(Placed p, Sized(dtype, shape, name));
  if (ref.in_region) {
    RETURN_IF_ERROR(PlaceInRegion(ref.range, dtype, /*is_output=*/true, leases, name, &p));
    return p;
  }
  if (ref.grow != nullptr && ref.buffer.empty()) {
    p.grow = ref.grow;  // filled once the call passed its checks (see StartVerify)
  } else {
    if (ref.buffer.size() != p.bytes) {
      return absl::InvalidArgumentError(absl::StrCat(name.str(), ": a buffer of ",
                                                     ref.buffer.size(), " bytes, shape ",
                                                     ShapeText(shape), " needs ", p.bytes));
    }
    p.host = ref.buffer.data();
  }
  p.where = staging_ != nullptr ? Placed::Where::kStaged : Placed::Where::kHost;
  return p;
}

absl::Status Engine::PlaceInRegion(const RegionRange& range, DType dtype, bool is_output,
                                   RegionLeases& leases, const TensorName& name, Placed* p) {
  ASSIGN_OR_RETURN(ResolvedRange r,
                   leases.Resolve(regions_, range, p->bytes, DTypeBytes(dtype), is_output, name));
  p->host = r.host();
  if (r.region->device().empty()) {
    // A region the devices cannot address (it could not be page-locked).
    p->where = staging_ != nullptr ? Placed::Where::kStaged : Placed::Where::kHost;
    return absl::OkStatus();
  }
  p->where = Placed::Where::kRegion;
  p->region = r.region;
  p->offset = r.offset;
  return absl::OkStatus();
}

uint64_t Engine::AddressOf(const Placed& p, int w, const HostStaging::Block& block) const {
  switch (p.where) {
    case Placed::Where::kRegion:
      return p.region->device()[w] + p.offset;
    case Placed::Where::kStaged:
      return staging_->DeviceAddress(w, block.host + p.staging_offset);
    default:
      return reinterpret_cast<uint64_t>(p.host);
  }
}

void Engine::SubmitVerify(VerifyCall call, absl::AnyInvocable<void(absl::Status)> done) {
  // A rejection is reported after every lock StartVerify took is released:
  // `done` may call the engine again.
  absl::Status rejected = StartVerify(call, done);
  if (!rejected.ok()) {
    done(std::move(rejected));
    return;
  }
  // The calling thread launches where the devices are idle.
  for (auto& w : workers_) w->Kick();
}

absl::Status Engine::StartVerify(VerifyCall& call, absl::AnyInvocable<void(absl::Status)>& done) {
  const int heads = config_.num_heads;
  const absl::Span<VerifyItem> items = call.items;
  const int layer = call.layer;
  if (items.empty()) return absl::InvalidArgumentError("verify request has no items");
  if (static_cast<int>(items.size()) > config_.max_batch()) {
    return absl::InvalidArgumentError(absl::StrCat("verify request has ", items.size(),
                                                   " items; max_batch is ", config_.max_batch()));
  }
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " is outside 0..", config_.num_layers - 1));
  }
  if (std::isnan(call.softmax_scale) || std::isinf(call.softmax_scale)) {
    return absl::InvalidArgumentError("softmax_scale must be finite");
  }
  const float scale =
      call.softmax_scale > 0.0f ? call.softmax_scale : config_.default_softmax_scale;

  // Everything that needs no sequence state, checked once, before any lock:
  // draft counts, trees, every tensor (dtype, shape, size, region range).
  auto task =
      std::make_unique<VerifyTask>(this, std::move(call.context), 0, layer, call.timing, nullptr);
  RegionLeases& leases = task->leases;
  struct ItemPlaces {
    Placed q, draft_kv, out, lse;
  };
  std::vector<ItemPlaces> places(items.size());
  std::vector<std::shared_ptr<const std::vector<uint64_t>>> visibility(items.size());
  int64_t bytes = 0;
  size_t staging_bytes = 0;
  for (size_t k = 0; k < items.size(); ++k) {
    const VerifyItem& it = items[k];
    const int64_t n = static_cast<int64_t>(it.parents.size());
    const auto where = [&] {
      return absl::StrCat("items[", k, "] (sequence ", it.sequence_id, ")");
    };
    if (n < 1 || n > config_.max_draft_len()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ": ", n, " drafts (parents); need 1..", config_.max_draft_len()));
    }
    absl::StatusOr<std::vector<uint64_t>> words = BuildVisibility(it.parents);
    if (!words.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ": ", words.status().message()));
    }
    visibility[k] = std::make_shared<const std::vector<uint64_t>>(*std::move(words));
    ItemPlaces& p = places[k];
    const int item = static_cast<int>(k);
    ASSIGN_OR_RETURN(p.q, PlaceInput(it.q, DType::kBf16, {n, heads, kLatentDim}, leases,
                                     {item, it.sequence_id, "q"}));
    ASSIGN_OR_RETURN(p.draft_kv, PlaceInput(it.draft_kv, DType::kBf16, {n, kLatentDim}, leases,
                                            {item, it.sequence_id, "draft_kv"}));
    RETURN_IF_ERROR(CheckRowsFinite(config_.kv_dtype, p.draft_kv.host, p.draft_kv.bytes,
                                    absl::StrCat(where(), ": draft_kv")));
    if (it.out.in_region != it.lse.in_region) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), ": out_shared_memory and lse_shared_memory go together (both or neither)"));
    }
    ASSIGN_OR_RETURN(p.out, PlaceOutput(it.out, DType::kBf16, {n, heads, kValueDim}, leases,
                                        {item, it.sequence_id, "out"}));
    ASSIGN_OR_RETURN(p.lse, PlaceOutput(it.lse, DType::kFp32, {n, heads}, leases,
                                        {item, it.sequence_id, "lse"}));
    for (Placed* t : {&p.q, &p.draft_kv, &p.out, &p.lse}) {
      // Tensors in device memory hold no host memory: they count as nothing queued.
      if (t->host != nullptr || t->grow != nullptr) bytes += static_cast<int64_t>(t->bytes);
      if (t->where == Placed::Where::kStaged) {
        t->staging_offset = staging_bytes;
        staging_bytes += Aligned(t->bytes);
      }
    }
    for (size_t j = 0; j < k; ++j) {
      if (items[j].sequence_id == it.sequence_id) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence ", it.sequence_id, " appears twice (items ", j, " and ", k, ")"));
      }
    }
  }
  if (!leases.empty()) RETURN_IF_ERROR(leases.CheckOutputsDoNotOverlap());

  std::vector<std::shared_ptr<Sequence>> seqs(items.size());
  for (size_t k = 0; k < items.size(); ++k) {
    ASSIGN_OR_RETURN(seqs[k], Find(items[k].sequence_id));
  }
  // Lock the sequences in id order (no deadlock with concurrent calls); the
  // locks are held until the shards are queued, so every device sees one
  // sequence's calls in the same order.
  const SequenceLocks locks(seqs);

  // State checks and page needs, still changing nothing.
  std::vector<int64_t> extra(items.size(), 0);
  std::vector<int64_t> pool_pages(allocators_.size(), 0);
  for (size_t k = 0; k < items.size(); ++k) {
    Sequence& s = *seqs[k];
    s.mu.AssertHeld();
    const int64_t n = static_cast<int64_t>(items[k].parents.size());
    if (s.released) return NotFound(s.id);
    if (!s.broken.ok()) return s.broken;
    if (s.owner_step != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", s.id, " is in device-driven step ", s.owner_step,
                       ": its layers run as its scheduler rings them (AbortStep ends the step)"));
    }
    if (s.pending) {
      if (!std::equal(s.parents.begin(), s.parents.end(), items[k].parents.begin(),
                      items[k].parents.end())) {
        return absl::FailedPreconditionError(absl::StrCat(
            "sequence ", s.id, " has a pending step with ", s.parents.size(),
            " drafts and another tree; every layer of a step must send the same parents "
            "(Commit the step to start a new one)"));
      }
      continue;
    }
    ASSIGN_OR_RETURN(extra[k], PagesToOpenStep(s, n));
    pool_pages[s.pool] += extra[k];
  }
  RETURN_IF_ERROR(Admit(bytes));
  absl::StatusOr<std::vector<std::vector<int32_t>>> allocated = AllocateInEveryPool(pool_pages);
  if (!allocated.ok()) {
    Unadmit(bytes);
    return allocated.status();
  }
  std::vector<std::vector<int32_t>>& new_pages = *allocated;
  if (staging_bytes > 0) {
    absl::StatusOr<HostStaging::Block> block =
        staging_->Allocate(staging_bytes, "this call's host-resident tensors");
    if (!block.ok()) {
      for (size_t p = 0; p < allocators_.size(); ++p) allocators_[p]->Free(new_pages[p]);
      Unadmit(bytes);
      return block.status();
    }
    task->staging = *block;
  }
  // From here on the call is accepted: outputs sized (or, staged, filled at
  // the copy out), inputs staged, the steps opened and the shards queued.
  VerifyTask* t = task.release();
  t->Accept(bytes, std::move(done));
  for (ItemPlaces& p : places) {
    for (Placed* out : {&p.out, &p.lse}) {
      if (out->where == Placed::Where::kStaged) {
        // A staged output string is filled from the staging block after the
        // call ran (CopyOutAndRelease): sizing it here would zero-fill it on
        // the submitting thread, before the launch, only to be overwritten.
        t->staged_outputs.push_back({out->staging_offset, out->host, out->grow, out->bytes});
        continue;
      }
      if (out->grow != nullptr) {
        out->grow->resize(out->bytes);
        out->host = reinterpret_cast<uint8_t*>(out->grow->data());
      }
    }
    for (const Placed* in : {&p.q, &p.draft_kv}) {
      if (in->where == Placed::Where::kStaged) {
        std::memcpy(t->staging.host + in->staging_offset, in->host, in->bytes);
      }
    }
  }
  t->items.resize(items.size());
  std::vector<size_t> next_page(allocators_.size(), 0);
  int opened = 0;
  std::vector<std::shared_ptr<const TableDelta>> deltas(items.size());
  for (size_t k = 0; k < items.size(); ++k) {
    Sequence& s = *seqs[k];
    s.mu.AssertHeld();
    VerifyTask::Item& item = t->items[k];
    item.seq = seqs[k];
    item.n = static_cast<int>(items[k].parents.size());
    if (!s.pending) {
      OpenStepOn(s, new_pages[s.pool], &next_page[s.pool], extra[k], items[k].parents,
                 visibility[k]);
      item.opened = true;
      ++opened;
    }
    item.visibility = s.visibility;
    item.step = s.step;
    item.op = ++s.ops_submitted;
    items[k].prefix_len = s.length;
    deltas[k] = TakeDelta(s);
    s.CallStarted();
  }
  pending_steps_.fetch_add(opened);

  // Shards: every item on every device of its sequence, each device its heads.
  int shards = 0;
  for (const VerifyTask::Item& item : t->items) {
    shards += static_cast<int>(DevicesOf(*item.seq).size());
  }
  t->SetPieces(shards);
  const uint32_t q_pitch = static_cast<uint32_t>(heads) * kLatentRowBytes;
  const uint32_t out_pitch = static_cast<uint32_t>(heads) * kValueDim * sizeof(Bf16);
  const uint32_t lse_pitch = static_cast<uint32_t>(heads) * sizeof(float);
  int index = 0;
  for (size_t k = 0; k < items.size(); ++k) {
    const VerifyTask::Item& item = t->items[k];
    const ItemPlaces& p = places[k];
    const std::vector<int> devices = DevicesOf(*item.seq);
    for (size_t r = 0; r < devices.size(); ++r) {
      // In TP mode device r computes heads [r * Hd, (r + 1) * Hd); in DP mode
      // the one device computes all.
      const uint64_t h0 = static_cast<uint64_t>(r) * heads_per_device_;
      const int w = devices[r];
      VerifyShard shard;
      shard.owner = t;
      shard.index = index++;
      shard.sequence = item.seq->id;
      shard.prefix_len = static_cast<int32_t>(items[k].prefix_len);
      shard.draft_len = item.n;
      shard.layer = layer;
      shard.scale = scale;
      shard.visibility = item.visibility->data();
      shard.table = deltas[k];
      shard.q = {AddressOf(p.q, w, t->staging) + h0 * kLatentRowBytes, q_pitch};
      shard.draft_kv = {AddressOf(p.draft_kv, w, t->staging), kLatentRowBytes};
      shard.out = {AddressOf(p.out, w, t->staging) + h0 * kValueDim * sizeof(Bf16), out_pitch};
      shard.lse = {AddressOf(p.lse, w, t->staging) + h0 * sizeof(float), lse_pitch};
      for (const Placed* out : {&p.out, &p.lse}) {
        if (out->where == Placed::Where::kStaged) shard.copy_out_bytes += out->bytes;
      }
      workers_[w]->Enqueue(std::move(shard));
    }
  }
  return absl::OkStatus();
}

void Engine::SubmitAppendKv(AppendCall call,
                            absl::AnyInvocable<void(absl::StatusOr<int64_t>)> done) {
  absl::Status rejected = StartAppendKv(call, done);  // after its locks are released
  if (!rejected.ok()) {
    done(std::move(rejected));
    return;
  }
  for (auto& w : workers_) w->Kick();
}

absl::Status Engine::StartAppendKv(AppendCall& call,
                                   absl::AnyInvocable<void(absl::StatusOr<int64_t>)>& done) {
  const uint64_t id = call.sequence_id;
  const int64_t layers = config_.num_layers;
  int64_t tokens = call.tokens;
  if (call.kv.has_shape) {
    // T comes from the tensor itself; everything else must match the geometry.
    tokens = call.kv.shape.size() == 3 ? call.kv.shape[1] : -1;
    if (tokens < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv: shape ", ShapeText(call.kv.shape), ", expected [", layers, ", T, 576] with T >= 1"));
    }
  }
  if (tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("append of ", tokens, " tokens: need >= 1"));
  }
  RegionLeases leases;
  ASSIGN_OR_RETURN(Placed rows, PlaceInput(call.kv, DType::kBf16, {layers, tokens, kLatentDim},
                                           leases, {-1, 0, "kv"}));
  RETURN_IF_ERROR(CheckRowsFinite(config_.kv_dtype, rows.host, rows.bytes, "kv"));
  // The row-copy kernel reads 16-byte vectors: rows in a region at another
  // alignment go through the staging (system regions) or are refused.
  if (rows.where == Placed::Where::kRegion && staging_ != nullptr &&
      (rows.region->device()[0] + rows.offset) % 16 != 0) {
    if (rows.host == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv: a CUDA shared-memory prompt must start at a multiple of 16 bytes (offset ",
          rows.offset, ")"));
    }
    rows.where = Placed::Where::kStaged;
  }
  if (rows.where == Placed::Where::kStaged && rows.bytes > staging_->capacity()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kv: ", FormatBytes(static_cast<int64_t>(rows.bytes)),
        " from host memory is more than the page-locked staging holds (--pinned-staging-bytes ",
        FormatBytes(static_cast<int64_t>(staging_->capacity())),
        "): append the prompt in smaller chunks"));
  }
  absl::StatusOr<std::shared_ptr<Sequence>> found = Find(id);
  if (!found.ok()) return found.status();
  std::shared_ptr<Sequence> seq = *std::move(found);
  Sequence& s = *seq;
  absl::MutexLock lock(&s.mu);
  if (s.released) return NotFound(id);
  if (!s.broken.ok()) return s.broken;
  if (s.owner_step != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", id, " is in device-driven step ", s.owner_step,
                     ": Commit its items (or AbortStep) before appending"));
  }
  if (s.pending) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", id, " has a pending verify step of ", s.parents.size(),
                     " drafts: Commit it before appending"));
  }
  if (call.start_position != s.length) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", id, " has length ", s.length, "; the chunk starts at ", call.start_position));
  }
  const int64_t old_length = s.length;
  const int64_t new_length = old_length + tokens;
  if (new_length > config_.max_sequence_len) {
    return absl::ResourceExhaustedError(absl::StrCat("sequence ", id, " would reach ", new_length,
                                                     " tokens; max_sequence_len is ",
                                                     config_.max_sequence_len));
  }
  const int64_t bytes = rows.host != nullptr ? static_cast<int64_t>(rows.bytes) : 0;
  RETURN_IF_ERROR(Admit(bytes));
  const int64_t extra =
      CeilDiv(new_length, config_.page_size) - static_cast<int64_t>(s.pages.size());
  std::vector<int32_t> added;
  if (extra > 0) {
    absl::StatusOr<std::vector<int32_t>> got = AllocatorOf(s).Allocate(extra);
    if (!got.ok()) {
      Unadmit(bytes);
      return got.status();
    }
    added = *std::move(got);
  }
  HostStaging::Block block;
  if (rows.where == Placed::Where::kStaged) {
    absl::StatusOr<HostStaging::Block> got = staging_->Allocate(rows.bytes, "this AppendKv");
    if (!got.ok()) {
      AllocatorOf(s).Free(added);
      Unadmit(bytes);
      return got.status();
    }
    block = *got;
    rows.staging_offset = 0;
    std::memcpy(block.host, rows.host, rows.bytes);
  }
  s.pages.insert(s.pages.end(), added.begin(), added.end());
  s.length = new_length;
  const uint64_t op_number = ++s.ops_submitted;
  s.CallStarted();

  // Cancelled or past its deadline when taken: taken back, unless calls
  // submitted after it build on it (then it runs).
  auto skip = [this, seq, op_number, old_length, added, context = call.context]() -> absl::Status {
    const absl::Status st = UnwantedStatus(context);
    if (st.ok()) return st;
    std::vector<int32_t> freed;
    {
      absl::MutexLock lock(&seq->mu);
      if (seq->released) return absl::NotFoundError("the sequence was released while queued");
      if (seq->ops_submitted != op_number) return absl::OkStatus();
      seq->length = old_length;
      freed.assign(seq->pages.end() - static_cast<int64_t>(added.size()), seq->pages.end());
      seq->pages.resize(seq->pages.size() - added.size());
      seq->Trimmed(seq->pages.size());
    }
    // At once: the pages were taken by this call and nothing else writes them.
    AllocatorOf(*seq).Free(freed);
    return st;
  };
  auto finish = [this, seq, tokens, new_length, done = std::move(done)](const absl::Status& status,
                                                                        bool ran) mutable {
    seq->CallEnded();
    if (status.ok()) {
      tokens_appended_.fetch_add(tokens);
      spdlog::debug("seq {} appended {} tokens, length {}", seq->id, tokens, new_length);
      done(new_length);
      return;
    }
    if (ran) {
      absl::MutexLock lock(&seq->mu);
      if (seq->broken.ok()) {
        seq->broken = absl::InternalError(absl::StrCat("sequence ", seq->id,
                                                       " lost prompt KV in a failed device write (",
                                                       status.message(), "): release it"));
      }
    }
    done(status);
  };
  auto* op_call = new OpCall(this, call.context, bytes, std::move(skip), std::move(finish));
  op_call->leases = std::move(leases);
  op_call->staging = block;
  DeviceOp op;
  op.kind = DeviceOp::Kind::kWriteRows;
  op.sequence = id;
  op.table = TakeDelta(s);
  op.start = old_length;
  op.count = tokens;
  op_call->Enqueue(DevicesOf(s), op, &rows);
  return absl::OkStatus();
}

void Engine::SubmitCommit(uint64_t sequence_id, absl::Span<const int32_t> accepted,
                          absl::AnyInvocable<void(absl::StatusOr<CommitResult>)> done) {
  // A step's item committed while the step still runs layers (the scheduler
  // may send it as soon as its stream is past the last wait): it waits for
  // the layers, or for the step's end. (`done` moves only if it waits.)
  if (steps_->DeferCommit(sequence_id, [&]() -> absl::AnyInvocable<void(absl::Status)> {
        return [this, sequence_id, done = std::move(done),
                path = std::vector<int32_t>(accepted.begin(), accepted.end())](
                   absl::Status ready) mutable {
          if (ready.ok()) ready = StartCommit(sequence_id, path, done);
          if (!ready.ok()) {
            done(std::move(ready));
            return;
          }
          for (auto& w : workers_) w->Kick();
        };
      })) {
    return;
  }
  absl::Status rejected = StartCommit(sequence_id, accepted, done);  // after its locks are released
  if (!rejected.ok()) {
    done(std::move(rejected));
    return;
  }
  for (auto& w : workers_) w->Kick();
}

absl::Status Engine::StartCommit(uint64_t sequence_id, absl::Span<const int32_t> accepted,
                                 absl::AnyInvocable<void(absl::StatusOr<CommitResult>)>& done,
                                 uint64_t step) {
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Find(sequence_id));
  Sequence& s = *seq;
  absl::MutexLock lock(&s.mu);
  if (s.released) return NotFound(sequence_id);
  if (!s.broken.ok()) return s.broken;
  if (step != 0 && s.owner_step != step) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", sequence_id, " is no longer in step ", step));
  }
  const uint64_t owner = s.owner_step;
  // A client's Commit of a step's item: once every layer ran on every rank.
  if (owner != 0 && step == 0) RETURN_IF_ERROR(steps_->CommitAllowed(owner));
  if (!s.pending) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", sequence_id, " has no pending verify step: Verify before Commit"));
  }
  RETURN_IF_ERROR(ValidateAcceptedPath(s.parents, accepted));
  const int k = static_cast<int>(accepted.size());
  if (k > 0 && owner == 0 && s.layers_verified < config_.num_layers) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", sequence_id, ": only ", s.layers_verified, " of ", config_.num_layers,
        " layers were verified in this step; accepting drafts needs their KV in every layer "
        "(commit an empty path to drop the step)"));
  }
  RETURN_IF_ERROR(Admit(0));
  const int64_t prefix = s.length;
  s.length += k;
  s.pending = false;
  s.owner_step = 0;
  if (owner != 0 && step == 0) steps_->OnItemCommitted(owner, sequence_id);
  s.parents.clear();
  s.visibility.reset();
  s.layer_verified.clear();
  s.layers_verified = 0;
  s.step_pages = 0;
  ++s.ops_submitted;
  // The compaction reads the pages that held the drafts: the devices' table
  // is trimmed by this op's change only after it ran (a compaction moves rows
  // within P..P+N-1, so it needs the table before the trim).
  const std::shared_ptr<const TableDelta> before = TakeDelta(s);
  // Pages past the new length held only rejected drafts: freed once every
  // device ran the compaction (or passed the barrier).
  const size_t keep = static_cast<size_t>(CeilDiv(s.length, config_.page_size));
  std::vector<int32_t> rejected;
  if (s.pages.size() > keep) {
    rejected.assign(s.pages.begin() + keep, s.pages.end());
    s.pages.resize(keep);
    s.Trimmed(keep);
  }
  s.CallStarted();
  pending_steps_.fetch_sub(1);
  const CommitResult result{s.length, k};
  PageAllocator* allocator = &AllocatorOf(s);
  auto finish = [this, seq, allocator, rejected = std::move(rejected), result,
                 done = std::move(done)](const absl::Status& status, bool) mutable {
    seq->CallEnded();
    allocator->Free(rejected);
    if (!status.ok()) {
      absl::MutexLock lock(&seq->mu);
      if (seq->broken.ok()) {
        seq->broken = absl::InternalError(
            absl::StrCat("sequence ", seq->id, " lost its accepted drafts in a failed compaction (",
                         status.message(), "): release it"));
      }
      done(status);
      return;
    }
    steps_committed_.fetch_add(1);
    tokens_committed_.fetch_add(result.accepted_count);
    spdlog::debug("seq {} committed {} drafts, length {}", seq->id, result.accepted_count,
                  result.length);
    done(result);
  };
  auto* op_call = new OpCall(this, CallContext{}, 0, nullptr, std::move(finish));
  op_call->accepted.assign(accepted.begin(), accepted.end());
  DeviceOp op;
  op.kind = k > 0 ? DeviceOp::Kind::kCompact : DeviceOp::Kind::kBarrier;
  op.sequence = sequence_id;
  op.table = before;
  op.prefix_len = prefix;
  op_call->Enqueue(DevicesOf(s), op);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Engine::PagesToOpenStep(const Sequence& s,
                                                int64_t n) const ABSL_NO_THREAD_SAFETY_ANALYSIS {
  if (s.length + n > config_.max_sequence_len) {
    return absl::ResourceExhaustedError(absl::StrCat("sequence ", s.id, " would reach ",
                                                     s.length + n, " tokens; max_sequence_len is ",
                                                     config_.max_sequence_len));
  }
  return std::max<int64_t>(
      0, CeilDiv(s.length + n, config_.page_size) - static_cast<int64_t>(s.pages.size()));
}

void Engine::OpenStepOn(Sequence& s, const std::vector<int32_t>& fresh, size_t* next, int64_t pages,
                        absl::Span<const int32_t> parents,
                        std::shared_ptr<const std::vector<uint64_t>> visibility) {
  s.pages.insert(s.pages.end(), fresh.begin() + *next, fresh.begin() + *next + pages);
  *next += pages;
  s.step_pages = pages;
  s.pending = true;
  ++s.step;
  s.parents.assign(parents.begin(), parents.end());
  s.visibility = std::move(visibility);
  s.layer_verified.assign(config_.num_layers, false);
  s.layers_verified = 0;
}

absl::StatusOr<std::vector<StepHost::Claimed>> Engine::ClaimForStep(
    uint64_t step, absl::Span<const StepItemSpec> items) {
  std::vector<std::shared_ptr<Sequence>> seqs(items.size());
  std::vector<std::shared_ptr<const std::vector<uint64_t>>> visibility(items.size());
  for (size_t k = 0; k < items.size(); ++k) {
    ASSIGN_OR_RETURN(seqs[k], Find(items[k].sequence_id));
    ASSIGN_OR_RETURN(std::vector<uint64_t> words, BuildVisibility(items[k].parents));
    visibility[k] = std::make_shared<const std::vector<uint64_t>>(std::move(words));
  }
  const SequenceLocks locks(seqs);
  std::vector<int64_t> extra(items.size(), 0);
  std::vector<int64_t> pool_pages(allocators_.size(), 0);
  for (size_t k = 0; k < items.size(); ++k) {
    Sequence& s = *seqs[k];
    s.mu.AssertHeld();
    const int64_t n = static_cast<int64_t>(items[k].parents.size());
    if (s.released) return NotFound(s.id);
    if (!s.broken.ok()) return s.broken;
    if (s.owner_step != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", s.id, " is in device-driven step ", s.owner_step, " already"));
    }
    if (s.pending) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence ", s.id, " has a pending verify step of Verify calls (", s.layers_verified,
          " of ", config_.num_layers, " layers): Commit it before opening a device-driven step"));
    }
    ASSIGN_OR_RETURN(extra[k], PagesToOpenStep(s, n));
    pool_pages[s.pool] += extra[k];
  }
  ASSIGN_OR_RETURN(std::vector<std::vector<int32_t>> new_pages, AllocateInEveryPool(pool_pages));
  std::vector<size_t> next_page(allocators_.size(), 0);
  std::vector<StepHost::Claimed> claimed(items.size());
  for (size_t k = 0; k < items.size(); ++k) {
    Sequence& s = *seqs[k];
    s.mu.AssertHeld();
    OpenStepOn(s, new_pages[s.pool], &next_page[s.pool], extra[k], items[k].parents, visibility[k]);
    s.owner_step = step;
    s.Touch();
    claimed[k].prefix_len = s.length;
    claimed[k].pages = s.pages;
  }
  pending_steps_.fetch_add(static_cast<int64_t>(items.size()));
  return claimed;
}

void Engine::UnclaimStep(uint64_t step, absl::Span<const StepItemSpec> items) {
  for (const StepItemSpec& item : items) {
    absl::StatusOr<std::shared_ptr<Sequence>> found = Find(item.sequence_id);
    if (!found.ok()) continue;
    Sequence& s = **found;
    std::vector<int32_t> freed;
    {
      absl::MutexLock lock(&s.mu);
      if (s.released || s.owner_step != step) continue;
      freed.assign(s.pages.end() - s.step_pages, s.pages.end());
      s.pages.resize(s.pages.size() - s.step_pages);
      s.Trimmed(s.pages.size());
      s.step_pages = 0;
      s.pending = false;
      s.owner_step = 0;
      s.parents.clear();
      s.visibility.reset();
      s.layer_verified.clear();
      pending_steps_.fetch_sub(1);
    }
    // At once: no device work used them (the step never started a lane).
    AllocatorOf(s).Free(freed);
  }
}

absl::StatusOr<StepOpened> Engine::OpenStep(const StepRequest& request) {
  if (absl::Status f = fault(); !f.ok()) {
    return absl::UnavailableError(
        absl::StrCat(f.message(), "; this server no longer serves device work"));
  }
  return steps_->Open(request);
}

absl::Status Engine::DoorbellSupport(DoorbellKind kind) const {
  if (config_.steps.lanes_per_device == 0) {
    return absl::FailedPreconditionError("no step lanes (--step-lanes 0)");
  }
  for (const auto& w : workers_) RETURN_IF_ERROR(w->device().DoorbellSupport(kind));
  return absl::OkStatus();
}

void Engine::SubmitAbortStep(uint64_t step_id,
                             absl::AnyInvocable<void(absl::StatusOr<StepInfo>)> done) {
  steps_->Abort(step_id, std::move(done));
}

absl::StatusOr<StepInfo> Engine::GetStep(uint64_t step_id) const { return steps_->Get(step_id); }

absl::StatusOr<StepInfo> Engine::AbortStep(uint64_t step_id) {
  absl::Notification finished;
  absl::StatusOr<StepInfo> result;
  SubmitAbortStep(step_id, [&](absl::StatusOr<StepInfo> r) {
    result = std::move(r);
    finished.Notify();
  });
  finished.WaitForNotification();
  return result;
}

std::vector<int32_t> Engine::ReleaseLocked(Sequence& s) {
  s.mu.AssertHeld();  // (beyond the static analysis: callers lock through a shared_ptr)
  std::vector<int32_t> pages = std::move(s.pages);
  s.pages.clear();
  if (s.pending) pending_steps_.fetch_sub(1);
  s.pending = false;
  s.released = true;
  return pages;
}

void Engine::SubmitRelease(uint64_t sequence_id,
                           absl::AnyInvocable<void(absl::StatusOr<int64_t>)> done) {
  absl::StatusOr<std::shared_ptr<Sequence>> found = Find(sequence_id);
  if (!found.ok()) return done(found.status());
  ReleaseNow(*std::move(found), std::move(done));
}

void Engine::ReleaseNow(const std::shared_ptr<Sequence>& seq,
                        absl::AnyInvocable<void(absl::StatusOr<int64_t>)> done) {
  const uint64_t sequence_id = seq->id;
  std::vector<int32_t> pages;
  bool already_released = false;
  uint64_t owner = 0;
  {
    absl::MutexLock lock(&seq->mu);
    already_released = seq->released;
    if (!already_released) owner = seq->owner_step;
    if (!already_released && owner == 0) {
      pages = ReleaseLocked(*seq);
      absl::MutexLock table_lock(&table_mu_);
      sequences_.erase(sequence_id);
      --live_per_pool_[seq->pool];
    }
  }
  if (already_released) return done(NotFound(sequence_id));  // (no lock held)
  if (owner != 0) {
    // Its step ends first (its lanes run out, its items are dropped), so no
    // lane still writes the pages that are freed; then the release again.
    steps_->AbortForRelease(
        owner, [this, seq, done = std::move(done)]() mutable { ReleaseNow(seq, std::move(done)); });
    return;
  }
  const int64_t freed = static_cast<int64_t>(pages.size());
  spdlog::debug("seq {} released, {} pages freed", sequence_id, freed);
  FreeAfterBarrier(seq, std::move(pages),
                   [done = std::move(done), freed]() mutable { done(freed); });
}

int Engine::ExpireIdle(absl::Time now) {
  if (config_.idle_timeout <= absl::ZeroDuration()) return 0;
  const int64_t cutoff = absl::ToUnixNanos(now - config_.idle_timeout);
  std::vector<std::shared_ptr<Sequence>> candidates;
  {
    absl::MutexLock lock(&table_mu_);
    for (const auto& [id, seq] : sequences_) {
      if (seq->IdleSince(cutoff)) candidates.push_back(seq);
    }
  }
  int expired = 0;
  // Waits for the pages to be back before returning (the janitor thread may block).
  std::vector<std::unique_ptr<absl::Notification>> freed;
  for (const auto& seq : candidates) {
    std::vector<int32_t> pages;
    {
      absl::MutexLock lock(&seq->mu);
      // Used again since the scan (or in use), or released by its owner meanwhile.
      // A sequence in a device-driven step is left to the step's own
      // timeouts, which end the claim.
      if (seq->released || seq->owner_step != 0 || !seq->IdleSince(cutoff)) continue;
      pages = ReleaseLocked(*seq);
      absl::MutexLock table_lock(&table_mu_);
      sequences_.erase(seq->id);
      --live_per_pool_[seq->pool];
      expired_.insert(seq->id);
      expired_order_.push_back(seq->id);
      if (expired_order_.size() > kExpiredIdsRemembered) {
        expired_.erase(expired_order_.front());
        expired_order_.pop_front();
      }
    }
    ++expired;
    spdlog::info("seq {} (\"{}\") expired after {} idle, {} pages freed", seq->id,
                 absl::CHexEscape(seq->label), absl::FormatDuration(config_.idle_timeout),
                 pages.size());
    freed.push_back(std::make_unique<absl::Notification>());
    FreeAfterBarrier(seq, std::move(pages), [n = freed.back().get()] { n->Notify(); });
  }
  for (const auto& n : freed) n->WaitForNotification();
  sequences_expired_.fetch_add(expired);
  return expired;
}

absl::Status Engine::ReadKv(uint64_t sequence_id, int64_t start, int64_t count, absl::Span<Bf16> kv,
                            int replica) {
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Find(sequence_id));
  absl::Notification finished;
  absl::Status result;
  std::vector<int> devices;
  {
    absl::MutexLock lock(&seq->mu);
    if (seq->released) return NotFound(sequence_id);
    devices = DevicesOf(*seq);
    if (replica < 0 || replica >= static_cast<int>(devices.size())) {
      return absl::InvalidArgumentError(absl::StrCat("replica ", replica, " of ", devices.size()));
    }
    const int64_t capacity = static_cast<int64_t>(seq->pages.size()) * config_.page_size;
    if (start < 0 || count < 0 || start + count > capacity ||
        static_cast<int64_t>(kv.size()) != int64_t{config_.num_layers} * count *
                                               KvRowBytes(config_.kv_dtype) /
                                               static_cast<int64_t>(sizeof(Bf16))) {
      return absl::InvalidArgumentError(
          absl::StrCat("read of [", start, ", ", start + count, ") outside the ", capacity,
                       " positions the sequence's pages hold, or into a buffer of the wrong size"));
    }
    RETURN_IF_ERROR(Admit(0));
    auto* op_call =
        new OpCall(this, CallContext{}, 0, nullptr, [&](const absl::Status& status, bool) {
          result = status;
          finished.Notify();
        });
    // Every device of the sequence gets the table change (their copies must
    // stay alike); only `replica` reads.
    const std::shared_ptr<const TableDelta> delta = TakeDelta(*seq);
    for (size_t r = 0; r < devices.size(); ++r) {
      if (static_cast<int>(r) == replica || delta == nullptr) continue;
      DeviceOp barrier;
      barrier.kind = DeviceOp::Kind::kBarrier;
      barrier.sequence = sequence_id;
      barrier.table = delta;
      workers_[devices[r]]->Enqueue(std::move(barrier));
    }
    DeviceOp op;
    op.kind = DeviceOp::Kind::kReadRows;
    op.sequence = sequence_id;
    op.table = delta;
    op.start = start;
    op.count = count;
    op.rows_out = kv.data();
    op_call->Enqueue({devices[replica]}, op);
  }
  KickAll(devices);
  finished.WaitForNotification();
  return result;
}

// ---- synchronous forms ----

absl::Status Engine::Verify(int layer, float softmax_scale, absl::Span<VerifyItem> items) {
  absl::Notification finished;
  absl::Status result;
  VerifyCall call;
  call.layer = layer;
  call.softmax_scale = softmax_scale;
  call.items = items;
  SubmitVerify(std::move(call), [&](absl::Status s) {
    result = std::move(s);
    finished.Notify();
  });
  finished.WaitForNotification();
  return result;
}

absl::StatusOr<int64_t> Engine::AppendKv(uint64_t sequence_id, int64_t start_position,
                                         int64_t tokens, TensorRef kv) {
  absl::Notification finished;
  absl::StatusOr<int64_t> result;
  AppendCall call;
  call.sequence_id = sequence_id;
  call.start_position = start_position;
  call.tokens = tokens;
  call.kv = std::move(kv);
  SubmitAppendKv(std::move(call), [&](absl::StatusOr<int64_t> r) {
    result = std::move(r);
    finished.Notify();
  });
  finished.WaitForNotification();
  return result;
}

absl::StatusOr<CommitResult> Engine::Commit(uint64_t sequence_id,
                                            absl::Span<const int32_t> accepted) {
  absl::Notification finished;
  absl::StatusOr<CommitResult> result;
  SubmitCommit(sequence_id, accepted, [&](absl::StatusOr<CommitResult> r) {
    result = std::move(r);
    finished.Notify();
  });
  finished.WaitForNotification();
  return result;
}

absl::StatusOr<int64_t> Engine::Release(uint64_t sequence_id) {
  absl::Notification finished;
  absl::StatusOr<int64_t> result;
  SubmitRelease(sequence_id, [&](absl::StatusOr<int64_t> r) {
    result = std::move(r);
    finished.Notify();
  });
  finished.WaitForNotification();
  return result;
}

}  // namespace mlaverify::engine
