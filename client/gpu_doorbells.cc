#include "client/gpu_doorbells.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/stream_memops.h"

namespace mlaverify::client::gpu_doorbells {
namespace {

absl::Status Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::UnavailableError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

}  // namespace

absl::StatusOr<uint64_t> OpenArena(const std::string& ipc_handle, int device) {
  if (ipc_handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat("the server's doorbell arena handle is ",
                                                   ipc_handle.size(), " bytes, not ",
                                                   sizeof(cudaIpcMemHandle_t)));
  }
  if (absl::Status s = Check(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, ipc_handle.data(), sizeof(handle));
  void* data = nullptr;
  if (absl::Status s = Check(cudaIpcOpenMemHandle(&data, handle, cudaIpcMemLazyEnablePeerAccess),
                             "opening the server's doorbell arena (cudaIpcOpenMemHandle)");
      !s.ok()) {
    return s;
  }
  return reinterpret_cast<uint64_t>(data);
}

void CloseArena(uint64_t address, int device) {
  if (cudaSetDevice(device) != cudaSuccess ||
      cudaIpcCloseMemHandle(reinterpret_cast<void*>(address)) != cudaSuccess) {
    cudaGetLastError();
  }
}

absl::Status Ring(void* stream, uint64_t address, uint64_t value) {
  return kernels::StreamWriteValue64(static_cast<cudaStream_t>(stream), address, value);
}

absl::Status Wait(void* stream, uint64_t address, uint64_t value) {
  return kernels::StreamWaitValue64(static_cast<cudaStream_t>(stream), address, value);
}

absl::StatusOr<uint64_t> Read(uint64_t address, int device) {
  if (absl::Status s = Check(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  uint64_t value = 0;
  if (absl::Status s = Check(cudaMemcpy(&value, reinterpret_cast<const void*>(address),
                                        sizeof(value), cudaMemcpyDeviceToHost),
                             "reading a completion word");
      !s.ok()) {
    return s;
  }
  return value;
}

absl::StatusOr<std::unique_ptr<TimedStream>> TimedStream::Create(int device, int events) {
  std::unique_ptr<TimedStream> t(new TimedStream());
  t->device_ = device;
  if (absl::Status s = Check(cudaSetDevice(device), "cudaSetDevice"); !s.ok()) return s;
  cudaStream_t stream = nullptr;
  if (absl::Status s = Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
      !s.ok()) {
    return s;
  }
  t->stream_ = stream;
  for (int k = 0; k < events; ++k) {
    cudaEvent_t e = nullptr;
    if (absl::Status s = Check(cudaEventCreate(&e), "event"); !s.ok()) return s;
    t->events_.push_back(e);
  }
  return t;
}

TimedStream::~TimedStream() {
  cudaSetDevice(device_);
  for (void* e : events_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::Status TimedStream::MakeCurrent() const {
  return Check(cudaSetDevice(device_), "cudaSetDevice");
}

absl::Status TimedStream::Record(int event) {
  return Check(cudaEventRecord(static_cast<cudaEvent_t>(events_.at(event)),
                               static_cast<cudaStream_t>(stream_)),
               "cudaEventRecord");
}

absl::Status TimedStream::Synchronize() {
  return Check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "the client's stream");
}

absl::StatusOr<double> TimedStream::Elapsed(int from, int to) const {
  float ms = 0;
  if (absl::Status s = Check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events_.at(from)),
                                                  static_cast<cudaEvent_t>(events_.at(to))),
                             "cudaEventElapsedTime");
      !s.ok()) {
    return s;
  }
  return ms * 1e-3;
}

}  // namespace mlaverify::client::gpu_doorbells
