#include "client/reference_check.h"

#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/draft_tree.h"
#include "common/status_macros.h"
#include "kernels/cpu_reference.h"
#include "kernels/verify_attention.h"

namespace mlaverify::client {

using mlaverify::kLatentDim;
using mlaverify::kValueDim;

void SequenceMirror::AppendPrompt(absl::Span<const Bf16> kv, int64_t tokens) {
  for (int layer = 0; layer < num_layers(); ++layer) {
    const Bf16* begin = kv.data() + layer * tokens * kLatentDim;
    layers_[layer].insert(layers_[layer].end(), begin, begin + tokens * kLatentDim);
  }
  length_ += tokens;
}

void SequenceMirror::AppendAccepted(const std::vector<std::vector<Bf16>>& draft_kv_per_layer,
                                    absl::Span<const int32_t> accepted) {
  for (int layer = 0; layer < num_layers(); ++layer) {
    for (int32_t a : accepted) {
      const Bf16* row = draft_kv_per_layer[layer].data() + static_cast<int64_t>(a) * kLatentDim;
      layers_[layer].insert(layers_[layer].end(), row, row + kLatentDim);
    }
  }
  length_ += static_cast<int64_t>(accepted.size());
}

absl::StatusOr<ReferenceComparison> CompareWithReference(const SequenceMirror& mirror, int layer,
                                                         const VerifyItemInput& item,
                                                         float softmax_scale,
                                                         const VerifyItemResult& result,
                                                         int num_threads, KvDtype kv_dtype) {
  if (result.prefix_len != mirror.length()) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", item.sequence_id, ": the server attended to ", result.prefix_len,
                     " committed tokens; the client sent ", mirror.length()));
  }
  const int32_t n = static_cast<int32_t>(item.parents.size());
  const int heads = result.num_heads;
  const int32_t prefix = static_cast<int32_t>(mirror.length());
  ASSIGN_OR_RETURN(std::vector<uint64_t> visibility, mlaverify::BuildVisibility(item.parents));

  // A one-layer "pool" with one token per page and the identity page table:
  // the prefix rows, then the drafts at P..P+N-1, where the server writes them.
  const int64_t total = static_cast<int64_t>(prefix) + n;
  const absl::Span<const Bf16> prefix_rows = mirror.layer_rows(layer);
  if (static_cast<int64_t>(item.draft_kv.size()) != int64_t{n} * kLatentDim) {
    return absl::InvalidArgumentError(absl::StrCat("sequence ", item.sequence_id,
                                                   ": draft_kv holds ", item.draft_kv.size(),
                                                   " values for ", n, " drafts"));
  }
  const int row_bytes = KvRowBytes(kv_dtype);
  std::vector<Bf16> rows(static_cast<size_t>(total) * row_bytes / sizeof(Bf16));
  auto* pool_bytes = reinterpret_cast<uint8_t*>(rows.data());
  for (int64_t j = 0; j < total; ++j) {
    const Bf16* row = j < prefix ? prefix_rows.data() + j * kLatentDim
                                 : item.draft_kv.data() + (j - prefix) * kLatentDim;
    StoreLatentRow(kv_dtype, row, pool_bytes + j * row_bytes);
  }
  std::vector<int32_t> page_table(total);
  std::iota(page_table.begin(), page_table.end(), 0);
  const int32_t layer_in_pool = 0;
  // Only there to satisfy CanImplement; the fp32 rows below are the reference.
  std::vector<Bf16> unused_out(static_cast<size_t>(n) * heads * kValueDim);
  std::vector<float> unused_lse(static_cast<size_t>(n) * heads);

  kernels::VerifyArguments args;
  args.batch = 1;
  args.num_heads = heads;
  args.max_draft_len = n;
  args.total_draft_capacity = n;
  args.q = item.q.data();
  args.q_token_stride = static_cast<int64_t>(heads) * kLatentDim;
  args.q_head_stride = kLatentDim;
  args.pool.data = rows.data();
  args.pool.num_layers = 1;
  args.pool.num_pages = total;
  args.pool.page_size = 1;
  args.pool.dtype = kv_dtype;
  args.page_table = page_table.data();
  args.page_table_stride = total;
  args.prefix_len = &prefix;
  args.draft_len = &n;
  args.layer = &layer_in_pool;
  args.default_softmax_scale = softmax_scale;
  args.visibility = visibility.data();
  args.out = unused_out.data();
  args.out_token_stride = static_cast<int64_t>(heads) * kValueDim;
  args.out_head_stride = kValueDim;
  args.lse = unused_lse.data();
  RETURN_IF_ERROR(kernels::CanImplement(args, /*require_16b_alignment=*/false));
  RETURN_IF_ERROR(kernels::ValidateRequests(args));

  // Every (draft, head) row in the server's [N, H] order.
  std::vector<kernels::ReferenceRow> all_rows;
  all_rows.reserve(static_cast<size_t>(n) * heads);
  for (int64_t i = 0; i < n; ++i) {
    for (int h = 0; h < heads; ++h) all_rows.push_back({i, h});
  }
  std::vector<float> ref_out(all_rows.size() * kValueDim);
  std::vector<float> ref_lse(all_rows.size());
  kernels::VerifyAttentionRowsCpu(args, 0, all_rows, ref_out.data(), ref_lse.data(), num_threads);

  ReferenceComparison comparison;
  double diff_sq = 0.0;
  double ref_sq = 0.0;
  for (size_t k = 0; k < ref_out.size(); ++k) {
    const double o = Bf16ToFloat(result.out[k]);
    if (!std::isfinite(o)) ++comparison.non_finite;
    const double d = o - ref_out[k];
    diff_sq += d * d;
    ref_sq += static_cast<double>(ref_out[k]) * ref_out[k];
  }
  comparison.rel_err = std::sqrt(diff_sq) / std::sqrt(ref_sq);
  for (size_t k = 0; k < ref_lse.size(); ++k) {
    if (!std::isfinite(result.lse[k])) ++comparison.non_finite;
    const double d = std::abs(static_cast<double>(result.lse[k]) - ref_lse[k]);
    // std::max would drop a NaN difference; keep the first one so the check
    // fails.
    if (d > comparison.lse_max_abs_err ||
        (std::isnan(d) && !std::isnan(comparison.lse_max_abs_err))) {
      comparison.lse_max_abs_err = d;
    }
  }
  return comparison;
}

}  // namespace mlaverify::client
