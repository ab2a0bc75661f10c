// GPU kernels against the CPU reference: verify attention over a grid of
// prefix lengths, draft counts, head counts, page sizes and masks; the draft
// write and the commit compaction; a captured CUDA graph replayed with other
// lengths and trees. Every problem draws fresh random data, poisons unused
// pool pages and rows with NaN and poisons the outputs before each run.
// Without a CUDA device every test is skipped with the reason.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/draft_tree.h"
#include "common/kv_dtype.h"
#include "common/workload.h"
#include "gtest/gtest.h"
#include "kernels/copy_list.h"
#include "kernels/cpu_reference.h"
#include "kernels/testing/device_problem.h"
#include "kernels/testing/verify_problem.h"
#include "kernels/verify_attention_cuda.h"

namespace mlaverify::kernels {
namespace {

using testing::CapacityFor;
using testing::Comparison;
using testing::DeviceBuffer;
using testing::DeviceVerifyProblem;
using testing::HostVerifyProblem;
using testing::MakeProblem;
using testing::MaskKind;
using testing::VerifyProblemSpec;

// Rows compared in full up to this many per problem; larger problems compare
// a random sample of this many rows (and scan every row for NaN).
constexpr int64_t kMaxCheckedRows = 2048;
// fused_combine_max_batch that lets every batch take the fused combine.
constexpr int kAnyBatch = 1 << 30;

class GpuKernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static const std::string reason = testing::NoUsableGpuReason();
    if (!reason.empty()) GTEST_SKIP() << "GPU test skipped: " << reason;
    auto config = PrepareVerifyLaunch(0);
    ASSERT_TRUE(config.ok()) << config.status();
    config_ = *config;
  }

  // Uploads `problem`, runs the draft write and the attention on the GPU,
  // runs the same on the CPU and compares.
  // `plan`, when given, receives the plan the launch chose.
  // `launches` > 1 runs the attention that many times back to back on the
  // same workspace (the last result is compared); `workspace_fill` >= 0
  // fills the workspace with that byte and initialises it again; `out_copy` / `lse_copy`
  // receive the outputs.
  Comparison RunAndCompare(HostVerifyProblem& problem, const VerifyLaunchConfig& config,
                           VerifyPlanSummary* plan = nullptr, int launches = 1,
                           int workspace_fill = -1, std::vector<Bf16>* out_copy = nullptr,
                           std::vector<float>* lse_copy = nullptr) {
    DeviceVerifyProblem device;
    EXPECT_TRUE(device.Init(CapacityFor(problem), config).ok());
    return RunAndCompareOn(device, problem, config, plan, launches, workspace_fill, out_copy,
                           lse_copy);
  }

  // The same on an initialised `device`, whose workspace keeps what earlier
  // launches left in it (the reuse_plan test).
  Comparison RunAndCompareOn(DeviceVerifyProblem& device, HostVerifyProblem& problem,
                             const VerifyLaunchConfig& config, VerifyPlanSummary* plan = nullptr,
                             int launches = 1, int workspace_fill = -1,
                             std::vector<Bf16>* out_copy = nullptr,
                             std::vector<float>* lse_copy = nullptr) {
    EXPECT_TRUE(device.Upload(problem).ok());
    EXPECT_TRUE(LaunchWriteDraftKv(device.WriteArgs(), nullptr).ok());
    if (workspace_fill >= 0) {  // garbage, then the initialisation every workspace gets
      EXPECT_EQ(cudaMemset(device.workspace(), workspace_fill, device.workspace_bytes()),
                cudaSuccess);
      EXPECT_TRUE(InitVerifyWorkspace(device.Args(), config, device.workspace(),
                                      device.workspace_bytes(), nullptr)
                      .ok());
    }
    for (int i = 0; i < launches; ++i) {
      const absl::Status launched = LaunchVerifyAttention(device.Args(), config, device.workspace(),
                                                          device.workspace_bytes(), nullptr);
      EXPECT_TRUE(launched.ok()) << launched;
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (plan != nullptr) {
      auto summary = ReadVerifyPlanSummary(device.Args(), config, device.workspace(), nullptr);
      EXPECT_TRUE(summary.ok()) << summary.status();
      if (summary.ok()) *plan = *summary;
    }
    std::vector<Bf16> out;
    std::vector<float> lse;
    EXPECT_TRUE(device.Download(problem, &out, &lse).ok());
    EXPECT_TRUE(WriteDraftKvCpu(problem.HostWriteArgs()).ok());
    const Comparison result = testing::CompareWithReference(problem, out, lse, kMaxCheckedRows);
    if (out_copy != nullptr) *out_copy = std::move(out);
    if (lse_copy != nullptr) *lse_copy = std::move(lse);
    return result;
  }

  VerifyLaunchConfig config_;
};

struct GridCase {
  std::vector<int> prefix_len;
  std::vector<int> draft_len;
  int heads;
  int page_size;
  MaskKind mask;
  std::string Name() const {
    return absl::StrCat("P=", absl::StrJoin(prefix_len, "/"), " N=", absl::StrJoin(draft_len, "/"),
                        " H=", heads, " page=", page_size, " ", testing::MaskName(mask));
  }
  VerifyProblemSpec Spec(uint64_t seed) const {
    VerifyProblemSpec spec;
    spec.prefix_len = prefix_len;
    spec.draft_len = draft_len;
    spec.num_heads = heads;
    spec.page_size = page_size;
    spec.mask = mask;
    spec.seed = seed;
    return spec;
  }
};

// Every P, N and H of the grid meets every other; page sizes and masks
// rotate through the combinations so that each pair of values appears too.
std::vector<GridCase> GridCases() {
  const int kPrefix[] = {0, 1, 63, 64, 65, 1000, 70000};
  const int kDraft[] = {1, 2, 7, 16, 64};
  const int kHeads[] = {1, 8, 16, 128};
  const int kPage[] = {1, 16, 64, 256};
  std::vector<GridCase> cases;
  int k = 0;
  for (int p : kPrefix) {
    for (int n : kDraft) {
      for (int h : kHeads) {
        // The CPU reference of P=70000 with 8192 query rows takes minutes:
        // keep the largest prefix to at most 1024 rows.
        if (p >= 70000 && n * h > 1024) continue;
        const MaskKind mask = (k / 4) % 2 == 0 ? MaskKind::kTree : MaskKind::kChain;
        cases.push_back({{p}, {n}, h, kPage[k % 4], mask});
        ++k;
      }
    }
  }
  // Mixed batches: different P and N in one launch, padding requests (N=0).
  cases.push_back({{0, 65, 1000, 63, 7}, {1, 7, 64, 16, 0}, 8, 16, MaskKind::kTree});
  cases.push_back({{5000, 1, 300, 0}, {16, 2, 64, 64}, 16, 64, MaskKind::kTree});
  cases.push_back(
      {{64, 64, 64, 64, 64, 64, 64, 64}, {16, 15, 14, 13, 0, 11, 10, 9}, 128, 1, MaskKind::kChain});
  cases.push_back({{70000, 2, 0}, {7, 64, 1}, 8, 256, MaskKind::kTree});
  // Batches at and past what one warp plans (32 requests): padding requests
  // first, in the middle and last.
  for (const int batch : {kPlanInWarpMaxBatch, kPlanInWarpMaxBatch + 8}) {
    GridCase c{{}, {}, 8, 16, MaskKind::kTree};
    for (int i = 0; i < batch; ++i) {
      c.prefix_len.push_back((i * 37) % 300);
      c.draft_len.push_back(i == 0 || i % 7 == 3 || i == batch - 1 ? 0 : 1 + i % 16);
    }
    cases.push_back(c);
  }
  return cases;
}

TEST_F(GpuKernelTest, AttentionMatchesReferenceOverTheGrid) {
  int index = 0;
  for (const GridCase& c : GridCases()) {
    HostVerifyProblem problem = MakeProblem(c.Spec(1000 + index++));
    VerifyLaunchConfig config = config_;
    // Both launch modes: the kernels must not depend on PDL's overlap.
    config.programmatic_launch = index % 2 == 0;
    // Both plan paths (plan kernel, plan in the attention's first warp),
    // alternating every two cases; the in-warp plan's cases also take the
    // fused combine where it applies (no PDL).
    config.plan_in_warp_max_batch = (index / 2) % 2 == 0 ? kPlanInWarpMaxBatch : 0;
    config.fused_combine_max_batch = (index / 2) % 2 == 0 ? kAnyBatch : 0;
    const Comparison result = RunAndCompare(problem, config);
    EXPECT_TRUE(result.ok()) << c.Name()
                             << (config.plan_in_warp_max_batch ? " plan in warp" : " plan kernel")
                             << ": " << result.ToString();
    EXPECT_GT(result.rows_checked, 0) << c.Name();
  }
}

// Scores that rise along the prefix (and large ones): the exponent reference
// of a row moves many times inside long splits, in both key halves of the
// `pipelined` score warps and at different tiles, so O's rescale runs deep
// into a segment. With the grid's ranges it moves after a row's first tiles
// only in short tree problems (a row whose first visible keys scored low).
// Both tests fail on a build whose PV warps skip that rescale (bench/NOTES.md,
// "Stale exponent reference").
TEST_F(GpuKernelTest, RisingScoresMoveTheExponentReference) {
  std::vector<GridCase> cases = {
      {{70000}, {16}, 8, 64, MaskKind::kTree},
      {{5000}, {64}, 16, 1, MaskKind::kTree},
      {{1000, 3000}, {7, 16}, 128, 16, MaskKind::kChain},
  };
  // A batch past the warp plan (the plan kernel's) with ~100 row tiles, fewer
  // than an H200's 132 CTAs: most requests get one split, so one CTA
  // attends a whole ramp.
  GridCase many{{}, {}, 8, 64, MaskKind::kTree};
  for (int i = 0; i < kPlanInWarpMaxBatch + 8; ++i) {
    many.prefix_len.push_back(2000 + 97 * i);
    many.draft_len.push_back(1 + i % 16);
  }
  cases.push_back(many);
  int index = 0;
  for (const GridCase& c : cases) {
    for (const float q_range : {8.0f, 24.0f}) {
      VerifyProblemSpec spec = c.Spec(7000 + index++);
      spec.q_range = q_range;
      spec.kv_ramp = q_range < 10.0f ? 8.0f : 0.0f;
      HostVerifyProblem problem = MakeProblem(spec);
      const Comparison result = RunAndCompare(problem, config_);
      EXPECT_TRUE(result.ok()) << c.Name() << " q_range " << q_range << " ramp " << spec.kv_ramp
                               << ": " << result.ToString();
      EXPECT_GT(result.rows_checked, 0) << c.Name();
    }
  }
}

TEST_F(GpuKernelTest, StridedQueriesAndAllSplitStrategiesAgree) {
  VerifyProblemSpec spec;
  spec.prefix_len = {3000, 17, 777};
  spec.draft_len = {16, 5, 9};
  spec.num_heads = 16;
  spec.page_size = 16;
  spec.q_token_pad = 64;  // q token stride > H * 576
  // Output head rows 4- but not 8-byte aligned (head stride 514): the
  // combine must not store more than 4 bytes at once.
  spec.out_head_pad = 2;
  spec.seed = 77;
  // num_sms = 1: the target is one CTA, so no request is split. A huge SM
  // count with 1-tile chunks splits every request as finely as it can.
  for (const int sms : {1, config_.num_sms, 4096}) {
    for (const int plan_in_warp : {0, kPlanInWarpMaxBatch}) {
      VerifyLaunchConfig config = config_;
      config.num_sms = sms;
      config.min_chunk_tiles = sms == 4096 ? 1 : config_.min_chunk_tiles;
      config.plan_in_warp_max_batch = plan_in_warp;
      HostVerifyProblem problem = MakeProblem(spec);
      const Comparison result = RunAndCompare(problem, config);
      EXPECT_TRUE(result.ok()) << "num_sms=" << sms << " plan_in_warp_max_batch=" << plan_in_warp
                               << ": " << result.ToString();
    }
  }
}

// The stream plan: equal KV ranges over requests laid end to end, a CTA's
// range spanning several requests (and, with few CTAs and many short
// requests, more than one block of 32 requests). The expected plan of each
// (case, CTA count) follows from the rule in verify_kernel.cuh ("Plan") and
// agrees with kernels/testing/models/plan_model.py.
TEST_F(GpuKernelTest, StreamPlanRangesSpanRequests) {
  struct StreamCase {
    GridCase grid;
    std::vector<std::pair<int, bool>> sms_and_stream;  // CTA target, stream plan expected
  };
  std::vector<StreamCase> cases;
  cases.push_back({{{3000, 17, 777, 0, 40000}, {4, 4, 4, 4, 4}, 8, 16, MaskKind::kTree},
                   {{3, true}, {16, true}, {132, false}}});
  {
    GridCase g{
        {}, {}, 16, 64, MaskKind::kChain};  // 70 requests: the plan kernel, three blocks of 32
    for (int i = 0; i < 70; ++i) {
      g.prefix_len.push_back((i * 37) % 300 + (i % 5 == 0 ? 5000 : 0));
      g.draft_len.push_back(2);
    }
    cases.push_back({g, {{3, true}, {16, true}, {132, true}}});
  }
  {
    GridCase g{{}, {}, 16, 1, MaskKind::kTree};  // 8 row tiles per request
    for (int i = 0; i < 8; ++i) {
      g.prefix_len.push_back(6000 * (i + 1) / 8);
      g.draft_len.push_back(16);
    }
    cases.push_back({g, {{3, false}, {16, true}, {132, true}}});
  }
  {
    GridCase g{{}, {}, 1, 256, MaskKind::kTree};  // padding requests do not count
    for (int i = 0; i < 32; ++i) {
      g.prefix_len.push_back((i * 613) % 2000);
      g.draft_len.push_back(i % 9 == 4 ? 0 : 1);
    }
    // At 132 CTAs the chunk plan is within STREAM_MIN_GAIN_TILES of the stream plan.
    cases.push_back({g, {{3, true}, {16, true}, {132, false}}});
  }
  {
    // 96 requests with 64 padding requests in the middle: at 3 and 16 CTAs
    // one CTA reads a whole block of 32 requests without a segment and goes
    // on to the next (ForEachSegment's count == 0 path).
    GridCase g{{}, {}, 16, 16, MaskKind::kTree};
    for (int i = 0; i < 96; ++i) {
      g.prefix_len.push_back((i * 53) % 900 + 100);
      g.draft_len.push_back(i < 8 || i >= 72 ? 2 : 0);
    }
    cases.push_back({g, {{3, true}, {16, true}, {132, false}}});
  }
  int index = 0;
  for (const StreamCase& c : cases) {
    HostVerifyProblem problem = MakeProblem(c.grid.Spec(5000 + index++));
    for (const auto& [sms, stream_expected] : c.sms_and_stream) {
      for (const int plan_in_warp : {0, kPlanInWarpMaxBatch}) {
        // Past 32 requests both settings launch the plan kernel.
        if (plan_in_warp > 0 && static_cast<int>(c.grid.prefix_len.size()) > kPlanInWarpMaxBatch)
          continue;
        for (const bool stream_plan : {true, false}) {
          VerifyLaunchConfig config = config_;
          config.num_sms = sms;
          config.ctas_per_sm = 1;
          config.min_chunk_tiles = 2;
          config.plan_in_warp_max_batch = plan_in_warp;
          config.stream_plan = stream_plan;
          // Both launch modes, each with both plans.
          config.programmatic_launch = stream_plan == (plan_in_warp == 0);
          VerifyPlanSummary plan{};
          const Comparison result = RunAndCompare(problem, config, &plan);
          const std::string where = absl::StrCat(c.grid.Name(), " sms=", sms,
                                                 plan_in_warp ? " plan in warp" : " plan kernel",
                                                 stream_plan ? "" : " stream plan off");
          EXPECT_TRUE(result.ok()) << where << ": " << result.ToString();
          EXPECT_EQ(plan.stream_groups > 0, stream_plan && stream_expected)
              << where << ": stream_groups=" << plan.stream_groups;
          EXPECT_GT(plan.total_work, 0) << where;
          if (plan.stream_groups > 0) {
            EXPECT_LE(plan.total_work, sms) << where;
          }
        }
      }
    }
  }
}

// The fused combine (the attention CTAs merge the partials; no combine
// kernel) gives the combine kernel's results bit for bit: the same merge code
// over the same partials. Each fused run launches three times back to back
// on one workspace (filled with garbage, then InitVerifyWorkspace): the
// counters must come back to zero after every launch. Both plans, many
// splits per row tile (B=1), padding requests.
TEST_F(GpuKernelTest, FusedCombineMatchesTheCombineKernelBitForBit) {
  ASSERT_GT(config_.resident_ctas, 0)
      << "PrepareVerifyLaunch found no resident CTA for the fused kernel";
  std::vector<GridCase> cases;
  cases.push_back({{4096}, {16}, 8, 64, MaskKind::kTree});  // 4 row tiles x 33 splits
  cases.push_back({{0, 65, 1000, 63, 7}, {1, 7, 64, 16, 0}, 8, 16, MaskKind::kTree});
  {
    GridCase g{{}, {}, 16, 1, MaskKind::kTree};  // equal row tiles: the stream plan
    for (int i = 0; i < 8; ++i) {
      g.prefix_len.push_back(6000 * (i + 1) / 8);
      g.draft_len.push_back(16);
    }
    cases.push_back(g);
  }
  {
    GridCase g{{}, {}, 1, 256, MaskKind::kChain};  // 32 requests, padding among them
    for (int i = 0; i < 32; ++i) {
      g.prefix_len.push_back((i * 613) % 20000);
      g.draft_len.push_back(i % 9 == 4 ? 0 : 1 + i % 3);
    }
    cases.push_back(g);
  }
  int index = 0;
  for (const GridCase& c : cases) {
    HostVerifyProblem problem = MakeProblem(c.Spec(9000 + index++));
    for (const bool stream_plan : {true, false}) {
      VerifyLaunchConfig fused = config_;
      fused.programmatic_launch = false;
      fused.stream_plan = stream_plan;
      fused.fused_combine_max_batch = kAnyBatch;
      VerifyLaunchConfig separate = fused;
      separate.fused_combine_max_batch = 0;
      const testing::DeviceCapacity capacity = CapacityFor(problem);
      VerifyArguments shape;
      shape.batch = capacity.batch;
      shape.num_heads = capacity.num_heads;
      shape.max_draft_len = capacity.max_draft_len;
      ASSERT_TRUE(LaunchUsesFusedCombine(shape, fused)) << c.Name();
      ASSERT_FALSE(LaunchUsesFusedCombine(shape, separate)) << c.Name();
      // The library's default: fused up to four requests.
      VerifyLaunchConfig by_default = fused;
      by_default.fused_combine_max_batch = VerifyLaunchConfig{}.fused_combine_max_batch;
      EXPECT_EQ(LaunchUsesFusedCombine(shape, by_default), shape.batch <= 4) << c.Name();
      const std::string where = absl::StrCat(c.Name(), stream_plan ? "" : " stream plan off");
      std::vector<Bf16> out_fused, out_separate;
      std::vector<float> lse_fused, lse_separate;
      VerifyPlanSummary plan_fused{}, plan_separate{};
      const Comparison fused_result =
          RunAndCompare(problem, fused, &plan_fused, /*launches=*/3, /*workspace_fill=*/0xA5,
                        &out_fused, &lse_fused);
      const Comparison separate_result =
          RunAndCompare(problem, separate, &plan_separate, 1, -1, &out_separate, &lse_separate);
      EXPECT_TRUE(fused_result.ok()) << where << " fused: " << fused_result.ToString();
      EXPECT_TRUE(separate_result.ok())
          << where << " combine kernel: " << separate_result.ToString();
      EXPECT_EQ(plan_fused.total_work, plan_separate.total_work) << where;
      EXPECT_EQ(plan_fused.stream_groups, plan_separate.stream_groups) << where;
      ASSERT_EQ(out_fused.size(), out_separate.size());
      ASSERT_EQ(lse_fused.size(), lse_separate.size());
      EXPECT_EQ(std::memcmp(out_fused.data(), out_separate.data(), out_fused.size() * sizeof(Bf16)),
                0)
          << where << ": outputs differ";
      EXPECT_EQ(
          std::memcmp(lse_fused.data(), lse_separate.data(), lse_fused.size() * sizeof(float)), 0)
          << where << ": LSE differ";
    }
  }
}

// VerifyLaunchConfig::reuse_plan, the pattern of a verify step: the first
// layer's launch plans, the next layers' launches read that plan. Layer B has
// the same lengths as layer A and fresh data (q, pool rows, page table,
// trees), so a launch that reads A's plan must match B's reference. And the
// reuse is real: after a layer with shorter prefixes, a reusing launch
// attends over the old, shorter ranges and misses B's reference. That check
// runs where the stale plan is a chunk plan, whose items carry their own
// ranges, splits and slots (inside B's: nothing out of bounds is read). A
// stale stream plan is mixed with the current lengths when the CTAs cut
// their segments, and reads out of bounds (this test's first version did):
// reuse_plan's contract (the same lengths) excludes both.
TEST_F(GpuKernelTest, ReusedPlanServesTheNextLayers) {
  struct ReuseCase {
    GridCase shape;
    std::vector<int> shorter_prefix;  // a previous layer's lengths, for the stale-plan check
  };
  std::vector<ReuseCase> cases;
  cases.push_back({{{4096}, {16}, 8, 64, MaskKind::kTree}, {2000}});  // fused combine, chunk plan
  {
    ReuseCase c{{{}, {}, 16, 1, MaskKind::kTree},
                {}};  // equal row tiles: the stream plan, combine kernel
    for (int i = 0; i < 8; ++i) {
      c.shape.prefix_len.push_back(3000 + 500 * i);
      c.shape.draft_len.push_back(16);
      c.shorter_prefix.push_back(1000 + 200 * i);
    }
    cases.push_back(c);
  }
  cases.push_back({{{0, 65, 1000, 63, 7000}, {1, 7, 64, 16, 2}, 8, 16, MaskKind::kTree},
                   {0, 1, 500, 63, 1000}});
  int index = 0;
  int stale_checks = 0;
  for (const ReuseCase& c : cases) {
    // The library's config, and the chunk plan with the combine kernel (a
    // stale chunk plan for the stale-plan check in every case).
    for (const bool chunk_plan : {false, true}) {
      for (const int plan_in_warp :
           {kPlanInWarpMaxBatch, 0}) {  // the plan that is reused: in-warp or kernel
        VerifyLaunchConfig first = config_;
        if (chunk_plan) {
          first.stream_plan = false;
          first.fused_combine_max_batch = 0;
        }
        first.plan_in_warp_max_batch = plan_in_warp;
        VerifyLaunchConfig next = first;
        next.reuse_plan = true;
        const std::string where =
            absl::StrCat(c.shape.Name(), chunk_plan ? " chunk plan, combine kernel" : "",
                         plan_in_warp ? " plan in warp" : " plan kernel");
        const uint64_t seed = 9500 + 10 * index++;
        VerifyProblemSpec spec_a = c.shape.Spec(seed);
        VerifyProblemSpec spec_b = c.shape.Spec(seed + 1);
        spec_b.num_layers = spec_a.num_layers;
        HostVerifyProblem layer_a = MakeProblem(spec_a);
        HostVerifyProblem layer_b = MakeProblem(spec_b);
        VerifyProblemSpec spec_short = spec_a;
        spec_short.prefix_len = c.shorter_prefix;
        spec_short.min_num_pages = std::max(layer_a.num_pages, layer_b.num_pages);
        spec_short.min_page_table_stride =
            std::max(layer_a.page_table_stride, layer_b.page_table_stride);
        HostVerifyProblem layer_short = MakeProblem(spec_short);

        SCOPED_TRACE(where);
        DeviceVerifyProblem device;
        ASSERT_TRUE(device.Init(CapacityFor(layer_a), first).ok()) << where;
        const Comparison a = RunAndCompareOn(device, layer_a, first);
        EXPECT_TRUE(a.ok()) << where << " layer A (plans): " << a.ToString();
        const Comparison b = RunAndCompareOn(device, layer_b, next);
        EXPECT_TRUE(b.ok()) << where << " layer B (reuses A's plan): " << b.ToString();
        // A stale plan: the shorter layer plans, B reuses it and must miss.
        const Comparison s = RunAndCompareOn(device, layer_short, first);
        EXPECT_TRUE(s.ok()) << where << " shorter layer (plans): " << s.ToString();
        auto short_plan = ReadVerifyPlanSummary(device.Args(), first, device.workspace(), nullptr);
        ASSERT_TRUE(short_plan.ok()) << where << ": " << short_plan.status();
        if (short_plan->stream_groups > 0) continue;  // see above
        ++stale_checks;
        HostVerifyProblem layer_b_again = MakeProblem(spec_b);
        const Comparison stale = RunAndCompareOn(device, layer_b_again, next);
        EXPECT_FALSE(stale.ok()) << where
                                 << ": a launch reusing the shorter layer's plan matched B's "
                                 << "reference, so reuse_plan did not reuse the plan";
      }
    }
  }
  EXPECT_GE(stale_checks, 8) << "the stale-plan check ran too rarely to show that plans are reused";
}

// The engine's pattern (server/engine/cuda_device.cc): one workspace sized
// and initialised once for the largest batch, then launches of whatever
// batch is at hand. The fused combine's counters and mark must sit where the
// initialisation wrote them for every smaller batch (v9.3 had them after the
// batch-sized plan arrays: the service's first fused launch trapped).
TEST_F(GpuKernelTest, WorkspaceInitialisedForMaxBatchServesSmallerBatches) {
  VerifyLaunchConfig config = config_;
  config.programmatic_launch = false;
  config.fused_combine_max_batch = kAnyBatch;
  int seed = 4200;
  for (const std::vector<int>& prefixes :
       {std::vector<int>{3000}, std::vector<int>{500, 9000, 64}}) {
    VerifyProblemSpec spec;
    spec.prefix_len = prefixes;
    spec.draft_len.assign(prefixes.size(), 16);
    spec.num_heads = 8;
    spec.page_size = 64;
    spec.seed = seed++;
    HostVerifyProblem problem = MakeProblem(spec);
    DeviceVerifyProblem device;
    ASSERT_TRUE(device.Init(CapacityFor(problem), config).ok());
    ASSERT_TRUE(device.Upload(problem).ok());
    ASSERT_TRUE(LaunchWriteDraftKv(device.WriteArgs(), nullptr).ok());
    const VerifyArguments args = device.Args();
    ASSERT_TRUE(LaunchUsesFusedCombine(args, config));
    VerifyArguments largest = args;  // what the engine sizes for: max_batch, max_draft_len
    largest.batch = 32;
    largest.max_draft_len = 64;
    DeviceBuffer workspace;
    ASSERT_TRUE(workspace.Allocate(VerifyWorkspaceBytes(largest, config)).ok());
    ASSERT_EQ(cudaMemset(workspace.as<void>(), 0xA5, workspace.bytes()), cudaSuccess);
    ASSERT_TRUE(
        InitVerifyWorkspace(largest, config, workspace.as<void>(), workspace.bytes(), nullptr)
            .ok());
    for (int launch = 0; launch < 2; ++launch) {
      const absl::Status launched =
          LaunchVerifyAttention(args, config, workspace.as<void>(), workspace.bytes(), nullptr);
      ASSERT_TRUE(launched.ok()) << launched;
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "batch " << problem.batch;
    std::vector<Bf16> out;
    std::vector<float> lse;
    ASSERT_TRUE(device.Download(problem, &out, &lse).ok());
    ASSERT_TRUE(WriteDraftKvCpu(problem.HostWriteArgs()).ok());
    const Comparison result = testing::CompareWithReference(problem, out, lse, kMaxCheckedRows);
    EXPECT_TRUE(result.ok()) << "batch " << problem.batch << ": " << result.ToString();
    EXPECT_GT(result.rows_checked, 0);
  }
}

TEST_F(GpuKernelTest, RejectsUnsupportedLaunchConfig) {
  VerifyProblemSpec spec;
  spec.prefix_len = {10};
  spec.draft_len = {2};
  HostVerifyProblem problem = MakeProblem(spec);
  DeviceVerifyProblem device;
  ASSERT_TRUE(device.Init(CapacityFor(problem), config_).ok());
  ASSERT_TRUE(device.Upload(problem).ok());
  EXPECT_EQ(LaunchVerifyAttention(device.Args(), config_, device.workspace(), 16, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  VerifyLaunchConfig config = config_;
  config.plan_in_warp_max_batch = kPlanInWarpMaxBatch + 1;  // a warp plans 32 requests at most
  EXPECT_EQ(LaunchVerifyAttention(device.Args(), config, device.workspace(),
                                  device.workspace_bytes(), nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// FP8 pools (the 656-byte row of common/kv_dtype.h): the kernel grid again
// (pages 1..256, P = 0.., N = 1..64, H = 1..128, trees and chains, mixed
// batches up to 40 requests) plus a batch of 64, over pools that store the
// quantized rows, unused pages NaN (an fp8 row of NaN bytes has NaN scales
// and rope), the draft rows quantized into the pool by the draft write. The
// reference is the CPU's over the rows as stored: each value e4m3 x scale in
// fp32. The kernel attends to those values rounded to bf16 (ConvertFp8Row):
// a relative change of at most 2^-9 per value, the size of the bf16 rounding
// it already applies to q's products and to P, which the bf16 grid's bound
// (1e-2; typically 2e-3) absorbs; the same bound holds here. A failure names
// its case and its worst (token, head) row.
TEST_F(GpuKernelTest, Fp8AttentionMatchesReferenceOverTheGrid) {
  std::vector<GridCase> cases = GridCases();
  GridCase wide{{}, {}, 8, 64, MaskKind::kChain};
  for (int i = 0; i < 64; ++i) {
    wide.prefix_len.push_back((i * 97) % 2000);
    wide.draft_len.push_back(1 + i % 8);
  }
  cases.push_back(wide);
  int index = 0;
  for (const GridCase& c : cases) {
    VerifyProblemSpec spec = c.Spec(5000 + index++);
    spec.kv_dtype = KvDtype::kFp8;
    HostVerifyProblem problem = MakeProblem(spec);
    VerifyLaunchConfig config = config_;
    config.programmatic_launch = index % 2 == 0;
    config.plan_in_warp_max_batch = (index / 2) % 2 == 0 ? kPlanInWarpMaxBatch : 0;
    config.fused_combine_max_batch = (index / 2) % 2 == 0 ? kAnyBatch : 0;
    const Comparison result = RunAndCompare(problem, config);
    EXPECT_TRUE(result.ok()) << "fp8 " << c.Name()
                             << (config.plan_in_warp_max_batch ? " plan in warp" : " plan kernel")
                             << ": " << result.ToString();
    EXPECT_GT(result.rows_checked, 0) << c.Name();
  }
}

// FP8 pools on both plans: the stream plan over requests of equal row tiles
// (several segments per CTA) and the chunk plan; then scores that rise
// along the prefix (the exponent reference moves inside fp8 tiles). Each as
// close to the reference as bf16. (Graphs: Fp8CapturedGraphReplays...)
TEST_F(GpuKernelTest, Fp8PoolsOnBothPlans) {
  VerifyProblemSpec spec;
  spec.prefix_len = {3000, 17, 900, 4100, 0, 2500};
  spec.draft_len = {4, 4, 4, 4, 4, 4};
  spec.num_heads = 8;
  spec.page_size = 32;
  spec.kv_dtype = KvDtype::kFp8;
  spec.seed = 77;
  for (const bool stream : {true, false}) {
    HostVerifyProblem problem = MakeProblem(spec);
    VerifyLaunchConfig config = config_;
    config.stream_plan = stream;
    config.plan_in_warp_max_batch = 0;
    const Comparison result = RunAndCompare(problem, config);
    EXPECT_TRUE(result.ok()) << (stream ? "stream plan: " : "chunk plan: ") << result.ToString();
  }
  // Heavy-tailed rows with rising scores move the exponent reference inside
  // the fp8 tiles too.
  spec.kv_range = 4.0f;
  spec.kv_ramp = 3.0f;
  spec.seed = 78;
  HostVerifyProblem problem = MakeProblem(spec);
  const Comparison result = RunAndCompare(problem, config_);
  EXPECT_TRUE(result.ok()) << "rising scores: " << result.ToString();
}

// The copy lists of a batch (copy_list.h): the gather runs the list in the
// ring slot its cursor names (host memory read in place) and advances the
// cursor, so launches of one grid take slots 0, 1, 2, 0, ...; the scatter
// runs a list in device memory. Rows of random sizes and pitches at every
// alignment a dtype allows, between device memory and mapped host memory in
// both directions, equal a host memcpy of the same list.
TEST_F(GpuKernelTest, CopyListsMoveEveryRowAtAnyAlignment) {
  constexpr int kSlots = 3, kCapacity = 48, kRowBlocks = 4;
  constexpr size_t kBuffer = size_t{4} << 20;
  const size_t slot_bytes = CopyListBytes(kCapacity);
  uint8_t *slots = nullptr, *host_src = nullptr, *host_dst = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&slots), kSlots * slot_bytes,
                          cudaHostAllocMapped | cudaHostAllocPortable),
            cudaSuccess);
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host_src), kBuffer, cudaHostAllocMapped),
            cudaSuccess);
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&host_dst), kBuffer, cudaHostAllocMapped),
            cudaSuccess);
  DeviceBuffer dev_src, dev_dst, counters, device_list, fetched;
  ASSERT_TRUE(dev_src.Allocate(kBuffer).ok());
  ASSERT_TRUE(dev_dst.Allocate(kBuffer).ok());
  ASSERT_TRUE(counters.Allocate(16).ok());
  ASSERT_TRUE(device_list.Allocate(slot_bytes).ok());
  ASSERT_TRUE(fetched.Allocate(slot_bytes).ok());
  ASSERT_EQ(cudaMemset(counters.as<void>(), 0, 16), cudaSuccess);
  void *slots_dev = nullptr, *src_dev = nullptr, *dst_dev = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(&slots_dev, slots, 0), cudaSuccess);
  ASSERT_EQ(cudaHostGetDevicePointer(&src_dev, host_src, 0), cudaSuccess);
  ASSERT_EQ(cudaHostGetDevicePointer(&dst_dev, host_dst, 0), cudaSuccess);
  std::mt19937_64 rng(17);
  std::vector<uint8_t> src_mirror(kBuffer), dst_mirror(kBuffer), host_dst_mirror(kBuffer);
  for (auto& b : src_mirror) b = static_cast<uint8_t>(rng());
  for (size_t k = 0; k < kBuffer; ++k) host_src[k] = static_cast<uint8_t>(rng());
  ASSERT_EQ(cudaMemcpy(dev_src.as<void>(), src_mirror.data(), kBuffer, cudaMemcpyHostToDevice),
            cudaSuccess);
  const uint64_t dev_src_a = reinterpret_cast<uint64_t>(dev_src.as<void>());
  const uint64_t dev_dst_a = reinterpret_cast<uint64_t>(dev_dst.as<void>());
  const uint64_t host_src_a = reinterpret_cast<uint64_t>(src_dev);
  const uint64_t host_dst_a = reinterpret_cast<uint64_t>(dst_dev);
  GatherParams gather{};
  gather.slots = static_cast<const uint8_t*>(slots_dev);
  gather.slot_bytes = slot_bytes;
  gather.num_slots = kSlots;
  gather.cursor = counters.as<int32_t>();
  gather.list = fetched.as<CopyListHeader>();
  gather.capacity = kCapacity;
  gather.row_blocks = kRowBlocks;
  for (int launch = 0; launch < 7; ++launch) {
    const bool scatter = launch == 6;
    std::memset(host_dst, 0xAB, kBuffer);
    std::fill(host_dst_mirror.begin(), host_dst_mirror.end(), 0xAB);
    ASSERT_EQ(cudaMemset(dev_dst.as<void>(), 0xCD, kBuffer), cudaSuccess);
    std::fill(dst_mirror.begin(), dst_mirror.end(), 0xCD);
    // The list, and the same list over the host mirrors.
    std::vector<uint8_t> list_bytes(slot_bytes);
    auto* list = reinterpret_cast<CopyListHeader*>(list_bytes.data());
    std::vector<uint8_t> mirror_list_bytes(slot_bytes);
    auto* mirror_list = reinterpret_cast<CopyListHeader*>(mirror_list_bytes.data());
    list->count = mirror_list->count = 10 + static_cast<int>(rng() % (kCapacity - 10));
    size_t next_dst = 0;
    for (int c = 0; c < list->count; ++c) {
      const uint32_t align = 1u << (rng() % 5);  // 1..16
      const uint32_t rows = 1 + static_cast<uint32_t>(rng() % 20);
      const uint32_t row_bytes = align * (1 + static_cast<uint32_t>(rng() % 300));
      const uint32_t src_pitch = row_bytes + align * static_cast<uint32_t>(rng() % 4);
      const uint32_t dst_pitch = row_bytes + align * static_cast<uint32_t>(rng() % 4);
      const uint64_t src_off = align * (rng() % ((kBuffer / 2) / align));
      const uint64_t dst_off = (next_dst + align - 1) / align * align;
      next_dst = dst_off + static_cast<uint64_t>(rows) * dst_pitch;
      ASSERT_LE(next_dst, kBuffer) << "test sizes";
      const bool from_host = rng() % 3 == 0, to_host = rng() % 3 == 0;
      CopyDescriptor& d = CopyListEntries(list)[c];
      d = {(from_host ? host_src_a : dev_src_a) + src_off,
           (to_host ? host_dst_a : dev_dst_a) + dst_off,
           src_pitch,
           dst_pitch,
           row_bytes,
           rows};
      CopyDescriptor& m = CopyListEntries(mirror_list)[c];
      m = d;
      m.src = reinterpret_cast<uint64_t>(from_host ? host_src : src_mirror.data()) + src_off;
      m.dst = reinterpret_cast<uint64_t>(to_host ? host_dst_mirror.data() : dst_mirror.data()) +
              dst_off;
    }
    RunCopyListOnHost(mirror_list);
    if (scatter) {
      ASSERT_EQ(
          cudaMemcpy(device_list.as<void>(), list_bytes.data(), slot_bytes, cudaMemcpyHostToDevice),
          cudaSuccess);
      ScatterParams p{device_list.as<CopyListHeader>(), kCapacity, kRowBlocks};
      ASSERT_TRUE(LaunchScatterCopies(p, nullptr).ok());
    } else {
      std::memcpy(slots + (launch % kSlots) * slot_bytes, list_bytes.data(), slot_bytes);
      ASSERT_TRUE(LaunchGatherCopies(gather, nullptr).ok());
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint8_t> got(kBuffer);
    ASSERT_EQ(cudaMemcpy(got.data(), dev_dst.as<void>(), kBuffer, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(got, dst_mirror) << "launch " << launch << ": device destinations";
    EXPECT_EQ(std::memcmp(host_dst, host_dst_mirror.data(), kBuffer), 0)
        << "launch " << launch << ": host destinations";
    int32_t cursor[2] = {-1, -1};
    ASSERT_EQ(cudaMemcpy(cursor, counters.as<void>(), 8, cudaMemcpyDeviceToHost), cudaSuccess);
    const int gathers = std::min(launch + 1, 6);
    EXPECT_EQ(cursor[0], gathers % kSlots) << "the cursor moves one slot per gather";
  }
  cudaFreeHost(slots);
  cudaFreeHost(host_src);
  cudaFreeHost(host_dst);
}

// Into an fp8 pool the kernel quantizes with the host's code: the same bytes
// as the CPU backend, zeros, huge and tiny values included.
TEST_F(GpuKernelTest, DraftWriteMatchesCpu) {
  for (KvDtype dtype : {KvDtype::kBf16, KvDtype::kFp8}) {
    SCOPED_TRACE(KvDtypeName(dtype));
    VerifyProblemSpec spec;
    spec.prefix_len = {0, 100, 63, 1};
    spec.draft_len = {64, 3, 1, 0};
    spec.page_size = 16;
    spec.num_layers = 3;
    spec.seed = 5;
    spec.kv_dtype = dtype;
    HostVerifyProblem problem = MakeProblem(spec);
    std::fill(problem.draft_kv.begin(), problem.draft_kv.begin() + kLatentDim, Bf16{0});
    for (int d = 0; d < kLatentDim; ++d) {
      problem.draft_kv[kLatentDim + d] =
          FloatToBf16((d % 3 == 0 ? 1e-30f : 3e4f) * (d % 2 ? -1 : 1));
    }
    DeviceVerifyProblem device;
    ASSERT_TRUE(device.Init(CapacityFor(problem), config_).ok());
    ASSERT_TRUE(device.Upload(problem).ok());
    ASSERT_TRUE(LaunchWriteDraftKv(device.WriteArgs(), nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_TRUE(WriteDraftKvCpu(problem.HostWriteArgs()).ok());
    std::vector<Bf16> pool(problem.pool.size());
    ASSERT_EQ(cudaMemcpy(pool.data(), device.Args().pool.data, pool.size() * sizeof(Bf16),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(std::memcmp(pool.data(), problem.pool.data(), pool.size() * sizeof(Bf16)), 0);
  }
}

// AppendKv's path: bf16 rows into the pool (quantized into an fp8 pool, the
// CPU backend's bytes), and back out as stored.
TEST_F(GpuKernelTest, RowCopyIntoAnFp8PoolQuantizesLikeTheCpu) {
  constexpr int kLayers = 2, kPage = 4, kPages = 6, kCount = 9;
  const KvPoolView host_view{nullptr, kLayers, kPages, kPage, KvDtype::kFp8};
  const std::vector<int32_t> pages = {4, 1, 5};  // positions 0..11
  std::mt19937_64 rng(17);
  std::vector<Bf16> rows =
      RandomBf16(rng, static_cast<size_t>(kLayers) * kCount * kLatentDim, 3.0f);
  std::vector<Bf16> want(static_cast<size_t>(kLayers) * kPages * kPage * host_view.RowElements(),
                         Bf16QuietNaN());
  KvPoolView cpu = host_view;
  cpu.data = want.data();
  for (int layer = 0; layer < kLayers; ++layer) {
    for (int t = 0; t < kCount; ++t) {
      StoreLatentRow(KvDtype::kFp8, rows.data() + (layer * kCount + t) * kLatentDim,
                     cpu.RowBytes(layer, pages.data(), 2 + t));
    }
  }
  DeviceBuffer pool, table, d_rows, back;
  ASSERT_TRUE(pool.Allocate(want.size() * sizeof(Bf16)).ok());
  ASSERT_TRUE(table.Allocate(pages.size() * sizeof(int32_t)).ok());
  ASSERT_TRUE(d_rows.Allocate(rows.size() * sizeof(Bf16)).ok());
  ASSERT_TRUE(back.Allocate(static_cast<size_t>(kLayers) * kCount * kFp8RowBytes).ok());
  std::vector<Bf16> poison(want.size(), Bf16QuietNaN());
  cudaMemcpy(pool.as<void>(), poison.data(), pool.bytes(), cudaMemcpyHostToDevice);
  cudaMemcpy(table.as<void>(), pages.data(), table.bytes(), cudaMemcpyHostToDevice);
  cudaMemcpy(d_rows.as<void>(), rows.data(), d_rows.bytes(), cudaMemcpyHostToDevice);
  KvPoolView device_view = host_view;
  device_view.data = pool.as<Bf16>();
  ASSERT_TRUE(LaunchCopyRows(device_view, table.as<int32_t>(), 2, kCount, d_rows.as<Bf16>(),
                             /*to_pool=*/true, nullptr)
                  .ok());
  ASSERT_TRUE(LaunchCopyRows(device_view, table.as<int32_t>(), 2, kCount, back.as<Bf16>(),
                             /*to_pool=*/false, nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<Bf16> got(want.size());
  cudaMemcpy(got.data(), pool.as<void>(), pool.bytes(), cudaMemcpyDeviceToHost);
  EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(Bf16)), 0);
  std::vector<uint8_t> read(back.bytes());
  cudaMemcpy(read.data(), back.as<void>(), back.bytes(), cudaMemcpyDeviceToHost);
  for (int layer = 0; layer < kLayers; ++layer) {
    for (int t = 0; t < kCount; ++t) {
      EXPECT_EQ(std::memcmp(read.data() + (layer * kCount + t) * kFp8RowBytes,
                            cpu.RowBytes(layer, pages.data(), 2 + t), kFp8RowBytes),
                0)
          << "layer " << layer << " row " << t;
    }
  }
}

TEST_F(GpuKernelTest, CompactionMatchesCpuInEveryLayer) {
  for (KvDtype dtype : {KvDtype::kBf16, KvDtype::kFp8}) {
    SCOPED_TRACE(KvDtypeName(dtype));
    VerifyProblemSpec spec;
    spec.prefix_len = {0, 40, 129, 7, 1000};
    spec.draft_len = {16, 64, 8, 5, 3};
    spec.page_size = 8;
    spec.num_layers = 4;
    spec.seed = 9;
    spec.kv_dtype = dtype;
    HostVerifyProblem problem = MakeProblem(spec);
    // Fill every layer at every position 0..P+N-1 so the move is visible in all.
    const KvPoolView view{problem.pool.data(), spec.num_layers, problem.num_pages, spec.page_size,
                          dtype};
    std::mt19937_64 rng(3);
    for (int b = 0; b < problem.batch; ++b) {
      const int32_t* pages = problem.page_table.data() + b * problem.page_table_stride;
      for (int layer = 0; layer < spec.num_layers; ++layer) {
        for (int64_t j = 0; j < problem.prefix_len[b] + problem.draft_len[b]; ++j) {
          Bf16* row = problem.pool.data() + view.RowOffset(layer, pages, j);
          for (int d = 0; d < view.RowElements(); ++d) {
            row[d] = Bf16{static_cast<uint16_t>(rng() & 0x3fff)};
          }
        }
      }
    }
    // Accepted paths: root-to-node paths of each request's tree, including an
    // empty one and one whose destinations are other steps' sources.
    std::vector<int32_t> accepted_len(problem.batch, 0), accepted(problem.batch * kMaxDraftLen, 0);
    for (int b = 0; b < problem.batch; ++b) {
      std::vector<int32_t> path;
      if (b != 3) {
        int node = problem.draft_len[b] - 1;  // walk up from the last draft
        while (node >= 0) {
          path.push_back(node);
          node = problem.parents[b][node];
        }
        std::reverse(path.begin(), path.end());
      }
      ASSERT_TRUE(ValidateAcceptedPath(problem.parents[b], path).ok());
      accepted_len[b] = static_cast<int32_t>(path.size());
      std::copy(path.begin(), path.end(), accepted.begin() + b * kMaxDraftLen);
    }
    DeviceBuffer pool, page_table, prefix_len, d_accepted_len, d_accepted;
    ASSERT_TRUE(pool.Allocate(problem.pool.size() * sizeof(Bf16)).ok());
    ASSERT_TRUE(page_table.Allocate(problem.page_table.size() * sizeof(int32_t)).ok());
    ASSERT_TRUE(prefix_len.Allocate(problem.batch * sizeof(int32_t)).ok());
    ASSERT_TRUE(d_accepted_len.Allocate(problem.batch * sizeof(int32_t)).ok());
    ASSERT_TRUE(d_accepted.Allocate(accepted.size() * sizeof(int32_t)).ok());
    cudaMemcpy(pool.as<void>(), problem.pool.data(), pool.bytes(), cudaMemcpyHostToDevice);
    cudaMemcpy(page_table.as<void>(), problem.page_table.data(), page_table.bytes(),
               cudaMemcpyHostToDevice);
    cudaMemcpy(prefix_len.as<void>(), problem.prefix_len.data(), prefix_len.bytes(),
               cudaMemcpyHostToDevice);
    cudaMemcpy(d_accepted_len.as<void>(), accepted_len.data(), d_accepted_len.bytes(),
               cudaMemcpyHostToDevice);
    cudaMemcpy(d_accepted.as<void>(), accepted.data(), d_accepted.bytes(), cudaMemcpyHostToDevice);

    CompactArguments args;
    args.batch = problem.batch;
    args.pool =
        KvPoolView{pool.as<Bf16>(), spec.num_layers, problem.num_pages, spec.page_size, dtype};
    args.page_table = page_table.as<int32_t>();
    args.page_table_stride = problem.page_table_stride;
    args.prefix_len = prefix_len.as<int32_t>();
    args.accepted_len = d_accepted_len.as<int32_t>();
    args.accepted = d_accepted.as<int32_t>();
    ASSERT_TRUE(LaunchCompactAcceptedKv(args, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    std::vector<Bf16> before = problem.pool;
    CompactArguments host_args = args;
    host_args.pool.data = problem.pool.data();
    host_args.page_table = problem.page_table.data();
    host_args.prefix_len = problem.prefix_len.data();
    host_args.accepted_len = accepted_len.data();
    host_args.accepted = accepted.data();
    ASSERT_TRUE(CompactAcceptedKvCpu(host_args).ok());
    ASSERT_NE(std::memcmp(before.data(), problem.pool.data(), before.size() * sizeof(Bf16)), 0)
        << "the CPU compaction moved nothing: the test would not see a broken kernel";
    std::vector<Bf16> gpu_pool(problem.pool.size());
    cudaMemcpy(gpu_pool.data(), pool.as<void>(), pool.bytes(), cudaMemcpyDeviceToHost);
    EXPECT_EQ(std::memcmp(gpu_pool.data(), problem.pool.data(), gpu_pool.size() * sizeof(Bf16)), 0);
  }
}

// The graph replay over a pool of `dtype` (a void function, so that ASSERTs end it).
void CapturedGraphReplays(const VerifyLaunchConfig& base, KvDtype dtype) {
  // One bucket: 4 requests, up to 16 drafts, 8 heads, page size 16, a pool
  // and page tables sized for prefixes up to 3000.
  constexpr int kBatch = 4, kMaxDraft = 16, kHeads = 8, kPage = 16, kMaxPrefix = 3000;
  const int64_t table_stride = (kMaxPrefix + kMaxDraft + kPage - 1) / kPage;
  const int64_t pool_pages = kBatch * table_stride + 4;
  auto spec_for = [&](int round) {
    std::mt19937_64 rng(100 + round);
    VerifyProblemSpec spec;
    for (int b = 0; b < kBatch; ++b) {
      spec.prefix_len.push_back(static_cast<int>(rng() % (kMaxPrefix + 1)));
      // Request 0 always has the full bucket so that capacity matches.
      spec.draft_len.push_back(b == 0 ? kMaxDraft : static_cast<int>(rng() % (kMaxDraft + 1)));
    }
    if (round == 3) spec.prefix_len = {0, 1, 2999, 64};
    spec.num_heads = kHeads;
    spec.page_size = kPage;
    spec.num_layers = 2;
    spec.mask = round % 2 == 0 ? MaskKind::kTree : MaskKind::kChain;
    spec.seed = 500 + round;
    spec.kv_dtype = dtype;
    spec.min_num_pages = pool_pages;
    spec.min_page_table_stride = table_stride;
    spec.extra_pages = 0;
    return spec;
  };
  HostVerifyProblem first = MakeProblem(spec_for(0));
  DeviceVerifyProblem device;
  testing::DeviceCapacity capacity = CapacityFor(first);
  capacity.total_draft = kBatch * kMaxDraft;
  capacity.q_elems = static_cast<int64_t>(capacity.total_draft) * kHeads * kLatentDim;
  ASSERT_TRUE(device.Init(capacity, base).ok());
  ASSERT_TRUE(device.Upload(first).ok());
  const VerifyArguments captured_args = device.Args();

  // With and without the fused combine (its counters must come back to zero
  // after every replay).
  for (const bool fused : {false, true}) {
    VerifyLaunchConfig config = base;
    config.fused_combine_max_batch = fused ? kAnyBatch : 0;
    EXPECT_EQ(LaunchUsesFusedCombine(captured_args, config), fused);
    cudaStream_t stream;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    cudaGraph_t graph;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ASSERT_TRUE(LaunchWriteDraftKv(device.WriteArgs(), stream).ok());
    ASSERT_TRUE(LaunchVerifyAttention(captured_args, config, device.workspace(),
                                      device.workspace_bytes(), stream)
                    .ok());
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

    for (int round = 0; round < 6; ++round) {
      HostVerifyProblem problem = MakeProblem(spec_for(round));  // the same data for both modes
      ASSERT_TRUE(device.Upload(problem).ok());                  // new contents, same addresses
      const VerifyArguments now = device.Args();
      ASSERT_EQ(now.q, captured_args.q);
      ASSERT_EQ(now.page_table_stride, captured_args.page_table_stride);
      ASSERT_EQ(now.pool.num_pages, captured_args.pool.num_pages);
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      std::vector<Bf16> out;
      std::vector<float> lse;
      ASSERT_TRUE(device.Download(problem, &out, &lse).ok());
      ASSERT_TRUE(WriteDraftKvCpu(problem.HostWriteArgs()).ok());
      const Comparison result = testing::CompareWithReference(problem, out, lse, kMaxCheckedRows);
      EXPECT_TRUE(result.ok()) << KvDtypeName(dtype) << (fused ? " fused combine, " : " ")
                               << "replay " << round
                               << " (P=" << absl::StrJoin(problem.prefix_len, "/")
                               << " N=" << absl::StrJoin(problem.draft_len, "/")
                               << "): " << result.ToString();
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

TEST_F(GpuKernelTest, CapturedGraphReplaysWithNewLengthsAndTrees) {
  CapturedGraphReplays(config_, KvDtype::kBf16);
}

// The same over an fp8 pool: the captured draft write quantizes each
// replay's drafts, the attention reads the stored rows.
TEST_F(GpuKernelTest, Fp8CapturedGraphReplaysWithNewLengthsAndTrees) {
  CapturedGraphReplays(config_, KvDtype::kFp8);
}

}  // namespace
}  // namespace mlaverify::kernels
