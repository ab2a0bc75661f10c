#include "kernels/testing/device_problem.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda_status.h"

namespace mlaverify::kernels::testing {
namespace {

using kernels::CudaErrorToStatus;

template <typename T>
absl::Status CopyIn(const DeviceBuffer& dst, const std::vector<T>& src, const char* what) {
  const size_t bytes = src.size() * sizeof(T);
  if (bytes > dst.bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", bytes, " bytes exceed the ", dst.bytes(), " allocated"));
  }
  return CudaErrorToStatus(cudaMemcpy(dst.as<void>(), src.data(), bytes, cudaMemcpyHostToDevice),
                           what);
}

}  // namespace

std::string NoUsableGpuReason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    return absl::StrCat(
        "no usable CUDA device or driver (cudaGetDeviceCount: ", cudaGetErrorString(err), ")");
  }
  return count == 0 ? "no CUDA device (device count is 0)" : "";
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

absl::Status DeviceBuffer::Allocate(size_t bytes) {
  if (ptr_ != nullptr) cudaFree(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
  RETURN_IF_ERROR(CudaErrorToStatus(cudaMalloc(&ptr_, std::max<size_t>(bytes, 16)), "cudaMalloc"));
  bytes_ = bytes;
  return absl::OkStatus();
}

DeviceCapacity CapacityFor(const HostVerifyProblem& p) {
  DeviceCapacity c;
  c.batch = p.batch;
  c.max_draft_len = std::max(1, *std::max_element(p.draft_len.begin(), p.draft_len.end()));
  c.total_draft = std::max(1, p.total_draft);
  c.num_heads = p.spec.num_heads;
  c.pool_elems = static_cast<int64_t>(p.pool.size());
  c.page_table_elems = static_cast<int64_t>(p.page_table.size());
  c.q_elems = static_cast<int64_t>(p.q.size());
  c.out_head_pad = p.spec.out_head_pad;
  return c;
}

absl::Status DeviceVerifyProblem::Init(const DeviceCapacity& c, const VerifyLaunchConfig& config) {
  capacity_ = c;
  RETURN_IF_ERROR(pool_.Allocate(c.pool_elems * sizeof(Bf16)));
  RETURN_IF_ERROR(page_table_.Allocate(c.page_table_elems * sizeof(int32_t)));
  RETURN_IF_ERROR(prefix_len_.Allocate(c.batch * sizeof(int32_t)));
  RETURN_IF_ERROR(draft_len_.Allocate(c.batch * sizeof(int32_t)));
  RETURN_IF_ERROR(layer_.Allocate(c.batch * sizeof(int32_t)));
  RETURN_IF_ERROR(visibility_.Allocate(c.total_draft * sizeof(uint64_t)));
  RETURN_IF_ERROR(q_.Allocate(c.q_elems * sizeof(Bf16)));
  RETURN_IF_ERROR(
      draft_kv_.Allocate(static_cast<size_t>(c.total_draft) * kLatentDim * sizeof(Bf16)));
  RETURN_IF_ERROR(out_.Allocate(static_cast<size_t>(c.total_draft) * c.num_heads *
                                (kValueDim + c.out_head_pad) * sizeof(Bf16)));
  RETURN_IF_ERROR(lse_.Allocate(static_cast<size_t>(c.total_draft) * c.num_heads * sizeof(float)));
  VerifyArguments shape;
  shape.batch = c.batch;
  shape.num_heads = c.num_heads;
  shape.max_draft_len = c.max_draft_len;
  RETURN_IF_ERROR(workspace_.Allocate(VerifyWorkspaceBytes(shape, config)));
  RETURN_IF_ERROR(
      InitVerifyWorkspace(shape, config, workspace_.as<void>(), workspace_.bytes(), nullptr));
  return CudaErrorToStatus(cudaStreamSynchronize(nullptr), "workspace init");
}

absl::Status DeviceVerifyProblem::Upload(const HostVerifyProblem& p) {
  if (p.batch != capacity_.batch || p.spec.num_heads != capacity_.num_heads) {
    return absl::InvalidArgumentError("problem batch/heads differ from the device capacity");
  }
  // The pool of a problem holds prefix rows only; the draft rows arrive
  // through the draft write, so a host pool that already went through
  // WriteDraftKvCpu is uploaded as is (identical rows either way).
  RETURN_IF_ERROR(CopyIn(pool_, p.pool, "pool"));
  RETURN_IF_ERROR(CopyIn(page_table_, p.page_table, "page_table"));
  RETURN_IF_ERROR(CopyIn(prefix_len_, p.prefix_len, "prefix_len"));
  RETURN_IF_ERROR(CopyIn(draft_len_, p.draft_len, "draft_len"));
  RETURN_IF_ERROR(CopyIn(layer_, p.layer, "layer"));
  RETURN_IF_ERROR(CopyIn(visibility_, p.visibility, "visibility"));
  RETURN_IF_ERROR(CopyIn(q_, p.q, "q"));
  RETURN_IF_ERROR(CopyIn(draft_kv_, p.draft_kv, "draft_kv"));

  VerifyArguments& a = args_;
  a = VerifyArguments{};
  a.batch = capacity_.batch;
  a.num_heads = capacity_.num_heads;
  a.max_draft_len = capacity_.max_draft_len;
  a.total_draft_capacity = capacity_.total_draft;
  a.q = q_.as<Bf16>();
  a.q_token_stride = p.q_token_stride;
  a.q_head_stride = kLatentDim;
  a.pool = KvPoolView{pool_.as<Bf16>(), p.spec.num_layers, p.num_pages, p.spec.page_size,
                      p.spec.kv_dtype};
  a.page_table = page_table_.as<int32_t>();
  a.page_table_stride = p.page_table_stride;
  a.prefix_len = prefix_len_.as<int32_t>();
  a.draft_len = draft_len_.as<int32_t>();
  a.layer = layer_.as<int32_t>();
  a.default_softmax_scale = p.softmax_scale;
  a.visibility = visibility_.as<uint64_t>();
  a.out = out_.as<Bf16>();
  a.out_head_stride = kValueDim + capacity_.out_head_pad;
  a.out_token_stride = static_cast<int64_t>(capacity_.num_heads) * a.out_head_stride;
  a.lse = lse_.as<float>();

  DraftKvWriteArguments& w = write_args_;
  w = DraftKvWriteArguments{};
  w.batch = capacity_.batch;
  w.total_draft_capacity = capacity_.total_draft;
  w.draft_kv = draft_kv_.as<Bf16>();
  w.draft_kv_stride = kLatentDim;
  w.pool = a.pool;
  w.page_table = a.page_table;
  w.page_table_stride = a.page_table_stride;
  w.prefix_len = a.prefix_len;
  w.draft_len = a.draft_len;
  w.layer = a.layer;
  RETURN_IF_ERROR(PoisonOutputs(nullptr));
  return CudaErrorToStatus(cudaDeviceSynchronize(), "upload");
}

absl::Status DeviceVerifyProblem::PoisonOutputs(cudaStream_t stream) {
  RETURN_IF_ERROR(CudaErrorToStatus(cudaMemsetAsync(out_.as<void>(), 0xff, out_.bytes(), stream),
                                    "poison out"));
  return CudaErrorToStatus(cudaMemsetAsync(lse_.as<void>(), 0xff, lse_.bytes(), stream),
                           "poison lse");
}

absl::Status DeviceVerifyProblem::Download(const HostVerifyProblem& p, std::vector<Bf16>* out,
                                           std::vector<float>* lse) const {
  const size_t rows = static_cast<size_t>(p.total_draft) * p.spec.num_heads;
  out->resize(rows * kValueDim);
  lse->resize(rows);
  RETURN_IF_ERROR(
      CudaErrorToStatus(cudaMemcpy2D(out->data(), kValueDim * sizeof(Bf16), out_.as<void>(),
                                     (kValueDim + capacity_.out_head_pad) * sizeof(Bf16),
                                     kValueDim * sizeof(Bf16), rows, cudaMemcpyDeviceToHost),
                        "download out"));
  return CudaErrorToStatus(
      cudaMemcpy(lse->data(), lse_.as<void>(), lse->size() * sizeof(float), cudaMemcpyDeviceToHost),
      "download lse");
}

}  // namespace mlaverify::kernels::testing
