// CudaSharedMemoryBuffer in a build without CUDA: there is no device memory
// to share.
#include "client/cuda_shared_memory.h"

namespace mlaverify::client {

absl::StatusOr<std::unique_ptr<CudaSharedMemoryBuffer>> CudaSharedMemoryBuffer::Create(int,
                                                                                       size_t) {
  return absl::UnimplementedError(
      "this build has no CUDA support: CUDA shared memory is not available");
}

CudaSharedMemoryBuffer::~CudaSharedMemoryBuffer() = default;

absl::Status CudaSharedMemoryBuffer::Write(uint64_t, const void*, size_t) const {
  return absl::UnimplementedError("this build has no CUDA support");
}

absl::Status CudaSharedMemoryBuffer::Read(uint64_t, void*, size_t) const {
  return absl::UnimplementedError("this build has no CUDA support");
}

}  // namespace mlaverify::client
