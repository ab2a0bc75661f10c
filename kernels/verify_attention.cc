#include "kernels/verify_attention.h"

#include <cstdint>

#include "absl/strings/str_cat.h"

namespace mlaverify::kernels {
namespace {

bool IsPowerOfTwo(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

absl::Status CanImplement(const VerifyArguments& a, bool require_16b_alignment) {
  if (a.batch < 1 || a.batch > kMaxBatch) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch = ", a.batch, ": must be in 1..", kMaxBatch));
  }
  if (a.num_heads < 1 || a.num_heads > kMaxHeads) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_heads = ", a.num_heads, ": must be in 1..", kMaxHeads));
  }
  if (a.max_draft_len < 1 || a.max_draft_len > kMaxDraftLen) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_draft_len = ", a.max_draft_len, ": must be in 1..", kMaxDraftLen));
  }
  if (a.total_draft_capacity < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("total_draft_capacity = ", a.total_draft_capacity, ": must be >= 1"));
  }
  if (!IsPowerOfTwo(a.pool.page_size) || a.pool.page_size > kMaxPageSize) {
    return absl::InvalidArgumentError(absl::StrCat(
        "page_size = ", a.pool.page_size, ": must be a power of two in 1..", kMaxPageSize));
  }
  if (a.pool.num_layers < 1 || a.pool.num_pages < 1) {
    return absl::InvalidArgumentError(absl::StrCat("pool has ", a.pool.num_layers, " layers and ",
                                                   a.pool.num_pages, " pages; need >= 1 of each"));
  }
  // The CUDA kernels address a layer's rows with a 32-bit token index
  // (page << log2(page_size) | offset): a layer holds fewer than 2^31 tokens.
  if (a.pool.num_pages > (int64_t{1} << 31) / a.pool.page_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool has ", a.pool.num_pages, " pages of ", a.pool.page_size,
                     " tokens per layer: at most 2^31 tokens per layer are supported"));
  }
  if (a.q == nullptr || a.pool.data == nullptr || a.page_table == nullptr ||
      a.prefix_len == nullptr || a.draft_len == nullptr || a.layer == nullptr ||
      a.visibility == nullptr || a.out == nullptr || a.lse == nullptr) {
    return absl::InvalidArgumentError(
        "a required pointer (q, pool, page_table, prefix_len, "
        "draft_len, layer, visibility, out or lse) is null");
  }
  if (a.page_table_stride < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_table_stride = ", a.page_table_stride, ": must be >= 1"));
  }
  if (a.softmax_scale == nullptr && !(a.default_softmax_scale > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("default_softmax_scale = ", a.default_softmax_scale,
                     ": must be > 0 when no per-request scales are given"));
  }
  if (a.q_token_stride < static_cast<int64_t>(a.num_heads - 1) * a.q_head_stride + kLatentDim ||
      a.q_head_stride < kLatentDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "q strides (token ", a.q_token_stride, ", head ", a.q_head_stride,
        ") overlap rows: need head_stride >= 576 and token_stride >= (H-1)*head_stride + 576"));
  }
  if (a.out_token_stride < static_cast<int64_t>(a.num_heads - 1) * a.out_head_stride + kValueDim ||
      a.out_head_stride < kValueDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "out strides (token ", a.out_token_stride, ", head ", a.out_head_stride,
        ") overlap rows: need head_stride >= 512 and token_stride >= (H-1)*head_stride + 512"));
  }
  if (require_16b_alignment) {
    // The kernels move 16-byte vectors (8 bf16): every row start must be on a
    // 16-byte boundary.
    if (a.q_token_stride % 8 != 0 || a.q_head_stride % 8 != 0 || a.out_token_stride % 2 != 0 ||
        a.out_head_stride % 2 != 0) {
      return absl::InvalidArgumentError(
          "q strides must be multiples of 8 elements and out strides multiples of 2");
    }
    if (!Aligned16(a.q) || !Aligned16(a.pool.data) || !Aligned16(a.out)) {
      return absl::InvalidArgumentError("q, pool and out must be 16-byte aligned");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateRequests(const VerifyArguments& a) {
  int64_t total_draft = 0;
  for (int b = 0; b < a.batch; ++b) {
    const int64_t p = a.prefix_len[b];
    const int64_t n = a.draft_len[b];
    if (n < 0 || n > a.max_draft_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", b, ": draft_len = ", n, " is outside 0..", a.max_draft_len));
    }
    if (p < 0 || p > kMaxSequenceLen - n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", b, ": prefix_len = ", p, " is outside 0..", kMaxSequenceLen, " - draft_len"));
    }
    if (a.layer[b] < 0 || a.layer[b] >= a.pool.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("request ", b, ": layer ", a.layer[b],
                                                     " is outside 0..", a.pool.num_layers - 1));
    }
    if (a.softmax_scale != nullptr && !(a.softmax_scale[b] > 0.0f)) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", b, ": softmax scale ", a.softmax_scale[b], " must be > 0"));
    }
    if (n == 0) continue;
    const int64_t pages_needed = (p + n + a.pool.page_size - 1) / a.pool.page_size;
    if (a.page_table_offset == nullptr && pages_needed > a.page_table_stride) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", b, ": ", p + n, " tokens need ", pages_needed,
                       " pages but the page table holds ", a.page_table_stride));
    }
    if (a.page_table_offset != nullptr && a.page_table_offset[b] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", b, ": page_table_offset = ", a.page_table_offset[b], " is negative"));
    }
    const int32_t* pages = a.PageRow(b);
    for (int64_t k = 0; k < pages_needed; ++k) {
      if (pages[k] < 0 || pages[k] >= a.pool.num_pages) {
        return absl::InvalidArgumentError(absl::StrCat("request ", b, ": page_table[", k,
                                                       "] = ", pages[k], " is outside 0..",
                                                       a.pool.num_pages - 1));
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t word = a.visibility[total_draft + i];
      const uint64_t self = uint64_t{1} << i;
      const uint64_t allowed = self | (self - 1);  // bits 0..i
      if ((word & self) == 0 || (word & ~allowed) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("request ", b, ": visibility word of draft ", i,
                         " must contain the draft itself and only earlier drafts"));
      }
    }
    total_draft += n;
  }
  if (total_draft > a.total_draft_capacity) {
    return absl::InvalidArgumentError(absl::StrCat("the requests hold ", total_draft,
                                                   " drafts; total_draft_capacity is ",
                                                   a.total_draft_capacity));
  }
  return absl::OkStatus();
}

}  // namespace mlaverify::kernels
