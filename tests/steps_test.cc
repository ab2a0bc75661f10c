// Device-driven verify steps (server/engine/steps.h) on the CPU backend and
// the fake device: one OpenStep, then every layer rung through a doorbell
// and waited for on a completion slot, no call per layer. The outputs of
// every layer are checked against the CPU reference over an independent
// mirror of each sequence, the KV after Commit against the mirror, and every
// way a step can end early (AbortStep, a layer timeout, the deadline, a
// release, shutdown) against "every sequence as before the step, every page
// back".
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/draft_tree.h"
#include "common/host_doorbell.h"
#include "common/workload.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/engine/device.h"
#include "server/engine/engine.h"
#include "tests/step_fixture.h"

namespace mlaverify::engine {
namespace {

using ::testing::HasSubstr;

// Which device the engine runs on.
enum class Flavor {
  kCpu,          // the CPU backend: host doorbells only
  kFake,         // the fake device (host and device doorbells)
  kFakeAsync,    // the fake device deferring its main launches to Wait, as a GPU
  kFakeGpuLike,  // the fake device addressing only its own and pinned memory
};

std::unique_ptr<Device> MakeDevice(Flavor flavor, int index) {
  FakeDeviceOptions fake;
  switch (flavor) {
    case Flavor::kCpu:
      return MakeCpuDevice(1);
    case Flavor::kFake:
      break;
    case Flavor::kFakeAsync:
      fake.asynchronous = true;
      break;
    case Flavor::kFakeGpuLike:
      fake.addresses_host_memory = false;
      break;
  }
  return MakeFakeDevice(index, fake, nullptr);
}

class StepsTest : public StepFixture {
 protected:
  // An engine over `devices` devices of `flavor` (tensor parallel when
  // several, unless `mode`).
  void Make(Flavor flavor, int devices = 1, int lanes = 2,
            ParallelMode mode = ParallelMode::kTensorParallel) {
    std::vector<std::unique_ptr<Device>> list;
    for (int d = 0; d < devices; ++d) list.push_back(MakeDevice(flavor, d));
    MakeOn(std::move(list), lanes, mode);
  }

  HostSlot Doorbell(const Placed& p, const StepOpened& o, int r) {
    if (p.request.doorbell_kind == DoorbellKind::kDevice) {
      return HostSlot(o.ranks[r].arena_host + o.ranks[r].doorbell_offset);
    }
    return HostSlot(region_ + p.request.ranks[r].doorbell_offset);
  }
};

class StepsFlavorTest : public StepsTest, public ::testing::WithParamInterface<Flavor> {};

// Every layer of a two-item step, rung one at a time, equals the reference;
// Commit of the accepted paths leaves the KV as the mirror says; a second
// step builds on the first.
TEST_P(StepsFlavorTest, HostDoorbellStepsMatchTheReferenceAndCommit) {
  Make(GetParam());
  std::vector<Mirror> mirrors(2);
  const uint64_t a = NewSequence(21, &mirrors[0]);
  const uint64_t b = NewSequence(5, &mirrors[1]);
  const int64_t free_before = engine_->Stats().free_pages;
  for (int round = 0; round < 2; ++round) {
    std::vector<ItemData> items = {RandomItem(a, round == 0 ? 7 : 1), RandomItem(b, 3)};
    Placed p = Place(items);
    auto opened = engine_->OpenStep(p.request);
    ASSERT_TRUE(opened.ok()) << opened.status();
    EXPECT_EQ(opened->prefix_len[0], mirrors[0].length());
    EXPECT_EQ(opened->prefix_len[1], mirrors[1].length());
    EXPECT_EQ(engine_->Stats().steps.open, 1);
    for (int l = 0; l < kLayers; ++l) {
      RingAndWait(p, *opened, l + 1);
      ExpectLayer(p, items, mirrors, l);
    }
    CommitLastPathOfFirst(items, mirrors);
    const StepInfo info = WaitEnded(opened->step_id);
    EXPECT_EQ(info.state, StepState::kCommitted);
    EXPECT_EQ(info.layers_done, kLayers);
    ExpectKvEquals(a, mirrors[0]);
    ExpectKvEquals(b, mirrors[1]);
  }
  const EngineStats stats = engine_->Stats();
  EXPECT_EQ(stats.steps.committed_total, 2);
  EXPECT_EQ(stats.steps.open, 0);
  EXPECT_EQ(stats.steps.lanes_busy, 0);
  EXPECT_EQ(stats.pending_steps, 0);
  // Only the accepted drafts took pages.
  EXPECT_LE(stats.free_pages, free_before);
  ASSERT_TRUE(engine_->Release(a).ok());
  ASSERT_TRUE(engine_->Release(b).ok());
  EXPECT_EQ(engine_->Stats().free_pages, engine_->Stats().total_pages);
}

INSTANTIATE_TEST_SUITE_P(Devices, StepsFlavorTest,
                         ::testing::Values(Flavor::kCpu, Flavor::kFake, Flavor::kFakeAsync,
                                           Flavor::kFakeGpuLike),
                         [](const ::testing::TestParamInfo<Flavor>& info) {
                           switch (info.param) {
                             case Flavor::kCpu:
                               return "cpu";
                             case Flavor::kFake:
                               return "fake";
                             case Flavor::kFakeAsync:
                               return "async";
                             default:
                               return "gpu_like";
                           }
                         });

// GPU doorbells on the fake device: the words are in its arena; each step
// on a lane takes the lane's next pair of words, and a pair used again
// starts past every value its earlier step could have seen, so an old value
// never rings a new step.
TEST_F(StepsTest, DeviceDoorbellsRotateWordsAndRaiseValues) {
  Make(Flavor::kFake, 1, /*lanes=*/1);
  std::vector<Mirror> mirrors(1);
  const uint64_t a = NewSequence(9, &mirrors[0]);
  std::map<uint64_t, uint64_t> last_base;  // doorbell offset -> base
  const int rounds = kDoorbellPairsPerLane + 2;
  for (int round = 0; round < rounds; ++round) {
    std::vector<ItemData> items = {RandomItem(a, round % 3 + 1)};
    Placed p = Place(items, DoorbellKind::kDevice);
    auto opened = engine_->OpenStep(p.request);
    ASSERT_TRUE(opened.ok()) << opened.status();
    const StepRankDoorbell& db = opened->ranks[0];
    ASSERT_NE(db.arena_host, nullptr);
    EXPECT_EQ(db.completion_offset, db.doorbell_offset + kHostSlotBytes);
    auto earlier = last_base.find(db.doorbell_offset);
    if (round < kDoorbellPairsPerLane) {
      EXPECT_EQ(earlier, last_base.end()) << "a fresh pair for each of the first steps";
      EXPECT_EQ(db.base, 0u);
    } else {
      ASSERT_NE(earlier, last_base.end());
      EXPECT_GT(db.base, earlier->second + kLayers + 1);
      // The pair's old values (the earlier step's last ring) ring nothing.
      Doorbell(p, *opened, 0).Store(earlier->second + kLayers);
      absl::SleepFor(absl::Milliseconds(20));
      EXPECT_EQ(engine_->GetStep(opened->step_id)->layers_done, 0);
      EXPECT_LE(Completion(p, *opened, 0), db.base);
    }
    last_base[db.doorbell_offset] = db.base;
    for (int l = 0; l < kLayers; ++l) {
      RingAndWait(p, *opened, l + 1);
      if (round == 0 || round == rounds - 1) ExpectLayer(p, items, mirrors, l);
    }
    const std::vector<int32_t> path = LastPath(items[0].parents);
    ASSERT_TRUE(engine_->Commit(a, path).ok());
    Accept(&mirrors[0], items[0], path);
    EXPECT_EQ(WaitEnded(opened->step_id).state, StepState::kCommitted);
  }
  ExpectKvEquals(a, mirrors[0]);
}

// Rings that go back, or come all at once, are fine: a layer runs once the
// doorbell reached it, in layer order.
TEST_F(StepsTest, RingsOutOfOrderAndAllAtOnce) {
  Make(Flavor::kFake);
  std::vector<Mirror> mirrors(1);
  const uint64_t a = NewSequence(13, &mirrors[0]);
  std::vector<ItemData> items = {RandomItem(a, 5)};
  Placed p = Place(items);
  auto opened = engine_->OpenStep(p.request);
  ASSERT_TRUE(opened.ok()) << opened.status();
  RingAndWait(p, *opened, 2);
  Doorbell(p, *opened, 0).Store(1);  // lower: changes nothing
  absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(Completion(p, *opened, 0), 2u);
  RingAndWait(p, *opened, kLayers);
  for (int l = 0; l < kLayers; ++l) ExpectLayer(p, items, mirrors, l);
  ASSERT_TRUE(engine_->Commit(a, {}).ok());
  EXPECT_EQ(WaitEnded(opened->step_id).state, StepState::kCommitted);
  ExpectKvEquals(a, mirrors[0]);
}

// A Commit sent before the last layer ran waits for it; one that waits on a
// step that is aborted fails with ABORTED.
TEST_F(StepsTest, CommitBeforeTheLastLayerWaitsForIt) {
  Make(Flavor::kFake);
  std::vector<Mirror> mirrors(1);
  const uint64_t a = NewSequence(10, &mirrors[0]);
  {
    std::vector<ItemData> items = {RandomItem(a, 3)};
    Placed p = Place(items);
    auto opened = engine_->OpenStep(p.request);
    ASSERT_TRUE(opened.ok()) << opened.status();
    RingAndWait(p, *opened, 1);
    absl::Notification committed;
    absl::StatusOr<CommitResult> result;
    const std::vector<int32_t> path = LastPath(items[0].parents);
    engine_->SubmitCommit(a, path, [&](absl::StatusOr<CommitResult> r) {
      result = std::move(r);
      committed.Notify();
    });
    EXPECT_FALSE(committed.WaitForNotificationWithTimeout(absl::Milliseconds(30)))
        << "committed before the layers ran";
    RingAndWait(p, *opened, kLayers);
    ASSERT_TRUE(committed.WaitForNotificationWithTimeout(absl::Seconds(10)));
    ASSERT_TRUE(result.ok()) << result.status();
    Accept(&mirrors[0], items[0], path);
    EXPECT_EQ(result->length, mirrors[0].length());
    EXPECT_EQ(WaitEnded(opened->step_id).state, StepState::kCommitted);
  }
  {
    std::vector<ItemData> items = {RandomItem(a, 3)};
    Placed p = Place(items);
    auto opened = engine_->OpenStep(p.request);
    ASSERT_TRUE(opened.ok()) << opened.status();
    absl::Notification committed;
    absl::StatusOr<CommitResult> result;
    engine_->SubmitCommit(a, {0}, [&](absl::StatusOr<CommitResult> r) {
      result = std::move(r);
      committed.Notify();
    });
    auto aborted = engine_->AbortStep(opened->step_id);
    ASSERT_TRUE(aborted.ok()) << aborted.status();
    EXPECT_EQ(aborted->state, StepState::kAborted);
    ASSERT_TRUE(committed.WaitForNotificationWithTimeout(absl::Seconds(10)));
    EXPECT_EQ(result.status().code(), absl::StatusCode::kAborted) << result.status();
  }
  ExpectKvEquals(a, mirrors[0]);
}

// Every early end leaves each sequence as before the step with every page
// back: AbortStep mid-way, a layer timeout (the scheduler stopped ringing),
// the step's deadline, a release of one of its sequences.
TEST_F(StepsTest, EarlyEndsLeaveEverySequenceAsBefore) {
  Make(Flavor::kFake);
  std::vector<Mirror> mirrors(2);
  const uint64_t a = NewSequence(17, &mirrors[0]);
  uint64_t b = NewSequence(8, &mirrors[1]);
  const int64_t free_before = engine_->Stats().free_pages;
  struct Case {
    const char* name;
    StepAbortReason reason;
  };
  for (const Case c : {Case{"abort", StepAbortReason::kAbortCall},
                       Case{"layer timeout", StepAbortReason::kLayerTimeout},
                       Case{"deadline", StepAbortReason::kDeadline},
                       Case{"release", StepAbortReason::kSequenceReleased}}) {
    SCOPED_TRACE(c.name);
    std::vector<ItemData> items = {RandomItem(a, 6), RandomItem(b, 2)};
    Placed p = Place(items);
    if (c.reason == StepAbortReason::kLayerTimeout)
      p.request.layer_timeout = absl::Milliseconds(50);
    if (c.reason == StepAbortReason::kDeadline) p.request.max_duration = absl::Milliseconds(80);
    auto opened = engine_->OpenStep(p.request);
    ASSERT_TRUE(opened.ok()) << opened.status();
    RingAndWait(p, *opened, 1);
    ExpectLayer(p, items, mirrors, 0);
    uint64_t released = 0;
    switch (c.reason) {
      case StepAbortReason::kAbortCall: {
        auto info = engine_->AbortStep(opened->step_id);
        ASSERT_TRUE(info.ok());
        EXPECT_EQ(info->state, StepState::kAborted);
        break;
      }
      case StepAbortReason::kSequenceReleased: {
        auto freed = engine_->Release(b);
        ASSERT_TRUE(freed.ok()) << freed.status();
        released = b;
        break;
      }
      default:
        break;
    }
    const StepInfo info = WaitEnded(opened->step_id);
    EXPECT_EQ(info.state, StepState::kAborted);
    EXPECT_EQ(info.abort_reason, c.reason) << StepAbortReasonName(info.abort_reason);
    // The scheduler's waits all pass: the completion is past the last layer.
    EXPECT_GT(Completion(p, *opened, 0), opened->ranks[0].base + kLayers);
    EXPECT_EQ(engine_->Commit(a, {0}).status().code(), absl::StatusCode::kFailedPrecondition)
        << "no step is pending any more";
    ExpectKvEquals(a, mirrors[0]);
    if (released != 0) {
      b = NewSequence(8, &mirrors[1]);
      continue;
    }
    ExpectKvEquals(b, mirrors[1]);
    EXPECT_EQ(engine_->Stats().free_pages, free_before);
  }
  const EngineStats stats = engine_->Stats();
  EXPECT_EQ(stats.steps.aborted_total[static_cast<int>(StepAbortReason::kAbortCall)], 1);
  EXPECT_EQ(stats.steps.aborted_total[static_cast<int>(StepAbortReason::kLayerTimeout)], 1);
  EXPECT_EQ(stats.steps.aborted_total[static_cast<int>(StepAbortReason::kDeadline)], 1);
  EXPECT_EQ(stats.steps.aborted_total[static_cast<int>(StepAbortReason::kSequenceReleased)], 1);
  EXPECT_EQ(stats.pending_steps, 0);
  EXPECT_EQ(stats.free_pages, free_before);
  // The sequences work as before.
  std::vector<ItemData> items = {RandomItem(a, 2)};
  Placed p = Place(items);
  auto opened = engine_->OpenStep(p.request);
  ASSERT_TRUE(opened.ok()) << opened.status();
  RingAndWait(p, *opened, kLayers);
  for (int l = 0; l < kLayers; ++l) ExpectLayer(p, items, mirrors, l);
}

// While a step holds a sequence, plain calls on it are refused and nothing
// changes; steps on other sequences and plain Verify calls on others run
// beside it; lanes are bounded per device.
TEST_F(StepsTest, ClaimedSequencesLanesAndPlainCallsBeside) {
  Make(Flavor::kFakeAsync, 1, /*lanes=*/2);
  std::vector<Mirror> mirrors(4);
  std::vector<uint64_t> ids;
  for (int k = 0; k < 4; ++k) ids.push_back(NewSequence(11 + k, &mirrors[k]));
  std::vector<ItemData> first = {RandomItem(ids[0], 4)};
  Placed p1 = Place(first);
  auto s1 = engine_->OpenStep(p1.request);
  ASSERT_TRUE(s1.ok()) << s1.status();
  // The same sequence again.
  std::vector<ItemData> again = {RandomItem(ids[0], 2)};
  auto twice = engine_->OpenStep(Place(again).request);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(twice.status().message()), HasSubstr("already"));
  // Plain calls on it.
  const std::vector<Bf16> kv = RandomBf16(rng_, kLayers * kLatentDim, 1.0f);
  auto appended = engine_->AppendKv(ids[0], mirrors[0].length(), 1, kv);
  EXPECT_EQ(appended.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(appended.status().message()), HasSubstr("device-driven step"));
  {
    const ItemData d = RandomItem(ids[0], 2);
    std::vector<Bf16> out(2 * kHeads * kValueDim);
    std::vector<float> lse(2 * kHeads);
    VerifyItem item{ids[0],        d.parents,           d.q[0],
                    d.draft_kv[0], absl::MakeSpan(out), absl::MakeSpan(lse)};
    const absl::Status verified = engine_->Verify(0, 0.0f, absl::MakeSpan(&item, 1));
    EXPECT_EQ(verified.code(), absl::StatusCode::kFailedPrecondition);
  }
  // A second step on another sequence, and a third: no lane left.
  std::vector<ItemData> second = {RandomItem(ids[1], 8)};
  Placed p2 = Place(second);
  auto s2 = engine_->OpenStep(p2.request);
  ASSERT_TRUE(s2.ok()) << s2.status();
  std::vector<ItemData> third = {RandomItem(ids[2], 1)};
  const int64_t free_before = engine_->Stats().free_pages;
  auto s3 = engine_->OpenStep(Place(third).request);
  EXPECT_EQ(s3.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s3.status().message()), HasSubstr("all 2 step lanes are busy"));
  EXPECT_EQ(engine_->Stats().free_pages, free_before) << "a refused step reserves nothing";
  // Plain Verify calls on another sequence run while both steps are gated.
  {
    const ItemData d = RandomItem(ids[3], 3);
    std::vector<Bf16> out(3 * kHeads * kValueDim);
    std::vector<float> lse(3 * kHeads);
    for (int l = 0; l < kLayers; ++l) {
      VerifyItem item{ids[3],        d.parents,           d.q[l],
                      d.draft_kv[l], absl::MakeSpan(out), absl::MakeSpan(lse)};
      ASSERT_TRUE(engine_->Verify(l, 0.0f, absl::MakeSpan(&item, 1)).ok());
    }
    ASSERT_TRUE(engine_->Commit(ids[3], {}).ok());
  }
  // The two steps, interleaved.
  RingAndWait(p2, *s2, 1);
  RingAndWait(p1, *s1, 2);
  RingAndWait(p2, *s2, kLayers);
  RingAndWait(p1, *s1, kLayers);
  for (int l = 0; l < kLayers; ++l) {
    ExpectLayer(p1, first, {mirrors[0]}, l);
    ExpectLayer(p2, second, {mirrors[1]}, l);
  }
  ASSERT_TRUE(engine_->Commit(ids[0], LastPath(first[0].parents)).ok());
  ASSERT_TRUE(engine_->Commit(ids[1], {}).ok());
  Accept(&mirrors[0], first[0], LastPath(first[0].parents));
  EXPECT_EQ(WaitEnded(s1->step_id).state, StepState::kCommitted);
  EXPECT_EQ(WaitEnded(s2->step_id).state, StepState::kCommitted);
  ExpectKvEquals(ids[0], mirrors[0]);
  ExpectKvEquals(ids[1], mirrors[1]);
}

// Tensor parallel over two devices: each rank rings its own doorbell, gets
// its heads into its own places, and both replicas take the accepted rows.
TEST_F(StepsTest, TensorParallelRanksEachTheirHeads) {
  Make(Flavor::kFake, /*devices=*/2);
  ASSERT_EQ(engine_->heads_per_device(), kHeads / 2);
  std::vector<Mirror> mirrors(2);
  const uint64_t a = NewSequence(19, &mirrors[0]);
  const uint64_t b = NewSequence(3, &mirrors[1]);
  std::vector<ItemData> items = {RandomItem(a, 6), RandomItem(b, 4)};
  Placed p = Place(items);
  ASSERT_EQ(p.request.ranks.size(), 2u);
  auto opened = engine_->OpenStep(p.request);
  ASSERT_TRUE(opened.ok()) << opened.status();
  ASSERT_EQ(opened->ranks.size(), 2u);
  // Rank 1 ahead of rank 0: the step's progress is the slower rank's.
  Ring(p, *opened, 1, kLayers);
  ASSERT_GE(AwaitCompletion(p, *opened, 1, kLayers), uint64_t{kLayers});
  EXPECT_EQ(engine_->GetStep(opened->step_id)->layers_done, 0);
  RingAndWait(p, *opened, kLayers);
  for (int l = 0; l < kLayers; ++l) ExpectLayer(p, items, mirrors, l);
  const std::vector<int32_t> path = LastPath(items[0].parents);
  ASSERT_TRUE(engine_->Commit(a, path).ok());
  ASSERT_TRUE(engine_->Commit(b, {}).ok());
  Accept(&mirrors[0], items[0], path);
  EXPECT_EQ(WaitEnded(opened->step_id).state, StepState::kCommitted);
  for (int replica = 0; replica < 2; ++replica) ExpectKvEquals(a, mirrors[0], replica);
}

// Data parallel: a step's items must share a device; the one rank has all
// heads.
TEST_F(StepsTest, DataParallelItemsShareADevice) {
  Make(Flavor::kFake, /*devices=*/2, 2, ParallelMode::kDataParallel);
  std::vector<Mirror> mirrors(2);
  const uint64_t a = NewSequence(9, &mirrors[0]);
  const uint64_t b = NewSequence(9, &mirrors[1]);  // placed on the other device
  std::vector<ItemData> both = {RandomItem(a, 2), RandomItem(b, 2)};
  auto mixed = engine_->OpenStep(Place(both).request);
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(mixed.status().message()), HasSubstr("must share a device"));
  std::vector<ItemData> items = {RandomItem(b, 5)};
  Placed p = Place(items);
  auto opened = engine_->OpenStep(p.request);
  ASSERT_TRUE(opened.ok()) << opened.status();
  RingAndWait(p, *opened, kLayers);
  for (int l = 0; l < kLayers; ++l) ExpectLayer(p, items, {mirrors[1]}, l);
  ASSERT_TRUE(engine_->Commit(b, {}).ok());
}

// Bad requests get precise codes and change nothing.
TEST_F(StepsTest, BadRequestsAreRefusedAndChangeNothing) {
  Make(Flavor::kCpu);
  std::vector<Mirror> mirrors(1);
  const uint64_t a = NewSequence(9, &mirrors[0]);
  std::vector<ItemData> items = {RandomItem(a, 3)};
  const Placed good = Place(items);
  const int64_t free_before = engine_->Stats().free_pages;
  struct Case {
    const char* name;
    std::function<void(StepRequest*)> spoil;
    absl::StatusCode code;
    const char* says;
  };
  const std::vector<Case> cases = {
      {"no items", [](StepRequest* r) { r->items.clear(); }, absl::StatusCode::kInvalidArgument,
       "no items"},
      {"a bad tree",
       [](StepRequest* r) {
         r->items[0].parents = {1, -1, 0};
       },
       absl::StatusCode::kInvalidArgument, "items[0]"},
      {"too many drafts", [](StepRequest* r) { r->items[0].parents.assign(17, -1); },
       absl::StatusCode::kInvalidArgument, "need 1..16"},
      {"unknown sequence", [](StepRequest* r) { r->items[0].sequence_id = 12345; },
       absl::StatusCode::kNotFound, "12345"},
      {"ranks", [](StepRequest* r) { r->ranks.push_back(r->ranks[0]); },
       absl::StatusCode::kInvalidArgument, "ranks"},
      {"GPU doorbells on the CPU", [](StepRequest* r) { r->doorbell_kind = DoorbellKind::kDevice; },
       absl::StatusCode::kFailedPrecondition, "CUDA backend"},
      {"short stride", [](StepRequest* r) { r->ranks[0].items[0].q.layer_stride = 64; },
       absl::StatusCode::kInvalidArgument, "layer_stride"},
      {"unknown region", [](StepRequest* r) { r->ranks[0].items[0].out.region = "nope"; },
       absl::StatusCode::kNotFound, "nope"},
      {"past the region",
       [](StepRequest* r) { r->ranks[0].items[0].lse.offset = kRegionBytes - 8; },
       absl::StatusCode::kOutOfRange, "past the end"},
      {"outputs overlap",
       [](StepRequest* r) { r->ranks[0].items[0].lse.offset = r->ranks[0].items[0].q.offset; },
       absl::StatusCode::kInvalidArgument, "overlaps"},
      {"slot misaligned", [](StepRequest* r) { r->ranks[0].completion_offset += 8; },
       absl::StatusCode::kInvalidArgument, "multiple of 16"},
      {"slots on one word",
       [](StepRequest* r) { r->ranks[0].completion_offset = r->ranks[0].doorbell_offset; },
       absl::StatusCode::kInvalidArgument, "overlaps"},
      {"timeout over the limit", [](StepRequest* r) { r->layer_timeout = absl::Seconds(3600); },
       absl::StatusCode::kInvalidArgument, "layer_timeout"},
      {"NaN scale", [](StepRequest* r) { r->softmax_scale = NAN; },
       absl::StatusCode::kInvalidArgument, "finite"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    StepRequest request = good.request;
    c.spoil(&request);
    auto opened = engine_->OpenStep(request);
    EXPECT_EQ(opened.status().code(), c.code) << opened.status();
    EXPECT_THAT(std::string(opened.status().message()), HasSubstr(c.says));
    EXPECT_EQ(engine_->Stats().free_pages, free_before);
    EXPECT_EQ(engine_->Stats().steps.open, 0);
    EXPECT_EQ(engine_->Stats().pending_steps, 0);
  }
  // Nothing was changed: the good request runs.
  auto opened = engine_->OpenStep(good.request);
  ASSERT_TRUE(opened.ok()) << opened.status();
  RingAndWait(good, *opened, kLayers);
  for (int l = 0; l < kLayers; ++l) ExpectLayer(good, items, mirrors, l);
  // A region a step holds cannot be unregistered.
  EXPECT_EQ(engine_->regions().Unregister("sys", RegionKind::kAny).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(engine_->Commit(a, {}).ok());
  WaitEnded(opened->step_id);
  EXPECT_EQ(engine_->GetStep(opened->step_id + 2).status().code(), absl::StatusCode::kNotFound);
}

// An engine destroyed with a step open (the server stops) ends it and its
// lane, whatever the scheduler does.
TEST_F(StepsTest, ShutdownEndsOpenSteps) {
  Make(Flavor::kFake);
  std::vector<Mirror> mirrors(1);
  const uint64_t a = NewSequence(9, &mirrors[0]);
  std::vector<ItemData> items = {RandomItem(a, 3)};
  Placed p = Place(items);
  auto opened = engine_->OpenStep(p.request);
  ASSERT_TRUE(opened.ok()) << opened.status();
  RingAndWait(p, *opened, 1);
  engine_.reset();
  EXPECT_GT(Completion(p, *opened, 0), uint64_t{kLayers}) << "the scheduler's waits were released";
}

}  // namespace
}  // namespace mlaverify::engine
