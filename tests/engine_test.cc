// The engine on the CPU backend: page allocator, sequence state machine,
// commit compaction in every layer, rollback, release, expiry, exhaustion, a
// failing backend, and concurrent use. Outputs are checked against the CPU
// reference run over an independent mirror of each sequence's KV.
#include "server/engine/engine.h"

#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "common/draft_tree.h"
#include "common/kv_dtype.h"
#include "common/workload.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu_reference.h"
#include "server/engine/batch_plan.h"
#include "server/engine/device.h"
#include "server/engine/host_staging.h"
#include "server/engine/page_allocator.h"
#include "server/engine/page_table_arena.h"
#include "tests/engine_reference.h"

namespace mlaverify::engine {
namespace {

using mlaverify::kLatentDim;
using mlaverify::kValueDim;
using ::testing::HasSubstr;

TEST(PageAllocator, AllOrNothingExhaustionAndReuse) {
  PageAllocator pages(10);
  auto a = pages.Allocate(6);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(pages.free_pages(), 4);
  auto b = pages.Allocate(5);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("need 5 pages, 4 of 10 are free"));
  EXPECT_EQ(pages.free_pages(), 4) << "a failed allocation must take nothing";
  pages.Free(*a);
  EXPECT_EQ(pages.free_pages(), 10);
  // The pages freed last come back first.
  auto c = pages.Allocate(1);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)[0], a->back());
  auto d = pages.Allocate(9);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(pages.free_pages(), 0);
  std::vector<int32_t> all = *c;
  all.insert(all.end(), d->begin(), d->end());
  std::sort(all.begin(), all.end());
  for (int k = 0; k < 10; ++k) EXPECT_EQ(all[k], k) << "every page exactly once";
}

TEST(PageAllocatorDeathTest, DoubleFreeAborts) {
  PageAllocator pages(4);
  auto a = pages.Allocate(1);
  ASSERT_TRUE(a.ok());
  pages.Free(*a);
  EXPECT_DEATH(pages.Free(*a), "freed but not allocated");
}

// A launch reuses the workspace's plan only when the previous launch had
// the same shape and lengths (kernels::VerifyLaunchConfig::reuse_plan): the
// layers of one step of one batch.
TEST(PlanFingerprint, MatchesOnlyTheLastLaunchsShapeAndLengths) {
  PlanFingerprint f;
  const std::vector<int32_t> prefix = {4096, 17}, draft = {16, 4};
  const BatchShape shape{2, 16};
  EXPECT_FALSE(f.Matches(shape, prefix, draft)) << "nothing launched yet";
  f.Record(shape, prefix, draft);
  EXPECT_TRUE(f.Matches(shape, prefix, draft)) << "the next layer of the same step";
  EXPECT_FALSE(f.Matches(BatchShape{2, 32}, prefix, draft)) << "another draft bucket";
  EXPECT_FALSE(f.Matches(shape, std::vector<int32_t>{4096, 18}, draft)) << "a prefix moved";
  EXPECT_FALSE(f.Matches(shape, prefix, std::vector<int32_t>{16, 5})) << "a draft count moved";
  EXPECT_FALSE(f.Matches(shape, std::vector<int32_t>{17, 4096}, std::vector<int32_t>{4, 16}))
      << "requests reordered";
  f.Record(BatchShape{1, 2}, std::vector<int32_t>{100}, std::vector<int32_t>{2});
  EXPECT_FALSE(f.Matches(shape, prefix, draft)) << "another batch launched in between";
  EXPECT_TRUE(f.Matches(BatchShape{1, 2}, std::vector<int32_t>{100}, std::vector<int32_t>{2}));
  f.Clear();
  EXPECT_FALSE(f.Matches(BatchShape{1, 2}, std::vector<int32_t>{100}, std::vector<int32_t>{2}))
      << "after a failed launch";
}

// The bucket a graph replay pads a batch up to: the smallest pair that holds it.
TEST(ChooseBucket, SmallestBucketPairThatHoldsTheBatch) {
  const std::vector<int> batches = {1, 2, 4, 8}, drafts = {1, 4, 16};
  EXPECT_EQ(ChooseBucket(batches, drafts, 1, 1), (BatchShape{1, 1}));
  EXPECT_EQ(ChooseBucket(batches, drafts, 3, 5), (BatchShape{4, 16}));
  EXPECT_EQ(ChooseBucket(batches, drafts, 8, 16), (BatchShape{8, 16}));
  EXPECT_EQ(ChooseBucket(batches, drafts, 2, 4), (BatchShape{2, 4}));
  EXPECT_FALSE(ChooseBucket(batches, drafts, 9, 1).has_value()) << "more requests than any bucket";
  EXPECT_FALSE(ChooseBucket(batches, drafts, 1, 17).has_value()) << "longer drafts than any bucket";
}

TEST(PageTableArena, WritesOnlyWhatChangedAndMovesTablesThatOutgrowTheirRange) {
  PageTableArena arena(1024);
  std::vector<TableWrite> writes;
  std::vector<int32_t> values;
  ASSERT_TRUE(arena.Apply(7, TableDelta{0, {10, 11, 12}}).ok());
  const int64_t first = arena.OffsetOf(7);
  ASSERT_GE(first, 0);
  arena.TakeWrites(&writes, &values);
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0].at, first);
  EXPECT_EQ(writes[0].count, 3);
  EXPECT_EQ(values, (std::vector<int32_t>{10, 11, 12}));
  // Trimmed by a rejected step: nothing to write.
  ASSERT_TRUE(arena.Apply(7, TableDelta{2, {}}).ok());
  arena.TakeWrites(&writes, &values);
  EXPECT_TRUE(writes.empty());
  // Past 16 entries: the two kept ones move (device to device) to a range of
  // 32, the new ones are written after them.
  std::vector<int32_t> more(18);
  for (int k = 0; k < 18; ++k) more[k] = 100 + k;
  ASSERT_TRUE(arena.Apply(7, TableDelta{2, more}).ok());
  const int64_t moved = arena.OffsetOf(7);
  EXPECT_NE(moved, first);
  // The range given up is not reused by the same launch...
  ASSERT_TRUE(arena.Apply(8, TableDelta{0, {1}}).ok());
  EXPECT_NE(arena.OffsetOf(8), first);
  arena.TakeWrites(&writes, &values);
  ASSERT_EQ(writes.size(), 3u);
  EXPECT_EQ(writes[0].from, first);
  EXPECT_EQ(writes[0].at, moved);
  EXPECT_EQ(writes[0].count, 2);
  EXPECT_EQ(writes[1].at, moved + 2);
  EXPECT_EQ(writes[1].count, 18);
  // ...but by the next one.
  ASSERT_TRUE(arena.Apply(9, TableDelta{0, {2}}).ok());
  EXPECT_EQ(arena.OffsetOf(9), first);
  const std::vector<int32_t>* list = arena.Entries(7);
  ASSERT_NE(list, nullptr);
  EXPECT_EQ(list->size(), 20u);
  EXPECT_EQ((*list)[1], 11);
  EXPECT_EQ((*list)[2], 100);
  EXPECT_EQ(arena.Apply(7, TableDelta{21, {}}).code(), absl::StatusCode::kInternal)
      << "a change that keeps more than the table has is a bug";
}

TEST(PageTableArena, CompactsWhenTooFragmentedAndAsksForAFullUpload) {
  PageTableArena arena(64);
  std::vector<TableWrite> writes;
  std::vector<int32_t> values;
  for (uint64_t id = 1; id <= 4; ++id) {
    ASSERT_TRUE(arena.Apply(id, TableDelta{0, {static_cast<int32_t>(id)}}).ok());
  }
  arena.Release(2);
  arena.Release(4);
  arena.TakeWrites(&writes, &values);
  // 32 entries are free, but not in one piece.
  std::vector<int32_t> grown(17, 5);
  ASSERT_TRUE(arena.Apply(1, TableDelta{1, grown}).ok());
  EXPECT_TRUE(arena.needs_full_upload());
  const std::vector<int32_t> snapshot = arena.Snapshot();
  const int64_t a = arena.OffsetOf(1), c = arena.OffsetOf(3);
  EXPECT_EQ(snapshot[a], 1);
  EXPECT_EQ(snapshot[a + 17], 5);
  EXPECT_EQ(snapshot[c], 3);
  arena.TakeWrites(&writes, &values);
  EXPECT_TRUE(writes.empty()) << "the upload replaces the writes";
  EXPECT_FALSE(arena.needs_full_upload());
}

TEST(HostStaging, FirstFitWithCoalescingAndExhaustionWithTheNumbers) {
  std::vector<uint8_t> memory(4096);
  HostStaging staging(memory.data(), memory.size(), {1000, 2000}, nullptr);
  auto a = staging.Allocate(300, "a");  // 512
  auto b = staging.Allocate(256, "b");
  auto c = staging.Allocate(1024, "c");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->bytes, 512u);
  EXPECT_EQ(staging.DeviceAddress(1, b->host), 2000u + 512);
  staging.Free(*b);
  auto d = staging.Allocate(512, "d");  // does not fit where b was
  ASSERT_TRUE(d.ok());
  EXPECT_GT(d->host, c->host);
  auto e = staging.Allocate(2048, "the big one");
  EXPECT_EQ(e.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(e.status().message()), HasSubstr("the big one needs 2.0 KiB"));
  for (const auto& block : {*a, *c, *d}) staging.Free(block);
  EXPECT_EQ(staging.in_use(), 0u);
  auto all = staging.Allocate(4096, "everything");
  EXPECT_TRUE(all.ok()) << "freed ranges coalesce";
}

TEST(EngineConfig, RejectsBadSettings) {
  EngineConfig c;
  EXPECT_TRUE(c.Validate().ok());
  c.page_size = 48;
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  c = EngineConfig{};
  c.draft_buckets = {1, 4, 2};
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  c = EngineConfig{};
  c.draft_buckets = {1, 128};
  EXPECT_EQ(c.Validate().code(), absl::StatusCode::kInvalidArgument);
  c = EngineConfig{};
  c.pool_bytes = 1000;
  EXPECT_THAT(std::string(c.Validate().message()), HasSubstr("holds no page"));
  c = EngineConfig{};
  c.num_heads = 8;
  EXPECT_THAT(std::string(c.Validate(3).message()), HasSubstr("does not split over 3"));
  c.parallel_mode = ParallelMode::kDataParallel;
  EXPECT_TRUE(c.Validate(3).ok()) << "data parallel: every device computes all heads";
  EXPECT_EQ(c.Validate(0).code(), absl::StatusCode::kInvalidArgument);
}

// Errors name a setting by the name its user gave it (the server passes its
// flags), and by the field where none was given.
TEST(EngineConfig, ErrorsUseTheSettingNamesGiven) {
  EngineConfig c;
  c.num_heads = 7;
  EXPECT_THAT(std::string(c.Validate(2).message()), HasSubstr("num_heads = 7 does not split"));
  c.setting_names = {{"num_heads", "--heads"}, {"draft_buckets", "--draft-buckets"}};
  EXPECT_THAT(std::string(c.Validate(2).message()), HasSubstr("--heads 7 does not split over 2"));
  c.num_heads = 8;
  c.draft_buckets = {4, 2};
  EXPECT_THAT(std::string(c.Validate().message()),
              HasSubstr("--draft-buckets [4,2]: need strictly increasing"));
  c.draft_buckets = {1, 2};
  c.copy_threads = 0;
  EXPECT_THAT(std::string(c.Validate().message()), HasSubstr("copy_threads = 0: need 1..64"));
}

std::vector<std::unique_ptr<Device>> CpuDevices(int count, int threads) {
  std::vector<std::unique_ptr<Device>> devices;
  for (int d = 0; d < count; ++d) devices.push_back(MakeCpuDevice(threads));
  return devices;
}

class EngineTest : public ::testing::Test {
 protected:
  static constexpr int kLayers = 3, kHeads = 4, kPage = 8;

  void SetUp() override { Make(/*pool_pages=*/64); }

  void Make(int64_t pool_pages, std::unique_ptr<Device> device = nullptr) {
    std::vector<std::unique_ptr<Device>> devices;
    devices.push_back(device ? std::move(device) : MakeCpuDevice(2));
    MakeOn(pool_pages, kPage, std::move(devices));
  }

  // An engine over `devices` (tensor parallel when there are several).
  void MakeOn(int64_t pool_pages, int page_size, std::vector<std::unique_ptr<Device>> devices) {
    engine_.reset();
    config_.num_layers = kLayers;
    config_.num_heads = kHeads;
    config_.page_size = page_size;
    config_.pool_bytes = pool_pages * config_.bytes_per_page();
    config_.max_sequence_len = 4096;
    config_.draft_buckets = {1, 2, 4, 8, 16};
    config_.batch_buckets = {1, 2, 4};
    config_.pinned_staging_bytes = 4 << 20;
    auto engine = Engine::Create(config_, std::move(devices));
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
  }

  // Creates a sequence with a random prompt of `length` tokens (appended in
  // two chunks) and its mirror.
  uint64_t NewSequence(int64_t length, Mirror* mirror) {
    auto id = engine_->CreateSequence("test");
    EXPECT_TRUE(id.ok());
    mirror->layers.assign(kLayers, {});
    int64_t done = 0;
    while (done < length) {
      const int64_t chunk = std::min<int64_t>(length - done, 1 + length / 2);
      const std::vector<Bf16> kv = RandomBf16(rng_, kLayers * chunk * kLatentDim, 1.0f);
      auto new_length = engine_->AppendKv(*id, done, chunk, kv);
      EXPECT_TRUE(new_length.ok()) << new_length.status();
      for (int l = 0; l < kLayers; ++l) {
        mirror->layers[l].insert(mirror->layers[l].end(), kv.begin() + l * chunk * kLatentDim,
                                 kv.begin() + (l + 1) * chunk * kLatentDim);
      }
      done += chunk;
    }
    return *id;
  }

  struct Step {
    std::vector<int32_t> parents;
    std::vector<std::vector<Bf16>> q, draft_kv;  // per layer
  };

  Step RandomStep(int n) {
    Step s;
    s.parents = RandomDraftTree(rng_, n);
    for (int l = 0; l < kLayers; ++l) {
      s.q.push_back(RandomBf16(rng_, static_cast<size_t>(n) * kHeads * kLatentDim, 2.0f));
      s.draft_kv.push_back(RandomBf16(rng_, static_cast<size_t>(n) * kLatentDim, 1.0f));
    }
    return s;
  }

  // Verifies one layer of one sequence and checks the output against the
  // reference over the mirror. into_strings: the outputs go into strings the
  // engine fills (as the transport's inline answers), not caller buffers.
  void VerifyLayerAndCheck(uint64_t id, const Mirror& m, const Step& s, int layer,
                           bool into_strings = false) {
    const int n = static_cast<int>(s.parents.size());
    std::vector<Bf16> out(static_cast<size_t>(n) * kHeads * kValueDim, Bf16QuietNaN());
    std::vector<float> lse(static_cast<size_t>(n) * kHeads, NAN);
    VerifyItem item{
        id, s.parents, s.q[layer], s.draft_kv[layer], absl::MakeSpan(out), absl::MakeSpan(lse)};
    std::string out_bytes, lse_bytes;
    if (into_strings) {
      item.out = OutputRef();
      item.out.grow = &out_bytes;
      item.lse = OutputRef();
      item.lse.grow = &lse_bytes;
    }
    ASSERT_TRUE(engine_->Verify(layer, 0.0f, absl::MakeSpan(&item, 1)).ok());
    if (into_strings) {
      ASSERT_EQ(out_bytes.size(), out.size() * sizeof(Bf16));
      ASSERT_EQ(lse_bytes.size(), lse.size() * sizeof(float));
      std::memcpy(out.data(), out_bytes.data(), out_bytes.size());
      std::memcpy(lse.data(), lse_bytes.data(), lse_bytes.size());
    }
    EXPECT_EQ(item.prefix_len, m.length());
    std::vector<Bf16> ref_out;
    std::vector<float> ref_lse;
    Reference(m, layer, s.draft_kv[layer], s.parents, s.q[layer], kHeads,
              config_.default_softmax_scale, &ref_out, &ref_lse, config_.kv_dtype);
    // Same math, same order of operations: equal to the bit.
    EXPECT_EQ(std::memcmp(out.data(), ref_out.data(), out.size() * sizeof(Bf16)), 0);
    EXPECT_EQ(lse, ref_lse);
  }

  void ApplyCommit(Mirror* m, const Step& s, const std::vector<int32_t>& accepted) {
    for (int l = 0; l < kLayers; ++l) {
      for (int32_t a : accepted) {
        m->layers[l].insert(m->layers[l].end(), s.draft_kv[l].begin() + a * kLatentDim,
                            s.draft_kv[l].begin() + (a + 1) * kLatentDim);
      }
    }
  }

  // The pool holds the mirror's rows as its dtype stores them, to the byte.
  void ExpectKvEquals(uint64_t id, const Mirror& m, int replica = 0) {
    const int64_t len = m.length();
    const int64_t row = KvRowBytes(config_.kv_dtype) / static_cast<int64_t>(sizeof(Bf16));
    std::vector<Bf16> kv(static_cast<size_t>(kLayers) * len * row);
    ASSERT_TRUE(engine_->ReadKv(id, 0, len, absl::MakeSpan(kv), replica).ok());
    for (int l = 0; l < kLayers; ++l) {
      const std::vector<Bf16> expected = StoredRows(m.layers[l], config_.kv_dtype);
      EXPECT_EQ(std::memcmp(kv.data() + l * len * row, expected.data(), len * row * sizeof(Bf16)),
                0)
          << "layer " << l;
    }
  }

  EngineConfig config_;
  std::unique_ptr<Engine> engine_;
  std::mt19937_64 rng_{12345};
};

TEST_F(EngineTest, VerifyMatchesReferenceAndCommitCompactsEveryLayer) {
  Mirror m;
  const uint64_t id = NewSequence(21, &m);
  ExpectKvEquals(id, m);
  for (int step = 0; step < 4; ++step) {
    const Step s = RandomStep(step == 0 ? 1 : 7);
    for (int l = 0; l < kLayers; ++l) VerifyLayerAndCheck(id, m, s, l);
    // The longest root-to-leaf path ending at the last draft.
    std::vector<int32_t> path;
    for (int a = static_cast<int>(s.parents.size()) - 1; a >= 0; a = s.parents[a])
      path.push_back(a);
    std::reverse(path.begin(), path.end());
    auto result = engine_->Commit(id, path);
    ASSERT_TRUE(result.ok()) << result.status();
    ApplyCommit(&m, s, path);
    EXPECT_EQ(result->length, m.length());
    EXPECT_EQ(result->accepted_count, static_cast<int>(path.size()));
    ExpectKvEquals(id, m);
  }
  EXPECT_EQ(engine_->Stats().tokens_committed_total, m.length() - 21);
}

// An fp8 pool (--kv-dtype fp8): rows enter it quantized (AppendKv, the
// drafts of a Verify), Commit moves them as stored, and Verify attends to the
// rows as stored; the output is the reference over the quantized rows to the
// bit, and within the quantization error of the bf16 reference.
class EngineFp8Test : public EngineTest {
 protected:
  void SetUp() override {
    config_.kv_dtype = KvDtype::kFp8;
    Make(/*pool_pages=*/64);
  }
};

TEST_F(EngineFp8Test, StoresQuantizedRowsVerifiesOverThemAndCommitsThemAsStored) {
  Mirror m;
  const uint64_t id = NewSequence(21, &m);
  ExpectKvEquals(id, m);
  for (int step = 0; step < 3; ++step) {
    const Step s = RandomStep(step == 0 ? 1 : 7);
    for (int l = 0; l < kLayers; ++l) {
      VerifyLayerAndCheck(id, m, s, l);
      // Against the unquantized rows: within fp8's error, far from garbage.
      const int n = static_cast<int>(s.parents.size());
      std::vector<Bf16> out(static_cast<size_t>(n) * kHeads * kValueDim);
      std::vector<float> lse(static_cast<size_t>(n) * kHeads);
      std::vector<Bf16> exact_out, fp8_out;
      std::vector<float> exact_lse, fp8_lse;
      Reference(m, l, s.draft_kv[l], s.parents, s.q[l], kHeads, config_.default_softmax_scale,
                &exact_out, &exact_lse, KvDtype::kBf16);
      Reference(m, l, s.draft_kv[l], s.parents, s.q[l], kHeads, config_.default_softmax_scale,
                &fp8_out, &fp8_lse, KvDtype::kFp8);
      double diff = 0, norm = 0;
      for (size_t k = 0; k < exact_out.size(); ++k) {
        const double e = Bf16ToFloat(exact_out[k]), f = Bf16ToFloat(fp8_out[k]);
        diff += (e - f) * (e - f);
        norm += e * e;
      }
      EXPECT_LT(std::sqrt(diff / norm), 0.08) << "layer " << l;
      EXPECT_GT(std::sqrt(diff / norm), 0.0) << "the fp8 reference must differ from bf16";
    }
    std::vector<int32_t> path;
    for (int a = static_cast<int>(s.parents.size()) - 1; a >= 0; a = s.parents[a])
      path.push_back(a);
    std::reverse(path.begin(), path.end());
    auto result = engine_->Commit(id, path);
    ASSERT_TRUE(result.ok()) << result.status();
    ApplyCommit(&m, s, path);
    ExpectKvEquals(id, m);
  }
}

TEST_F(EngineFp8Test, HoldsMorePagesInTheSameBytes) {
  EXPECT_EQ(config_.bytes_per_page(), int64_t{kLayers} * kPage * 656);
  EngineConfig bf16 = config_;
  bf16.kv_dtype = KvDtype::kBf16;
  EngineConfig fp8 = config_;
  bf16.pool_bytes = fp8.pool_bytes = int64_t{1} << 30;
  EXPECT_GE(static_cast<double>(fp8.num_pages()), 1.75 * static_cast<double>(bf16.num_pages()));
  EXPECT_EQ(engine_->Stats().total_pages, 64);
  EXPECT_EQ(engine_->Stats().kv_row_bytes, 656);
}

TEST_F(EngineFp8Test, NonFiniteRowsAreRefusedAndNothingIsWritten) {
  Mirror m;
  const uint64_t id = NewSequence(9, &m);
  const int64_t free_before = engine_->Stats().free_pages;
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    // AppendKv: the sequence keeps its length and its pages.
    std::vector<Bf16> kv = RandomBf16(rng_, kLayers * 3 * kLatentDim, 1.0f);
    kv[2 * 3 * kLatentDim + kLatentDim + 100] = FloatToBf16(bad);  // layer 2, token 1
    auto appended = engine_->AppendKv(id, 9, 3, kv);
    EXPECT_EQ(appended.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(appended.status().message()), HasSubstr("NaN or an infinity"));
    EXPECT_EQ(engine_->Stats().free_pages, free_before);
    // Verify: no step opens, the pool is as before.
    Step s = RandomStep(4);
    s.draft_kv[1][2 * kLatentDim + 7] = FloatToBf16(bad);
    std::vector<Bf16> out(4 * kHeads * kValueDim);
    std::vector<float> lse(4 * kHeads);
    VerifyItem item{id, s.parents, s.q[1], s.draft_kv[1], absl::MakeSpan(out), absl::MakeSpan(lse)};
    const absl::Status verified = engine_->Verify(1, 0.0f, absl::MakeSpan(&item, 1));
    EXPECT_EQ(verified.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(verified.message()), HasSubstr("draft_kv: row 2"));
    EXPECT_EQ(engine_->Stats().pending_steps, 0);
    EXPECT_EQ(engine_->Stats().free_pages, free_before);
  }
  ExpectKvEquals(id, m);
  // The sequence goes on as if nothing happened.
  const Step s = RandomStep(3);
  for (int l = 0; l < kLayers; ++l) VerifyLayerAndCheck(id, m, s, l);
}

TEST_F(EngineTest, RejectedStepLeavesSequenceAsBefore) {
  Mirror m;
  const uint64_t id = NewSequence(16, &m);  // exactly two pages
  const int64_t free_before = engine_->Stats().free_pages;
  const Step s = RandomStep(5);
  VerifyLayerAndCheck(id, m, s, 0);
  EXPECT_EQ(engine_->Stats().free_pages, free_before - 1) << "drafts need a third page";
  EXPECT_EQ(engine_->Stats().pending_steps, 1);
  // Only one layer verified: accepting must fail, rejecting everything is fine.
  EXPECT_EQ(engine_->Commit(id, {0}).status().code(), absl::StatusCode::kFailedPrecondition);
  auto result = engine_->Commit(id, {});
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->length, 16);
  EXPECT_EQ(engine_->Stats().free_pages, free_before);
  EXPECT_EQ(engine_->Stats().pending_steps, 0);
  ExpectKvEquals(id, m);
  // The next step starts from the same prefix.
  const Step next = RandomStep(3);
  for (int l = 0; l < kLayers; ++l) VerifyLayerAndCheck(id, m, next, l);
}

TEST_F(EngineTest, StateMachineRejectsOutOfOrderCalls) {
  Mirror m;
  const uint64_t id = NewSequence(10, &m);
  const int64_t free_before = engine_->Stats().free_pages;
  EXPECT_EQ(engine_->Commit(id, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  const Step s = RandomStep(4);
  VerifyLayerAndCheck(id, m, s, 1);
  // Another tree while the step is pending.
  Step other = s;
  other.parents = {-1, -1, -1, -1};
  std::vector<Bf16> out(4 * kHeads * kValueDim);
  std::vector<float> lse(4 * kHeads);
  VerifyItem item{
      id, other.parents, other.q[0], other.draft_kv[0], absl::MakeSpan(out), absl::MakeSpan(lse)};
  const absl::Status st = engine_->Verify(0, 0.0f, absl::MakeSpan(&item, 1));
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(st.message()), HasSubstr("same parents"));
  // Appending while pending.
  const std::vector<Bf16> kv(kLayers * kLatentDim);
  EXPECT_EQ(engine_->AppendKv(id, 10, 1, kv).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A path that is not root-to-node.
  for (int l = 0; l < kLayers; ++l) VerifyLayerAndCheck(id, m, s, l);
  std::vector<int32_t> bad = {1};
  if (s.parents[1] == -1) bad = {0, 1};  // 1 is a root, so 1 is not 0's child
  EXPECT_EQ(engine_->Commit(id, bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->Commit(id, {9}).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(engine_->Commit(id, {}).ok());
  EXPECT_EQ(engine_->Stats().free_pages, free_before);
  // Wrong start position on append.
  EXPECT_EQ(engine_->AppendKv(id, 9, 1, kv).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine_->AppendKv(id, 10, 2, kv).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(EngineTest, VerifyRejectsBadItemsWithoutChangingAnything) {
  Mirror m1, m2;
  const uint64_t a = NewSequence(5, &m1);
  const uint64_t b = NewSequence(5, &m2);
  const int64_t free_before = engine_->Stats().free_pages;
  const Step s = RandomStep(3);
  std::vector<Bf16> out(3 * kHeads * kValueDim);
  std::vector<float> lse(3 * kHeads);
  auto item_for = [&](uint64_t id) {
    return VerifyItem{
        id, s.parents, s.q[0], s.draft_kv[0], absl::MakeSpan(out), absl::MakeSpan(lse)};
  };
  std::vector<VerifyItem> dup = {item_for(a), item_for(a)};
  EXPECT_EQ(engine_->Verify(0, 0.0f, absl::MakeSpan(dup)).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<VerifyItem> unknown = {item_for(a), item_for(999)};
  EXPECT_EQ(engine_->Verify(0, 0.0f, absl::MakeSpan(unknown)).code(), absl::StatusCode::kNotFound);
  std::vector<VerifyItem> layer = {item_for(a)};
  EXPECT_EQ(engine_->Verify(kLayers, 0.0f, absl::MakeSpan(layer)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->Verify(0, NAN, absl::MakeSpan(layer)).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<VerifyItem> none;
  EXPECT_EQ(engine_->Verify(0, 0.0f, absl::MakeSpan(none)).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<VerifyItem> too_many = {item_for(a), item_for(b), item_for(a + 100),
                                      item_for(a + 101), item_for(a + 102)};
  EXPECT_EQ(engine_->Verify(0, 0.0f, absl::MakeSpan(too_many)).code(),
            absl::StatusCode::kInvalidArgument);
  VerifyItem cyclic = item_for(a);
  const std::vector<int32_t> bad_parents = {-1, 2, 0};
  cyclic.parents = bad_parents;
  EXPECT_EQ(engine_->Verify(0, 0.0f, absl::MakeSpan(&cyclic, 1)).code(),
            absl::StatusCode::kInvalidArgument);
  VerifyItem short_q = item_for(a);
  short_q.q.bytes = short_q.q.bytes.subspan(2);  // one bf16 value short
  EXPECT_EQ(engine_->Verify(0, 0.0f, absl::MakeSpan(&short_q, 1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->Stats().free_pages, free_before);
  EXPECT_EQ(engine_->Stats().pending_steps, 0);
  ExpectKvEquals(a, m1);
}

TEST_F(EngineTest, ExhaustionIsReportedAndChangesNothing) {
  Make(/*pool_pages=*/5);
  Mirror m1, m2;
  const uint64_t a = NewSequence(24, &m1);  // 3 pages
  const uint64_t b = NewSequence(16, &m2);  // 2 pages: the pool is full
  EXPECT_EQ(engine_->Stats().free_pages, 0);
  const std::vector<Bf16> kv(kLayers * kLatentDim);
  const absl::Status appended = engine_->AppendKv(a, 24, 1, kv).status();
  EXPECT_EQ(appended.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(appended.message()), HasSubstr("0 of 5 are free"));
  // Two items: neither may open a step when the pool cannot hold both.
  ASSERT_TRUE(engine_->Release(b).ok());
  Mirror m3;
  const uint64_t c = NewSequence(15, &m3);  // 2 pages, one slot left in the last
  EXPECT_EQ(engine_->Stats().free_pages, 0);
  const Step s = RandomStep(2);
  std::vector<Bf16> out1(2 * kHeads * kValueDim), out2(2 * kHeads * kValueDim);
  std::vector<float> lse1(2 * kHeads), lse2(2 * kHeads);
  std::vector<VerifyItem> items = {
      {c, s.parents, s.q[0], s.draft_kv[0], absl::MakeSpan(out1), absl::MakeSpan(lse1)},
      {a, s.parents, s.q[0], s.draft_kv[0], absl::MakeSpan(out2), absl::MakeSpan(lse2)}};
  EXPECT_EQ(engine_->Verify(0, 0.0f, absl::MakeSpan(items)).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(engine_->Stats().pending_steps, 0);
  EXPECT_EQ(engine_->Stats().free_pages, 0);
  // Freeing a makes room for both.
  ASSERT_TRUE(engine_->Release(a).ok());
  Mirror m4;
  const uint64_t d = NewSequence(8, &m4);
  items[1].sequence_id = d;
  EXPECT_TRUE(engine_->Verify(0, 0.0f, absl::MakeSpan(items)).ok());
  EXPECT_EQ(engine_->Stats().pending_steps, 2);
}

TEST_F(EngineTest, ReleaseAndExpiryFreeEverything) {
  config_.idle_timeout = absl::Seconds(30);
  auto engine = Engine::Create(config_, CpuDevices(1, 1));
  ASSERT_TRUE(engine.ok());
  engine_ = *std::move(engine);
  const int64_t total = engine_->Stats().total_pages;
  Mirror m1, m2;
  const uint64_t a = NewSequence(40, &m1);
  const uint64_t b = NewSequence(3, &m2);
  const Step s = RandomStep(4);
  VerifyLayerAndCheck(b, m2, s, 0);  // a pending step is freed too
  auto freed = engine_->Release(a);
  ASSERT_TRUE(freed.ok());
  EXPECT_EQ(*freed, 5);
  EXPECT_EQ(engine_->Release(a).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->ExpireIdle(absl::Now()), 0) << "nothing is idle yet";
  EXPECT_EQ(engine_->ExpireIdle(absl::Now() + absl::Seconds(31)), 1);
  const absl::Status gone = engine_->Commit(b, {}).status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(gone.message()), HasSubstr("expired"));
  const EngineStats stats = engine_->Stats();
  EXPECT_EQ(stats.free_pages, total);
  EXPECT_EQ(stats.live_sequences, 0);
  EXPECT_EQ(stats.pending_steps, 0);
  EXPECT_EQ(stats.sequences_expired_total, 1);
}

// A device that faults on its first verify launch: the call fails with
// INTERNAL naming the device, the step it opened is undone, and the engine
// refuses device work from then on.
TEST_F(EngineTest, DeviceFaultFailsTheCallUndoesTheStepAndStopsDeviceWork) {
  FakeDeviceOptions fake;
  fake.fail_launch = 1;
  Make(64, MakeFakeDevice(0, fake, nullptr));
  absl::Status heard;
  int faults = 0;
  engine_->SetFaultListener([&](const absl::Status& s) {
    heard = s;
    ++faults;
  });
  Mirror m;
  const uint64_t id = NewSequence(16, &m);
  const int64_t free_before = engine_->Stats().free_pages;
  const Step s = RandomStep(3);
  std::vector<Bf16> out(3 * kHeads * kValueDim);
  std::vector<float> lse(3 * kHeads);
  VerifyItem item{id, s.parents, s.q[0], s.draft_kv[0], absl::MakeSpan(out), absl::MakeSpan(lse)};
  const absl::Status failed = engine_->Verify(0, 0.0f, absl::MakeSpan(&item, 1));
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(failed.message()), HasSubstr("device fake:0 faulted"));
  EXPECT_EQ(engine_->Stats().free_pages, free_before);
  EXPECT_EQ(engine_->Stats().pending_steps, 0);
  EXPECT_EQ(faults, 1);
  EXPECT_THAT(std::string(heard.message()), HasSubstr("fake:0"));
  EXPECT_EQ(engine_->Commit(id, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  const absl::Status refused = engine_->Verify(0, 0.0f, absl::MakeSpan(&item, 1));
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("fake:0"));
  EXPECT_EQ(faults, 1) << "a fault is reported once";
  // Releasing still works and gives every page back.
  ASSERT_TRUE(engine_->Release(id).ok());
  EXPECT_EQ(engine_->Stats().free_pages, engine_->Stats().total_pages);
}

// The devices keep each sequence's page table themselves (the engine sends
// only what changed). With one page per token, tables outgrow their first
// ranges (16 entries) and move, are trimmed by rejected drafts, and freed
// ranges are reused by new sequences; on two tensor-parallel devices of each
// flavor (the CPU backend; fakes that launch from the submitting thread; and
// fakes that, like a GPU, address only their own memory, so that every
// tensor goes through the engine's host staging) every output equals the
// reference over an independent mirror and both replicas hold every row.
class PageTableTest : public EngineTest, public ::testing::WithParamInterface<std::string> {};

TEST_P(PageTableTest, TablesFollowGrowthMovesTrimsAndReuse) {
  std::vector<std::unique_ptr<Device>> devices;
  FakeDeviceRecord records[2];
  for (int d = 0; d < 2; ++d) {
    if (GetParam() == "cpu") {
      devices.push_back(MakeCpuDevice(1));
      continue;
    }
    FakeDeviceOptions options;
    options.graphs = true;
    options.asynchronous = true;
    options.addresses_host_memory = GetParam() != "staged";
    devices.push_back(MakeFakeDevice(d, options, &records[d]));
  }
  MakeOn(/*pool_pages=*/700, /*page_size=*/1, std::move(devices));
  std::vector<Mirror> mirrors(3);
  std::vector<uint64_t> ids = {NewSequence(5, &mirrors[0]), NewSequence(14, &mirrors[1]),
                               NewSequence(40, &mirrors[2])};
  for (int step = 0; step < 7; ++step) {
    if (step == 3) {
      // A released sequence's range goes back; a new one may take it.
      ASSERT_TRUE(engine_->Release(ids[1]).ok());
      mirrors[1] = Mirror{};
      ids[1] = NewSequence(3, &mirrors[1]);
    }
    for (size_t k = 0; k < ids.size(); ++k) {
      Step s = RandomStep(7);
      if ((step + k) % 2 == 0) s.parents = {-1, 0, 1, 2, 3, 4, 5};  // a chain: 7 accepted
      for (int l = 0; l < kLayers; ++l) {
        VerifyLayerAndCheck(ids[k], mirrors[k], s, l, /*into_strings=*/(l + step) % 2 == 1);
      }
      std::vector<int32_t> path;
      if ((step + k) % 4 != 1) {
        for (int a = 6; a >= 0; a = s.parents[a]) path.insert(path.begin(), a);
      }
      ASSERT_TRUE(engine_->Commit(ids[k], path).ok());
      ApplyCommit(&mirrors[k], s, path);
    }
  }
  for (size_t k = 0; k < ids.size(); ++k) {
    // Two moves (past 16 and 32 entries); the replacement of sequence 1 one.
    EXPECT_GT(mirrors[k].length(), k == 1 ? 16 : 32);
    ExpectKvEquals(ids[k], mirrors[k], 0);
    ExpectKvEquals(ids[k], mirrors[k], 1);
    ASSERT_TRUE(engine_->Release(ids[k]).ok());
  }
  EXPECT_EQ(engine_->Stats().free_pages, engine_->Stats().total_pages);
  if (GetParam() != "cpu") {
    absl::MutexLock lock(&records[0].mu);
    EXPECT_GT(records[0].table_entries_written, 0);
    EXPECT_EQ(records[0].table_uploads, 0) << "no arena compaction needed";
  }
  EXPECT_EQ(engine_->Stats().staging_bytes > 0, GetParam() == "staged");
  EXPECT_EQ(engine_->Stats().staging_bytes_in_use, 0) << "every call's staging went back";
}

INSTANTIATE_TEST_SUITE_P(Devices, PageTableTest, ::testing::Values("cpu", "async", "staged"),
                         [](const auto& info) { return info.param; });

TEST_F(EngineTest, ConcurrentSequencesLeaveNoPagesBehind) {
  Make(256);
  const int64_t total = engine_->Stats().total_pages;
  std::vector<std::thread> workers;
  std::atomic<int> failures{0};
  for (int w = 0; w < 6; ++w) {
    workers.emplace_back([&, w] {
      std::mt19937_64 rng(w);
      for (int round = 0; round < 5; ++round) {
        auto id = engine_->CreateSequence("worker");
        std::vector<Bf16> kv = RandomBf16(rng, kLayers * 9 * kLatentDim, 1.0f);
        if (!engine_->AppendKv(*id, 0, 9, kv).ok()) ++failures;
        for (int step = 0; step < 3; ++step) {
          const std::vector<int32_t> parents = RandomDraftTree(rng, 4);
          const std::vector<Bf16> q = RandomBf16(rng, 4 * kHeads * kLatentDim, 2.0f);
          const std::vector<Bf16> dkv = RandomBf16(rng, 4 * kLatentDim, 1.0f);
          std::vector<Bf16> out(4 * kHeads * kValueDim);
          std::vector<float> lse(4 * kHeads);
          for (int l = 0; l < kLayers; ++l) {
            VerifyItem item{*id, parents, q, dkv, absl::MakeSpan(out), absl::MakeSpan(lse)};
            if (!engine_->Verify(l, 0.0f, absl::MakeSpan(&item, 1)).ok()) ++failures;
          }
          const std::vector<int32_t> path =
              parents[0] == -1 && step % 2 == 0 ? std::vector<int32_t>{0} : std::vector<int32_t>{};
          if (!engine_->Commit(*id, path).ok()) ++failures;
        }
        if (!engine_->Release(*id).ok()) ++failures;
      }
    });
  }
  for (auto& t : workers) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(engine_->Stats().free_pages, total);
  EXPECT_EQ(engine_->Stats().live_sequences, 0);
}

}  // namespace
}  // namespace mlaverify::engine
