// A sequence's state changes under its lock (server/engine/sequence.h):
// the pages a step needs, opening one and closing it unrun, the page-list
// changes its devices are sent, and release.
#include "server/engine/sequence.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mlaverify::engine {
namespace {

using ::testing::ElementsAre;

TEST(SequenceTest, AStepTakesThePagesItNeedsAndGivesThemBackUnrun) {
  Sequence s(7, "label", 0);
  absl::MutexLock lock(&s.mu);
  s.length = 10;  // page size 8: pages 0 and 1 hold positions 0..15
  s.pages = {4, 5};
  EXPECT_EQ(*s.PagesToOpenStep(6, 8, 100), 0);  // 10 + 6 = 16 fits
  EXPECT_EQ(*s.PagesToOpenStep(7, 8, 100), 1);
  EXPECT_EQ(*s.PagesToOpenStep(15, 8, 100), 2);
  EXPECT_EQ(s.PagesToOpenStep(91, 8, 100).status().code(), absl::StatusCode::kResourceExhausted);

  EXPECT_EQ(s.TakeDelta()->values, (std::vector<int32_t>{4, 5}));  // the devices learn both
  EXPECT_EQ(s.TakeDelta(), nullptr);                               // then nothing changed

  const std::vector<int32_t> fresh = {9, 3};
  const std::vector<int32_t> parents = {-1, 0, 0};
  s.OpenStep(fresh, parents, nullptr, 4);
  EXPECT_TRUE(s.pending);
  EXPECT_EQ(s.step, 1u);
  EXPECT_EQ(s.step_pages, 2);
  EXPECT_THAT(s.pages, ElementsAre(4, 5, 9, 3));
  EXPECT_EQ(s.layer_verified.size(), 4u);
  auto delta = s.TakeDelta();
  ASSERT_NE(delta, nullptr);
  EXPECT_EQ(delta->keep, 2);
  EXPECT_THAT(delta->values, ElementsAre(9, 3));

  EXPECT_THAT(s.CloseStepUnrun(), ElementsAre(9, 3));
  EXPECT_FALSE(s.pending);
  EXPECT_THAT(s.pages, ElementsAre(4, 5));
  delta = s.TakeDelta();  // the devices' table shrinks back to two entries
  ASSERT_NE(delta, nullptr);
  EXPECT_EQ(delta->keep, 2);
  EXPECT_TRUE(delta->values.empty());
}

TEST(SequenceTest, ReleaseDetachesThePagesAndSaysWhetherAStepWasOpen) {
  Sequence s(8, "", 0);
  absl::MutexLock lock(&s.mu);
  s.pages = {1, 2};
  const std::vector<int32_t> parents = {-1};
  s.OpenStep(std::vector<int32_t>{3}, parents, nullptr, 2);
  bool had_step = false;
  EXPECT_THAT(s.MarkReleased(&had_step), ElementsAre(1, 2, 3));
  EXPECT_TRUE(had_step);
  EXPECT_TRUE(s.released);
  EXPECT_FALSE(s.pending);
  EXPECT_TRUE(s.pages.empty());
}

}  // namespace
}  // namespace mlaverify::engine
