// Tree-masked verify attention over the paged latent KV pool: the arguments
// every executor takes (the CUDA kernels and the CPU reference), and the
// validation of them. No CUDA headers here: the CPU backend includes this.
//
// Math (docs/kernel.md, "What one launch computes"), for request b with
// prefix length P = prefix_len[b], N = draft_len[b] drafts stored in the pool
// at positions P..P+N-1, query token i in 0..N-1 and head h:
//   s[j]   = scale_b * dot(q[i,h,:576], kv[j,:576])   for visible j
//   o[i,h] = sum_j softmax(s)[j] * kv[j,:512]
//   lse    = ln sum_j exp(s[j])
// with visible(i) = {0..P-1} and {P+a : bit a of visibility[i] is set}.
#ifndef MLAVERIFY_KERNELS_VERIFY_ATTENTION_H_
#define MLAVERIFY_KERNELS_VERIFY_ATTENTION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "common/bf16.h"
#include "common/draft_tree.h"
#include "common/geometry.h"
#include "common/kv_dtype.h"

namespace mlaverify::kernels {

// The paged latent KV pool of one device: layer-major
// [num_layers][num_pages][page_size][row], a row being KvRowBytes(dtype)
// bytes (common/kv_dtype.h: 576 bf16, or the 656-byte fp8 row). A sequence's
// page table (int32 page ids) is shared by all layers.
struct KvPoolView {
  // [num_layers, num_pages, page_size, RowElements()]: addressed in 2-byte
  // units for both dtypes (656 = 2 * 328), so offsets stay element offsets.
  Bf16* data = nullptr;
  int num_layers = 0;
  int64_t num_pages = 0;
  int page_size = 0;  // power of two, 1..kMaxPageSize
  KvDtype dtype = KvDtype::kBf16;

  int64_t RowElements() const { return KvRowBytes(dtype) / static_cast<int>(sizeof(Bf16)); }
  // Element offset of the row holding token `position` of a sequence whose
  // page table is `pages`.
  int64_t RowOffset(int layer, const int32_t* pages, int64_t position) const {
    const int64_t page = pages[position / page_size];
    return ((static_cast<int64_t>(layer) * num_pages + page) * page_size + position % page_size) *
           RowElements();
  }
  uint8_t* RowBytes(int layer, const int32_t* pages, int64_t position) const {
    return reinterpret_cast<uint8_t*>(data + RowOffset(layer, pages, position));
  }
};

// One verify launch: `batch` requests, each with its own prefix length, draft
// count, layer and page table. Pointers are device pointers for the CUDA path
// and host pointers for the CPU reference. Every per-request value is read
// from memory (not passed by value) so that a captured CUDA graph stays valid
// when lengths change between replays.
struct VerifyArguments {
  int batch = 0;          // requests; a request with draft_len 0 is padding
  int num_heads = 0;      // H: query heads on this device, 1..kMaxHeads
  int max_draft_len = 0;  // upper bound on every draft_len[b], 1..kMaxDraftLen
  // Rows available in q / out / lse / visibility: sum_b draft_len[b] must not
  // exceed it.
  int total_draft_capacity = 0;

  // Absorbed queries [total_draft, num_heads, 576] bf16. Request b's drafts
  // start at token row sum_{b' < b} draft_len[b'] (packed, no gaps).
  const Bf16* q = nullptr;
  int64_t q_token_stride = 0;  // elements between draft tokens
  int64_t q_head_stride = 0;   // elements between heads; rows are contiguous

  KvPoolView pool;
  // Request b's page ids start at PageRow(b) (below): page_table + b *
  // page_table_stride, or + page_table_offset[b] when that is set (the
  // per-sequence tables of a device's page-table arena). The pipelined
  // kernel spells the same rule out (verify_pipelined_kernel.cuh).
  const int32_t* page_table = nullptr;
  int64_t page_table_stride = 0;               // elements between requests' rows
  const int64_t* page_table_offset = nullptr;  // [batch] or nullptr
  const int32_t* prefix_len = nullptr;         // [batch] P_b >= 0
  const int32_t* draft_len = nullptr;          // [batch] N_b in 0..max_draft_len
  const int32_t* layer = nullptr;              // [batch] in 0..pool.num_layers-1
  // [batch] per-request softmax scale, or nullptr for default_softmax_scale.
  const float* softmax_scale = nullptr;
  float default_softmax_scale = 0.0f;
  // [total_draft] ancestor-or-self bit sets, see BuildVisibility().
  const uint64_t* visibility = nullptr;

  // Outputs: out [total_draft, num_heads, 512] bf16, lse [total_draft,
  // num_heads] fp32 natural log, contiguous.
  Bf16* out = nullptr;
  int64_t out_token_stride = 0;
  int64_t out_head_stride = 0;
  float* lse = nullptr;

  const int32_t* PageRow(int b) const {
    return page_table +
           (page_table_offset != nullptr ? page_table_offset[b] : b * page_table_stride);
  }
};

// Checks everything that can be checked without reading the per-request
// arrays (which may live on the device): sizes, strides, alignment, page size.
// Returns INVALID_ARGUMENT with the reason. `require_16b_alignment` is set by
// the CUDA path, whose loads are 16-byte vectors.
absl::Status CanImplement(const VerifyArguments& args, bool require_16b_alignment);

// Checks the per-request values against the pool and the limits. Only for
// host-resident arrays: the CPU reference and the client's reference check
// call it. The engine does not: it builds P, N and the page tables from its
// own sequence state, bounded by its submission checks.
absl::Status ValidateRequests(const VerifyArguments& args);

}  // namespace mlaverify::kernels

#endif  // MLAVERIFY_KERNELS_VERIFY_ATTENTION_H_
