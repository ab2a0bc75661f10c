// The client's CUDA side of GPU doorbells (client/steps.h): opening a
// server device's doorbell arena by its IPC handle, and the stream
// operations that ring and wait. gpu_doorbells.cc in CUDA builds,
// gpu_doorbells_unavailable.cc (UNIMPLEMENTED) without.
#ifndef MLAVERIFY_CLIENT_GPU_DOORBELLS_H_
#define MLAVERIFY_CLIENT_GPU_DOORBELLS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace mlaverify::client::gpu_doorbells {

// The arena's first byte in this process (cudaIpcOpenMemHandle on CUDA
// device `device`). Open once per handle; Close when done.
absl::StatusOr<uint64_t> OpenArena(const std::string& ipc_handle, int device);
void CloseArena(uint64_t address, int device);
// `stream` is a cudaStream_t; the word is in device memory.
absl::Status Ring(void* stream, uint64_t address, uint64_t value);
absl::Status Wait(void* stream, uint64_t address, uint64_t value);
// The word's value (a synchronous copy).
absl::StatusOr<uint64_t> Read(uint64_t address, int device);

// A CUDA stream of this process on one device, with `events` timing events
// made up front (the load tester's scheduler stand-in).
class TimedStream {
 public:
  static absl::StatusOr<std::unique_ptr<TimedStream>> Create(int device, int events);
  ~TimedStream();
  TimedStream(const TimedStream&) = delete;
  TimedStream& operator=(const TimedStream&) = delete;

  void* stream() const { return stream_; }
  int device() const { return device_; }
  // Makes the stream's device the calling thread's current one (for work
  // launched on the current device, such as LaunchClientWork).
  absl::Status MakeCurrent() const;
  absl::Status Record(int event);
  absl::Status Synchronize();
  // Seconds from event `from` to event `to` (both recorded and done).
  absl::StatusOr<double> Elapsed(int from, int to) const;

 private:
  TimedStream() = default;
  int device_ = 0;
  void* stream_ = nullptr;
  std::vector<void*> events_;
};

}  // namespace mlaverify::client::gpu_doorbells

#endif  // MLAVERIFY_CLIENT_GPU_DOORBELLS_H_
