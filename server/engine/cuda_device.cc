// CudaDevice: one GPU's KV pool replica and the launches of its verify
// batches. Everything a batch needs sits at fixed addresses, allocated once at
// Init: per staging set a pinned host input region (write-combined: the host
// only writes it) and its device mirror, a pinned host output region, one
// attention workspace, the pool. A batch of shape (B, N) is one host-to-device
// copy of its packed inputs, the draft-row write, the attention (plan,
// attention, combine) writing its outputs straight into the pinned host
// output region (mapped memory; or, with direct_output off, into a device
// buffer and one device-to-host copy), all on the compute stream.
// CaptureGraphs records that sequence as CUDA graphs per (staging set, shape):
// the whole sequence, for a batch launched on an idle device, and for a batch
// launched while the previous one runs, its input copy (replayed on a copy
// stream, overlapped with the running batch) apart from the rest (replayed on
// the compute stream once both are done); each with and without the plan
// kernel. Lengths, page tables and trees are read from device memory, so one
// graph serves every prefix length. Eager launches issue the same sequence
// directly.
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
#include "kernels/device_fault.h"
#include "kernels/verify_attention_cuda.h"
#include "server/engine/device.h"

namespace mlaverify::engine {
namespace {

// Pinned staging for AppendKv / ReadKv rows, two buffers so that the host copy
// of one chunk overlaps the device's copy of the previous one.
constexpr size_t kRowChunkBytes = size_t{32} << 20;

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, const CudaDeviceOptions& options)
      : ordinal_(ordinal), name_(absl::StrCat("cuda:", ordinal)), options_(options) {}

  ~CudaDevice() override {
    // Errors are ignored: after a sticky fault every call fails, and the
    // process is on its way out.
    cudaSetDevice(ordinal_);
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    for (StagingSet& s : sets_) {
      cudaFreeHost(s.host_in);
      cudaFreeHost(s.host_out);
      cudaFree(s.dev_in);
      cudaFree(s.dev_out);
      if (s.start != nullptr) cudaEventDestroy(s.start);
      if (s.stop != nullptr) cudaEventDestroy(s.stop);
      if (s.input_done != nullptr) cudaEventDestroy(s.input_done);
    }
    for (int i = 0; i < 2; ++i) {
      cudaFreeHost(row_host_[i]);
      cudaFree(row_dev_[i]);
      if (row_done_[i] != nullptr) cudaEventDestroy(row_done_[i]);
    }
    cudaFreeHost(small_host_);
    cudaFree(small_dev_);
    cudaFree(workspace_);
    cudaFree(pool_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
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
    RETURN_IF_ERROR(
        Check(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking), "stream"));
    const size_t pool_bytes =
        static_cast<size_t>(g.num_layers) * g.num_pages * g.page_size * kLatentRowBytes;
    RETURN_IF_ERROR(Check(cudaMalloc(&pool_, pool_bytes), "pool allocation"));
    const StagingLayout max =
        StagingLayout::For({g.max_batch, g.max_draft_len}, g.num_heads, g.max_pages_per_sequence);
    sets_.resize(g.staging_sets);
    for (StagingSet& s : sets_) {
      // Write-combined: the host only writes the inputs, and the device reads
      // such memory faster over PCIe.
      RETURN_IF_ERROR(Check(cudaHostAlloc(&s.host_in, max.input_bytes, cudaHostAllocWriteCombined),
                            "pinned staging"));
      RETURN_IF_ERROR(Check(
          cudaHostAlloc(&s.host_out, max.output_bytes, cudaHostAllocMapped | cudaHostAllocPortable),
          "pinned staging"));
      RETURN_IF_ERROR(Check(cudaHostGetDevicePointer(&s.host_out_on_device, s.host_out, 0),
                            "cudaHostGetDevicePointer"));
      RETURN_IF_ERROR(Check(cudaMalloc(&s.dev_in, max.input_bytes), "input buffers"));
      if (!options_.direct_output) {
        RETURN_IF_ERROR(Check(cudaMalloc(&s.dev_out, max.output_bytes), "output buffers"));
      }
      RETURN_IF_ERROR(Check(cudaEventCreate(&s.start), "event"));
      RETURN_IF_ERROR(Check(cudaEventCreate(&s.stop), "event"));
      RETURN_IF_ERROR(
          Check(cudaEventCreateWithFlags(&s.input_done, cudaEventDisableTiming), "event"));
      // All padding until a batch is packed: a stray replay reads nothing.
      std::memset(s.host_in, 0, max.input_bytes);
      RETURN_IF_ERROR(Check(cudaMemset(s.dev_in, 0, max.input_bytes), "input buffers"));
    }
    kernels::VerifyArguments shape;
    shape.batch = g.max_batch;
    shape.num_heads = g.num_heads;
    shape.max_draft_len = g.max_draft_len;
    workspace_bytes_ = kernels::VerifyWorkspaceBytes(shape, config_);
    RETURN_IF_ERROR(Check(cudaMalloc(&workspace_, workspace_bytes_), "workspace"));
    RETURN_IF_ERROR(
        kernels::InitVerifyWorkspace(shape, config_, workspace_, workspace_bytes_, stream_));
    for (int i = 0; i < 2; ++i) {
      RETURN_IF_ERROR(
          Check(cudaHostAlloc(&row_host_[i], kRowChunkBytes, cudaHostAllocDefault), "row staging"));
      RETURN_IF_ERROR(Check(cudaMalloc(&row_dev_[i], kRowChunkBytes), "row staging"));
      RETURN_IF_ERROR(
          Check(cudaEventCreateWithFlags(&row_done_[i], cudaEventDisableTiming), "event"));
    }
    // A sequence's page list, then a compaction's [prefix, k, path...].
    small_bytes_ =
        (static_cast<size_t>(g.max_pages_per_sequence) + kMaxDraftLen + 2) * sizeof(int32_t);
    RETURN_IF_ERROR(
        Check(cudaHostAlloc(&small_host_, small_bytes_, cudaHostAllocDefault), "pinned staging"));
    RETURN_IF_ERROR(Check(cudaMalloc(&small_dev_, small_bytes_), "page table buffer"));
    return Check(cudaStreamSynchronize(stream_), "initialisation");
  }

  bool SupportsGraphs() const override { return true; }

  absl::StatusOr<int64_t> CaptureGraphs(int set, BatchShape shape) override {
    size_t free_before = 0, free_after = 0, total = 0;
    RETURN_IF_ERROR(Check(cudaMemGetInfo(&free_before, &total), "cudaMemGetInfo"));
    for (const Part part : {Part::kWhole, Part::kAfterInput, Part::kInput}) {
      for (const bool reuse : {false, true}) {
        if (part == Part::kInput && reuse) continue;  // the copy has no plan
        cudaStream_t stream = part == Part::kInput ? copy_stream_ : stream_;
        RETURN_IF_ERROR(Check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
                              "cudaStreamBeginCapture"));
        const absl::Status enqueued = Enqueue(set, shape, reuse, part, stream);
        cudaGraph_t graph = nullptr;
        const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
        RETURN_IF_ERROR(enqueued);
        RETURN_IF_ERROR(Check(ended, "cudaStreamEndCapture"));
        cudaGraphExec_t exec = nullptr;
        const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
        cudaGraphDestroy(graph);
        RETURN_IF_ERROR(Check(instantiated, "cudaGraphInstantiate"));
        graphs_[Key(set, shape, reuse, part)] = exec;
      }
    }
    RETURN_IF_ERROR(Check(cudaMemGetInfo(&free_after, &total), "cudaMemGetInfo"));
    return free_before > free_after ? static_cast<int64_t>(free_before - free_after) : 0;
  }

  StagingView Staging(int set, BatchShape shape) override {
    StagingView v;
    v.layout = StagingLayout::For(shape, g_.num_heads, g_.max_pages_per_sequence);
    v.input = static_cast<uint8_t*>(sets_[set].host_in);
    v.output = static_cast<uint8_t*>(sets_[set].host_out);
    return v;
  }

  absl::Status Launch(const LaunchOptions& o) override {
    StagingSet& s = sets_[o.set];
    ++launches_;
    if (options_.fail_after_launches > 0 && launches_ == options_.fail_after_launches) {
      RETURN_IF_ERROR(Check(kernels::LaunchTrapKernel(stream_), "fault injection"));
    }
    if (!o.inputs_from_device.empty() || !o.outputs_to_device.empty()) {
      // Some shards' tensors are in a client's device memory: the staged
      // inputs go up (the input-copy graph), those shards' q/draft_kv rows
      // are copied over them device to device, the kernels run (the
      // after-input graph), then their out/lse rows are copied to the
      // client; all on the compute stream, so the stop event (and Wait)
      // follows the last copy.
      RETURN_IF_ERROR(Check(cudaEventRecord(s.start, stream_), "cudaEventRecord"));
      RETURN_IF_ERROR(Replay(o, Part::kInput, stream_));
      auto* in = static_cast<uint8_t*>(s.dev_in);
      for (const DeviceCopy& c : o.inputs_from_device) {
        RETURN_IF_ERROR(
            Check(cudaMemcpy2DAsync(in + c.staging_offset, c.staging_pitch, c.other, c.other_pitch,
                                    c.width, c.rows, cudaMemcpyDefault, stream_),
                  "input copy from device memory"));
      }
      RETURN_IF_ERROR(Replay(o, Part::kAfterInput, stream_));
      auto* out = static_cast<uint8_t*>(options_.direct_output ? s.host_out_on_device : s.dev_out);
      for (const DeviceCopy& c : o.outputs_to_device) {
        RETURN_IF_ERROR(
            Check(cudaMemcpy2DAsync(c.other, c.other_pitch, out + c.staging_offset, c.staging_pitch,
                                    c.width, c.rows, cudaMemcpyDefault, stream_),
                  "output copy to device memory"));
      }
      return Check(cudaEventRecord(s.stop, stream_), "cudaEventRecord");
    }
    if (o.overlap_input) {
      // The input copy runs on the copy stream beside the running batch;
      // the kernels follow it and that batch (stream order) on the compute
      // stream. The device time counted is the kernels' alone (the copy
      // overlapped, and the wait for the previous batch is not this one's).
      RETURN_IF_ERROR(Replay(o, Part::kInput, copy_stream_));
      RETURN_IF_ERROR(Check(cudaEventRecord(s.input_done, copy_stream_), "cudaEventRecord"));
      RETURN_IF_ERROR(Check(cudaStreamWaitEvent(stream_, s.input_done, 0), "cudaStreamWaitEvent"));
      RETURN_IF_ERROR(Check(cudaEventRecord(s.start, stream_), "cudaEventRecord"));
      RETURN_IF_ERROR(Replay(o, Part::kAfterInput, stream_));
    } else {
      // One graph for the whole batch; its device time runs from the input
      // copy to the end of the kernels.
      RETURN_IF_ERROR(Check(cudaEventRecord(s.start, stream_), "cudaEventRecord"));
      RETURN_IF_ERROR(Replay(o, Part::kWhole, stream_));
    }
    return Check(cudaEventRecord(s.stop, stream_), "cudaEventRecord");
  }

  absl::StatusOr<double> Wait(int set) override {
    StagingSet& s = sets_[set];
    RETURN_IF_ERROR(Check(cudaEventSynchronize(s.stop), "verify batch"));
    float ms = 0;
    RETURN_IF_ERROR(Check(cudaEventElapsedTime(&ms, s.start, s.stop), "cudaEventElapsedTime"));
    return ms * 1e-3;
  }

  absl::Status WriteRows(absl::Span<const int32_t> page_table, int64_t start, int64_t count,
                         const Bf16* rows) override {
    RETURN_IF_ERROR(UploadPageTable(page_table));
    const int64_t layers = g_.num_layers;
    const int64_t chunk_max = std::max<int64_t>(1, kRowChunkBytes / (layers * kLatentRowBytes));
    // Rows in page-locked memory (a pinned shared-memory region) are copied
    // by DMA straight from where they are, one strided copy per chunk: no
    // staging copy on the host, and no host wait between chunks (the stream
    // orders each chunk's copy after the previous chunk's kernel).
    cudaPointerAttributes attributes{};
    const bool pinned = cudaPointerGetAttributes(&attributes, rows) == cudaSuccess &&
                        attributes.type == cudaMemoryTypeHost;
    if (!pinned) cudaGetLastError();  // clears a failed query's error
    bool used[2] = {false, false};
    for (int64_t c0 = 0, i = 0; c0 < count; c0 += chunk_max, i ^= 1) {
      const int64_t chunk = std::min(chunk_max, count - c0);
      if (pinned) {
        const size_t run = static_cast<size_t>(chunk) * kLatentRowBytes;
        RETURN_IF_ERROR(
            Check(cudaMemcpy2DAsync(row_dev_[i], run, rows + c0 * kLatentDim,
                                    static_cast<size_t>(count) * kLatentRowBytes, run,
                                    static_cast<size_t>(layers), cudaMemcpyHostToDevice, stream_),
                  "row upload"));
        RETURN_IF_ERROR(kernels::LaunchCopyRows(View(), PageTableOnDevice(), start + c0, chunk,
                                                static_cast<Bf16*>(row_dev_[i]),
                                                /*to_pool=*/true, stream_));
        continue;
      }
      // The buffer's previous chunk must have left it before it is refilled.
      if (used[i]) RETURN_IF_ERROR(Check(cudaEventSynchronize(row_done_[i]), "row upload"));
      auto* host = static_cast<Bf16*>(row_host_[i]);
      for (int64_t layer = 0; layer < layers; ++layer) {
        std::memcpy(host + layer * chunk * kLatentDim, rows + (layer * count + c0) * kLatentDim,
                    static_cast<size_t>(chunk) * kLatentRowBytes);
      }
      const size_t bytes = static_cast<size_t>(layers * chunk) * kLatentRowBytes;
      RETURN_IF_ERROR(
          Check(cudaMemcpyAsync(row_dev_[i], host, bytes, cudaMemcpyHostToDevice, stream_),
                "row upload"));
      RETURN_IF_ERROR(kernels::LaunchCopyRows(View(), PageTableOnDevice(), start + c0, chunk,
                                              static_cast<Bf16*>(row_dev_[i]), /*to_pool=*/true,
                                              stream_));
      RETURN_IF_ERROR(Check(cudaEventRecord(row_done_[i], stream_), "cudaEventRecord"));
      used[i] = true;
    }
    return Check(cudaStreamSynchronize(stream_), "row upload");
  }

  absl::Status ReadRows(absl::Span<const int32_t> page_table, int64_t start, int64_t count,
                        Bf16* rows) override {
    RETURN_IF_ERROR(UploadPageTable(page_table));
    const int64_t layers = g_.num_layers;
    const int64_t chunk_max = std::max<int64_t>(1, kRowChunkBytes / (layers * kLatentRowBytes));
    for (int64_t c0 = 0; c0 < count; c0 += chunk_max) {
      const int64_t chunk = std::min(chunk_max, count - c0);
      RETURN_IF_ERROR(kernels::LaunchCopyRows(View(), PageTableOnDevice(), start + c0, chunk,
                                              static_cast<Bf16*>(row_dev_[0]), /*to_pool=*/false,
                                              stream_));
      const size_t bytes = static_cast<size_t>(layers * chunk) * kLatentRowBytes;
      RETURN_IF_ERROR(
          Check(cudaMemcpyAsync(row_host_[0], row_dev_[0], bytes, cudaMemcpyDeviceToHost, stream_),
                "row download"));
      RETURN_IF_ERROR(Check(cudaStreamSynchronize(stream_), "row download"));
      const auto* host = static_cast<const Bf16*>(row_host_[0]);
      for (int64_t layer = 0; layer < layers; ++layer) {
        std::memcpy(rows + (layer * count + c0) * kLatentDim, host + layer * chunk * kLatentDim,
                    static_cast<size_t>(chunk) * kLatentRowBytes);
      }
    }
    return absl::OkStatus();
  }

  absl::Status Compact(absl::Span<const int32_t> page_table, int64_t prefix_len,
                       absl::Span<const int32_t> accepted) override {
    // [page table][prefix, k, accepted[0..63]] in one upload.
    auto* host = static_cast<int32_t*>(small_host_);
    const size_t pages = page_table.size();
    std::memcpy(host, page_table.data(), pages * sizeof(int32_t));
    int32_t* path = host + g_.max_pages_per_sequence;
    std::fill(path, path + kMaxDraftLen + 2, 0);
    path[0] = static_cast<int32_t>(prefix_len);
    path[1] = static_cast<int32_t>(accepted.size());
    std::copy(accepted.begin(), accepted.end(), path + 2);
    RETURN_IF_ERROR(Check(
        cudaMemcpyAsync(small_dev_, small_host_, small_bytes_, cudaMemcpyHostToDevice, stream_),
        "path upload"));
    const int32_t* dev = static_cast<const int32_t*>(small_dev_);
    const int32_t* dev_path = dev + g_.max_pages_per_sequence;
    kernels::CompactArguments c;
    c.batch = 1;
    c.pool = View();
    c.page_table = dev;
    c.page_table_stride = std::max<int64_t>(1, static_cast<int64_t>(pages));
    c.prefix_len = dev_path;
    c.accepted_len = dev_path + 1;
    c.accepted = dev_path + 2;
    RETURN_IF_ERROR(kernels::LaunchCompactAcceptedKv(c, stream_));
    return Check(cudaStreamSynchronize(stream_), "compaction");
  }

  absl::Status PinHostMemory(void* data, size_t bytes) override {
    // On this device's context (a thread with none would create one on
    // device 0); portable: every device of the process sees it pinned.
    RETURN_IF_ERROR(BindThread());
    const cudaError_t err = cudaHostRegister(data, bytes, cudaHostRegisterPortable);
    if (err == cudaSuccess) return absl::OkStatus();
    cudaGetLastError();  // not sticky: clear it for this thread's next call
    return absl::UnavailableError(
        absl::StrCat(name_, ": cudaHostRegister of ", bytes, " bytes: ", cudaGetErrorString(err)));
  }

  void UnpinHostMemory(void* data) override {
    if (!BindThread().ok() || cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
  }

  absl::StatusOr<void*> OpenIpcMemory(absl::string_view handle) override {
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
    return data;
  }

  void CloseIpcMemory(void* data) override {
    if (!BindThread().ok() || cudaIpcCloseMemHandle(data) != cudaSuccess) cudaGetLastError();
  }

  int cuda_ordinal() const override { return ordinal_; }

 private:
  struct StagingSet {
    void* host_in = nullptr;
    void* host_out = nullptr;
    void* host_out_on_device = nullptr;  // the same memory as the device addresses it
    void* dev_in = nullptr;
    void* dev_out = nullptr;  // only without direct_output
    cudaEvent_t start = nullptr;
    cudaEvent_t stop = nullptr;
    cudaEvent_t input_done = nullptr;
  };
  // Which part of a batch's launch sequence a graph holds.
  enum class Part { kWhole, kInput, kAfterInput };
  using GraphKey = std::tuple<int, int, int, bool, Part>;  // set, batch, draft, reuse_plan, part

  static GraphKey Key(int set, BatchShape shape, bool reuse, Part part) {
    return {set, shape.batch, shape.draft_len, reuse, part};
  }

  // Replays the graph of `part` for a launch, or issues it eagerly.
  absl::Status Replay(const LaunchOptions& o, Part part, cudaStream_t stream) {
    if (!o.graph) return Enqueue(o.set, o.shape, o.reuse_plan, part, stream);
    const bool reuse = part == Part::kInput ? false : o.reuse_plan;
    const auto it = graphs_.find(Key(o.set, o.shape, reuse, part));
    if (it == graphs_.end()) {
      return absl::InternalError(absl::StrCat(name_, ": no graph was captured for batch ",
                                              o.shape.batch, " x draft ", o.shape.draft_len));
    }
    return Check(cudaGraphLaunch(it->second, stream), "cudaGraphLaunch");
  }

  absl::Status Check(cudaError_t err, const char* what) const {
    if (err == cudaSuccess) return absl::OkStatus();
    return absl::InternalError(absl::StrCat(name_, ": CUDA ", what, ": ", cudaGetErrorString(err)));
  }

  kernels::KvPoolView View() const {
    return kernels::KvPoolView{static_cast<Bf16*>(pool_), g_.num_layers, g_.num_pages,
                               g_.page_size};
  }

  const int32_t* PageTableOnDevice() const { return static_cast<const int32_t*>(small_dev_); }

  // The row operations' page list, through pinned memory (no pageable copy).
  absl::Status UploadPageTable(absl::Span<const int32_t> page_table) {
    std::memcpy(small_host_, page_table.data(), page_table.size() * sizeof(int32_t));
    return Check(cudaMemcpyAsync(small_dev_, small_host_, page_table.size() * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, stream_),
                 "page table upload");
  }

  // The launch sequence of one batch of `shape` from staging set `set`, or
  // one part of it, on `stream`.
  absl::Status Enqueue(int set, BatchShape shape, bool reuse_plan, Part part, cudaStream_t stream) {
    const StagingSet& s = sets_[set];
    const StagingLayout l = StagingLayout::For(shape, g_.num_heads, g_.max_pages_per_sequence);
    auto* in = static_cast<uint8_t*>(s.dev_in);
    auto* out = static_cast<uint8_t*>(options_.direct_output ? s.host_out_on_device : s.dev_out);
    if (part != Part::kAfterInput) {
      RETURN_IF_ERROR(
          Check(cudaMemcpyAsync(s.dev_in, s.host_in, l.input_bytes, cudaMemcpyHostToDevice, stream),
                "input upload"));
    }
    if (part == Part::kInput) return absl::OkStatus();
    const auto* prefix = reinterpret_cast<const int32_t*>(in + l.prefix_len);
    const auto* drafts = reinterpret_cast<const int32_t*>(in + l.draft_len);
    const auto* layers = reinterpret_cast<const int32_t*>(in + l.layer);
    const auto* tables = reinterpret_cast<const int32_t*>(in + l.page_tables);
    const auto* draft_kv = reinterpret_cast<const Bf16*>(in + l.draft_kv);

    kernels::DraftKvWriteArguments w;
    w.batch = shape.batch;
    w.total_draft_capacity = shape.rows();
    w.draft_kv = draft_kv;
    w.draft_kv_stride = kLatentDim;
    w.pool = View();
    w.page_table = tables;
    w.page_table_stride = l.page_table_stride;
    w.prefix_len = prefix;
    w.draft_len = drafts;
    w.layer = layers;
    RETURN_IF_ERROR(kernels::LaunchWriteDraftKv(w, stream));

    kernels::VerifyArguments a;
    a.batch = shape.batch;
    a.num_heads = g_.num_heads;
    a.max_draft_len = shape.draft_len;
    a.total_draft_capacity = shape.rows();
    a.q = reinterpret_cast<const Bf16*>(in + l.q);
    a.q_token_stride = static_cast<int64_t>(g_.num_heads) * kLatentDim;
    a.q_head_stride = kLatentDim;
    a.pool = View();
    a.page_table = tables;
    a.page_table_stride = l.page_table_stride;
    a.prefix_len = prefix;
    a.draft_len = drafts;
    a.layer = layers;
    a.softmax_scale = reinterpret_cast<const float*>(in + l.scale);
    a.default_softmax_scale = 1.0f;  // unused: every request carries its scale
    a.visibility = reinterpret_cast<const uint64_t*>(in + l.visibility);
    a.out = reinterpret_cast<Bf16*>(out + l.out);
    a.out_token_stride = static_cast<int64_t>(g_.num_heads) * kValueDim;
    a.out_head_stride = kValueDim;
    a.lse = reinterpret_cast<float*>(out + l.lse);
    kernels::VerifyLaunchConfig config = config_;
    config.reuse_plan = reuse_plan;
    RETURN_IF_ERROR(
        kernels::LaunchVerifyAttention(a, config, workspace_, workspace_bytes_, stream));
    if (options_.direct_output) return absl::OkStatus();
    return Check(
        cudaMemcpyAsync(s.host_out, s.dev_out, l.output_bytes, cudaMemcpyDeviceToHost, stream),
        "output download");
  }

  const int ordinal_;
  const std::string name_;
  const CudaDeviceOptions options_;
  DeviceGeometry g_;
  kernels::VerifyLaunchConfig config_;
  cudaStream_t stream_ = nullptr;       // the kernels, row copies, compactions
  cudaStream_t copy_stream_ = nullptr;  // overlapped input copies
  void* pool_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::vector<StagingSet> sets_;
  std::map<GraphKey, cudaGraphExec_t> graphs_;
  void* row_host_[2] = {nullptr, nullptr};
  void* row_dev_[2] = {nullptr, nullptr};
  cudaEvent_t row_done_[2] = {nullptr, nullptr};
  void* small_host_ = nullptr;
  void* small_dev_ = nullptr;
  size_t small_bytes_ = 0;
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
