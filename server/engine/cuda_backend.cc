// The CUDA backend, eager form: the pool in device memory, each engine call
// staged through fixed device buffers and run on one stream with the kernels
// of kernels/verify_attention_cuda.h. One call at a time per device (a mutex);
// CUDA graphs per bucket, cross-call batching and multi-GPU belong to the GPU
// engine that replaces this loop.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda_status.h"
#include "common/status_macros.h"
#include "kernels/verify_attention_cuda.h"
#include "server/engine/backend.h"
#include "server/engine/plan_reuse.h"
#include "spdlog/spdlog.h"

namespace mlaverify::engine {
namespace {

using mlaverify::kLatentDim;
using mlaverify::kMaxDraftLen;
using mlaverify::kValueDim;

// Staging for AppendKv / ReadKv rows; larger writes go in chunks.
constexpr size_t kRowStagingBytes = size_t{64} << 20;

using kernels::CudaErrorToStatus;

// One cudaMalloc, freed with the backend.
class DeviceAllocation {
 public:
  ~DeviceAllocation() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  absl::Status Allocate(size_t bytes, const char* what) {
    bytes_ = std::max<size_t>(bytes, 16);
    return CudaErrorToStatus(cudaMalloc(&ptr_, bytes_), what);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {}
  ~CudaBackend() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  std::string name() const override { return "cuda"; }

  std::vector<DeviceDescription> devices() const override {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, device_);
    return {{absl::StrCat(prop.name, " (device ", device_, ", sm_", prop.major, prop.minor, ")"),
             prop.totalGlobalMem}};
  }

  absl::Status Init(const PoolGeometry& g) override {
    absl::MutexLock lock(&mu_);
    g_ = g;
    ASSIGN_OR_RETURN(config_, kernels::PrepareVerifyLaunch(device_));
    RETURN_IF_ERROR(CudaErrorToStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream"));
    const size_t pool_bytes =
        static_cast<size_t>(g.num_layers) * g.num_pages * g.page_size * kLatentDim * sizeof(Bf16);
    RETURN_IF_ERROR(pool_.Allocate(pool_bytes, "pool allocation"));
    const size_t tokens = static_cast<size_t>(g.max_batch) * g.max_draft_len;
    const size_t rows = tokens * g.num_heads;
    RETURN_IF_ERROR(q_.Allocate(rows * kLatentDim * sizeof(Bf16), "q staging"));
    RETURN_IF_ERROR(draft_kv_.Allocate(tokens * kLatentDim * sizeof(Bf16), "draft staging"));
    RETURN_IF_ERROR(out_.Allocate(rows * kValueDim * sizeof(Bf16), "out staging"));
    RETURN_IF_ERROR(lse_.Allocate(rows * sizeof(float), "lse staging"));
    RETURN_IF_ERROR(visibility_.Allocate(tokens * sizeof(uint64_t), "visibility staging"));
    RETURN_IF_ERROR(requests_.Allocate(4 * g.max_batch * sizeof(int32_t), "request staging"));
    RETURN_IF_ERROR(page_tables_.Allocate(
        static_cast<size_t>(g.max_batch) * g.max_pages_per_sequence * sizeof(int32_t), "page tables"));
    RETURN_IF_ERROR(accepted_.Allocate((kMaxDraftLen + 2) * sizeof(int32_t), "accepted path"));
    RETURN_IF_ERROR(rows_.Allocate(kRowStagingBytes, "row staging"));
    kernels::VerifyArguments shape;
    shape.batch = g.max_batch;
    shape.num_heads = g.num_heads;
    shape.max_draft_len = g.max_draft_len;
    RETURN_IF_ERROR(workspace_.Allocate(kernels::VerifyWorkspaceBytes(shape, config_), "workspace"));
    RETURN_IF_ERROR(kernels::InitVerifyWorkspace(shape, config_, workspace_.as<void>(), workspace_.bytes(),
                                                 stream_));
    spdlog::info("cuda backend: device {}, pool {:.1f} MiB, {} SMs", device_,
                 static_cast<double>(pool_bytes) / (1 << 20), config_.num_sms);
    return absl::OkStatus();
  }

  absl::Status WriteRows(absl::Span<const int32_t> page_table, int64_t start, int64_t count,
                         absl::Span<const Bf16> data) override {
    return CopyRows(page_table, start, count, data.data(), nullptr);
  }

  absl::Status ReadRows(absl::Span<const int32_t> page_table, int64_t start, int64_t count,
                        absl::Span<Bf16> data) override {
    return CopyRows(page_table, start, count, nullptr, data.data());
  }

  absl::Status Verify(absl::Span<const BackendVerifyRequest> requests) override {
    absl::MutexLock lock(&mu_);
    const int batch = static_cast<int>(requests.size());
    const int heads = g_.num_heads;
    const int64_t stride = g_.max_pages_per_sequence;
    if (batch > g_.max_batch) {
      return absl::InvalidArgumentError(absl::StrCat(batch, " requests exceed max_batch ", g_.max_batch));
    }
    // Pack the batch: per-request arrays, page tables [batch, stride], and
    // the drafts' rows back to back.
    std::vector<int32_t> scalars(4 * batch);  // prefix | draft | layer | scale bits
    std::vector<int32_t> tables(static_cast<size_t>(batch) * stride, 0);
    std::vector<uint64_t> visibility;
    int64_t tokens = 0;
    for (int b = 0; b < batch; ++b) {
      const BackendVerifyRequest& r = requests[b];
      scalars[b] = r.prefix_len;
      scalars[batch + b] = r.draft_len;
      scalars[2 * batch + b] = r.layer;
      std::memcpy(&scalars[3 * batch + b], &r.softmax_scale, sizeof(float));
      if (static_cast<int64_t>(r.page_table.size()) > stride) {
        return absl::InternalError("page table longer than max_pages_per_sequence");
      }
      std::copy(r.page_table.begin(), r.page_table.end(), tables.begin() + b * stride);
      visibility.insert(visibility.end(), r.visibility.begin(), r.visibility.end());
      tokens += r.draft_len;
    }
    auto* q = q_.as<Bf16>();
    auto* draft_kv = draft_kv_.as<Bf16>();
    int64_t row = 0;
    for (const BackendVerifyRequest& r : requests) {
      RETURN_IF_ERROR(CudaErrorToStatus(cudaMemcpyAsync(q + row * heads * kLatentDim, r.q.data(),
                                           r.q.size() * sizeof(Bf16), cudaMemcpyHostToDevice, stream_),
                           "q upload"));
      RETURN_IF_ERROR(CudaErrorToStatus(cudaMemcpyAsync(draft_kv + row * kLatentDim, r.draft_kv.data(),
                                           r.draft_kv.size() * sizeof(Bf16), cudaMemcpyHostToDevice,
                                           stream_),
                           "draft upload"));
      row += r.draft_len;
    }
    int32_t* d_scalars = requests_.as<int32_t>();
    RETURN_IF_ERROR(CudaErrorToStatus(cudaMemcpyAsync(d_scalars, scalars.data(), scalars.size() * sizeof(int32_t),
                                         cudaMemcpyHostToDevice, stream_),
                         "request upload"));
    RETURN_IF_ERROR(CudaErrorToStatus(cudaMemcpyAsync(page_tables_.as<int32_t>(), tables.data(),
                                         tables.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                                         stream_),
                         "page table upload"));
    RETURN_IF_ERROR(CudaErrorToStatus(cudaMemcpyAsync(visibility_.as<uint64_t>(), visibility.data(),
                                         visibility.size() * sizeof(uint64_t),
                                         cudaMemcpyHostToDevice, stream_),
                         "visibility upload"));

    kernels::DraftKvWriteArguments w;
    w.batch = batch;
    w.total_draft_capacity = static_cast<int>(tokens);
    w.draft_kv = draft_kv;
    w.draft_kv_stride = kLatentDim;
    w.pool = View();
    w.page_table = page_tables_.as<int32_t>();
    w.page_table_stride = stride;
    w.prefix_len = d_scalars;
    w.draft_len = d_scalars + batch;
    w.layer = d_scalars + 2 * batch;
    RETURN_IF_ERROR(kernels::LaunchWriteDraftKv(w, stream_));

    kernels::VerifyArguments a;
    a.batch = batch;
    a.num_heads = heads;
    a.max_draft_len = g_.max_draft_len;
    a.total_draft_capacity = static_cast<int>(tokens);
    a.q = q;
    a.q_token_stride = static_cast<int64_t>(heads) * kLatentDim;
    a.q_head_stride = kLatentDim;
    a.pool = View();
    a.page_table = page_tables_.as<int32_t>();
    a.page_table_stride = stride;
    a.prefix_len = d_scalars;
    a.draft_len = d_scalars + batch;
    a.layer = d_scalars + 2 * batch;
    a.softmax_scale = reinterpret_cast<const float*>(d_scalars + 3 * batch);
    a.default_softmax_scale = requests[0].softmax_scale;
    a.visibility = visibility_.as<uint64_t>();
    a.out = out_.as<Bf16>();
    a.out_token_stride = static_cast<int64_t>(heads) * kValueDim;
    a.out_head_stride = kValueDim;
    a.lse = lse_.as<float>();
    // The layers of one step of this batch share the plan of its first
    // launch (plan_reuse.h): equal lengths, one workspace, one config.
    const absl::Span<const int32_t> prefix_lens(scalars.data(), batch);
    const absl::Span<const int32_t> draft_lens(scalars.data() + batch, batch);
    kernels::VerifyLaunchConfig config = config_;
    config.reuse_plan = plan_reuse_.CanReuse(prefix_lens, draft_lens);
    plan_reuse_.Invalidate();  // until this launch has completed
    RETURN_IF_ERROR(kernels::LaunchVerifyAttention(a, config, workspace_.as<void>(),
                                                   workspace_.bytes(), stream_));
    row = 0;
    for (const BackendVerifyRequest& r : requests) {
      RETURN_IF_ERROR(CudaErrorToStatus(cudaMemcpyAsync(r.out.data(), out_.as<Bf16>() + row * heads * kValueDim,
                                           r.out.size() * sizeof(Bf16), cudaMemcpyDeviceToHost,
                                           stream_),
                           "out download"));
      RETURN_IF_ERROR(CudaErrorToStatus(cudaMemcpyAsync(r.lse.data(), lse_.as<float>() + row * heads,
                                           r.lse.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                           stream_),
                           "lse download"));
      row += r.draft_len;
    }
    RETURN_IF_ERROR(CudaErrorToStatus(cudaStreamSynchronize(stream_), "verify"));
    plan_reuse_.Planned(prefix_lens, draft_lens);
    return absl::OkStatus();
  }

  absl::Status Compact(absl::Span<const int32_t> page_table, int64_t prefix_len,
                       absl::Span<const int32_t> accepted) override {
    absl::MutexLock lock(&mu_);
    // [prefix, k, accepted[0..63]] in one upload.
    std::vector<int32_t> packed(kMaxDraftLen + 2, 0);
    packed[0] = static_cast<int32_t>(prefix_len);
    packed[1] = static_cast<int32_t>(accepted.size());
    std::copy(accepted.begin(), accepted.end(), packed.begin() + 2);
    int32_t* d = accepted_.as<int32_t>();
    RETURN_IF_ERROR(CudaErrorToStatus(cudaMemcpyAsync(d, packed.data(), packed.size() * sizeof(int32_t),
                                         cudaMemcpyHostToDevice, stream_),
                         "path upload"));
    RETURN_IF_ERROR(UploadPageTable(page_table));
    kernels::CompactArguments c;
    c.batch = 1;
    c.pool = View();
    c.page_table = page_tables_.as<int32_t>();
    c.page_table_stride = std::max<int64_t>(1, static_cast<int64_t>(page_table.size()));
    c.prefix_len = d;
    c.accepted_len = d + 1;
    c.accepted = d + 2;
    RETURN_IF_ERROR(kernels::LaunchCompactAcceptedKv(c, stream_));
    return CudaErrorToStatus(cudaStreamSynchronize(stream_), "compaction");
  }

 private:
  kernels::KvPoolView View() const {
    return kernels::KvPoolView{pool_.as<Bf16>(), g_.num_layers, g_.num_pages, g_.page_size};
  }

  absl::Status UploadPageTable(absl::Span<const int32_t> page_table)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return CudaErrorToStatus(cudaMemcpyAsync(page_tables_.as<int32_t>(), page_table.data(),
                                page_table.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_),
                "page table upload");
  }

  // Host rows [num_layers, count, 576] to the pool (`upload`) or from it
  // (`download`), in chunks that fit the row staging buffer (a chunk of
  // tokens of every layer is a strided 2D copy).
  absl::Status CopyRows(absl::Span<const int32_t> page_table, int64_t start, int64_t count,
                        const Bf16* upload, Bf16* download) {
    const bool to_pool = upload != nullptr;
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(UploadPageTable(page_table));
    const size_t row_bytes = kLatentDim * sizeof(Bf16);
    const int64_t chunk_max =
        std::max<int64_t>(1, static_cast<int64_t>(rows_.bytes() / (row_bytes * g_.num_layers)));
    for (int64_t c0 = 0; c0 < count; c0 += chunk_max) {
      const int64_t chunk = std::min(chunk_max, count - c0);
      Bf16* staged = rows_.as<Bf16>();
      if (to_pool) {
        RETURN_IF_ERROR(CudaErrorToStatus(cudaMemcpy2DAsync(staged, chunk * row_bytes, upload + c0 * kLatentDim,
                                               count * row_bytes, chunk * row_bytes, g_.num_layers,
                                               cudaMemcpyHostToDevice, stream_),
                             "rows upload"));
      }
      RETURN_IF_ERROR(kernels::LaunchCopyRows(View(), page_tables_.as<int32_t>(), start + c0, chunk,
                                              staged, to_pool, stream_));
      if (!to_pool) {
        RETURN_IF_ERROR(CudaErrorToStatus(cudaMemcpy2DAsync(download + c0 * kLatentDim, count * row_bytes, staged,
                                               chunk * row_bytes, chunk * row_bytes, g_.num_layers,
                                               cudaMemcpyDeviceToHost, stream_),
                             "rows download"));
      }
      // The staging buffer is reused by the next chunk.
      RETURN_IF_ERROR(CudaErrorToStatus(cudaStreamSynchronize(stream_), "row copy"));
    }
    return absl::OkStatus();
  }

  const int device_;
  absl::Mutex mu_;
  PoolGeometry g_;
  kernels::VerifyLaunchConfig config_;
  PlanReuseTracker plan_reuse_ ABSL_GUARDED_BY(mu_);
  cudaStream_t stream_ = nullptr;
  DeviceAllocation pool_, q_, draft_kv_, out_, lse_, visibility_, requests_, page_tables_,
      accepted_, rows_, workspace_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    return absl::UnavailableError(absl::StrCat(
        "no CUDA device: ", err != cudaSuccess ? cudaGetErrorString(err) : "device count is 0"));
  }
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA device ", device, " of ", count, " requested"));
  }
  return std::unique_ptr<Backend>(new CudaBackend(device));
}

}  // namespace mlaverify::engine
