#include "kernels/cpu_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/kv_dtype.h"
#include "common/status_macros.h"
#include "kernels/parallel_for.h"

namespace mlaverify::kernels {
namespace {

// Token rows of q where each request starts (exclusive prefix sum of
// draft_len).
std::vector<int64_t> DraftRowOffsets(const int32_t* draft_len, int batch) {
  std::vector<int64_t> offsets(batch + 1, 0);
  for (int b = 0; b < batch; ++b) offsets[b + 1] = offsets[b] + draft_len[b];
  return offsets;
}

float ScaleOf(const VerifyArguments& a, int b) {
  return a.softmax_scale != nullptr ? a.softmax_scale[b] : a.default_softmax_scale;
}

void ToFloat(const Bf16* src, int n, float* dst) {
  for (int d = 0; d < n; ++d) dst[d] = Bf16ToFloat(src[d]);
}

// Computes one (token, head) row against keys already converted to fp32
// (`keys` holds L = P + N rows of 576). Scores are fp32 dot products, the
// softmax is taken in fp32 with the maximum subtracted, the output
// accumulates fp32 probabilities times fp32 values.
void AttendRow(const float* q, const float* keys, int64_t prefix, int draft_len, uint64_t visible,
               float scale, float* scores, float* out512, float* lse) {
  const int64_t total = prefix + draft_len;
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < total; ++j) {
    const bool is_visible = j < prefix || ((visible >> (j - prefix)) & 1u) != 0;
    if (!is_visible) {
      scores[j] = -std::numeric_limits<float>::infinity();
      continue;
    }
    const float* k = keys + j * kLatentDim;
    float dot = 0.0f;
    for (int d = 0; d < kLatentDim; ++d) dot += q[d] * k[d];
    scores[j] = dot * scale;
    max_score = std::max(max_score, scores[j]);
  }
  std::fill(out512, out512 + kValueDim, 0.0f);
  float sum = 0.0f;
  for (int64_t j = 0; j < total; ++j) {
    if (scores[j] == -std::numeric_limits<float>::infinity()) continue;
    const float p = std::exp(scores[j] - max_score);
    sum += p;
    const float* v = keys + j * kLatentDim;
    for (int d = 0; d < kValueDim; ++d) out512[d] += p * v[d];
  }
  const float inv = 1.0f / sum;  // sum >= 1: the row always sees itself
  for (int d = 0; d < kValueDim; ++d) out512[d] *= inv;
  *lse = max_score + std::log(sum);
}

// Converts the L = P + N key rows of request b to fp32, in parallel.
std::vector<float> GatherKeys(const VerifyArguments& a, int b, int64_t total, int num_threads) {
  std::vector<float> keys(static_cast<size_t>(total) * kLatentDim);
  const int32_t* pages = a.PageRow(b);
  const int layer = a.layer[b];
  ParallelFor(total, num_threads, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      LoadLatentRow(a.pool.dtype, a.pool.RowBytes(layer, pages, j), keys.data() + j * kLatentDim);
    }
  });
  return keys;
}

}  // namespace

absl::Status VerifyAttentionCpu(const VerifyArguments& a, int num_threads) {
  RETURN_IF_ERROR(CanImplement(a, /*require_16b_alignment=*/false));
  RETURN_IF_ERROR(ValidateRequests(a));
  const std::vector<int64_t> offsets = DraftRowOffsets(a.draft_len, a.batch);
  const int heads = a.num_heads;
  std::vector<ReferenceRow> rows;
  std::vector<float> out, lse;
  for (int b = 0; b < a.batch; ++b) {
    const int n = a.draft_len[b];
    if (n == 0) continue;
    rows.clear();
    for (int i = 0; i < n; ++i) {
      for (int h = 0; h < heads; ++h) rows.push_back({offsets[b] + i, h});
    }
    out.resize(rows.size() * kValueDim);
    lse.resize(rows.size());
    VerifyAttentionRowsCpu(a, b, rows, out.data(), lse.data(), num_threads);
    for (size_t k = 0; k < rows.size(); ++k) {
      Bf16* dst = a.out + rows[k].token_row * a.out_token_stride + rows[k].head * a.out_head_stride;
      for (int d = 0; d < kValueDim; ++d) dst[d] = FloatToBf16(out[k * kValueDim + d]);
      a.lse[rows[k].token_row * heads + rows[k].head] = lse[k];
    }
  }
  return absl::OkStatus();
}

void VerifyAttentionRowsCpu(const VerifyArguments& a, int b, absl::Span<const ReferenceRow> rows,
                            float* out, float* lse, int num_threads) {
  const int n = a.draft_len[b];
  const int64_t prefix = a.prefix_len[b];
  const int64_t total = prefix + n;
  const std::vector<float> keys = GatherKeys(a, b, total, num_threads);
  const float scale = ScaleOf(a, b);
  ParallelFor(static_cast<int64_t>(rows.size()), num_threads, [&](int64_t begin, int64_t end) {
    std::vector<float> q(kLatentDim), scores(total);
    for (int64_t k = begin; k < end; ++k) {
      const ReferenceRow& row = rows[k];
      ToFloat(a.q + row.token_row * a.q_token_stride + row.head * a.q_head_stride, kLatentDim,
              q.data());
      AttendRow(q.data(), keys.data(), prefix, n, a.visibility[row.token_row], scale, scores.data(),
                out + k * kValueDim, lse + k);
    }
  });
}

absl::Status WriteDraftKvCpu(const DraftKvWriteArguments& a) {
  RETURN_IF_ERROR(CanImplementWrite(a, /*require_16b_alignment=*/false));
  RETURN_IF_ERROR(ValidateWriteRequests(a));
  int64_t row = 0;
  for (int b = 0; b < a.batch; ++b) {
    const int32_t* pages = a.page_table + b * a.page_table_stride;
    for (int i = 0; i < a.draft_len[b]; ++i, ++row) {
      StoreLatentRow(a.pool.dtype, a.draft_kv + row * a.draft_kv_stride,
                     a.pool.RowBytes(a.layer[b], pages, a.prefix_len[b] + i));
    }
  }
  return absl::OkStatus();
}

absl::Status CompactAcceptedKvCpu(const CompactArguments& a) {
  RETURN_IF_ERROR(CanImplementCompact(a, /*require_16b_alignment=*/false));
  RETURN_IF_ERROR(ValidateCompactRequests(a));
  for (int b = 0; b < a.batch; ++b) {
    const int32_t* pages = a.page_table + b * a.page_table_stride;
    const int32_t* path = a.accepted + b * kMaxDraftLen;
    const int64_t prefix = a.prefix_len[b];
    for (int layer = 0; layer < a.pool.num_layers; ++layer) {
      // accepted[t] >= t, so walking t upwards never overwrites a row that a
      // later step still has to read.
      for (int t = 0; t < a.accepted_len[b]; ++t) {
        if (path[t] == t) continue;
        // Stored rows move as they are (an fp8 row is not quantized again).
        std::memcpy(a.pool.RowBytes(layer, pages, prefix + t),
                    a.pool.RowBytes(layer, pages, prefix + path[t]), KvRowBytes(a.pool.dtype));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace mlaverify::kernels
