// MakeCudaBackend in a build without nvcc: a clear refusal, never a silent
// fallback (the server decides what to do with it).
#include "server/engine/backend.h"

namespace mlaverify::engine {

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int) {
  return absl::UnimplementedError(
      "this build has no CUDA backend: nvcc was not found at configure time (rebuild with CUDA "
      "at /usr/local/cuda or use --backend cpu)");
}

}  // namespace mlaverify::engine
