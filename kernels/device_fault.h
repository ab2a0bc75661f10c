// A kernel that stops with a device-side trap: a real, sticky CUDA error
// (every later call on the context fails), for testing how the service handles
// a device fault on a GPU. Never launched unless a test or an operator's
// testing flag asks for it.
#ifndef MLAVERIFY_KERNELS_DEVICE_FAULT_H_
#define MLAVERIFY_KERNELS_DEVICE_FAULT_H_

#include <cuda_runtime_api.h>

namespace mlaverify::kernels {

cudaError_t LaunchTrapKernel(cudaStream_t stream);

}  // namespace mlaverify::kernels

#endif  // MLAVERIFY_KERNELS_DEVICE_FAULT_H_
