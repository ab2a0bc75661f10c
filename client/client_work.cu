// The busy kernel behind LaunchClientWork (client_work.cc).
#include <cuda_runtime.h>

#include <cstdint>

namespace mlaverify::client::internal {
namespace {

__device__ __forceinline__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Each block stays resident for `nanoseconds` from its start.
__global__ void BusyKernel(uint64_t nanoseconds) {
  __shared__ uint64_t s_end;
  if (threadIdx.x == 0) s_end = GlobalTimer() + nanoseconds;
  __syncthreads();
  while (GlobalTimer() < s_end) {
  }
}

}  // namespace

cudaError_t LaunchBusyKernel(cudaStream_t stream, uint64_t nanoseconds, int blocks) {
  BusyKernel<<<blocks, 128, 0, stream>>>(nanoseconds);
  return cudaGetLastError();
}

}  // namespace mlaverify::client::internal
