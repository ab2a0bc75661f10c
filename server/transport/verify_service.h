// The gRPC face of the engine: mlaverify.v1.VerifyService on the callback
// API. Thin on purpose: checks tensor dtypes/shapes/sizes against the
// geometry, points the engine at the request and response bytes, maps
// statuses. Engine calls run on a WorkQueue, never on gRPC's threads.
#ifndef MLAVERIFY_SERVER_TRANSPORT_VERIFY_SERVICE_H_
#define MLAVERIFY_SERVER_TRANSPORT_VERIFY_SERVICE_H_

#include <atomic>
#include <chrono>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/strings/string_view.h"
#include "mlaverify/v1/verify.grpc.pb.h"
#include "server/engine/engine.h"
#include "server/transport/slow_call_log.h"
#include "server/transport/work_queue.h"

namespace mlaverify::transport {

enum class ServingState { kStarting, kServing, kDraining };

// Receives one call per finished RPC (and per message of a stream); the
// server wires it to the metrics. Implementations must be thread-safe.
class RpcObserver {
 public:
  virtual ~RpcObserver() = default;
  virtual void OnRpc(absl::string_view rpc, grpc::StatusCode code, double seconds) = 0;
  virtual void OnVerify(int items, int64_t draft_tokens) = 0;
};

struct ServiceOptions {
  std::string version = "0.1.0";
  int64_t max_message_bytes = 64 << 20;
  int worker_threads = 8;
  // Calls that spend at least this long in the server (queue wait plus
  // work) are logged as warnings, at most one a second; <= 0: off.
  double slow_call_seconds = 0.1;
};

class VerifyServiceImpl final : public v1::VerifyService::CallbackService {
 public:
  // `engine`, `observer` (may be null) and `state` outlive the service.
  VerifyServiceImpl(engine::Engine* engine, const ServiceOptions& options, RpcObserver* observer,
                    const std::atomic<ServingState>* state);
  ~VerifyServiceImpl() override;

  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx,
                                          const v1::GetServerInfoRequest* request,
                                          v1::ServerInfo* response) override;
  grpc::ServerUnaryReactor* CreateSequence(grpc::CallbackServerContext* ctx,
                                           const v1::CreateSequenceRequest* request,
                                           v1::CreateSequenceResponse* response) override;
  grpc::ServerUnaryReactor* AppendKv(grpc::CallbackServerContext* ctx,
                                     const v1::AppendKvRequest* request,
                                     v1::AppendKvResponse* response) override;
  grpc::ServerUnaryReactor* Verify(grpc::CallbackServerContext* ctx,
                                   const v1::VerifyRequest* request,
                                   v1::VerifyResponse* response) override;
  grpc::ServerBidiReactor<v1::VerifyRequest, v1::VerifyResponse>* VerifyStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* Commit(grpc::CallbackServerContext* ctx,
                                   const v1::CommitRequest* request,
                                   v1::CommitResponse* response) override;
  grpc::ServerUnaryReactor* ReleaseSequence(grpc::CallbackServerContext* ctx,
                                            const v1::ReleaseSequenceRequest* request,
                                            v1::ReleaseSequenceResponse* response) override;

  // Verify of one request into `response`; shared by Verify and VerifyStream.
  absl::Status DoVerify(const v1::VerifyRequest& request, v1::VerifyResponse* response);

 private:
  class StreamReactor;

  // Runs `body` on the work queue after the admission checks (serving state,
  // cancellation, deadline), finishes the reactor and reports to the observer.
  template <typename Body>
  grpc::ServerUnaryReactor* RunUnary(absl::string_view rpc, grpc::CallbackServerContext* ctx,
                                     bool allowed_while_draining, Body body);
  absl::Status Admit(grpc::CallbackServerContext* ctx, bool allowed_while_draining) const;
  // One finished call (or stream message), timed from its arrival: `started`
  // is when a worker thread took it up.
  void Observe(absl::string_view rpc, grpc::StatusCode code, std::chrono::steady_clock::time_point arrived,
               std::chrono::steady_clock::time_point started);

  engine::Engine* const engine_;
  const ServiceOptions options_;
  RpcObserver* const observer_;
  const std::atomic<ServingState>* const state_;
  SlowCallLog slow_calls_;
  WorkQueue queue_;
};

}  // namespace mlaverify::transport

#endif  // MLAVERIFY_SERVER_TRANSPORT_VERIFY_SERVICE_H_
