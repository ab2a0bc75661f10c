// MakeCudaDevice in a build without nvcc: the CPU backend is all there is.
#include "server/engine/device.h"

namespace mlaverify::engine {

absl::StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int, const CudaDeviceOptions&) {
  return absl::UnimplementedError(
      "this build has no CUDA support (nvcc was not found at configure time)");
}

}  // namespace mlaverify::engine
