// Device copies of a HostVerifyProblem for the GPU tests and the benchmark.
// Buffers are sized at construction and can be refilled with other problems
// of the same or smaller size (what a captured CUDA graph needs: fixed
// addresses, changing contents).
#ifndef MLAVERIFY_KERNELS_TESTING_DEVICE_PROBLEM_H_
#define MLAVERIFY_KERNELS_TESTING_DEVICE_PROBLEM_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/testing/verify_problem.h"
#include "kernels/verify_attention_cuda.h"

namespace mlaverify::kernels::testing {

// Owns one cudaMalloc allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  absl::Status Allocate(size_t bytes);
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Capacities a DeviceVerifyProblem is allocated for.
struct DeviceCapacity {
  int batch = 0;
  int max_draft_len = 0;
  int total_draft = 0;
  int num_heads = 0;
  int64_t pool_elems = 0;
  int64_t page_table_elems = 0;
  int64_t q_elems = 0;
  int64_t out_head_pad = 0;  // the output's head stride is 512 + out_head_pad
};

DeviceCapacity CapacityFor(const HostVerifyProblem& p);

class DeviceVerifyProblem {
 public:
  // Allocates buffers for `capacity` and the attention workspace.
  absl::Status Init(const DeviceCapacity& capacity, const VerifyLaunchConfig& config);
  // Copies the problem's inputs (pool, tables, lengths, trees, q, draft KV)
  // and poisons the outputs with NaN. Synchronous.
  absl::Status Upload(const HostVerifyProblem& p);
  // Argument structs over the device buffers for the last uploaded problem.
  // max_draft_len and batch come from the capacity, as in a graph bucket.
  VerifyArguments Args() const { return args_; }
  DraftKvWriteArguments WriteArgs() const { return write_args_; }
  void* workspace() const { return workspace_.as<void>(); }
  size_t workspace_bytes() const { return workspace_.bytes(); }
  // Fills out and lse with NaN (all bits set) on `stream`.
  absl::Status PoisonOutputs(cudaStream_t stream);
  // Copies out [total_draft, H, 512] (without the head padding) and lse
  // [total_draft, H] back. Synchronous.
  absl::Status Download(const HostVerifyProblem& p, std::vector<Bf16>* out,
                        std::vector<float>* lse) const;

 private:
  DeviceCapacity capacity_;
  DeviceBuffer pool_, page_table_, prefix_len_, draft_len_, layer_, visibility_, q_, draft_kv_,
      out_, lse_, workspace_;
  VerifyArguments args_;
  DraftKvWriteArguments write_args_;
};

// Empty when a CUDA device is usable; otherwise why not (what GPU tests
// print when they skip).
std::string NoUsableGpuReason();

// Largest sensible read bandwidth of the device (a streaming read kernel over
// `bytes`), in bytes per second. Used as the memory roof in reports.
absl::StatusOr<double> MeasureReadBandwidth(size_t bytes, int reps);

// Event-timed replays of an instantiated graph, the way every benchmark
// figure is taken: 5 warm-up replays, then `reps` timed ones, each after a
// memset of `flush` when given (it evicts L2, and it keeps the stream busy so
// that the replay is queued before the start event fires: the host's
// submission time is not part of the figure). Median and fastest replay.
struct GraphTiming {
  double median_us = 0.0;
  double min_us = 0.0;
};
absl::StatusOr<GraphTiming> TimeGraphReplays(cudaGraphExec_t exec, cudaStream_t stream, int reps,
                                             const DeviceBuffer* flush);

// Median time, in microseconds, of a CUDA graph holding one empty kernel of
// `ctas` x `threads` with `smem_bytes` of dynamic shared memory (launched
// cooperatively when asked), timed by TimeGraphReplays with the benchmark's
// `flush` buffer as the benchmark times the verify graph: the part of a small
// launch's figure that no kernel change can remove.
absl::StatusOr<double> MeasureLaunchFloorUs(int ctas, int threads, int smem_bytes, bool cooperative,
                                            int reps, const DeviceBuffer& flush);

}  // namespace mlaverify::kernels::testing

#endif  // MLAVERIFY_KERNELS_TESTING_DEVICE_PROBLEM_H_
