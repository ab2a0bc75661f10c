// The first two rooms of a call's life, with no engine and no device:
// placement (call_placement.h: every check that needs no sequence state,
// where each tensor goes, fp8 rows checked where the client cannot change
// them) and the reservation (call_reservation.h: admission, staging block
// and pages, given back by its destructor unless committed).
#include "server/engine/call_placement.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/geometry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/engine/call_reservation.h"

namespace mlaverify::engine {
namespace {

using ::testing::HasSubstr;

constexpr int kHeads = 2;

PlacementGeometry Geometry(bool staged, KvDtype dtype = KvDtype::kBf16) {
  PlacementGeometry g;
  g.num_layers = 3;
  g.num_heads = kHeads;
  g.max_batch = 4;
  g.max_draft_len = 8;
  g.default_softmax_scale = 0.125f;
  g.kv_dtype = dtype;
  g.staged = staged;
  g.staging_capacity = staged ? (size_t{1} << 20) : 0;
  return g;
}

// Host memory "mapped" for one device at its own address, or not mappable
// (the devices then reach the region through the staging or as host memory).
class HostMapper final : public RegionMapper {
 public:
  explicit HostMapper(bool mappable) : mappable_(mappable) {}
  absl::StatusOr<HostMapping> MapHost(void* data, size_t) override {
    if (!mappable_) return absl::ResourceExhaustedError("RLIMIT_MEMLOCK");
    HostMapping m;
    m.device.push_back(reinterpret_cast<uint64_t>(data));
    return m;
  }
  void UnmapHost(void*) override {}
  absl::StatusOr<std::vector<uint64_t>> OpenCuda(absl::string_view, int) override {
    return absl::FailedPreconditionError("no CUDA here");
  }
  void CloseCuda(const std::vector<uint64_t>&) override {}
  absl::StatusOr<std::vector<uint64_t>> AddressLocalDevice(uint64_t, int) override {
    return absl::FailedPreconditionError("no CUDA here");
  }

 private:
  const bool mappable_;
};

// One item's tensors in caller memory (outputs as strings to grow).
struct InlineItem {
  InlineItem(uint64_t id, int n)
      : parents(n),
        q(static_cast<size_t>(n) * kHeads * kLatentDim, FloatToBf16(0.5f)),
        draft(static_cast<size_t>(n) * kLatentDim, FloatToBf16(0.25f)) {
    for (int i = 0; i < n; ++i) parents[i] = i - 1;
    item.sequence_id = id;
    item.parents = parents;
    item.q = q;
    item.draft_kv = draft;
    item.out.grow = &out;
    item.lse.grow = &lse;
  }
  std::vector<int32_t> parents;
  std::vector<Bf16> q, draft;
  std::string out, lse;
  VerifyItem item;
};

VerifyCall CallOf(std::vector<VerifyItem>& items, int layer = 1, float scale = 0) {
  VerifyCall call;
  call.layer = layer;
  call.softmax_scale = scale;
  call.items = absl::MakeSpan(items);
  return call;
}

class CallPlacementTest : public ::testing::Test {
 protected:
  CallPlacementTest() : regions_(RegionOptions{}) {}
  RegionRegistry regions_;
};

TEST_F(CallPlacementTest, EachMalformedCallIsRefusedWithItsReason) {
  const PlacementGeometry g = Geometry(false);
  auto refused = [&](std::vector<VerifyItem> items, int layer, float scale) {
    absl::StatusOr<PlacedVerify> placed = PlaceVerify(g, regions_, CallOf(items, layer, scale));
    EXPECT_EQ(placed.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(placed.status().message());
  };
  InlineItem a(7, 3), b(7, 2), big(9, 9), none(10, 1);
  none.parents.clear();
  none.item.parents = {};
  EXPECT_THAT(refused({}, 1, 0), HasSubstr("no items"));
  EXPECT_THAT(refused({a.item, a.item, a.item, a.item, a.item}, 1, 0), HasSubstr("max_batch is 4"));
  EXPECT_THAT(refused({a.item}, 3, 0), HasSubstr("layer 3 is outside 0..2"));
  EXPECT_THAT(refused({a.item}, 1, std::numeric_limits<float>::quiet_NaN()),
              HasSubstr("softmax_scale must be finite"));
  EXPECT_THAT(refused({big.item}, 1, 0), HasSubstr("items[0] (sequence 9): 9 drafts"));
  EXPECT_THAT(refused({none.item}, 1, 0), HasSubstr("0 drafts"));
  EXPECT_THAT(refused({a.item, b.item}, 1, 0), HasSubstr("sequence 7 appears twice"));

  InlineItem wrong_bytes(11, 2);
  wrong_bytes.item.q = absl::MakeConstSpan(wrong_bytes.q).subspan(1);
  EXPECT_THAT(refused({wrong_bytes.item}, 1, 0), HasSubstr("items[0] (sequence 11) q: "));
  InlineItem wrong_dtype(12, 2);
  wrong_dtype.item.draft_kv.dtype = DType::kFp32;
  EXPECT_THAT(refused({wrong_dtype.item}, 1, 0),
              HasSubstr("draft_kv: dtype DTYPE_FP32, expected DTYPE_BF16"));
  InlineItem wrong_shape(13, 2);
  const std::vector<int64_t> shape = {2, kHeads + 1, kLatentDim};
  wrong_shape.item.q.has_shape = true;
  wrong_shape.item.q.shape = shape;
  EXPECT_THAT(refused({wrong_shape.item}, 1, 0),
              HasSubstr("shape [2, 3, 576], expected [2, 2, 576]"));
  InlineItem half_region(14, 2);
  half_region.item.out.in_region = true;
  EXPECT_THAT(refused({half_region.item}, 1, 0), HasSubstr("go together"));
}

TEST_F(CallPlacementTest, StagedTensorsGetAlignedOffsetsAndCountAsHeldBytes) {
  InlineItem a(1, 3), b(2, 1);
  std::vector<VerifyItem> items = {a.item, b.item};
  absl::StatusOr<PlacedVerify> placed = PlaceVerify(Geometry(true), regions_, CallOf(items));
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_EQ(placed->scale, 0.125f);  // the default for a scale <= 0
  EXPECT_EQ(placed->layer, 1);
  size_t expected_offset = 0;
  int64_t bytes = 0;
  for (const PlacedVerifyItem& item : placed->items) {
    for (const PlacedTensor* t : {&item.q, &item.draft_kv, &item.out, &item.lse}) {
      EXPECT_EQ(t->where, PlacedTensor::Where::kStaged);
      EXPECT_EQ(t->staging_offset, expected_offset);
      EXPECT_EQ(t->staging_offset % 256, 0u);
      expected_offset += (t->bytes + 255) / 256 * 256;
      bytes += static_cast<int64_t>(t->bytes);
    }
  }
  EXPECT_EQ(placed->items[0].q.bytes, size_t{3} * kHeads * kLatentDim * 2);
  EXPECT_EQ(placed->items[1].lse.bytes, size_t{1} * kHeads * 4);
  EXPECT_EQ(placed->staging_bytes, expected_offset);
  EXPECT_EQ(placed->admitted_bytes, bytes);
  ASSERT_EQ(placed->items[0].visibility->size(), 3u);
  EXPECT_EQ((*placed->items[0].visibility)[2], 0b111u);  // a chain: each row sees its ancestors

  // The same call where the devices address host memory: nothing staged.
  placed = PlaceVerify(Geometry(false), regions_, CallOf(items));
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_EQ(placed->staging_bytes, 0u);
  EXPECT_EQ(placed->items[0].q.where, PlacedTensor::Where::kHost);
  EXPECT_EQ(placed->admitted_bytes, bytes);
}

TEST_F(CallPlacementTest, Fp8RowsAreCheckedOnTheCopyTheDevicesRead) {
  InlineItem a(1, 2);
  a.draft[kLatentDim + 5] = FloatToBf16(std::numeric_limits<float>::infinity());
  std::vector<VerifyItem> items = {a.item};
  for (const bool staged : {true, false}) {
    const PlacementGeometry g = Geometry(staged, KvDtype::kFp8);
    absl::StatusOr<PlacedVerify> placed = PlaceVerify(g, regions_, CallOf(items));
    ASSERT_TRUE(placed.ok()) << placed.status();
    EXPECT_TRUE(placed->items[0].draft_kv.rows_to_check);
    EXPECT_FALSE(placed->items[0].q.rows_to_check);
    std::vector<uint8_t> block(placed->staging_bytes);
    std::vector<std::unique_ptr<uint8_t[]>> copies;
    const absl::Status filled = FillStagedInputs(g, InputsOf(*placed), block.data(), copies);
    EXPECT_EQ(filled.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(filled.message()),
                HasSubstr("items[0] (sequence 1) draft_kv: row 1 holds a NaN or an infinity"));
  }
  // A bf16 pool stores what it is given.
  const PlacementGeometry bf16 = Geometry(true);
  absl::StatusOr<PlacedVerify> placed = PlaceVerify(bf16, regions_, CallOf(items));
  ASSERT_TRUE(placed.ok());
  std::vector<uint8_t> block(placed->staging_bytes);
  std::vector<std::unique_ptr<uint8_t[]>> copies;
  EXPECT_TRUE(FillStagedInputs(bf16, InputsOf(*placed), block.data(), copies).ok());
  EXPECT_EQ(std::memcmp(block.data() + placed->items[0].draft_kv.staging_offset, a.draft.data(),
                        a.draft.size() * sizeof(Bf16)),
            0);
}

// A system region the test writes like a client that keeps writing during
// its call.
class RegionPlacementTest : public ::testing::TestWithParam<bool> {
 protected:
  static constexpr size_t kBytes = 1 << 20;

  void SetUp() override {
    RegionOptions options;
    options.enabled = true;
    regions_ = std::make_unique<RegionRegistry>(options);
    regions_->SetMapper(&mapper_);
    key_ = absl::StrCat("/mlaverify-placement-test-", getpid());
    const int fd = shm_open(key_.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, kBytes), 0);
    memory_ =
        static_cast<uint8_t*>(mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    ASSERT_NE(memory_, MAP_FAILED);
    ASSERT_TRUE(regions_->Register("r", key_, 0, kBytes).ok());
  }
  void TearDown() override {
    regions_.reset();
    if (memory_ != nullptr && memory_ != MAP_FAILED) munmap(memory_, kBytes);
    shm_unlink(key_.c_str());
  }

  // bf16 rows of value `v` at `offset` of the region.
  TensorRef Rows(uint64_t offset, int64_t rows, float v) {
    auto* values = reinterpret_cast<Bf16*>(memory_ + offset);
    for (int64_t i = 0; i < rows * kLatentDim; ++i) values[i] = FloatToBf16(v);
    TensorRef ref;
    ref.in_region = true;
    ref.range = {"r", offset, static_cast<uint64_t>(rows * kLatentDim * sizeof(Bf16))};
    return ref;
  }

  HostMapper mapper_{GetParam()};
  std::unique_ptr<RegionRegistry> regions_;
  std::string key_;
  uint8_t* memory_ = nullptr;
};

TEST_P(RegionPlacementTest, Fp8RowsFromARegionAreCopiedBeforeTheirCheck) {
  const bool pinned = GetParam();
  InlineItem a(1, 2);
  a.item.draft_kv = Rows(4096, 2, 1.0f);
  std::vector<VerifyItem> items = {a.item};
  for (const bool staged : {true, false}) {
    SCOPED_TRACE(absl::StrCat("staged ", staged, ", region pinned ", pinned));
    const PlacementGeometry g = Geometry(staged, KvDtype::kFp8);
    absl::StatusOr<PlacedVerify> placed = PlaceVerify(g, *regions_, CallOf(items));
    ASSERT_TRUE(placed.ok()) << placed.status();
    PlacedTensor& draft = placed->items[0].draft_kv;
    // Never read in place, even where the devices could address the region.
    EXPECT_NE(draft.where, PlacedTensor::Where::kRegion);
    std::vector<uint8_t> block(placed->staging_bytes);
    std::vector<std::unique_ptr<uint8_t[]>> copies;
    ASSERT_TRUE(FillStagedInputs(g, InputsOf(*placed), block.data(), copies).ok());
    const uint8_t* read_by_devices =
        staged ? block.data() + draft.staging_offset : static_cast<const uint8_t*>(draft.host);
    EXPECT_NE(read_by_devices, memory_ + 4096);
    // The client writes an infinity after the check: the devices' copy keeps
    // the checked value.
    reinterpret_cast<Bf16*>(memory_ + 4096)[3] =
        FloatToBf16(std::numeric_limits<float>::infinity());
    EXPECT_EQ(Bf16ToFloat(reinterpret_cast<const Bf16*>(read_by_devices)[3]), 1.0f);
    reinterpret_cast<Bf16*>(memory_ + 4096)[3] = FloatToBf16(1.0f);
  }
  // A bf16 pool reads a pinned region in place.
  absl::StatusOr<PlacedVerify> placed = PlaceVerify(Geometry(true), *regions_, CallOf(items));
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_EQ(placed->items[0].draft_kv.where,
            pinned ? PlacedTensor::Where::kRegion : PlacedTensor::Where::kStaged);
}

TEST_P(RegionPlacementTest, AppendRowsArePlacedAndBounded) {
  AppendCall call;
  call.sequence_id = 5;
  call.tokens = 4;
  call.kv = Rows(0, 3 * 4, 1.0f);  // 3 layers x 4 tokens
  absl::StatusOr<PlacedAppend> placed = PlaceAppend(Geometry(true), *regions_, call);
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_EQ(placed->tokens, 4);
  EXPECT_EQ(placed->rows.bytes, size_t{3} * 4 * kLatentDim * 2);
  EXPECT_EQ(placed->admitted_bytes, static_cast<int64_t>(placed->rows.bytes));
  // T comes from the shape when there is one.
  const std::vector<int64_t> shape = {3, 4, kLatentDim};
  call.tokens = 0;
  call.kv.has_shape = true;
  call.kv.shape = shape;
  placed = PlaceAppend(Geometry(true), *regions_, call);
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_EQ(placed->tokens, 4);
  // More than the staging holds, when it must be staged (fp8 rows always are).
  PlacementGeometry small = Geometry(true, KvDtype::kFp8);
  small.staging_capacity = 1024;
  placed = PlaceAppend(small, *regions_, call);
  EXPECT_EQ(placed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(placed.status().message()),
              HasSubstr("append the prompt in smaller chunks"));
  const std::vector<int64_t> flat = {12, kLatentDim};
  call.kv.shape = flat;
  placed = PlaceAppend(Geometry(true), *regions_, call);
  EXPECT_THAT(std::string(placed.status().message()), HasSubstr("expected [3, T, 576]"));
}

INSTANTIATE_TEST_SUITE_P(Pinned, RegionPlacementTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "pinned" : "unpinned"; });

// ---- the reservation ----

class CallReservationTest : public ::testing::Test {
 protected:
  CallReservationTest()
      : gate_(2, 4096),
        memory_(static_cast<uint8_t*>(std::malloc(1 << 16))),
        staging_(memory_, 1 << 16, {reinterpret_cast<uint64_t>(memory_)},
                 [](uint8_t* m) { std::free(m); }) {
    pools_.push_back(std::make_unique<PageAllocator>(10));
    pools_.push_back(std::make_unique<PageAllocator>(4));
  }

  AdmissionGate gate_;
  uint8_t* memory_;
  HostStaging staging_;
  std::vector<std::unique_ptr<PageAllocator>> pools_;
};

TEST_F(CallReservationTest, WhatIsNotCommittedGoesBack) {
  {
    CallReservation r(gate_, pools_, &staging_);
    ASSERT_TRUE(r.Admit(1000).ok());
    ASSERT_TRUE(r.ReserveStaging(3000, "a test call").ok());
    ASSERT_TRUE(r.ReservePages(std::vector<int64_t>{3, 2}).ok());
    EXPECT_EQ(gate_.calls(), 1);
    EXPECT_EQ(gate_.bytes(), 1000);
    EXPECT_GE(staging_.in_use(), 3000u);
    EXPECT_EQ(pools_[0]->free_pages(), 7);
    EXPECT_EQ(pools_[1]->free_pages(), 2);
    EXPECT_EQ(r.pages(0).size(), 3u);
  }
  EXPECT_EQ(gate_.calls(), 0);
  EXPECT_EQ(gate_.bytes(), 0);
  EXPECT_EQ(staging_.in_use(), 0u);
  EXPECT_EQ(pools_[0]->free_pages(), 10);
  EXPECT_EQ(pools_[1]->free_pages(), 4);
}

TEST_F(CallReservationTest, PagesAreAllOrNoneAcrossPools) {
  CallReservation r(gate_, pools_, &staging_);
  const absl::Status pages = r.ReservePages(std::vector<int64_t>{3, 5});  // pool 1 holds 4
  EXPECT_EQ(pages.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pools_[0]->free_pages(), 10);  // pool 0's three went back at once
  EXPECT_TRUE(r.pages(0).empty());
}

TEST_F(CallReservationTest, ACommittedReservationBelongsToItsCall) {
  CallReservation::Held held;
  {
    CallReservation r(gate_, pools_, &staging_);
    ASSERT_TRUE(r.Admit(100).ok());
    ASSERT_TRUE(r.ReserveStaging(256, "a test call").ok());
    ASSERT_TRUE(r.ReservePages(std::vector<int64_t>{2, 0}).ok());
    held = r.Commit();
  }
  EXPECT_EQ(held.admitted_bytes, 100);
  EXPECT_EQ(held.pages[0].size(), 2u);
  EXPECT_TRUE(held.pages[1].empty());
  EXPECT_EQ(gate_.calls(), 1);
  EXPECT_EQ(pools_[0]->free_pages(), 8);
  EXPECT_GE(staging_.in_use(), 256u);
  // What the call gives back when it finished.
  gate_.Leave(held.admitted_bytes);
  staging_.Free(held.staging);
  pools_[0]->Free(held.pages[0]);
  EXPECT_EQ(gate_.calls(), 0);
  EXPECT_EQ(staging_.in_use(), 0u);
}

TEST_F(CallReservationTest, TheGateBoundsCallsAndBytes) {
  const absl::Status too_big = gate_.Enter(5000);
  EXPECT_EQ(too_big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_big.message()), HasSubstr("split it into smaller calls"));
  ASSERT_TRUE(gate_.Enter(3000).ok());
  const absl::Status bytes_full = gate_.Enter(2000);
  EXPECT_EQ(bytes_full.code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(gate_.Enter(1000).ok());
  const absl::Status calls_full = gate_.Enter(0);
  EXPECT_EQ(calls_full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(calls_full.message()), HasSubstr("--max-queued-calls"));
  EXPECT_EQ(gate_.calls(), 2);
  EXPECT_EQ(gate_.bytes(), 4000);
  gate_.Leave(3000);
  gate_.Leave(1000);
  EXPECT_EQ(gate_.calls(), 0);
  EXPECT_EQ(gate_.bytes(), 0);
}

}  // namespace
}  // namespace mlaverify::engine
