#include "kernels/testing/verify_problem.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "absl/strings/str_format.h"
#include "common/draft_tree.h"
#include "kernels/cpu_reference.h"
#include "kernels/parallel_for.h"

namespace mlaverify::kernels::testing {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [-range, range), a pure function of (seed, index) so that fills
// are reproducible whatever the thread count.
float HashUniform(uint64_t seed, uint64_t index, float range) {
  const uint64_t h = SplitMix64(seed * 0x100000001b3ull ^ index);
  const float unit = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
  return (2.0f * unit - 1.0f) * range;
}

// A standard normal from two hashed uniforms (Box-Muller).
float HashNormal(uint64_t seed, uint64_t index) {
  const double u1 = (HashUniform(seed, 2 * index, 1.0f) + 1.0) * 0.5 + 1e-12;  // (0, 1]
  const double u2 = (HashUniform(seed, 2 * index + 1, 1.0f) + 1.0) * 0.5;
  return static_cast<float>(std::sqrt(-2.0 * std::log(std::min(1.0, u1))) *
                            std::cos(6.283185307179586 * u2));
}

// Value `index` of a prefix row (see KvValues).
float HashKvValue(KvValues kind, uint64_t seed, uint64_t index, int dim, float range) {
  switch (kind) {
    case KvValues::kUniform:
      return HashUniform(seed, index, range);
    case KvValues::kNormal:
      return HashNormal(seed, index) * range;
    case KvValues::kHeavyTailed: {
      // Student-t, nu = 3: Z / sqrt(chi2_3 / 3).
      const float z = HashNormal(seed, 4 * index);
      double chi2 = 0.0;
      for (int k = 1; k <= 3; ++k) {
        const double n = HashNormal(seed, 4 * index + k);
        chi2 += n * n;
      }
      const bool large = dim == 7 || dim == 100 || dim == 300 || dim == 450;
      return static_cast<float>(z / std::sqrt(std::max(chi2, 1e-6) / 3.0)) * range *
             (large ? 20.0f : 1.0f);
    }
  }
  return 0.0f;
}

void FillRandom(Bf16* data, int64_t n, uint64_t seed, float range) {
  ParallelFor(n, 0, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) data[k] = FloatToBf16(HashUniform(seed, k, range));
  });
}

std::vector<int32_t> MakeParents(MaskKind mask, int n, std::mt19937_64& rng) {
  std::vector<int32_t> parents(n);
  for (int i = 0; i < n; ++i) {
    if (mask == MaskKind::kChain || i == 0) {
      parents[i] = i - 1;
      continue;
    }
    // Half the nodes extend the previous one (deep paths), the rest hang off a
    // uniformly chosen earlier node or the prefix (wide trees).
    if (rng() % 2 == 0) {
      parents[i] = i - 1;
    } else {
      parents[i] = static_cast<int32_t>(rng() % (i + 1)) - 1;
    }
  }
  return parents;
}

}  // namespace

const char* MaskName(MaskKind m) { return m == MaskKind::kChain ? "chain" : "tree"; }

const char* KvValuesName(KvValues v) {
  return v == KvValues::kNormal ? "normal" : v == KvValues::kHeavyTailed ? "heavy" : "uniform";
}

int64_t HostVerifyProblem::total_kv_tokens() const {
  int64_t t = 0;
  for (int b = 0; b < batch; ++b) t += prefix_len[b] + draft_len[b];
  return t;
}

VerifyArguments HostVerifyProblem::HostArgs(Bf16* out, float* lse) {
  VerifyArguments a;
  a.batch = batch;
  a.num_heads = spec.num_heads;
  a.max_draft_len = std::max(1, *std::max_element(draft_len.begin(), draft_len.end()));
  a.total_draft_capacity = std::max(1, total_draft);
  a.q = q.data();
  a.q_token_stride = q_token_stride;
  a.q_head_stride = kLatentDim;
  a.pool = KvPoolView{pool.data(), spec.num_layers, num_pages, spec.page_size, spec.kv_dtype};
  a.page_table = page_table.data();
  a.page_table_stride = page_table_stride;
  a.prefix_len = prefix_len.data();
  a.draft_len = draft_len.data();
  a.layer = layer.data();
  a.default_softmax_scale = softmax_scale;
  a.visibility = visibility.data();
  a.out = out;
  a.out_token_stride = static_cast<int64_t>(spec.num_heads) * kValueDim;
  a.out_head_stride = kValueDim;
  a.lse = lse;
  return a;
}

DraftKvWriteArguments HostVerifyProblem::HostWriteArgs() {
  DraftKvWriteArguments w;
  w.batch = batch;
  w.total_draft_capacity = std::max(1, total_draft);
  w.draft_kv = draft_kv.data();
  w.draft_kv_stride = kLatentDim;
  w.pool = KvPoolView{pool.data(), spec.num_layers, num_pages, spec.page_size, spec.kv_dtype};
  w.page_table = page_table.data();
  w.page_table_stride = page_table_stride;
  w.prefix_len = prefix_len.data();
  w.draft_len = draft_len.data();
  w.layer = layer.data();
  return w;
}

HostVerifyProblem MakeProblem(const VerifyProblemSpec& spec) {
  HostVerifyProblem p;
  p.spec = spec;
  p.batch = static_cast<int>(spec.prefix_len.size());
  p.prefix_len.assign(spec.prefix_len.begin(), spec.prefix_len.end());
  p.draft_len.assign(spec.draft_len.begin(), spec.draft_len.end());
  std::mt19937_64 rng(spec.seed);
  const int ps = spec.page_size;

  // Pages: each request gets ceil((P+N)/ps) of them, drawn from a shuffled
  // pool so that consecutive positions rarely sit in consecutive pages.
  std::vector<int64_t> pages_needed(p.batch);
  int64_t total_pages = 0;
  for (int b = 0; b < p.batch; ++b) {
    pages_needed[b] = (static_cast<int64_t>(p.prefix_len[b]) + p.draft_len[b] + ps - 1) / ps;
    total_pages += pages_needed[b];
    p.page_table_stride = std::max(p.page_table_stride, pages_needed[b]);
  }
  p.page_table_stride = std::max<int64_t>({p.page_table_stride, spec.min_page_table_stride, 1});
  p.num_pages = std::max<int64_t>(total_pages + spec.extra_pages, spec.min_num_pages);
  std::vector<int32_t> order(p.num_pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  p.page_table.assign(p.batch * p.page_table_stride, -1);
  int64_t next = 0;
  for (int b = 0; b < p.batch; ++b) {
    for (int64_t k = 0; k < pages_needed[b]; ++k) {
      p.page_table[b * p.page_table_stride + k] = order[next++];
    }
  }

  // Pool: NaN everywhere, then random prefix rows in each request's layer.
  const KvPoolView view{nullptr, spec.num_layers, p.num_pages, ps, spec.kv_dtype};
  const int64_t pool_elems =
      static_cast<int64_t>(spec.num_layers) * p.num_pages * ps * view.RowElements();
  p.pool.resize(pool_elems);
  {
    Bf16* data = p.pool.data();
    ParallelFor(pool_elems, 0, [data](int64_t begin, int64_t end) {
      std::fill(data + begin, data + end, Bf16QuietNaN());
    });
  }
  p.layer.resize(p.batch);
  for (int b = 0; b < p.batch; ++b) {
    p.layer[b] = static_cast<int32_t>(rng() % spec.num_layers);
    const int32_t* pages = p.page_table.data() + b * p.page_table_stride;
    const uint64_t seed = SplitMix64(spec.seed + 1000 + b);
    const double ramp_per_row = spec.kv_ramp / std::max(1, p.prefix_len[b]);
    ParallelFor(p.prefix_len[b], 0, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        const float range =
            static_cast<float>(spec.kv_range * (1.0 + ramp_per_row * static_cast<double>(j)));
        Bf16 row[kLatentDim];
        for (int d = 0; d < kLatentDim; ++d) {
          row[d] = FloatToBf16(HashKvValue(spec.kv_values, seed, j * kLatentDim + d, d, range));
        }
        StoreLatentRow(
            spec.kv_dtype, row,
            reinterpret_cast<uint8_t*>(p.pool.data() + view.RowOffset(p.layer[b], pages, j)));
      }
    });
  }

  // Drafts: trees, visibility words, queries and draft KV rows.
  p.total_draft = std::accumulate(p.draft_len.begin(), p.draft_len.end(), 0);
  p.parents.resize(p.batch);
  for (int b = 0; b < p.batch; ++b) {
    p.parents[b] = MakeParents(spec.mask, p.draft_len[b], rng);
    if (p.draft_len[b] > 0) {
      const auto words = BuildVisibility(p.parents[b]);
      p.visibility.insert(p.visibility.end(), words->begin(), words->end());
    }
  }
  if (p.visibility.empty()) p.visibility.push_back(1);
  p.q_token_stride = static_cast<int64_t>(spec.num_heads) * kLatentDim + spec.q_token_pad;
  const int64_t q_rows = std::max(1, p.total_draft);
  p.q.resize(q_rows * p.q_token_stride);
  FillRandom(p.q.data(), static_cast<int64_t>(p.q.size()), spec.seed * 3 + 1, spec.q_range);
  p.draft_kv.resize(q_rows * kLatentDim);
  FillRandom(p.draft_kv.data(), static_cast<int64_t>(p.draft_kv.size()), spec.seed * 3 + 2,
             spec.kv_range);
  p.softmax_scale = 1.0f / std::sqrt(192.0f);
  return p;
}

std::string Comparison::ToString() const {
  std::string s =
      absl::StrFormat("rel_err=%.3e lse_max_abs_err=%.3e rows_checked=%d nan_outputs=%d", rel_err,
                      lse_max_abs_err, rows_checked, nan_outputs);
  if (first_nan_token >= 0) {
    absl::StrAppendFormat(&s, " first_nan=(token %d, head %d)", first_nan_token, first_nan_head);
  }
  if (worst_token >= 0) {
    absl::StrAppendFormat(&s, " worst_row=(token %d, head %d) rel_err=%.3e", worst_token,
                          worst_head, worst_row_rel_err);
  }
  return s;
}

Comparison CompareWithReference(HostVerifyProblem& problem, const std::vector<Bf16>& out,
                                const std::vector<float>& lse, int64_t max_rows, uint64_t seed) {
  Comparison c;
  const int heads = problem.spec.num_heads;
  const int64_t total_rows = static_cast<int64_t>(problem.total_draft) * heads;
  for (int64_t r = 0; r < total_rows; ++r) {
    const int64_t before = c.nan_outputs;
    if (!std::isfinite(lse[r])) ++c.nan_outputs;
    for (int d = 0; d < kValueDim; ++d) {
      if (!std::isfinite(Bf16ToFloat(out[r * kValueDim + d]))) {
        ++c.nan_outputs;
        break;
      }
    }
    if (c.nan_outputs > before && c.first_nan_token < 0) {
      c.first_nan_token = r / heads;
      c.first_nan_head = r % heads;
    }
  }
  // Rows to check, grouped by request so each request's keys convert once.
  std::vector<std::vector<ReferenceRow>> rows(problem.batch);
  std::vector<std::pair<int, ReferenceRow>> all;
  int64_t token_row = 0;
  for (int b = 0; b < problem.batch; ++b) {
    for (int i = 0; i < problem.draft_len[b]; ++i, ++token_row) {
      for (int h = 0; h < heads; ++h) all.push_back({b, ReferenceRow{token_row, h}});
    }
  }
  if (static_cast<int64_t>(all.size()) > max_rows) {
    std::mt19937_64 rng(seed);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(max_rows);
  }
  for (const auto& [b, row] : all) rows[b].push_back(row);

  const VerifyArguments args = problem.HostArgs(nullptr, nullptr);
  double e = 0.0, n = 0.0;
  std::vector<float> ref, ref_lse;
  for (int b = 0; b < problem.batch; ++b) {
    if (rows[b].empty()) continue;
    ref.resize(rows[b].size() * kValueDim);
    ref_lse.resize(rows[b].size());
    VerifyAttentionRowsCpu(args, b, rows[b], ref.data(), ref_lse.data());
    for (size_t k = 0; k < rows[b].size(); ++k) {
      const int64_t r = rows[b][k].token_row * heads + rows[b][k].head;
      double row_e = 0.0, row_n = 0.0;
      for (int d = 0; d < kValueDim; ++d) {
        const double want = ref[k * kValueDim + d];
        const double got = Bf16ToFloat(out[r * kValueDim + d]);
        row_e += (got - want) * (got - want);
        row_n += want * want;
      }
      e += row_e;
      n += row_n;
      c.row_rel_errs.push_back(row_n > 0.0 ? std::sqrt(row_e / row_n)
                                           : (row_e == 0.0 ? 0.0 : INFINITY));
      const double row_rel =
          row_n > 0.0 ? std::sqrt(row_e / row_n) : (row_e == 0.0 ? 0.0 : INFINITY);
      // NaN counts as worst, and stays so.
      if (!(row_rel <= c.worst_row_rel_err) && !std::isnan(c.worst_row_rel_err)) {
        c.worst_row_rel_err = row_rel;
        c.worst_token = rows[b][k].token_row;
        c.worst_head = rows[b][k].head;
      }
      const double lse_err = std::fabs(static_cast<double>(lse[r]) - ref_lse[k]);
      c.row_lse_abs_errs.push_back(lse_err);
      // NaN must not hide inside a max: propagate it explicitly.
      if (!(lse_err <= c.lse_max_abs_err)) c.lse_max_abs_err = lse_err;
    }
    c.rows_checked += static_cast<int64_t>(rows[b].size());
  }
  c.rel_err = n > 0.0 ? std::sqrt(e / n) : (e == 0.0 ? 0.0 : INFINITY);
  return c;
}

double ProblemBytes(const HostVerifyProblem& p) {
  return static_cast<double>(p.total_kv_tokens()) * KvRowBytes(p.spec.kv_dtype);
}

double ProblemFlops(const HostVerifyProblem& p) {
  double f = 0.0;
  for (int b = 0; b < p.batch; ++b) {
    f += static_cast<double>(p.draft_len[b]) * p.spec.num_heads *
         (static_cast<double>(p.prefix_len[b]) + p.draft_len[b]) * (2.0 * (kLatentDim + kValueDim));
  }
  return f;
}

}  // namespace mlaverify::kernels::testing
