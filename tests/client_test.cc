// The client library's parts that need no server: wire conversions and the
// checks on what a server sends back, AppendKv chunking, exact percentiles,
// the random workloads, and the demo's reference check (against a float64
// brute force written independently here). Plus the client's own failures
// without a server: bad TLS setups and an unreachable target.
#include "client/client.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/arrivals.h"
#include "client/latency_stats.h"
#include "client/load.h"
#include "client/reference_check.h"
#include "client/replica_set.h"
#include "client/shared_memory.h"
#include "client/wire.h"
#include "common/draft_tree.h"
#include "common/workload.h"
#include "gtest/gtest.h"
#include "kernels/verify_attention.h"

namespace mlaverify::client {
namespace {

using mlaverify::kLatentDim;
using mlaverify::kValueDim;

// ---- FromGrpcStatus ---------------------------------------------------------

TEST(FromGrpcStatus, KeepsCodeAndMessage) {
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  const absl::Status s =
      FromGrpcStatus(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "need 9 pages, 3 free"));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "need 9 pages, 3 free");
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "")).code(),
            absl::StatusCode::kUnavailable);
}

// ---- AppendKv chunking ------------------------------------------------------

TEST(AppendChunks, PlanCoversEveryTokenOnceInOrder) {
  for (int64_t tokens : {1, 7, 64, 1000}) {
    for (int64_t max_chunk : {1, 3, 64, 5000}) {
      const std::vector<TokenRange> chunks = PlanAppendChunks(tokens, max_chunk);
      ASSERT_FALSE(chunks.empty());
      EXPECT_EQ(chunks.front().begin, 0);
      EXPECT_EQ(chunks.back().end, tokens);
      for (size_t c = 0; c < chunks.size(); ++c) {
        EXPECT_GE(chunks[c].size(), 1);
        EXPECT_LE(chunks[c].size(), max_chunk);
        if (c > 0) {
          EXPECT_EQ(chunks[c].begin, chunks[c - 1].end);
        }
      }
      EXPECT_EQ(static_cast<int64_t>(chunks.size()), (tokens + max_chunk - 1) / max_chunk);
    }
  }
  EXPECT_TRUE(PlanAppendChunks(0, 8).empty());
}

TEST(AppendChunks, ChunkIsTheLargestThatFitsTheHeadroom) {
  const int64_t limit = int64_t{4} << 20;  // gRPC's default
  for (int layers : {1, 4, 61}) {
    const int64_t tokens = MaxAppendChunkTokens(limit, layers);
    const int64_t bytes_per_token = int64_t{layers} * kLatentDim * 2;
    ASSERT_GE(tokens, 1);
    // The tensor bytes of a full chunk stay under 90% of the limit ...
    EXPECT_LE(tokens * bytes_per_token, static_cast<int64_t>(limit * kAppendKvHeadroom));
    // ... and one more token would not fit the budget.
    EXPECT_GT((tokens + 1) * bytes_per_token + 1024,
              static_cast<int64_t>(limit * kAppendKvHeadroom));
  }
  // 61 layers of one token are 70,272 bytes: a 64 KiB limit cannot carry it.
  EXPECT_EQ(MaxAppendChunkTokens(64 << 10, 61), 0);
  EXPECT_EQ(MaxAppendChunkTokens(0, 4), 0);
}

TEST(AppendChunks, ChunkGathersTheRangeFromEveryLayer) {
  const int layers = 3;
  const int64_t tokens = 10;
  std::vector<Bf16> kv(layers * tokens * kLatentDim);
  // Each row's values name its layer and token, so a misplaced row shows.
  for (int l = 0; l < layers; ++l) {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int d = 0; d < kLatentDim; ++d) {
        kv[(l * tokens + t) * kLatentDim + d] = Bf16{static_cast<uint16_t>(l * 100 + t)};
      }
    }
  }
  const TokenRange range{4, 7};
  const v1::AppendKvRequest request = BuildAppendKvChunk(42, 5, layers, tokens, kv, range);
  EXPECT_EQ(request.sequence_id(), 42u);
  EXPECT_EQ(request.start_position(), 5 + 4);
  EXPECT_EQ(request.kv().dtype(), v1::DTYPE_BF16);
  ASSERT_EQ(request.kv().shape_size(), 3);
  EXPECT_EQ(request.kv().shape(0), layers);
  EXPECT_EQ(request.kv().shape(1), 3);
  EXPECT_EQ(request.kv().shape(2), kLatentDim);
  ASSERT_EQ(request.kv().raw().size(), static_cast<size_t>(layers * 3 * kLatentDim * 2));
  std::vector<Bf16> chunk(layers * 3 * kLatentDim);
  std::memcpy(chunk.data(), request.kv().raw().data(), request.kv().raw().size());
  for (int l = 0; l < layers; ++l) {
    for (int t = 0; t < 3; ++t) {
      EXPECT_EQ(chunk[(l * 3 + t) * kLatentDim + kLatentDim - 1].bits, l * 100 + 4 + t)
          << "layer " << l << " row " << t;
    }
  }
}

// ---- Verify request / response ----------------------------------------------

struct ItemBuffers {
  std::vector<int32_t> parents;
  std::vector<Bf16> q;
  std::vector<Bf16> draft_kv;
  VerifyItemInput Input(uint64_t id) const { return {id, parents, q, draft_kv}; }
};

ItemBuffers MakeItem(int n, int heads) {
  ItemBuffers b;
  for (int i = 0; i < n; ++i) b.parents.push_back(i - 1);
  b.q.assign(static_cast<size_t>(n) * heads * kLatentDim, FloatToBf16(0.5f));
  b.draft_kv.assign(static_cast<size_t>(n) * kLatentDim, FloatToBf16(0.25f));
  return b;
}

// What a well-behaved server answers for `request`: zeros of the right shape.
v1::VerifyResponse AnswerFor(const v1::VerifyRequest& request) {
  v1::VerifyResponse response;
  response.set_request_id(request.request_id());
  response.set_layer(request.layer());
  for (const v1::VerifyItem& item : request.items()) {
    const int64_t n = item.q().shape(0);
    const int64_t heads = item.q().shape(1);
    v1::VerifyResult* result = response.add_results();
    result->set_sequence_id(item.sequence_id());
    result->set_prefix_len(11);
    result->mutable_out()->set_dtype(v1::DTYPE_BF16);
    for (int64_t d : {n, heads, int64_t{kValueDim}}) result->mutable_out()->add_shape(d);
    result->mutable_out()->set_raw(std::string(n * heads * kValueDim * 2, '\0'));
    result->mutable_lse()->set_dtype(v1::DTYPE_FP32);
    for (int64_t d : {n, heads}) result->mutable_lse()->add_shape(d);
    result->mutable_lse()->set_raw(std::string(n * heads * 4, '\0'));
  }
  return response;
}

TEST(VerifyWire, RequestCarriesShapesTreeAndScale) {
  const ItemBuffers a = MakeItem(3, 2);
  const ItemBuffers b = MakeItem(5, 2);
  const VerifyItemInput items[] = {a.Input(7), b.Input(9)};
  const absl::StatusOr<v1::VerifyRequest> request = BuildVerifyRequest(4, items, 0.125f, 77);
  ASSERT_TRUE(request.ok()) << request.status();
  EXPECT_EQ(request->layer(), 4);
  EXPECT_EQ(request->request_id(), 77u);
  EXPECT_FLOAT_EQ(request->softmax_scale(), 0.125f);
  ASSERT_EQ(request->items_size(), 2);
  const v1::VerifyItem& second = request->items(1);
  EXPECT_EQ(second.sequence_id(), 9u);
  EXPECT_EQ(std::vector<int32_t>(second.parents().begin(), second.parents().end()), b.parents);
  EXPECT_EQ(std::vector<int64_t>(second.q().shape().begin(), second.q().shape().end()),
            (std::vector<int64_t>{5, 2, kLatentDim}));
  EXPECT_EQ(second.q().raw().size(), b.q.size() * 2);
  EXPECT_EQ(
      std::vector<int64_t>(second.draft_kv().shape().begin(), second.draft_kv().shape().end()),
      (std::vector<int64_t>{5, kLatentDim}));
}

TEST(VerifyWire, RequestRejectsWhatCannotBeShaped) {
  EXPECT_EQ(BuildVerifyRequest(0, {}, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  ItemBuffers bad_q = MakeItem(3, 2);
  bad_q.q.pop_back();
  VerifyItemInput items[] = {bad_q.Input(1)};
  EXPECT_EQ(BuildVerifyRequest(0, items, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  ItemBuffers bad_kv = MakeItem(3, 2);
  bad_kv.draft_kv.resize(2 * kLatentDim);
  items[0] = bad_kv.Input(1);
  EXPECT_EQ(BuildVerifyRequest(0, items, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  ItemBuffers no_drafts = MakeItem(0, 2);
  items[0] = no_drafts.Input(1);
  EXPECT_EQ(BuildVerifyRequest(0, items, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(VerifyWire, WellFormedResponseUnpacks) {
  const ItemBuffers a = MakeItem(4, 3);
  const VerifyItemInput items[] = {a.Input(5)};
  const v1::VerifyResponse response = AnswerFor(*BuildVerifyRequest(0, items, 0, 1));
  const absl::StatusOr<std::vector<VerifyItemResult>> results =
      ParseVerifyResponse(items, response);
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(results->size(), 1u);
  EXPECT_EQ((*results)[0].sequence_id, 5u);
  EXPECT_EQ((*results)[0].num_drafts, 4);
  EXPECT_EQ((*results)[0].num_heads, 3);
  EXPECT_EQ((*results)[0].out.size(), 4u * 3 * kValueDim);
  EXPECT_EQ((*results)[0].lse.size(), 4u * 3);
  EXPECT_EQ((*results)[0].prefix_len, 11);
}

TEST(VerifyWire, MalformedResponsesAreInternalOrDataLoss) {
  const ItemBuffers a = MakeItem(2, 2);
  const ItemBuffers b = MakeItem(3, 2);
  const VerifyItemInput items[] = {a.Input(1), b.Input(2)};
  const v1::VerifyResponse good = AnswerFor(*BuildVerifyRequest(0, items, 0, 1));
  ASSERT_TRUE(ParseVerifyResponse(items, good).ok());

  v1::VerifyResponse r = good;
  r.mutable_results()->RemoveLast();
  EXPECT_EQ(ParseVerifyResponse(items, r).status().code(), absl::StatusCode::kInternal);

  r = good;
  r.mutable_results(1)->set_sequence_id(3);
  EXPECT_EQ(ParseVerifyResponse(items, r).status().code(), absl::StatusCode::kInternal);

  r = good;
  r.mutable_results(0)->mutable_out()->set_dtype(v1::DTYPE_FP32);
  EXPECT_EQ(ParseVerifyResponse(items, r).status().code(), absl::StatusCode::kInternal);

  r = good;
  r.mutable_results(1)->mutable_lse()->set_shape(1, 4);
  EXPECT_EQ(ParseVerifyResponse(items, r).status().code(), absl::StatusCode::kInternal);

  r = good;
  r.mutable_results(1)->mutable_out()->mutable_shared_memory()->set_region("x");
  EXPECT_EQ(ParseVerifyResponse(items, r).status().code(), absl::StatusCode::kInternal);

  r = good;
  r.mutable_results(0)->mutable_out()->mutable_raw()->pop_back();
  const absl::Status short_out = ParseVerifyResponse(items, r).status();
  EXPECT_EQ(short_out.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(short_out.message().find("item 0"), absl::string_view::npos) << short_out;

  r = good;
  r.mutable_results(1)->mutable_lse()->mutable_raw()->append("abcd");
  EXPECT_EQ(ParseVerifyResponse(items, r).status().code(), absl::StatusCode::kDataLoss);
}

// The shared-memory plane: the request carries references to the placement
// (its inputs copied in), the answer's references must be exactly the
// placement's, and the outputs are read from the region.
TEST(VerifyWire, SharedMemoryItemsTravelAsReferences) {
  const ItemBuffers a = MakeItem(3, 2);
  std::vector<uint8_t> region(ShmVerifyItemBytes(3, 2) + 512);
  const ShmItemPlacement place = PlaceVerifyItem("r", region.data(), 100, 3, 2);
  EXPECT_EQ(place.q_offset % 256, 0u);
  EXPECT_LE(place.end_offset, region.size());
  VerifyItemInput item = a.Input(5);
  item.shm = &place;
  const absl::StatusOr<v1::VerifyRequest> request = BuildVerifyRequest(0, {&item, 1}, 0, 1);
  ASSERT_TRUE(request.ok()) << request.status();
  const v1::VerifyItem& wire = request->items(0);
  EXPECT_TRUE(wire.q().raw().empty());
  EXPECT_EQ(wire.q().shared_memory().region(), "r");
  EXPECT_EQ(wire.q().shared_memory().offset(), place.q_offset);
  EXPECT_EQ(wire.q().shared_memory().byte_size(), a.q.size() * 2);
  EXPECT_EQ(wire.draft_kv().shared_memory().offset(), place.draft_kv_offset);
  EXPECT_EQ(wire.out_shared_memory().offset(), place.out_offset);
  EXPECT_EQ(wire.out_shared_memory().byte_size(), 3u * 2 * kValueDim * 2);
  EXPECT_EQ(wire.lse_shared_memory().offset(), place.lse_offset);
  EXPECT_EQ(std::memcmp(region.data() + place.q_offset, a.q.data(), a.q.size() * 2), 0);
  EXPECT_EQ(
      std::memcmp(region.data() + place.draft_kv_offset, a.draft_kv.data(), a.draft_kv.size() * 2),
      0);

  // The server's answer: references, the bytes in the region.
  v1::VerifyResponse answer = AnswerFor(*request);
  v1::VerifyResult* result = answer.mutable_results(0);
  *result->mutable_out()->mutable_shared_memory() = wire.out_shared_memory();
  *result->mutable_lse()->mutable_shared_memory() = wire.lse_shared_memory();
  const float lse_value = 3.5f;
  std::memcpy(region.data() + place.lse_offset, &lse_value, sizeof(float));
  const absl::StatusOr<std::vector<VerifyItemResult>> results =
      ParseVerifyResponse({&item, 1}, answer);
  ASSERT_TRUE(results.ok()) << results.status();
  EXPECT_EQ((*results)[0].lse[0], lse_value);

  v1::VerifyResponse elsewhere = answer;
  elsewhere.mutable_results(0)->mutable_out()->mutable_shared_memory()->set_offset(0);
  EXPECT_EQ(ParseVerifyResponse({&item, 1}, elsewhere).status().code(),
            absl::StatusCode::kInternal);
  const v1::VerifyResponse inline_answer = AnswerFor(*request);
  EXPECT_EQ(ParseVerifyResponse({&item, 1}, inline_answer).status().code(),
            absl::StatusCode::kInternal);
}

// ---- Percentiles ------------------------------------------------------------

// Shared-memory names carry 64 random bits after the pid and a counter, so
// another local user cannot create a scheduler's next name before it does.
TEST(SharedMemoryBuffer, NamesAreUnpredictable) {
  std::vector<std::string> keys;
  for (int i = 0; i < 2; ++i) {
    auto shm = client::SharedMemoryBuffer::Create(4096);
    ASSERT_TRUE(shm.ok()) << shm.status();
    keys.push_back((*shm)->key());
  }
  const std::string prefix = absl::StrCat("/mlaverify-", getpid(), "-");
  for (const std::string& key : keys) {
    ASSERT_TRUE(absl::StartsWith(key, prefix)) << key;
    const size_t dash = key.rfind('-');
    const std::string nonce = key.substr(dash + 1);
    EXPECT_EQ(nonce.size(), 16u) << key;
    EXPECT_EQ(nonce.find_first_not_of("0123456789abcdef"), std::string::npos) << key;
  }
  EXPECT_NE(keys[0].substr(keys[0].rfind('-')), keys[1].substr(keys[1].rfind('-')));
}

TEST(LatencyStats, NearestRankPercentiles) {
  std::vector<double> samples;
  for (int i = 1000; i >= 1; --i) samples.push_back(i);  // unsorted on purpose
  const LatencySummary s = Summarize(samples);
  EXPECT_EQ(s.count, 1000);
  EXPECT_DOUBLE_EQ(s.p50, 500);
  EXPECT_DOUBLE_EQ(s.p90, 900);
  EXPECT_DOUBLE_EQ(s.p99, 990);
  EXPECT_DOUBLE_EQ(s.p999, 999);
  EXPECT_DOUBLE_EQ(s.max, 1000);
  EXPECT_DOUBLE_EQ(s.mean, 500.5);

  const std::vector<double> ten = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  EXPECT_DOUBLE_EQ(Percentile(ten, 50), 5);
  EXPECT_DOUBLE_EQ(Percentile(ten, 51), 6);
  EXPECT_DOUBLE_EQ(Percentile(ten, 99.9), 10);
  EXPECT_DOUBLE_EQ(Percentile(ten, 0), 1);
  EXPECT_DOUBLE_EQ(Percentile(ten, 100), 10);
  const std::vector<double> one = {3.5};
  EXPECT_DOUBLE_EQ(Percentile(one, 99.9), 3.5);
  EXPECT_EQ(Summarize({}).count, 0);
}

TEST(LatencyStats, P95AndChosenPercentiles) {
  std::vector<double> samples;
  for (int i = 1; i <= 1000; ++i) samples.push_back(i);
  const std::vector<double> chosen = {99.5, 12.5};
  const LatencySummary s = Summarize(samples, chosen);
  EXPECT_DOUBLE_EQ(s.p95, 950);
  ASSERT_EQ(s.chosen.size(), 2u);
  EXPECT_EQ(s.chosen[0].first, 99.5);
  EXPECT_DOUBLE_EQ(s.chosen[0].second, 995);
  EXPECT_DOUBLE_EQ(s.chosen[1].second, 125);
  // With no samples the asked percentiles are still named (as 0).
  EXPECT_EQ(Summarize({}, chosen).chosen.size(), 2u);
}

TEST(LatencyStats, HistogramHoldsEverySampleInItsBucket) {
  std::mt19937_64 rng(7);
  std::lognormal_distribution<double> latency(0.0, 1.5);  // ms, around 1 ms
  std::vector<double> samples;
  for (int i = 0; i < 5000; ++i) samples.push_back(latency(rng));
  samples.push_back(1.0);  // an exact bound stays in its own bucket
  samples.push_back(2.0);
  const LatencySummary s = Summarize(samples);
  std::sort(samples.begin(), samples.end());
  int64_t total = 0;
  double lower = 0;
  for (const HistogramBucket& b : s.histogram) {
    ASSERT_GT(b.count, 0);
    ASSERT_GT(b.upper, lower);
    // Bounds are 2^(k/4): four per doubling.
    const double k = 4 * std::log2(b.upper);
    EXPECT_NEAR(k, std::round(k), 1e-9);
    // Exactly the samples in (lower, upper].
    const auto from = std::upper_bound(samples.begin(), samples.end(), lower);
    const auto to = std::upper_bound(samples.begin(), samples.end(), b.upper);
    EXPECT_EQ(to - from, b.count) << "bucket up to " << b.upper;
    total += b.count;
    lower = b.upper;
  }
  EXPECT_EQ(total, static_cast<int64_t>(samples.size()));
  EXPECT_GE(s.histogram.back().upper, s.max);
  EXPECT_LT(s.histogram.back().upper, s.max * 1.19);
  EXPECT_TRUE(Summarize({}).histogram.empty());
}

// ---- Open-loop arrivals and load ranges ------------------------------------------

TEST(Arrivals, ConstantSlotsAreEvenlySpaced) {
  ArrivalSchedule s(ArrivalProcess::kConstant, 200.0, 8, 1);
  for (int i = 0; i < 1000; ++i) ASSERT_DOUBLE_EQ(s.Next(), i / 200.0) << i;
}

TEST(Arrivals, BurstsShareTheirStartAndKeepTheRate) {
  ArrivalSchedule s(ArrivalProcess::kBurst, 100.0, 4, 1);
  for (int burst = 0; burst < 50; ++burst) {
    for (int k = 0; k < 4; ++k) ASSERT_DOUBLE_EQ(s.Next(), burst * 4 / 100.0);
  }
}

TEST(Arrivals, PoissonGapsAreExponentialOfTheMeanRate) {
  const double rate = 1000.0;
  ArrivalSchedule s(ArrivalProcess::kPoisson, rate, 1, 7);
  constexpr int kCalls = 200000;
  double last = s.Next(), sum = 0, sum_sq = 0;
  EXPECT_EQ(last, 0.0);
  int short_gaps = 0;
  for (int i = 1; i < kCalls; ++i) {
    const double t = s.Next();
    const double gap = t - last;
    ASSERT_GE(gap, 0.0);
    sum += gap;
    sum_sq += gap * gap;
    // P(gap < mean / 10) = 1 - e^-0.1 = 9.5 % for an exponential; 0 for
    // constant spacing.
    short_gaps += gap < 0.1 / rate;
    last = t;
  }
  const double mean = sum / (kCalls - 1);
  const double sd = std::sqrt(sum_sq / (kCalls - 1) - mean * mean);
  EXPECT_NEAR(mean * rate, 1.0, 0.01);  // the asked rate, within 1 %
  EXPECT_NEAR(sd / mean, 1.0, 0.02);    // an exponential's coefficient of variation is 1
  EXPECT_NEAR(short_gaps / double(kCalls - 1), 1 - std::exp(-0.1), 0.005);
  // Seeded: the same schedule again.
  ArrivalSchedule again(ArrivalProcess::kPoisson, rate, 1, 7),
      other(ArrivalProcess::kPoisson, rate, 1, 8);
  ArrivalSchedule first(ArrivalProcess::kPoisson, rate, 1, 7);
  for (int i = 0; i < 10; ++i) ASSERT_EQ(again.Next(), first.Next());
  other.Next();
  first.Next();
  EXPECT_NE(other.Next(), first.Next());
}

TEST(Arrivals, NamesParseAndUnknownOnesAreRefused) {
  EXPECT_EQ(*ParseArrivalProcess("poisson"), ArrivalProcess::kPoisson);
  EXPECT_EQ(ArrivalProcessName(*ParseArrivalProcess("burst")), "burst");
  const absl::StatusOr<ArrivalProcess> bad = ParseArrivalProcess("gamma");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "constant, poisson or burst"));
}

TEST(LoadRanges, ValueOrRangeParses) {
  int64_t low = -1, high = -1;
  ASSERT_TRUE(ParseValueOrRange("--drafts", "16", &low, &high).ok());
  EXPECT_EQ(low, 16);
  EXPECT_EQ(high, 0);
  ASSERT_TRUE(ParseValueOrRange("--prompt-len", "512:4096", &low, &high).ok());
  EXPECT_EQ(low, 512);
  EXPECT_EQ(high, 4096);
  ASSERT_TRUE(ParseValueOrRange("--drafts", "4:4", &low, &high).ok());
  EXPECT_EQ(high, 4);
  for (const char* bad : {"", "x", "4:", ":4", "8:4", "-1", "1:2:3", "3.5"}) {
    const absl::Status s = ParseValueOrRange("--drafts", bad, &low, &high);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(s.message(), "--drafts")) << s;
  }
}

// ---- Workloads ----------------------------------------------------------------

TEST(Workload, RandomTreesAreValidForests) {
  std::mt19937_64 rng(3);
  bool saw_chain_link = false, saw_branch = false, saw_second_root = false;
  for (int trial = 0; trial < 500; ++trial) {
    const int n = 1 + trial % mlaverify::kMaxDraftLen;
    const std::vector<int32_t> parents = RandomDraftTree(rng, n);
    ASSERT_EQ(static_cast<int>(parents.size()), n);
    ASSERT_TRUE(mlaverify::ValidateDraftTree(parents).ok()) << "trial " << trial;
    EXPECT_EQ(parents[0], -1);
    std::vector<int> children(n, 0);
    for (int i = 1; i < n; ++i) {
      saw_chain_link |= parents[i] == i - 1;
      saw_second_root |= parents[i] == -1;
      if (parents[i] >= 0 && ++children[parents[i]] == 2) saw_branch = true;
    }
  }
  EXPECT_TRUE(saw_chain_link);
  EXPECT_TRUE(saw_branch);
  EXPECT_TRUE(saw_second_root);
}

TEST(Workload, AcceptedPathsAreRootToNodePaths) {
  std::mt19937_64 rng(5);
  int empty = 0, longest = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const std::vector<int32_t> parents = RandomDraftTree(rng, 1 + trial % 16);
    const std::vector<int32_t> path = RandomAcceptedPath(rng, parents);
    ASSERT_TRUE(mlaverify::ValidateAcceptedPath(parents, path).ok()) << "trial " << trial;
    const std::vector<int> depth = NodeDepths(parents);
    empty += path.empty();
    longest += static_cast<int>(path.size()) == *std::max_element(depth.begin(), depth.end());
  }
  EXPECT_GT(empty, 50);     // about a quarter
  EXPECT_GT(longest, 100);  // a quarter, plus random nodes that happen to be deepest
  EXPECT_EQ(PathToNode({-1, 0, 0, 2, -1}, 3), (std::vector<int32_t>{0, 2, 3}));
  EXPECT_EQ(NodeDepths({-1, 0, 0, 2, -1}), (std::vector<int>{1, 2, 2, 3, 1}));
}

// ---- Reference check ----------------------------------------------------------

// float64 brute force of the verify math over explicit key rows (prefix, then
// drafts); independent of kernels/.
void BruteForce(const std::vector<Bf16>& keys, int64_t prefix, const std::vector<int32_t>& parents,
                const std::vector<Bf16>& q, int heads, float scale, std::vector<double>* out,
                std::vector<double>* lse) {
  const int n = static_cast<int>(parents.size());
  out->assign(static_cast<size_t>(n) * heads * kValueDim, 0.0);
  lse->assign(static_cast<size_t>(n) * heads, 0.0);
  for (int i = 0; i < n; ++i) {
    std::vector<int64_t> visible;
    for (int64_t j = 0; j < prefix; ++j) visible.push_back(j);
    for (int a = i; a >= 0; a = parents[a]) visible.push_back(prefix + a);
    for (int h = 0; h < heads; ++h) {
      const Bf16* qrow = q.data() + (static_cast<size_t>(i) * heads + h) * kLatentDim;
      std::vector<double> s;
      double m = -INFINITY;
      for (int64_t j : visible) {
        double dot = 0;
        for (int d = 0; d < kLatentDim; ++d) {
          dot += static_cast<double>(Bf16ToFloat(qrow[d])) * Bf16ToFloat(keys[j * kLatentDim + d]);
        }
        s.push_back(scale * dot);
        m = std::max(m, s.back());
      }
      double sum = 0;
      for (double& v : s) sum += (v = std::exp(v - m));
      double* o = out->data() + (static_cast<size_t>(i) * heads + h) * kValueDim;
      for (size_t k = 0; k < visible.size(); ++k) {
        for (int d = 0; d < kValueDim; ++d) {
          o[d] += s[k] / sum * Bf16ToFloat(keys[visible[k] * kLatentDim + d]);
        }
      }
      (*lse)[static_cast<size_t>(i) * heads + h] = m + std::log(sum);
    }
  }
}

// A server-like answer: the brute force rounded as the server sends it.
VerifyItemResult AsServerResult(uint64_t id, int n, int heads, int64_t prefix,
                                const std::vector<double>& out, const std::vector<double>& lse) {
  VerifyItemResult r;
  r.sequence_id = id;
  r.num_drafts = n;
  r.num_heads = heads;
  r.prefix_len = prefix;
  for (double v : out) r.out.push_back(FloatToBf16(static_cast<float>(v)));
  for (double v : lse) r.lse.push_back(static_cast<float>(v));
  return r;
}

class ReferenceCheckTest : public ::testing::Test {
 protected:
  static constexpr int kLayers = 2;
  static constexpr int kHeads = 3;
  static constexpr int64_t kPrompt = 37;
  static constexpr float kScale = 0.0721688f;  // 1/sqrt(192)

  // Builds a mirror that went through a prompt and one committed step, and
  // the same layer-1 rows written out by hand, for the brute force.
  void SetUp() override {
    std::mt19937_64 rng(11);
    std::vector<Bf16> prompt(kLayers * kPrompt * kLatentDim);
    FillUniformBf16(rng, -1, 1, absl::MakeSpan(prompt));
    mirror_.AppendPrompt(prompt, kPrompt);
    std::vector<std::vector<Bf16>> step_kv(kLayers, std::vector<Bf16>(6 * kLatentDim));
    for (auto& layer_kv : step_kv) FillUniformBf16(rng, -1, 1, absl::MakeSpan(layer_kv));
    const std::vector<int32_t> accepted = {1, 4};  // a path of tree {-1,-1,0,0,1,4}
    mirror_.AppendAccepted(step_kv, accepted);

    keys_.assign(prompt.begin() + kPrompt * kLatentDim, prompt.begin() + 2 * kPrompt * kLatentDim);
    for (int32_t a : accepted) {
      keys_.insert(keys_.end(), step_kv[1].begin() + a * kLatentDim,
                   step_kv[1].begin() + (a + 1) * kLatentDim);
    }
    parents_ = {-1, 0, 0, 1, -1};
    q_.resize(parents_.size() * kHeads * kLatentDim);
    FillUniformBf16(rng, -2, 2, absl::MakeSpan(q_));
    draft_kv_.resize(parents_.size() * kLatentDim);
    FillUniformBf16(rng, -1, 1, absl::MakeSpan(draft_kv_));
    keys_.insert(keys_.end(), draft_kv_.begin(), draft_kv_.end());
  }

  VerifyItemInput Item() const { return {7, parents_, q_, draft_kv_}; }

  SequenceMirror mirror_{kLayers};
  std::vector<Bf16> keys_;  // layer 1: prompt, accepted drafts, new drafts
  std::vector<int32_t> parents_;
  std::vector<Bf16> q_;
  std::vector<Bf16> draft_kv_;
};

TEST_F(ReferenceCheckTest, MirrorFollowsAppendAndCommit) {
  EXPECT_EQ(mirror_.length(), kPrompt + 2);
  const absl::Span<const Bf16> rows = mirror_.layer_rows(1);
  ASSERT_EQ(rows.size(), static_cast<size_t>((kPrompt + 2) * kLatentDim));
  EXPECT_TRUE(std::equal(rows.begin(), rows.end(), keys_.begin(),
                         [](Bf16 a, Bf16 b) { return a.bits == b.bits; }));
}

TEST_F(ReferenceCheckTest, CorrectAnswerPasses) {
  std::vector<double> out, lse;
  BruteForce(keys_, mirror_.length(), parents_, q_, kHeads, kScale, &out, &lse);
  const VerifyItemResult result =
      AsServerResult(7, parents_.size(), kHeads, mirror_.length(), out, lse);
  const absl::StatusOr<ReferenceComparison> c =
      CompareWithReference(mirror_, 1, Item(), kScale, result);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_LT(c->rel_err, 5e-3);  // bf16 rounding of the output
  EXPECT_LT(c->lse_max_abs_err, 1e-4);
  EXPECT_EQ(c->non_finite, 0);
  EXPECT_TRUE(c->ok(1e-2, 1e-2));
}

TEST_F(ReferenceCheckTest, WrongMaskFails) {
  // The answer of a server that ignored the tree and used a causal chain.
  std::vector<double> out, lse;
  BruteForce(keys_, mirror_.length(), {-1, 0, 1, 2, 3}, q_, kHeads, kScale, &out, &lse);
  const absl::StatusOr<ReferenceComparison> c =
      CompareWithReference(mirror_, 1, Item(), kScale,
                           AsServerResult(7, parents_.size(), kHeads, mirror_.length(), out, lse));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->ok(1e-2, 1e-2)) << "rel err " << c->rel_err << " lse " << c->lse_max_abs_err;
}

TEST_F(ReferenceCheckTest, WrongLayerFails) {
  std::vector<double> out, lse;
  BruteForce(keys_, mirror_.length(), parents_, q_, kHeads, kScale, &out, &lse);
  const absl::StatusOr<ReferenceComparison> c =
      CompareWithReference(mirror_, 0, Item(), kScale,
                           AsServerResult(7, parents_.size(), kHeads, mirror_.length(), out, lse));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_GT(c->rel_err, 0.1);
}

TEST_F(ReferenceCheckTest, NaNNeverPasses) {
  std::vector<double> out, lse;
  BruteForce(keys_, mirror_.length(), parents_, q_, kHeads, kScale, &out, &lse);
  VerifyItemResult result = AsServerResult(7, parents_.size(), kHeads, mirror_.length(), out, lse);
  result.lse[3] = NAN;
  absl::StatusOr<ReferenceComparison> c = CompareWithReference(mirror_, 1, Item(), kScale, result);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->non_finite, 1);
  EXPECT_TRUE(std::isnan(c->lse_max_abs_err));
  EXPECT_FALSE(c->ok(1e-2, 1e9));

  result = AsServerResult(7, parents_.size(), kHeads, mirror_.length(), out, lse);
  result.out[100] = Bf16QuietNaN();
  c = CompareWithReference(mirror_, 1, Item(), kScale, result);
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(std::isnan(c->rel_err));
  EXPECT_FALSE(c->ok(1e9, 1e9));
}

TEST_F(ReferenceCheckTest, PrefixDisagreementIsReported) {
  std::vector<double> out, lse;
  BruteForce(keys_, mirror_.length(), parents_, q_, kHeads, kScale, &out, &lse);
  const absl::StatusOr<ReferenceComparison> c = CompareWithReference(
      mirror_, 1, Item(), kScale,
      AsServerResult(7, parents_.size(), kHeads, mirror_.length() + 1, out, lse));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
}

// ---- VerifyClient without a server --------------------------------------------

TEST(VerifyClient, RejectsInconsistentTls) {
  ClientOptions options;
  options.tls_cert_chain_file = "/dev/null";  // certificate without a key
  EXPECT_EQ(VerifyClient::Create("127.0.0.1:1", options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = ClientOptions();
  options.tls_root_ca_file = "/nonexistent/ca.pem";
  EXPECT_EQ(VerifyClient::Create("127.0.0.1:1", options).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(VerifyClient::Create("", ClientOptions()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(VerifyClient, UnreachableServerIsUnavailable) {
  ClientOptions options;
  options.call_timeout = absl::Seconds(5);
  // Port 1 on loopback: nothing listens, the connection is refused at once.
  absl::StatusOr<std::unique_ptr<VerifyClient>> client =
      VerifyClient::Create("127.0.0.1:1", options);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->GetServerInfo().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ((*client)->Health().status().code(), absl::StatusCode::kUnavailable);
  // AppendKv needs the server's message limit first, so it fails the same way.
  const std::vector<Bf16> kv(kLatentDim);
  EXPECT_EQ((*client)->AppendKv(1, 0, 1, 1, kv).status().code(), absl::StatusCode::kUnavailable);
  // A malformed request fails locally, before any connection.
  EXPECT_EQ((*client)->AppendKv(1, 0, 1, 2, kv).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<VerifyStreamSession>> stream = (*client)->OpenVerifyStream();
  ASSERT_TRUE(stream.ok());
  const ItemBuffers item = MakeItem(2, 1);
  const VerifyItemInput items[] = {item.Input(1)};
  EXPECT_EQ((*stream)->Verify(0, items).status().code(), absl::StatusCode::kUnavailable);
  // The broken stream keeps reporting why it broke.
  EXPECT_EQ((*stream)->Verify(0, items).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace mlaverify::client

namespace mlaverify::client {
namespace {

TEST(ReplicaSet, RejectsNoTargetsAndRepeatedOnes) {
  EXPECT_EQ(ReplicaSet::Create({}, ClientOptions{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReplicaSet::Create({"127.0.0.1:1", "127.0.0.1:1"}, ClientOptions{}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ReplicaSet, UnavailableMarksAReplicaDownAndItsCallsFailAtOnceNamingIt) {
  ClientOptions options;
  options.call_timeout = absl::Seconds(5);
  absl::StatusOr<std::unique_ptr<ReplicaSet>> set =
      ReplicaSet::Create({"127.0.0.1:1", "127.0.0.1:2"}, options, absl::Hours(1));
  ASSERT_TRUE(set.ok()) << set.status();
  ReplicaSet& replicas = **set;
  EXPECT_TRUE(replicas.CheckUp(1).ok());
  // Another code leaves it up; UNAVAILABLE marks it down.
  EXPECT_TRUE(absl::StrContains(replicas.Observe(1, absl::NotFoundError("x")).message(),
                                "replica 1 (127.0.0.1:2): x"));
  EXPECT_TRUE(replicas.CheckUp(1).ok());
  replicas.Observe(1, absl::UnavailableError("connection refused")).IgnoreError();
  const absl::Status down = replicas.CheckUp(1);
  EXPECT_EQ(down.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(down.message(), "replica 1 (127.0.0.1:2) is down"))
      << down.message();
  const std::vector<int32_t> path;
  EXPECT_EQ(replicas.Commit(PlacedSequence{1, 7}, path).status().code(),
            absl::StatusCode::kUnavailable);
  // Nothing listens on either port: no replica takes a sequence, and the
  // error names both.
  absl::StatusOr<PlacedSequence> placed = replicas.CreateSequence("x");
  EXPECT_EQ(placed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(placed.status().message(), "replica 0 (127.0.0.1:1)"))
      << placed.status().message();
  EXPECT_FALSE(replicas.States()[0].up);
}

}  // namespace
}  // namespace mlaverify::client
