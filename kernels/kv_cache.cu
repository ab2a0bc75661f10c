// Pool maintenance kernels: write a verify step's draft rows, compact the
// accepted path at commit. Both move 16-byte vectors (a bf16 latent row is 72
// of them, an fp8 row 41) and are safe inside CUDA graphs (sizes from device
// memory, fixed grid). Rows entering an fp8 pool are quantized with the
// common/kv_dtype.h code the CPU backend runs, so both store the same bytes.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/kv_dtype.h"
#include "kernels/verify_params.h"

namespace mlaverify::kernels {
namespace {

constexpr int ROW_VECTORS = 576 / 8;  // uint4 per bf16 latent row
constexpr int MAX_DRAFTS = 64;
constexpr int WRITE_THREADS = 128;
constexpr int COMPACT_THREADS = 256;
constexpr int COMPACT_VECTORS_PER_THREAD =
    (MAX_DRAFTS * ROW_VECTORS + COMPACT_THREADS - 1) / COMPACT_THREADS;

constexpr int FP8_ROW_ELEMENTS = kFp8RowBytes / 2;  // 328: an fp8 row in 2-byte units
static_assert(WRITE_THREADS % 32 == 0, "rows are quantized by whole warps");
static_assert(kFp8GroupSize == 32 * 4, "each lane quantizes four values of its group");

__device__ __forceinline__ int64_t RowOffset(int layer, int64_t num_pages, int page_size_log2,
                                             const int32_t* pages, int64_t position,
                                             int row_elements) {
  const int64_t page = pages[position >> page_size_log2];
  const int64_t in_page = position & ((int64_t{1} << page_size_log2) - 1);
  return ((static_cast<int64_t>(layer) * num_pages + page) << page_size_log2 | in_page) *
         row_elements;
}

// The codes of QuantizeFp8Value(v[k], scale) for k = 0..3, low byte first.
// From sm_89 on, two cvt.rn.satfinite.e4m3x2 (round to nearest even,
// saturating at ±448) replace common/kv_dtype.h's integer rounding: the same
// codes for every finite input, and only finite rows reach the pool (the
// engine refuses rows holding NaN or Inf). The GPU tests compare the bytes
// with the CPU's. A zero scale (an all-zero group) gives zero codes, as on
// the host.
__device__ __forceinline__ uint32_t QuantizeFour(const float (&v)[4], float scale) {
#if __CUDA_ARCH__ >= 890
  if (!(scale > 0.0f)) return 0;
  uint16_t low, high;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(low) : "f"(v[1] / scale), "f"(v[0] / scale));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;"
      : "=h"(high)
      : "f"(v[3] / scale), "f"(v[2] / scale));
  return static_cast<uint32_t>(low) | static_cast<uint32_t>(high) << 16;
#else
  return static_cast<uint32_t>(QuantizeFp8Value(v[0], scale)) |
         static_cast<uint32_t>(QuantizeFp8Value(v[1], scale)) << 8 |
         static_cast<uint32_t>(QuantizeFp8Value(v[2], scale)) << 16 |
         static_cast<uint32_t>(QuantizeFp8Value(v[3], scale)) << 24;
#endif
}

// A bf16 row (576 values, 16-byte aligned) into a 656-byte fp8 row, by one
// warp: lane l holds values 4l..4l+3 of every group, the four groups' amax
// reductions run side by side, lanes 0-7 copy the rope values. One warp per
// row lets the row copy put four rows in a CTA, more rows in flight per SM.
__device__ __forceinline__ void QuantizeRowWarp(const uint16_t* src, uint16_t* dst_row, int lane) {
  auto* dst = reinterpret_cast<uint8_t*>(dst_row);
  float v[kFp8Groups][4];
  float amax[kFp8Groups];
#pragma unroll
  for (int g = 0; g < kFp8Groups; ++g) {
    const uint2 packed = reinterpret_cast<const uint2*>(src + g * kFp8GroupSize)[lane];
    v[g][0] = __uint_as_float(packed.x << 16);
    v[g][1] = __uint_as_float(packed.x & 0xffff0000u);
    v[g][2] = __uint_as_float(packed.y << 16);
    v[g][3] = __uint_as_float(packed.y & 0xffff0000u);
    amax[g] = fmaxf(fmaxf(fabsf(v[g][0]), fabsf(v[g][1])), fmaxf(fabsf(v[g][2]), fabsf(v[g][3])));
  }
  uint4 rope{};
  if (lane < kRopeDim * 2 / 16) rope = reinterpret_cast<const uint4*>(src + kValueDim)[lane];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
    for (int g = 0; g < kFp8Groups; ++g) {
      amax[g] = fmaxf(amax[g], __shfl_xor_sync(0xffffffffu, amax[g], offset));
    }
  }
#pragma unroll
  for (int g = 0; g < kFp8Groups; ++g) {
    const float scale = Fp8GroupScale(amax[g]);
    const uint32_t codes = QuantizeFour(v[g], scale);
    reinterpret_cast<uint32_t*>(dst + g * kFp8GroupSize)[lane] = codes;
    if (lane == g) reinterpret_cast<float*>(dst + kFp8ScaleOffset)[g] = scale;
  }
  if (lane < kRopeDim * 2 / 16) reinterpret_cast<uint4*>(dst + kFp8RopeOffset)[lane] = rope;
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
  if (b >= p.batch) return;
  const int32_t* pages = p.page_table + (p.page_table_offset != nullptr ? p.page_table_offset[b]
                                                                        : b * p.page_table_stride);
  const int64_t dst = RowOffset(p.layer[b], p.num_pages, p.page_size_log2, pages,
                                static_cast<int64_t>(p.prefix_len[b]) + s_index, p.row_elements);
  const uint16_t* src_row = p.draft_kv + blockIdx.x * p.draft_kv_stride;
  if (p.row_elements == FP8_ROW_ELEMENTS) {
    if (threadIdx.x < 32) QuantizeRowWarp(src_row, p.pool + dst, threadIdx.x);
    return;
  }
  if (threadIdx.x >= ROW_VECTORS) return;
  reinterpret_cast<uint4*>(p.pool + dst)[threadIdx.x] =
      reinterpret_cast<const uint4*>(src_row)[threadIdx.x];
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
  // 72 vectors per bf16 row, 41 per fp8 row: the staging is sized for bf16.
  const int row_vectors = p.row_elements / 8;
  uint4 staged[COMPACT_VECTORS_PER_THREAD];
#pragma unroll
  for (int u = 0; u < COMPACT_VECTORS_PER_THREAD; ++u) {
    const int v = threadIdx.x + u * COMPACT_THREADS;
    if (v < k * row_vectors) {
      const int t = v / row_vectors;
      const int64_t src =
          RowOffset(layer, p.num_pages, p.page_size_log2, pages, prefix + path[t], p.row_elements);
      staged[u] = reinterpret_cast<const uint4*>(p.pool + src)[v % row_vectors];
    }
  }
  __syncthreads();
#pragma unroll
  for (int u = 0; u < COMPACT_VECTORS_PER_THREAD; ++u) {
    const int v = threadIdx.x + u * COMPACT_THREADS;
    if (v < k * row_vectors) {
      const int t = v / row_vectors;
      if (path[t] == t) continue;  // already in place
      const int64_t dst =
          RowOffset(layer, p.num_pages, p.page_size_log2, pages, prefix + t, p.row_elements);
      reinterpret_cast<uint4*>(p.pool + dst)[v % row_vectors] = staged[u];
    }
  }
}

// One CTA per (row, layer); 72 threads move one bf16 row (41 an fp8 row out
// of the pool).
__global__ void __launch_bounds__(WRITE_THREADS)
    RowCopyKernel(const RowCopyParams p, bool to_pool) {
  const int64_t t = blockIdx.x;
  const int layer = blockIdx.y;
  const int64_t pool_row =
      RowOffset(layer, p.num_pages, p.page_size_log2, p.page_table, p.start + t, p.row_elements);
  if (threadIdx.x >= p.row_elements / 8) return;
  uint4* pool = reinterpret_cast<uint4*>(p.pool + pool_row);
  uint4* rows = reinterpret_cast<uint4*>(
      p.rows + (layer * p.count + t) * (to_pool ? int64_t{576} : int64_t{p.row_elements}));
  if (to_pool) {
    pool[threadIdx.x] = rows[threadIdx.x];
  } else {
    rows[threadIdx.x] = pool[threadIdx.x];
  }
}

// Into an fp8 pool: one warp per (row, layer), QUANTIZE_ROWS_PER_CTA rows of
// one layer per CTA.
constexpr int QUANTIZE_ROWS_PER_CTA = WRITE_THREADS / 32;
__global__ void __launch_bounds__(WRITE_THREADS) QuantizingRowCopyKernel(const RowCopyParams p) {
  const int64_t t = int64_t{blockIdx.x} * QUANTIZE_ROWS_PER_CTA + threadIdx.x / 32;
  const int layer = blockIdx.y;
  if (t >= p.count) return;  // whole warps exit: the shuffles see full warps
  const int64_t pool_row =
      RowOffset(layer, p.num_pages, p.page_size_log2, p.page_table, p.start + t, p.row_elements);
  QuantizeRowWarp(p.rows + (layer * p.count + t) * 576, p.pool + pool_row, threadIdx.x % 32);
}

}  // namespace

cudaError_t LaunchRowCopyKernel(const RowCopyParams& p, bool to_pool, cudaStream_t stream) {
  if (p.count <= 0) return cudaSuccess;
  if (to_pool && p.row_elements == FP8_ROW_ELEMENTS) {
    const auto ctas =
        static_cast<unsigned>((p.count + QUANTIZE_ROWS_PER_CTA - 1) / QUANTIZE_ROWS_PER_CTA);
    QuantizingRowCopyKernel<<<dim3(ctas, p.num_layers), WRITE_THREADS, 0, stream>>>(p);
    return cudaGetLastError();
  }
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
