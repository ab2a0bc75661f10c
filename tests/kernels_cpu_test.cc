// The CPU reference (the CPU backend's math and the GPU tests' oracle) against
// a float64 brute force written independently here, plus the draft-tree
// helpers and the CPU draft write / compaction.
#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/draft_tree.h"
#include "common/kv_dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu_reference.h"
#include "kernels/parallel_for.h"
#include "kernels/testing/verify_problem.h"

namespace mlaverify::kernels {
namespace {

// ---- ParallelFor over the shared pool --------------------------------------

TEST(ParallelForTest, EverySliceRunsOnceAndThePoolDoesNotGrowPerCall) {
  for (const int64_t n : {1, 2, 7, 64, 1000}) {
    for (const int threads : {1, 2, 3, 8, 16}) {
      std::vector<std::atomic<int>> hits(n);
      ParallelFor(n, threads, [&](int64_t begin, int64_t end) {
        ASSERT_LT(begin, end);
        for (int64_t i = begin; i < end; ++i) hits[i].fetch_add(1);
      });
      for (int64_t i = 0; i < n; ++i)
        ASSERT_EQ(hits[i].load(), 1) << n << " " << threads << " " << i;
    }
  }
  // 16 threads asked at most: 15 helpers, started once, kept.
  const int started = WorkerPool::Shared().threads();
  EXPECT_GE(started, 15);
  for (int call = 0; call < 200; ++call) {
    ParallelFor(64, 16, [](int64_t, int64_t) {});
  }
  EXPECT_EQ(WorkerPool::Shared().threads(), started);
}

TEST(ParallelForTest, NestedAndConcurrentCallsFinishWithEverySum) {
  // 8 callers at once, each running slices that run a ParallelFor of their
  // own: more work than helpers, and helpers busy inside outer slices.
  std::vector<std::thread> callers;
  std::vector<int64_t> sums(8, 0);
  for (int c = 0; c < 8; ++c) {
    callers.emplace_back([c, &sums] {
      for (int round = 0; round < 20; ++round) {
        std::atomic<int64_t> sum{0};
        ParallelFor(16, 4, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            ParallelFor(100, 3, [&](int64_t b, int64_t e) {
              int64_t local = 0;
              for (int64_t j = b; j < e; ++j) local += i * 100 + j;
              sum.fetch_add(local);
            });
          }
        });
        sums[c] += sum.load();
      }
    });
  }
  for (std::thread& t : callers) t.join();
  // sum over i < 16, j < 100 of (100 i + j) = 100 * 100 * 120 + 16 * 4950.
  for (int c = 0; c < 8; ++c) EXPECT_EQ(sums[c], 20 * (1200000 + 16 * 4950)) << c;
}

using testing::HostVerifyProblem;
using testing::MakeProblem;
using testing::MaskKind;
using testing::VerifyProblemSpec;

TEST(DraftTree, ChainGivesCausalVisibility) {
  const auto words = BuildVisibility({-1, 0, 1, 2});
  ASSERT_TRUE(words.ok());
  EXPECT_EQ(*words, (std::vector<uint64_t>{0b1, 0b11, 0b111, 0b1111}));
}

TEST(DraftTree, TreeVisibilityFollowsAncestors) {
  //      0        3
  //     / \       |
  //    1   2      4
  const auto words = BuildVisibility({-1, 0, 0, -1, 3});
  ASSERT_TRUE(words.ok());
  EXPECT_EQ(*words, (std::vector<uint64_t>{0b00001, 0b00011, 0b00101, 0b01000, 0b11000}));
}

TEST(DraftTree, RejectsWhatIsNotAForestWithParentsFirst) {
  EXPECT_FALSE(ValidateDraftTree({}).ok());
  EXPECT_FALSE(ValidateDraftTree({0}).ok());         // own parent
  EXPECT_FALSE(ValidateDraftTree({-1, 1}).ok());     // own parent
  EXPECT_FALSE(ValidateDraftTree({-1, 2, 0}).ok());  // parent after child
  EXPECT_FALSE(ValidateDraftTree({-2}).ok());
  EXPECT_FALSE(ValidateDraftTree(std::vector<int32_t>(65, -1)).ok());
  EXPECT_TRUE(ValidateDraftTree(std::vector<int32_t>(64, -1)).ok());
  const absl::Status s = ValidateDraftTree({-1, 0, 5});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("parents[2] = 5"), absl::string_view::npos) << s;
}

TEST(DraftTree, AcceptedPathMustStartAtARootAndFollowChildren) {
  const std::vector<int32_t> parents = {-1, 0, 0, 1, -1};
  EXPECT_TRUE(ValidateAcceptedPath(parents, {}).ok());
  EXPECT_TRUE(ValidateAcceptedPath(parents, {0, 1, 3}).ok());
  EXPECT_TRUE(ValidateAcceptedPath(parents, {4}).ok());
  EXPECT_FALSE(ValidateAcceptedPath(parents, {1}).ok());        // not a root
  EXPECT_FALSE(ValidateAcceptedPath(parents, {0, 3}).ok());     // skips a node
  EXPECT_FALSE(ValidateAcceptedPath(parents, {0, 2, 3}).ok());  // 3 is not 2's child
  EXPECT_FALSE(ValidateAcceptedPath(parents, {0, 9}).ok());     // out of range
}

// Float64 brute force over the pool, written from docs/kernel.md's math without
// sharing code with the reference: scores, max-subtracted softmax, weighted
// sum and natural-log LSE.
void BruteForce(const HostVerifyProblem& p, std::vector<double>* out, std::vector<double>* lse) {
  const int heads = p.spec.num_heads;
  out->assign(static_cast<size_t>(p.total_draft) * heads * kValueDim, 0.0);
  lse->assign(static_cast<size_t>(p.total_draft) * heads, 0.0);
  int64_t token_row = 0;
  for (int b = 0; b < p.batch; ++b) {
    const int64_t prefix = p.prefix_len[b];
    const int n = p.draft_len[b];
    const int32_t* pages = p.page_table.data() + b * p.page_table_stride;
    // Row j as stored (an fp8 row dequantized by its one definition).
    const int64_t row_elems = KvRowBytes(p.spec.kv_dtype) / 2;
    std::vector<float> key_row(kLatentDim);
    auto key = [&](int64_t j) -> const float* {
      const int64_t page = pages[j / p.spec.page_size];
      const Bf16* row =
          p.pool.data() +
          (((static_cast<int64_t>(p.layer[b]) * p.num_pages + page) * p.spec.page_size) +
           j % p.spec.page_size) *
              row_elems;
      LoadLatentRow(p.spec.kv_dtype, reinterpret_cast<const uint8_t*>(row), key_row.data());
      return key_row.data();
    };
    for (int i = 0; i < n; ++i, ++token_row) {
      // Ancestors of draft i, walked up the parent links.
      std::vector<bool> visible_draft(n, false);
      for (int a = i; a >= 0; a = p.parents[b][a]) visible_draft[a] = true;
      for (int h = 0; h < heads; ++h) {
        const Bf16* q = p.q.data() + token_row * p.q_token_stride + h * kLatentDim;
        std::vector<double> s;
        std::vector<int64_t> cols;
        for (int64_t j = 0; j < prefix + n; ++j) {
          if (j >= prefix && !visible_draft[j - prefix]) continue;
          double dot = 0.0;
          const float* k = key(j);
          for (int d = 0; d < kLatentDim; ++d) {
            dot += static_cast<double>(Bf16ToFloat(q[d])) * k[d];
          }
          s.push_back(dot * p.softmax_scale);
          cols.push_back(j);
        }
        double mx = -INFINITY;
        for (double v : s) mx = std::max(mx, v);
        double sum = 0.0;
        for (double v : s) sum += std::exp(v - mx);
        double* o = out->data() + (token_row * heads + h) * kValueDim;
        for (size_t k = 0; k < s.size(); ++k) {
          const double w = std::exp(s[k] - mx) / sum;
          const float* v = key(cols[k]);
          for (int d = 0; d < kValueDim; ++d) o[d] += w * v[d];
        }
        (*lse)[token_row * heads + h] = mx + std::log(sum);
      }
    }
  }
}

struct CpuCase {
  std::vector<int> prefix, draft;
  int heads, page_size;
  MaskKind mask;
  KvDtype kv_dtype = KvDtype::kBf16;
};

class CpuReferenceTest : public ::testing::TestWithParam<CpuCase> {};

TEST_P(CpuReferenceTest, MatchesFloat64BruteForce) {
  const CpuCase& c = GetParam();
  VerifyProblemSpec spec;
  spec.prefix_len = c.prefix;
  spec.draft_len = c.draft;
  spec.num_heads = c.heads;
  spec.page_size = c.page_size;
  spec.mask = c.mask;
  spec.seed = 42 + c.page_size + c.heads;
  spec.kv_dtype = c.kv_dtype;
  HostVerifyProblem p = MakeProblem(spec);
  ASSERT_TRUE(WriteDraftKvCpu(p.HostWriteArgs()).ok());
  const size_t rows = static_cast<size_t>(p.total_draft) * c.heads;
  std::vector<Bf16> out(rows * kValueDim, Bf16QuietNaN());
  std::vector<float> lse(rows, NAN);
  ASSERT_TRUE(VerifyAttentionCpu(p.HostArgs(out.data(), lse.data()), 2).ok());

  std::vector<double> ref_out, ref_lse;
  BruteForce(p, &ref_out, &ref_lse);
  double err = 0.0, norm = 0.0, lse_err = 0.0;
  for (size_t k = 0; k < out.size(); ++k) {
    const double got = Bf16ToFloat(out[k]);
    ASSERT_TRUE(std::isfinite(got)) << "output element " << k << " not written or NaN";
    err += (got - ref_out[k]) * (got - ref_out[k]);
    norm += ref_out[k] * ref_out[k];
  }
  for (size_t r = 0; r < rows; ++r) lse_err = std::max(lse_err, std::fabs(lse[r] - ref_lse[r]));
  // bf16 output rounding alone is ~2e-3 relative; fp32 accumulation adds far less.
  EXPECT_LT(std::sqrt(err / norm), 4e-3);
  EXPECT_LT(lse_err, 1e-3);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, CpuReferenceTest,
    ::testing::Values(CpuCase{{0}, {1}, 1, 1, MaskKind::kChain},                 // P = 0, N = 1
                      CpuCase{{0}, {7}, 2, 64, MaskKind::kTree},                 // drafts only
                      CpuCase{{1}, {16}, 3, 1, MaskKind::kTree},                 // page size 1
                      CpuCase{{63, 64, 65}, {5, 2, 9}, 2, 64, MaskKind::kTree},  // page edges
                      CpuCase{{130, 0}, {64, 3}, 1, 16, MaskKind::kTree},        // N = 64
                      CpuCase{{200, 17}, {4, 0}, 4, 8, MaskKind::kChain},        // padding request
                      // fp8 pools: the same oracle over the rows as stored.
                      CpuCase{{0}, {1}, 1, 1, MaskKind::kChain, KvDtype::kFp8},
                      CpuCase{{1}, {16}, 3, 1, MaskKind::kTree, KvDtype::kFp8},
                      CpuCase{{63, 64, 65}, {5, 2, 9}, 2, 64, MaskKind::kTree, KvDtype::kFp8},
                      CpuCase{{130, 0}, {64, 3}, 1, 16, MaskKind::kTree, KvDtype::kFp8},
                      CpuCase{{200, 17}, {4, 0}, 4, 8, MaskKind::kChain, KvDtype::kFp8},
                      CpuCase{{300}, {8}, 2, 256, MaskKind::kTree, KvDtype::kFp8}));

TEST(CpuReference, PerRequestScaleIsApplied) {
  VerifyProblemSpec spec;
  spec.prefix_len = {50, 50};
  spec.draft_len = {4, 4};
  spec.num_heads = 2;
  spec.page_size = 16;
  HostVerifyProblem p = MakeProblem(spec);
  ASSERT_TRUE(WriteDraftKvCpu(p.HostWriteArgs()).ok());
  const size_t rows = static_cast<size_t>(p.total_draft) * 2;
  std::vector<Bf16> out_default(rows * kValueDim), out_scaled(rows * kValueDim);
  std::vector<float> lse_default(rows), lse_scaled(rows);
  ASSERT_TRUE(VerifyAttentionCpu(p.HostArgs(out_default.data(), lse_default.data())).ok());
  VerifyArguments a = p.HostArgs(out_scaled.data(), lse_scaled.data());
  const std::vector<float> scales = {p.softmax_scale, 2.0f * p.softmax_scale};
  a.softmax_scale = scales.data();
  ASSERT_TRUE(VerifyAttentionCpu(a).ok());
  // Request 0 keeps the default scale, request 1 doubles it.
  EXPECT_EQ(std::memcmp(out_default.data(), out_scaled.data(), rows / 2 * kValueDim * 2), 0);
  EXPECT_NE(lse_default[rows - 1], lse_scaled[rows - 1]);
}

TEST(CpuReference, RejectsBadRequestsWithoutWriting) {
  VerifyProblemSpec spec;
  spec.prefix_len = {10};
  spec.draft_len = {4};
  HostVerifyProblem p = MakeProblem(spec);
  std::vector<Bf16> out(4 * 8 * kValueDim, Bf16{0x1234});
  std::vector<float> lse(4 * 8, 7.0f);
  VerifyArguments a = p.HostArgs(out.data(), lse.data());
  const std::vector<int32_t> bad_layer = {5};
  a.layer = bad_layer.data();
  const absl::Status s = VerifyAttentionCpu(a);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out[0].bits, 0x1234);
  EXPECT_EQ(lse[0], 7.0f);
  a = p.HostArgs(out.data(), lse.data());
  a.num_heads = 0;
  EXPECT_EQ(VerifyAttentionCpu(a).code(), absl::StatusCode::kInvalidArgument);
  // A sequence longer than the kernels' int32 positions allow.
  a = p.HostArgs(out.data(), lse.data());
  const std::vector<int32_t> too_long = {kMaxSequenceLen - 3};  // + 4 drafts
  a.prefix_len = too_long.data();
  const absl::Status s_long = ValidateRequests(a);
  EXPECT_EQ(s_long.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s_long.message()), ::testing::HasSubstr("prefix_len"));
  EXPECT_EQ(out[0].bits, 0x1234);
}

TEST(CanImplement, LimitsALayerTo2To31Tokens) {
  // The CUDA kernels index a layer's rows with a 32-bit token index.
  VerifyProblemSpec spec;
  spec.prefix_len = {10};
  spec.draft_len = {4};
  HostVerifyProblem p = MakeProblem(spec);
  VerifyArguments a = p.HostArgs(nullptr, nullptr);
  std::vector<Bf16> out(4 * 8 * kValueDim);
  std::vector<float> lse(4 * 8);
  a.out = out.data();
  a.lse = lse.data();
  ASSERT_TRUE(CanImplement(a, false).ok());
  a.pool.num_pages = (int64_t{1} << 31) / a.pool.page_size;
  EXPECT_TRUE(CanImplement(a, false).ok());
  a.pool.num_pages += 1;
  const absl::Status s = CanImplement(a, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("2^31 tokens per layer"));
}

TEST(CpuKvCache, CompactionMovesTheAcceptedPathInEveryLayer) {
  constexpr int kLayers = 3, kPage = 4;
  std::vector<Bf16> pool(static_cast<size_t>(kLayers) * 8 * kPage * kLatentDim);
  for (size_t k = 0; k < pool.size(); ++k) pool[k] = Bf16{static_cast<uint16_t>(k * 7 + 1)};
  const std::vector<Bf16> before = pool;
  const std::vector<int32_t> page_table = {5, 2, 7, 0};  // one request, 16 positions
  const std::vector<int32_t> prefix = {6};
  const std::vector<int32_t> accepted_len = {3};
  std::vector<int32_t> accepted(kMaxDraftLen, 0);
  accepted[0] = 0;
  accepted[1] = 2;
  accepted[2] = 3;  // position 6+2 moves to 6+1, then 6+3 to 6+2 (a source before)
  CompactArguments a;
  a.batch = 1;
  a.pool = KvPoolView{pool.data(), kLayers, 8, kPage};
  a.page_table = page_table.data();
  a.page_table_stride = 4;
  a.prefix_len = prefix.data();
  a.accepted_len = accepted_len.data();
  a.accepted = accepted.data();
  ASSERT_TRUE(CompactAcceptedKvCpu(a).ok());
  const KvPoolView before_view{const_cast<Bf16*>(before.data()), kLayers, 8, kPage};
  for (int layer = 0; layer < kLayers; ++layer) {
    for (int t = 0; t < 3; ++t) {
      const Bf16* got = pool.data() + a.pool.RowOffset(layer, page_table.data(), 6 + t);
      const Bf16* want =
          before.data() + before_view.RowOffset(layer, page_table.data(), 6 + accepted[t]);
      EXPECT_EQ(std::memcmp(got, want, kLatentDim * 2), 0) << "layer " << layer << " t " << t;
    }
    // The prefix is untouched.
    for (int j = 0; j < 6; ++j) {
      const int64_t off = a.pool.RowOffset(layer, page_table.data(), j);
      EXPECT_EQ(std::memcmp(pool.data() + off, before.data() + off, kLatentDim * 2), 0);
    }
  }
}

// An fp8 pool: the draft write quantizes each row (the bytes of
// QuantizeLatentRow), and the compaction moves stored rows as they are.
TEST(CpuKvCache, Fp8DraftWriteQuantizesAndCompactionMovesStoredRows) {
  VerifyProblemSpec spec;
  spec.prefix_len = {5};
  spec.draft_len = {6};
  spec.num_heads = 1;
  spec.page_size = 4;
  spec.mask = MaskKind::kChain;
  spec.kv_dtype = KvDtype::kFp8;
  HostVerifyProblem p = MakeProblem(spec);
  const DraftKvWriteArguments w = p.HostWriteArgs();
  ASSERT_TRUE(WriteDraftKvCpu(w).ok());
  const int32_t* pages = p.page_table.data();
  for (int i = 0; i < 6; ++i) {
    uint8_t want[kFp8RowBytes];
    QuantizeLatentRow(p.draft_kv.data() + i * kLatentDim, want);
    EXPECT_EQ(std::memcmp(w.pool.RowBytes(p.layer[0], pages, 5 + i), want, kFp8RowBytes), 0) << i;
  }
  const std::vector<Bf16> before = p.pool;
  const std::vector<int32_t> accepted_len = {2};
  std::vector<int32_t> accepted(kMaxDraftLen, 0);
  accepted[0] = 0;
  accepted[1] = 4;
  CompactArguments c;
  c.batch = 1;
  c.pool = w.pool;
  c.page_table = pages;
  c.page_table_stride = p.page_table_stride;
  c.prefix_len = p.prefix_len.data();
  c.accepted_len = accepted_len.data();
  c.accepted = accepted.data();
  ASSERT_TRUE(CompactAcceptedKvCpu(c).ok());
  KvPoolView old = w.pool;
  old.data = const_cast<Bf16*>(before.data());
  EXPECT_EQ(std::memcmp(c.pool.RowBytes(p.layer[0], pages, 6), old.RowBytes(p.layer[0], pages, 9),
                        kFp8RowBytes),
            0);
  EXPECT_EQ(std::memcmp(c.pool.RowBytes(p.layer[0], pages, 5), old.RowBytes(p.layer[0], pages, 5),
                        kFp8RowBytes),
            0);
}

}  // namespace
}  // namespace mlaverify::kernels
