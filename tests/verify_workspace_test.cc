// The verify workspace's layout contract, checked on the host (no GPU): one
// workspace sized and initialised for the largest shape (the engine sizes for
// max_batch, max_draft_len) serves every launch of a smaller shape.
#include "kernels/verify_workspace.h"

#include <gtest/gtest.h>

#include <vector>

#include "kernels/verify_attention_cuda.h"

namespace mlaverify::kernels {
namespace {

VerifyLaunchConfig H200Config() {
  VerifyLaunchConfig c;
  c.num_sms = 132;
  c.resident_ctas = 132;
  return c;
}

VerifyArguments Shape(int batch, int heads, int max_draft_len) {
  VerifyArguments a;
  a.batch = batch;
  a.num_heads = heads;
  a.max_draft_len = max_draft_len;
  return a;
}

// InitVerifyWorkspace writes the fused combine's mark and counters where the
// layout of its shape puts them; a launch of any other shape must look there.
TEST(VerifyWorkspaceTest, FusedStateDoesNotMoveWithTheLaunchShape) {
  for (const VerifyLaunchConfig& config : {H200Config(), [] {
                                             VerifyLaunchConfig c = H200Config();
                                             c.num_sms = 188;  // RTX PRO 6000 Blackwell
                                             c.ctas_per_sm = 2;
                                             return c;
                                           }()}) {
    const VerifyWorkspaceLayout sized = VerifyWorkspaceLayoutFor(Shape(32, 128, 64), config);
    for (int batch : {1, 2, 4, 7, 32}) {
      for (int heads : {1, 8, 128}) {
        for (int draft : {1, 16, 64}) {
          const VerifyWorkspaceLayout l =
              VerifyWorkspaceLayoutFor(Shape(batch, heads, draft), config);
          EXPECT_EQ(l.fused_magic, sized.fused_magic) << batch << " " << heads << " " << draft;
          EXPECT_EQ(l.split_arrivals, sized.split_arrivals)
              << batch << " " << heads << " " << draft;
          EXPECT_EQ(l.split_done, sized.split_done) << batch << " " << heads << " " << draft;
          // ...and a smaller launch fits the bytes the largest one was sized for.
          EXPECT_LE(l.bytes, sized.bytes) << batch << " " << heads << " " << draft;
          EXPECT_LE(l.bytes, VerifyWorkspaceBytes(Shape(32, 128, 64), config));
        }
      }
    }
  }
}

TEST(VerifyWorkspaceTest, RegionsAreAlignedInOrderAndHoldTheirArrays) {
  const VerifyLaunchConfig config = H200Config();
  const VerifyArguments shape = Shape(40, 16, 64);  // more row tiles than CTAs: max_work > target
  const VerifyWorkspaceLayout l = VerifyWorkspaceLayoutFor(shape, config);
  const int target = VerifyTargetCtas(config);
  const int max_work = VerifyMaxWork(shape, config);
  EXPECT_EQ(target, 132);
  EXPECT_EQ(max_work, 40 * 32);  // 64 drafts x 16 heads = 32 row tiles per request
  const std::vector<std::pair<size_t, size_t>> regions = {
      {l.fused_magic, sizeof(unsigned long long)},
      {l.split_arrivals, sizeof(unsigned int) * target},
      {l.split_done, sizeof(unsigned int) * target},
      {l.summary, sizeof(VerifyPlanSummary)},
      {l.request_q_row, sizeof(int32_t) * shape.batch},
      {l.request_stream_start, sizeof(int32_t) * shape.batch},
      {l.work, sizeof(VerifyWorkItem) * max_work},
      {l.partial_lse, sizeof(float) * 2 * target * kVerifyRowsPerCta},
      {l.partial_out, sizeof(uint16_t) * 2 * target * kVerifyRowsPerCta * kValueDim},
  };
  size_t end = 0;
  for (size_t i = 0; i < regions.size(); ++i) {
    EXPECT_EQ(regions[i].first % 256, 0u) << "region " << i;
    EXPECT_GE(regions[i].first, end) << "region " << i << " overlaps the one before";
    end = regions[i].first + regions[i].second;
  }
  EXPECT_LE(end, l.bytes);
  EXPECT_EQ(l.bytes, VerifyWorkspaceBytes(shape, config));
}

}  // namespace
}  // namespace mlaverify::kernels
