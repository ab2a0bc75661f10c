// Device-driven verify steps on a CUDA device: GPU doorbells rung with
// stream memory operations from this process (the scheduler's side), host
// doorbells whose completion the GPU writes into a page-locked system
// region, every layer's outputs within bf16 tolerance of the CPU reference
// and the pool equal to the mirror to the bit after Commit; a lane held at
// its doorbell does not hold the device's other work, and a region's
// release (which waits for the whole device) waits for gated steps to end,
// at worst their layer timeout; a step that times
// out releases every wait, gives its pages back, and the next step runs;
// tensor parallel over device 0 listed twice. Skipped with the reason when
// no GPU is present.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "kernels/stream_memops.h"
#include "kernels/testing/device_problem.h"
#include "tests/step_fixture.h"

namespace mlaverify::engine {
namespace {

// As the server does before CUDA starts: one hardware queue per stream, so
// that no lane held at its doorbell holds the test's ring stream (or
// another engine's stream) queued behind it.
const bool kOwnQueues = setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0) == 0;

class GpuStepsTest : public StepFixture {
 protected:
  void SetUp() override {
    static const std::string reason = kernels::testing::NoUsableGpuReason();
    if (!reason.empty()) GTEST_SKIP() << "GPU test skipped: " << reason;
    exact_ = false;
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&device_, kRegionBytes), cudaSuccess);
    write_device_ = [this](uint64_t offset, const void* data, size_t bytes) {
      ASSERT_EQ(
          cudaMemcpy(static_cast<uint8_t*>(device_) + offset, data, bytes, cudaMemcpyHostToDevice),
          cudaSuccess);
    };
    read_device_ = [this](uint64_t offset, void* data, size_t bytes) {
      ASSERT_EQ(cudaMemcpy(data, static_cast<const uint8_t*>(device_) + offset, bytes,
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
    };
    // The scheduler's ring: a stream write, from a stream that never waits.
    ring_device_ = [this](uint64_t address, uint64_t value) {
      ASSERT_TRUE(kernels::StreamWriteValue64(stream_, address, value).ok());
      ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    };
    read_device_word_ = [](uint64_t address) {
      uint64_t value = 0;
      EXPECT_EQ(cudaMemcpy(&value, reinterpret_cast<const void*>(address), sizeof(value),
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      return value;
    };
  }

  void TearDown() override {
    StepFixture::TearDown();
    if (device_ != nullptr) cudaFree(device_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // An engine over CUDA device 0 listed `count` times, the system region and
  // the device region ("dev").
  void MakeGpu(int count = 1, int lanes = 2) {
    std::vector<std::unique_ptr<Device>> devices;
    for (int d = 0; d < count; ++d) {
      auto cuda = MakeCudaDevice(0);
      ASSERT_TRUE(cuda.ok()) << cuda.status();
      devices.push_back(*std::move(cuda));
    }
    MakeOn(std::move(devices), lanes);
    ASSERT_TRUE(engine_->DoorbellSupport(DoorbellKind::kDevice).ok())
        << engine_->DoorbellSupport(DoorbellKind::kDevice);
    ASSERT_TRUE(
        engine_->regions()
            .RegisterLocalDevice("dev", reinterpret_cast<uint64_t>(device_), 0, kRegionBytes)
            .ok());
  }

  // One whole step of `items` (opened, every layer rung and checked,
  // committed with the last path of item 0 and nothing of the others).
  void RunStep(std::vector<ItemData> items, std::vector<Mirror>& mirrors, DoorbellKind kind,
               Where where, bool all_at_once = false) {
    Placed p = Place(items, kind, where);
    auto opened = engine_->OpenStep(p.request);
    ASSERT_TRUE(opened.ok()) << opened.status();
    if (all_at_once) {
      RingAndWait(p, *opened, kLayers);
    } else {
      for (int l = 0; l < kLayers; ++l) RingAndWait(p, *opened, l + 1);
    }
    for (int l = 0; l < kLayers; ++l) ExpectLayer(p, items, mirrors, l);
    CommitLastPathOfFirst(items, mirrors);
    EXPECT_EQ(WaitEnded(opened->step_id).state, StepState::kCommitted);
  }

  // Two GPU-doorbell steps (sequences ids[0] and ids[1]) held at their
  // first doorbell on two lanes, and a third sequence (ids[2]) for the work
  // beside them.
  struct GatedPair {
    std::vector<Mirror> mirrors;
    std::vector<uint64_t> ids;
    std::vector<ItemData> first, second;
    Placed p1, p2;
    StepOpened s1, s2;
  };
  GatedPair OpenGatedPair();
  // Rings both steps through, checks every layer against the reference and
  // commits both.
  void RunGatedPair(const GatedPair& g);
  // Verify calls for every layer of `id`, three drafts each.
  void VerifyEveryLayer(uint64_t id);

  cudaStream_t stream_ = nullptr;
  void* device_ = nullptr;
};

TEST_F(GpuStepsTest, GpuDoorbellsMatchTheReferenceAndCommit) {
  MakeGpu();
  std::vector<Mirror> mirrors(2);
  const uint64_t a = NewSequence(300, &mirrors[0]);
  const uint64_t b = NewSequence(17, &mirrors[1]);
  const int64_t free_before = engine_->Stats().free_pages;
  RunStep({RandomItem(a, 16), RandomItem(b, 3)}, mirrors, DoorbellKind::kDevice, Where::kDevice);
  RunStep({RandomItem(a, 4), RandomItem(b, 1)}, mirrors, DoorbellKind::kDevice, Where::kDevice,
          /*all_at_once=*/true);
  // Tensors in the system region, read and written by the lane in place.
  std::vector<Mirror> only_a = {mirrors[0]};
  RunStep({RandomItem(a, 7)}, only_a, DoorbellKind::kDevice, Where::kSystem);
  mirrors[0] = only_a[0];
  ExpectKvEquals(a, mirrors[0]);
  ExpectKvEquals(b, mirrors[1]);
  EXPECT_LE(engine_->Stats().free_pages, free_before);
  EXPECT_EQ(engine_->Stats().steps.committed_total, 3);
}

// Host doorbells on a GPU: the lane's thread sees the ring in the host slot;
// the GPU writes the completion there.
TEST_F(GpuStepsTest, HostDoorbellsOnTheGpu) {
  MakeGpu();
  std::vector<Mirror> mirrors(1);
  const uint64_t a = NewSequence(129, &mirrors[0]);
  RunStep({RandomItem(a, 8)}, mirrors, DoorbellKind::kHost, Where::kSystem);
  RunStep({RandomItem(a, 2)}, mirrors, DoorbellKind::kHost, Where::kDevice);
  ExpectKvEquals(a, mirrors[0]);
}

// A watchdog rings gated lanes open after this, so a wait shows as a
// failure with its duration, not a hang.
constexpr absl::Duration kGateWatchdog = absl::Seconds(5);

GpuStepsTest::GatedPair GpuStepsTest::OpenGatedPair() {
  MakeGpu(1, /*lanes=*/2);
  GatedPair g;
  g.mirrors.resize(3);
  for (int k = 0; k < 3; ++k) g.ids.push_back(NewSequence(100 + k, &g.mirrors[k]));
  g.first = {RandomItem(g.ids[0], 4)};
  g.second = {RandomItem(g.ids[1], 4)};
  g.p1 = Place(g.first, DoorbellKind::kDevice, Where::kDevice);
  g.p2 = Place(g.second, DoorbellKind::kDevice, Where::kDevice);
  auto s1 = engine_->OpenStep(g.p1.request);
  auto s2 = engine_->OpenStep(g.p2.request);
  EXPECT_TRUE(s1.ok()) << s1.status();
  EXPECT_TRUE(s2.ok()) << s2.status();
  if (s1.ok()) g.s1 = *std::move(s1);
  if (s2.ok()) g.s2 = *std::move(s2);
  return g;
}

void GpuStepsTest::RunGatedPair(const GatedPair& g) {
  RingAndWait(g.p2, g.s2, kLayers);
  RingAndWait(g.p1, g.s1, kLayers);
  for (int l = 0; l < kLayers; ++l) {
    ExpectLayer(g.p1, g.first, {g.mirrors[0]}, l);
    ExpectLayer(g.p2, g.second, {g.mirrors[1]}, l);
  }
  EXPECT_TRUE(engine_->Commit(g.ids[0], {}).ok());
  EXPECT_TRUE(engine_->Commit(g.ids[1], {}).ok());
  EXPECT_EQ(WaitEnded(g.s1.step_id).state, StepState::kCommitted);
  EXPECT_EQ(WaitEnded(g.s2.step_id).state, StepState::kCommitted);
}

void GpuStepsTest::VerifyEveryLayer(uint64_t id) {
  const ItemData d = RandomItem(id, 3);
  std::vector<Bf16> out(3 * kHeads * kValueDim);
  std::vector<float> lse(3 * kHeads);
  for (int l = 0; l < kLayers; ++l) {
    VerifyItem item{id, d.parents, d.q[l], d.draft_kv[l], absl::MakeSpan(out), absl::MakeSpan(lse)};
    EXPECT_TRUE(engine_->Verify(l, 0.0f, absl::MakeSpan(&item, 1)).ok());
  }
}

// Two lanes held at their doorbells hold nothing else: another sequence's
// verify calls and commit run meanwhile; then both steps run.
TEST_F(GpuStepsTest, GatedLanesDoNotHoldPlainCalls) {
  const GatedPair g = OpenGatedPair();
  ASSERT_FALSE(HasFailure());
  absl::Notification done;
  std::thread watchdog([&] {
    if (done.WaitForNotificationWithTimeout(kGateWatchdog)) return;
    Ring(g.p1, g.s1, 0, g.s1.ranks[0].base + kLayers);
    Ring(g.p2, g.s2, 0, g.s2.ranks[0].base + kLayers);
  });
  const absl::Time start = absl::Now();
  VerifyEveryLayer(g.ids[2]);
  EXPECT_TRUE(engine_->Commit(g.ids[2], {}).ok());
  const absl::Duration took = absl::Now() - start;
  done.Notify();
  watchdog.join();
  RunGatedPair(g);
  std::printf("while two lanes were gated: %.3f ms\n", absl::ToDoubleMilliseconds(took));
  EXPECT_LT(took, absl::Seconds(2)) << "plain calls waited for the gated lanes";
}

// Unlocking host memory (a region's Unregister: cudaHostUnregister) waits
// for the whole device, so the engine runs it only once no lane is held at a
// GPU doorbell. Beside two gated steps: it waits, verify calls run
// meanwhile, and it finishes once the steps have run and committed.
TEST_F(GpuStepsTest, RegionReleaseWaitsForGatedStepsAndTheRestRuns) {
  const GatedPair g = OpenGatedPair();
  ASSERT_FALSE(HasFailure());
  ASSERT_TRUE(engine_->regions().Register("sys2", key_, 0, 4096).ok());
  absl::Notification unregistered;
  std::thread release([&] {
    EXPECT_TRUE(engine_->regions().Unregister("sys2", RegionKind::kAny).ok());
    unregistered.Notify();
  });
  const absl::Time start = absl::Now();
  VerifyEveryLayer(g.ids[2]);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1)) << "verify calls waited for the release";
  EXPECT_FALSE(unregistered.HasBeenNotified()) << "the release ran beside gated lanes";
  RunGatedPair(g);
  EXPECT_TRUE(unregistered.WaitForNotificationWithTimeout(absl::Seconds(2)))
      << "the release did not run once the steps ended";
  release.join();
}

// Beside a step its scheduler never rings, a region's release waits only
// for the step's layer timeout: the timeout still ends the step (no CUDA
// call of the engine is held behind the release), then the release runs. A
// watchdog rings the step after kGateWatchdog so a regression fails, not
// hangs.
TEST_F(GpuStepsTest, RegionReleaseBesideAnUnrungStepEndsAtTheLayerTimeout) {
  MakeGpu(1, /*lanes=*/1);
  std::vector<Mirror> mirrors(1);
  const uint64_t a = NewSequence(55, &mirrors[0]);
  const int64_t free_before = engine_->Stats().free_pages;
  std::vector<ItemData> items = {RandomItem(a, 8)};
  Placed p = Place(items, DoorbellKind::kDevice, Where::kDevice);
  p.request.layer_timeout = absl::Milliseconds(300);
  auto opened = engine_->OpenStep(p.request);
  ASSERT_TRUE(opened.ok()) << opened.status();
  ASSERT_TRUE(engine_->regions().Register("sys2", key_, 0, 4096).ok());
  absl::Notification done;
  std::thread watchdog([&] {
    if (done.WaitForNotificationWithTimeout(kGateWatchdog)) return;
    Ring(p, *opened, 0, opened->ranks[0].base + kLayers);
  });
  const absl::Time start = absl::Now();
  EXPECT_TRUE(engine_->regions().Unregister("sys2", RegionKind::kAny).ok());
  const absl::Duration took = absl::Now() - start;
  done.Notify();
  watchdog.join();
  EXPECT_LT(took, absl::Seconds(2)) << "the release outlived the step's layer timeout";
  const StepInfo info = WaitEnded(opened->step_id);
  EXPECT_EQ(info.state, StepState::kAborted);
  EXPECT_EQ(info.abort_reason, StepAbortReason::kLayerTimeout);
  EXPECT_EQ(engine_->Stats().free_pages, free_before);
  ExpectKvEquals(a, mirrors[0]);
  std::printf("release beside an unrung step: %.1f ms\n", absl::ToDoubleMilliseconds(took));
}

// A scheduler that stops ringing: the step aborts at its layer timeout,
// every wait on its completion passes, every page is back, the sequence is
// as before, and the next step on the lane runs.
TEST_F(GpuStepsTest, TimeoutReleasesEveryWaitAndTheNextStepRuns) {
  MakeGpu(1, /*lanes=*/1);
  std::vector<Mirror> mirrors(1);
  const uint64_t a = NewSequence(77, &mirrors[0]);
  const int64_t free_before = engine_->Stats().free_pages;
  std::vector<ItemData> items = {RandomItem(a, 16)};
  Placed p = Place(items, DoorbellKind::kDevice, Where::kDevice);
  p.request.layer_timeout = absl::Milliseconds(100);
  auto opened = engine_->OpenStep(p.request);
  ASSERT_TRUE(opened.ok()) << opened.status();
  RingAndWait(p, *opened, 1);
  ExpectLayer(p, items, mirrors, 0);
  // The scheduler's own stream waits for the last layer: released by the end.
  ASSERT_TRUE(kernels::StreamWaitValue64(stream_, opened->ranks[0].completion_address,
                                         opened->ranks[0].base + kLayers)
                  .ok());
  const StepInfo info = WaitEnded(opened->step_id);
  EXPECT_EQ(info.state, StepState::kAborted);
  EXPECT_EQ(info.abort_reason, StepAbortReason::kLayerTimeout);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess) << "the scheduler's wait passed";
  EXPECT_GT(Completion(p, *opened, 0), opened->ranks[0].base + kLayers);
  EXPECT_EQ(engine_->Stats().free_pages, free_before);
  ExpectKvEquals(a, mirrors[0]);
  RunStep({RandomItem(a, 5)}, mirrors, DoorbellKind::kDevice, Where::kDevice);
  ExpectKvEquals(a, mirrors[0]);
}

// Tensor parallel over device 0 listed twice: each rank's lane waits on its
// own doorbell and writes its heads into its own places.
TEST_F(GpuStepsTest, TensorParallelOverOneDeviceTwice) {
  MakeGpu(2);
  ASSERT_EQ(engine_->heads_per_device(), kHeads / 2);
  std::vector<Mirror> mirrors(1);
  const uint64_t a = NewSequence(211, &mirrors[0]);
  RunStep({RandomItem(a, 16)}, mirrors, DoorbellKind::kDevice, Where::kDevice);
  for (int replica = 0; replica < 2; ++replica) ExpectKvEquals(a, mirrors[0], replica);
}

}  // namespace
}  // namespace mlaverify::engine
