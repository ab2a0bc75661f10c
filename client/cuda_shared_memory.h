// The client's side of the CUDA shared-memory data plane: a device
// allocation this process exports to the server by CUDA IPC handle
// (RegisterCudaSharedMemory), so that a Verify item's q, draft_kv, out and
// lse stay in device memory: the server copies the inputs device to device
// into its batch and writes the outputs back before it answers.
//
//   ASSIGN_OR_RETURN(auto buf, CudaSharedMemoryBuffer::Create(/*device=*/0, bytes));
//   RETURN_IF_ERROR(client->RegisterCudaSharedMemory("gpu-0", buf->ipc_handle(), 0, buf->size()));
//   ShmItemPlacement place = PlaceVerifyItem("gpu-0", nullptr, 0, N, H);
//   place.cuda = buf.get();  // q/draft_kv written to the device, out/lse read back
//
// In a build without CUDA, Create is UNIMPLEMENTED.
#ifndef MLAVERIFY_CLIENT_CUDA_SHARED_MEMORY_H_
#define MLAVERIFY_CLIENT_CUDA_SHARED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mlaverify::client {

class CudaSharedMemoryBuffer {
 public:
  // cudaMalloc of `bytes` on `device` and its IPC handle. UNAVAILABLE with
  // CUDA's words when the device or the memory is not there.
  static absl::StatusOr<std::unique_ptr<CudaSharedMemoryBuffer>> Create(int device, size_t bytes);
  ~CudaSharedMemoryBuffer();  // cudaFree (unregister it from the server first)
  CudaSharedMemoryBuffer(const CudaSharedMemoryBuffer&) = delete;
  CudaSharedMemoryBuffer& operator=(const CudaSharedMemoryBuffer&) = delete;

  // The cudaIpcMemHandle_t bytes RegisterCudaSharedMemory takes.
  const std::string& ipc_handle() const { return handle_; }
  int device() const { return device_; }
  size_t size() const { return size_; }

  // Host memory to and from the allocation (synchronous copies).
  absl::Status Write(uint64_t offset, const void* src, size_t bytes) const;
  absl::Status Read(uint64_t offset, void* dst, size_t bytes) const;

 private:
  CudaSharedMemoryBuffer() = default;
  int device_ = 0;
  size_t size_ = 0;
  void* data_ = nullptr;
  std::string handle_;
};

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_CUDA_SHARED_MEMORY_H_
