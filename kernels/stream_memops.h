// Stream memory operations: a 64-bit write or wait placed on a CUDA stream
// (the driver's cuStreamWriteValue64 / cuStreamWaitValue64 /
// cuStreamBatchMemOp), the GPU doorbells of device-driven verify steps
// (docs/steps.md). The driver's functions are looked up once through the
// runtime (cudaGetDriverEntryPointByVersion), so nothing links libcuda.
//
// What shipped code learned about them, and this code keeps:
//   - a wait is released only by a write that reaches the GPU's memory
//     system as a memory operation; a host store (or a DMA copy) into the
//     word may never wake a pending wait: ring with StreamWriteValue64 from
//     a stream that never blocks;
//   - the wait compares cyclically, (int64_t)(*word - value) >= 0, so
//     values stay below 2^63 and only grow;
//   - each operation takes a place in the stream's hardware queue: keep far
//     fewer than a thousand queued behind one pending wait;
//   - support is decided by doing it (ProbeStreamMemOps), not by the
//     deprecated attribute of the first version of the API.
// Host code; CUDA builds only. Any thread.
#ifndef MLAVERIFY_KERNELS_STREAM_MEMOPS_H_
#define MLAVERIFY_KERNELS_STREAM_MEMOPS_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace mlaverify::kernels {

// Writes `value` to the 64-bit word at `address` (device memory, or
// page-locked host memory by its device address) once the stream's earlier
// work is done, after a memory fence: what that work wrote is visible to
// whoever sees the value.
absl::Status StreamWriteValue64(cudaStream_t stream, uint64_t address, uint64_t value);
// Several such writes as one operation in the stream's queue.
absl::Status StreamWriteValues64(cudaStream_t stream,
                                 absl::Span<const std::pair<uint64_t, uint64_t>> writes);
// Holds the stream's later work until (int64_t)(*address - value) >= 0.
absl::Status StreamWaitValue64(cudaStream_t stream, uint64_t address, uint64_t value);

// OK when stream memory operations work on CUDA device `device`: a write and
// a wait on a word of device memory, and a write into page-locked host
// memory, done on a stream of its own and checked. Else UNAVAILABLE with
// what failed (the driver has no such functions, or the device refuses
// them).
absl::Status ProbeStreamMemOps(int device);

}  // namespace mlaverify::kernels

#endif  // MLAVERIFY_KERNELS_STREAM_MEMOPS_H_
