// The whole service in process over loopback gRPC: every RPC, the stream,
// health states, and a table of bad inputs, each answered with its documented
// code, changing nothing (page counts and the sequence's next step) and
// leaving the server serving. Outputs are checked with the client's own
// reference (client/reference_check.h) over a mirror of what was sent.
#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/reference_check.h"
#include "client/shared_memory.h"
#include "client/wire.h"
#include "common/host_doorbell.h"
#include "common/workload.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/verify_attention.h"
#include "server/engine/device.h"
#include "server/engine/engine.h"
#include "server/transport/grpc_server.h"
#include "server/transport/slow_call_log.h"

namespace mlaverify {
namespace {

using mlaverify::kLatentDim;
using ::testing::HasSubstr;

constexpr int kLayers = 2, kHeads = 4, kPage = 8, kMaxDraft = 8, kMaxBatch = 4;
constexpr int64_t kRow = mlaverify::kLatentDim;  // int64_t so {kLayers, T, kRow} is a shape
constexpr int64_t kPoolPages = 48;
constexpr int64_t kMaxMessageBytes = 1 << 20;

// The inputs of one decode step of one sequence.
struct Step {
  std::vector<int32_t> parents;
  std::vector<std::vector<Bf16>> q, draft_kv;  // per layer
  client::VerifyItemInput Item(uint64_t id, int layer) const {
    return {id, parents, q[layer], draft_kv[layer]};
  }
};

// Counts the oversized requests the service reports.
class OversizeCounter final : public transport::RpcObserver {
 public:
  void OnRpc(absl::string_view, grpc::StatusCode, double) override {}
  void OnOversizedRequest(absl::string_view rpc) override {
    absl::MutexLock lock(&mu_);
    ++counts_[std::string(rpc)];
  }
  int count(const std::string& rpc) {
    absl::MutexLock lock(&mu_);
    return counts_[rpc];
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, int> counts_ ABSL_GUARDED_BY(mu_);
};

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(engine::MakeCpuDevice(2)); }

  // The server over one device (a fake one for tests that need a slow device).
  void Make(std::unique_ptr<engine::Device> device) {
    stub_.reset();
    client_.reset();
    server_.reset();
    engine_.reset();
    engine::EngineConfig config;
    config.num_layers = kLayers;
    config.num_heads = kHeads;
    config.page_size = kPage;
    config.pool_bytes = kPoolPages * config.bytes_per_page();
    config.draft_buckets = {1, 2, 4, kMaxDraft};
    config.batch_buckets = {1, 2, kMaxBatch};
    config.max_sequence_len = 4096;
    config.shared_memory = shm_options_;
    std::vector<std::unique_ptr<engine::Device>> devices;
    devices.push_back(std::move(device));
    auto engine = engine::Engine::Create(config, std::move(devices));
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    transport::GrpcServerOptions options;
    options.listen_address = "127.0.0.1:0";
    options.service.max_message_bytes = max_message_bytes_;
    auto server = transport::GrpcServer::Start(options, &oversize_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    server_->AttachEngine(engine_.get());
    const std::string target = "127.0.0.1:" + std::to_string(server_->port());
    auto c = client::VerifyClient::Create(target, client::ClientOptions{});
    ASSERT_TRUE(c.ok());
    client_ = *std::move(c);
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(-1);
    args.SetMaxReceiveMessageSize(-1);
    channel_ = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
    stub_ = v1::VerifyService::NewStub(channel_);
  }

  // A fake device slow enough for calls to be in flight or queued.
  static std::unique_ptr<engine::Device> SlowDevice(absl::Duration latency) {
    engine::FakeDeviceOptions slow;
    slow.graphs = false;
    slow.latency = latency;
    return engine::MakeFakeDevice(0, slow, nullptr);
  }

  void Serve() { server_->SetServing(); }

  // A sequence with a random prompt, and its mirror.
  uint64_t NewSequence(int64_t prompt, client::SequenceMirror* mirror) {
    auto id = client_->CreateSequence("test");
    EXPECT_TRUE(id.ok()) << id.status();
    const std::vector<Bf16> kv = RandomBf16(rng_, kLayers * prompt * kLatentDim, 1.0f);
    auto appended = client_->AppendKv(*id, 0, kLayers, prompt, kv);
    EXPECT_TRUE(appended.ok()) << appended.status();
    mirror->AppendPrompt(kv, prompt);
    return *id;
  }

  Step RandomStep(int n) {
    Step s;
    for (int i = 0; i < n; ++i) {
      s.parents.push_back(i == 0 || rng_() % 2 ? i - 1
                                               : static_cast<int32_t>(rng_() % (i + 1)) - 1);
    }
    for (int l = 0; l < kLayers; ++l) {
      s.q.push_back(RandomBf16(rng_, static_cast<size_t>(n) * kHeads * kLatentDim, 2.0f));
      s.draft_kv.push_back(RandomBf16(rng_, static_cast<size_t>(n) * kLatentDim, 1.0f));
    }
    return s;
  }

  // Verifies every layer (unary), checks each result against the reference,
  // commits the path to the last draft and mirrors it.
  void RunCheckedStep(uint64_t id, client::SequenceMirror* mirror, const Step& s) {
    const float scale = engine_->config().default_softmax_scale;
    for (int l = 0; l < kLayers; ++l) {
      const client::VerifyItemInput item = s.Item(id, l);
      auto results = client_->Verify(l, absl::MakeConstSpan(&item, 1));
      ASSERT_TRUE(results.ok()) << results.status();
      auto cmp = client::CompareWithReference(*mirror, l, item, scale, (*results)[0], 1);
      ASSERT_TRUE(cmp.ok()) << cmp.status();
      EXPECT_TRUE(cmp->ok(1e-2, 1e-3)) << "layer " << l << " rel_err " << cmp->rel_err;
    }
    std::vector<int32_t> path;
    for (int a = static_cast<int>(s.parents.size()) - 1; a >= 0; a = s.parents[a])
      path.insert(path.begin(), a);
    auto committed = client_->Commit(id, path);
    ASSERT_TRUE(committed.ok()) << committed.status();
    mirror->AppendAccepted(s.draft_kv, path);
    EXPECT_EQ(committed->length, mirror->length());
  }

  int64_t FreePages() { return engine_->Stats().free_pages; }

  // Another server over the test's engine with `options` (127.0.0.1:0
  // unless they name an address), serving; null (and a failure) if it does
  // not start. `target` gets its host:port.
  std::unique_ptr<transport::GrpcServer> ServeAlso(transport::GrpcServerOptions options,
                                                   std::string* target) {
    if (options.listen_address == transport::GrpcServerOptions().listen_address) {
      options.listen_address = "127.0.0.1:0";
    }
    auto server = transport::GrpcServer::Start(options, nullptr);
    EXPECT_TRUE(server.ok()) << server.status();
    if (!server.ok()) return nullptr;
    (*server)->AttachEngine(engine_.get());
    (*server)->SetServing();
    *target = "127.0.0.1:" + std::to_string((*server)->port());
    return *std::move(server);
  }

  static std::unique_ptr<client::VerifyClient> ClientWithToken(const std::string& target,
                                                               const std::string& token) {
    client::ClientOptions o;
    o.auth_token = token;
    return *client::VerifyClient::Create(target, o);
  }

  // Rebuilds the server with client shared memory enabled (limits small
  // enough to reach in a test).
  void MakeWithSharedMemory(std::unique_ptr<engine::Device> device) {
    shm_options_.enabled = true;
    shm_options_.max_regions = 3;
    shm_options_.max_total_bytes = 64 << 20;
    Make(std::move(device));
  }

  // A client-side shared-memory object registered as `name`.
  std::unique_ptr<client::SharedMemoryBuffer> RegisterBuffer(const std::string& name,
                                                             size_t bytes) {
    auto shm = client::SharedMemoryBuffer::Create(bytes);
    EXPECT_TRUE(shm.ok()) << shm.status();
    absl::Status registered = client_->RegisterSystemSharedMemory(name, (*shm)->key(), 0, bytes);
    EXPECT_TRUE(registered.ok()) << registered;
    return *std::move(shm);
  }

  // Calls holding region `name` now, or -1 when the server does not know it.
  int64_t RegionCallsInFlight(const std::string& name) {
    auto regions = client_->SystemSharedMemoryStatus(name);
    return regions.ok() && regions->size() == 1 ? (*regions)[0].calls_in_flight() : -1;
  }

  OversizeCounter oversize_;  // outlives the server
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<transport::GrpcServer> server_;
  std::unique_ptr<client::VerifyClient> client_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::VerifyService::Stub> stub_;
  std::mt19937_64 rng_{2024};
  engine::RegionOptions shm_options_;             // what Make gives the engine
  int64_t max_message_bytes_ = kMaxMessageBytes;  // what Make gives the server
};

TEST_F(ServerTest, HealthFollowsTheServingState) {
  auto health = client_->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, client::ServingStatus::kNotServing);
  EXPECT_EQ(client_->CreateSequence("early").status().code(), absl::StatusCode::kUnavailable);
  Serve();
  EXPECT_EQ(*client_->Health(), client::ServingStatus::kServing);
  EXPECT_EQ(*client_->Health("mlaverify.v1.VerifyService"), client::ServingStatus::kServing);
  EXPECT_TRUE(client_->CreateSequence("now").ok());
  server_->Drain(absl::ZeroDuration(), absl::Seconds(1));
  EXPECT_EQ(server_->state(), transport::ServingState::kDraining);
  EXPECT_FALSE(client_->CreateSequence("late").ok());
}

// SIGTERM's drain: NOT_SERVING at once, but calls are still served through
// the grace period; after it new work is refused.
TEST_F(ServerTest, DrainServesThroughTheGraceThenRefuses) {
  Serve();
  transport::DrainCounts counts;
  std::thread drain([&] { counts = server_->Drain(absl::Milliseconds(400), absl::Seconds(5)); });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(*client_->Health(), client::ServingStatus::kNotServing) << "health goes at once";
  EXPECT_EQ(server_->state(), transport::ServingState::kDrainGrace);
  EXPECT_TRUE(client_->CreateSequence("during the grace").ok()) << "still served";
  drain.join();
  EXPECT_EQ(server_->state(), transport::ServingState::kDraining);
  const absl::Status late = client_->CreateSequence("after").status();
  EXPECT_EQ(late.code(), absl::StatusCode::kUnavailable) << late;
  EXPECT_EQ(counts.calls_cut, 0);
}

// After the grace, an idle VerifyStream and a Health.Watch end at once (they
// do not hold the exit for the drain timeout), while a call in flight
// finishes with its answer rather than CANCELLED.
TEST_F(ServerTest, DrainEndsIdleStreamsAtOnceAndFinishesCallsInFlight) {
  Make(SlowDevice(absl::Milliseconds(300)));
  Serve();
  client::SequenceMirror mirror(kLayers);
  const uint64_t a = NewSequence(8, &mirror), b = NewSequence(8, &mirror);
  const Step sa = RandomStep(2), sb = RandomStep(2);
  auto stream = client_->OpenVerifyStream(absl::Seconds(30));
  ASSERT_TRUE(stream.ok()) << stream.status();
  const client::VerifyItemInput stream_item = sa.Item(a, 0);
  ASSERT_TRUE((*stream)->Verify(0, absl::MakeConstSpan(&stream_item, 1)).ok());  // then idle
  grpc::ClientContext watch_ctx;
  grpc::health::v1::HealthCheckRequest watch_req;
  auto health = grpc::health::v1::Health::NewStub(channel_);
  auto watch = health->Watch(&watch_ctx, watch_req);
  grpc::health::v1::HealthCheckResponse first;
  ASSERT_TRUE(watch->Read(&first));
  absl::Status in_flight;
  std::thread call([&] {
    const client::VerifyItemInput item = sb.Item(b, 0);
    in_flight = client_->Verify(0, absl::MakeConstSpan(&item, 1)).status();
  });
  absl::SleepFor(absl::Milliseconds(100));  // the call is on the device now
  const absl::Time start = absl::Now();
  const transport::DrainCounts counts = server_->Drain(absl::ZeroDuration(), absl::Seconds(10));
  const absl::Duration took = absl::Now() - start;
  call.join();
  EXPECT_LT(took, absl::Seconds(3)) << "nothing waited for the 10 s timeout";
  EXPECT_TRUE(in_flight.ok()) << in_flight;
  EXPECT_EQ(counts.calls_in_flight_at_close, 1);
  EXPECT_EQ(counts.calls_finished, 1);
  EXPECT_EQ(counts.calls_cut, 0);
  EXPECT_EQ(counts.streams_ended, 1);
  const absl::Status closed = (*stream)->Close();
  EXPECT_EQ(closed.code(), absl::StatusCode::kUnavailable) << closed;
  EXPECT_THAT(std::string(closed.message()), HasSubstr("draining"));
  grpc::health::v1::HealthCheckResponse next;
  while (watch->Read(&next)) {
  }
  watch->Finish();
}

// With a token configured, every VerifyService call needs the bearer token
// (UNAUTHENTICATED without it or with another), health does not.
TEST_F(ServerTest, BearerTokenIsRequiredExceptForHealth) {
  transport::GrpcServerOptions options;
  options.service.auth_token = "s3cret-token";
  std::string target;
  auto server = ServeAlso(options, &target);
  ASSERT_NE(server, nullptr);
  auto anonymous = ClientWithToken(target, ""), wrong = ClientWithToken(target, "s3cret-tokeN"),
       right = ClientWithToken(target, "s3cret-token");
  EXPECT_EQ(*anonymous->Health(), client::ServingStatus::kServing) << "health needs no token";
  const absl::Status none = anonymous->CreateSequence("x").status();
  EXPECT_EQ(none.code(), absl::StatusCode::kUnauthenticated) << none;
  EXPECT_THAT(std::string(none.message()), HasSubstr("bearer token"));
  EXPECT_EQ(wrong->GetServerInfo().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(engine_->Stats().live_sequences, 0) << "a refused call changes nothing";
  auto id = right->CreateSequence("y");
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_TRUE(right->ReleaseSequence(*id).ok());
  auto stream = wrong->OpenVerifyStream(absl::Seconds(10));
  ASSERT_TRUE(stream.ok());
  const std::vector<Bf16> q(static_cast<size_t>(kHeads) * kLatentDim), kv(kLatentDim);
  const std::vector<int32_t> parents = {-1};
  const client::VerifyItemInput item{1, parents, q, kv};
  EXPECT_EQ((*stream)->Verify(0, absl::MakeConstSpan(&item, 1)).status().code(),
            absl::StatusCode::kUnauthenticated)
      << "stream requests are checked too";
}

// A VerifyStream's token and the serving state are checked when it opens,
// before it takes a slot: streams without the token, however many, leave
// the only slot to the scheduler that has it.
TEST_F(ServerTest, StreamsWithoutTheTokenTakeNoSlot) {
  transport::GrpcServerOptions options;
  options.service.auth_token = "s3cret-token";
  options.service.max_streams = 1;
  std::string target;
  auto server = ServeAlso(options, &target);
  ASSERT_NE(server, nullptr);
  auto anonymous = ClientWithToken(target, ""), right = ClientWithToken(target, "s3cret-token");
  const std::vector<Bf16> q(static_cast<size_t>(kHeads) * kLatentDim), kv(kLatentDim);
  const std::vector<int32_t> parents = {-1};
  std::vector<std::unique_ptr<client::VerifyStreamSession>> held;
  for (int i = 0; i < 4; ++i) {
    auto stream = anonymous->OpenVerifyStream(absl::Seconds(10));
    ASSERT_TRUE(stream.ok());
    const client::VerifyItemInput item{1, parents, q, kv};
    EXPECT_EQ((*stream)->Verify(0, absl::MakeConstSpan(&item, 1)).status().code(),
              absl::StatusCode::kUnauthenticated);
    held.push_back(*std::move(stream));
  }
  auto id = right->CreateSequence("s");
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(right->AppendKv(*id, 0, kLayers, 1, std::vector<Bf16>(kLayers * kLatentDim)).ok());
  auto stream = right->OpenVerifyStream(absl::Seconds(10));
  ASSERT_TRUE(stream.ok());
  const client::VerifyItemInput item{*id, parents, q, kv};
  auto served = (*stream)->Verify(0, absl::MakeConstSpan(&item, 1));
  EXPECT_TRUE(served.ok()) << "the scheduler's stream takes the slot: " << served.status();
  EXPECT_TRUE((*stream)->Close().ok());
}

// One connection holds at most --max-streams-per-connection VerifyStreams;
// a stream idle past --stream-idle-timeout-s ends UNAVAILABLE, a busy one
// stays.
TEST_F(ServerTest, StreamsPerConnectionAreCappedAndIdleOnesEnd) {
  transport::GrpcServerOptions options;
  options.service.max_streams_per_connection = 2;
  options.service.stream_idle_timeout = absl::Milliseconds(1500);
  std::string target;
  auto server = ServeAlso(options, &target);
  ASSERT_NE(server, nullptr);
  client::ClientOptions one;
  one.connections = 1;
  auto a = *client::VerifyClient::Create(target, one);
  auto b = *client::VerifyClient::Create(target, one);  // a connection of its own
  auto id = a->CreateSequence("s");
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(a->AppendKv(*id, 0, kLayers, 1, std::vector<Bf16>(kLayers * kLatentDim)).ok());
  const Step step = RandomStep(1);
  const client::VerifyItemInput item = step.Item(*id, 0);
  auto open = [&](client::VerifyClient& c) {
    auto stream = c.OpenVerifyStream(absl::Seconds(30));
    EXPECT_TRUE(stream.ok());
    return *std::move(stream);
  };
  // Three streams on one connection: the server meets them in an order of
  // its own, and exactly one of them is refused.
  std::vector<std::unique_ptr<client::VerifyStreamSession>> on_a, served;
  for (int i = 0; i < 3; ++i) on_a.push_back(open(*a));
  int refused = 0;
  for (auto& stream : on_a) {
    const absl::Status status = stream->Verify(0, absl::MakeConstSpan(&item, 1)).status();
    if (status.ok()) {
      served.push_back(std::move(stream));
      continue;
    }
    ++refused;
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("--max-streams-per-connection 2"));
  }
  ASSERT_EQ(refused, 1);
  ASSERT_EQ(served.size(), 2u);
  client::VerifyStreamSession& busy = *served[0];
  client::VerifyStreamSession& idle = *served[1];
  auto other = open(*b);
  EXPECT_TRUE(other->Verify(0, absl::MakeConstSpan(&item, 1)).ok()) << "another connection";

  EXPECT_EQ(server->EndIdleStreams(), 0) << "nothing idle yet";
  absl::SleepFor(absl::Milliseconds(1700));
  EXPECT_TRUE(busy.Verify(0, absl::MakeConstSpan(&item, 1)).ok()) << "busy again";
  EXPECT_EQ(server->EndIdleStreams(), 2) << "idle and other were idle";
  const absl::Status ended = idle.Verify(0, absl::MakeConstSpan(&item, 1)).status();
  EXPECT_EQ(ended.code(), absl::StatusCode::kUnavailable) << ended;
  EXPECT_THAT(std::string(ended.message()), HasSubstr("--stream-idle-timeout-s"));
  EXPECT_TRUE(busy.Verify(0, absl::MakeConstSpan(&item, 1)).ok());
  // The ended stream's place on the connection is free again.
  auto fourth = open(*a);
  EXPECT_TRUE(fourth->Verify(0, absl::MakeConstSpan(&item, 1)).ok());
  EXPECT_TRUE(busy.Close().ok());
  EXPECT_TRUE(fourth->Close().ok());
}

// Readiness that sees the serving path: the probe says "answering" only
// while the port answers a health check SERVING within the deadline: not a
// port that accepts connections and says nothing (a wedged transport), not
// a server that is not serving; in process when the port takes TLS only.
TEST_F(ServerTest, ServingPathProbeSeesAPortThatDoesNotAnswer) {
  const auto wait_checks = [](const transport::ServingPathProbe& probe, int64_t n) {
    for (int i = 0; i < 500 && probe.checks() < n; ++i) absl::SleepFor(absl::Milliseconds(10));
  };
  // A listening socket nobody reads from: connections are accepted by the
  // kernel, no HTTP/2 answer ever comes.
  const int silent = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(silent, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(silent, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(silent, 16), 0);
  socklen_t len = sizeof addr;
  ASSERT_EQ(getsockname(silent, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  {
    transport::ServingPathProbe probe(
        grpc::CreateChannel("127.0.0.1:" + std::to_string(ntohs(addr.sin_port)),
                            grpc::InsecureChannelCredentials()),
        absl::Milliseconds(50), absl::Milliseconds(200));
    wait_checks(probe, 2);
    EXPECT_GE(probe.checks(), 2);
    EXPECT_FALSE(probe.answering());
  }
  close(silent);

  // The test's server: not serving yet, then serving, then draining.
  EXPECT_TRUE(server_->serving_path_answers()) << "no probe started: the state decides";
  server_->StartServingProbe(absl::Milliseconds(50), absl::Milliseconds(500));
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(server_->serving_path_answers()) << "health says NOT_SERVING before SetServing";
  Serve();
  bool answered = false;
  for (int i = 0; i < 200 && !answered; ++i) {
    answered = server_->serving_path_answers();
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(answered);
}

// A call whose deadline passes while it waits for the device is not run, and
// the step it would have opened is taken back: the sequence is as before.
// Bytes that do not parse are bad input: INVALID_ARGUMENT naming the RPC
// (not gRPC's UNIMPLEMENTED with no message), nothing created.
TEST_F(ServerTest, UndecodableRequestsAreInvalidArgument) {
  Serve();
  grpc::GenericStub generic(channel_);
  const auto call = [&](const std::string& method, const std::string& bytes) {
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::ClientContext ctx;
    absl::Notification done;
    grpc::Status status;
    generic.UnaryCall(&ctx, "/mlaverify.v1.VerifyService/" + method, grpc::StubOptions(), &request,
                      &response, [&](grpc::Status s) {
                        status = std::move(s);
                        done.Notify();
                      });
    done.WaitForNotification();
    return status;
  };
  for (const std::string& bytes :
       {std::string("\xff\xff\xff\xff"), std::string("\x08\xff"),
        std::string("\x0a\x02\xc3\x28")}) {  // garbage, truncated varint, invalid UTF-8
    const grpc::Status status = call("CreateSequence", bytes);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(),
                testing::HasSubstr("do not parse as mlaverify.v1.CreateSequenceRequest"));
  }
  EXPECT_EQ(call("Verify", "\x12\x05\x08").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(engine_->Stats().live_sequences, 0);

  // (A stream's undecodable message is answered in band and the stream goes
  // on: tests/abuse_test.py sends one over raw HTTP/2.)
}

TEST_F(ServerTest, DeadlineThatPassesWhileQueuedChangesNothing) {
  Make(SlowDevice(absl::Milliseconds(300)));
  Serve();
  client::SequenceMirror ma(kLayers), mb(kLayers);
  const uint64_t a = NewSequence(8, &ma), b = NewSequence(8, &mb);
  const int64_t free_before = FreePages();
  const Step sa = RandomStep(2), sb = RandomStep(3);
  std::thread busy([&] {
    const client::VerifyItemInput item = sa.Item(a, 0);
    EXPECT_TRUE(client_->Verify(0, absl::MakeConstSpan(&item, 1)).ok());
  });
  absl::SleepFor(absl::Milliseconds(50));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  v1::VerifyRequest r;
  r.set_layer(0);
  v1::VerifyItem* item = r.add_items();
  item->set_sequence_id(b);
  for (int32_t p : sb.parents) item->add_parents(p);
  client::SetBf16Tensor({3, kHeads, kRow}, sb.q[0], item->mutable_q());
  client::SetBf16Tensor({3, kRow}, sb.draft_kv[0], item->mutable_draft_kv());
  v1::VerifyResponse resp;
  EXPECT_EQ(stub_->Verify(&ctx, r, &resp).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  busy.join();
  // Once the device passed it, b has no open step and its page is back.
  absl::SleepFor(absl::Milliseconds(400));
  EXPECT_EQ(engine_->Stats().pending_steps, 1) << "only a's step";
  EXPECT_EQ(FreePages(), free_before - 1) << "a's draft page only";
  EXPECT_EQ(client_->Commit(b, {}).status().code(), absl::StatusCode::kFailedPrecondition);
}

// OpenSequence's handle releases its sequence when it goes, early returns
// included; Release reports, Detach keeps the sequence, a moved-from handle
// releases nothing twice.
TEST_F(ServerTest, SequenceHandleReleasesWhenItGoes) {
  Serve();
  const int64_t free_before = FreePages();
  const std::vector<Bf16> kv = RandomBf16(rng_, kLayers * 20 * kLatentDim, 1.0f);
  uint64_t gone = 0;
  {
    auto handle = client_->OpenSequence("scoped");
    ASSERT_TRUE(handle.ok()) << handle.status();
    gone = handle->id();
    ASSERT_TRUE(client_->AppendKv(gone, 0, kLayers, 20, kv).ok());
    EXPECT_LT(FreePages(), free_before);
    client::SequenceHandle moved = std::move(*handle);
    EXPECT_EQ(handle->id(), 0u);
    EXPECT_EQ(moved.id(), gone);
  }
  EXPECT_EQ(FreePages(), free_before) << "the handle released its sequence when it went";
  EXPECT_EQ(client_->ReleaseSequence(gone).status().code(), absl::StatusCode::kNotFound);

  auto kept = client_->OpenSequence("kept");
  ASSERT_TRUE(kept.ok());
  ASSERT_TRUE(client_->AppendKv(kept->id(), 0, kLayers, 20, kv).ok());
  const uint64_t id = kept->Detach();
  *kept = client::SequenceHandle();
  EXPECT_LT(FreePages(), free_before) << "a detached sequence stays";
  auto reported = client_->OpenSequence("reported");
  ASSERT_TRUE(reported.ok());
  auto freed = reported->Release();
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*reported->Release(), 0) << "a released handle releases nothing again";
  ASSERT_TRUE(client_->ReleaseSequence(id).ok());
  EXPECT_EQ(FreePages(), free_before);
}

TEST_F(ServerTest, EveryRpcEndToEnd) {
  Serve();
  auto info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->backend(), "cpu");
  EXPECT_EQ(info->num_layers(), kLayers);
  EXPECT_EQ(info->num_heads(), kHeads);
  EXPECT_EQ(info->latent_dim(), 576);
  EXPECT_EQ(info->max_draft_len(), kMaxDraft);
  EXPECT_EQ(info->max_batch(), kMaxBatch);
  EXPECT_EQ(info->total_pages(), kPoolPages);
  EXPECT_EQ(info->free_pages(), kPoolPages);
  EXPECT_EQ(info->max_message_bytes(), kMaxMessageBytes);

  client::SequenceMirror m1(kLayers), m2(kLayers);
  const uint64_t a = NewSequence(13, &m1);
  const uint64_t b = NewSequence(150, &m2);
  for (int step = 0; step < 3; ++step) RunCheckedStep(a, &m1, RandomStep(step + 2));

  // Two sequences in one Verify call.
  const Step sa = RandomStep(5), sb = RandomStep(3);
  const float scale = engine_->config().default_softmax_scale;
  for (int l = 0; l < kLayers; ++l) {
    const client::VerifyItemInput items[2] = {sa.Item(a, l), sb.Item(b, l)};
    auto results = client_->Verify(l, items);
    ASSERT_TRUE(results.ok()) << results.status();
    EXPECT_TRUE(
        client::CompareWithReference(m1, l, items[0], scale, (*results)[0], 1)->ok(1e-2, 1e-3));
    EXPECT_TRUE(
        client::CompareWithReference(m2, l, items[1], scale, (*results)[1], 1)->ok(1e-2, 1e-3));
  }
  ASSERT_TRUE(client_->Commit(a, {}).ok());
  auto committed = client_->Commit(b, {0});
  ASSERT_TRUE(committed.ok());
  m2.AppendAccepted(sb.draft_kv, {0});
  EXPECT_EQ(committed->length, 151);
  auto freed = client_->ReleaseSequence(a);
  ASSERT_TRUE(freed.ok());
  EXPECT_GT(*freed, 0);
  ASSERT_TRUE(client_->ReleaseSequence(b).ok());
  EXPECT_EQ(FreePages(), kPoolPages);
}

TEST_F(ServerTest, StreamAnswersInOrderAndSurvivesABadRequest) {
  Serve();
  client::SequenceMirror m(kLayers);
  const uint64_t id = NewSequence(40, &m);
  auto stream = client_->OpenVerifyStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  const Step s = RandomStep(6);
  const float scale = engine_->config().default_softmax_scale;
  for (int l = 0; l < kLayers; ++l) {
    // A bad request between good ones: answered with its code, stream goes on.
    client::VerifyItemInput bad = s.Item(id, l);
    const std::vector<int32_t> cyclic = {-1, 3, 0, 1, 2, 4};
    bad.parents = cyclic;
    auto refused = (*stream)->Verify(l, absl::MakeConstSpan(&bad, 1));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    const client::VerifyItemInput item = s.Item(id, l);
    auto results = (*stream)->Verify(l, absl::MakeConstSpan(&item, 1));
    ASSERT_TRUE(results.ok()) << results.status();
    EXPECT_TRUE(client::CompareWithReference(m, l, item, scale, (*results)[0], 1)->ok(1e-2, 1e-3));
  }
  EXPECT_TRUE((*stream)->Close().ok());
  ASSERT_TRUE(client_->Commit(id, {0}).ok());
}

// A request over max_message_bytes (but within twice it) is answered
// RESOURCE_EXHAUSTED by the service, counted, and changes nothing; on a
// VerifyStream the answer is in band and the stream goes on. Beyond twice the
// limit gRPC refuses the message itself.
TEST_F(ServerTest, OversizedRequestsAreCountedAndKeepTheStreamOpen) {
  Serve();
  client::SequenceMirror m(kLayers);
  const uint64_t id = NewSequence(40, &m);
  const int64_t free_before = FreePages();
  const Step s = RandomStep(4);
  const client::VerifyItemInput item = s.Item(id, 0);
  absl::StatusOr<v1::VerifyRequest> good = client::BuildVerifyRequest(0, {&item, 1}, 0.0f, 0);
  ASSERT_TRUE(good.ok()) << good.status();
  v1::VerifyRequest oversized = *good;
  oversized.mutable_items(0)->mutable_q()->mutable_raw()->append(kMaxMessageBytes, '\0');

  {
    grpc::ClientContext ctx;
    v1::VerifyResponse response;
    const grpc::Status st = stub_->Verify(&ctx, oversized, &response);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(st.error_message(), HasSubstr("over the server's max_message_bytes"));
  }
  EXPECT_EQ(oversize_.count("Verify"), 1);
  EXPECT_EQ(FreePages(), free_before);
  // Nothing was opened: there is no step to commit.
  EXPECT_EQ(client_->Commit(id, {}).status().code(), absl::StatusCode::kFailedPrecondition);

  {
    v1::VerifyRequest huge = *good;
    huge.mutable_items(0)->mutable_q()->mutable_raw()->append(3 * kMaxMessageBytes, '\0');
    grpc::ClientContext ctx;
    v1::VerifyResponse response;
    EXPECT_EQ(stub_->Verify(&ctx, huge, &response).error_code(),
              grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_EQ(oversize_.count("Verify"), 1);  // gRPC's refusal, before the service
  }

  grpc::ClientContext ctx;
  auto stream = stub_->VerifyStream(&ctx);
  oversized.set_request_id(7);
  ASSERT_TRUE(stream->Write(oversized));
  v1::VerifyResponse answer;
  ASSERT_TRUE(stream->Read(&answer));
  EXPECT_EQ(answer.request_id(), 7u);
  EXPECT_EQ(answer.error_code(), static_cast<int32_t>(grpc::StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_THAT(answer.error_message(), HasSubstr("max_message_bytes"));
  EXPECT_EQ(oversize_.count("VerifyStream"), 1);
  v1::VerifyRequest next = *good;
  next.set_request_id(8);
  ASSERT_TRUE(stream->Write(next));
  ASSERT_TRUE(stream->Read(&answer));
  EXPECT_EQ(answer.request_id(), 8u);
  EXPECT_EQ(answer.error_code(), 0) << answer.error_message();
  ASSERT_EQ(answer.results_size(), 1);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  auto results = client::ParseVerifyResponse({&item, 1}, answer);
  ASSERT_TRUE(results.ok()) << results.status();
  const float scale = engine_->config().default_softmax_scale;
  EXPECT_TRUE(client::CompareWithReference(m, 0, item, scale, (*results)[0], 1)->ok(1e-2, 1e-3));
  EXPECT_TRUE(client_->Commit(id, {}).ok());
}

// A Verify whose inputs are in shared memory is small, yet its inline answer
// (out and lse) can exceed max_message_bytes: it is refused before it runs,
// with nothing changed, in band on a stream, which stays open. (Run, its
// answer would be dropped by gRPC after the step had opened.)
TEST_F(ServerTest, InlineAnswerOverTheMessageLimitIsRefusedBeforeItRuns) {
  max_message_bytes_ = 64 << 10;  // kMaxBatch x kMaxDraft x kHeads x 1 KiB of out = 128 KiB
  MakeWithSharedMemory(engine::MakeCpuDevice(2));
  Serve();
  const int n = kMaxDraft;
  const uint64_t item_bytes = client::ShmVerifyItemBytes(n, kHeads);
  auto shm = RegisterBuffer("answers", kMaxBatch * item_bytes);
  std::vector<client::ShmItemPlacement> places;
  std::vector<Step> steps;
  std::vector<uint64_t> ids;
  client::SequenceMirror unused(kLayers);
  for (int k = 0; k < kMaxBatch; ++k) {
    ids.push_back(NewSequence(8, &unused));
    places.push_back(client::PlaceVerifyItem("answers", shm->data(), k * item_bytes, n, kHeads));
    steps.push_back(RandomStep(n));
  }
  std::vector<client::VerifyItemInput> items;
  for (int k = 0; k < kMaxBatch; ++k) {
    items.push_back(steps[k].Item(ids[k], 0));
    items.back().shm = &places[k];
  }
  absl::StatusOr<v1::VerifyRequest> built = client::BuildVerifyRequest(0, items, 0.0f, 0);
  ASSERT_TRUE(built.ok()) << built.status();
  v1::VerifyRequest inline_answer = *built;
  for (v1::VerifyItem& item : *inline_answer.mutable_items()) {
    item.clear_out_shared_memory();
    item.clear_lse_shared_memory();
  }
  ASSERT_LT(inline_answer.ByteSizeLong(), 4096u) << "the request itself is small";
  const int64_t free_before = FreePages();

  {
    grpc::ClientContext ctx;
    v1::VerifyResponse response;
    const grpc::Status st = stub_->Verify(&ctx, inline_answer, &response);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_THAT(st.error_message(), HasSubstr("inline answer"));
    EXPECT_THAT(st.error_message(), HasSubstr("shared memory"));
  }
  EXPECT_EQ(FreePages(), free_before);
  EXPECT_EQ(engine_->Stats().pending_steps, 0) << "no step was opened";

  grpc::ClientContext ctx;
  auto stream = stub_->VerifyStream(&ctx);
  inline_answer.set_request_id(11);
  ASSERT_TRUE(stream->Write(inline_answer));
  v1::VerifyResponse answer;
  ASSERT_TRUE(stream->Read(&answer));
  EXPECT_EQ(answer.request_id(), 11u);
  EXPECT_EQ(answer.error_code(), static_cast<int32_t>(grpc::StatusCode::RESOURCE_EXHAUSTED));
  EXPECT_THAT(answer.error_message(), HasSubstr("inline answer"));
  EXPECT_EQ(engine_->Stats().pending_steps, 0);
  // The same items with their outputs in shared memory run on that stream.
  v1::VerifyRequest in_place = *built;
  in_place.set_request_id(12);
  ASSERT_TRUE(stream->Write(in_place));
  ASSERT_TRUE(stream->Read(&answer));
  EXPECT_EQ(answer.request_id(), 12u);
  EXPECT_EQ(answer.error_code(), 0) << answer.error_message();
  EXPECT_EQ(answer.results_size(), kMaxBatch);
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(engine_->Stats().pending_steps, kMaxBatch);
}

// ---- bad inputs -------------------------------------------------------------

struct BadCase {
  std::string name;
  grpc::StatusCode code;
  std::string message_part;
  // Sends the bad request; returns the status.
  std::function<grpc::Status()> send;
};

TEST_F(ServerTest, BadInputsGetTheirCodeAndChangeNothing) {
  Serve();
  client::SequenceMirror m(kLayers);
  const uint64_t id = NewSequence(20, &m);
  client::SequenceMirror released_mirror(kLayers);
  const uint64_t released = NewSequence(3, &released_mirror);
  ASSERT_TRUE(client_->ReleaseSequence(released).ok());
  const Step s = RandomStep(4);
  // A well-formed request for layer 0; each case breaks one thing of a copy.
  const client::VerifyItemInput good_item = s.Item(id, 0);
  const v1::VerifyRequest good =
      *client::BuildVerifyRequest(0, absl::MakeConstSpan(&good_item, 1), 0.0f, 1);
  auto verify = [this](const v1::VerifyRequest& r) {
    grpc::ClientContext ctx;
    v1::VerifyResponse resp;
    return stub_->Verify(&ctx, r, &resp);
  };
  auto modified = [&](std::function<void(v1::VerifyRequest*)> edit) {
    v1::VerifyRequest r = good;
    edit(&r);
    return [r, verify] { return verify(r); };
  };
  auto append = [this](const v1::AppendKvRequest& r) {
    grpc::ClientContext ctx;
    v1::AppendKvResponse resp;
    return stub_->AppendKv(&ctx, r, &resp);
  };
  auto commit = [this](uint64_t seq, std::vector<int32_t> accepted) {
    grpc::ClientContext ctx;
    v1::CommitRequest r;
    r.set_sequence_id(seq);
    for (int32_t a : accepted) r.add_accepted(a);
    v1::CommitResponse resp;
    return stub_->Commit(&ctx, r, &resp);
  };
  const std::vector<Bf16> one_token(kLayers * kLatentDim);
  v1::AppendKvRequest good_append;
  good_append.set_sequence_id(id);
  good_append.set_start_position(20);
  client::SetBf16Tensor({int64_t{kLayers}, 1, kRow}, one_token, good_append.mutable_kv());

  using grpc::StatusCode;
  std::vector<BadCase> cases = {
      {"q with a byte short", StatusCode::INVALID_ARGUMENT, "bytes of data",
       modified([](v1::VerifyRequest* r) {
         r->mutable_items(0)->mutable_q()->mutable_raw()->pop_back();
       })},
      {"q shape for 3 drafts, tree of 4", StatusCode::INVALID_ARGUMENT, "shape",
       modified([](v1::VerifyRequest* r) { r->mutable_items(0)->mutable_q()->set_shape(0, 3); })},
      {"q as fp32", StatusCode::INVALID_ARGUMENT, "dtype", modified([](v1::VerifyRequest* r) {
         r->mutable_items(0)->mutable_q()->set_dtype(v1::DTYPE_FP32);
       })},
      {"draft_kv [N, 512]", StatusCode::INVALID_ARGUMENT, "draft_kv",
       modified([](v1::VerifyRequest* r) {
         r->mutable_items(0)->mutable_draft_kv()->set_shape(1, 512);
       })},
      {"ServerInfo says shared memory is off", StatusCode::OK, "",
       [&] {
         return client_->GetServerInfo()->client_shared_memory()
                    ? grpc::Status(grpc::StatusCode::INTERNAL, "client_shared_memory is true")
                    : grpc::Status::OK;
       }},
      {"q in shared memory on a server without --allow-client-shm", StatusCode::FAILED_PRECONDITION,
       "--allow-client-shm", modified([](v1::VerifyRequest* r) {
         v1::SharedMemoryRef* ref = r->mutable_items(0)->mutable_q()->mutable_shared_memory();
         ref->set_region("r");
         ref->set_byte_size(4 * kHeads * kLatentDim * 2);
       })},
      {"shared-memory registration without --allow-client-shm", StatusCode::FAILED_PRECONDITION,
       "--allow-client-shm",
       [&] {
         grpc::ClientContext ctx;
         v1::RegisterSystemSharedMemoryRequest r;
         r.set_name("r");
         r.set_key("/mlaverify-test-none");
         r.set_byte_size(4096);
         v1::RegisterSystemSharedMemoryResponse resp;
         return stub_->RegisterSystemSharedMemory(&ctx, r, &resp);
       }},
      {"N above the largest bucket", StatusCode::INVALID_ARGUMENT, "need 1..8",
       modified([](v1::VerifyRequest* r) {
         for (int i = 4; i < 9; ++i) r->mutable_items(0)->add_parents(i - 1);
       })},
      {"no drafts", StatusCode::INVALID_ARGUMENT, "drafts",
       modified([](v1::VerifyRequest* r) { r->mutable_items(0)->clear_parents(); })},
      {"parent after child", StatusCode::INVALID_ARGUMENT, "parents[1]",
       modified([](v1::VerifyRequest* r) { r->mutable_items(0)->set_parents(1, 3); })},
      {"own parent", StatusCode::INVALID_ARGUMENT, "parents[2]",
       modified([](v1::VerifyRequest* r) { r->mutable_items(0)->set_parents(2, 2); })},
      {"parent below -1", StatusCode::INVALID_ARGUMENT, "parents[0]",
       modified([](v1::VerifyRequest* r) { r->mutable_items(0)->set_parents(0, -2); })},
      {"unknown sequence", StatusCode::NOT_FOUND, "not found",
       modified([](v1::VerifyRequest* r) { r->mutable_items(0)->set_sequence_id(987654); })},
      {"released sequence", StatusCode::NOT_FOUND, "not found",
       modified(
           [released](v1::VerifyRequest* r) { r->mutable_items(0)->set_sequence_id(released); })},
      {"layer past the last", StatusCode::INVALID_ARGUMENT, "layer",
       modified([](v1::VerifyRequest* r) { r->set_layer(kLayers); })},
      {"negative layer", StatusCode::INVALID_ARGUMENT, "layer",
       modified([](v1::VerifyRequest* r) { r->set_layer(-1); })},
      {"no items", StatusCode::INVALID_ARGUMENT, "no items",
       modified([](v1::VerifyRequest* r) { r->clear_items(); })},
      {"same sequence twice", StatusCode::INVALID_ARGUMENT, "twice",
       modified([](v1::VerifyRequest* r) { *r->add_items() = r->items(0); })},
      {"more items than max_batch", StatusCode::INVALID_ARGUMENT, "max_batch",
       modified([](v1::VerifyRequest* r) {
         for (int k = 0; k < kMaxBatch; ++k) *r->add_items() = r->items(0);
       })},
      {"NaN softmax scale", StatusCode::INVALID_ARGUMENT, "finite",
       modified([](v1::VerifyRequest* r) { r->set_softmax_scale(NAN); })},
      {"append at the wrong position", StatusCode::FAILED_PRECONDITION, "length 20",
       [&] {
         v1::AppendKvRequest r = good_append;
         r.set_start_position(19);
         return append(r);
       }},
      {"append with the wrong layer count", StatusCode::INVALID_ARGUMENT, "shape",
       [&] {
         v1::AppendKvRequest r = good_append;
         r.mutable_kv()->set_shape(0, kLayers + 1);
         return append(r);
       }},
      {"append with a byte short", StatusCode::INVALID_ARGUMENT, "bytes",
       [&] {
         v1::AppendKvRequest r = good_append;
         r.mutable_kv()->mutable_raw()->pop_back();
         return append(r);
       }},
      {"append whose shape overflows a 64-bit byte count", StatusCode::INVALID_ARGUMENT,
       "too large",
       [&] {
         v1::AppendKvRequest r = good_append;
         r.mutable_kv()->set_shape(1, int64_t{1} << 55);
         return append(r);
       }},
      {"append with a negative token count", StatusCode::INVALID_ARGUMENT, "T >= 1",
       [&] {
         v1::AppendKvRequest r = good_append;
         r.mutable_kv()->set_shape(1, -4);
         return append(r);
       }},
      {"append to an unknown sequence", StatusCode::NOT_FOUND, "not found",
       [&] {
         v1::AppendKvRequest r = good_append;
         r.set_sequence_id(424242);
         return append(r);
       }},
      {"append past the pool's capacity", StatusCode::RESOURCE_EXHAUSTED, "KV pool exhausted",
       [&] {
         const int64_t tokens = kPoolPages * kPage;  // 384 tokens = 885 KB: under the limit
         const std::vector<Bf16> kv(kLayers * tokens * kLatentDim);
         v1::AppendKvRequest r = good_append;
         client::SetBf16Tensor({int64_t{kLayers}, tokens, kRow}, kv, r.mutable_kv());
         return append(r);
       }},
      {"oversized message", StatusCode::RESOURCE_EXHAUSTED, "",
       [&] {
         const int64_t tokens = 500;  // 1.15 MB > 1 MiB limit
         const std::vector<Bf16> kv(kLayers * tokens * kLatentDim);
         v1::AppendKvRequest r = good_append;
         client::SetBf16Tensor({int64_t{kLayers}, tokens, kRow}, kv, r.mutable_kv());
         return append(r);
       }},
      {"commit without a pending step", StatusCode::FAILED_PRECONDITION, "no pending",
       [&] { return commit(id, {}); }},
      {"commit of an unknown sequence", StatusCode::NOT_FOUND, "not found",
       [&] { return commit(31337, {}); }},
      {"release of a released sequence", StatusCode::NOT_FOUND, "not found",
       [&] {
         grpc::ClientContext ctx;
         v1::ReleaseSequenceRequest r;
         r.set_sequence_id(released);
         v1::ReleaseSequenceResponse resp;
         return stub_->ReleaseSequence(&ctx, r, &resp);
       }},
  };

  for (const BadCase& c : cases) {
    const int64_t free_before = FreePages();
    const grpc::Status status = c.send();
    EXPECT_EQ(status.error_code(), c.code) << c.name << ": " << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(c.message_part)) << c.name;
    EXPECT_EQ(FreePages(), free_before) << c.name << " changed the page count";
    EXPECT_EQ(engine_->Stats().pending_steps, 0) << c.name << " opened a step";
    EXPECT_EQ(*client_->Health(), client::ServingStatus::kServing) << c.name;
  }

  // Bad inputs during a pending step. Draft 1 is either not a root ({1} is no
  // path) or a root ({0, 1} is no path).
  const std::vector<int32_t> not_a_path =
      s.parents[1] != -1 ? std::vector<int32_t>{1} : std::vector<int32_t>{0, 1};
  ASSERT_TRUE(verify(good).ok());
  const int64_t free_pending = FreePages();
  std::vector<BadCase> pending_cases = {
      {"another tree in the same step", StatusCode::FAILED_PRECONDITION, "same parents",
       modified([](v1::VerifyRequest* r) { r->mutable_items(0)->set_parents(3, -1); })},
      {"append during a step", StatusCode::FAILED_PRECONDITION, "pending",
       [&] { return append(good_append); }},
      {"accepting with a layer not verified", StatusCode::FAILED_PRECONDITION, "1 of 2 layers",
       [&] { return commit(id, {0}); }},
      {"accepted drafts that are not a root-to-node path", StatusCode::INVALID_ARGUMENT, "path",
       [&] { return commit(id, not_a_path); }},
      {"accepted index out of range", StatusCode::INVALID_ARGUMENT, "not a draft index",
       [&] { return commit(id, {7}); }},
  };
  for (const BadCase& c : pending_cases) {
    const grpc::Status status = c.send();
    EXPECT_EQ(status.error_code(), c.code) << c.name << ": " << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(c.message_part)) << c.name;
    EXPECT_EQ(FreePages(), free_pending) << c.name;
    EXPECT_EQ(engine_->Stats().pending_steps, 1) << c.name;
  }
  // Dropping the step restores the pages; then the sequence works as if
  // nothing had happened.
  ASSERT_TRUE(client_->Commit(id, {}).ok());
  RunCheckedStep(id, &m, RandomStep(4));
  RunCheckedStep(id, &m, RandomStep(kMaxDraft));
}

// ---- system shared memory ---------------------------------------------------

// Verify (unary and stream) and AppendKv through a registered region give the
// reference's answers; the region's use is counted, and it goes away on
// request once no call holds it.
TEST_F(ServerTest, SharedMemoryDataPlaneEndToEnd) {
  MakeWithSharedMemory(engine::MakeCpuDevice(2));
  Serve();
  EXPECT_TRUE(client_->GetServerInfo()->client_shared_memory());
  const int n = 4;
  const uint64_t item_bytes = client::ShmVerifyItemBytes(n, kHeads);
  const uint64_t staging_bytes = 3 * kLayers * kLatentDim * 2;  // 3 tokens: the prompt goes in 7
  auto shm = RegisterBuffer("plane", 2 * item_bytes + staging_bytes);
  const client::ShmStaging staging{"plane", shm->data(), 2 * item_bytes, staging_bytes};

  client::SequenceMirror m(kLayers);
  auto id = client_->CreateSequence("shm");
  ASSERT_TRUE(id.ok());
  const int64_t prompt = 20;
  const std::vector<Bf16> kv = RandomBf16(rng_, kLayers * prompt * kLatentDim, 1.0f);
  auto appended = client_->AppendKv(*id, 0, kLayers, prompt, kv, &staging);
  ASSERT_TRUE(appended.ok()) << appended.status();
  EXPECT_EQ(appended->length, prompt);
  EXPECT_EQ(appended->chunks, 7);
  m.AppendPrompt(kv, prompt);
  // What the server holds is what was staged, chunk by chunk.
  std::vector<Bf16> held(kLayers * prompt * kLatentDim);
  ASSERT_TRUE(engine_->ReadKv(*id, 0, prompt, absl::MakeSpan(held)).ok());
  EXPECT_EQ(std::memcmp(held.data(), kv.data(), kv.size() * sizeof(Bf16)), 0);

  const float scale = engine_->config().default_softmax_scale;
  const client::ShmItemPlacement place =
      client::PlaceVerifyItem("plane", shm->data(), 0, n, kHeads);
  auto stream = client_->OpenVerifyStream();
  ASSERT_TRUE(stream.ok());
  for (int step = 0; step < 2; ++step) {
    const Step s = RandomStep(n);
    for (int l = 0; l < kLayers; ++l) {
      client::VerifyItemInput item = s.Item(*id, l);
      item.shm = &place;
      auto results = step == 0 ? client_->Verify(l, absl::MakeConstSpan(&item, 1))
                               : (*stream)->Verify(l, absl::MakeConstSpan(&item, 1));
      ASSERT_TRUE(results.ok()) << results.status();
      auto cmp = client::CompareWithReference(m, l, item, scale, (*results)[0], 1);
      ASSERT_TRUE(cmp.ok()) << cmp.status();
      EXPECT_TRUE(cmp->ok(1e-2, 1e-3)) << "step " << step << " layer " << l;
    }
    auto committed = client_->Commit(*id, {0});
    ASSERT_TRUE(committed.ok()) << committed.status();
    m.AppendAccepted(s.draft_kv, {0});
  }
  ASSERT_TRUE((*stream)->Close().ok());

  auto regions = client_->SystemSharedMemoryStatus();
  ASSERT_TRUE(regions.ok()) << regions.status();
  ASSERT_EQ(regions->size(), 1u);
  EXPECT_EQ((*regions)[0].name(), "plane");
  EXPECT_EQ((*regions)[0].key(), shm->key());
  EXPECT_EQ((*regions)[0].calls_total(), 7 + 2 * kLayers);
  EXPECT_EQ((*regions)[0].calls_in_flight(), 0);
  auto gone = client_->UnregisterSystemSharedMemory("plane");
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_EQ(*gone, std::vector<std::string>{"plane"});
  const Step last = RandomStep(n);
  client::VerifyItemInput item = last.Item(*id, 0);
  item.shm = &place;
  EXPECT_EQ(client_->Verify(0, absl::MakeConstSpan(&item, 1)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->Stats().pending_steps, 0);
}

// Device-driven steps over gRPC with host doorbells: one OpenStep, every
// layer rung and awaited through slots in a system region (no call per
// layer), each layer's outputs in the region checked against the
// reference, then Commit; an aborted step's waits end with ABORTED and
// change nothing; GPU doorbells on the CPU backend are refused.
TEST_F(ServerTest, DeviceDrivenStepsEndToEnd) {
  MakeWithSharedMemory(engine::MakeCpuDevice(2));
  Serve();
  auto info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->host_doorbells());
  EXPECT_FALSE(info->gpu_doorbells());
  EXPECT_EQ(info->step_lanes_per_device(), engine_->config().steps.lanes_per_device);
  const int n = 5;
  const uint64_t q_bytes = n * kHeads * kLatentRowBytes, kv_bytes = n * kLatentRowBytes;
  const uint64_t out_bytes = n * kHeads * kValueDim * sizeof(Bf16);
  const uint64_t lse_bytes = n * kHeads * sizeof(float);
  // Every layer's tensors side by side (layer strides), then the slots.
  const uint64_t q_at = 0, kv_at = q_at + kLayers * q_bytes, out_at = kv_at + kLayers * kv_bytes,
                 lse_at = out_at + kLayers * out_bytes, slots_at = lse_at + kLayers * lse_bytes;
  auto shm = RegisterBuffer("steps", slots_at + 2 * kHostSlotBytes);
  client::SequenceMirror m(kLayers);
  const uint64_t id = NewSequence(19, &m);
  const float scale = engine_->config().default_softmax_scale;
  const int64_t free_before = FreePages();
  const auto spec_of = [&](const Step& s) {
    client::StepSpec spec;
    spec.items.push_back({id, s.parents});
    client::StepRankSpec rank;
    rank.items.push_back({{"steps", q_at, q_bytes},
                          {"steps", kv_at, kv_bytes},
                          {"steps", out_at, out_bytes},
                          {"steps", lse_at, lse_bytes}});
    rank.doorbell_region = "steps";
    rank.doorbell_offset = slots_at;
    rank.completion_offset = slots_at + kHostSlotBytes;
    rank.doorbell_region_data = shm->data();
    spec.ranks.push_back(rank);
    return spec;
  };
  for (int round = 0; round < 2; ++round) {
    const Step s = RandomStep(n);
    for (int l = 0; l < kLayers; ++l) {
      std::memcpy(shm->data() + q_at + l * q_bytes, s.q[l].data(), q_bytes);
      std::memcpy(shm->data() + kv_at + l * kv_bytes, s.draft_kv[l].data(), kv_bytes);
    }
    auto step = client_->OpenStep(spec_of(s));
    ASSERT_TRUE(step.ok()) << step.status();
    EXPECT_EQ((*step)->prefix_len()[0], m.length());
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE((*step)->Ring(0, l + 1).ok());
      ASSERT_TRUE((*step)->Wait(0, l + 1, absl::Seconds(20)).ok());
      client::VerifyItemResult result;
      result.sequence_id = id;
      result.num_drafts = n;
      result.num_heads = kHeads;
      result.prefix_len = m.length();
      result.out.resize(n * kHeads * kValueDim);
      result.lse.resize(n * kHeads);
      std::memcpy(result.out.data(), shm->data() + out_at + l * out_bytes, out_bytes);
      std::memcpy(result.lse.data(), shm->data() + lse_at + l * lse_bytes, lse_bytes);
      auto cmp = client::CompareWithReference(m, l, s.Item(id, l), scale, result, 1);
      ASSERT_TRUE(cmp.ok()) << cmp.status();
      EXPECT_TRUE(cmp->ok(1e-2, 1e-3)) << "round " << round << " layer " << l;
    }
    EXPECT_EQ(*(*step)->Completed(0), kLayers);
    const std::vector<int32_t> path = {0};
    auto committed = client_->Commit(id, path);
    ASSERT_TRUE(committed.ok()) << committed.status();
    m.AppendAccepted(s.draft_kv, path);
    EXPECT_EQ(committed->length, m.length());
  }
  // Aborted after one layer: its waits end ABORTED, nothing changed.
  const Step s = RandomStep(n);
  auto step = client_->OpenStep(spec_of(s));
  ASSERT_TRUE(step.ok()) << step.status();
  ASSERT_TRUE((*step)->Ring(0, 1).ok());
  ASSERT_TRUE((*step)->Wait(0, 1).ok());
  auto aborted = (*step)->Abort();
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  EXPECT_EQ(aborted->state(), "aborted");
  EXPECT_EQ(aborted->abort_reason(), "abort_call");
  EXPECT_EQ(aborted->error_code(), static_cast<int>(absl::StatusCode::kAborted));
  EXPECT_EQ((*step)->Wait(0, kLayers).code(), absl::StatusCode::kAborted);
  EXPECT_EQ((*step)->Completed(0).status().code(), absl::StatusCode::kAborted);
  auto again = (*step)->Status();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->state(), "aborted");
  EXPECT_EQ(client_->Commit(id, {0}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client_->GetStep(12345).status().code(), absl::StatusCode::kNotFound);
  // GPU doorbells need the CUDA backend; a bad region is NOT_FOUND.
  client::StepSpec gpu = spec_of(s);
  gpu.doorbells = client::Doorbells::kGpu;
  EXPECT_EQ(client_->OpenStep(gpu).status().code(), absl::StatusCode::kFailedPrecondition);
  client::StepSpec bad = spec_of(s);
  bad.ranks[0].items[0].q.region = "nope";
  EXPECT_EQ(client_->OpenStep(bad).status().code(), absl::StatusCode::kNotFound);
  // Only the accepted drafts took pages; the sequence verifies as before.
  EXPECT_LE(FreePages(), free_before);
  EXPECT_EQ(engine_->Stats().pending_steps, 0);
  RunCheckedStep(id, &m, RandomStep(3));
}

// Every malformed registration and reference gets its documented code,
// leaves the sequences and the registry as they were and holds no region.
// This host's first address that is not loopback ("" when it has none):
// calls from it reach the server as from another host would.
std::string NonLoopbackAddress() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string found;
  for (ifaddrs* a = list; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || (a->ifa_flags & IFF_LOOPBACK) || !(a->ifa_flags & IFF_UP)) {
      continue;
    }
    char text[INET6_ADDRSTRLEN] = {};
    if (a->ifa_addr->sa_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof text);
      found = text;
    }
  }
  freeifaddrs(list);
  return found;
}

// Shared memory is for clients on the server's host: IPv6 loopback counts
// (gRPC writes it URI-escaped), another address is refused PERMISSION_DENIED
// wherever a region is registered, named, listed or removed, and the refused
// calls change nothing.
TEST_F(ServerTest, SharedMemoryIsForClientsOnThisHostOnly) {
  MakeWithSharedMemory(engine::MakeCpuDevice(2));
  Serve();
  transport::GrpcServerOptions options;
  options.listen_address = "[::]:0";  // every address, both families
  auto everywhere = transport::GrpcServer::Start(options, nullptr);
  if (!everywhere.ok()) GTEST_SKIP() << "cannot listen on [::]: " << everywhere.status();
  (*everywhere)->AttachEngine(engine_.get());
  (*everywhere)->SetServing();
  const std::string port = std::to_string((*everywhere)->port());

  auto shm = client::SharedMemoryBuffer::Create(1 << 20);
  ASSERT_TRUE(shm.ok()) << shm.status();
  auto v6 = client::VerifyClient::Create("[::1]:" + port, client::ClientOptions{});
  ASSERT_TRUE(v6.ok()) << v6.status();
  ASSERT_TRUE((*v6)->GetServerInfo().ok()) << "no IPv6 loopback here?";
  const absl::Status registered =
      (*v6)->RegisterSystemSharedMemory("v6", (*shm)->key(), 0, 1 << 20);
  ASSERT_TRUE(registered.ok()) << "IPv6 loopback is this host: " << registered;
  ASSERT_TRUE((*v6)->SystemSharedMemoryStatus("v6").ok());
  // Over loopback, but relayed by a proxy (deploy/http2-front adds the
  // header): its client is elsewhere.
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-forwarded-for", "203.0.113.9");
    v1::SystemSharedMemoryStatusRequest request;
    v1::SystemSharedMemoryStatusResponse response;
    const grpc::Status relayed = stub_->SystemSharedMemoryStatus(&ctx, request, &response);
    EXPECT_EQ(relayed.error_code(), grpc::StatusCode::PERMISSION_DENIED) << relayed.error_message();
    EXPECT_THAT(relayed.error_message(), HasSubstr("relayed by a proxy"));
  }

  const std::string address = NonLoopbackAddress();
  if (address.empty()) GTEST_SKIP() << "this host has no address but loopback";
  auto remote = client::VerifyClient::Create(address + ":" + port, client::ClientOptions{});
  ASSERT_TRUE(remote.ok()) << remote.status();
  auto id = (*remote)->CreateSequence("remote");
  ASSERT_TRUE(id.ok()) << "calls without shared memory are served: " << id.status();
  const auto denied = [](const absl::Status& s, const std::string& what) {
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << what << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("on the server's host")) << what;
  };
  denied((*remote)->RegisterSystemSharedMemory("r", (*shm)->key(), 0, 4096), "register");
  denied((*remote)->SystemSharedMemoryStatus("").status(), "system status");
  denied((*remote)->CudaSharedMemoryStatus("").status(), "CUDA status");
  denied((*remote)->UnregisterSystemSharedMemory("").status(), "unregister every region");
  denied((*remote)->UnregisterCudaSharedMemory("").status(), "unregister every CUDA region");
  const std::vector<Bf16> kv(static_cast<size_t>(kLayers) * kLatentDim);
  const client::ShmStaging staging{"v6", (*shm)->data(), 0, 1 << 20};
  denied((*remote)->AppendKv(*id, 0, kLayers, 1, kv, &staging).status(), "AppendKv from a region");
  const int n = 1;
  const client::ShmItemPlacement place =
      client::PlaceVerifyItem("v6", (*shm)->data(), 0, n, kHeads);
  const Step step = RandomStep(n);
  client::VerifyItemInput item = step.Item(*id, 0);
  item.shm = &place;
  denied((*remote)->Verify(0, absl::MakeConstSpan(&item, 1)).status(), "Verify naming a region");
  auto stream = (*remote)->OpenVerifyStream();
  ASSERT_TRUE(stream.ok());
  denied((*stream)->Verify(0, absl::MakeConstSpan(&item, 1)).status(), "a stream's Verify");
  // Nothing changed: the region is there, the sequence is empty.
  auto regions = client_->SystemSharedMemoryStatus("");
  ASSERT_TRUE(regions.ok()) << regions.status();
  ASSERT_EQ(regions->size(), 1u);
  EXPECT_EQ((*regions)[0].name(), "v6");
  EXPECT_EQ(engine_->Stats().tokens_appended_total, 0);
  EXPECT_EQ(engine_->Stats().pending_steps, 0);
  EXPECT_TRUE((*v6)->UnregisterSystemSharedMemory("v6").ok());
}

TEST_F(ServerTest, SharedMemoryBadReferencesGetTheirCodeAndChangeNothing) {
  MakeWithSharedMemory(engine::MakeCpuDevice(2));
  Serve();
  client::SequenceMirror m(kLayers);
  const uint64_t id = NewSequence(20, &m);
  const int n = 4;
  const uint64_t item_bytes = client::ShmVerifyItemBytes(n, kHeads);
  auto shm = RegisterBuffer("r", 2 * item_bytes);
  const client::ShmItemPlacement place = client::PlaceVerifyItem("r", shm->data(), 0, n, kHeads);
  const Step s = RandomStep(n);
  client::VerifyItemInput good_item = s.Item(id, 0);
  good_item.shm = &place;
  const v1::VerifyRequest good =
      *client::BuildVerifyRequest(0, absl::MakeConstSpan(&good_item, 1), 0.0f, 1);
  auto verify = [this](const v1::VerifyRequest& r) {
    grpc::ClientContext ctx;
    v1::VerifyResponse resp;
    return stub_->Verify(&ctx, r, &resp);
  };
  auto modified = [&](std::function<void(v1::VerifyItem*)> edit) {
    v1::VerifyRequest r = good;
    edit(r.mutable_items(0));
    return [r, verify] { return verify(r); };
  };
  auto streamed = [&](std::function<void(v1::VerifyItem*)> edit) {
    v1::VerifyRequest r = good;
    edit(r.mutable_items(0));
    return [this, r] {
      grpc::ClientContext ctx;
      auto stream = stub_->VerifyStream(&ctx);
      stream->Write(r);
      stream->WritesDone();
      v1::VerifyResponse answer;
      EXPECT_TRUE(stream->Read(&answer));
      EXPECT_TRUE(stream->Finish().ok());
      return grpc::Status(static_cast<grpc::StatusCode>(answer.error_code()),
                          answer.error_message());
    };
  };
  auto append_ref = [&](const std::string& region, uint64_t offset, int64_t tokens) {
    return [this, id, region, offset, tokens] {
      v1::AppendKvRequest r;
      r.set_sequence_id(id);
      r.set_start_position(20);
      v1::Tensor* t = r.mutable_kv();
      t->set_dtype(v1::DTYPE_BF16);
      for (int64_t d : {int64_t{kLayers}, tokens, kRow}) t->add_shape(d);
      v1::SharedMemoryRef* ref = t->mutable_shared_memory();
      ref->set_region(region);
      ref->set_offset(offset);
      ref->set_byte_size(static_cast<uint64_t>(kLayers * tokens * kLatentDim * 2));
      grpc::ClientContext ctx;
      v1::AppendKvResponse resp;
      return stub_->AppendKv(&ctx, r, &resp);
    };
  };
  auto reg = [this](const std::string& name, const std::string& key, uint64_t offset,
                    uint64_t bytes) {
    return [this, name, key, offset, bytes] {
      grpc::ClientContext ctx;
      v1::RegisterSystemSharedMemoryRequest r;
      r.set_name(name);
      r.set_key(key);
      r.set_offset(offset);
      r.set_byte_size(bytes);
      v1::RegisterSystemSharedMemoryResponse resp;
      return stub_->RegisterSystemSharedMemory(&ctx, r, &resp);
    };
  };
  const uint64_t q_bytes = static_cast<uint64_t>(n) * kHeads * kLatentDim * 2;
  const uint64_t region_bytes = 2 * item_bytes;

  using grpc::StatusCode;
  std::vector<BadCase> cases = {
      {"unknown region", StatusCode::NOT_FOUND, "no shared-memory region 'nope'",
       modified(
           [](v1::VerifyItem* i) { i->mutable_q()->mutable_shared_memory()->set_region("nope"); })},
      {"q past the region's end", StatusCode::OUT_OF_RANGE, "past the end",
       modified([&](v1::VerifyItem* i) {
         i->mutable_q()->mutable_shared_memory()->set_offset(region_bytes - q_bytes + 256);
       })},
      {"q offset near 2^64", StatusCode::OUT_OF_RANGE, "past the end",
       modified([](v1::VerifyItem* i) {
         i->mutable_q()->mutable_shared_memory()->set_offset(~uint64_t{0} - 1);
       })},
      {"q byte_size a byte short", StatusCode::INVALID_ARGUMENT, "byte_size",
       modified([&](v1::VerifyItem* i) {
         i->mutable_q()->mutable_shared_memory()->set_byte_size(q_bytes - 1);
       })},
      {"q offset not bf16-aligned", StatusCode::INVALID_ARGUMENT, "multiple of 2",
       modified([](v1::VerifyItem* i) { i->mutable_q()->mutable_shared_memory()->set_offset(1); })},
      {"lse offset not fp32-aligned", StatusCode::INVALID_ARGUMENT, "multiple of 4",
       modified([](v1::VerifyItem* i) {
         auto* ref = i->mutable_lse_shared_memory();
         ref->set_offset(ref->offset() + 2);
       })},
      {"out overlapping q", StatusCode::INVALID_ARGUMENT, "overlaps",
       modified([](v1::VerifyItem* i) {
         i->mutable_out_shared_memory()->set_offset(i->q().shared_memory().offset());
       })},
      {"lse overlapping out", StatusCode::INVALID_ARGUMENT, "overlaps",
       modified([](v1::VerifyItem* i) {
         i->mutable_lse_shared_memory()->set_offset(i->out_shared_memory().offset() + 64);
       })},
      {"out placed without lse", StatusCode::INVALID_ARGUMENT, "both or neither",
       modified([](v1::VerifyItem* i) { i->clear_lse_shared_memory(); })},
      {"out in an unknown region", StatusCode::NOT_FOUND, "no shared-memory region",
       modified([](v1::VerifyItem* i) { i->mutable_out_shared_memory()->set_region("nope"); })},
      {"out of the wrong size", StatusCode::INVALID_ARGUMENT, "byte_size",
       modified([](v1::VerifyItem* i) {
         auto* ref = i->mutable_out_shared_memory();
         ref->set_byte_size(ref->byte_size() * 2);
       })},
      {"stream: q past the region's end", StatusCode::OUT_OF_RANGE, "past the end",
       streamed([&](v1::VerifyItem* i) {
         i->mutable_q()->mutable_shared_memory()->set_offset(region_bytes);
       })},
      {"stream: out overlapping draft_kv", StatusCode::INVALID_ARGUMENT, "overlaps",
       streamed([](v1::VerifyItem* i) {
         i->mutable_out_shared_memory()->set_offset(i->draft_kv().shared_memory().offset());
       })},
      {"append from an unknown region", StatusCode::NOT_FOUND, "no shared-memory region",
       append_ref("nope", 0, 1)},
      {"append past the region's end", StatusCode::OUT_OF_RANGE, "past the end",
       append_ref("r", 0, static_cast<int64_t>(region_bytes / (kLayers * kLatentDim * 2)) + 1)},
      {"register with an empty name", StatusCode::INVALID_ARGUMENT, "name",
       reg("", shm->key(), 0, 4096)},
      {"register with a key without '/'", StatusCode::INVALID_ARGUMENT, "key",
       reg("k", "mlaverify", 0, 4096)},
      {"register a key outside --shm-key-prefix", StatusCode::PERMISSION_DENIED, "--shm-key-prefix",
       reg("k", "/psm_not_a_scheduler_object", 0, 4096)},
      {"register an object that does not exist", StatusCode::NOT_FOUND, "shm_open",
       reg("k", "/mlaverify-test-does-not-exist", 0, 4096)},
      {"register a name twice", StatusCode::ALREADY_EXISTS, "already registered",
       reg("r", shm->key(), 0, 4096)},
      {"register past the object's end", StatusCode::INVALID_ARGUMENT, "does not fit",
       reg("k", shm->key(), 4096, region_bytes)},
      {"register 0 bytes", StatusCode::INVALID_ARGUMENT, "byte_size is 0",
       reg("k", shm->key(), 0, 0)},
      {"register over --max-shm-bytes", StatusCode::RESOURCE_EXHAUSTED, "--max-shm-bytes",
       reg("k", shm->key(), 0, uint64_t{65} << 20)},
      {"register CUDA memory on the CPU backend", StatusCode::FAILED_PRECONDITION,
       "needs the CUDA backend",
       [&] {
         grpc::ClientContext ctx;
         v1::RegisterCudaSharedMemoryRequest r;
         r.set_name("gpu");
         r.set_raw_handle(std::string(64, '\0'));
         r.set_device_id(0);
         r.set_byte_size(4096);
         v1::RegisterCudaSharedMemoryResponse resp;
         return stub_->RegisterCudaSharedMemory(&ctx, r, &resp);
       }},
      {"register CUDA memory of 0 bytes", StatusCode::INVALID_ARGUMENT, "byte_size is 0",
       [&] {
         grpc::ClientContext ctx;
         v1::RegisterCudaSharedMemoryRequest r;
         r.set_name("gpu");
         r.set_raw_handle(std::string(64, '\0'));
         v1::RegisterCudaSharedMemoryResponse resp;
         return stub_->RegisterCudaSharedMemory(&ctx, r, &resp);
       }},
      {"unregister an unknown region", StatusCode::NOT_FOUND, "no shared-memory region",
       [&] {
         grpc::ClientContext ctx;
         v1::UnregisterSystemSharedMemoryRequest r;
         r.set_name("nope");
         v1::UnregisterSystemSharedMemoryResponse resp;
         return stub_->UnregisterSystemSharedMemory(&ctx, r, &resp);
       }},
      {"status of an unknown region", StatusCode::NOT_FOUND, "no shared-memory region",
       [&] {
         grpc::ClientContext ctx;
         v1::SystemSharedMemoryStatusRequest r;
         r.set_name("nope");
         v1::SystemSharedMemoryStatusResponse resp;
         return stub_->SystemSharedMemoryStatus(&ctx, r, &resp);
       }},
      {"unregister a system region as a CUDA one", StatusCode::NOT_FOUND,
       "no CUDA shared-memory region 'r' is registered (it is a system region)",
       [&] {
         grpc::ClientContext ctx;
         v1::UnregisterCudaSharedMemoryRequest r;
         r.set_name("r");
         v1::UnregisterCudaSharedMemoryResponse resp;
         return stub_->UnregisterCudaSharedMemory(&ctx, r, &resp);
       }},
      {"CUDA status of a system region", StatusCode::NOT_FOUND, "no CUDA shared-memory region",
       [&] {
         grpc::ClientContext ctx;
         v1::CudaSharedMemoryStatusRequest r;
         r.set_name("r");
         v1::CudaSharedMemoryStatusResponse resp;
         return stub_->CudaSharedMemoryStatus(&ctx, r, &resp);
       }},
  };
  for (const BadCase& c : cases) {
    const int64_t free_before = FreePages();
    const grpc::Status status = c.send();
    EXPECT_EQ(status.error_code(), c.code) << c.name << ": " << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr(c.message_part)) << c.name;
    EXPECT_EQ(FreePages(), free_before) << c.name << " changed the page count";
    EXPECT_EQ(engine_->Stats().pending_steps, 0) << c.name << " opened a step";
    EXPECT_EQ(RegionCallsInFlight("r"), 0) << c.name << " left the region held";
    auto regions = client_->SystemSharedMemoryStatus();
    ASSERT_TRUE(regions.ok());
    EXPECT_EQ(regions->size(), 1u) << c.name << " changed the registry";
  }
  // The CUDA-only views see no system region; unregistering every CUDA
  // region removes none.
  auto cuda_regions = client_->CudaSharedMemoryStatus();
  ASSERT_TRUE(cuda_regions.ok()) << cuda_regions.status();
  EXPECT_TRUE(cuda_regions->empty());
  auto no_cuda = client_->UnregisterCudaSharedMemory("");
  ASSERT_TRUE(no_cuda.ok()) << no_cuda.status();
  EXPECT_TRUE(no_cuda->empty());
  // The region limit: two more fit (3 in all), the fourth does not.
  auto second = RegisterBuffer("r2", 4096);
  auto third = RegisterBuffer("r3", 4096);
  EXPECT_EQ(reg("r4", shm->key(), 0, 4096)().error_code(), StatusCode::RESOURCE_EXHAUSTED);
  // The good request still works, and unregistering every region at once
  // removes all three.
  EXPECT_TRUE(verify(good).ok());
  ASSERT_TRUE(client_->Commit(id, {}).ok());
  auto gone = client_->UnregisterSystemSharedMemory("");
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_EQ(gone->size(), 3u);
}

// Alignment and overlap are checked on the object's bytes, whatever the
// regions' names: a region registered at an odd offset cannot serve a bf16
// tensor at its offset 0, and an output in one region may not overlap an
// input through another region over the same object.
TEST_F(ServerTest, SharedMemoryChecksSeeTheObjectNotTheName) {
  MakeWithSharedMemory(engine::MakeCpuDevice(2));
  Serve();
  client::SequenceMirror m(kLayers);
  const uint64_t id = NewSequence(8, &m);
  const int n = 2;
  const uint64_t item_bytes = client::ShmVerifyItemBytes(n, kHeads);
  auto shm = RegisterBuffer("a", 2 * item_bytes);
  ASSERT_TRUE(client_->RegisterSystemSharedMemory("b", shm->key(), 0, 2 * item_bytes).ok());
  ASSERT_TRUE(client_->RegisterSystemSharedMemory("odd", shm->key(), 1, item_bytes).ok());
  const Step s = RandomStep(n);
  client::VerifyItemInput item = s.Item(id, 0);
  const client::ShmItemPlacement place = client::PlaceVerifyItem("a", shm->data(), 0, n, kHeads);
  item.shm = &place;
  v1::VerifyRequest request = *client::BuildVerifyRequest(0, absl::MakeConstSpan(&item, 1), 0, 1);
  auto verify = [this](const v1::VerifyRequest& r) {
    grpc::ClientContext ctx;
    v1::VerifyResponse resp;
    return stub_->Verify(&ctx, r, &resp);
  };
  // out through "b", at the same object bytes as q through "a".
  v1::VerifyRequest aliased = request;
  aliased.mutable_items(0)->mutable_out_shared_memory()->set_region("b");
  aliased.mutable_items(0)->mutable_out_shared_memory()->set_offset(place.q_offset);
  grpc::Status status = verify(aliased);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("overlaps"));
  // q at offset 0 of "odd" is byte 1 of the object.
  v1::VerifyRequest odd = request;
  odd.mutable_items(0)->mutable_q()->mutable_shared_memory()->set_region("odd");
  odd.mutable_items(0)->mutable_q()->mutable_shared_memory()->set_offset(0);
  status = verify(odd);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("multiple of 2"));
  EXPECT_EQ(engine_->Stats().pending_steps, 0);
  // The untouched request works; out through "b" where "a" has it is fine.
  v1::VerifyRequest through_b = request;
  through_b.mutable_items(0)->mutable_out_shared_memory()->set_region("b");
  EXPECT_TRUE(verify(through_b).ok());
  EXPECT_TRUE(client_->Commit(id, {}).ok());
  EXPECT_EQ(client_->UnregisterSystemSharedMemory("")->size(), 3u);
}

// A region a running call holds cannot be unregistered: the call completes
// (its outputs in place), then the region goes.
TEST_F(ServerTest, SharedMemoryRegionHeldByARunningCallStays) {
  MakeWithSharedMemory(SlowDevice(absl::Milliseconds(400)));
  Serve();
  client::SequenceMirror m(kLayers);
  const uint64_t id = NewSequence(8, &m);
  const int n = 2;
  auto shm = RegisterBuffer("held", client::ShmVerifyItemBytes(n, kHeads));
  const client::ShmItemPlacement place = client::PlaceVerifyItem("held", shm->data(), 0, n, kHeads);
  const Step s = RandomStep(n);
  client::VerifyItemInput item = s.Item(id, 0);
  item.shm = &place;
  absl::StatusOr<std::vector<client::VerifyItemResult>> results;
  std::thread call([&] { results = client_->Verify(0, absl::MakeConstSpan(&item, 1)); });
  while (RegionCallsInFlight("held") == 0) absl::SleepFor(absl::Milliseconds(5));
  auto refused = client_->UnregisterSystemSharedMemory("held");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("held by calls in flight"));
  auto refused_all = client_->UnregisterSystemSharedMemory("");
  EXPECT_EQ(refused_all.status().code(), absl::StatusCode::kFailedPrecondition);
  call.join();
  ASSERT_TRUE(results.ok()) << results.status();
  auto cmp = client::CompareWithReference(m, 0, item, engine_->config().default_softmax_scale,
                                          (*results)[0], 1);
  ASSERT_TRUE(cmp.ok());
  EXPECT_TRUE(cmp->ok(1e-2, 1e-3));
  EXPECT_EQ(RegionCallsInFlight("held"), 0);
  EXPECT_TRUE(client_->UnregisterSystemSharedMemory("held").ok());
}

TEST(SharedMemoryRegistryTest, ReleaseAllDropsEveryRegionAndLeasesKeepTheirMapping) {
  engine::RegionOptions options;
  options.enabled = true;
  engine::RegionRegistry registry(options);
  auto shm = client::SharedMemoryBuffer::Create(8192);
  ASSERT_TRUE(shm.ok());
  std::memset((*shm)->data(), 7, 8192);
  ASSERT_TRUE(registry.Register("a", (*shm)->key(), 4096, 4096).ok());
  ASSERT_TRUE(registry.Register("b", (*shm)->key(), 0, 4096).ok());
  EXPECT_EQ(registry.registered_bytes(), 8192);
  engine::RegionLeases leases;
  auto range = leases.Resolve(registry, {"a", 8, 16}, 16, 4, false, {-1, 0, "t"});
  ASSERT_TRUE(range.ok()) << range.status();
  uint8_t* data = range->host();
  EXPECT_EQ(data[0], 7);
  EXPECT_EQ(registry.ReleaseAll(), 2);
  EXPECT_EQ(registry.regions(), 0);
  EXPECT_EQ(registry.registered_bytes(), 0);
  data[0] = 9;  // still mapped: the lease holds it
  EXPECT_EQ((*shm)->data()[4096 + 8], 9);
  leases.Clear();
}

// The server reads and writes what a registration names: only keys under
// the prefix, and only objects of the server's own user.
TEST(SharedMemoryRegistryTest, RegistersOnlyTheSchedulersOwnObjects) {
  engine::RegionOptions options;
  options.enabled = true;
  options.key_prefix = "/owner-test";
  engine::RegionRegistry registry(options);
  const std::string key = absl::StrCat("/owner-test-", getpid());
  const int fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0666);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  absl::Status outside =
      engine::RegionRegistry(engine::RegionOptions{true}).Register("p", key, 0, 4096);
  EXPECT_EQ(outside.code(), absl::StatusCode::kPermissionDenied) << outside;
  EXPECT_THAT(std::string(outside.message()), testing::HasSubstr("--shm-key-prefix '/mlaverify'"));
  EXPECT_TRUE(registry.Register("mine", key, 0, 4096).ok());
  // Another user's object, openable by this process (mode 0666): refused,
  // nothing registered.
  if (geteuid() == 0) {
    ASSERT_EQ(fchown(fd, 65534, 65534), 0) << std::strerror(errno);
    absl::Status foreign = registry.Register("theirs", key, 0, 4096);
    EXPECT_EQ(foreign.code(), absl::StatusCode::kPermissionDenied) << foreign;
    EXPECT_THAT(std::string(foreign.message()), testing::HasSubstr("owned by the server's user"));
    EXPECT_EQ(registry.regions(), 1);
  } else {
    std::printf("not root: the foreign-owner case needs chown and is not run\n");
  }
  close(fd);
  shm_unlink(key.c_str());
}

TEST_F(ServerTest, VerifyExhaustionChangesNothing) {
  Serve();
  client::SequenceMirror m(kLayers), filler_mirror(kLayers);
  const uint64_t id = NewSequence(kPage, &m);  // a full page: drafts need another
  const uint64_t filler = NewSequence((kPoolPages - 1) * kPage, &filler_mirror);
  ASSERT_EQ(FreePages(), 0);
  const Step s = RandomStep(3);
  const client::VerifyItemInput item = s.Item(id, 0);
  auto refused = client_->Verify(0, absl::MakeConstSpan(&item, 1));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("0 of 48 are free"));
  EXPECT_EQ(engine_->Stats().pending_steps, 0);
  ASSERT_TRUE(client_->ReleaseSequence(filler).ok());
  RunCheckedStep(id, &m, s);
}

TEST_F(ServerTest, ExpiredDeadlineIsHonoured) {
  Serve();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() - std::chrono::seconds(1));
  v1::CreateSequenceRequest r;
  v1::CreateSequenceResponse resp;
  EXPECT_EQ(stub_->CreateSequence(&ctx, r, &resp).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(engine_->Stats().live_sequences, 0);
}

// The slow-call warning: written for calls at or over the threshold, with the
// queue and work split; at most one per interval, the held-back ones counted
// into the next with the slowest of them; a threshold of 0 turns it off.
TEST(SlowCallLogTest, WarnsAboutSlowCallsAtMostOncePerInterval) {
  using transport::SlowCallLog;
  const SlowCallLog::Clock::time_point t0{};
  SlowCallLog log(0.1, std::chrono::seconds(1));
  EXPECT_FALSE(log.Report("Verify", "OK", 0.001, 0.098, t0).has_value());
  const auto first = log.Report("Verify", "OK", 0.002, 0.275, t0);
  ASSERT_TRUE(first.has_value());
  EXPECT_THAT(*first, HasSubstr("slow Verify (OK): 277.0 ms in the server, 2.0 ms queued for a "
                                "worker, 275.0 ms working"));
  EXPECT_FALSE(
      log.Report("Commit", "OK", 0.0, 0.2, t0 + std::chrono::milliseconds(500)).has_value());
  EXPECT_FALSE(
      log.Report("Verify", "INTERNAL", 0.0, 0.3, t0 + std::chrono::milliseconds(999)).has_value());
  const auto next = log.Report("Verify", "OK", 0.0, 0.15, t0 + std::chrono::milliseconds(1000));
  ASSERT_TRUE(next.has_value());
  EXPECT_THAT(
      *next, HasSubstr("; 2 more slow calls since the last warning, the slowest Verify (INTERNAL): "
                       "300.0 ms in the server, 0.0 ms queued for a worker, 300.0 ms working"));
  const auto after = log.Report("Verify", "OK", 0.0, 0.15, t0 + std::chrono::milliseconds(2500));
  ASSERT_TRUE(after.has_value());
  EXPECT_THAT(*after, ::testing::Not(HasSubstr("more slow calls")));

  SlowCallLog off(0.0, std::chrono::seconds(1));
  EXPECT_FALSE(off.Report("Verify", "OK", 10.0, 10.0, t0).has_value());
}

}  // namespace
}  // namespace mlaverify
