// HostDevice: the KV pool, the page-table arena, the batch buffers and the
// slots in host memory; a launch runs its slot's copy lists with memcpy
// (kernels::RunCopyListOnHost, the same lists a GPU runs) and computes the
// attention with the CPU reference. As the CPU backend it runs every launch
// when it is made; with FakeDeviceOptions it also keeps the books a GPU's
// graphs would need (which shapes were captured, which launch used which),
// sleeps to simulate a slow device, injects faults, and can defer the work
// to Wait as a GPU would, so that the worker's batching, bucket choice,
// padding, copy lists, page tables and fault handling are tested without a
// GPU.
//
// Device-driven steps: each lane is a thread with its own batch memory, one
// slot per layer and a page table. It waits on the step's doorbell (a host
// slot: a registered region's, or, for a fake's device doorbells, a word of
// an arena of host memory the tests ring), runs the layer as a launch would
// and stores the completion, waking the scheduler's waiter.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/geometry.h"
#include "common/host_doorbell.h"
#include "common/kv_dtype.h"
#include "common/status_macros.h"
#include "kernels/copy_list.h"
#include "kernels/cpu_reference.h"
#include "kernels/parallel_for.h"
#include "server/engine/device.h"

namespace mlaverify::engine {
namespace {

// 256-byte aligned, uninitialised host memory.
struct AlignedBuffer {
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data;
  size_t bytes = 0;

  bool Allocate(size_t n) {
    bytes = (std::max<size_t>(n, 1) + 255) / 256 * 256;
    data.reset(static_cast<uint8_t*>(std::aligned_alloc(256, bytes)));
    return data != nullptr;
  }
  uint64_t address() const { return reinterpret_cast<uint64_t>(data.get()); }
};

// What one launch of a verify batch reads and writes besides the pool: the
// device's own, or a lane's.
struct BatchMemory {
  AlignedBuffer q, out, lse, requests, visibility, outputs;
  AlignedBuffer draft_kv;  // fp8 pools only: the batch's draft rows before quantization

  bool Allocate(const DeviceGeometry& g, const SlotLayout& slot) {
    const size_t rows = static_cast<size_t>(g.max_batch) * g.max_draft_len;
    return q.Allocate(rows * g.num_heads * kLatentRowBytes) &&
           out.Allocate(rows * g.num_heads * kValueDim * sizeof(Bf16)) &&
           lse.Allocate(rows * g.num_heads * sizeof(float)) &&
           requests.Allocate(slot.requests.bytes) && visibility.Allocate(rows * sizeof(uint64_t)) &&
           outputs.Allocate(kernels::CopyListBytes(slot.output_capacity)) &&
           (g.kv_dtype == KvDtype::kBf16 || draft_kv.Allocate(rows * kLatentRowBytes));
  }
  void Describe(uint64_t pool, uint64_t table, DeviceBuffers* b) const {
    b->pool = pool;
    b->table = table;
    b->q = q.address();
    b->out = out.address();
    b->lse = lse.address();
    b->requests = requests.address();
    b->visibility = visibility.address();
    b->outputs = outputs.address();
    if (draft_kv.data != nullptr) b->draft_kv = draft_kv.address();
  }
  bool Holds(uint64_t address, uint64_t bytes) const {
    for (const AlignedBuffer* b : {&q, &out, &lse, &requests, &visibility, &outputs, &draft_kv}) {
      if (b->data != nullptr && address >= b->address() &&
          address + bytes <= b->address() + b->bytes) {
        return true;
      }
    }
    return false;
  }
};

// One lane of device-driven steps (device.h): its memory, its thread and
// the step it runs.
struct HostLane {
  BatchMemory memory;
  AlignedBuffer slots;  // [num_layers][lane slot bytes]
  AlignedBuffer table;  // int32 [LaneGeometry::table_entries]
  DeviceBuffers buffers;
  std::thread thread;
  absl::Mutex mu;
  bool has_step ABSL_GUARDED_BY(mu) = false;
  bool stop ABSL_GUARDED_BY(mu) = false;
  StepLaunch launch ABSL_GUARDED_BY(mu);
  // Read without the lock by lane_progress and the waits' stop test.
  std::atomic<int> layers_done{0};
  std::atomic<bool> drained{true};
  std::atomic<uint64_t> end_value{0};  // EndLane's value (0: not ended)
  std::vector<LayerTiming> timings ABSL_GUARDED_BY(mu);
};

class HostDevice final : public Device {
 public:
  HostDevice(std::string name, int threads, std::optional<FakeDeviceOptions> fake,
             FakeDeviceRecord* record)
      : name_(std::move(name)),
        threads_(kernels::ResolveThreadCount(threads)),
        fake_(fake),
        record_(record) {}

  std::string name() const override { return name_; }

  DeviceDescription Describe() const override {
    return {fake_ ? absl::StrCat("fake device (", name_, ")")
                  : absl::StrCat("cpu (", threads_, " threads)"),
            pool_.bytes};
  }

  absl::Status Init(const DeviceGeometry& g) override {
    g_ = g;
    const size_t pool_bytes =
        static_cast<size_t>(g.num_layers) * g.num_pages * g.page_size * KvRowBytes(g.kv_dtype);
    if (!pool_.Allocate(pool_bytes)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", pool_bytes, " bytes of host memory for the KV pool"));
    }
    // Every pool byte is written once here, as a GPU's pool is allocated
    // whole: the memory is committed at start (no out-of-memory later, a
    // resident size that stays flat), and all-ones bytes are bf16 NaN (and,
    // in an fp8 row, NaN codes and NaN scales), so a read of a row never
    // written shows up as NaN in an answer.
    std::memset(pool_.data.get(), 0xFF, pool_.bytes);
    const bool ok = table_.Allocate(static_cast<size_t>(g.table_entries) * sizeof(int32_t)) &&
                    main_.Allocate(g, g.slot) &&
                    slots_.Allocate(static_cast<size_t>(g.slots) * g.slot.bytes);
    if (!ok) return absl::ResourceExhaustedError("cannot allocate the host device's buffers");
    std::memset(table_.data.get(), 0, table_.bytes);
    std::memset(slots_.data.get(), 0, slots_.bytes);
    main_.Describe(pool_.address(), table_.address(), &buffers_);
    buffers_.slots = slots_.address();
    RETURN_IF_ERROR(InitLanes());
    results_.assign(g.slots, absl::OkStatus());
    seconds_.assign(g.slots, 0.0);
    {
      absl::MutexLock lock(&exec_mu_);
      due_.assign(g.slots, absl::InfinitePast());
    }
    return absl::OkStatus();
  }

  const DeviceBuffers& buffers() const override { return buffers_; }
  uint8_t* slot(int k) override {
    return slots_.data.get() + static_cast<size_t>(k) * g_.slot.bytes;
  }
  bool asynchronous() const override { return fake_ && (fake_->asynchronous || fake_->timed_only); }
  bool timed_only() const { return fake_ && fake_->timed_only; }

  absl::Status DoorbellSupport(DoorbellKind kind) const override {
    if (lanes_.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(name_, " has no step lanes (the server runs with 0 lanes per device)"));
    }
    if (kind == DoorbellKind::kDevice && !(fake_ && fake_->device_doorbells)) {
      return absl::FailedPreconditionError(
          "GPU doorbells (slots in device memory, stream memory operations) need the CUDA "
          "backend; this server runs on the CPU: use host doorbells (slots in a system "
          "shared-memory region)");
    }
    return absl::OkStatus();
  }
  DoorbellArena doorbell_arena() const override {
    DoorbellArena a;
    a.address = arena_.address();
    a.host = arena_.data.get();
    a.bytes = arena_.bytes;
    return a;
  }
  uint8_t* lane_slot(int lane, int layer) override {
    return lanes_[lane]->slots.data.get() + static_cast<size_t>(layer) * g_.lanes.slot.bytes;
  }
  const DeviceBuffers& lane_buffers(int lane) const override { return lanes_[lane]->buffers; }
  int32_t* lane_table(int lane) override {
    return reinterpret_cast<int32_t*>(lanes_[lane]->table.data.get());
  }

  absl::Status LaunchStep(const StepLaunch& launch) override {
    // Work launched before runs first (stream order), then the lane starts.
    RunPending();
    RETURN_IF_ERROR(CheckFault());
    if (launch.lane < 0 || launch.lane >= static_cast<int>(lanes_.size()) ||
        launch.layers != g_.num_layers) {
      return absl::InternalError(absl::StrCat(name_, ": step launch on lane ", launch.lane,
                                              " with ", launch.layers, " layers"));
    }
    HostLane& lane = *lanes_[launch.lane];
    absl::MutexLock lock(&lane.mu);
    if (lane.has_step || !lane.drained.load()) {
      return absl::InternalError(absl::StrCat(name_, ": lane ", launch.lane, " is busy"));
    }
    lane.launch = launch;
    lane.layers_done.store(0);
    lane.end_value.store(0);
    lane.drained.store(false);
    lane.timings.clear();
    lane.has_step = true;
    return absl::OkStatus();
  }

  void EndLane(int lane_index, uint64_t end_value) override {
    HostLane& lane = *lanes_[lane_index];
    HostSlot doorbell;
    {
      absl::MutexLock lock(&lane.mu);
      if (!lane.has_step) return;
      lane.end_value.store(end_value);
      doorbell = SlotOf(lane.launch, lane.launch.doorbell);
    }
    // Wakes the lane's wait at once (the lane stores the completion).
    doorbell.Store(end_value);
  }

  LaneProgress lane_progress(int lane) override {
    LaneProgress p;
    // Drained first: the lane's thread counts its last layer before it
    // drains, so a drained lane shows every layer it ran.
    p.drained = lanes_[lane]->drained.load();
    p.layers_done = lanes_[lane]->layers_done.load();
    return p;
  }

  std::vector<LayerTiming> lane_timings(int lane) override {
    absl::MutexLock lock(&lanes_[lane]->mu);
    return lanes_[lane]->timings;
  }

  ~HostDevice() override {
    for (auto& lane : lanes_) {
      {
        absl::MutexLock lock(&lane->mu);
        lane->stop = true;
      }
      lane->end_value.store(UINT64_MAX);
      if (lane->thread.joinable()) lane->thread.join();
    }
  }
  bool addresses_host_memory() const override { return !fake_ || fake_->addresses_host_memory; }

  absl::Status PinHost(void* data, size_t bytes) override {
    AddAddressable(data, bytes);
    return absl::OkStatus();
  }
  void UnpinHost(void* data) override { RemoveAddressable(data); }
  absl::StatusOr<uint8_t*> AllocateHostStaging(size_t bytes) override {
    if (addresses_host_memory()) return Device::AllocateHostStaging(bytes);
    auto* data = static_cast<uint8_t*>(std::aligned_alloc(256, (bytes + 255) / 256 * 256));
    if (data == nullptr) return absl::ResourceExhaustedError("host staging allocation");
    AddAddressable(data, bytes);
    return data;
  }
  void FreeHostStaging(uint8_t* data) override {
    RemoveAddressable(data);
    std::free(data);
  }
  bool SupportsGraphs() const override { return fake_ && fake_->graphs; }

  absl::StatusOr<int64_t> CaptureGraphs(BatchShape shape) override {
    if (!SupportsGraphs()) return absl::FailedPreconditionError(name_ + " records no graphs");
    captured_.push_back(shape);
    if (record_ != nullptr) {
      absl::MutexLock lock(&record_->mu);
      record_->captured.push_back(shape);
    }
    return 0;
  }

  absl::Status Launch(const LaunchOptions& o) override {
    if (record_ != nullptr) {
      absl::MutexLock lock(&record_->mu);
      record_->launch_threads.push_back(std::this_thread::get_id());
    }
    if (timed_only()) return IssueTimed(o.slot, RealRequests(o));
    return Issue(o.slot, [this, o] { return RunBatch(o); });
  }

  absl::Status LaunchWriteRows(int slot, int, int64_t table_offset, int64_t start, int64_t count,
                               uint64_t rows) override {
    if (timed_only()) return IssueTimed(slot, 0);
    return Issue(slot, [this, slot, table_offset, start, count, rows]() -> absl::Status {
      RETURN_IF_ERROR(Simulate());
      RETURN_IF_ERROR(RunGather(slot));
      if (!Addressable(rows, static_cast<uint64_t>(g_.num_layers) * count * kLatentRowBytes)) {
        return absl::InternalError(
            absl::StrCat(name_, ": rows to write are in host memory the device cannot address"));
      }
      if (record_ != nullptr) {
        absl::MutexLock lock(&record_->mu);
        ++record_->write_rows;
      }
      const auto* src = reinterpret_cast<const Bf16*>(rows);
      const KvDtype dtype = g_.kv_dtype;
      ForEachRow(
          table_offset, start, count,
          [dtype](uint8_t* pool_row, const Bf16* row) { StoreLatentRow(dtype, row, pool_row); },
          src, kLatentDim);
      return absl::OkStatus();
    });
  }

  absl::Status LaunchCompact(int slot, int, int64_t table_offset) override {
    if (timed_only()) return IssueTimed(slot, 0);
    return Issue(slot, [this, slot, table_offset]() -> absl::Status {
      RETURN_IF_ERROR(Simulate());
      RETURN_IF_ERROR(RunGather(slot));
      if (record_ != nullptr) {
        absl::MutexLock lock(&record_->mu);
        ++record_->compacts;
      }
      const auto* params = reinterpret_cast<const int32_t*>(this->slot(slot) + g_.slot.op);
      kernels::CompactArguments c;
      c.batch = 1;
      c.pool = View();
      c.page_table = Table() + table_offset;
      c.page_table_stride = g_.table_entries - table_offset;
      c.prefix_len = params;
      c.accepted_len = params + 1;
      c.accepted = params + 2;
      return kernels::CompactAcceptedKvCpu(c);
    });
  }

  absl::Status LaunchGather(int slot, int) override {
    if (timed_only()) return IssueTimed(slot, 0);
    return Issue(slot, [this, slot]() -> absl::Status {
      RETURN_IF_ERROR(CheckFault());
      return RunGather(slot);
    });
  }

  bool Finished(int slot) override {
    if (!timed_only()) return true;
    absl::MutexLock lock(&exec_mu_);
    return absl::Now() >= due_[slot];
  }

  absl::StatusOr<double> Wait(int slot) override {
    if (timed_only()) {
      absl::Time due;
      {
        absl::MutexLock lock(&exec_mu_);
        due = due_[slot];
      }
      if (const absl::Duration left = due - absl::Now(); left > absl::ZeroDuration()) {
        absl::SleepFor(left);
      }
      absl::MutexLock lock(&exec_mu_);
      return seconds_[slot];
    }
    if (asynchronous()) {
      // Deferred work runs in launch order, up to this slot's.
      absl::MutexLock lock(&exec_mu_);
      while (!pending_.empty()) {
        Pending p = std::move(pending_.front());
        pending_.pop_front();
        Complete(p.slot, p.work);
        if (p.slot == slot) break;
      }
    }
    // (A synchronous launch finished before the worker queued it for Wait.)
    if (!results_[slot].ok()) return results_[slot];
    return seconds_[slot];
  }

  absl::Status ReadRows(int64_t table_offset, int64_t start, int64_t count, Bf16* rows) override {
    RunPending();
    RETURN_IF_ERROR(CheckFault());
    const int row_bytes = KvRowBytes(g_.kv_dtype);
    ForEachRow(
        table_offset, start, count,
        [row_bytes](uint8_t* pool_row, Bf16* row) { std::memcpy(row, pool_row, row_bytes); }, rows,
        row_bytes / static_cast<int>(sizeof(Bf16)));
    return absl::OkStatus();
  }

  absl::Status UploadTable(absl::Span<const int32_t> entries) override {
    RunPending();
    RETURN_IF_ERROR(CheckFault());
    if (entries.size() != static_cast<size_t>(g_.table_entries)) {
      return absl::InternalError("page-table upload of the wrong size");
    }
    std::memcpy(table_.data.get(), entries.data(), entries.size() * sizeof(int32_t));
    if (record_ != nullptr) {
      absl::MutexLock lock(&record_->mu);
      ++record_->table_uploads;
    }
    return absl::OkStatus();
  }

 private:
  // ---- lanes ----
  absl::Status InitLanes() {
    const LaneGeometry& lg = g_.lanes;
    if (lg.lanes > 0 && fake_ && fake_->device_doorbells) {
      if (!arena_.Allocate(DoorbellArenaBytes(lg.lanes))) {
        return absl::ResourceExhaustedError("cannot allocate the doorbell arena");
      }
      std::memset(arena_.data.get(), 0, arena_.bytes);
    }
    for (int k = 0; k < lg.lanes; ++k) {
      auto lane = std::make_unique<HostLane>();
      const bool ok =
          lane->memory.Allocate(g_, lg.slot) &&
          lane->slots.Allocate(static_cast<size_t>(g_.num_layers) * lg.slot.bytes) &&
          lane->table.Allocate(static_cast<size_t>(std::max<int64_t>(1, lg.table_entries)) *
                               sizeof(int32_t));
      if (!ok) return absl::ResourceExhaustedError("cannot allocate a step lane's buffers");
      std::memset(lane->slots.data.get(), 0, lane->slots.bytes);
      std::memset(lane->table.data.get(), 0, lane->table.bytes);
      lane->memory.Describe(pool_.address(), lane->table.address(), &lane->buffers);
      lane->buffers.slots = lane->slots.address();
      lanes_.push_back(std::move(lane));
    }
    for (int k = 0; k < lg.lanes; ++k) {
      lanes_[k]->thread = std::thread([this, k] { LaneLoop(k); });
    }
    return absl::OkStatus();
  }

  // A step's doorbell or completion slot: a host pointer (host doorbells),
  // or an offset into the arena (a fake's device doorbells).
  HostSlot SlotOf(const StepLaunch& launch, uint64_t where) {
    if (launch.kind == DoorbellKind::kDevice) return HostSlot(arena_.data.get() + where);
    return HostSlot(reinterpret_cast<void*>(where));
  }

  // The lane's thread: runs each step it is given, layer by layer as the
  // doorbell allows, until the device goes.
  void LaneLoop(int index) {
    HostLane& lane = *lanes_[index];
    while (true) {
      StepLaunch launch;
      {
        absl::MutexLock lock(&lane.mu);
        lane.mu.Await(absl::Condition(
            +[](HostLane* l) ABSL_NO_THREAD_SAFETY_ANALYSIS { return l->has_step || l->stop; },
            &lane));
        if (lane.stop) return;
        launch = lane.launch;
      }
      std::vector<LayerTiming> timings;
      RunLaneStep(index, launch, &timings);
      absl::MutexLock lock(&lane.mu);
      lane.timings = std::move(timings);
      lane.has_step = false;
      lane.drained.store(true);
    }
  }

  void RunLaneStep(int index, const StepLaunch& launch, std::vector<LayerTiming>* timings) {
    HostLane& lane = *lanes_[index];
    const HostSlot doorbell = SlotOf(launch, launch.doorbell);
    const HostSlot completion = SlotOf(launch, launch.completion);
    const uint64_t last = launch.base + static_cast<uint64_t>(launch.layers);
    const auto ended = [&lane] { return lane.end_value.load() != 0; };
    absl::Time previous_end;  // (layer 0 has no wait)
    bool completed = true;
    for (int layer = 0; layer < launch.layers; ++layer) {
      const uint64_t target = launch.base + static_cast<uint64_t>(layer) + 1;
      // (Returns below `target` only once ended.)
      doorbell.WaitAtLeast(target, absl::Microseconds(50), absl::InfiniteFuture(), ended,
                           absl::Milliseconds(5));
      // Ended by the server: the layers left are not run (their pages are
      // dropped). (A ring past the last layer rings every layer, as a GPU
      // doorbell does.)
      if (ended()) {
        completed = false;
        break;
      }
      const absl::Time start = absl::Now();
      absl::Status ran = Simulate();
      if (ran.ok()) {
        ran = RunList(reinterpret_cast<const kernels::CopyListHeader*>(lane_slot(index, layer) +
                                                                       g_.lanes.slot.list));
      }
      if (ran.ok()) {
        ran = Compute(lane.memory, reinterpret_cast<const int32_t*>(lane.table.data.get()),
                      std::max<int64_t>(1, g_.lanes.table_entries), launch.shape);
      }
      const absl::Time end = absl::Now();
      if (!ran.ok()) {
        // A device error stops the lane; the engine sees the layers stop.
        completed = false;
        break;
      }
      // (The first layer's wait is not a scheduler's work between layers.)
      timings->push_back({absl::ToDoubleSeconds(end - start),
                          layer == 0 ? 0.0 : absl::ToDoubleSeconds(start - previous_end)});
      previous_end = end;
      lane.layers_done.store(layer + 1);
      completion.Store(target);
    }
    if (!completed) {
      // Every wait of the scheduler passes; the engine reads the end from
      // its own books. (If nobody ended it, a device error did: the value
      // is past the last layer all the same.)
      const uint64_t end = lane.end_value.load();
      completion.Store(end != 0 ? end : last + 1);
    }
  }

  struct Pending {
    int slot;
    std::function<absl::Status()> work;
  };

  // Runs `work` now, or (an asynchronous fake) at Wait, in launch order.
  absl::Status Issue(int slot, std::function<absl::Status()> work) {
    absl::MutexLock lock(&exec_mu_);
    if (asynchronous()) {
      pending_.push_back({slot, std::move(work)});
      return absl::OkStatus();
    }
    Complete(slot, work);
    return absl::OkStatus();
  }

  // A timed-only launch: due once the previous launch ended and this one's
  // time passed; nothing runs.
  absl::Status IssueTimed(int slot, int requests) {
    RETURN_IF_ERROR(CheckFault());
    const absl::Duration time = fake_->launch_time + requests * fake_->request_time;
    absl::MutexLock lock(&exec_mu_);
    stream_end_ = std::max(stream_end_, absl::Now()) + time;
    due_[slot] = stream_end_;
    seconds_[slot] = absl::ToDoubleSeconds(time);
    return absl::OkStatus();
  }

  // Requests of a verify launch that are not padding, from its slot.
  int RealRequests(const LaunchOptions& o) {
    const auto* drafts = reinterpret_cast<const int32_t*>(slot(o.slot) + g_.slot.request_block +
                                                          g_.slot.requests.draft_len);
    int requests = 0;
    for (int b = 0; b < o.shape.batch; ++b) requests += drafts[b] > 0 ? 1 : 0;
    return requests;
  }

  void Complete(int slot, const std::function<absl::Status()>& work) {
    const absl::Time started = absl::Now();
    results_[slot] = work();
    seconds_[slot] = absl::ToDoubleSeconds(absl::Now() - started);
  }

  // Work launched before a synchronous call runs first (stream order).
  void RunPending() {
    absl::MutexLock lock(&exec_mu_);
    while (!pending_.empty()) {
      Pending p = std::move(pending_.front());
      pending_.pop_front();
      Complete(p.slot, p.work);
    }
  }

  // A fault, once injected, stays (a sticky device error).
  absl::Status CheckFault() const {
    if (faulted_) return absl::InternalError(absl::StrCat(name_, ": injected fault"));
    return absl::OkStatus();
  }

  absl::Status Simulate() {
    RETURN_IF_ERROR(CheckFault());
    if (fake_ && fake_->latency > absl::ZeroDuration()) absl::SleepFor(fake_->latency);
    return absl::OkStatus();
  }

  const int32_t* Table() const { return reinterpret_cast<const int32_t*>(table_.data.get()); }

  // Page-locked host memory is addressed by every device of the process
  // (a portable mapping): the fakes share one book of it.
  struct PinnedBook {
    absl::Mutex mu;
    std::map<uint64_t, size_t> ranges ABSL_GUARDED_BY(mu);  // start -> bytes
  };
  static PinnedBook& Pinned() {
    static PinnedBook* book = new PinnedBook;
    return *book;
  }
  static void AddAddressable(const void* data, size_t bytes) {
    absl::MutexLock lock(&Pinned().mu);
    Pinned().ranges[reinterpret_cast<uint64_t>(data)] = bytes;
  }
  static void RemoveAddressable(const void* data) {
    absl::MutexLock lock(&Pinned().mu);
    Pinned().ranges.erase(reinterpret_cast<uint64_t>(data));
  }
  // Whether [address, address + bytes) lies in memory this device
  // addresses (always, unless it plays a GPU).
  bool Addressable(uint64_t address, uint64_t bytes) {
    if (addresses_host_memory()) return true;
    for (const AlignedBuffer* b : {&pool_, &table_, &slots_, &arena_}) {
      if (address >= b->address() && address + bytes <= b->address() + b->bytes) return true;
    }
    if (main_.Holds(address, bytes)) return true;
    for (const auto& lane : lanes_) {
      if (lane->memory.Holds(address, bytes)) return true;
      for (const AlignedBuffer* b : {&lane->slots, &lane->table}) {
        if (address >= b->address() && address + bytes <= b->address() + b->bytes) return true;
      }
    }
    PinnedBook& pinned = Pinned();
    absl::MutexLock lock(&pinned.mu);
    auto it = pinned.ranges.upper_bound(address);
    if (it == pinned.ranges.begin()) return false;
    --it;
    return address + bytes <= it->first + it->second;
  }
  // Every descriptor of `list` must stay in addressable memory.
  absl::Status CheckList(const kernels::CopyListHeader* list) {
    const kernels::CopyDescriptor* d = kernels::CopyListEntries(list);
    for (int i = 0; i < list->count; ++i) {
      if (d[i].rows == 0) continue;
      const uint64_t last = d[i].rows - 1;
      if (!Addressable(d[i].src, last * d[i].src_pitch + d[i].row_bytes) ||
          !Addressable(d[i].dst, last * d[i].dst_pitch + d[i].row_bytes)) {
        return absl::InternalError(absl::StrCat(name_, ": copy descriptor ", i,
                                                " touches host memory the device cannot address"));
      }
    }
    return absl::OkStatus();
  }

  // Runs the gather list of `slot`.
  absl::Status RunGather(int slot) {
    return RunList(
        reinterpret_cast<const kernels::CopyListHeader*>(this->slot(slot) + g_.slot.list));
  }
  absl::Status RunList(const kernels::CopyListHeader* list) {
    RETURN_IF_ERROR(CheckList(list));
    if (record_ != nullptr) {
      int64_t table_entries = 0;
      const kernels::CopyDescriptor* d = kernels::CopyListEntries(list);
      for (int i = 0; i < list->count; ++i) {
        if (d[i].dst >= table_.address() && d[i].dst < table_.address() + table_.bytes) {
          table_entries += d[i].row_bytes / sizeof(int32_t);
        }
      }
      absl::MutexLock lock(&record_->mu);
      record_->table_entries_written += table_entries;
    }
    kernels::RunCopyListOnHost(list);
    return absl::OkStatus();
  }

  absl::Status RunBatch(const LaunchOptions& o) {
    if (fake_) {
      ++launches_;
      if (fake_->fail_launch > 0 && launches_ == fake_->fail_launch) faulted_ = true;
      if (o.graph && std::find(captured_.begin(), captured_.end(), o.shape) == captured_.end()) {
        return absl::InternalError(absl::StrCat(name_, ": graph launch of batch ", o.shape.batch,
                                                " x draft ", o.shape.draft_len,
                                                ", which was never captured"));
      }
    } else if (o.graph) {
      return absl::InternalError(absl::StrCat(name_, " has no graphs"));
    }
    if (record_ != nullptr) {
      // Recorded as the launch begins (before its latency), from the slot.
      const int requests = RealRequests(o);
      const auto* list =
          reinterpret_cast<const kernels::CopyListHeader*>(slot(o.slot) + g_.slot.list);
      absl::MutexLock lock(&record_->mu);
      record_->launches.push_back(o);
      record_->launch_requests.push_back(requests);
      record_->gather_descriptors.push_back(list->count);
    }
    RETURN_IF_ERROR(Simulate());
    RETURN_IF_ERROR(RunGather(o.slot));
    return Compute(main_, Table(), g_.table_entries, o.shape);
  }

  // The attention of a gathered batch of `shape` in `m` (page ids in
  // `table`, `table_entries` long), then its output list.
  absl::Status Compute(BatchMemory& m, const int32_t* table, int64_t table_entries,
                       BatchShape shape) {
    const RequestArraysLayout& r = g_.slot.requests;
    const auto* block = m.requests.data.get();
    const auto* prefix = reinterpret_cast<const int32_t*>(block + r.prefix_len);
    const auto* drafts = reinterpret_cast<const int32_t*>(block + r.draft_len);
    const auto* layers = reinterpret_cast<const int32_t*>(block + r.layer);
    const auto* scales = reinterpret_cast<const float*>(block + r.scale);
    const auto* offsets = reinterpret_cast<const int64_t*>(block + r.table_offset);
    const int heads = g_.num_heads;
    const auto* q = reinterpret_cast<const Bf16*>(m.q.data.get());
    auto* out = reinterpret_cast<Bf16*>(m.out.data.get());
    auto* lse = reinterpret_cast<float*>(m.lse.data.get());
    const auto* visibility = reinterpret_cast<const uint64_t*>(m.visibility.data.get());
    const auto* draft_kv = reinterpret_cast<const Bf16*>(m.draft_kv.data.get());
    int64_t row = 0;
    for (int b = 0; b < shape.batch; ++b) {
      const int32_t draft = drafts[b];
      if (draft == 0) continue;  // padding
      if (draft > shape.draft_len || row + draft > shape.rows()) {
        return absl::InternalError(absl::StrCat(name_, ": request ", b, " has ", draft,
                                                " drafts, more than its launch shape holds"));
      }
      if (offsets[b] < 0 || offsets[b] >= table_entries) {
        return absl::InternalError(absl::StrCat(name_, ": request ", b, "'s page table at ",
                                                offsets[b], " is outside the arena"));
      }
      if (g_.kv_dtype != KvDtype::kBf16) {
        // The gather put the draft rows in the draft buffer: they enter the
        // pool quantized, and the attention reads them as stored.
        kernels::DraftKvWriteArguments w;
        w.batch = 1;
        w.total_draft_capacity = draft;
        w.draft_kv = draft_kv + row * kLatentDim;
        w.pool = View();
        w.page_table = table + offsets[b];
        w.page_table_stride = table_entries - offsets[b];
        w.prefix_len = prefix + b;
        w.draft_len = drafts + b;
        w.layer = layers + b;
        RETURN_IF_ERROR(kernels::WriteDraftKvCpu(w));
      }
      kernels::VerifyArguments a;
      a.batch = 1;
      a.num_heads = heads;
      a.max_draft_len = draft;
      a.total_draft_capacity = draft;
      a.q = q + row * heads * kLatentDim;
      a.q_token_stride = static_cast<int64_t>(heads) * kLatentDim;
      a.q_head_stride = kLatentDim;
      a.pool = View();
      a.page_table = table + offsets[b];
      a.page_table_stride = table_entries - offsets[b];
      a.prefix_len = prefix + b;
      a.draft_len = drafts + b;
      a.layer = layers + b;
      a.default_softmax_scale = scales[b];
      a.visibility = visibility + row;
      a.out = out + row * heads * kValueDim;
      a.out_token_stride = static_cast<int64_t>(heads) * kValueDim;
      a.out_head_stride = kValueDim;
      a.lse = lse + row * heads;
      RETURN_IF_ERROR(kernels::VerifyAttentionCpu(a, threads_));
      row += draft;
    }
    const auto* outputs = reinterpret_cast<const kernels::CopyListHeader*>(m.outputs.data.get());
    RETURN_IF_ERROR(CheckList(outputs));
    kernels::RunCopyListOnHost(outputs);
    return absl::OkStatus();
  }

  // Calls fn(pool row, rows row) for positions start..start+count-1 of every
  // layer, `rows` being laid out [num_layers, count, row_elements].
  template <typename Row, typename Fn>
  void ForEachRow(int64_t table_offset, int64_t start, int64_t count, Fn fn, Row* rows,
                  int64_t row_elements) {
    const kernels::KvPoolView view = View();
    const int32_t* pages = Table() + table_offset;
    for (int layer = 0; layer < g_.num_layers; ++layer) {
      for (int64_t t = 0; t < count; ++t) {
        fn(view.RowBytes(layer, pages, start + t),
           rows + (static_cast<int64_t>(layer) * count + t) * row_elements);
      }
    }
  }

  kernels::KvPoolView View() const {
    return kernels::KvPoolView{reinterpret_cast<Bf16*>(pool_.data.get()), g_.num_layers,
                               g_.num_pages, g_.page_size, g_.kv_dtype};
  }

  const std::string name_;
  const int threads_;
  const std::optional<FakeDeviceOptions> fake_;
  FakeDeviceRecord* const record_;
  DeviceGeometry g_;
  DeviceBuffers buffers_;
  AlignedBuffer pool_, table_, slots_;
  BatchMemory main_;
  AlignedBuffer arena_;  // device doorbells (fakes): 16-byte host slots
  std::vector<std::unique_ptr<HostLane>> lanes_;
  std::vector<BatchShape> captured_;
  // Launched work runs under it, one piece at a time, in launch order.
  absl::Mutex exec_mu_;
  std::deque<Pending> pending_ ABSL_GUARDED_BY(exec_mu_);
  std::vector<absl::Status> results_;
  std::vector<double> seconds_;
  // Timed-only fakes: when each slot's launch ends, and the last launch's.
  std::vector<absl::Time> due_ ABSL_GUARDED_BY(exec_mu_);
  absl::Time stream_end_ ABSL_GUARDED_BY(exec_mu_) = absl::InfinitePast();
  int launches_ = 0;
  std::atomic<bool> faulted_{false};  // read by the lanes too
};

}  // namespace

std::unique_ptr<Device> MakeCpuDevice(int threads) {
  return std::make_unique<HostDevice>("cpu", threads, std::nullopt, nullptr);
}

std::unique_ptr<Device> MakeFakeDevice(int index, const FakeDeviceOptions& options,
                                       FakeDeviceRecord* record, int threads) {
  return std::make_unique<HostDevice>(absl::StrCat("fake:", index), threads, options, record);
}

}  // namespace mlaverify::engine
