// The benchmark's device-side measurements: graph-replay timing (how every
// row is timed), and two probes reported beside the rows: a streaming read
// kernel (the memory roof: bytes read once, 16-byte loads, several in flight
// per thread) and the launch floor (an empty kernel's graph, timed the same
// way).
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "kernels/testing/device_problem.h"

namespace mlaverify::kernels::testing {
namespace {

__global__ void ReadKernel(const uint4* __restrict__ data, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldcs(data + i);
    const uint4 b = __ldcs(data + i + stride);
    const uint4 c = __ldcs(data + i + 2 * stride);
    const uint4 d = __ldcs(data + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^
           d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = __ldcs(data + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads alive
}

// Does nothing: what a launch costs before the kernel's first instruction and
// after its last.
__global__ void EmptyKernel() {}

}  // namespace

absl::StatusOr<double> MeasureReadBandwidth(size_t bytes, int reps) {
  DeviceBuffer buffer, sink;
  if (auto s = buffer.Allocate(bytes); !s.ok()) return s;
  if (auto s = sink.Allocate(sizeof(uint32_t)); !s.ok()) return s;
  cudaMemset(buffer.as<void>(), 0x5a, bytes);
  int sms = 0, device = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const size_t n = bytes / sizeof(uint4);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> times;
  for (int r = 0; r < reps + 2; ++r) {
    cudaEventRecord(start);
    ReadKernel<<<sms * 8, 512>>>(buffer.as<uint4>(), n, sink.as<uint32_t>());
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    if (r >= 2) times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return absl::InternalError(std::string("read bandwidth kernel: ") + cudaGetErrorString(err));
  }
  std::sort(times.begin(), times.end());
  const double median_s = times[times.size() / 2] * 1e-3;
  return static_cast<double>(bytes) / median_s;
}

absl::StatusOr<GraphTiming> TimeGraphReplays(cudaGraphExec_t exec, cudaStream_t stream, int reps,
                                             const DeviceBuffer* flush) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> times;
  for (int r = -5; r < reps; ++r) {
    if (flush != nullptr) cudaMemsetAsync(flush->as<void>(), r & 0xff, flush->bytes(), stream);
    cudaEventRecord(start, stream);
    cudaGraphLaunch(exec, stream);
    cudaEventRecord(stop, stream);
    if (cudaEventSynchronize(stop) != cudaSuccess) break;
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    if (r >= 0) times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || times.empty()) {
    return absl::InternalError(std::string("timing failed: ") + cudaGetErrorString(err));
  }
  std::sort(times.begin(), times.end());
  return GraphTiming{times[times.size() / 2] * 1e3, times.front() * 1e3};
}

absl::StatusOr<double> MeasureLaunchFloorUs(int ctas, int threads, int smem_bytes, bool cooperative,
                                            int reps, const DeviceBuffer& flush) {
  const void* kernel = reinterpret_cast<const void*>(&EmptyKernel);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) !=
      cudaSuccess) {
    return absl::InternalError(std::string("launch floor: shared memory attribute: ") +
                               cudaGetErrorString(cudaGetLastError()));
  }
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeCooperative;
  attribute.val.cooperative = 1;
  config.attrs = &attribute;
  config.numAttrs = cooperative ? 1 : 0;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
  cudaError_t err = cudaLaunchKernelExC(&config, kernel, nullptr);
  const cudaError_t capture = cudaStreamEndCapture(stream, &graph);
  if (err == cudaSuccess) err = capture;
  if (err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
  const absl::StatusOr<GraphTiming> timing =
      err == cudaSuccess
          ? TimeGraphReplays(exec, stream, reps, &flush)
          : absl::StatusOr<GraphTiming>(absl::InternalError(
                std::string("launch floor: graph not built: ") + cudaGetErrorString(err)));
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  if (!timing.ok()) return timing.status();
  return timing->median_us;
}

}  // namespace mlaverify::kernels::testing
