// The copy-list kernels (copy_list.h). A list runs with a block per
// descriptor (grid.y) and row (every row_blocks-th row, grid.x); its threads
// move a row in the widest access the descriptor's addresses allow. The
// grids are fixed for a bucket and the lists' lengths are read from memory,
// so the kernels sit in captured graphs. The gather first fetches its list
// from the host slot with one block: reading host memory from every block of
// the copy grid cost ~1 us of device time per block on the H200
// (bench/NOTES.md, "The gather reads its list with plain loads").
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/copy_list.h"
#include "kernels/verify_params.h"

namespace mlaverify::kernels {
namespace {

constexpr int COPY_THREADS = 256;
constexpr int UNROLL = 4;

// Plain loads: a launch sees what the host wrote before it was launched.
// (ld.global.cv, which refetches every access, cost ~1 us per load of host
// memory, serialised, on the H200: bench/research/host_read_probe.cu.)
template <typename V>
__device__ __forceinline__ V Load(const V* p) {
  return *p;
}

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

__device__ __forceinline__ uint64_t GlobalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One block: the slot's list (capacity entries, whatever the count) into
// device memory, then the cursor to the next slot.
__global__ void __launch_bounds__(COPY_THREADS) FetchKernel(const GatherParams p) {
  __shared__ int32_t s_slot;
  if (threadIdx.x == 0) {
    s_slot = *p.cursor;
    if (p.stamps != nullptr) p.stamps[2 * s_slot] = GlobalTimer();
  }
  __syncthreads();
  const auto* src =
      reinterpret_cast<const uint4*>(p.slots + static_cast<uint64_t>(s_slot) * p.slot_bytes);
  auto* dst = reinterpret_cast<uint4*>(p.list);
  const int vectors = static_cast<int>(CopyListBytes(p.capacity) / sizeof(uint4));
  for (int i = threadIdx.x; i < vectors; i += COPY_THREADS) dst[i] = src[i];
  __syncthreads();
  if (threadIdx.x == 0) *p.cursor = s_slot + 1 == p.num_slots ? 0 : s_slot + 1;
}

// This block's part of a list in device memory: descriptor blockIdx.y,
// rows blockIdx.x + k * gridDim.x.
__device__ __forceinline__ void RunListBlock(const CopyListHeader* list) {
  if (static_cast<int>(blockIdx.y) >= list->count) return;
  const CopyDescriptor d = CopyListEntries(list)[blockIdx.y];
  RunDescriptor(d, blockIdx.x, gridDim.x);
}

__global__ void __launch_bounds__(COPY_THREADS) RunListKernel(const CopyListHeader* list) {
  RunListBlock(list);
}

// The scatter of a stamped launch (a step lane's layer): block (0, 0)
// records when the attention was done, then the list runs.
__global__ void __launch_bounds__(COPY_THREADS)
    StampedRunListKernel(const CopyListHeader* list, uint64_t* stamps, const int32_t* cursor,
                         int32_t num_slots) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    const int32_t slot = (*cursor + num_slots - 1) % num_slots;
    stamps[2 * slot + 1] = GlobalTimer();
  }
  RunListBlock(list);
}

}  // namespace

cudaError_t LaunchGatherKernel(const GatherParams& p, cudaStream_t stream) {
  if (p.capacity < 1 || p.row_blocks < 1) return cudaErrorInvalidValue;
  FetchKernel<<<1, COPY_THREADS, 0, stream>>>(p);
  RunListKernel<<<dim3(p.row_blocks, p.capacity), COPY_THREADS, 0, stream>>>(p.list);
  return cudaGetLastError();
}

cudaError_t LaunchScatterKernel(const ScatterParams& p, cudaStream_t stream) {
  if (p.capacity < 1 || p.row_blocks < 1) return cudaErrorInvalidValue;
  if (p.stamps != nullptr) {
    StampedRunListKernel<<<dim3(p.row_blocks, p.capacity), COPY_THREADS, 0, stream>>>(
        p.list, p.stamps, p.cursor, p.num_slots);
    return cudaGetLastError();
  }
  RunListKernel<<<dim3(p.row_blocks, p.capacity), COPY_THREADS, 0, stream>>>(p.list);
  return cudaGetLastError();
}

}  // namespace mlaverify::kernels
