#include "kernels/kv_cache.h"

#include "absl/strings/str_cat.h"

namespace mlaverify::kernels {
namespace {

absl::Status CheckPool(const KvPoolView& pool) {
  const int ps = pool.page_size;
  if (ps < 1 || ps > kMaxPageSize || (ps & (ps - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size = ", ps, ": must be a power of two in 1..", kMaxPageSize));
  }
  if (pool.data == nullptr || pool.num_layers < 1 || pool.num_pages < 1) {
    return absl::InvalidArgumentError("the pool is empty or null");
  }
  return absl::OkStatus();
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Checks that positions [0, end) of request b are mapped to valid pages.
absl::Status CheckPages(const KvPoolView& pool, const int32_t* page_table, int64_t stride, int b,
                        int64_t end) {
  if (end <= 0) return absl::OkStatus();
  const int64_t pages_needed = (end + pool.page_size - 1) / pool.page_size;
  if (pages_needed > stride) {
    return absl::InvalidArgumentError(absl::StrCat("request ", b, ": ", end, " tokens need ",
                                                   pages_needed, " pages but the page table holds ",
                                                   stride));
  }
  const int32_t* pages = page_table + b * stride;
  for (int64_t k = 0; k < pages_needed; ++k) {
    if (pages[k] < 0 || pages[k] >= pool.num_pages) {
      return absl::InvalidArgumentError(absl::StrCat("request ", b, ": page_table[", k,
                                                     "] = ", pages[k], " is outside 0..",
                                                     pool.num_pages - 1));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CanImplementWrite(const DraftKvWriteArguments& a, bool require_16b_alignment) {
  if (a.batch < 1 || a.batch > kMaxBatch) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch = ", a.batch, ": must be in 1..", kMaxBatch));
  }
  if (a.total_draft_capacity < 1 || a.draft_kv_stride < kLatentDim) {
    return absl::InvalidArgumentError("draft_kv needs >= 1 row and a row stride >= 576");
  }
  if (a.draft_kv == nullptr || a.page_table == nullptr || a.prefix_len == nullptr ||
      a.draft_len == nullptr || a.layer == nullptr || a.page_table_stride < 1) {
    return absl::InvalidArgumentError("a required pointer of the draft write is null");
  }
  if (require_16b_alignment && (!Aligned16(a.draft_kv) || a.draft_kv_stride % 8 != 0)) {
    return absl::InvalidArgumentError("draft_kv rows must be 16-byte aligned");
  }
  return CheckPool(a.pool);
}

absl::Status CanImplementCompact(const CompactArguments& a, bool require_16b_alignment) {
  if (a.batch < 1 || a.batch > kMaxBatch) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch = ", a.batch, ": must be in 1..", kMaxBatch));
  }
  if (a.page_table == nullptr || a.prefix_len == nullptr || a.accepted_len == nullptr ||
      a.accepted == nullptr || a.page_table_stride < 1) {
    return absl::InvalidArgumentError("a required pointer of the compaction is null");
  }
  if (require_16b_alignment && !Aligned16(a.pool.data)) {
    return absl::InvalidArgumentError("the pool must be 16-byte aligned");
  }
  return CheckPool(a.pool);
}

absl::Status ValidateWriteRequests(const DraftKvWriteArguments& a) {
  if (a.page_table_offset != nullptr) {
    return absl::InvalidArgumentError(
        "page_table_offset is for device launches; host page tables are rows of page_table");
  }
  int64_t total = 0;
  for (int b = 0; b < a.batch; ++b) {
    const int64_t p = a.prefix_len[b];
    const int64_t n = a.draft_len[b];
    if (p < 0 || n < 0 || n > kMaxDraftLen) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", b, ": prefix_len ", p, " / draft_len ", n, " out of range"));
    }
    if (a.layer[b] < 0 || a.layer[b] >= a.pool.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("request ", b, ": layer ", a.layer[b],
                                                     " is outside 0..", a.pool.num_layers - 1));
    }
    if (n > 0) {
      if (auto s = CheckPages(a.pool, a.page_table, a.page_table_stride, b, p + n); !s.ok())
        return s;
    }
    total += n;
  }
  if (total > a.total_draft_capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the requests hold ", total, " draft rows; capacity is ", a.total_draft_capacity));
  }
  return absl::OkStatus();
}

absl::Status ValidateCompactRequests(const CompactArguments& a) {
  for (int b = 0; b < a.batch; ++b) {
    const int64_t p = a.prefix_len[b];
    const int k = a.accepted_len[b];
    if (p < 0 || k < 0 || k > kMaxDraftLen) {
      return absl::InvalidArgumentError(
          absl::StrCat("request ", b, ": prefix_len ", p, " / accepted_len ", k, " out of range"));
    }
    const int32_t* path = a.accepted + b * kMaxDraftLen;
    int32_t previous = -1;
    for (int t = 0; t < k; ++t) {
      if (path[t] <= previous || path[t] >= kMaxDraftLen) {
        return absl::InvalidArgumentError(
            absl::StrCat("request ", b, ": accepted[", t, "] = ", path[t],
                         " must be a draft index above the previous one (a path from a root)"));
      }
      previous = path[t];
    }
    if (k > 0) {
      if (auto s = CheckPages(a.pool, a.page_table, a.page_table_stride, b, p + previous + 1);
          !s.ok()) {
        return s;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace mlaverify::kernels
