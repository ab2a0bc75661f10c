#include "kernels/device_fault.h"

namespace mlaverify::kernels {
namespace {

__global__ void TrapKernel() { __trap(); }

}  // namespace

cudaError_t LaunchTrapKernel(cudaStream_t stream) {
  TrapKernel<<<1, 1, 0, stream>>>();
  return cudaGetLastError();
}

}  // namespace mlaverify::kernels
