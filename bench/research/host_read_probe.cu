// What reading page-locked host memory costs a kernel on this machine: grids
// of G blocks whose first thread each loads one word of mapped host memory
// (one page, as a batch's copy list would be read by every block of its copy
// grid), against the same grid loading device memory and against a grid that
// loads nothing; and one block reading a whole 5 KB list from host memory.
// CUDA events around 50 launches each, median per launch.
//
//   mlaverify-host-read-probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

namespace {

__global__ void ReadOneWord(const int* data, int* sink, bool cache_volatile) {
  if (threadIdx.x != 0) return;
  const int v = cache_volatile ? __ldcv(data + (blockIdx.x & 7)) : data[blockIdx.x & 7];
  if (v == 12345) *sink = v;
}

__global__ void ReadNothing(int* sink) {
  if (threadIdx.x == 0 && blockIdx.x == 1 << 30) *sink = 1;
}

__global__ void ReadList(const uint4* data, uint4* out, int vectors) {
  for (int i = threadIdx.x; i < vectors; i += blockDim.x) out[i] = __ldcv(data + i);
}

template <typename Launch>
float MedianMicros(Launch launch) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> t;
  for (int rep = 0; rep < 60; ++rep) {
    cudaEventRecord(a);
    launch();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    if (rep >= 10) t.push_back(ms * 1e3f);
  }
  std::sort(t.begin(), t.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return t[t.size() / 2];
}

}  // namespace

int main() {
  int *host = nullptr, *host_device = nullptr, *device = nullptr, *sink = nullptr;
  uint4* list_out = nullptr;
  if (cudaHostAlloc(&host, 1 << 16, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess ||
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_device), host, 0) != cudaSuccess ||
      cudaMalloc(&device, 1 << 16) != cudaSuccess || cudaMalloc(&sink, 64) != cudaSuccess ||
      cudaMalloc(&list_out, 1 << 16) != cudaSuccess) {
    std::printf("allocation failed\n");
    return 1;
  }
  cudaMemset(device, 0, 1 << 16);
  for (int g : {1, 70, 280, 652, 2000}) {
    const float host_cv = MedianMicros([&] { ReadOneWord<<<g, 256>>>(host_device, sink, true); });
    const float host_plain =
        MedianMicros([&] { ReadOneWord<<<g, 256>>>(host_device, sink, false); });
    const float dev = MedianMicros([&] { ReadOneWord<<<g, 256>>>(device, sink, true); });
    const float none = MedianMicros([&] { ReadNothing<<<g, 256>>>(sink); });
    std::printf(
        "grid %5d blocks: one host word per block %8.1f us (ld.cv) %8.1f us (ld); one device "
        "word %6.1f us; nothing %6.1f us\n",
        g, host_cv, host_plain, dev, none);
  }
  for (int bytes : {512, 5376, 65536}) {
    const float us = MedianMicros([&] {
      ReadList<<<1, 256>>>(reinterpret_cast<const uint4*>(host_device), list_out, bytes / 16);
    });
    std::printf("one block reading %6d bytes of host memory: %6.1f us\n", bytes, us);
  }
  const cudaError_t err = cudaDeviceSynchronize();
  std::printf("%s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
