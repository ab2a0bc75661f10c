// Pool maintenance kernels: write a verify step's draft rows, compact the
// accepted path at commit. Both move 16-byte vectors (a latent row is 72 of
// them) and are safe inside CUDA graphs (sizes from device memory, fixed grid).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/verify_params.h"

namespace mlaverify::kernels {
namespace {

constexpr int ROW_VECTORS = 576 / 8;  // uint4 per latent row
constexpr int MAX_DRAFTS = 64;
constexpr int WRITE_THREADS = 128;
constexpr int COMPACT_THREADS = 256;
constexpr int COMPACT_VECTORS_PER_THREAD =
    (MAX_DRAFTS * ROW_VECTORS + COMPACT_THREADS - 1) / COMPACT_THREADS;

__device__ __forceinline__ int64_t RowOffset(int layer, int64_t num_pages, int page_size_log2,
                                             const int32_t* pages, int64_t position) {
  const int64_t page = pages[position >> page_size_log2];
  const int64_t in_page = position & ((int64_t{1} << page_size_log2) - 1);
  return ((static_cast<int64_t>(layer) * num_pages + page) << page_size_log2 | in_page) * 576;
}

// One CTA per draft row of the capacity; rows past the live total exit.
__global__ void __launch_bounds__(WRITE_THREADS) DraftKvWriteKernel(const DraftKvWriteParams p) {
  __shared__ int s_request, s_index;
  if (threadIdx.x == 0) {
    int row = blockIdx.x, b = 0;
    while (b < p.batch && row >= p.draft_len[b]) row -= p.draft_len[b++];
    s_request = b;
    s_index = row;
  }
  __syncthreads();
  const int b = s_request;
  if (b >= p.batch || threadIdx.x >= ROW_VECTORS) return;
  const int32_t* pages = p.page_table + b * p.page_table_stride;
  const int64_t dst = RowOffset(p.layer[b], p.num_pages, p.page_size_log2, pages,
                                static_cast<int64_t>(p.prefix_len[b]) + s_index);
  const uint4* src = reinterpret_cast<const uint4*>(p.draft_kv + blockIdx.x * p.draft_kv_stride);
  reinterpret_cast<uint4*>(p.pool + dst)[threadIdx.x] = src[threadIdx.x];
}

// One CTA per (layer, request): reads every accepted row into registers,
// then writes them to P..P+k-1. Reading all before writing any makes the
// in-place move safe when a destination is another step's source.
__global__ void __launch_bounds__(COMPACT_THREADS) CompactKernel(const CompactParams p) {
  const int layer = blockIdx.x;
  const int b = blockIdx.y;
  const int k = p.accepted_len[b];
  if (k == 0) return;
  const int32_t* pages = p.page_table + b * p.page_table_stride;
  const int32_t* path = p.accepted + b * MAX_DRAFTS;
  const int64_t prefix = p.prefix_len[b];
  uint4 staged[COMPACT_VECTORS_PER_THREAD];
#pragma unroll
  for (int u = 0; u < COMPACT_VECTORS_PER_THREAD; ++u) {
    const int v = threadIdx.x + u * COMPACT_THREADS;
    if (v < k * ROW_VECTORS) {
      const int t = v / ROW_VECTORS;
      const int64_t src = RowOffset(layer, p.num_pages, p.page_size_log2, pages, prefix + path[t]);
      staged[u] = reinterpret_cast<const uint4*>(p.pool + src)[v % ROW_VECTORS];
    }
  }
  __syncthreads();
#pragma unroll
  for (int u = 0; u < COMPACT_VECTORS_PER_THREAD; ++u) {
    const int v = threadIdx.x + u * COMPACT_THREADS;
    if (v < k * ROW_VECTORS) {
      const int t = v / ROW_VECTORS;
      if (path[t] == t) continue;  // already in place
      const int64_t dst = RowOffset(layer, p.num_pages, p.page_size_log2, pages, prefix + t);
      reinterpret_cast<uint4*>(p.pool + dst)[v % ROW_VECTORS] = staged[u];
    }
  }
}

// One CTA per (row, layer); 72 threads move one latent row.
__global__ void __launch_bounds__(WRITE_THREADS)
    RowCopyKernel(const RowCopyParams p, bool to_pool) {
  const int64_t t = blockIdx.x;
  const int layer = blockIdx.y;
  if (threadIdx.x >= ROW_VECTORS) return;
  const int64_t pool_row =
      RowOffset(layer, p.num_pages, p.page_size_log2, p.page_table, p.start + t);
  uint4* pool = reinterpret_cast<uint4*>(p.pool + pool_row);
  uint4* rows = reinterpret_cast<uint4*>(p.rows + (layer * p.count + t) * 576);
  if (to_pool) {
    pool[threadIdx.x] = rows[threadIdx.x];
  } else {
    rows[threadIdx.x] = pool[threadIdx.x];
  }
}

}  // namespace

cudaError_t LaunchRowCopyKernel(const RowCopyParams& p, bool to_pool, cudaStream_t stream) {
  if (p.count <= 0) return cudaSuccess;
  RowCopyKernel<<<dim3(static_cast<unsigned>(p.count), p.num_layers), WRITE_THREADS, 0, stream>>>(
      p, to_pool);
  return cudaGetLastError();
}

cudaError_t LaunchDraftKvWriteKernel(const DraftKvWriteParams& p, cudaStream_t stream) {
  DraftKvWriteKernel<<<p.total_draft_capacity, WRITE_THREADS, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchCompactKernel(const CompactParams& p, cudaStream_t stream) {
  CompactKernel<<<dim3(p.num_layers, p.batch), COMPACT_THREADS, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mlaverify::kernels
