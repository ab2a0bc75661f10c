// The one conversion of a CUDA runtime error into an absl::Status, shared by
// the kernel launchers, the CUDA backend and the test/bench device helpers.
#ifndef MLAVERIFY_KERNELS_CUDA_STATUS_H_
#define MLAVERIFY_KERNELS_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace mlaverify::kernels {

// OK for cudaSuccess, else INTERNAL "CUDA <what>: <CUDA's message>".
inline absl::Status CudaErrorToStatus(cudaError_t err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("CUDA ", what, ": ", cudaGetErrorString(err)));
}

}  // namespace mlaverify::kernels

#endif  // MLAVERIFY_KERNELS_CUDA_STATUS_H_
