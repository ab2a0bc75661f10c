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
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/geometry.h"
#include "common/status_macros.h"
#include "kernels/copy_list.h"
#include "kernels/device_fault.h"
#include "kernels/verify_attention_cuda.h"
#include "server/engine/device.h"

namespace mlaverify::engine {
namespace {

// ReadRows' chunk (tests only): device rows, copied back through pinned memory.
constexpr size_t kReadChunkBytes = size_t{32} << 20;

template <typename T>
T* At(uint64_t address, size_t offset = 0) {
  return reinterpret_cast<T*>(address + offset);
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, const CudaDeviceOptions& options)
      : ordinal_(ordinal), name_(absl::StrCat("cuda:", ordinal)), options_(options) {}

  ~CudaDevice() override {
    // Errors are ignored: after a sticky fault every call fails, and the
    // process is on its way out.
    cudaSetDevice(ordinal_);
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    for (cudaEvent_t e : start_) cudaEventDestroy(e);
    for (cudaEvent_t e : stop_) cudaEventDestroy(e);
    cudaFreeHost(slots_);
    cudaFreeHost(read_host_);
    cudaFreeHost(upload_host_);
    for (void* p : {pool_, table_, q_, out_, lse_, requests_, visibility_, outputs_, counters_,
                    list_, workspace_, read_dev_, draft_kv_}) {
      cudaFree(p);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
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
    RETURN_IF_ERROR(Check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream"));
    const size_t rows = static_cast<size_t>(g.max_batch) * g.max_draft_len;
    const size_t pool_bytes =
        static_cast<size_t>(g.num_layers) * g.num_pages * g.page_size * KvRowBytes(g.kv_dtype);
    RETURN_IF_ERROR(Check(cudaMalloc(&pool_, pool_bytes), "pool allocation"));
    RETURN_IF_ERROR(Allocate(&table_, static_cast<size_t>(g.table_entries) * sizeof(int32_t),
                             "page-table arena"));
    RETURN_IF_ERROR(Allocate(&q_, rows * g.num_heads * kLatentRowBytes, "query buffer"));
    if (g.kv_dtype != KvDtype::kBf16) {
      // The batch's draft rows before quantization (device_worker.cc gathers them here).
      RETURN_IF_ERROR(Allocate(&draft_kv_, rows * kLatentRowBytes, "draft row buffer"));
    }
    RETURN_IF_ERROR(Allocate(&out_, rows * g.num_heads * kValueDim * sizeof(Bf16), "out buffer"));
    RETURN_IF_ERROR(Allocate(&lse_, rows * g.num_heads * sizeof(float), "lse buffer"));
    RETURN_IF_ERROR(Allocate(&requests_, g.slot.requests.bytes, "request arrays"));
    RETURN_IF_ERROR(Allocate(&visibility_, rows * sizeof(uint64_t), "visibility words"));
    RETURN_IF_ERROR(
        Allocate(&outputs_, kernels::CopyListBytes(g.slot.output_capacity), "output list"));
    RETURN_IF_ERROR(Allocate(&counters_, 2 * sizeof(int32_t), "gather cursor"));
    RETURN_IF_ERROR(Allocate(&list_, kernels::CopyListBytes(g.slot.list_capacity), "gather list"));
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
    start_.resize(g.slots);
    stop_.resize(g.slots);
    for (int k = 0; k < g.slots; ++k) {
      RETURN_IF_ERROR(Check(cudaEventCreate(&start_[k]), "event"));
      RETURN_IF_ERROR(Check(cudaEventCreate(&stop_[k]), "event"));
    }
    kernels::VerifyArguments shape;
    shape.batch = g.max_batch;
    shape.num_heads = g.num_heads;
    shape.max_draft_len = g.max_draft_len;
    workspace_bytes_ = kernels::VerifyWorkspaceBytes(shape, config_);
    RETURN_IF_ERROR(Check(cudaMalloc(&workspace_, workspace_bytes_), "workspace"));
    RETURN_IF_ERROR(
        kernels::InitVerifyWorkspace(shape, config_, workspace_, workspace_bytes_, stream_));
    buffers_.pool = Address(pool_);
    if (draft_kv_ != nullptr) buffers_.draft_kv = Address(draft_kv_);
    buffers_.table = Address(table_);
    buffers_.q = Address(q_);
    buffers_.out = Address(out_);
    buffers_.lse = Address(lse_);
    buffers_.requests = Address(requests_);
    buffers_.visibility = Address(visibility_);
    buffers_.outputs = Address(outputs_);
    buffers_.slots = Address(slots_device);
    return Check(cudaStreamSynchronize(stream_), "initialisation");
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
    for (const bool reuse : {false, true}) {
      RETURN_IF_ERROR(Check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal),
                            "cudaStreamBeginCapture"));
      const absl::Status enqueued = EnqueueBatch(shape, reuse);
      cudaGraph_t graph = nullptr;
      const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
      RETURN_IF_ERROR(enqueued);
      RETURN_IF_ERROR(Check(ended, "cudaStreamEndCapture"));
      cudaGraphExec_t exec = nullptr;
      const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      RETURN_IF_ERROR(Check(instantiated, "cudaGraphInstantiate"));
      graphs_[Key(shape, reuse)] = exec;
    }
    RETURN_IF_ERROR(Check(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo"));
    return free_before > free_after ? static_cast<int64_t>(free_before - free_after) : 0;
  }

  absl::Status Launch(const LaunchOptions& o) override {
    // Launchers are whichever thread holds the worker's launch lock.
    RETURN_IF_ERROR(BindThread());
    ++launches_;
    if (options_.fail_after_launches > 0 && launches_ == options_.fail_after_launches) {
      RETURN_IF_ERROR(Check(kernels::LaunchTrapKernel(stream_), "fault injection"));
    }
    RETURN_IF_ERROR(Check(cudaEventRecord(start_[o.slot], stream_), "cudaEventRecord"));
    if (o.graph) {
      const auto it = graphs_.find(Key(o.shape, o.reuse_plan));
      if (it == graphs_.end()) {
        return absl::InternalError(absl::StrCat(name_, ": no graph was captured for batch ",
                                                o.shape.batch, " x draft ", o.shape.draft_len));
      }
      RETURN_IF_ERROR(Check(cudaGraphLaunch(it->second, stream_), "cudaGraphLaunch"));
    } else {
      RETURN_IF_ERROR(EnqueueBatch(o.shape, o.reuse_plan));
    }
    return Check(cudaEventRecord(stop_[o.slot], stream_), "cudaEventRecord");
  }

  absl::Status LaunchWriteRows(int slot, int gather_count, int64_t table_offset, int64_t start,
                               int64_t count, uint64_t rows) override {
    RETURN_IF_ERROR(BeginOp(slot, gather_count));
    // Rows read in place: page-locked host memory (a region, the staging)
    // across PCIe, or device memory.
    RETURN_IF_ERROR(kernels::LaunchCopyRows(View(), TableAt(table_offset), start, count,
                                            At<Bf16>(rows), /*to_pool=*/true, stream_));
    return Check(cudaEventRecord(stop_[slot], stream_), "cudaEventRecord");
  }

  absl::Status LaunchCompact(int slot, int gather_count, int64_t table_offset) override {
    RETURN_IF_ERROR(BeginOp(slot, gather_count));
    // The path is read in place from the slot's op area (mapped memory).
    const uint64_t op = buffers_.slots + static_cast<uint64_t>(slot) * g_.slot.bytes + g_.slot.op;
    kernels::CompactArguments c;
    c.batch = 1;
    c.pool = View();
    c.page_table = TableAt(table_offset);
    c.page_table_stride = std::max<int64_t>(1, g_.table_entries - table_offset);
    c.prefix_len = At<const int32_t>(op);
    c.accepted_len = At<const int32_t>(op, sizeof(int32_t));
    c.accepted = At<const int32_t>(op, 2 * sizeof(int32_t));
    RETURN_IF_ERROR(kernels::LaunchCompactAcceptedKv(c, stream_));
    return Check(cudaEventRecord(stop_[slot], stream_), "cudaEventRecord");
  }

  absl::Status LaunchGather(int slot, int gather_count) override {
    RETURN_IF_ERROR(BeginOp(slot, gather_count));
    return Check(cudaEventRecord(stop_[slot], stream_), "cudaEventRecord");
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
                                              stream_));
      const size_t bytes = static_cast<size_t>(layers * chunk * row_bytes);
      RETURN_IF_ERROR(
          Check(cudaMemcpyAsync(read_host_, read_dev_, bytes, cudaMemcpyDeviceToHost, stream_),
                "row download"));
      RETURN_IF_ERROR(Check(cudaStreamSynchronize(stream_), "row download"));
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
    RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(table_, upload_host_, bytes, cudaMemcpyHostToDevice, stream_),
              "table upload"));
    // Rare (a compacted arena): the buffer is reused only once this is done.
    return Check(cudaStreamSynchronize(stream_), "table upload");
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
    if (!BindThread().ok() || cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
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
    if (!BindThread().ok() || cudaIpcCloseMemHandle(At<void>(address)) != cudaSuccess) {
      cudaGetLastError();
    }
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

 private:
  using GraphKey = std::tuple<int, int, bool>;  // batch, draft, reuse_plan

  static GraphKey Key(BatchShape shape, bool reuse) {
    return {shape.batch, shape.draft_len, reuse};
  }
  static uint64_t Address(const void* p) { return reinterpret_cast<uint64_t>(p); }

  absl::Status Check(cudaError_t err, const char* what) const {
    if (err == cudaSuccess) return absl::OkStatus();
    return absl::InternalError(absl::StrCat(name_, ": CUDA ", what, ": ", cudaGetErrorString(err)));
  }

  absl::Status Allocate(void** p, size_t bytes, const char* what) {
    RETURN_IF_ERROR(Check(cudaMalloc(p, std::max<size_t>(bytes, 16)), what));
    return Check(cudaMemsetAsync(*p, 0, std::max<size_t>(bytes, 16), stream_), what);
  }

  kernels::KvPoolView View() const {
    return kernels::KvPoolView{static_cast<Bf16*>(pool_), g_.num_layers, g_.num_pages, g_.page_size,
                               g_.kv_dtype};
  }

  const int32_t* TableAt(int64_t offset) const {
    return static_cast<const int32_t*>(table_) + offset;
  }

  kernels::GatherParams Gather(int capacity, int row_blocks) const {
    kernels::GatherParams p{};
    p.slots = At<const uint8_t>(buffers_.slots);
    p.slot_bytes = g_.slot.bytes;
    p.num_slots = g_.slots;
    p.cursor = static_cast<int32_t*>(counters_);
    p.list = static_cast<kernels::CopyListHeader*>(list_);
    p.capacity = std::max(1, capacity);
    p.row_blocks = row_blocks;
    return p;
  }

  // A pool operation's start: its slot's gather (page-table writes).
  absl::Status BeginOp(int slot, int gather_count) {
    RETURN_IF_ERROR(BindThread());
    RETURN_IF_ERROR(Check(cudaEventRecord(start_[slot], stream_), "cudaEventRecord"));
    return kernels::LaunchGatherCopies(Gather(gather_count, 1), stream_);
  }

  // The launch sequence of one batch of `shape` on the compute stream.
  absl::Status EnqueueBatch(BatchShape shape, bool reuse_plan) {
    const int row_blocks = CopyRowBlocks(shape.draft_len);
    RETURN_IF_ERROR(kernels::LaunchGatherCopies(
        Gather(GatherCapacity(shape, g_.page_size, g_.max_batch), row_blocks), stream_));
    const RequestArraysLayout& r = g_.slot.requests;
    if (draft_kv_ != nullptr) {
      // fp8 pool: the gather left the draft rows in the draft buffer; they
      // enter the pool quantized, and the attention reads them as stored.
      kernels::DraftKvWriteArguments w;
      w.batch = shape.batch;
      w.total_draft_capacity = shape.rows();
      w.draft_kv = static_cast<const Bf16*>(draft_kv_);
      w.pool = View();
      w.page_table = static_cast<const int32_t*>(table_);
      w.page_table_stride = 1;  // unused: every request has its offset
      w.page_table_offset = At<const int64_t>(buffers_.requests, r.table_offset);
      w.prefix_len = At<const int32_t>(buffers_.requests, r.prefix_len);
      w.draft_len = At<const int32_t>(buffers_.requests, r.draft_len);
      w.layer = At<const int32_t>(buffers_.requests, r.layer);
      RETURN_IF_ERROR(kernels::LaunchWriteDraftKv(w, stream_));
    }
    kernels::VerifyArguments a;
    a.batch = shape.batch;
    a.num_heads = g_.num_heads;
    a.max_draft_len = shape.draft_len;
    a.total_draft_capacity = shape.rows();
    a.q = static_cast<const Bf16*>(q_);
    a.q_token_stride = static_cast<int64_t>(g_.num_heads) * kLatentDim;
    a.q_head_stride = kLatentDim;
    a.pool = View();
    a.page_table = static_cast<const int32_t*>(table_);
    a.page_table_stride = 1;  // unused: every request has its offset
    a.page_table_offset = At<const int64_t>(buffers_.requests, r.table_offset);
    a.prefix_len = At<const int32_t>(buffers_.requests, r.prefix_len);
    a.draft_len = At<const int32_t>(buffers_.requests, r.draft_len);
    a.layer = At<const int32_t>(buffers_.requests, r.layer);
    a.softmax_scale = At<const float>(buffers_.requests, r.scale);
    a.default_softmax_scale = 1.0f;  // unused: every request carries its scale
    a.visibility = static_cast<const uint64_t*>(visibility_);
    a.out = static_cast<Bf16*>(out_);
    a.out_token_stride = static_cast<int64_t>(g_.num_heads) * kValueDim;
    a.out_head_stride = kValueDim;
    a.lse = static_cast<float*>(lse_);
    kernels::VerifyLaunchConfig config = config_;
    config.reuse_plan = reuse_plan;
    RETURN_IF_ERROR(
        kernels::LaunchVerifyAttention(a, config, workspace_, workspace_bytes_, stream_));
    kernels::ScatterParams s{};
    s.list = static_cast<const kernels::CopyListHeader*>(outputs_);
    s.capacity = ScatterCapacity(shape);
    s.row_blocks = row_blocks;
    return kernels::LaunchScatterCopies(s, stream_);
  }

  // Threading (device.h): the members below the constants are the launcher's.
  // Init, CaptureGraphs, Launch*, ReadRows and UploadTable run under the
  // worker's launch lock (DeviceWorker::launch_mu_, one launcher at a time);
  // Finished and Wait, on the completion thread, read only start_ and stop_,
  // fixed once Init returned; the memory functions (PinHost ... FreeHostStaging)
  // read only the constants. So this class holds no lock of its own, and
  // clang's analysis has nothing to check here beyond what it checks in
  // device_worker.cc.
  const int ordinal_;
  const std::string name_;
  const CudaDeviceOptions options_;
  DeviceGeometry g_;
  DeviceBuffers buffers_;
  kernels::VerifyLaunchConfig config_;
  cudaStream_t stream_ = nullptr;  // every launch, in order
  void* pool_ = nullptr;
  void* table_ = nullptr;
  void* q_ = nullptr;
  void* draft_kv_ = nullptr;  // fp8 pools only: the batch's draft rows before quantization
  void* out_ = nullptr;
  void* lse_ = nullptr;
  void* requests_ = nullptr;
  void* visibility_ = nullptr;
  void* outputs_ = nullptr;
  void* counters_ = nullptr;  // the gather's cursor
  void* list_ = nullptr;      // the gather's list, fetched from the slot
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  uint8_t* slots_ = nullptr;  // host view
  std::vector<cudaEvent_t> start_, stop_;
  std::map<GraphKey, cudaGraphExec_t> graphs_;
  void* read_dev_ = nullptr;
  void* read_host_ = nullptr;
  void* upload_host_ = nullptr;
  int launches_ = 0;
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
