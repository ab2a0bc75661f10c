// The device workers on fake devices (server/engine/device.h): batching of
// queued calls across sequences and layers, bucket choice and padding, graph
// capture at startup, plan reuse, queue limits, deadlines and cancellation
// while queued, fault handling, and tensor- and data-parallel fan-out over
// several devices, all checked against a single CPU device's outputs.
#include <atomic>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/draft_tree.h"
#include "common/geometry.h"
#include "common/workload.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/engine/device.h"
#include "server/engine/engine.h"

namespace mlaverify::engine {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kLayers = 3, kHeads = 4, kPage = 8;

EngineConfig BaseConfig(int heads = kHeads) {
  EngineConfig c;
  c.num_layers = kLayers;
  c.num_heads = heads;
  c.page_size = kPage;
  c.pool_bytes = 128 * c.bytes_per_page();
  c.max_sequence_len = 1024;
  c.draft_buckets = {1, 4, 8};
  c.batch_buckets = {1, 2, 4, 8};
  return c;
}

// One verify item's inputs and output buffers (NaN until written).
struct Work {
  uint64_t id = 0;
  std::vector<int32_t> parents;
  std::vector<Bf16> q, draft_kv, out;
  std::vector<float> lse;
  VerifyItem item;

  Work(uint64_t id_in, int n, int heads, std::mt19937_64& rng)
      : id(id_in),
        parents(RandomDraftTree(rng, n)),
        q(RandomBf16(rng, static_cast<size_t>(n) * heads * kLatentDim, 2.0f)),
        draft_kv(RandomBf16(rng, static_cast<size_t>(n) * kLatentDim, 1.0f)),
        out(static_cast<size_t>(n) * heads * kValueDim, Bf16QuietNaN()),
        lse(static_cast<size_t>(n) * heads, NAN) {
    item = VerifyItem{id, parents, q, draft_kv, absl::MakeSpan(out), absl::MakeSpan(lse)};
  }
};

// Runs `f` on another thread and returns once it has been called: a
// submission whose `done` arrives later.
struct Pending {
  absl::Notification done;
  absl::Status status;
};

void SubmitOne(Engine& e, int layer, Work& w, Pending* p, CallContext context = {}) {
  VerifyCall call;
  call.layer = layer;
  call.items = absl::MakeSpan(&w.item, 1);
  call.context = std::move(context);
  e.SubmitVerify(std::move(call), [p](absl::Status s) {
    p->status = std::move(s);
    p->done.Notify();
  });
}

uint64_t NewSequence(Engine& e, int64_t prompt, std::mt19937_64& rng,
                     std::vector<Bf16>* kv_out = nullptr) {
  auto id = e.CreateSequence("test");
  EXPECT_TRUE(id.ok()) << id.status();
  const std::vector<Bf16> kv =
      RandomBf16(rng, static_cast<size_t>(kLayers) * prompt * kLatentDim, 1.0f);
  auto length = e.AppendKv(*id, 0, prompt, kv);
  EXPECT_TRUE(length.ok()) << length.status();
  if (kv_out != nullptr) *kv_out = kv;
  return *id;
}

// Waits until the fake device has started `n` launches (it records a launch
// as it begins, then sleeps for its latency): what is submitted after this
// queues behind that launch.
void WaitForLaunches(FakeDeviceRecord& record, size_t n) {
  absl::MutexLock lock(&record.mu);
  struct Enough {
    FakeDeviceRecord* r;
    size_t n;
    static bool Eval(Enough* e) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return e->r->launches.size() >= e->n;
    }
  } enough{&record, n};
  record.mu.Await(absl::Condition(&Enough::Eval, &enough));
}

std::unique_ptr<Engine> MakeEngine(const EngineConfig& config,
                                   std::vector<std::unique_ptr<Device>> devices) {
  auto e = Engine::Create(config, std::move(devices));
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *std::move(e) : nullptr;
}

std::vector<std::unique_ptr<Device>> Fakes(
    int count, const FakeDeviceOptions& options,
    std::vector<std::unique_ptr<FakeDeviceRecord>>* records) {
  std::vector<std::unique_ptr<Device>> devices;
  for (int d = 0; d < count; ++d) {
    records->push_back(std::make_unique<FakeDeviceRecord>());
    devices.push_back(MakeFakeDevice(d, options, records->back().get()));
  }
  return devices;
}

// One asynchronous fake device (launch returns, the work runs at Wait, as
// on a GPU) whose launches take `latency`, under `config`.
std::unique_ptr<Engine> GpuLikeEngine(const EngineConfig& config, absl::Duration latency,
                                      std::vector<std::unique_ptr<FakeDeviceRecord>>* records) {
  FakeDeviceOptions gpu_like;
  gpu_like.asynchronous = true;
  gpu_like.latency = latency;
  return MakeEngine(config, Fakes(1, gpu_like, records));
}

// Makes `sequences` sequences (prompts of 6, 7, ... tokens), forgets the
// launches that took, then submits one Verify of 2 drafts per sequence at
// once from this thread and waits until all are done OK.
void SubmitOnePerSequenceAndWait(Engine& engine, FakeDeviceRecord& record, int sequences,
                                 uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint64_t> ids;
  for (int s = 0; s < sequences; ++s) ids.push_back(NewSequence(engine, 6 + s, rng));
  {
    absl::MutexLock lock(&record.mu);
    record.launch_threads.clear();
    record.launch_requests.clear();
  }
  std::vector<std::unique_ptr<Work>> work;
  std::vector<Pending> pending(sequences);
  for (int s = 0; s < sequences; ++s) {
    work.push_back(std::make_unique<Work>(ids[s], 2, kHeads, rng));
    SubmitOne(engine, 0, *work[s], &pending[s]);
  }
  for (auto& p : pending) {
    p.done.WaitForNotification();
    EXPECT_TRUE(p.status.ok()) << p.status;
  }
}

TEST(EngineWorkerTest, CapturesEveryBucketOnceAtStart) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  EngineConfig config = BaseConfig();
  config.batches_in_flight = 3;
  auto engine = MakeEngine(config, Fakes(1, FakeDeviceOptions{}, &records));
  ASSERT_NE(engine, nullptr);
  absl::MutexLock lock(&records[0]->mu);
  EXPECT_EQ(records[0]->captured.size(), 4u * 3)
      << "one graph per (batch bucket, draft bucket), whatever the launches in flight";
  EXPECT_TRUE(engine->graphs_enabled());
}

// While a slow launch runs, calls for other sequences queue; the next launch
// takes them all as one batch, padded to the smallest bucket that holds it,
// and every output equals the one a lone CPU device computes.
TEST(EngineWorkerTest, QueuedCallsShareOneBatchPaddedToItsBucket) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  FakeDeviceOptions slow;
  slow.latency = absl::Milliseconds(60);
  const EngineConfig config = BaseConfig();
  auto engine = MakeEngine(config, Fakes(1, slow, &records));
  std::vector<std::unique_ptr<Device>> cpu;
  cpu.push_back(MakeCpuDevice(1));
  auto reference = MakeEngine(config, std::move(cpu));
  ASSERT_TRUE(engine && reference);

  std::mt19937_64 rng(7);
  constexpr int kSequences = 6;
  std::vector<uint64_t> ids, ref_ids;
  for (int s = 0; s < kSequences; ++s) {
    std::vector<Bf16> kv;
    ids.push_back(NewSequence(*engine, 10 + 3 * s, rng, &kv));
    auto r = reference->CreateSequence("ref");
    ASSERT_TRUE(r.ok());
    ASSERT_TRUE(reference->AppendKv(*r, 0, 10 + 3 * s, kv).ok());
    ref_ids.push_back(*r);
  }
  {
    absl::MutexLock lock(&records[0]->mu);
    records[0]->launches.clear();
    records[0]->launch_requests.clear();
  }
  // The first runs alone; the other five queue behind it.
  std::vector<std::unique_ptr<Work>> work;
  std::vector<Pending> pending(kSequences);
  for (int s = 0; s < kSequences; ++s) {
    work.push_back(std::make_unique<Work>(ids[s], s % 2 == 0 ? 3 : 5, kHeads, rng));
    SubmitOne(*engine, 1, *work[s], &pending[s]);
    if (s == 0) WaitForLaunches(*records[0], 1);
  }
  for (auto& p : pending) {
    p.done.WaitForNotification();
    EXPECT_TRUE(p.status.ok()) << p.status;
  }
  {
    FakeDeviceRecord& record = *records[0];
    absl::MutexLock lock(&record.mu);
    const std::vector<LaunchOptions> launches = record.launches;
    const std::vector<int> requests = record.launch_requests;
    EXPECT_EQ(requests, (std::vector<int>{1, 5})) << "the five queued calls share one launch";
    int largest = 0;
    for (size_t k = 0; k < launches.size(); ++k) {
      EXPECT_TRUE(launches[k].graph);
      // The bucket is the smallest that holds the batch.
      const BatchShape shape = launches[k].shape;
      EXPECT_GE(shape.batch, requests[k]);
      EXPECT_TRUE(shape.batch == 1 || shape.batch / 2 < requests[k]) << "bucket " << shape.batch;
      largest = std::max(largest, requests[k]);
    }
    EXPECT_GE(largest, 3) << "the calls queued behind the first launches share one";
  }
  for (int s = 0; s < kSequences; ++s) {
    Work ref(ref_ids[s], 1, kHeads, rng);
    ref.parents = work[s]->parents;
    ref.q = work[s]->q;
    ref.draft_kv = work[s]->draft_kv;
    ref.out.assign(work[s]->out.size(), Bf16QuietNaN());
    ref.lse.assign(work[s]->lse.size(), NAN);
    ref.item = VerifyItem{ref_ids[s],
                          ref.parents,
                          ref.q,
                          ref.draft_kv,
                          absl::MakeSpan(ref.out),
                          absl::MakeSpan(ref.lse)};
    ASSERT_TRUE(reference->Verify(1, 0.0f, absl::MakeSpan(&ref.item, 1)).ok());
    EXPECT_EQ(std::memcmp(ref.out.data(), work[s]->out.data(), ref.out.size() * sizeof(Bf16)), 0)
        << "sequence " << s << ": batching must not change a bit";
    EXPECT_EQ(ref.lse, work[s]->lse);
  }
}

// Two calls for the same sequence and layer never share a launch (the second
// rewrites the first's draft rows); other layers of the same sequence may.
TEST(EngineWorkerTest, SameRowsNeverShareALaunch) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  FakeDeviceOptions slow;
  slow.latency = absl::Milliseconds(40);
  auto engine = MakeEngine(BaseConfig(), Fakes(1, slow, &records));
  ASSERT_NE(engine, nullptr);
  std::mt19937_64 rng(11);
  const uint64_t a = NewSequence(*engine, 9, rng);
  const uint64_t blocker = NewSequence(*engine, 9, rng);
  Work first(a, 4, kHeads, rng), block(blocker, 2, kHeads, rng);
  Pending p0, p2, p3, p4;
  SubmitOne(*engine, 0, block, &p0);  // taken alone; the device is busy for 40 ms
  WaitForLaunches(*records[0], 1);
  Work again(a, 4, kHeads, rng), other_layer(a, 4, kHeads, rng);
  again.parents = first.parents;
  again.item.parents = again.parents;
  other_layer.parents = first.parents;
  other_layer.item.parents = other_layer.parents;
  SubmitOne(*engine, 2, first, &p2);
  SubmitOne(*engine, 2, again, &p3);        // same layer: must wait for the next launch
  SubmitOne(*engine, 1, other_layer, &p4);  // behind it in the queue
  for (Pending* p : {&p0, &p2, &p3, &p4}) {
    p->done.WaitForNotification();
    EXPECT_TRUE(p->status.ok()) << p->status;
  }
  // The first layer-2 call runs alone: the second (which would race its draft
  // rows) waits for the next launch, with the layer-1 call behind it.
  absl::MutexLock lock(&records[0]->mu);
  EXPECT_EQ(records[0]->launch_requests, (std::vector<int>{1, 1, 2}));
}

// The layers of one verify step of one sequence, one after another, reuse
// the plan of the step's first launch.
TEST(EngineWorkerTest, LaterLayersOfAStepReuseThePlan) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  auto engine = MakeEngine(BaseConfig(), Fakes(1, FakeDeviceOptions{}, &records));
  ASSERT_NE(engine, nullptr);
  std::mt19937_64 rng(5);
  const uint64_t id = NewSequence(*engine, 20, rng);
  Work w(id, 6, kHeads, rng);
  for (int layer = 0; layer < kLayers; ++layer) {
    ASSERT_TRUE(engine->Verify(layer, 0.0f, absl::MakeSpan(&w.item, 1)).ok());
  }
  ASSERT_TRUE(engine->Commit(id, {}).ok());
  Work next(id, 6, kHeads, rng);
  ASSERT_TRUE(engine->Verify(0, 0.0f, absl::MakeSpan(&next.item, 1)).ok());
  FakeDeviceRecord& record = *records[0];
  absl::MutexLock lock(&record.mu);
  const std::vector<LaunchOptions> launches = record.launches;
  ASSERT_EQ(launches.size(), 4u);
  EXPECT_FALSE(launches[0].reuse_plan) << "the step's first launch plans";
  EXPECT_TRUE(launches[1].reuse_plan);
  EXPECT_TRUE(launches[2].reuse_plan);
  EXPECT_TRUE(launches[3].reuse_plan) << "a rejected step leaves the lengths as they were: the "
                                         "next step of the same N plans the same";
}

TEST(EngineWorkerTest, EagerWhenGraphsAreOffWithTheExactShape) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  EngineConfig config = BaseConfig();
  config.use_graphs = false;
  auto engine = MakeEngine(config, Fakes(1, FakeDeviceOptions{}, &records));
  ASSERT_NE(engine, nullptr);
  EXPECT_FALSE(engine->graphs_enabled());
  std::mt19937_64 rng(3);
  const uint64_t id = NewSequence(*engine, 5, rng);
  Work w(id, 3, kHeads, rng);
  ASSERT_TRUE(engine->Verify(0, 0.0f, absl::MakeSpan(&w.item, 1)).ok());
  absl::MutexLock lock(&records[0]->mu);
  EXPECT_TRUE(records[0]->captured.empty());
  ASSERT_EQ(records[0]->launches.size(), 1u);
  EXPECT_FALSE(records[0]->launches[0].graph);
  EXPECT_EQ(records[0]->launches[0].shape, (BatchShape{1, 3}));
}

// Over the admission limit a call gets RESOURCE_EXHAUSTED with the numbers
// and changes nothing; once the queue drains the server takes work again.
TEST(EngineWorkerTest, FullQueueIsResourceExhaustedAndRecovers) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  FakeDeviceOptions slow;
  slow.latency = absl::Milliseconds(50);
  EngineConfig config = BaseConfig();
  config.max_queued_calls = 2;
  auto engine = MakeEngine(config, Fakes(1, slow, &records));
  ASSERT_NE(engine, nullptr);
  std::mt19937_64 rng(13);
  std::vector<uint64_t> ids;
  for (int s = 0; s < 3; ++s) ids.push_back(NewSequence(*engine, 8, rng));
  const EngineStats before = engine->Stats();
  Work w0(ids[0], 2, kHeads, rng), w1(ids[1], 2, kHeads, rng), w2(ids[2], 2, kHeads, rng);
  Pending p0, p1;
  SubmitOne(*engine, 0, w0, &p0);
  SubmitOne(*engine, 0, w1, &p1);
  const absl::Status full = engine->Verify(0, 0.0f, absl::MakeSpan(&w2.item, 1));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(full.message()), HasSubstr("2 calls"));
  EXPECT_THAT(std::string(full.message()), HasSubstr("--max-queued-calls"));
  p0.done.WaitForNotification();
  p1.done.WaitForNotification();
  EXPECT_TRUE(p0.status.ok() && p1.status.ok());
  EXPECT_EQ(engine->Stats().pending_steps, 2) << "the refused call opened no step";
  EXPECT_EQ(engine->Stats().free_pages, before.free_pages - 2);
  EXPECT_TRUE(engine->Verify(0, 0.0f, absl::MakeSpan(&w2.item, 1)).ok());
  EXPECT_EQ(engine->Stats().queued_calls, 0);
  EXPECT_EQ(engine->Stats().queued_bytes, 0);
}

// A call that holds more bytes than --max-queued-bytes admits at all is
// INVALID_ARGUMENT (splitting it is the fix; retrying never is), changes
// nothing, and leaves the queue counters at zero.
TEST(EngineWorkerTest, CallLargerThanTheQueueBudgetIsInvalidNotRetryLater) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  EngineConfig config = BaseConfig();
  // A 4-token prompt's AppendKv holds 3 x 4 x 576 x 2 B = 13.5 KiB; an
  // 8-draft item's q alone 8 x 4 heads x 576 x 2 B = 36 KiB.
  config.max_queued_bytes = 16 << 10;
  auto engine = MakeEngine(config, Fakes(1, FakeDeviceOptions(), &records));
  ASSERT_NE(engine, nullptr);
  std::mt19937_64 rng(29);
  const uint64_t id = NewSequence(*engine, 4, rng);
  const EngineStats before = engine->Stats();
  Work big(id, 8, kHeads, rng);
  const absl::Status status = engine->Verify(0, 0.0f, absl::MakeSpan(&big.item, 1));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("more than --max-queued-bytes (16384 bytes)"));
  EXPECT_THAT(std::string(status.message()), Not(HasSubstr("retry later")));
  const EngineStats after = engine->Stats();
  EXPECT_EQ(after.pending_steps, before.pending_steps);
  EXPECT_EQ(after.free_pages, before.free_pages);
  EXPECT_EQ(after.queued_calls, 0);
  EXPECT_EQ(after.queued_bytes, 0);
  absl::MutexLock lock(&records[0]->mu);
  EXPECT_TRUE(records[0]->launches.empty());
}

// A sequence with a call in flight is not idle, however long the call runs:
// idle expiry leaves it (and its pages) alone until the call has finished,
// and counts from the call's end.
TEST(EngineWorkerTest, IdleExpirySparesSequencesWithCallsInFlight) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  FakeDeviceOptions slow;
  slow.latency = absl::Milliseconds(200);
  EngineConfig config = BaseConfig();
  config.idle_timeout = absl::Seconds(30);
  auto engine = MakeEngine(config, Fakes(1, slow, &records));
  ASSERT_NE(engine, nullptr);
  std::mt19937_64 rng(31);
  const uint64_t busy = NewSequence(*engine, 8, rng);
  Work w(busy, 3, kHeads, rng);
  Pending p;
  SubmitOne(*engine, 0, w, &p);
  WaitForLaunches(*records[0], 1);
  // Far enough ahead that the sequence's last submission is past the timeout.
  EXPECT_EQ(engine->ExpireIdle(absl::Now() + absl::Seconds(31)), 0)
      << "expired a sequence whose Verify is running";
  p.done.WaitForNotification();
  ASSERT_TRUE(p.status.ok()) << p.status;
  auto committed = engine->Commit(busy, {});
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(engine->ExpireIdle(absl::Now()), 0) << "used just now";
  EXPECT_EQ(engine->ExpireIdle(absl::Now() + absl::Seconds(31)), 1);
  EXPECT_EQ(engine->Commit(busy, {}).status().code(), absl::StatusCode::kNotFound);
}

// A call whose deadline passes (or that is cancelled) while it waits behind
// slow work completes unrun, and the step it opened is taken back.
TEST(EngineWorkerTest, DeadlineAndCancellationAreHonouredWhileQueued) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  FakeDeviceOptions slow;
  slow.latency = absl::Milliseconds(80);
  auto engine = MakeEngine(BaseConfig(), Fakes(1, slow, &records));
  ASSERT_NE(engine, nullptr);
  std::mt19937_64 rng(17);
  const uint64_t busy = NewSequence(*engine, 8, rng), late = NewSequence(*engine, 8, rng),
                 gone = NewSequence(*engine, 8, rng);
  const EngineStats before = engine->Stats();
  Work wb(busy, 2, kHeads, rng), wb2(busy, 2, kHeads, rng), wl(late, 3, kHeads, rng),
      wg(gone, 3, kHeads, rng);
  wb2.parents = wb.parents;
  wb2.item.parents = wb2.parents;
  Pending pb, pb2, pl, pg;
  SubmitOne(*engine, 0, wb, &pb);
  WaitForLaunches(*records[0], 1);  // the device is busy for 80 ms
  SubmitOne(*engine, 1, wb2, &pb2);
  CallContext soon;
  soon.deadline = absl::Now() + absl::Milliseconds(10);
  SubmitOne(*engine, 0, wl, &pl, soon);
  std::atomic<bool> cancelled{false};
  CallContext cancellable;
  cancellable.is_cancelled = [&cancelled] { return cancelled.load(); };
  SubmitOne(*engine, 0, wg, &pg, cancellable);
  cancelled = true;
  for (Pending* p : {&pb, &pb2, &pl, &pg}) p->done.WaitForNotification();
  EXPECT_TRUE(pb.status.ok() && pb2.status.ok());
  EXPECT_EQ(pl.status.code(), absl::StatusCode::kDeadlineExceeded) << pl.status;
  EXPECT_EQ(pg.status.code(), absl::StatusCode::kCancelled) << pg.status;
  EXPECT_TRUE(std::isnan(Bf16ToFloat(wl.out[0]))) << "an unrun call writes no output";
  // Only the busy sequence's step stays open, and only its page was taken.
  EXPECT_EQ(engine->Stats().pending_steps, 1);
  EXPECT_EQ(engine->Stats().free_pages, before.free_pages - 1);
  // The rolled-back sequences start a step with another tree at once.
  Work fresh(late, 5, kHeads, rng);
  EXPECT_TRUE(engine->Verify(0, 0.0f, absl::MakeSpan(&fresh.item, 1)).ok());
  absl::MutexLock lock(&records[0]->mu);
  for (int r : records[0]->launch_requests) EXPECT_EQ(r, 1) << "the unrun calls never launched";
}

// A busy sequence holds no thread: with many calls of one sequence queued
// on a slow device, another caller's host-only calls answer at once.
TEST(EngineWorkerTest, BusySequenceBlocksNoOtherCaller) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  FakeDeviceOptions slow;
  slow.latency = absl::Milliseconds(30);
  auto engine = MakeEngine(BaseConfig(), Fakes(1, slow, &records));
  ASSERT_NE(engine, nullptr);
  std::mt19937_64 rng(19);
  const uint64_t id = NewSequence(*engine, 8, rng);
  std::vector<std::unique_ptr<Work>> work;
  std::vector<Pending> pending(16);
  const std::vector<int32_t> tree = RandomDraftTree(rng, 2);
  for (int k = 0; k < 16; ++k) {
    work.push_back(std::make_unique<Work>(id, 2, kHeads, rng));
    work.back()->parents = tree;
    work.back()->item.parents = work.back()->parents;
    SubmitOne(*engine, k % kLayers, *work.back(), &pending[k]);
  }
  const absl::Time start = absl::Now();
  auto other = engine->CreateSequence("other");
  const EngineStats stats = engine->Stats();
  EXPECT_TRUE(other.ok());
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(20))
      << "CreateSequence and Stats wait for nothing";
  EXPECT_GT(stats.queued_calls, 0);
  for (auto& p : pending) {
    p.done.WaitForNotification();
    EXPECT_TRUE(p.status.ok()) << p.status;
  }
}

// A sequence's calls run in submission order: prompt chunks submitted back to
// back without waiting land in order.
TEST(EngineWorkerTest, OneSequencesCallsRunInSubmissionOrder) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  FakeDeviceOptions slow;
  slow.latency = absl::Milliseconds(5);
  auto engine = MakeEngine(BaseConfig(), Fakes(1, slow, &records));
  ASSERT_NE(engine, nullptr);
  std::mt19937_64 rng(23);
  auto id = engine->CreateSequence("chunks");
  ASSERT_TRUE(id.ok());
  constexpr int kChunks = 5, kTokens = 7;
  std::vector<std::vector<Bf16>> chunks;
  std::vector<Pending> pending(kChunks);
  for (int c = 0; c < kChunks; ++c) {
    chunks.push_back(RandomBf16(rng, static_cast<size_t>(kLayers) * kTokens * kLatentDim, 1.0f));
    AppendCall call;
    call.sequence_id = *id;
    call.start_position = c * kTokens;
    call.tokens = kTokens;
    call.kv = chunks.back();
    Pending* p = &pending[c];
    engine->SubmitAppendKv(std::move(call), [p](absl::StatusOr<int64_t> r) {
      p->status = r.status();
      p->done.Notify();
    });
  }
  for (auto& p : pending) {
    p.done.WaitForNotification();
    EXPECT_TRUE(p.status.ok()) << p.status;
  }
  std::vector<Bf16> kv(static_cast<size_t>(kLayers) * kChunks * kTokens * kLatentDim);
  ASSERT_TRUE(engine->ReadKv(*id, 0, kChunks * kTokens, absl::MakeSpan(kv)).ok());
  for (int layer = 0; layer < kLayers; ++layer) {
    for (int c = 0; c < kChunks; ++c) {
      EXPECT_EQ(
          std::memcmp(kv.data() + (static_cast<size_t>(layer) * kChunks * kTokens + c * kTokens) *
                                      kLatentDim,
                      chunks[c].data() + static_cast<size_t>(layer) * kTokens * kLatentDim,
                      static_cast<size_t>(kTokens) * kLatentRowBytes),
          0)
          << "layer " << layer << " chunk " << c;
    }
  }
}

// A call still queued when its sequence is released completes with
// NOT_FOUND, unrun; the pages come back once the device passed the release.
TEST(EngineWorkerTest, ReleaseWhileQueuedSkipsTheQueuedWork) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  FakeDeviceOptions slow;
  slow.latency = absl::Milliseconds(50);
  auto engine = MakeEngine(BaseConfig(), Fakes(1, slow, &records));
  ASSERT_NE(engine, nullptr);
  std::mt19937_64 rng(29);
  const uint64_t a = NewSequence(*engine, 8, rng), b = NewSequence(*engine, 8, rng),
                 c = NewSequence(*engine, 8, rng);
  Work wa(a, 2, kHeads, rng), wb(b, 2, kHeads, rng), wc(c, 2, kHeads, rng);
  Pending pa, pb, pc;
  SubmitOne(*engine, 0, wa, &pa);
  WaitForLaunches(*records[0], 1);  // the device is busy for 50 ms
  SubmitOne(*engine, 0, wb, &pb);
  SubmitOne(*engine, 0, wc, &pc);
  auto freed = engine->Release(c);
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 2) << "its prompt page and its step's page";
  for (Pending* p : {&pa, &pb, &pc}) p->done.WaitForNotification();
  EXPECT_TRUE(pa.status.ok() && pb.status.ok());
  EXPECT_EQ(pc.status.code(), absl::StatusCode::kNotFound) << pc.status;
  ASSERT_TRUE(engine->Release(a).ok());
  ASSERT_TRUE(engine->Release(b).ok());
  EXPECT_EQ(engine->Stats().free_pages, engine->Stats().total_pages);
}

// The second launch faults: the calls it touched fail with INTERNAL naming
// the device, the engine says so once, and later device work is refused
// with UNAVAILABLE.
TEST(EngineWorkerTest, DeviceFaultFailsTouchedCallsAndRefusesLaterWork) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  FakeDeviceOptions faulty;
  faulty.fail_launch = 2;
  auto engine = MakeEngine(BaseConfig(), Fakes(1, faulty, &records));
  ASSERT_NE(engine, nullptr);
  std::atomic<int> faults{0};
  engine->SetFaultListener([&](const absl::Status&) { ++faults; });
  std::mt19937_64 rng(31);
  const uint64_t id = NewSequence(*engine, 8, rng);
  Work w(id, 2, kHeads, rng);
  ASSERT_TRUE(engine->Verify(0, 0.0f, absl::MakeSpan(&w.item, 1)).ok());
  const absl::Status failed = engine->Verify(1, 0.0f, absl::MakeSpan(&w.item, 1));
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(failed.message()),
              HasSubstr("device fake:0 faulted: fake:0: injected fault"));
  EXPECT_EQ(faults.load(), 1);
  EXPECT_FALSE(engine->fault().ok());
  const absl::Status refused = engine->Verify(2, 0.0f, absl::MakeSpan(&w.item, 1));
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable);
  std::vector<Bf16> kv(static_cast<size_t>(kLayers) * kLatentDim);
  EXPECT_EQ(engine->AppendKv(id, 8, 1, kv).status().code(), absl::StatusCode::kFailedPrecondition)
      << "the step of layer 0 is still pending";
  EXPECT_EQ(faults.load(), 1);
}

// On an idle device that launches asynchronously (a GPU), the thread that
// submits a call launches it: no hand-off to another thread. While launches
// are in flight, calls queue and the device thread launches them as one
// batch once a launch finishes.
TEST(EngineWorkerTest, TheSubmittingThreadLaunchesOnAnIdleDevice) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  EngineConfig config = BaseConfig();
  config.batches_in_flight = 1;
  auto engine = GpuLikeEngine(config, absl::Milliseconds(30), &records);
  ASSERT_NE(engine, nullptr);
  SubmitOnePerSequenceAndWait(*engine, *records[0], 4, 41);
  absl::MutexLock lock(&records[0]->mu);
  ASSERT_EQ(records[0]->launch_threads.size(), 2u);
  EXPECT_EQ(records[0]->launch_threads[0], std::this_thread::get_id())
      << "the idle device's first call is launched by its submitter";
  EXPECT_NE(records[0]->launch_threads[1], std::this_thread::get_id())
      << "the rest queued behind it and went out as one batch from the completion side";
  EXPECT_EQ(records[0]->launch_requests, (std::vector<int>{1, 3}));
}

// Without polling (EngineConfig::poll_launches false) a submitter launches
// whenever a slot is free, also while another launch runs; with every slot
// taken the call queues and the device thread, woken by the oldest launch's
// end, launches it.
TEST(EngineWorkerTest, WithoutPollingSubmittersLaunchIntoFreeSlots) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  EngineConfig config = BaseConfig();
  config.batches_in_flight = 2;
  config.poll_launches = false;
  // A device that only takes time (the asynchronous fake runs its work at
  // Wait under its own lock, so a launch would wait for the one in flight).
  FakeDeviceOptions timed;
  timed.timed_only = true;
  timed.launch_time = absl::Milliseconds(40);
  auto engine = MakeEngine(config, Fakes(1, timed, &records));
  ASSERT_NE(engine, nullptr);
  SubmitOnePerSequenceAndWait(*engine, *records[0], 3, 47);
  absl::MutexLock lock(&records[0]->mu);
  ASSERT_EQ(records[0]->launch_threads.size(), 3u);
  EXPECT_EQ(records[0]->launch_threads[0], std::this_thread::get_id());
  EXPECT_EQ(records[0]->launch_threads[1], std::this_thread::get_id())
      << "the second slot was free: its submitter launched it while the first ran";
  EXPECT_NE(records[0]->launch_threads[2], std::this_thread::get_id())
      << "both slots taken: the third queued for the device thread";
}

// Many submitters at once without polling, with and without the completion
// thread: every Verify and Commit completes OK.
TEST(EngineWorkerTest, WithoutPollingManySubmittersAllComplete) {
  for (const bool completion_thread : {false, true}) {
    std::vector<std::unique_ptr<FakeDeviceRecord>> records;
    EngineConfig config = BaseConfig();
    config.batches_in_flight = 2;
    config.poll_launches = false;
    config.completion_thread = completion_thread;
    auto engine = GpuLikeEngine(config, absl::Microseconds(200), &records);
    ASSERT_NE(engine, nullptr);
    constexpr int kThreads = 8, kCalls = 40;
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 rng(100 + t);
        const uint64_t id = NewSequence(*engine, 5 + t, rng);
        for (int c = 0; c < kCalls; ++c) {
          Work w(id, 1 + c % 3, kHeads, rng);
          const absl::Status verified = engine->Verify(0, 0.0f, absl::MakeSpan(&w.item, 1));
          const absl::StatusOr<CommitResult> committed = engine->Commit(id, {});
          if (!verified.ok() || !committed.ok()) failures.fetch_add(1);
        }
      });
    }
    for (std::thread& t : threads) t.join();
    EXPECT_EQ(failures.load(), 0) << "completion thread " << completion_thread;
  }
}

// Completing a finished batch (copying outputs out, running the callers'
// callbacks) happens on the completion thread: while one call's completion
// is slow, the device thread keeps launching and finishing what queues, and
// the calls still complete in launch order.
TEST(EngineWorkerTest, ASlowCompletionHoldsNoLaunchAndOrderIsKept) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  EngineConfig config = BaseConfig();
  config.batches_in_flight = 2;
  config.completion_thread = true;
  auto engine = GpuLikeEngine(config, absl::Milliseconds(5), &records);
  ASSERT_NE(engine, nullptr);
  std::mt19937_64 rng(43);
  std::vector<uint64_t> ids;
  for (int s = 0; s < 3; ++s) ids.push_back(NewSequence(*engine, 6 + s, rng));
  {
    absl::MutexLock lock(&records[0]->mu);
    records[0]->launches.clear();
  }
  std::vector<std::unique_ptr<Work>> work;
  for (int s = 0; s < 3; ++s) work.push_back(std::make_unique<Work>(ids[s], 2, kHeads, rng));
  absl::Mutex order_mu;
  std::vector<int> order;
  absl::Notification first_completing, release_first;
  std::vector<Pending> pending(3);
  auto submit = [&](int k) {
    VerifyCall call;
    call.layer = 0;
    call.items = absl::MakeSpan(&work[k]->item, 1);
    engine->SubmitVerify(std::move(call), [&, k](absl::Status s) {
      if (k == 0) {
        first_completing.Notify();
        // A slow completion (a caller's callback that takes its time).
        release_first.WaitForNotificationWithTimeout(absl::Seconds(20));
      }
      {
        absl::MutexLock lock(&order_mu);
        order.push_back(k);
      }
      pending[k].status = std::move(s);
      pending[k].done.Notify();
    });
  };
  // The first two are in flight together, so the first is handed over when
  // it finishes (the second still runs) and its completion blocks there.
  submit(0);
  submit(1);
  ASSERT_TRUE(first_completing.WaitForNotificationWithTimeout(absl::Seconds(20)));
  submit(2);
  {
    absl::MutexLock lock(&records[0]->mu);
    struct Three {
      FakeDeviceRecord* r;
      static bool Eval(Three* t) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return t->r->launches.size() >= 3;
      }
    } three{records[0].get()};
    EXPECT_TRUE(
        records[0]->mu.AwaitWithTimeout(absl::Condition(&Three::Eval, &three), absl::Seconds(10)))
        << "the third call was not launched while the first call's completion was blocked";
  }
  absl::SleepFor(absl::Milliseconds(20));  // the third has run on the device by now
  EXPECT_FALSE(pending[1].done.HasBeenNotified());
  EXPECT_FALSE(pending[2].done.HasBeenNotified()) << "a later call completed before an earlier one";
  release_first.Notify();
  for (auto& p : pending) {
    ASSERT_TRUE(p.done.WaitForNotificationWithTimeout(absl::Seconds(20)));
    EXPECT_TRUE(p.status.ok()) << p.status;
  }
  absl::MutexLock lock(&order_mu);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
}

// A batch's copy lists name each byte it moves once: per request its queries
// and its draft rows (one descriptor per page the rows fall in), the page
// table's new entries, and the request arrays, visibility words and output
// list; the output list has out and lse per request.
TEST(EngineWorkerTest, ABatchsCopyListsNameEachPieceOnce) {
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  EngineConfig config = BaseConfig();  // page 8
  auto engine = MakeEngine(config, Fakes(1, FakeDeviceOptions{}, &records));
  ASSERT_NE(engine, nullptr);
  std::mt19937_64 rng(43);
  const uint64_t id = NewSequence(*engine, 14, rng);  // 2 pages; drafts at 14..16: two pages
  Work w(id, 3, kHeads, rng);
  ASSERT_TRUE(engine->Verify(0, 0.0f, absl::MakeSpan(&w.item, 1)).ok());
  ASSERT_TRUE(engine->Verify(1, 0.0f, absl::MakeSpan(&w.item, 1)).ok());
  absl::MutexLock lock(&records[0]->mu);
  ASSERT_EQ(records[0]->gather_descriptors.size(), 2u);
  EXPECT_EQ(records[0]->gather_descriptors[0], 1 + 2 + 1 + 3)
      << "q, two draft runs, the step's new page, request arrays, visibility, output list";
  EXPECT_EQ(records[0]->gather_descriptors[1], 1 + 2 + 3)
      << "the next layer: the page table is already on the device";
}

// Tensor parallel over two devices: each computes half the heads, the KV is
// written to both, and outputs and pools equal one device's to the bit.
// Data parallel: sequences spread over the devices, each with all heads.
// Each on fakes that launch on the calling thread, that launch
// asynchronously as a GPU does, and that also address only their own memory
// (every tensor through the engine's host staging).
struct ParallelCase {
  ParallelMode mode;
  std::string flavor;  // "sync", "async", "staged"
};

class ParallelModeTest : public ::testing::TestWithParam<ParallelCase> {};

TEST_P(ParallelModeTest, TwoDevicesMatchOneToTheBit) {
  const ParallelMode mode = GetParam().mode;
  EngineConfig config = BaseConfig(/*heads=*/8);
  config.parallel_mode = mode;
  config.pinned_staging_bytes = 8 << 20;
  FakeDeviceOptions options;
  options.asynchronous = GetParam().flavor != "sync";
  options.addresses_host_memory = GetParam().flavor != "staged";
  std::vector<std::unique_ptr<FakeDeviceRecord>> records;
  auto engine = MakeEngine(config, Fakes(2, options, &records));
  EngineConfig single_config = config;
  single_config.parallel_mode = ParallelMode::kTensorParallel;
  std::vector<std::unique_ptr<Device>> one;
  one.push_back(MakeCpuDevice(1));
  auto single = MakeEngine(single_config, std::move(one));
  ASSERT_TRUE(engine && single);
  EXPECT_EQ(engine->heads_per_device(), mode == ParallelMode::kTensorParallel ? 4 : 8);
  const int64_t one_device_pages = single->Stats().total_pages;
  EXPECT_EQ(engine->Stats().total_pages,
            mode == ParallelMode::kDataParallel ? 2 * one_device_pages : one_device_pages);

  std::mt19937_64 rng(37);
  constexpr int kSequences = 4;
  std::vector<uint64_t> ids, single_ids;
  std::vector<int64_t> lengths;
  for (int s = 0; s < kSequences; ++s) {
    std::vector<Bf16> kv;
    ids.push_back(NewSequence(*engine, 5 + 4 * s, rng, &kv));
    auto r = single->CreateSequence("single");
    ASSERT_TRUE(r.ok());
    ASSERT_TRUE(single->AppendKv(*r, 0, 5 + 4 * s, kv).ok());
    single_ids.push_back(*r);
    lengths.push_back(5 + 4 * s);
  }
  if (mode == ParallelMode::kDataParallel) {
    const EngineStats stats = engine->Stats();
    ASSERT_EQ(stats.pools.size(), 2u);
    EXPECT_EQ(stats.pools[0].live_sequences, 2) << "placed by free pages: two per device";
    EXPECT_EQ(stats.pools[1].live_sequences, 2);
  }
  for (int step = 0; step < 3; ++step) {
    std::vector<std::vector<int32_t>> trees;
    for (int s = 0; s < kSequences; ++s)
      trees.push_back(RandomDraftTree(rng, 1 + static_cast<int>(rng() % 8)));
    for (int layer = 0; layer < kLayers; ++layer) {
      std::vector<std::unique_ptr<Work>> a, b;
      std::vector<VerifyItem> items_a, items_b;
      for (int s = 0; s < kSequences; ++s) {
        a.push_back(std::make_unique<Work>(ids[s], static_cast<int>(trees[s].size()), 8, rng));
        a.back()->parents = trees[s];
        a.back()->item.parents = a.back()->parents;
        b.push_back(std::make_unique<Work>(single_ids[s], 1, 8, rng));
        Work& w = *b.back();
        w.parents = trees[s];
        w.q = a.back()->q;
        w.draft_kv = a.back()->draft_kv;
        w.out.assign(a.back()->out.size(), Bf16QuietNaN());
        w.lse.assign(a.back()->lse.size(), NAN);
        w.item = VerifyItem{single_ids[s],        w.parents, w.q, w.draft_kv, absl::MakeSpan(w.out),
                            absl::MakeSpan(w.lse)};
        items_a.push_back(a.back()->item);
        items_b.push_back(w.item);
      }
      ASSERT_TRUE(engine->Verify(layer, 0.0f, absl::MakeSpan(items_a)).ok());
      ASSERT_TRUE(single->Verify(layer, 0.0f, absl::MakeSpan(items_b)).ok());
      for (int s = 0; s < kSequences; ++s) {
        EXPECT_EQ(std::memcmp(a[s]->out.data(), b[s]->out.data(), a[s]->out.size() * sizeof(Bf16)),
                  0)
            << "step " << step << " layer " << layer << " sequence " << s;
        EXPECT_EQ(a[s]->lse, b[s]->lse);
      }
    }
    for (int s = 0; s < kSequences; ++s) {
      std::vector<int32_t> path;
      if ((s + step) % 3 != 0) {
        for (int x = static_cast<int>(trees[s].size()) - 1; x >= 0; x = trees[s][x])
          path.insert(path.begin(), x);
      }
      auto ca = engine->Commit(ids[s], path);
      auto cb = single->Commit(single_ids[s], path);
      ASSERT_TRUE(ca.ok() && cb.ok());
      ASSERT_EQ(ca->length, cb->length);
      lengths[s] = ca->length;
      std::vector<Bf16> expected(static_cast<size_t>(kLayers) * lengths[s] * kLatentDim);
      ASSERT_TRUE(single->ReadKv(single_ids[s], 0, lengths[s], absl::MakeSpan(expected)).ok());
      const int replicas = mode == ParallelMode::kTensorParallel ? 2 : 1;
      for (int r = 0; r < replicas; ++r) {
        std::vector<Bf16> got(expected.size());
        ASSERT_TRUE(engine->ReadKv(ids[s], 0, lengths[s], absl::MakeSpan(got), r).ok());
        EXPECT_EQ(std::memcmp(got.data(), expected.data(), got.size() * sizeof(Bf16)), 0)
            << "replica " << r << " of sequence " << s << " after step " << step;
      }
    }
  }
  for (uint64_t id : ids) ASSERT_TRUE(engine->Release(id).ok());
  EXPECT_EQ(engine->Stats().free_pages, engine->Stats().total_pages);
  if (mode == ParallelMode::kTensorParallel) {
    FakeDeviceRecord& r0 = *records[0];
    FakeDeviceRecord& r1 = *records[1];
    absl::MutexLock l0(&r0.mu);
    absl::MutexLock l1(&r1.mu);
    auto total = [](const std::vector<int>& v) { return std::accumulate(v.begin(), v.end(), 0); };
    EXPECT_EQ(total(r0.launch_requests), total(r1.launch_requests))
        << "every verify item fans out to both devices";
    EXPECT_EQ(total(r0.launch_requests), 3 * kLayers * kSequences);
    EXPECT_EQ(r0.write_rows, r1.write_rows) << "prompts go to both";
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, ParallelModeTest,
                         ::testing::Values(ParallelCase{ParallelMode::kTensorParallel, "sync"},
                                           ParallelCase{ParallelMode::kDataParallel, "sync"},
                                           ParallelCase{ParallelMode::kTensorParallel, "async"},
                                           ParallelCase{ParallelMode::kDataParallel, "async"},
                                           ParallelCase{ParallelMode::kTensorParallel, "staged"},
                                           ParallelCase{ParallelMode::kDataParallel, "staged"}),
                         [](const auto& info) {
                           return absl::StrCat(ParallelModeName(info.param.mode), "_",
                                               info.param.flavor);
                         });

}  // namespace
}  // namespace mlaverify::engine
