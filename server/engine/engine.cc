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
#include "common/byte_size_text.h"
#include "common/draft_tree.h"
#include "common/geometry.h"
#include "common/kv_dtype.h"
#include "common/log_fields.h"
#include "common/status_macros.h"
#include "server/engine/engine_impl.h"
#include "server/engine/sequence.h"
#include "spdlog/spdlog.h"

namespace mlaverify::engine {
namespace {

// How many recently expired ids NOT_FOUND can still explain.
constexpr size_t kExpiredIdsRemembered = 4096;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

}  // namespace

namespace {

// What every asynchronous call shares: admission bytes, the one decision
// whether it runs (asked by the first piece of device work taken), and the
// count of pieces still out.
class Call {
 public:
  // `submitted`: when the call entered the engine (its checks and copies
  // in count as its time).
  Call(CallHost* host, CallContext context, int64_t bytes, absl::Time submitted = absl::Now())
      : host_(host), context_(std::move(context)), bytes_(bytes), submitted_(submitted) {}
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
    if (staging.host != nullptr) host_->FreeStaging(staging);
    staging = {};
    private_copies.clear();
    leases.Clear();
  }

  CallHost* const host_;
  const CallContext context_;
  const int64_t bytes_;  // admitted host bytes
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
  // Inputs copied out of regions before their check (call_placement.h).
  std::vector<std::unique_ptr<uint8_t[]>> private_copies;

 private:
  absl::Mutex mu_;
  int remaining_ ABSL_GUARDED_BY(mu_) = 0;
  bool deciding_ ABSL_GUARDED_BY(mu_) = false;
  bool decided_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status decision_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// RegionMapper over the engine's workers: host memory is page-locked once
// (for every device of the process) and addressed by each; exported device
// memory is opened once per physical device.
// A call made of device ops (AppendKv, Commit, Release, ReadKv): one op per
// device the sequence lives on; `finish` runs once all are done.
class OpCall final : public Call {
 public:
  using SkipFn = absl::AnyInvocable<absl::Status()>;
  using FinishFn = absl::AnyInvocable<void(const absl::Status& status, bool ran)>;

  OpCall(CallHost* host, CallContext context, int64_t bytes, SkipFn skip, FinishFn finish)
      : Call(host, std::move(context), bytes), skip_(std::move(skip)), finish_(std::move(finish)) {}

  // Queues `op` (admit and done filled in here; `rows_in` from `rows` as
  // each device addresses it) on each of `devices`.
  void Enqueue(const std::vector<int>& devices, const DeviceOp& op,
               const PlacedTensor* rows = nullptr) {
    SetPieces(static_cast<int>(devices.size()));
    for (int d : devices) {
      DeviceOp copy;
      copy.kind = op.kind;
      copy.sequence = op.sequence;
      copy.table = op.table;
      copy.release_table = op.release_table;
      copy.start = op.start;
      copy.count = op.count;
      copy.rows_in = rows != nullptr ? host_->AddressOf(*rows, d, staging) : 0;
      copy.rows_out = op.rows_out;
      copy.prefix_len = op.prefix_len;
      copy.accepted = accepted;
      copy.admit = [this] { return Decide(); };
      copy.done = [this](const absl::Status& status) {
        if (PieceDone(status)) Finish();
      };
      host_->EnqueueOp(d, std::move(copy));
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
    host_->LeaveAdmission(bytes_);
    finish_(s, r);
    delete this;
  }

  SkipFn skip_;
  FinishFn finish_;
};

// A Verify call: one shard per item and device.
class VerifyTask final : public Call, public ShardOwner {
 public:
  struct Item {
    std::shared_ptr<Sequence> seq;
    int n = 0;
    bool opened = false;  // this call opened the step
    uint64_t step = 0;
    uint64_t op = 0;  // its number among the sequence's calls
    std::shared_ptr<const std::vector<uint64_t>> visibility;
  };

  VerifyTask(CallHost* host, CallContext context, int64_t bytes, absl::Time submitted, int layer,
             VerifyTiming* timing, absl::AnyInvocable<void(absl::Status)> done)
      : Call(host, std::move(context), bytes, submitted),
        layer_(layer),
        timing_(timing),
        done_(std::move(done)) {}

  std::vector<Item> items;

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
        freed = s.CloseStepUnrun();
      }
      // At once: the pages were taken by this call and only it would have
      // written them; no work queued before it owns them.
      host_->StepClosedUnrun(s, std::move(freed));
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
    CopyOutAndRelease(s.ok());
    host_->LeaveAdmission(bytes_);
    VerifyTiming t;
    t.items = static_cast<int>(items.size());
    {
      absl::MutexLock lock(&timing_mu_);
      t.queue_seconds = std::max(0.0, absl::ToDoubleSeconds(last_taken_ - submitted_));
      t.device_seconds = device_seconds_;
    }
    t.total_seconds = absl::ToDoubleSeconds(absl::Now() - submitted_);
    if (timing_ != nullptr) *timing_ = t;
    if (s.ok()) {
      int64_t drafts = 0;
      for (const Item& item : items) drafts += item.n;
      host_->VerifySucceeded(static_cast<int>(items.size()), drafts, t);
    }
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

}  // namespace

class EngineImpl::Mapper final : public RegionMapper {
 public:
  explicit Mapper(EngineImpl* engine) : engine_(engine) {}

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

  EngineImpl* const engine_;
};

// The engine as the step runner sees it (steps.h).
class EngineImpl::StepHostImpl final : public StepHost {
 public:
  explicit StepHostImpl(EngineImpl* engine) : e_(engine) {
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
  EngineImpl* const e_;
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
  std::unique_ptr<EngineImpl> e(new EngineImpl(config));
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
  geometry.blocking_wait = !config.poll_launches;
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
  options.poll_launches = config.poll_launches;
  EngineImpl* raw = e.get();
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
  e->placement_ = PlacementGeometry::Of(config, e->staging_ != nullptr,
                                        e->staging_ != nullptr ? e->staging_->capacity() : 0);
  e->mapper_ = std::make_unique<EngineImpl::Mapper>(raw);
  e->regions_.SetMapper(e->mapper_.get());
  e->step_host_ = std::make_unique<EngineImpl::StepHostImpl>(raw);
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
      tp ? "replica" : "device", ByteSizeText(config.pool_bytes), config.max_draft_len(),
      config.max_batch(), config.batches_in_flight,
      e->staging_ != nullptr ? ByteSizeText(config.pinned_staging_bytes) : "no");
  return e;
}

EngineImpl::EngineImpl(const EngineConfig& config)
    : config_(config),
      admission_(config.max_queued_calls, config.max_queued_bytes),
      regions_(config.shared_memory) {
  absl::MutexLock lock(&table_mu_);
  instance_id_ = absl::StrFormat("%08x%08x", id_source_(), id_source_());
}

EngineImpl::~EngineImpl() {
  steps_.reset();  // aborts open steps while the workers still run
  for (auto& w : workers_) w->Stop();
  // Regions and staging go while the devices that mapped them are still here.
  regions_.ReleaseAll();
  staging_.reset();
}

std::vector<DeviceDescription> EngineImpl::devices() const {
  std::vector<DeviceDescription> out;
  for (const auto& w : workers_) out.push_back(w->Describe());
  return out;
}

std::vector<std::string> EngineImpl::device_names() const {
  std::vector<std::string> out;
  for (const auto& w : workers_) out.push_back(w->name());
  return out;
}

absl::Status EngineImpl::fault() const {
  if (!faulted_.load(std::memory_order_acquire)) return absl::OkStatus();
  absl::MutexLock lock(&fault_mu_);
  return fault_;
}

void EngineImpl::SetFaultListener(std::function<void(const absl::Status&)> listener) {
  absl::MutexLock lock(&fault_mu_);
  fault_listener_ = std::move(listener);
}

void EngineImpl::OnDeviceFault(int, const absl::Status& status) {
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

EngineStats EngineImpl::Stats() const {
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
  s.queued_calls = admission_.calls();
  s.queued_bytes = admission_.bytes();
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

PageAllocator& EngineImpl::AllocatorOf(const Sequence& seq) { return *allocators_[seq.pool]; }

std::vector<int> EngineImpl::DevicesOf(const Sequence& seq) const {
  if (config_.parallel_mode == ParallelMode::kDataParallel) return {seq.pool};
  std::vector<int> all(workers_.size());
  for (size_t d = 0; d < all.size(); ++d) all[d] = static_cast<int>(d);
  return all;
}

void EngineImpl::KickAll(const std::vector<int>& devices) {
  for (int d : devices) workers_[d]->Kick();
}

absl::Status EngineImpl::Serving() const {
  if (absl::Status f = fault(); !f.ok()) {
    return absl::UnavailableError(
        absl::StrCat(f.message(), "; this server no longer serves device work"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> EngineImpl::CreateSequence(const std::string& label) {
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

absl::StatusOr<std::shared_ptr<Sequence>> EngineImpl::Find(uint64_t id) const {
  {
    absl::ReaderMutexLock lock(&table_mu_);
    auto it = sequences_.find(id);
    if (it != sequences_.end()) return it->second;
  }
  return NotFound(id);
}

absl::Status EngineImpl::NotFound(uint64_t id) const {
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

void EngineImpl::FreeAfterBarrier(const std::shared_ptr<Sequence>& seq, std::vector<int32_t> pages,
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
  admission_.EnterUnrefused();
  DeviceOp barrier;
  barrier.kind = DeviceOp::Kind::kBarrier;
  barrier.sequence = seq->id;
  barrier.release_table = true;  // the sequence is gone from every device
  const std::vector<int> devices = DevicesOf(*seq);
  call->Enqueue(devices, barrier);
  KickAll(devices);
}

uint64_t EngineImpl::AddressOf(const PlacedTensor& p, int w,
                               const HostStaging::Block& block) const {
  switch (p.where) {
    case PlacedTensor::Where::kRegion:
      return p.region->device()[w] + p.offset;
    case PlacedTensor::Where::kStaged:
      return staging_->DeviceAddress(w, block.host + p.staging_offset);
    default:
      return reinterpret_cast<uint64_t>(p.host);
  }
}

void EngineImpl::EnqueueOp(int device, DeviceOp op) { workers_[device]->Enqueue(std::move(op)); }

void EngineImpl::FreeStaging(const HostStaging::Block& staging) {
  if (staging_ != nullptr) staging_->Free(staging);
}

void EngineImpl::StepClosedUnrun(const Sequence& seq, std::vector<int32_t> pages) {
  pending_steps_.fetch_sub(1);
  allocators_[seq.pool]->Free(pages);
}

void EngineImpl::VerifySucceeded(int items, int64_t drafts, const VerifyTiming& timing) {
  verify_items_.fetch_add(items);
  drafts_verified_.fetch_add(drafts);
  if (observer_ != nullptr) observer_->OnVerifyDone(timing);
}

void EngineImpl::SubmitVerify(VerifyCall call, absl::AnyInvocable<void(absl::Status)> done) {
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

absl::Status EngineImpl::StartVerify(VerifyCall& call,
                                     absl::AnyInvocable<void(absl::Status)>& done) {
  const absl::Time entered = absl::Now();
  const absl::Span<VerifyItem> items = call.items;
  // Checked and placed: everything that needs no sequence state, before any
  // reservation or lock (call_placement.h).
  ASSIGN_OR_RETURN(PlacedVerify placed, PlaceVerify(placement_, regions_, call));

  // Admitted and staged, still with no sequence lock held: the inputs are
  // copied into the staging block (and an fp8 pool's rows checked on that
  // copy) while other calls of the same sequences proceed.
  CallReservation reservation = Reserve();
  RETURN_IF_ERROR(reservation.Admit(placed.admitted_bytes));
  if (placed.staging_bytes > 0) {
    RETURN_IF_ERROR(
        reservation.ReserveStaging(placed.staging_bytes, "this call's host-resident tensors"));
  }
  std::vector<std::unique_ptr<uint8_t[]>> private_copies;
  RETURN_IF_ERROR(
      FillStagedInputs(placement_, InputsOf(placed), reservation.staging().host, private_copies));

  std::vector<std::shared_ptr<Sequence>> seqs(items.size());
  for (size_t k = 0; k < items.size(); ++k) {
    ASSIGN_OR_RETURN(seqs[k], Find(items[k].sequence_id));
  }
  // Lock the sequences in id order (no deadlock with concurrent calls); the
  // locks are held until the shards are queued, so every device sees one
  // sequence's calls in the same order. They guard state and pages only.
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
    ASSIGN_OR_RETURN(extra[k], s.PagesToOpenStep(n, config_.page_size, config_.max_sequence_len));
    pool_pages[s.pool] += extra[k];
  }
  // A faulted device refuses what its state would have allowed.
  RETURN_IF_ERROR(Serving());
  RETURN_IF_ERROR(reservation.ReservePages(pool_pages));

  // From here on the call is accepted: it owns what was reserved, outputs
  // are sized (or, staged, filled at the copy out), the steps opened and the
  // shards queued.
  CallReservation::Held held = reservation.Commit();
  auto* t = new VerifyTask(this, std::move(call.context), held.admitted_bytes, entered,
                           placed.layer, call.timing, std::move(done));
  t->staging = held.staging;
  t->leases = std::move(placed.leases);
  t->private_copies = std::move(private_copies);
  for (PlacedVerifyItem& p : placed.items) {
    for (PlacedTensor* out : {&p.out, &p.lse}) {
      if (out->where == PlacedTensor::Where::kStaged) {
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
      s.OpenStep(absl::MakeConstSpan(held.pages[s.pool]).subspan(next_page[s.pool], extra[k]),
                 items[k].parents, placed.items[k].visibility, config_.num_layers);
      next_page[s.pool] += extra[k];
      item.opened = true;
      ++opened;
    }
    item.visibility = s.visibility;
    item.step = s.step;
    item.op = ++s.ops_submitted;
    items[k].prefix_len = s.length;
    deltas[k] = s.TakeDelta();
    s.CallStarted();
  }
  pending_steps_.fetch_add(opened);

  // Shards: every item on every device of its sequence, each device its heads.
  const int heads = config_.num_heads;
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
    const PlacedVerifyItem& p = placed.items[k];
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
      shard.layer = placed.layer;
      shard.scale = placed.scale;
      shard.visibility = item.visibility->data();
      shard.table = deltas[k];
      shard.q = {AddressOf(p.q, w, t->staging) + h0 * kLatentRowBytes, q_pitch};
      shard.draft_kv = {AddressOf(p.draft_kv, w, t->staging), kLatentRowBytes};
      shard.out = {AddressOf(p.out, w, t->staging) + h0 * kValueDim * sizeof(Bf16), out_pitch};
      shard.lse = {AddressOf(p.lse, w, t->staging) + h0 * sizeof(float), lse_pitch};
      for (const PlacedTensor* out : {&p.out, &p.lse}) {
        if (out->where == PlacedTensor::Where::kStaged) shard.copy_out_bytes += out->bytes;
      }
      workers_[w]->Enqueue(std::move(shard));
    }
  }
  return absl::OkStatus();
}

void EngineImpl::SubmitAppendKv(AppendCall call,
                                absl::AnyInvocable<void(absl::StatusOr<int64_t>)> done) {
  absl::Status rejected = StartAppendKv(call, done);  // after its locks are released
  if (!rejected.ok()) {
    done(std::move(rejected));
    return;
  }
  for (auto& w : workers_) w->Kick();
}

absl::Status EngineImpl::StartAppendKv(AppendCall& call,
                                       absl::AnyInvocable<void(absl::StatusOr<int64_t>)>& done) {
  const uint64_t id = call.sequence_id;
  ASSIGN_OR_RETURN(PlacedAppend placed, PlaceAppend(placement_, regions_, call));
  const int64_t tokens = placed.tokens;
  PlacedTensor& rows = placed.rows;
  // Admitted and staged before the sequence's lock: a whole prompt chunk is
  // copied (and an fp8 pool's rows checked) while its other calls proceed.
  CallReservation reservation = Reserve();
  RETURN_IF_ERROR(reservation.Admit(placed.admitted_bytes));
  if (placed.staging_bytes > 0) {
    RETURN_IF_ERROR(reservation.ReserveStaging(placed.staging_bytes, "this AppendKv"));
  }
  std::vector<std::unique_ptr<uint8_t[]>> private_copies;
  RETURN_IF_ERROR(
      FillStagedInputs(placement_, {&rows}, reservation.staging().host, private_copies));

  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Find(id));
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
  std::vector<int64_t> pool_pages(allocators_.size(), 0);
  pool_pages[s.pool] = std::max<int64_t>(
      0, CeilDiv(new_length, config_.page_size) - static_cast<int64_t>(s.pages.size()));
  RETURN_IF_ERROR(Serving());
  RETURN_IF_ERROR(reservation.ReservePages(pool_pages));

  // Accepted.
  CallReservation::Held held = reservation.Commit();
  const std::vector<int32_t> added = std::move(held.pages[s.pool]);
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
  auto* op_call =
      new OpCall(this, call.context, held.admitted_bytes, std::move(skip), std::move(finish));
  op_call->leases = std::move(placed.leases);
  op_call->staging = held.staging;
  op_call->private_copies = std::move(private_copies);
  DeviceOp op;
  op.kind = DeviceOp::Kind::kWriteRows;
  op.sequence = id;
  op.table = s.TakeDelta();
  op.start = old_length;
  op.count = tokens;
  op_call->Enqueue(DevicesOf(s), op, &rows);
  return absl::OkStatus();
}

void EngineImpl::SubmitCommit(uint64_t sequence_id, absl::Span<const int32_t> accepted,
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

absl::Status EngineImpl::StartCommit(uint64_t sequence_id, absl::Span<const int32_t> accepted,
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
  RETURN_IF_ERROR(Serving());
  RETURN_IF_ERROR(admission_.Enter(0));
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
  const std::shared_ptr<const TableDelta> before = s.TakeDelta();
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

absl::StatusOr<std::vector<StepHost::Claimed>> EngineImpl::ClaimForStep(
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
    ASSIGN_OR_RETURN(extra[k], s.PagesToOpenStep(n, config_.page_size, config_.max_sequence_len));
    pool_pages[s.pool] += extra[k];
  }
  CallReservation reservation = Reserve();
  RETURN_IF_ERROR(reservation.ReservePages(pool_pages));
  const std::vector<std::vector<int32_t>> new_pages = reservation.Commit().pages;
  std::vector<size_t> next_page(allocators_.size(), 0);
  std::vector<StepHost::Claimed> claimed(items.size());
  for (size_t k = 0; k < items.size(); ++k) {
    Sequence& s = *seqs[k];
    s.mu.AssertHeld();
    s.OpenStep(absl::MakeConstSpan(new_pages[s.pool]).subspan(next_page[s.pool], extra[k]),
               items[k].parents, visibility[k], config_.num_layers);
    next_page[s.pool] += extra[k];
    s.owner_step = step;
    s.Touch();
    claimed[k].prefix_len = s.length;
    claimed[k].pages = s.pages;
  }
  pending_steps_.fetch_add(static_cast<int64_t>(items.size()));
  return claimed;
}

void EngineImpl::UnclaimStep(uint64_t step, absl::Span<const StepItemSpec> items) {
  for (const StepItemSpec& item : items) {
    absl::StatusOr<std::shared_ptr<Sequence>> found = Find(item.sequence_id);
    if (!found.ok()) continue;
    Sequence& s = **found;
    std::vector<int32_t> freed;
    {
      absl::MutexLock lock(&s.mu);
      if (s.released || s.owner_step != step) continue;
      freed = s.CloseStepUnrun();
      s.owner_step = 0;
      pending_steps_.fetch_sub(1);
    }
    // At once: no device work used them (the step never started a lane).
    AllocatorOf(s).Free(freed);
  }
}

absl::StatusOr<StepOpened> EngineImpl::OpenStep(const StepRequest& request) {
  if (absl::Status f = fault(); !f.ok()) {
    return absl::UnavailableError(
        absl::StrCat(f.message(), "; this server no longer serves device work"));
  }
  return steps_->Open(request);
}

absl::Status EngineImpl::DoorbellSupport(DoorbellKind kind) const {
  if (config_.steps.lanes_per_device == 0) {
    return absl::FailedPreconditionError("no step lanes (--step-lanes 0)");
  }
  for (const auto& w : workers_) RETURN_IF_ERROR(w->device().DoorbellSupport(kind));
  return absl::OkStatus();
}

void EngineImpl::SubmitAbortStep(uint64_t step_id,
                                 absl::AnyInvocable<void(absl::StatusOr<StepInfo>)> done) {
  steps_->Abort(step_id, std::move(done));
}

absl::StatusOr<StepInfo> EngineImpl::GetStep(uint64_t step_id) const {
  return steps_->Get(step_id);
}

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

std::vector<int32_t> EngineImpl::ReleaseLocked(Sequence& s) {
  bool had_step = false;
  std::vector<int32_t> pages = s.MarkReleased(&had_step);
  if (had_step) pending_steps_.fetch_sub(1);
  return pages;
}

void EngineImpl::SubmitRelease(uint64_t sequence_id,
                               absl::AnyInvocable<void(absl::StatusOr<int64_t>)> done) {
  absl::StatusOr<std::shared_ptr<Sequence>> found = Find(sequence_id);
  if (!found.ok()) return done(found.status());
  ReleaseNow(*std::move(found), std::move(done));
}

void EngineImpl::ReleaseNow(const std::shared_ptr<Sequence>& seq,
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

int EngineImpl::ExpireIdle(absl::Time now) {
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
    LogFields sequence;
    sequence.sequence = seq->id;
    const ScopedLogFields fields(sequence);
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

absl::Status EngineImpl::ReadKv(uint64_t sequence_id, int64_t start, int64_t count,
                                absl::Span<Bf16> kv, int replica) {
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
    RETURN_IF_ERROR(Serving());
    RETURN_IF_ERROR(admission_.Enter(0));
    auto* op_call =
        new OpCall(this, CallContext{}, 0, nullptr, [&](const absl::Status& status, bool) {
          result = status;
          finished.Notify();
        });
    // Every device of the sequence gets the table change (their copies must
    // stay alike); only `replica` reads.
    const std::shared_ptr<const TableDelta> delta = seq->TakeDelta();
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
