// The copy-list kernels (copy_list.h). A block runs one descriptor (grid.y)
// and every row_blocks-th row of it (grid.x); its threads move a row in the
// widest access the descriptor's addresses allow. Both kernels have a fixed
// grid for a bucket and read the list's length from memory, so they sit in
// captured graphs.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/copy_list.h"
#include "kernels/verify_params.h"

namespace mlaverify::kernels {
namespace {

constexpr int COPY_THREADS = 256;
constexpr int UNROLL = 4;

// Loads that bypass the caches: a slot and the staging it points at are
// host memory the host rewrites between launches.
__device__ __forceinline__ uint4 Load(const uint4* p) { return __ldcv(p); }
__device__ __forceinline__ uint2 Load(const uint2* p) { return __ldcv(p); }
__device__ __forceinline__ unsigned int Load(const unsigned int* p) { return __ldcv(p); }
__device__ __forceinline__ unsigned short Load(const unsigned short* p) { return __ldcv(p); }
__device__ __forceinline__ unsigned char Load(const unsigned char* p) { return __ldcv(p); }

template <typename V>
__device__ __forceinline__ void CopyRows(const CopyDescriptor& d, int first_row, int row_step) {
  const int per_row = static_cast<int>(d.row_bytes / sizeof(V));
  for (int r = first_row; r < static_cast<int>(d.rows); r += row_step) {
    const V* src = reinterpret_cast<const V*>(d.src + static_cast<uint64_t>(r) * d.src_pitch);
    V* dst = reinterpret_cast<V*>(d.dst + static_cast<uint64_t>(r) * d.dst_pitch);
    // UNROLL loads in flight per thread before their stores: a row read
    // across PCIe waits microseconds per access.
    for (int i0 = threadIdx.x; i0 < per_row; i0 += COPY_THREADS * UNROLL) {
      V v[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int i = i0 + u * COPY_THREADS;
        if (i < per_row) v[u] = Load(src + i);
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int i = i0 + u * COPY_THREADS;
        if (i < per_row) dst[i] = v[u];
      }
    }
  }
}

__device__ __forceinline__ void RunDescriptor(const CopyDescriptor& d, int first_row,
                                              int row_step) {
  const uint64_t bits = d.src | d.dst | d.src_pitch | d.dst_pitch | d.row_bytes;
  if ((bits & 15) == 0) {
    CopyRows<uint4>(d, first_row, row_step);
  } else if ((bits & 7) == 0) {
    CopyRows<uint2>(d, first_row, row_step);
  } else if ((bits & 3) == 0) {
    CopyRows<unsigned int>(d, first_row, row_step);
  } else if ((bits & 1) == 0) {
    CopyRows<unsigned short>(d, first_row, row_step);
  } else {
    CopyRows<unsigned char>(d, first_row, row_step);
  }
}

__global__ void __launch_bounds__(COPY_THREADS) GatherKernel(const GatherParams p) {
  __shared__ int32_t s_slot;
  __shared__ int32_t s_count;
  __shared__ uint4 s_desc[2];
  if (threadIdx.x == 0) s_slot = *reinterpret_cast<volatile int32_t*>(p.cursor);
  __syncthreads();
  const auto* list = reinterpret_cast<const CopyListHeader*>(
      p.slots + static_cast<uint64_t>(s_slot) * p.slot_bytes);
  // The count and this block's descriptor are read side by side (one
  // round trip to host memory, not two).
  if (threadIdx.x == 0) s_count = __ldcv(&list->count);
  if (threadIdx.x == 32 || threadIdx.x == 33) {
    const auto* entry = reinterpret_cast<const uint4*>(CopyListEntries(list) + blockIdx.y);
    s_desc[threadIdx.x - 32] = __ldcv(entry + (threadIdx.x - 32));
  }
  __syncthreads();
  if (static_cast<int>(blockIdx.y) < s_count) {
    const CopyDescriptor d = *reinterpret_cast<const CopyDescriptor*>(s_desc);
    RunDescriptor(d, blockIdx.x, gridDim.x);
  }
  // The last block to finish moves the cursor to the next slot (every block
  // has read it by then) and leaves the arrival count zero for the next launch.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned int blocks = gridDim.x * gridDim.y;
    if (atomicAdd(p.arrivals, 1u) == blocks - 1) {
      *p.arrivals = 0;
      *p.cursor = s_slot + 1 == p.num_slots ? 0 : s_slot + 1;
      __threadfence();
    }
  }
}

__global__ void __launch_bounds__(COPY_THREADS) ScatterKernel(const ScatterParams p) {
  const int count = p.list->count;
  if (static_cast<int>(blockIdx.y) >= count) return;
  const CopyDescriptor d = CopyListEntries(p.list)[blockIdx.y];
  RunDescriptor(d, blockIdx.x, gridDim.x);
}

}  // namespace

cudaError_t LaunchGatherKernel(const GatherParams& p, cudaStream_t stream) {
  if (p.capacity < 1 || p.row_blocks < 1) return cudaErrorInvalidValue;
  GatherKernel<<<dim3(p.row_blocks, p.capacity), COPY_THREADS, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchScatterKernel(const ScatterParams& p, cudaStream_t stream) {
  if (p.capacity < 1 || p.row_blocks < 1) return cudaErrorInvalidValue;
  ScatterKernel<<<dim3(p.row_blocks, p.capacity), COPY_THREADS, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mlaverify::kernels
