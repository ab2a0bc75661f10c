// mlaverify-cluster-probe: how many thread-block clusters of each size the
// device holds at once with one verify-sized CTA per SM (bench/NOTES.md,
// "Clusters"). A split row tile whose splits all sit in one cluster could
// merge its partials through distributed shared memory instead of global
// memory, a fence and a spin-wait; this says how many CTAs such a launch
// could keep resident per cluster size. It launches nothing: it asks
// cudaOccupancyMaxActiveClusters about an empty kernel whose shared memory
// (more than half an SM's) keeps it to one CTA per SM, like the attention
// kernel's registers do.
//
//   mlaverify-cluster-probe [--smem BYTES]
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <cstdio>

namespace {

__global__ void __launch_bounds__(256, 1) EmptyClusterKernel(int* sink) {
  extern __shared__ int smem[];
  if (sink != nullptr && threadIdx.x == 0) sink[blockIdx.x] = smem[0];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"mlaverify-cluster-probe: resident clusters per size at one CTA per SM"};
  int smem = 0;
  app.add_option("--smem", smem,
                 "dynamic shared memory per CTA (default: just over half the SM's)");
  CLI11_PARSE(app, argc, argv);
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    std::fprintf(stderr, "mlaverify-cluster-probe needs a CUDA device; none found\n");
    return 3;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  if (smem == 0) smem = static_cast<int>(prop.sharedMemPerMultiprocessor / 2 + 1024);
  if (cudaFuncSetAttribute(EmptyClusterKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
          cudaSuccess ||
      cudaFuncSetAttribute(EmptyClusterKernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) !=
          cudaSuccess) {
    std::fprintf(stderr, "cudaFuncSetAttribute failed: %s\n",
                 cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  std::printf("%s (sm_%d%d), %d SMs, %d B dynamic shared memory per CTA, 256 threads\n", prop.name,
              prop.major, prop.minor, prop.multiProcessorCount, smem);
  std::printf("%8s %16s %14s\n", "cluster", "active clusters", "resident CTAs");
  for (int size = 1; size <= 16; size *= 2) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(size * 64);
    config.blockDim = dim3(256);
    config.dynamicSmemBytes = static_cast<size_t>(smem);
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = static_cast<unsigned>(size);
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    int clusters = 0;
    const cudaError_t err = cudaOccupancyMaxActiveClusters(&clusters, EmptyClusterKernel, &config);
    if (err != cudaSuccess) {
      std::printf("%8d %16s (%s)\n", size, "-", cudaGetErrorString(err));
      cudaGetLastError();
      continue;
    }
    std::printf("%8d %16d %14d\n", size, clusters, clusters * size);
  }
  return 0;
}
