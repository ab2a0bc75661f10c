// CudaDevice: one GPU's KV pool replica and the launches of its work.
// Everything a launch touches sits at fixed addresses, allocated once at
// Init: the pool, the page-table arena, the batch buffers (queries, outputs,
// request arrays, visibility words, the output list) and the attention
// workspace in device memory; the ring of slots in page-locked host memory,
// which the device reads in place. A verify batch of shape (B, N) is three
// steps on the compute stream: the gather kernel runs the copy list of the
// slot the device's cursor names (page-table writes, the request arrays, the
// queries into the query buffer, the draft rows straight into the pool, the
// output list into device memory) and advances the cursor; with an fp8 pool
// the draft rows go to a draft buffer instead and the draft-write kernel
// quantizes them into the pool; the attention
// (plan, attention, combine) reads only device memory; the scatter kernel
// runs the output list (each output row to its caller's memory: a CUDA
// region, a page-locked system region, or the engine's host staging).
// CaptureGraphs records those steps as one CUDA graph per (B, N) and plan
// variant; lengths, page tables, trees and every address a batch uses are
// read from memory, so one graph serves every batch of its bucket. Pool
// operations run the same gather first and then their kernel, eagerly, on
// the same stream; nothing but ReadRows and UploadTable waits on the host.
//
// Device-driven steps: each lane has its own stream (the highest priority:
// a rung layer goes before queued batches), its own launch memory (batch
// buffers, workspace, gather list and cursor), a page table, one slot per
// layer and its own graphs per bucket. LaunchStep makes the lane wait for
// the main stream's work so far, copies the step's slots and table up, and
// then, for GPU doorbells, enqueues every layer as three operations: a
// stream wait on the doorbell word, the bucket's graph (the first layer
// plans, the rest reuse the plan: the lengths are the step's), and one
// batch of two stream writes (the completion word; the progress word the
// engine reads in page-locked host memory). For host doorbells a thread of
// the lane waits on the host slot and launches each layer the same way,
// its completion written by the GPU into the slot. EndLane writes the
// doorbell from the release stream (which never waits on anything) and
// appends the completion's end value to the lane's stream.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/geometry.h"
#include "common/host_doorbell.h"
#include "common/status_macros.h"
#include "kernels/copy_list.h"
#include "kernels/device_fault.h"
#include "kernels/stream_memops.h"
#include "kernels/verify_attention_cuda.h"
#include "server/engine/device.h"
#include "spdlog/spdlog.h"

namespace mlaverify::engine {
namespace {

// ReadRows' chunk (tests only): device rows, copied back through pinned memory.
constexpr size_t kReadChunkBytes = size_t{32} << 20;

template <typename T>
T* At(uint64_t address, size_t offset = 0) {
  return reinterpret_cast<T*>(address + offset);
}

uint64_t Address(const void* p) { return reinterpret_cast<uint64_t>(p); }

// What one verify launch sequence runs over: the device's own memory, or a
// step lane's. Fixed from Init on (graphs hold these addresses).
struct LaunchMemory {
  cudaStream_t stream = nullptr;
  void* q = nullptr;
  void* draft_kv = nullptr;  // fp8 pools only: the batch's draft rows before quantization
  void* out = nullptr;
  void* lse = nullptr;
  void* requests = nullptr;
  void* visibility = nullptr;
  void* outputs = nullptr;
  void* counters = nullptr;  // the gather's cursor
  void* list = nullptr;      // the gather's list, fetched from the slot
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  uint64_t slots = 0;  // slot 0 as the gather reads it
  uint64_t slot_bytes = 0;
  int num_slots = 0;
  void* table = nullptr;
  uint64_t* stamps = nullptr;  // lanes: [num_slots][2] (device view), else null

  void Describe(uint64_t pool, DeviceBuffers* b) const {
    b->pool = pool;
    b->table = Address(table);
    b->q = Address(q);
    b->out = Address(out);
    b->lse = Address(lse);
    b->requests = Address(requests);
    b->visibility = Address(visibility);
    b->outputs = Address(outputs);
    b->slots = slots;
    if (draft_kv != nullptr) b->draft_kv = Address(draft_kv);
  }
};

using GraphKey = std::tuple<int, int, bool>;  // batch, draft, reuse_plan

GraphKey Key(BatchShape shape, bool reuse) { return {shape.batch, shape.draft_len, reuse}; }

// Calls that release memory the GPU may address (cudaHostUnregister,
// cudaIpcCloseMemHandle, cudaFree) wait for the whole device: measured
// (bench/results/runs/2026-12-07-gpu-steps-test-h100.log), an unregister
// beside a lane held at a GPU doorbell waited until the doorbell was rung,
// and while it waited the step runner's own calls waited too, so even the
// layer timeout could not end the step. Such a release therefore runs only
// while no lane of the process is held at a GPU doorbell: it waits for the
// gated lanes to drain (their steps end by commit, abort or timeout) and
// holds new GPU-doorbell launches back meanwhile. Process-wide: devices over
// one GPU share its context, and a portable registration spans them all.
// (The server's own cudaFree calls come at start-up and shutdown only.)
// tests/gpu_steps_test.cc, RegionRelease*, checks it.
class LaneGate {
 public:
  // Before a GPU-doorbell step's waits are enqueued on a lane.
  void Enter(bool* gated) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* releasing) { return *releasing == 0; }, &releasing_));
    if (!*gated) ++gated_;
    *gated = true;
  }
  // Once that lane drained (again later: no effect).
  void Leave(bool* gated) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (*gated) --gated_;
    *gated = false;
  }
  // Runs `release` with no lane held at a GPU doorbell (new ones wait for
  // it; releases run side by side).
  void Release(absl::string_view what, const std::function<void()>& release)
      ABSL_LOCKS_EXCLUDED(mu_) {
    const absl::Time start = absl::Now();
    {
      absl::MutexLock lock(&mu_);
      ++releasing_;
      mu_.Await(absl::Condition(
          +[](int* gated) { return *gated == 0; }, &gated_));
    }
    const absl::Duration waited = absl::Now() - start;
    if (waited > absl::Milliseconds(100)) {
      spdlog::warn("{} waited {} for steps held at GPU doorbells to end", std::string(what),
                   absl::FormatDuration(waited));
    }
    release();
    absl::MutexLock lock(&mu_);
    --releasing_;
  }

 private:
  absl::Mutex mu_;
  int gated_ ABSL_GUARDED_BY(mu_) = 0;      // lanes held at (or running from) GPU doorbells
  int releasing_ ABSL_GUARDED_BY(mu_) = 0;  // releases waiting or running
};

LaneGate& ProcessLaneGate() {
  static LaneGate* const gate = new LaneGate;  // never destroyed: devices may outlive statics
  return *gate;
}

// One lane of device-driven steps (device.h).
struct CudaLane {
  LaunchMemory memory;
  DeviceBuffers buffers;
  std::map<GraphKey, cudaGraphExec_t> graphs;
  uint8_t* slots_host = nullptr;    // page-locked: the engine writes the step's slots here
  int32_t* table_host = nullptr;    // page-locked: and its page table
  uint64_t* stamps_host = nullptr;  // page-locked, mapped: [layers][2] ns (the gather, the scatter)
  uint64_t* progress_host = nullptr;  // page-locked, mapped: base + layers done
  uint64_t progress_device = 0;
  cudaEvent_t main_mark = nullptr;  // the main stream's work before the step
  cudaEvent_t end = nullptr;        // after the step's last operation
  // The step (set by LaunchStep, read by the other threads).
  std::atomic<bool> running{false};
  std::atomic<uint64_t> base{0};
  std::atomic<int> layers{0};
  std::atomic<uint64_t> end_value{0};  // EndLane's (0: not ended)
  std::atomic<bool> host_kind{false};  // the step has host doorbells
  // The step's doorbell and completion (StepLaunch): offsets in the arena
  // (GPU doorbells), or host slots in this process.
  std::atomic<uint64_t> doorbell{0};
  std::atomic<uint64_t> completion{0};
  bool completion_ended = false;  // EndLane appended the completion's end value
  absl::Mutex end_mu;             // EndLane's calls, one at a time
  bool gated = false;             // counted by the process's LaneGate (under its lock)
  // Host doorbells: the lane's thread, which launches each rung layer.
  std::thread thread;
  absl::Mutex mu;
  bool has_step ABSL_GUARDED_BY(mu) = false;
  bool stop ABSL_GUARDED_BY(mu) = false;
  StepLaunch launch ABSL_GUARDED_BY(mu);
  std::atomic<bool> thread_done{true};  // the thread launched all it will of its step
  absl::Status error ABSL_GUARDED_BY(mu);
};

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, const CudaDeviceOptions& options)
      : ordinal_(ordinal), name_(absl::StrCat("cuda:", ordinal)), options_(options) {}

  ~CudaDevice() override {
    // Errors are ignored: after a sticky fault every call fails, and the
    // process is on its way out.
    for (auto& lane : lanes_) {
      {
        absl::MutexLock lock(&lane->mu);
        lane->stop = true;
      }
      lane->end_value.store(UINT64_MAX);
      if (lane->thread.joinable()) lane->thread.join();
    }
    cudaSetDevice(ordinal_);
    for (auto& lane : lanes_) {
      if (lane->memory.stream != nullptr) cudaStreamSynchronize(lane->memory.stream);
      gate_.Leave(&lane->gated);
      for (auto& [key, exec] : lane->graphs) cudaGraphExecDestroy(exec);
      FreeMemory(lane->memory);
      cudaFree(At<void>(lane->memory.slots));  // a lane's slots are on the device
      cudaFreeHost(lane->slots_host);
      cudaFreeHost(lane->table_host);
      cudaFreeHost(lane->stamps_host);
      cudaFreeHost(lane->progress_host);
      if (lane->main_mark != nullptr) cudaEventDestroy(lane->main_mark);
      if (lane->end != nullptr) cudaEventDestroy(lane->end);
      if (lane->memory.stream != nullptr) cudaStreamDestroy(lane->memory.stream);
    }
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    for (cudaEvent_t e : start_) cudaEventDestroy(e);
    for (cudaEvent_t e : stop_) cudaEventDestroy(e);
    cudaFreeHost(slots_);
    cudaFreeHost(read_host_);
    cudaFreeHost(upload_host_);
    FreeMemory(main_);
    for (void* p : {pool_, read_dev_}) cudaFree(p);
    // The doorbell arena is never freed while the process lives: a client
    // may hold its IPC handle, which a new allocation could be given again.
    if (release_ != nullptr) cudaStreamDestroy(release_);
    if (main_.stream != nullptr) cudaStreamDestroy(main_.stream);
  }

  std::string name() const override { return name_; }

  DeviceDescription Describe() const override {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, ordinal_);
    return {absl::StrCat(prop.name, " (", name_, ", sm_", prop.major, prop.minor, ")"),
            prop.totalGlobalMem};
  }

  absl::Status BindThread() override { return Check(cudaSetDevice(ordinal_), "cudaSetDevice"); }

  absl::Status Init(const DeviceGeometry& g) override {
    g_ = g;
    RETURN_IF_ERROR(BindThread());
    ASSIGN_OR_RETURN(config_, kernels::PrepareVerifyLaunch(ordinal_));
    RETURN_IF_ERROR(
        Check(cudaStreamCreateWithFlags(&main_.stream, cudaStreamNonBlocking), "stream"));
    const size_t pool_bytes =
        static_cast<size_t>(g.num_layers) * g.num_pages * g.page_size * KvRowBytes(g.kv_dtype);
    RETURN_IF_ERROR(Check(cudaMalloc(&pool_, pool_bytes), "pool allocation"));
    RETURN_IF_ERROR(AllocateLaunchMemory(g.slot, &main_));
    RETURN_IF_ERROR(Allocate(&main_.table, static_cast<size_t>(g.table_entries) * sizeof(int32_t),
                             main_.stream, "page-table arena"));
    // The slots: page-locked, mapped (the gather reads them in place),
    // portable (every device of the process may read them).
    const size_t slot_bytes = static_cast<size_t>(g.slots) * g.slot.bytes;
    RETURN_IF_ERROR(Check(cudaHostAlloc(reinterpret_cast<void**>(&slots_), slot_bytes,
                                        cudaHostAllocPortable | cudaHostAllocMapped),
                          "slot allocation"));
    std::memset(slots_, 0, slot_bytes);
    void* slots_device = nullptr;
    RETURN_IF_ERROR(
        Check(cudaHostGetDevicePointer(&slots_device, slots_, 0), "cudaHostGetDevicePointer"));
    main_.slots = Address(slots_device);
    main_.slot_bytes = g.slot.bytes;
    main_.num_slots = g.slots;
    start_.resize(g.slots);
    stop_.resize(g.slots);
    for (int k = 0; k < g.slots; ++k) {
      RETURN_IF_ERROR(Check(cudaEventCreate(&start_[k]), "event"));
      // Wait synchronizes on the stop event: blocking, its thread sleeps
      // until the launch ends instead of spinning (DeviceGeometry).
      RETURN_IF_ERROR(
          Check(cudaEventCreateWithFlags(
                    &stop_[k], g.blocking_wait ? cudaEventBlockingSync : cudaEventDefault),
                "event"));
    }
    main_.Describe(Address(pool_), &buffers_);
    RETURN_IF_ERROR(InitLanes());
    return Check(cudaStreamSynchronize(main_.stream), "initialisation");
  }

  const DeviceBuffers& buffers() const override { return buffers_; }
  uint8_t* slot(int k) override { return slots_ + static_cast<size_t>(k) * g_.slot.bytes; }
  bool asynchronous() const override { return true; }
  bool addresses_host_memory() const override { return false; }
  bool SupportsGraphs() const override { return true; }

  absl::StatusOr<int64_t> CaptureGraphs(BatchShape shape) override {
    RETURN_IF_ERROR(BindThread());
    size_t free_before = 0, free_after = 0, total = 0;
    RETURN_IF_ERROR(Check(cudaMemGetInfo(&free_before, &total), "cudaMemGetInfo"));
    RETURN_IF_ERROR(Capture(main_, shape, &graphs_));
    // Every lane replays its own graphs (its memory, its stream).
    for (auto& lane : lanes_) RETURN_IF_ERROR(Capture(lane->memory, shape, &lane->graphs));
    RETURN_IF_ERROR(Check(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo"));
    return free_before > free_after ? static_cast<int64_t>(free_before - free_after) : 0;
  }

  absl::Status Launch(const LaunchOptions& o) override {
    // Launchers are whichever thread holds the worker's launch lock.
    RETURN_IF_ERROR(BindThread());
    ++launches_;
    if (options_.fail_after_launches > 0 && launches_ == options_.fail_after_launches) {
      RETURN_IF_ERROR(Check(kernels::LaunchTrapKernel(main_.stream), "fault injection"));
    }
    RETURN_IF_ERROR(Check(cudaEventRecord(start_[o.slot], main_.stream), "cudaEventRecord"));
    RETURN_IF_ERROR(Replay(main_, graphs_, o.shape, o.graph, o.reuse_plan));
    return Check(cudaEventRecord(stop_[o.slot], main_.stream), "cudaEventRecord");
  }

  absl::Status LaunchWriteRows(int slot, int gather_count, int64_t table_offset, int64_t start,
                               int64_t count, uint64_t rows) override {
    RETURN_IF_ERROR(BeginOp(slot, gather_count));
    // Rows read in place: page-locked host memory (a region, the staging)
    // across PCIe, or device memory.
    RETURN_IF_ERROR(kernels::LaunchCopyRows(View(), TableAt(table_offset), start, count,
                                            At<Bf16>(rows), /*to_pool=*/true, main_.stream));
    return Check(cudaEventRecord(stop_[slot], main_.stream), "cudaEventRecord");
  }

  absl::Status LaunchCompact(int slot, int gather_count, int64_t table_offset) override {
    RETURN_IF_ERROR(BeginOp(slot, gather_count));
    // The path is read in place from the slot's op area (mapped memory).
    const uint64_t op = main_.slots + static_cast<uint64_t>(slot) * g_.slot.bytes + g_.slot.op;
    kernels::CompactArguments c;
    c.batch = 1;
    c.pool = View();
    c.page_table = TableAt(table_offset);
    c.page_table_stride = std::max<int64_t>(1, g_.table_entries - table_offset);
    c.prefix_len = At<const int32_t>(op);
    c.accepted_len = At<const int32_t>(op, sizeof(int32_t));
    c.accepted = At<const int32_t>(op, 2 * sizeof(int32_t));
    RETURN_IF_ERROR(kernels::LaunchCompactAcceptedKv(c, main_.stream));
    return Check(cudaEventRecord(stop_[slot], main_.stream), "cudaEventRecord");
  }

  absl::Status LaunchGather(int slot, int gather_count) override {
    RETURN_IF_ERROR(BeginOp(slot, gather_count));
    return Check(cudaEventRecord(stop_[slot], main_.stream), "cudaEventRecord");
  }

  bool Finished(int slot) override { return cudaEventQuery(stop_[slot]) != cudaErrorNotReady; }

  absl::StatusOr<double> Wait(int slot) override {
    RETURN_IF_ERROR(Check(cudaEventSynchronize(stop_[slot]), "launch"));
    float ms = 0;
    RETURN_IF_ERROR(
        Check(cudaEventElapsedTime(&ms, start_[slot], stop_[slot]), "cudaEventElapsedTime"));
    return ms * 1e-3;
  }

  absl::Status ReadRows(int64_t table_offset, int64_t start, int64_t count, Bf16* rows) override {
    RETURN_IF_ERROR(BindThread());
    if (read_dev_ == nullptr) {
      RETURN_IF_ERROR(Check(cudaMalloc(&read_dev_, kReadChunkBytes), "row read buffer"));
      RETURN_IF_ERROR(Check(cudaHostAlloc(&read_host_, kReadChunkBytes, cudaHostAllocDefault),
                            "row read buffer"));
    }
    const int64_t layers = g_.num_layers;
    // Rows as stored (device.h): 576 bf16 values, or 656-byte fp8 rows.
    const int64_t row_bytes = KvRowBytes(g_.kv_dtype);
    const int64_t row_elements = row_bytes / static_cast<int64_t>(sizeof(Bf16));
    const int64_t chunk_max = std::max<int64_t>(1, kReadChunkBytes / (layers * row_bytes));
    for (int64_t c0 = 0; c0 < count; c0 += chunk_max) {
      const int64_t chunk = std::min(chunk_max, count - c0);
      RETURN_IF_ERROR(kernels::LaunchCopyRows(View(), TableAt(table_offset), start + c0, chunk,
                                              static_cast<Bf16*>(read_dev_), /*to_pool=*/false,
                                              main_.stream));
      const size_t bytes = static_cast<size_t>(layers * chunk * row_bytes);
      RETURN_IF_ERROR(
          Check(cudaMemcpyAsync(read_host_, read_dev_, bytes, cudaMemcpyDeviceToHost, main_.stream),
                "row download"));
      RETURN_IF_ERROR(Check(cudaStreamSynchronize(main_.stream), "row download"));
      const auto* host = static_cast<const Bf16*>(read_host_);
      for (int64_t layer = 0; layer < layers; ++layer) {
        std::memcpy(rows + (layer * count + c0) * row_elements, host + layer * chunk * row_elements,
                    static_cast<size_t>(chunk * row_bytes));
      }
    }
    return absl::OkStatus();
  }

  absl::Status UploadTable(absl::Span<const int32_t> entries) override {
    RETURN_IF_ERROR(BindThread());
    const size_t bytes = entries.size() * sizeof(int32_t);
    if (entries.size() != static_cast<size_t>(g_.table_entries)) {
      return absl::InternalError("page-table upload of the wrong size");
    }
    if (upload_host_ == nullptr) {
      RETURN_IF_ERROR(
          Check(cudaHostAlloc(&upload_host_, bytes, cudaHostAllocDefault), "table upload buffer"));
    }
    std::memcpy(upload_host_, entries.data(), bytes);
    RETURN_IF_ERROR(Check(
        cudaMemcpyAsync(main_.table, upload_host_, bytes, cudaMemcpyHostToDevice, main_.stream),
        "table upload"));
    // Rare (a compacted arena): the buffer is reused only once this is done.
    return Check(cudaStreamSynchronize(main_.stream), "table upload");
  }

  absl::Status PinHost(void* data, size_t bytes) override {
    // On this device's context (a thread with none would create one on
    // device 0); portable: every device of the process sees it pinned.
    RETURN_IF_ERROR(BindThread());
    const cudaError_t err =
        cudaHostRegister(data, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
    if (err == cudaSuccess) return absl::OkStatus();
    cudaGetLastError();  // not sticky: clear it for this thread's next call
    return absl::UnavailableError(
        absl::StrCat(name_, ": cudaHostRegister of ", bytes, " bytes: ", cudaGetErrorString(err)));
  }

  void UnpinHost(void* data) override {
    gate_.Release("cudaHostUnregister", [&] {
      if (!BindThread().ok() || cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
    });
  }

  absl::StatusOr<uint64_t> AddressOfHost(const void* data) override {
    RETURN_IF_ERROR(BindThread());
    void* device = nullptr;
    const cudaError_t err = cudaHostGetDevicePointer(&device, const_cast<void*>(data), 0);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(
          absl::StrCat(name_, ": cudaHostGetDevicePointer: ", cudaGetErrorString(err)));
    }
    return Address(device);
  }

  absl::StatusOr<uint64_t> OpenIpcMemory(absl::string_view handle) override {
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a CUDA IPC handle is ", sizeof(cudaIpcMemHandle_t), " bytes, not ", handle.size()));
    }
    RETURN_IF_ERROR(BindThread());
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* data = nullptr;
    const cudaError_t err = cudaIpcOpenMemHandle(&data, h, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      cudaGetLastError();  // not sticky
      return absl::InvalidArgumentError(
          absl::StrCat(name_, ": cudaIpcOpenMemHandle: ", cudaGetErrorString(err)));
    }
    return Address(data);
  }

  void CloseIpcMemory(uint64_t address) override {
    gate_.Release("cudaIpcCloseMemHandle", [&] {
      if (!BindThread().ok() || cudaIpcCloseMemHandle(At<void>(address)) != cudaSuccess) {
        cudaGetLastError();
      }
    });
  }

  absl::StatusOr<uint64_t> AddressOfDeviceMemory(uint64_t address, int device_id) override {
    if (device_id == ordinal_) return address;
    RETURN_IF_ERROR(BindThread());
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, ordinal_, device_id) != cudaSuccess || can == 0) {
      cudaGetLastError();
      return absl::InvalidArgumentError(
          absl::StrCat(name_, " cannot reach the memory of cuda:", device_id, " (no peer access)"));
    }
    const cudaError_t err = cudaDeviceEnablePeerAccess(device_id, 0);
    if (err != cudaSuccess && err != cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();
      return absl::InternalError(
          absl::StrCat(name_, ": cudaDeviceEnablePeerAccess: ", cudaGetErrorString(err)));
    }
    cudaGetLastError();
    return address;  // unified addressing: the same address on every device
  }

  absl::StatusOr<uint8_t*> AllocateHostStaging(size_t bytes) override {
    RETURN_IF_ERROR(BindThread());
    void* data = nullptr;
    RETURN_IF_ERROR(Check(cudaHostAlloc(&data, bytes, cudaHostAllocPortable | cudaHostAllocMapped),
                          "page-locked staging allocation"));
    return static_cast<uint8_t*>(data);
  }

  void FreeHostStaging(uint8_t* data) override {
    if (BindThread().ok()) cudaFreeHost(data);
  }

  int cuda_ordinal() const override { return ordinal_; }

  // ---- device-driven steps ----

  absl::Status DoorbellSupport(DoorbellKind kind) const override {
    if (lanes_.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(name_, " has no step lanes (the server runs with 0 lanes per device)"));
    }
    if (!memops_.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(name_, " cannot run device-driven steps: ", memops_.message()));
    }
    return absl::OkStatus();
  }

  DoorbellArena doorbell_arena() const override { return arena_; }

  uint8_t* lane_slot(int lane, int layer) override {
    return lanes_[lane]->slots_host + static_cast<size_t>(layer) * g_.lanes.slot.bytes;
  }
  const DeviceBuffers& lane_buffers(int lane) const override { return lanes_[lane]->buffers; }
  int32_t* lane_table(int lane) override { return lanes_[lane]->table_host; }

  absl::Status LaunchStep(const StepLaunch& launch) override {
    RETURN_IF_ERROR(BindThread());
    if (launch.lane < 0 || launch.lane >= static_cast<int>(lanes_.size()) ||
        launch.layers != g_.num_layers) {
      return absl::InternalError(absl::StrCat(name_, ": step launch on lane ", launch.lane,
                                              " with ", launch.layers, " layers"));
    }
    CudaLane& lane = *lanes_[launch.lane];
    if ((lane.running.load() && cudaEventQuery(lane.end) == cudaErrorNotReady) ||
        !lane.thread_done.load()) {
      return absl::InternalError(absl::StrCat(name_, ": lane ", launch.lane, " is busy"));
    }
    const cudaStream_t stream = lane.memory.stream;
    // Nothing of the step before the main stream's work so far (the rows it
    // attends to were written there), then its slots and page table go up.
    RETURN_IF_ERROR(Check(cudaEventRecord(lane.main_mark, main_.stream), "cudaEventRecord"));
    RETURN_IF_ERROR(Check(cudaStreamWaitEvent(stream, lane.main_mark, 0), "cudaStreamWaitEvent"));
    const size_t slot_bytes = static_cast<size_t>(launch.layers) * g_.lanes.slot.bytes;
    RETURN_IF_ERROR(Check(cudaMemcpyAsync(At<void>(lane.memory.slots), lane.slots_host, slot_bytes,
                                          cudaMemcpyHostToDevice, stream),
                          "step slots upload"));
    if (launch.table_entries > 0) {
      RETURN_IF_ERROR(
          Check(cudaMemcpyAsync(lane.memory.table, lane.table_host,
                                static_cast<size_t>(launch.table_entries) * sizeof(int32_t),
                                cudaMemcpyHostToDevice, stream),
                "step page table upload"));
    }
    RETURN_IF_ERROR(
        Check(cudaMemsetAsync(lane.memory.counters, 0, sizeof(int32_t), stream), "cursor reset"));
    std::memset(lane.stamps_host, 0, static_cast<size_t>(launch.layers) * 2 * sizeof(uint64_t));
    __atomic_store_n(lane.progress_host, launch.base, __ATOMIC_RELEASE);
    lane.base.store(launch.base);
    lane.layers.store(launch.layers);
    lane.end_value.store(0);
    lane.host_kind.store(launch.kind == DoorbellKind::kHost);
    lane.doorbell.store(launch.doorbell);
    lane.completion.store(launch.completion);
    {
      absl::MutexLock lock(&lane.end_mu);
      lane.completion_ended = false;
    }
    lane.running.store(true);
    if (launch.kind == DoorbellKind::kDevice) {
      gate_.Enter(&lane.gated);  // left in lane_progress once the lane drained
      const uint64_t doorbell = arena_.address + launch.doorbell;
      const uint64_t completion = arena_.address + launch.completion;
      absl::Status enqueued;
      for (int layer = 0; layer < launch.layers && enqueued.ok(); ++layer) {
        const uint64_t value = launch.base + static_cast<uint64_t>(layer) + 1;
        enqueued = Memop(kernels::StreamWaitValue64(stream, doorbell, value));
        if (enqueued.ok()) enqueued = EnqueueLayer(lane, launch, layer, completion);
      }
      if (!enqueued.ok()) {
        // What was enqueued must not wait for rings the step will never
        // see counted: every wait passes at once, and the lane's end is
        // recorded after it (the worker faults the device all the same).
        const uint64_t end = launch.base + static_cast<uint64_t>(launch.layers) + 1;
        kernels::StreamWriteValue64(release_, doorbell, end).IgnoreError();
        kernels::StreamWriteValue64(stream, completion, end).IgnoreError();
        cudaEventRecord(lane.end, stream);
        // Nothing waits for a ring any more (and the runner may never poll
        // a lane whose launch failed).
        gate_.Leave(&lane.gated);
        return enqueued;
      }
      return Check(cudaEventRecord(lane.end, stream), "cudaEventRecord");
    }
    // Host doorbells: the lane's thread launches each layer once rung.
    absl::MutexLock lock(&lane.mu);
    lane.launch = launch;
    lane.error = absl::OkStatus();
    lane.thread_done.store(false);
    lane.has_step = true;
    return absl::OkStatus();
  }

  void EndLane(int index, uint64_t end_value) override {
    CudaLane& lane = *lanes_[index];
    if (!lane.running.load()) return;
    lane.end_value.store(end_value);
    if (lane.host_kind.load()) {
      // The lane's thread stops launching (its wait returns at once) and
      // stores the completion's end value once what it launched ran.
      HostSlot(reinterpret_cast<void*>(lane.doorbell.load())).Store(end_value);
      return;
    }
    absl::MutexLock lock(&lane.end_mu);
    if (!BindThread().ok()) return;
    // The doorbell from the release stream, which waits for nothing: every
    // layer still waiting runs at once. Again on every call: a late ring may
    // have lowered it.
    if (!kernels::StreamWriteValue64(release_, arena_.address + lane.doorbell.load(), end_value)
             .ok()) {
      return;
    }
    if (!lane.completion_ended) {
      // The completion after the step's last operation (stream order): the
      // scheduler's waits all pass, and no layer's own write follows it.
      // The lane's end is recorded again after it, so "drained" includes it.
      lane.completion_ended =
          kernels::StreamWriteValue64(lane.memory.stream, arena_.address + lane.completion.load(),
                                      end_value)
              .ok() &&
          cudaEventRecord(lane.end, lane.memory.stream) == cudaSuccess;
    }
  }

  LaneProgress lane_progress(int index) override {
    CudaLane& lane = *lanes_[index];
    LaneProgress p;
    // Drained first, progress after: the progress word's last write comes
    // before the lane's end in stream order, so a lane seen drained shows
    // every layer it ran (read the other way round, a layer finishing
    // between the two reads looked like a lane that stopped early).
    if (lane.thread_done.load() && BindThread().ok()) {
      const cudaError_t q = cudaEventQuery(lane.end);
      // A device error also ends the lane (the worker faults the device).
      p.drained = q != cudaErrorNotReady;
    }
    const uint64_t seen = __atomic_load_n(lane.progress_host, __ATOMIC_ACQUIRE);
    const uint64_t base = lane.base.load();
    const int layers = lane.layers.load();
    p.layers_done = seen <= base ? 0 : static_cast<int>(std::min<uint64_t>(seen - base, layers));
    if (p.drained) {
      lane.running.store(false);
      gate_.Leave(&lane.gated);
    }
    return p;
  }

  std::vector<LayerTiming> lane_timings(int index) override {
    CudaLane& lane = *lanes_[index];
    const int layers = lane.layers.load();
    std::vector<LayerTiming> out;
    uint64_t previous_end = 0;
    for (int l = 0; l < layers; ++l) {
      const uint64_t start = lane.stamps_host[2 * l], end = lane.stamps_host[2 * l + 1];
      if (start == 0 || end < start) break;  // not run
      LayerTiming t;
      t.device_seconds = static_cast<double>(end - start) * 1e-9;
      if (previous_end != 0 && start > previous_end) {
        t.doorbell_wait_seconds = static_cast<double>(start - previous_end) * 1e-9;
      }
      previous_end = end;
      out.push_back(t);
    }
    return out;
  }

 private:
  absl::Status Check(cudaError_t err, const char* what) const {
    if (err == cudaSuccess) return absl::OkStatus();
    return absl::InternalError(absl::StrCat(name_, ": CUDA ", what, ": ", cudaGetErrorString(err)));
  }
  absl::Status Memop(absl::Status s) const {
    if (s.ok()) return s;
    return absl::InternalError(absl::StrCat(name_, ": ", s.message()));
  }

  absl::Status Allocate(void** p, size_t bytes, cudaStream_t stream, const char* what) {
    RETURN_IF_ERROR(Check(cudaMalloc(p, std::max<size_t>(bytes, 16)), what));
    return Check(cudaMemsetAsync(*p, 0, std::max<size_t>(bytes, 16), stream), what);
  }

  static void FreeMemory(const LaunchMemory& m) {
    for (void* p : {m.q, m.draft_kv, m.out, m.lse, m.requests, m.visibility, m.outputs, m.counters,
                    m.list, m.workspace, m.table}) {
      cudaFree(p);
    }
  }

  // Everything of a LaunchMemory but its stream, table and slots.
  absl::Status AllocateLaunchMemory(const SlotLayout& slot, LaunchMemory* m) {
    const size_t rows = static_cast<size_t>(g_.max_batch) * g_.max_draft_len;
    const cudaStream_t s = m->stream;
    RETURN_IF_ERROR(Allocate(&m->q, rows * g_.num_heads * kLatentRowBytes, s, "query buffer"));
    if (g_.kv_dtype != KvDtype::kBf16) {
      // The batch's draft rows before quantization (the gather puts them here).
      RETURN_IF_ERROR(Allocate(&m->draft_kv, rows * kLatentRowBytes, s, "draft row buffer"));
    }
    RETURN_IF_ERROR(
        Allocate(&m->out, rows * g_.num_heads * kValueDim * sizeof(Bf16), s, "out buffer"));
    RETURN_IF_ERROR(Allocate(&m->lse, rows * g_.num_heads * sizeof(float), s, "lse buffer"));
    RETURN_IF_ERROR(Allocate(&m->requests, slot.requests.bytes, s, "request arrays"));
    RETURN_IF_ERROR(Allocate(&m->visibility, rows * sizeof(uint64_t), s, "visibility words"));
    RETURN_IF_ERROR(
        Allocate(&m->outputs, kernels::CopyListBytes(slot.output_capacity), s, "output list"));
    RETURN_IF_ERROR(Allocate(&m->counters, 2 * sizeof(int32_t), s, "gather cursor"));
    RETURN_IF_ERROR(
        Allocate(&m->list, kernels::CopyListBytes(slot.list_capacity), s, "gather list"));
    kernels::VerifyArguments shape;
    shape.batch = g_.max_batch;
    shape.num_heads = g_.num_heads;
    shape.max_draft_len = g_.max_draft_len;
    m->workspace_bytes = kernels::VerifyWorkspaceBytes(shape, config_);
    RETURN_IF_ERROR(Check(cudaMalloc(&m->workspace, m->workspace_bytes), "workspace"));
    return kernels::InitVerifyWorkspace(shape, config_, m->workspace, m->workspace_bytes, s);
  }

  // The lanes, their memory and threads, the doorbell arena, the release
  // stream; and whether stream memory operations work here at all.
  absl::Status InitLanes() {
    const LaneGeometry& lg = g_.lanes;
    if (lg.lanes == 0) return absl::OkStatus();
    memops_ = kernels::ProbeStreamMemOps(ordinal_);
    RETURN_IF_ERROR(BindThread());
    if (!memops_.ok()) {
      spdlog::warn("{}: {}; OpenStep is refused on this device", name_,
                   std::string(memops_.message()));
    }
    int least = 0, greatest = 0;
    RETURN_IF_ERROR(Check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "priorities"));
    RETURN_IF_ERROR(Check(cudaStreamCreateWithFlags(&release_, cudaStreamNonBlocking), "stream"));
    void* arena = nullptr;
    const size_t arena_bytes = DoorbellArenaBytes(lg.lanes);
    RETURN_IF_ERROR(Check(cudaMalloc(&arena, arena_bytes), "doorbell arena"));
    RETURN_IF_ERROR(Check(cudaMemsetAsync(arena, 0, arena_bytes, release_), "doorbell arena"));
    cudaIpcMemHandle_t handle;
    RETURN_IF_ERROR(Check(cudaIpcGetMemHandle(&handle, arena), "doorbell arena's IPC handle"));
    arena_.address = Address(arena);
    arena_.bytes = arena_bytes;
    arena_.ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
    for (int k = 0; k < lg.lanes; ++k) {
      auto lane = std::make_unique<CudaLane>();
      LaunchMemory& m = lane->memory;
      RETURN_IF_ERROR(Check(
          cudaStreamCreateWithPriority(&m.stream, cudaStreamNonBlocking, greatest), "lane stream"));
      RETURN_IF_ERROR(AllocateLaunchMemory(lg.slot, &m));
      RETURN_IF_ERROR(Allocate(
          &m.table, static_cast<size_t>(std::max<int64_t>(1, lg.table_entries)) * sizeof(int32_t),
          m.stream, "lane page table"));
      const size_t slot_bytes = static_cast<size_t>(g_.num_layers) * lg.slot.bytes;
      void* slots = nullptr;
      RETURN_IF_ERROR(Allocate(&slots, slot_bytes, m.stream, "lane slots"));
      m.slots = Address(slots);
      m.slot_bytes = lg.slot.bytes;
      m.num_slots = g_.num_layers;
      RETURN_IF_ERROR(Check(cudaHostAlloc(reinterpret_cast<void**>(&lane->slots_host), slot_bytes,
                                          cudaHostAllocDefault),
                            "lane slot staging"));
      std::memset(lane->slots_host, 0, slot_bytes);
      RETURN_IF_ERROR(
          Check(cudaHostAlloc(
                    reinterpret_cast<void**>(&lane->table_host),
                    static_cast<size_t>(std::max<int64_t>(1, lg.table_entries)) * sizeof(int32_t),
                    cudaHostAllocDefault),
                "lane table staging"));
      const size_t stamp_bytes = static_cast<size_t>(g_.num_layers) * 2 * sizeof(uint64_t);
      RETURN_IF_ERROR(Check(cudaHostAlloc(reinterpret_cast<void**>(&lane->stamps_host), stamp_bytes,
                                          cudaHostAllocMapped | cudaHostAllocPortable),
                            "lane stamps"));
      std::memset(lane->stamps_host, 0, stamp_bytes);
      void* stamps_device = nullptr;
      RETURN_IF_ERROR(Check(cudaHostGetDevicePointer(&stamps_device, lane->stamps_host, 0),
                            "cudaHostGetDevicePointer"));
      m.stamps = static_cast<uint64_t*>(stamps_device);
      RETURN_IF_ERROR(
          Check(cudaHostAlloc(reinterpret_cast<void**>(&lane->progress_host), sizeof(uint64_t),
                              cudaHostAllocMapped | cudaHostAllocPortable),
                "lane progress word"));
      *lane->progress_host = 0;
      void* progress_device = nullptr;
      RETURN_IF_ERROR(Check(cudaHostGetDevicePointer(&progress_device, lane->progress_host, 0),
                            "cudaHostGetDevicePointer"));
      lane->progress_device = Address(progress_device);
      // Created up front: creating events while a launching thread is held
      // by a full stream queue would block with it.
      RETURN_IF_ERROR(
          Check(cudaEventCreateWithFlags(&lane->main_mark, cudaEventDisableTiming), "event"));
      RETURN_IF_ERROR(Check(cudaEventCreateWithFlags(&lane->end, cudaEventDisableTiming), "event"));
      m.Describe(Address(pool_), &lane->buffers);
      lanes_.push_back(std::move(lane));
    }
    for (int k = 0; k < lg.lanes; ++k) {
      lanes_[k]->thread = std::thread([this, k] { HostDoorbellLoop(k); });
    }
    return Check(cudaStreamSynchronize(release_), "lane initialisation");
  }

  // A step's layer on its lane's stream, once its doorbell let it go: the
  // bucket's graph (the first layer plans, the rest reuse the plan), then
  // one batch of writes: `completion` and the lane's progress word.
  absl::Status EnqueueLayer(CudaLane& lane, const StepLaunch& launch, int layer,
                            uint64_t completion) {
    const uint64_t value = launch.base + static_cast<uint64_t>(layer) + 1;
    RETURN_IF_ERROR(Replay(lane.memory, lane.graphs, launch.shape, launch.graph, layer > 0));
    return Memop(kernels::StreamWriteValues64(
        lane.memory.stream, {{completion, value}, {lane.progress_device, value}}));
  }

  // Host doorbells: the lane's thread waits for each ring on the host slot
  // and launches the layer; the GPU writes the completion into the slot.
  void HostDoorbellLoop(int index) {
    CudaLane& lane = *lanes_[index];
    while (true) {
      StepLaunch launch;
      {
        absl::MutexLock lock(&lane.mu);
        lane.mu.Await(absl::Condition(
            +[](CudaLane* l) ABSL_NO_THREAD_SAFETY_ANALYSIS { return l->has_step || l->stop; },
            &lane));
        if (lane.stop) return;
        launch = lane.launch;
      }
      absl::Status status = BindThread();
      const HostSlot doorbell(reinterpret_cast<void*>(launch.doorbell));
      const uint64_t last = launch.base + static_cast<uint64_t>(launch.layers);
      const auto ended = [&lane] { return lane.end_value.load() != 0; };
      int layer = 0;
      for (; layer < launch.layers && status.ok(); ++layer) {
        const uint64_t value = launch.base + static_cast<uint64_t>(layer) + 1;
        // (Returns below `value` only once ended.)
        doorbell.WaitAtLeast(value, absl::Microseconds(50), absl::InfiniteFuture(), ended,
                             absl::Milliseconds(2));
        // Ended by the server (or the device going): the layers left are
        // not run. (A ring past the last layer rings every layer, as a GPU
        // doorbell does.)
        if (ended()) break;
        status = EnqueueLayer(lane, launch, layer, launch.completion_device);
      }
      if (layer < launch.layers || !status.ok()) {
        // Ended early, or a launch failed: once what was launched ran (or
        // failed), the completion's end value, stored from here with a wake,
        // so every wait of the scheduler passes.
        cudaStreamSynchronize(lane.memory.stream);
        const uint64_t end = lane.end_value.load() != 0 ? lane.end_value.load() : last + 1;
        HostSlot(reinterpret_cast<void*>(launch.completion)).Store(end);
      }
      // Recorded whatever happened: "drained" must not come before the
      // launched layers ran.
      const absl::Status recorded = Check(cudaEventRecord(lane.end, lane.memory.stream), "event");
      if (status.ok()) status = recorded;
      if (!status.ok()) spdlog::error("{}: step lane {}: {}", name_, index, status.ToString());
      {
        absl::MutexLock lock(&lane.mu);
        lane.has_step = false;
        lane.error = status;
      }
      lane.thread_done.store(true);
    }
  }

  kernels::KvPoolView View() const {
    return kernels::KvPoolView{static_cast<Bf16*>(pool_), g_.num_layers, g_.num_pages, g_.page_size,
                               g_.kv_dtype};
  }

  const int32_t* TableAt(int64_t offset) const {
    return static_cast<const int32_t*>(main_.table) + offset;
  }

  kernels::GatherParams Gather(const LaunchMemory& m, int capacity, int row_blocks) const {
    kernels::GatherParams p{};
    p.slots = At<const uint8_t>(m.slots);
    p.slot_bytes = m.slot_bytes;
    p.num_slots = m.num_slots;
    p.cursor = static_cast<int32_t*>(m.counters);
    p.list = static_cast<kernels::CopyListHeader*>(m.list);
    p.capacity = std::max(1, capacity);
    p.row_blocks = row_blocks;
    p.stamps = m.stamps;
    return p;
  }

  // A pool operation's start: its slot's gather (page-table writes).
  absl::Status BeginOp(int slot, int gather_count) {
    RETURN_IF_ERROR(BindThread());
    RETURN_IF_ERROR(Check(cudaEventRecord(start_[slot], main_.stream), "cudaEventRecord"));
    return kernels::LaunchGatherCopies(Gather(main_, gather_count, 1), main_.stream);
  }

  // Records the launch sequence of `shape` over `m` (both plan variants).
  absl::Status Capture(const LaunchMemory& m, BatchShape shape,
                       std::map<GraphKey, cudaGraphExec_t>* graphs) {
    for (const bool reuse : {false, true}) {
      RETURN_IF_ERROR(Check(cudaStreamBeginCapture(m.stream, cudaStreamCaptureModeThreadLocal),
                            "cudaStreamBeginCapture"));
      const absl::Status enqueued = EnqueueBatch(m, shape, reuse);
      cudaGraph_t graph = nullptr;
      const cudaError_t ended = cudaStreamEndCapture(m.stream, &graph);
      RETURN_IF_ERROR(enqueued);
      RETURN_IF_ERROR(Check(ended, "cudaStreamEndCapture"));
      cudaGraphExec_t exec = nullptr;
      const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      RETURN_IF_ERROR(Check(instantiated, "cudaGraphInstantiate"));
      (*graphs)[Key(shape, reuse)] = exec;
    }
    return absl::OkStatus();
  }

  // A batch of `shape` over `m`: its captured graph, or eagerly.
  absl::Status Replay(const LaunchMemory& m, const std::map<GraphKey, cudaGraphExec_t>& graphs,
                      BatchShape shape, bool graph, bool reuse_plan) {
    if (!graph) return EnqueueBatch(m, shape, reuse_plan);
    const auto it = graphs.find(Key(shape, reuse_plan));
    if (it == graphs.end()) {
      return absl::InternalError(absl::StrCat(name_, ": no graph was captured for batch ",
                                              shape.batch, " x draft ", shape.draft_len));
    }
    return Check(cudaGraphLaunch(it->second, m.stream), "cudaGraphLaunch");
  }

  // The launch sequence of one batch of `shape` on m's stream.
  absl::Status EnqueueBatch(const LaunchMemory& m, BatchShape shape, bool reuse_plan) {
    const int row_blocks = CopyRowBlocks(shape.draft_len);
    RETURN_IF_ERROR(kernels::LaunchGatherCopies(
        Gather(m, GatherCapacity(shape, g_.page_size, g_.max_batch), row_blocks), m.stream));
    const uint64_t requests = Address(m.requests);
    const RequestArraysLayout& r = g_.slot.requests;
    const int32_t* table = static_cast<const int32_t*>(m.table);
    if (m.draft_kv != nullptr) {
      // fp8 pool: the gather left the draft rows in the draft buffer; they
      // enter the pool quantized, and the attention reads them as stored.
      kernels::DraftKvWriteArguments w;
      w.batch = shape.batch;
      w.total_draft_capacity = shape.rows();
      w.draft_kv = static_cast<const Bf16*>(m.draft_kv);
      w.pool = View();
      w.page_table = table;
      w.page_table_stride = 1;  // unused: every request has its offset
      w.page_table_offset = At<const int64_t>(requests, r.table_offset);
      w.prefix_len = At<const int32_t>(requests, r.prefix_len);
      w.draft_len = At<const int32_t>(requests, r.draft_len);
      w.layer = At<const int32_t>(requests, r.layer);
      RETURN_IF_ERROR(kernels::LaunchWriteDraftKv(w, m.stream));
    }
    kernels::VerifyArguments a;
    a.batch = shape.batch;
    a.num_heads = g_.num_heads;
    a.max_draft_len = shape.draft_len;
    a.total_draft_capacity = shape.rows();
    a.q = static_cast<const Bf16*>(m.q);
    a.q_token_stride = static_cast<int64_t>(g_.num_heads) * kLatentDim;
    a.q_head_stride = kLatentDim;
    a.pool = View();
    a.page_table = table;
    a.page_table_stride = 1;  // unused: every request has its offset
    a.page_table_offset = At<const int64_t>(requests, r.table_offset);
    a.prefix_len = At<const int32_t>(requests, r.prefix_len);
    a.draft_len = At<const int32_t>(requests, r.draft_len);
    a.layer = At<const int32_t>(requests, r.layer);
    a.softmax_scale = At<const float>(requests, r.scale);
    a.default_softmax_scale = 1.0f;  // unused: every request carries its scale
    a.visibility = static_cast<const uint64_t*>(m.visibility);
    a.out = static_cast<Bf16*>(m.out);
    a.out_token_stride = static_cast<int64_t>(g_.num_heads) * kValueDim;
    a.out_head_stride = kValueDim;
    a.lse = static_cast<float*>(m.lse);
    kernels::VerifyLaunchConfig config = config_;
    config.reuse_plan = reuse_plan;
    RETURN_IF_ERROR(
        kernels::LaunchVerifyAttention(a, config, m.workspace, m.workspace_bytes, m.stream));
    kernels::ScatterParams s{};
    s.list = static_cast<const kernels::CopyListHeader*>(m.outputs);
    s.capacity = ScatterCapacity(shape);
    s.row_blocks = row_blocks;
    s.stamps = m.stamps;
    s.cursor = static_cast<const int32_t*>(m.counters);
    s.num_slots = m.num_slots;
    return kernels::LaunchScatterCopies(s, m.stream);
  }

  // Threading (device.h): Init, CaptureGraphs, Launch*, ReadRows and
  // UploadTable run under the worker's launch lock (DeviceWorker::launch_mu_,
  // one launcher at a time); Finished and Wait, on the completion thread,
  // read only start_ and stop_, fixed once Init returned; the memory
  // functions (PinHost ... FreeHostStaging) read only the constants. The
  // lanes' step state is atomics or under each lane's locks: LaunchStep
  // (the launcher), a host-doorbell lane's thread, and EndLane,
  // lane_progress and lane_timings (the engine's step runner) share it.
  const int ordinal_;
  const std::string name_;
  LaneGate& gate_ = ProcessLaneGate();
  const CudaDeviceOptions options_;
  DeviceGeometry g_;
  DeviceBuffers buffers_;
  kernels::VerifyLaunchConfig config_;
  LaunchMemory main_;  // its stream runs every launch but the lanes', in order
  void* pool_ = nullptr;
  uint8_t* slots_ = nullptr;  // host view
  std::vector<cudaEvent_t> start_, stop_;
  std::map<GraphKey, cudaGraphExec_t> graphs_;
  void* read_dev_ = nullptr;
  void* read_host_ = nullptr;
  void* upload_host_ = nullptr;
  int launches_ = 0;
  // Device-driven steps.
  absl::Status memops_ = absl::UnavailableError("no step lanes");
  cudaStream_t release_ = nullptr;  // EndLane's doorbell writes; never waits
  DoorbellArena arena_;
  std::vector<std::unique_ptr<CudaLane>> lanes_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int ordinal,
                                                       const CudaDeviceOptions& options) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    return absl::UnavailableError(absl::StrCat(
        "no CUDA device: ", err != cudaSuccess ? cudaGetErrorString(err) : "device count is 0"));
  }
  if (ordinal < 0 || ordinal >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", ordinal, " requested; this machine has ", count));
  }
  return std::unique_ptr<Device>(new CudaDevice(ordinal, options));
}

}  // namespace mlaverify::engine
