#include "client/client_work.h"

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/strings/str_cat.h"

namespace mlaverify::client {
namespace internal {
cudaError_t LaunchBusyKernel(cudaStream_t stream, uint64_t nanoseconds, int blocks);
}  // namespace internal

absl::Status LaunchClientWork(void* stream, double microseconds) {
  if (microseconds <= 0) return absl::OkStatus();
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError("no CUDA device for the client's work");
  }
  const cudaError_t err = internal::LaunchBusyKernel(
      static_cast<cudaStream_t>(stream), static_cast<uint64_t>(microseconds * 1e3), sms);
  if (err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("the client's work kernel: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

}  // namespace mlaverify::client
