// Metrics text output and the admin HTTP endpoints, over real loopback
// sockets (ephemeral ports, so suites can run in parallel).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "server/admin/admin_http_server.h"
#include "server/admin/metrics.h"
#include "server/engine/engine.h"

namespace mlaverify::admin {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::Optional;

// The value of the sample whose name and labels are exactly `series` (labels
// as prometheus-cpp prints them: sorted by name), or nullopt if absent.
std::optional<double> SampleValue(const std::string& text, const std::string& series) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.size() > series.size() && line.compare(0, series.size(), series) == 0 &&
        line[series.size()] == ' ') {
      return std::stod(line.substr(series.size() + 1));
    }
  }
  return std::nullopt;
}

// A stats source the test mutates between scrapes.
class FakeStats {
 public:
  engine::EngineStats Get() {
    absl::MutexLock lock(&mu_);
    return stats_;
  }
  void Set(const engine::EngineStats& stats) {
    absl::MutexLock lock(&mu_);
    stats_ = stats;
  }

 private:
  absl::Mutex mu_;
  engine::EngineStats stats_;
};

engine::EngineStats PoolStats() {
  engine::EngineStats s;
  s.total_pages = 10;
  s.free_pages = 7;
  s.live_sequences = 2;
  s.pending_steps = 1;
  return s;
}

TEST(MetricsTest, RecordRpcCountsRequestsErrorsAndLatency) {
  Metrics metrics;
  metrics.RecordRpc("Verify", "OK", 2e-4);
  metrics.RecordRpc("Verify", "OK", 3e-3);
  metrics.RecordRpc("Verify", "INVALID_ARGUMENT", 4e-5);
  metrics.RecordRpc("Commit", "NOT_FOUND", 0.2);
  const std::string text = metrics.Serialize();

  EXPECT_THAT(SampleValue(text, R"(mlaverify_requests_total{code="OK",rpc="Verify"})"),
              Optional(2.0));
  EXPECT_THAT(
      SampleValue(text, R"(mlaverify_requests_total{code="INVALID_ARGUMENT",rpc="Verify"})"),
      Optional(1.0));
  EXPECT_THAT(SampleValue(text, R"(mlaverify_requests_total{code="NOT_FOUND",rpc="Commit"})"),
              Optional(1.0));
  // Errors carry only the non-OK codes.
  EXPECT_THAT(
      SampleValue(text, R"(mlaverify_request_errors_total{code="INVALID_ARGUMENT",rpc="Verify"})"),
      Optional(1.0));
  EXPECT_THAT(SampleValue(text, R"(mlaverify_request_errors_total{code="NOT_FOUND",rpc="Commit"})"),
              Optional(1.0));
  EXPECT_THAT(text, Not(HasSubstr(R"(mlaverify_request_errors_total{code="OK")")));

  // One histogram per rpc, whatever the code; buckets are cumulative.
  EXPECT_THAT(SampleValue(text, R"(mlaverify_request_duration_seconds_count{rpc="Verify"})"),
              Optional(3.0));
  EXPECT_THAT(
      SampleValue(text, R"(mlaverify_request_duration_seconds_bucket{rpc="Verify",le="5e-05"})"),
      Optional(1.0));
  EXPECT_THAT(
      SampleValue(text, R"(mlaverify_request_duration_seconds_bucket{rpc="Verify",le="0.0002"})"),
      Optional(2.0));
  EXPECT_THAT(
      SampleValue(text, R"(mlaverify_request_duration_seconds_bucket{rpc="Verify",le="0.002"})"),
      Optional(2.0));
  EXPECT_THAT(
      SampleValue(text, R"(mlaverify_request_duration_seconds_bucket{rpc="Verify",le="0.003"})"),
      Optional(3.0));
  EXPECT_THAT(
      SampleValue(text, R"(mlaverify_request_duration_seconds_bucket{rpc="Verify",le="10"})"),
      Optional(3.0));
  EXPECT_THAT(SampleValue(text, R"(mlaverify_request_duration_seconds_count{rpc="Commit"})"),
              Optional(1.0));
  EXPECT_THAT(
      SampleValue(text, R"(mlaverify_request_duration_seconds_bucket{rpc="Commit",le="0.1"})"),
      Optional(0.0));
  EXPECT_THAT(
      SampleValue(text, R"(mlaverify_request_duration_seconds_bucket{rpc="Commit",le="0.2"})"),
      Optional(1.0));
}

// The request-duration buckets: 10 µs .. 10 s, four a decade, each bound
// printed as its decimal (no 0.5600000000000001).
TEST(MetricsTest, RequestDurationBucketsAreFourADecadeFrom10usTo10s) {
  Metrics metrics;
  metrics.RecordRpc("Verify", "OK", 1e-3);
  const std::string text = metrics.Serialize();
  const std::string prefix = R"(mlaverify_request_duration_seconds_bucket{rpc="Verify",le=")";
  std::vector<std::string> bounds;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.compare(0, prefix.size(), prefix) == 0) {
      bounds.push_back(line.substr(prefix.size(), line.find('"', prefix.size()) - prefix.size()));
    }
  }
  const std::vector<std::string> want = {
      "1e-05", "2e-05", "3e-05", "5e-05", "0.0001", "0.0002", "0.0003", "0.0005", "0.001",
      "0.002", "0.003", "0.005", "0.01",  "0.02",   "0.03",   "0.05",   "0.1",    "0.2",
      "0.3",   "0.5",   "1",     "2",     "3",      "5",      "10",     "+Inf"};
  EXPECT_EQ(bounds, want);
}

// The process_* series are there and plausible: this process has memory, file
// descriptors (stdin/stdout/stderr at least), a limit on them and a start
// time within the last hour; CPU time grows with work.
TEST(MetricsTest, ProcessMetricsArePresentAndPlausible) {
  Metrics metrics;
  const std::string before = metrics.Serialize();
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  const std::optional<double> rss = SampleValue(before, "process_resident_memory_bytes");
  const std::optional<double> vsz = SampleValue(before, "process_virtual_memory_bytes");
  const std::optional<double> fds = SampleValue(before, "process_open_fds");
  const std::optional<double> max_fds = SampleValue(before, "process_max_fds");
  const std::optional<double> start = SampleValue(before, "process_start_time_seconds");
  const std::optional<double> cpu = SampleValue(before, "process_cpu_seconds_total");
  ASSERT_TRUE(rss && vsz && fds && max_fds && start && cpu) << before;
  EXPECT_GT(*rss, 1 << 20);
  EXPECT_GE(*vsz, *rss);
  EXPECT_GE(*fds, 3);
  EXPECT_TRUE(*max_fds == -1 || *max_fds >= *fds) << *max_fds;
  EXPECT_LE(*start, now + 1);
  EXPECT_GT(*start, now - 3600);
  EXPECT_THAT(before, HasSubstr("# TYPE process_cpu_seconds_total counter"));
  EXPECT_THAT(before, HasSubstr("# TYPE process_resident_memory_bytes gauge"));

  // Burn 0.3 s of CPU (std::clock, whatever the machine's load); the counter
  // follows (it counts 10 ms clock ticks).
  volatile double sink = 0;
  const std::clock_t cpu_start = std::clock();
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (std::clock() - cpu_start < CLOCKS_PER_SEC * 3 / 10 && absl::Now() < give_up) {
    for (int k = 0; k < 10000; ++k) sink = sink + k;
  }
  const std::optional<double> cpu_after =
      SampleValue(metrics.Serialize(), "process_cpu_seconds_total");
  ASSERT_TRUE(cpu_after.has_value());
  EXPECT_GE(*cpu_after, *cpu + 0.2);

  // A descriptor opened shows in the count.
  FILE* file = std::fopen("/proc/self/stat", "r");
  ASSERT_NE(file, nullptr);
  EXPECT_THAT(SampleValue(metrics.Serialize(), "process_open_fds"), Optional(*fds + 1));
  std::fclose(file);
}

TEST(MetricsTest, RecordRpcIsThreadSafe) {
  Metrics metrics;
  constexpr int kThreads = 4;
  constexpr int kCallsPerThread = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&metrics, t] {
      for (int i = 0; i < kCallsPerThread; ++i) {
        // Half the threads race to create the same new series.
        metrics.RecordRpc("Verify", t % 2 == 0 ? "OK" : "RESOURCE_EXHAUSTED", 1e-4);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  const std::string text = metrics.Serialize();
  EXPECT_THAT(SampleValue(text, R"(mlaverify_requests_total{code="OK",rpc="Verify"})"),
              Optional(double{kThreads / 2 * kCallsPerThread}));
  EXPECT_THAT(
      SampleValue(text,
                  R"(mlaverify_request_errors_total{code="RESOURCE_EXHAUSTED",rpc="Verify"})"),
      Optional(double{kThreads / 2 * kCallsPerThread}));
  EXPECT_THAT(SampleValue(text, R"(mlaverify_request_duration_seconds_count{rpc="Verify"})"),
              Optional(double{kThreads * kCallsPerThread}));
}

TEST(MetricsTest, RecordBatchCountsPathsBucketsRowsAndDeviceTime) {
  Metrics metrics;
  engine::BatchReport eager;
  eager.requests = 3;
  eager.rows = 12;
  eager.shape = {3, 4};
  eager.device_seconds = 2e-5;
  metrics.RecordBatch(eager, "cpu");
  engine::BatchReport graph;
  graph.requests = 5;
  graph.rows = 40;
  graph.shape = {8, 16};
  graph.graph = true;
  graph.reused_plan = true;
  graph.device_seconds = 4e-5;
  metrics.RecordBatch(graph, "cuda:0");
  metrics.RecordBatch(graph, "cuda:0");
  const std::string text = metrics.Serialize();
  EXPECT_THAT(SampleValue(text, R"(mlaverify_verify_batches_total{path="eager"})"), Optional(1.0));
  EXPECT_THAT(SampleValue(text, R"(mlaverify_verify_batches_total{path="graph"})"), Optional(2.0));
  EXPECT_THAT(
      SampleValue(text,
                  R"(mlaverify_verify_graph_bucket_total{batch_bucket="8",draft_bucket="16"})"),
      Optional(2.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_verify_rows_total"), Optional(92.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_verify_padded_rows_total"), Optional(2.0 * (128 - 40)));
  EXPECT_THAT(SampleValue(text, "mlaverify_verify_plan_reused_total"), Optional(2.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_verify_batch_requests_count"), Optional(3.0));
  EXPECT_THAT(SampleValue(text, R"(mlaverify_verify_batch_requests_bucket{le="4"})"),
              Optional(1.0));
  EXPECT_THAT(SampleValue(text, R"(mlaverify_device_batch_seconds_count{device="cuda:0"})"),
              Optional(2.0));
  EXPECT_THAT(
      SampleValue(text, R"(mlaverify_device_batch_seconds_bucket{device="cpu",le="2e-05"})"),
      Optional(1.0));
}

TEST(MetricsTest, VerifyTimingSplitsQueueDeviceAndTheRest) {
  Metrics metrics;
  engine::VerifyTiming t;
  t.queue_seconds = 1e-5;
  t.device_seconds = 3e-5;
  t.total_seconds = 6e-5;
  metrics.RecordVerifyTiming(t);
  metrics.RecordDeviceFault("cuda:1");
  metrics.RecordOversizedRequest("VerifyStream");
  metrics.RecordOversizedRequest("VerifyStream");
  const std::string text = metrics.Serialize();
  EXPECT_THAT(
      SampleValue(text, R"(mlaverify_verify_server_seconds_bucket{part="queue",le="1e-05"})"),
      Optional(1.0));
  EXPECT_THAT(
      SampleValue(text, R"(mlaverify_verify_server_seconds_bucket{part="device",le="2e-05"})"),
      Optional(0.0));
  EXPECT_THAT(
      SampleValue(text, R"(mlaverify_verify_server_seconds_bucket{part="device",le="3e-05"})"),
      Optional(1.0));
  EXPECT_THAT(SampleValue(text, R"(mlaverify_verify_server_seconds_sum{part="other"})"),
              Optional(::testing::DoubleNear(2e-5, 1e-12)));
  EXPECT_THAT(SampleValue(text, R"(mlaverify_device_faults_total{device="cuda:1"})"),
              Optional(1.0));
  EXPECT_THAT(SampleValue(text, R"(mlaverify_oversized_requests_total{rpc="VerifyStream"})"),
              Optional(2.0));
}

TEST(MetricsTest, EngineGaugesFollowTheStatsSource) {
  Metrics metrics;
  FakeStats fake;
  fake.Set(PoolStats());
  metrics.SetStatsSource([&fake] { return fake.Get(); });
  std::string text = metrics.Serialize();
  EXPECT_THAT(SampleValue(text, "mlaverify_kv_pages_capacity"), Optional(10.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_kv_pages_free"), Optional(7.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_kv_pages_used"), Optional(3.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_sequences_live"), Optional(2.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_verify_steps_pending"), Optional(1.0));

  // Gauges are re-read on every scrape, and may go down.
  engine::EngineStats later = PoolStats();
  later.free_pages = 10;
  later.live_sequences = 0;
  later.pending_steps = 0;
  fake.Set(later);
  text = metrics.Serialize();
  EXPECT_THAT(SampleValue(text, "mlaverify_kv_pages_free"), Optional(10.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_kv_pages_used"), Optional(0.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_sequences_live"), Optional(0.0));
}

TEST(MetricsTest, MirroredCountersAdvanceByEngineDeltas) {
  Metrics metrics;
  FakeStats fake;
  engine::EngineStats s;
  s.tokens_appended_total = 5;
  s.tokens_committed_total = 2;
  s.steps_committed_total = 1;
  s.sequences_created_total = 3;
  s.sequences_expired_total = 0;
  fake.Set(s);
  metrics.SetStatsSource([&fake] { return fake.Get(); });

  std::string text = metrics.Serialize();
  EXPECT_THAT(SampleValue(text, "mlaverify_tokens_appended_total"), Optional(5.0));
  // A second scrape with no engine progress must not add the total again.
  text = metrics.Serialize();
  EXPECT_THAT(SampleValue(text, "mlaverify_tokens_appended_total"), Optional(5.0));

  s.tokens_appended_total = 12;
  s.tokens_committed_total = 9;
  s.steps_committed_total = 4;
  s.sequences_created_total = 3;
  s.sequences_expired_total = 2;
  fake.Set(s);
  text = metrics.Serialize();
  EXPECT_THAT(SampleValue(text, "mlaverify_tokens_appended_total"), Optional(12.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_tokens_committed_total"), Optional(9.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_steps_committed_total"), Optional(4.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_sequences_created_total"), Optional(3.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_sequences_expired_total"), Optional(2.0));
  EXPECT_THAT(text, HasSubstr("# TYPE mlaverify_tokens_appended_total counter"));

  // A total that goes backwards is a new baseline, never a decrement.
  s.tokens_appended_total = 4;
  fake.Set(s);
  text = metrics.Serialize();
  EXPECT_THAT(SampleValue(text, "mlaverify_tokens_appended_total"), Optional(12.0));
  s.tokens_appended_total = 6;
  fake.Set(s);
  text = metrics.Serialize();
  EXPECT_THAT(SampleValue(text, "mlaverify_tokens_appended_total"), Optional(14.0));

  // A new source counts from zero on top of what was exported.
  engine::EngineStats fresh;
  fresh.tokens_appended_total = 3;
  metrics.SetStatsSource([fresh] { return fresh; });
  text = metrics.Serialize();
  EXPECT_THAT(SampleValue(text, "mlaverify_tokens_appended_total"), Optional(17.0));
}

TEST(MetricsTest, SharedMemoryGaugesFollowTheirSource) {
  admin::Metrics metrics;
  EXPECT_THAT(SampleValue(metrics.Serialize(), "mlaverify_shm_regions"), Optional(0.0));
  admin::Metrics::SharedMemoryUsage usage{3, 4096};
  metrics.SetSharedMemorySource([&usage] { return usage; });
  std::string text = metrics.Serialize();
  EXPECT_THAT(SampleValue(text, "mlaverify_shm_regions"), Optional(3.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_shm_registered_bytes"), Optional(4096.0));
  usage = {1, 512};
  text = metrics.Serialize();
  EXPECT_THAT(SampleValue(text, "mlaverify_shm_regions"), Optional(1.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_shm_registered_bytes"), Optional(512.0));
}

TEST(MetricsTest, InfoAndReady) {
  Metrics metrics;
  metrics.SetInfo("0.1.0", "cpu");
  std::string text = metrics.Serialize();
  EXPECT_THAT(SampleValue(text, R"(mlaverify_build_info{backend="cpu",version="0.1.0"})"),
              Optional(1.0));
  EXPECT_THAT(SampleValue(text, "mlaverify_ready"), Optional(0.0));

  metrics.SetInfo("0.2.0", "cuda");
  metrics.SetReady(true);
  text = metrics.Serialize();
  EXPECT_THAT(SampleValue(text, R"(mlaverify_build_info{backend="cuda",version="0.2.0"})"),
              Optional(1.0));
  EXPECT_THAT(text, Not(HasSubstr(R"(version="0.1.0")")));
  EXPECT_THAT(SampleValue(text, "mlaverify_ready"), Optional(1.0));

  metrics.SetReady(false);
  EXPECT_THAT(SampleValue(metrics.Serialize(), "mlaverify_ready"), Optional(0.0));
}

class AdminHttpServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fake_.Set(PoolStats());
    metrics_.SetStatsSource([this] { return fake_.Get(); });
    server_ = std::make_unique<AdminHttpServer>(&metrics_, [this] { return ready_.load(); });
    ASSERT_TRUE(server_->Start("127.0.0.1", 0).ok());
    ASSERT_GT(server_->port(), 0);
  }

  httplib::Result Get(const std::string& path) {
    httplib::Client client("127.0.0.1", server_->port());
    client.set_connection_timeout(5);
    client.set_read_timeout(5);
    return client.Get(path.c_str());
  }

  FakeStats fake_;
  Metrics metrics_;
  std::atomic<bool> ready_{false};
  std::unique_ptr<AdminHttpServer> server_;
};

TEST_F(AdminHttpServerTest, HealthzIsAlwaysOk) {
  httplib::Result res = Get("/healthz");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body, "ok\n");
}

TEST_F(AdminHttpServerTest, ReadyzFollowsTheReadyFunction) {
  httplib::Result res = Get("/readyz");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 503);
  EXPECT_EQ(res->body, "not ready\n");

  ready_ = true;
  res = Get("/readyz");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->body, "ready\n");

  // Draining: ready goes back to false while liveness stays up.
  ready_ = false;
  res = Get("/readyz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 503);
  res = Get("/healthz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
}

TEST_F(AdminHttpServerTest, MetricsServesPrometheusText) {
  metrics_.RecordRpc("Verify", "INVALID_ARGUMENT", 1e-3);
  httplib::Result res = Get("/metrics");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_THAT(res->body, HasSubstr("\nmlaverify_kv_pages_free 7\n"));
  EXPECT_THAT(
      res->body,
      HasSubstr("\nmlaverify_requests_total{code=\"INVALID_ARGUMENT\",rpc=\"Verify\"} 1\n"));

  // Each scrape re-reads the engine.
  engine::EngineStats later = PoolStats();
  later.free_pages = 4;
  fake_.Set(later);
  res = Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_THAT(SampleValue(res->body, "mlaverify_kv_pages_free"), Optional(4.0));
}

TEST_F(AdminHttpServerTest, UnknownPathIs404) {
  httplib::Result res = Get("/nope");
  ASSERT_TRUE(res) << httplib::to_string(res.error());
  EXPECT_EQ(res->status, 404);
  res = Get("/metrics/extra");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
}

TEST_F(AdminHttpServerTest, SecondServerOnTheSamePortFails) {
  Metrics other_metrics;
  AdminHttpServer other(&other_metrics, nullptr);
  absl::Status status = other.Start("127.0.0.1", server_->port());
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(std::to_string(server_->port())));
  EXPECT_EQ(other.port(), 0);
  // The first server is unaffected.
  httplib::Result res = Get("/healthz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
}

TEST_F(AdminHttpServerTest, StartTwiceIsFailedPrecondition) {
  EXPECT_EQ(server_->Start("127.0.0.1", 0).code(), absl::StatusCode::kFailedPrecondition);
}

// A slowloris: a request head that keeps coming, a byte every 400 ms (well
// inside the idle timeout), is cut at kRequestHeadSeconds; probes from
// another connection are answered meanwhile.
TEST_F(AdminHttpServerTest, ATrickledRequestHeadIsCutAtItsDeadline) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(server_->port()));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const absl::Time opened = absl::Now();
  const std::string head = "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ";
  ASSERT_EQ(send(fd, head.data(), head.size(), MSG_NOSIGNAL), static_cast<ssize_t>(head.size()));
  absl::Duration closed_after = absl::InfiniteDuration();
  bool probed = false;
  while (absl::Now() - opened < absl::Seconds(AdminHttpServer::kRequestHeadSeconds + 4)) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 400) > 0) {
      char byte;
      if (recv(fd, &byte, 1, MSG_DONTWAIT) <= 0) {
        closed_after = absl::Now() - opened;
        break;
      }
    }
    if (send(fd, "a", 1, MSG_NOSIGNAL) != 1) {
      closed_after = absl::Now() - opened;
      break;
    }
    if (!probed) {
      httplib::Result res = Get("/healthz");
      ASSERT_TRUE(res);
      EXPECT_EQ(res->status, 200);
      probed = true;
    }
  }
  close(fd);
  EXPECT_GE(closed_after,
            absl::Seconds(AdminHttpServer::kRequestHeadSeconds) - absl::Milliseconds(500));
  EXPECT_LE(closed_after, absl::Seconds(AdminHttpServer::kRequestHeadSeconds + 2))
      << "a head trickled in for " << closed_after;
  EXPECT_GE(server_->heads_cut(), 1);
  // A probe's head, all at once, is not cut.
  httplib::Result res = Get("/readyz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 503);
}

TEST_F(AdminHttpServerTest, StopIsIdempotentAndClosesThePort) {
  const int port = server_->port();
  server_->Stop();
  EXPECT_EQ(server_->port(), 0);
  server_->Stop();

  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(1);
  EXPECT_FALSE(client.Get("/healthz"));

  // The freed port can be bound again, by this object or another.
  ASSERT_TRUE(server_->Start("127.0.0.1", port).ok());
  EXPECT_EQ(server_->port(), port);
  httplib::Result res = Get("/healthz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  // The destructor stops it once more.
}

TEST(AdminHttpServerLifecycleTest, StopRightAfterStartReturns) {
  // httplib ignores stop() until its accept loop runs; Stop must not hang in
  // that window.
  Metrics metrics;
  for (int i = 0; i < 20; ++i) {
    AdminHttpServer server(&metrics, nullptr);
    ASSERT_TRUE(server.Start("127.0.0.1", 0).ok());
    server.Stop();
  }
}

TEST(AdminHttpServerLifecycleTest, NullMetricsAndNullReady) {
  AdminHttpServer server(nullptr, nullptr);
  ASSERT_TRUE(server.Start("127.0.0.1", 0).ok());
  httplib::Client client("127.0.0.1", server.port());
  httplib::Result res = client.Get("/readyz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
}

TEST(AdminHttpServerLifecycleTest, RejectsBadArguments) {
  Metrics metrics;
  AdminHttpServer server(&metrics, nullptr);
  EXPECT_EQ(server.Start("127.0.0.1", -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server.Start("127.0.0.1", 65536).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server.Start("", 0).code(), absl::StatusCode::kInvalidArgument);
  // An address this host does not own cannot be bound.
  EXPECT_EQ(server.Start("192.0.2.1", 0).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(server.port(), 0);
  server.Stop();  // never started: a no-op
}

}  // namespace
}  // namespace mlaverify::admin
