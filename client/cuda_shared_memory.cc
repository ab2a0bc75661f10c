#include "client/cuda_shared_memory.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"

namespace mlaverify::client {
namespace {

absl::Status Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::UnavailableError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaSharedMemoryBuffer>> CudaSharedMemoryBuffer::Create(
    int device, size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("a CUDA shared-memory buffer of 0 bytes");
  std::unique_ptr<CudaSharedMemoryBuffer> b(new CudaSharedMemoryBuffer());
  b->device_ = device;
  b->size_ = bytes;
  if (absl::Status s = Check(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  if (absl::Status s = Check(cudaMalloc(&b->data_, bytes), "cudaMalloc"); !s.ok()) {
    b->data_ = nullptr;
    return s;
  }
  // Zeroed, so that a read before the first answer shows zeros, not garbage.
  if (absl::Status s = Check(cudaMemset(b->data_, 0, bytes), "cudaMemset"); !s.ok()) return s;
  cudaIpcMemHandle_t handle;
  if (absl::Status s = Check(cudaIpcGetMemHandle(&handle, b->data_), "cudaIpcGetMemHandle");
      !s.ok()) {
    return s;
  }
  b->handle_.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  return b;
}

CudaSharedMemoryBuffer::~CudaSharedMemoryBuffer() {
  if (data_ != nullptr && cudaSetDevice(device_) == cudaSuccess) cudaFree(data_);
}

absl::Status CudaSharedMemoryBuffer::Write(uint64_t offset, const void* src, size_t bytes) const {
  if (offset > size_ || bytes > size_ - offset) {
    return absl::OutOfRangeError(
        absl::StrCat("write of ", bytes, " bytes at ", offset, " past the buffer's ", size_));
  }
  if (absl::Status s = Check(cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
  return Check(
      cudaMemcpy(static_cast<uint8_t*>(data_) + offset, src, bytes, cudaMemcpyHostToDevice),
      "cudaMemcpy to the device");
}

absl::Status CudaSharedMemoryBuffer::Read(uint64_t offset, void* dst, size_t bytes) const {
  if (offset > size_ || bytes > size_ - offset) {
    return absl::OutOfRangeError(
        absl::StrCat("read of ", bytes, " bytes at ", offset, " past the buffer's ", size_));
  }
  if (absl::Status s = Check(cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
  return Check(
      cudaMemcpy(dst, static_cast<const uint8_t*>(data_) + offset, bytes, cudaMemcpyDeviceToHost),
      "cudaMemcpy from the device");
}

}  // namespace mlaverify::client
