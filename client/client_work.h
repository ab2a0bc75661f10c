// A stand-in for a scheduler's own GPU work between two layers of a
// device-driven step (`mlaverify-client load --steps --client-work-us`):
// one block per multiprocessor busy for the given time, so that the
// scheduler's context and the server's alternate on the GPU as they do in
// production (the model's other kernels between two attention layers).
#ifndef MLAVERIFY_CLIENT_CLIENT_WORK_H_
#define MLAVERIFY_CLIENT_CLIENT_WORK_H_

#include "absl/status/status.h"

namespace mlaverify::client {

// Enqueues the busy kernel on `stream` (a cudaStream_t) of the current
// device. UNIMPLEMENTED in a build without CUDA.
absl::Status LaunchClientWork(void* stream, double microseconds);

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_CLIENT_WORK_H_
