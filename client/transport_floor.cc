#include "client/transport_floor.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "mlaverify/floor/v1/floor.grpc.pb.h"

namespace mlaverify::client {
namespace {

using Clock = std::chrono::steady_clock;
namespace fv1 = mlaverify::floor::v1;

// Bounds a hostile or mistaken size; Verify answers are far below it.
constexpr int64_t kMaxPayloadBytes = int64_t{256} << 20;

// Answers each message with `reply_bytes` of payload, built per answer as the
// real service builds its outputs.
class EchoService final : public fv1::TransportFloor::CallbackService {
 public:
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx,
                                  const fv1::FloorMessage* request,
                                  fv1::FloorMessage* response) override {
    response->mutable_payload()->assign(
        static_cast<size_t>(std::min<uint64_t>(request->reply_bytes(), kMaxPayloadBytes)), '\0');
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerBidiReactor<fv1::FloorMessage, fv1::FloorMessage>* Stream(
      grpc::CallbackServerContext*) override {
    return new PingPong();
  }

 private:
  // Reads one message, writes its answer, reads the next.
  class PingPong final : public grpc::ServerBidiReactor<fv1::FloorMessage, fv1::FloorMessage> {
   public:
    PingPong() { StartRead(&request_); }
    void OnReadDone(bool ok) override {
      if (!ok) return Finish(grpc::Status::OK);
      response_.mutable_payload()->assign(
          static_cast<size_t>(std::min<uint64_t>(request_.reply_bytes(), kMaxPayloadBytes)), '\0');
      StartWrite(&response_);
    }
    void OnWriteDone(bool ok) override {
      if (!ok) return Finish(grpc::Status::CANCELLED);
      StartRead(&request_);
    }
    void OnDone() override { delete this; }

   private:
    fv1::FloorMessage request_, response_;
  };
};

struct ThreadResult {
  std::vector<double> latencies_ms;
  int64_t errors = 0;
  std::string first_error;
};

}  // namespace

absl::StatusOr<FloorReport> MeasureTransportFloor(const FloorOptions& o) {
  if (o.connections < 1 || o.connections > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("transport floor: connections ", o.connections, ": need 1..256"));
  }
  if (o.concurrency < 1 || o.duration_s <= 0 || o.warmup_s < 0 || o.request_bytes < 0 ||
      o.reply_bytes < 0 || o.request_bytes > kMaxPayloadBytes || o.reply_bytes > kMaxPayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "transport floor: concurrency ", o.concurrency, ", duration ", o.duration_s,
        " s, messages of ", o.request_bytes, " / ", o.reply_bytes, " bytes make no run"));
  }
  EchoService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  builder.SetMaxReceiveMessageSize(static_cast<int>(kMaxPayloadBytes + 1024));
  builder.SetMaxSendMessageSize(static_cast<int>(kMaxPayloadBytes + 1024));
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(static_cast<int>(kMaxPayloadBytes + 1024));
  channel_args.SetMaxSendMessageSize(static_cast<int>(kMaxPayloadBytes + 1024));
  if (o.http2_max_frame_bytes > 0) {
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, o.http2_max_frame_bytes);
    channel_args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, o.http2_max_frame_bytes);
  }
  if (o.http2_lookahead_bytes > 0) {
    builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, o.http2_lookahead_bytes);
    channel_args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, o.http2_lookahead_bytes);
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError("transport floor: the echo server did not start");
  }
  // A subchannel pool per channel: each channel is a TCP connection of its
  // own (with the global pool, equal channels would share one).
  channel_args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::vector<std::unique_ptr<fv1::TransportFloor::Stub>> stubs;
  for (int c = 0; c < o.connections; ++c) {
    grpc::ChannelArguments own = channel_args;
    own.SetInt("mlaverify.connection_index", c);
    stubs.push_back(fv1::TransportFloor::NewStub(grpc::CreateCustomChannel(
        absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials(), own)));
  }

  const Clock::time_point start = Clock::now();
  const Clock::time_point measure_from = start + std::chrono::duration_cast<Clock::duration>(
                                                     std::chrono::duration<double>(o.warmup_s));
  const Clock::time_point end = measure_from + std::chrono::duration_cast<Clock::duration>(
                                                   std::chrono::duration<double>(o.duration_s));
  std::vector<ThreadResult> results(o.concurrency);
  std::vector<std::thread> threads;
  for (int t = 0; t < o.concurrency; ++t) {
    threads.emplace_back([&, t] {
      ThreadResult& r = results[t];
      fv1::TransportFloor::Stub* stub = stubs[t % stubs.size()].get();
      const std::string payload(static_cast<size_t>(o.request_bytes), '\x01');
      fv1::FloorMessage request, answer;
      request.set_reply_bytes(static_cast<uint64_t>(o.reply_bytes));
      auto fail = [&r](const std::string& why) {
        if (r.errors++ == 0) r.first_error = why;
      };
      if (!o.stream) {
        while (Clock::now() < end) {
          request.set_payload(payload);  // the client copies its bytes in, as for Verify
          grpc::ClientContext ctx;
          ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
          const Clock::time_point t0 = Clock::now();
          const grpc::Status s = stub->Unary(&ctx, request, &answer);
          const Clock::time_point t1 = Clock::now();
          if (!s.ok()) {
            fail(s.error_message());
            continue;
          }
          if (t0 >= measure_from) {
            r.latencies_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
          }
        }
        return;
      }
      grpc::ClientContext ctx;
      auto stream = stub->Stream(&ctx);
      while (Clock::now() < end) {
        request.set_payload(payload);
        const Clock::time_point t0 = Clock::now();
        if (!stream->Write(request) || !stream->Read(&answer)) {
          fail("stream broke");
          break;
        }
        const Clock::time_point t1 = Clock::now();
        if (t0 >= measure_from) {
          r.latencies_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        }
      }
      stream->WritesDone();
      const grpc::Status s = stream->Finish();
      if (!s.ok()) fail(s.error_message());
    });
  }
  for (std::thread& t : threads) t.join();
  const double measured =
      std::chrono::duration<double>(std::max(Clock::now(), measure_from) - measure_from).count();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));

  FloorReport report;
  std::vector<double> all;
  for (ThreadResult& r : results) {
    all.insert(all.end(), r.latencies_ms.begin(), r.latencies_ms.end());
    report.errors += r.errors;
    if (report.first_error.empty()) report.first_error = r.first_error;
  }
  report.calls = static_cast<int64_t>(all.size());
  report.calls_per_second = measured > 0 ? report.calls / measured : 0.0;
  report.latency_ms = Summarize(std::move(all));
  return report;
}

}  // namespace mlaverify::client
