// The client's connection pool and keepalive against the real server over
// loopback, with a TCP proxy in between that counts the connections it
// carries and can cut one: calls spread over N connections, a sequence's
// calls stay on one, a connection lost mid-load fails only the calls on it
// and is opened again, and an idle stream outlives short keepalive settings
// on both ends (while a client pinging faster than the server allows is
// told to go away).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/replica_set.h"
#include "common/geometry.h"
#include "common/workload.h"
#include "gtest/gtest.h"
#include "server/engine/device.h"
#include "server/engine/engine.h"
#include "server/transport/grpc_server.h"

namespace mlaverify {
namespace {

using mlaverify::kLatentDim;

constexpr int kLayers = 2, kHeads = 4, kPage = 8, kDrafts = 4;
constexpr int64_t kPrompt = 16;

// Forwards every connection accepted on a loopback port to `upstream_port`,
// one thread per connection. Kill(i) shuts the i-th accepted connection
// down on both sides, as a NAT or balancer that drops a flow does.
class TcpProxy {
 public:
  explicit TcpProxy(int upstream_port) : upstream_port_(upstream_port) {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    const int one = 1;
    setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        listen(listener_, 64) != 0) {
      ADD_FAILURE() << "proxy cannot listen";
      return;
    }
    socklen_t len = sizeof(addr);
    getsockname(listener_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::thread([this] { Accept(); });
  }

  ~TcpProxy() {
    stopping_.store(true);
    shutdown(listener_, SHUT_RDWR);
    acceptor_.join();
    close(listener_);
    // (The pumps never take mu_.)
    absl::MutexLock lock(&mu_);
    for (Pair& p : pairs_) {
      shutdown(p.client, SHUT_RDWR);
      shutdown(p.server, SHUT_RDWR);
    }
    for (std::thread& t : pumps_) t.join();
    for (Pair& p : pairs_) {
      close(p.client);
      close(p.server);
    }
  }

  int port() const { return port_; }

  int accepted() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(pairs_.size());
  }

  void Kill(int index) {
    absl::MutexLock lock(&mu_);
    ASSERT_LT(index, static_cast<int>(pairs_.size()));
    shutdown(pairs_[index].client, SHUT_RDWR);
    shutdown(pairs_[index].server, SHUT_RDWR);
  }

 private:
  struct Pair {
    int client = -1, server = -1;
  };

  void Accept() {
    while (!stopping_.load()) {
      const int client = accept(listener_, nullptr, nullptr);
      if (client < 0) return;  // shut down
      const int server = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      addr.sin_port = htons(static_cast<uint16_t>(upstream_port_));
      if (connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        close(client);
        close(server);
        continue;
      }
      absl::MutexLock lock(&mu_);
      pairs_.push_back({client, server});
      pumps_.emplace_back([client, server] { Pump(client, server); });
    }
  }

  // Copies bytes both ways until either side closes or is shut down; then
  // shuts both down so the other end sees the loss too.
  static void Pump(int a, int b) {
    char buffer[1 << 16];
    pollfd fds[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
    for (;;) {
      if (poll(fds, 2, 1000) < 0) break;
      bool done = false;
      for (int i = 0; i < 2 && !done; ++i) {
        if (fds[i].revents == 0) continue;
        const ssize_t n = read(fds[i].fd, buffer, sizeof(buffer));
        if (n <= 0) {
          done = true;
          break;
        }
        const int to = fds[1 - i].fd;
        for (ssize_t sent = 0; sent < n;) {
          const ssize_t w = write(to, buffer + sent, n - sent);
          if (w <= 0) {
            done = true;
            break;
          }
          sent += w;
        }
      }
      if (done) break;
    }
    shutdown(a, SHUT_RDWR);
    shutdown(b, SHUT_RDWR);
  }

  const int upstream_port_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  absl::Mutex mu_;
  std::vector<Pair> pairs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> pumps_ ABSL_GUARDED_BY(mu_);
};

class PoolTest : public ::testing::Test {
 protected:
  // The server on one CPU device, or a fake one `device_latency` slow (so
  // that calls are in flight when a connection is cut).
  void StartServer(transport::GrpcServerOptions options,
                   absl::Duration device_latency = absl::ZeroDuration()) {
    engine::EngineConfig config;
    config.num_layers = kLayers;
    config.num_heads = kHeads;
    config.page_size = kPage;
    config.pool_bytes = 2048 * config.bytes_per_page();
    config.draft_buckets = {kDrafts};
    config.batch_buckets = {1, 2, 4};
    config.max_sequence_len = 1024;
    std::vector<std::unique_ptr<engine::Device>> devices;
    if (device_latency > absl::ZeroDuration()) {
      engine::FakeDeviceOptions slow;
      slow.graphs = false;
      slow.latency = device_latency;
      devices.push_back(engine::MakeFakeDevice(0, slow, nullptr));
    } else {
      devices.push_back(engine::MakeCpuDevice(1));
    }
    auto engine = engine::Engine::Create(config, std::move(devices));
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    options.listen_address = "127.0.0.1:0";
    auto server = transport::GrpcServer::Start(options, nullptr);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    server_->AttachEngine(engine_.get());
    server_->SetServing();
    proxy_ = std::make_unique<TcpProxy>(server_->port());
  }

  std::unique_ptr<client::VerifyClient> Connect(client::ClientOptions options) {
    auto c = client::VerifyClient::Create("127.0.0.1:" + std::to_string(proxy_->port()), options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }

  // A sequence with a short prompt.
  uint64_t NewSequence(client::VerifyClient& c) {
    auto id = c.CreateSequence("pool");
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return 0;
    auto appended = c.AppendKv(*id, 0, kLayers, kPrompt, prompt_);
    EXPECT_TRUE(appended.ok()) << appended.status();
    return *id;
  }

  // One verify step of `id`: every layer, then a commit of the first draft.
  absl::Status Step(client::VerifyClient& c, uint64_t id) {
    const client::VerifyItemInput item{id, chain_, q_, draft_kv_};
    for (int layer = 0; layer < kLayers; ++layer) {
      auto results = c.Verify(layer, absl::MakeConstSpan(&item, 1));
      if (!results.ok()) return results.status();
    }
    const std::vector<int32_t> accepted = {0};
    return c.Commit(id, accepted).status();
  }

  void CutOneConnectionMidLoad(bool through_replica_set);

  std::mt19937_64 rng_{35};
  const std::vector<Bf16> prompt_ = RandomBf16(rng_, kLayers* kPrompt* kLatentDim, 1.0f);
  const std::vector<Bf16> q_ = RandomBf16(rng_, kDrafts* kHeads* kLatentDim, 1.0f);
  const std::vector<Bf16> draft_kv_ = RandomBf16(rng_, kDrafts* kLatentDim, 1.0f);
  const std::vector<int32_t> chain_ = {-1, 0, 1, 2};
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<transport::GrpcServer> server_;
  std::unique_ptr<TcpProxy> proxy_;  // destroyed before the server
};

TEST_F(PoolTest, CallsSpreadOverTheConnectionsAndASequenceKeepsOne) {
  StartServer({});
  client::ClientOptions options;
  options.connections = 4;
  auto c = Connect(options);
  ASSERT_NE(c, nullptr);
  ASSERT_EQ(c->connections(), 4);
  std::vector<uint64_t> ids;
  for (int s = 0; s < 8; ++s) ids.push_back(NewSequence(*c));
  const std::vector<client::ConnectionStats> before = c->GetConnectionStats();
  // Four threads, two sequences each, stepping at once: every call of a
  // sequence must land on its connection, and the steps must keep their
  // order (a Commit before its Verify, or two Verifys of a layer out of
  // turn, would fail).
  constexpr int kSteps = 5;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int step = 0; step < kSteps; ++step) {
        for (int k = 0; k < 2; ++k) {
          if (!Step(*c, ids[t * 2 + k]).ok()) failures.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  const std::vector<client::ConnectionStats> after = c->GetConnectionStats();
  std::vector<int64_t> expected(4, 0);
  for (uint64_t id : ids) expected[c->ConnectionOf(id)] += kSteps * (kLayers + 1);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(after[i].calls - before[i].calls, expected[i]) << "connection " << i;
    EXPECT_EQ(after[i].failed, 0) << "connection " << i;
  }
  // Streams take the connections in turn.
  std::set<int> stream_connections;
  std::vector<std::unique_ptr<client::VerifyStreamSession>> streams;
  for (int s = 0; s < 4; ++s) {
    auto stream = c->OpenVerifyStream();
    ASSERT_TRUE(stream.ok()) << stream.status();
    const client::VerifyItemInput item{ids[s], chain_, q_, draft_kv_};
    auto results = (*stream)->Verify(0, absl::MakeConstSpan(&item, 1));
    ASSERT_TRUE(results.ok()) << results.status();
    stream_connections.insert((*stream)->connection());
    streams.push_back(*std::move(stream));
  }
  EXPECT_EQ(stream_connections.size(), 4u);
  for (auto& stream : streams) EXPECT_TRUE(stream->Close().ok());
  // A health probe on a chosen connection goes there and nowhere else
  // (ReplicaSet relies on it to probe two distinct connections).
  for (int i = 0; i < 4; ++i) {
    const std::vector<client::ConnectionStats> pre = c->GetConnectionStats();
    const absl::StatusOr<client::ServingStatus> health = c->HealthOn(i);
    ASSERT_TRUE(health.ok()) << health.status();
    EXPECT_EQ(*health, client::ServingStatus::kServing);
    const std::vector<client::ConnectionStats> post = c->GetConnectionStats();
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(post[j].calls - pre[j].calls, i == j ? 1 : 0)
          << "probe " << i << " connection " << j;
    }
  }
  EXPECT_EQ(c->HealthOn(4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->HealthOn(-1).status().code(), absl::StatusCode::kInvalidArgument);
  // Four channels are four TCP connections through the proxy, not one.
  EXPECT_EQ(proxy_->accepted(), 4);
}

TEST_F(PoolTest, OneConnectionCarriesEverythingWhenAskedFor) {
  StartServer({});
  client::ClientOptions options;
  options.connections = 1;
  auto c = Connect(options);
  ASSERT_NE(c, nullptr);
  for (int s = 0; s < 4; ++s) EXPECT_TRUE(Step(*c, NewSequence(*c)).ok());
  EXPECT_EQ(proxy_->accepted(), 1);
}

// 16 threads step their sequences over 4 connections; one connection is cut
// mid-load. Through the ReplicaSet (as `load` calls) the replica must also
// stay up: one lost connection is not a lost server.
void PoolTest::CutOneConnectionMidLoad(bool through_replica_set) {
  // A slow device keeps calls in flight on every connection at the cut.
  StartServer({}, absl::Milliseconds(50));
  client::ClientOptions options;
  options.connections = 4;
  options.call_timeout = absl::Seconds(10);
  std::unique_ptr<client::VerifyClient> own;
  std::unique_ptr<client::ReplicaSet> set;
  const std::string target = "127.0.0.1:" + std::to_string(proxy_->port());
  if (through_replica_set) {
    auto made = client::ReplicaSet::Create({target}, options);
    ASSERT_TRUE(made.ok()) << made.status();
    set = *std::move(made);
  } else {
    own = Connect(options);
    ASSERT_NE(own, nullptr);
  }
  client::VerifyClient* c = set != nullptr ? &set->replica(0) : own.get();
  const auto step = [&](uint64_t id) -> absl::Status {
    if (set == nullptr) return Step(*c, id);
    const client::VerifyItemInput item{id, chain_, q_, draft_kv_};
    for (int layer = 0; layer < kLayers; ++layer) {
      auto results = set->Verify(0, layer, absl::MakeConstSpan(&item, 1));
      if (!results.ok()) return results.status();
    }
    const std::vector<int32_t> accepted = {0};
    return set->Commit(client::PlacedSequence{0, id}, accepted).status();
  };
  constexpr int kThreads = 16;
  std::vector<uint64_t> ids;
  for (int s = 0; s < kThreads; ++s) ids.push_back(NewSequence(*c));
  ASSERT_EQ(proxy_->accepted(), 4);
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  // Per thread: failed calls, and calls that succeeded after a failure.
  std::vector<int> failed(kThreads, 0), recovered(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      uint64_t id = ids[t];
      while (!stop.load()) {
        if (step(id).ok()) {
          if (failed[t] > 0) ++recovered[t];
          continue;
        }
        ++failed[t];
        // The step's state is unknown: a fresh sequence on the same
        // connection (ids are tried until one maps there). CreateSequence
        // takes the connections in turn, so it too may meet the lost one
        // while it goes down: then it is tried again.
        c->ReleaseSequence(id).IgnoreError();
        const int connection = c->ConnectionOf(ids[t]);
        for (;;) {
          if (stop.load()) return;
          absl::StatusOr<uint64_t> created = c->CreateSequence("pool");
          if (!created.ok()) continue;
          if (c->ConnectionOf(*created) != connection) continue;
          if (c->AppendKv(*created, 0, kLayers, kPrompt, prompt_).ok()) {
            id = *created;
            break;
          }
        }
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(500));
  const std::vector<client::ConnectionStats> before_kill = c->GetConnectionStats();
  proxy_->Kill(0);
  absl::SleepFor(absl::Milliseconds(2000));
  stop.store(true);
  for (std::thread& t : threads) t.join();

  // Exactly one connection lost calls, and only the threads whose sequence
  // lives on it saw failures; each of them carried on after.
  std::set<int> failed_connections;
  for (int t = 0; t < kThreads; ++t) {
    if (failed[t] > 0) failed_connections.insert(c->ConnectionOf(ids[t]));
  }
  ASSERT_EQ(failed_connections.size(), 1u)
      << "calls per connection before the cut: " << before_kill[0].calls << " "
      << before_kill[1].calls << " " << before_kill[2].calls << " " << before_kill[3].calls;
  const int lost = *failed_connections.begin();
  for (int t = 0; t < kThreads; ++t) {
    if (c->ConnectionOf(ids[t]) != lost) {
      EXPECT_EQ(failed[t], 0) << "thread " << t;
    } else if (failed[t] > 0) {
      EXPECT_GT(recovered[t], 0) << "thread " << t << " never recovered";
    }
  }
  const std::vector<client::ConnectionStats> stats = c->GetConnectionStats();
  for (int i = 0; i < 4; ++i) {
    if (i != lost) {
      EXPECT_EQ(stats[i].failed, 0) << "connection " << i;
    }
  }
  EXPECT_GT(stats[lost].failed, 0);
  // gRPC opened the lost connection again (through the proxy, a fifth one).
  EXPECT_EQ(proxy_->accepted(), 5);
  if (set != nullptr) {
    EXPECT_TRUE(set->CheckUp(0).ok()) << set->CheckUp(0);
  }
}

TEST_F(PoolTest, ALostConnectionFailsOnlyItsCallsAndIsOpenedAgain) {
  CutOneConnectionMidLoad(/*through_replica_set=*/false);
}

TEST_F(PoolTest, ALostConnectionLeavesTheReplicaUp) {
  CutOneConnectionMidLoad(/*through_replica_set=*/true);
}

TEST_F(PoolTest, AnIdleStreamOutlivesShortKeepaliveSettings) {
  // The server pings every 100 ms and gives 200 ms for the ack; the client
  // pings every 200 ms, which the server's 50 ms minimum interval allows.
  transport::GrpcServerOptions server_options;
  server_options.keepalive_time_ms = 100;
  server_options.keepalive_timeout_ms = 200;
  server_options.http2_min_ping_interval_ms = 50;
  StartServer(server_options);
  client::ClientOptions options;
  options.connections = 1;
  options.keepalive_time = absl::Milliseconds(200);
  options.keepalive_timeout = absl::Milliseconds(200);
  auto c = Connect(options);
  ASSERT_NE(c, nullptr);
  const uint64_t id = NewSequence(*c);
  auto stream = c->OpenVerifyStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  const client::VerifyItemInput item{id, chain_, q_, draft_kv_};
  ASSERT_TRUE((*stream)->Verify(0, absl::MakeConstSpan(&item, 1)).ok());
  // Idle for 5 s: gRPC 1.51 sends at most one ping a second, so about five
  // each way; as many pings against the server's default interval end the
  // connection (the next test).
  absl::SleepFor(absl::Seconds(5));
  auto again = (*stream)->Verify(1, absl::MakeConstSpan(&item, 1));
  EXPECT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE((*stream)->Close().ok());
  EXPECT_EQ(proxy_->accepted(), 1);  // the same connection throughout
}

TEST_F(PoolTest, PingsFasterThanTheServerAllowsEndTheConnection) {
  // The counter-case: the server's minimum ping interval (10 s, its
  // default) above the client's 200 ms. The server counts the pings as
  // strikes and sends GOAWAY, so the idle stream dies: the two settings
  // must agree, as the defaults do (30 s client, 10 s server).
  StartServer({});
  client::ClientOptions options;
  options.connections = 1;
  options.keepalive_time = absl::Milliseconds(200);
  options.keepalive_timeout = absl::Milliseconds(200);
  auto c = Connect(options);
  ASSERT_NE(c, nullptr);
  const uint64_t id = NewSequence(*c);
  auto stream = c->OpenVerifyStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  const client::VerifyItemInput item{id, chain_, q_, draft_kv_};
  ASSERT_TRUE((*stream)->Verify(0, absl::MakeConstSpan(&item, 1)).ok());
  // About five pings (one a second at most): the third strike past the
  // first ping goes over the 2 allowed.
  absl::SleepFor(absl::Seconds(5));
  auto again = (*stream)->Verify(1, absl::MakeConstSpan(&item, 1));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
}

TEST(PoolOptions, BadPoolAndKeepaliveSettingsAreInvalidArgument) {
  client::ClientOptions options;
  for (int n : {0, -1, client::kMaxConnections + 1}) {
    options.connections = n;
    EXPECT_EQ(client::VerifyClient::Create("127.0.0.1:1", options).status().code(),
              absl::StatusCode::kInvalidArgument)
        << n;
  }
  options.connections = 3;
  options.keepalive_time = absl::Microseconds(10);
  EXPECT_EQ(client::VerifyClient::Create("127.0.0.1:1", options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.keepalive_time = absl::InfiniteDuration();  // no pings: fine
  auto c = client::VerifyClient::Create("127.0.0.1:1", options);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->connections(), 3);
  for (uint64_t id : {0u, 1u, 2u, 3u, 7u, 300u}) EXPECT_EQ((*c)->ConnectionOf(id), id % 3);
}

}  // namespace
}  // namespace mlaverify
