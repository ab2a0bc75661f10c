#include "kernels/stream_memops.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_status.h"

namespace mlaverify::kernels {
namespace {

using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using WaitValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using BatchMemOp = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);

struct DriverFunctions {
  WriteValue64 write = nullptr;
  WaitValue64 wait = nullptr;
  BatchMemOp batch = nullptr;
  absl::Status status;
};

// The CUDA 12 forms (the "_v2" functions of the driver API).
constexpr unsigned int kDriverApiVersion = 12000;

template <typename Fn>
absl::Status Lookup(const char* symbol, Fn* fn) {
  void* found = nullptr;
  cudaDriverEntryPointQueryResult result = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &found, kDriverApiVersion,
                                                           cudaEnableDefault, &result);
  if (err != cudaSuccess || result != cudaDriverEntryPointSuccess || found == nullptr) {
    cudaGetLastError();
    return absl::UnavailableError(absl::StrCat(
        "the CUDA driver has no ", symbol,
        err != cudaSuccess ? absl::StrCat(" (", cudaGetErrorString(err), ")") : std::string()));
  }
  *fn = reinterpret_cast<Fn>(found);
  return absl::OkStatus();
}

const DriverFunctions& Functions() {
  static const DriverFunctions* functions = [] {
    auto* f = new DriverFunctions;
    f->status = Lookup("cuStreamWriteValue64", &f->write);
    if (f->status.ok()) f->status = Lookup("cuStreamWaitValue64", &f->wait);
    if (f->status.ok()) f->status = Lookup("cuStreamBatchMemOp", &f->batch);
    return f;
  }();
  return *functions;
}

absl::Status FromDriver(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, " failed: CUresult ", static_cast<int>(result)));
}

}  // namespace

absl::Status StreamWriteValue64(cudaStream_t stream, uint64_t address, uint64_t value) {
  const DriverFunctions& f = Functions();
  if (!f.status.ok()) return f.status;
  return FromDriver(f.write(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(address),
                            value, CU_STREAM_WRITE_VALUE_DEFAULT),
                    "cuStreamWriteValue64");
}

absl::Status StreamWriteValues64(cudaStream_t stream,
                                 absl::Span<const std::pair<uint64_t, uint64_t>> writes) {
  const DriverFunctions& f = Functions();
  if (!f.status.ok()) return f.status;
  CUstreamBatchMemOpParams params[8];
  if (writes.empty() || writes.size() > 8) {
    return absl::InvalidArgumentError("1..8 writes per batch");
  }
  for (size_t k = 0; k < writes.size(); ++k) {
    std::memset(&params[k], 0, sizeof(params[k]));
    params[k].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    params[k].writeValue.address = static_cast<CUdeviceptr>(writes[k].first);
    params[k].writeValue.value64 = writes[k].second;
    params[k].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  }
  return FromDriver(f.batch(reinterpret_cast<CUstream>(stream),
                            static_cast<unsigned int>(writes.size()), params, 0),
                    "cuStreamBatchMemOp");
}

absl::Status StreamWaitValue64(cudaStream_t stream, uint64_t address, uint64_t value) {
  const DriverFunctions& f = Functions();
  if (!f.status.ok()) return f.status;
  return FromDriver(f.wait(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(address),
                           value, CU_STREAM_WAIT_VALUE_GEQ),
                    "cuStreamWaitValue64");
}

absl::Status ProbeStreamMemOps(int device) {
  if (const absl::Status loaded = Functions().status; !loaded.ok()) return loaded;
  absl::Status status = CudaErrorToStatus(cudaSetDevice(device), "cudaSetDevice");
  if (!status.ok()) return status;
  cudaStream_t stream = nullptr;
  uint64_t* word = nullptr;
  uint64_t* host = nullptr;
  void* host_device = nullptr;
  status = CudaErrorToStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  if (status.ok())
    status = CudaErrorToStatus(cudaMalloc(reinterpret_cast<void**>(&word), sizeof(uint64_t)),
                               "cudaMalloc");
  if (status.ok()) {
    status = CudaErrorToStatus(cudaHostAlloc(reinterpret_cast<void**>(&host), sizeof(uint64_t),
                                             cudaHostAllocMapped | cudaHostAllocPortable),
                               "cudaHostAlloc");
  }
  if (status.ok())
    status = CudaErrorToStatus(cudaHostGetDevicePointer(&host_device, host, 0), "mapping");
  if (status.ok()) {
    *host = 0;
    status =
        CudaErrorToStatus(cudaMemsetAsync(word, 0, sizeof(uint64_t), stream), "cudaMemsetAsync");
  }
  // A write, a wait it satisfies, then a write into host memory that only
  // lands once the wait passed.
  constexpr uint64_t kValue = uint64_t{1} << 40;
  if (status.ok()) status = StreamWriteValue64(stream, reinterpret_cast<uint64_t>(word), kValue);
  if (status.ok()) status = StreamWaitValue64(stream, reinterpret_cast<uint64_t>(word), kValue);
  if (status.ok()) {
    status = StreamWriteValues64(stream, {{reinterpret_cast<uint64_t>(host_device), kValue + 1}});
  }
  if (status.ok()) status = CudaErrorToStatus(cudaStreamSynchronize(stream), "the probe's stream");
  if (status.ok() && __atomic_load_n(host, __ATOMIC_ACQUIRE) != kValue + 1) {
    status = absl::UnavailableError("a stream write into page-locked host memory did not land");
  }
  if (!status.ok()) {
    cudaGetLastError();  // not sticky: clear it for this thread's next call
    status = absl::UnavailableError(absl::StrCat("stream memory operations on CUDA device ", device,
                                                 " do not work: ", status.message()));
  }
  if (host != nullptr) cudaFreeHost(host);
  if (word != nullptr) cudaFree(word);
  if (stream != nullptr) cudaStreamDestroy(stream);
  return status;
}

}  // namespace mlaverify::kernels
