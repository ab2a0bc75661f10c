// The gRPC face of the engine: mlaverify.v1.VerifyService on the callback
// API. Thin on purpose: turns each message into the engine's types (tensor
// references into the request and response; the engine checks them),
// submits to the engine's asynchronous calls and finishes the RPC from their
// completion.
// It runs no compute and owns no threads: gRPC's callback threads only decode,
// submit and encode.
// Every method is registered raw (bytes in, bytes out) and decoded here, so
// that bytes which do not parse are bad input like any other: INVALID_ARGUMENT
// naming the RPC, counted and logged (in band on a VerifyStream, which goes
// on). gRPC's typed handlers answer them UNIMPLEMENTED with no message and
// end a stream with OK.
#ifndef MLAVERIFY_SERVER_TRANSPORT_VERIFY_SERVICE_H_
#define MLAVERIFY_SERVER_TRANSPORT_VERIFY_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/any_invocable.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "mlaverify/v1/verify.grpc.pb.h"
#include "server/engine/engine.h"
#include "server/transport/log_limiter.h"
#include "server/transport/slow_call_log.h"

namespace mlaverify::transport {

// kDrainGrace: health NOT_SERVING (load balancers move away) but calls are
// still served; kDraining: new work refused. kFaulted: a device failed;
// health NOT_SERVING, device calls UNAVAILABLE.
enum class ServingState { kStarting, kServing, kDrainGrace, kDraining, kFaulted };

// What a drain did, for its closing log line.
struct DrainCounts {
  int64_t calls_in_flight_at_close = 0;  // unary calls and stream requests
  int64_t calls_finished = 0;            // finished between the close and the end
  int64_t calls_cut = 0;                 // still running when the timeout ended them
  int64_t streams_ended = 0;             // VerifyStreams ended with UNAVAILABLE
};

// Receives one call per finished RPC (and per message of a stream); the
// server wires it to the metrics. Implementations must be thread-safe.
class RpcObserver {
 public:
  virtual ~RpcObserver() = default;
  virtual void OnRpc(absl::string_view rpc, grpc::StatusCode code, double seconds) = 0;
  // A request over max_message_bytes was refused (it is also in OnRpc).
  virtual void OnOversizedRequest(absl::string_view rpc) {}
};

// gRPC's own receive limit for a service whose messages may be
// `max_message_bytes`: twice that (at most INT_MAX), so a request somewhat
// over the limit still reaches the service, which answers it with a precise
// RESOURCE_EXHAUSTED (in band on a VerifyStream, which stays open) and
// counts it. Beyond this, gRPC refuses the message and ends the call.
int TransportReceiveLimit(int64_t max_message_bytes);

struct ServiceOptions {
  std::string version = "0.1.0";
  int64_t max_message_bytes = 64 << 20;
  // Calls that spend at least this long in the server are logged as
  // warnings, at most one a second; <= 0: off.
  double slow_call_seconds = 0.1;
  // Requests of one VerifyStream the server works on at once (read ahead of
  // the answers, answered in order).
  int stream_max_in_flight = 8;
  // VerifyStreams open at once, over all connections; one more is refused
  // with RESOURCE_EXHAUSTED. Each holds up to stream_max_in_flight answers.
  int max_streams = 256;
  // VerifyStreams open at once on one connection (one more is refused with
  // RESOURCE_EXHAUSTED), so that no one connection takes every slot.
  int max_streams_per_connection = 64;
  // A VerifyStream with nothing in flight and no request for this long ends
  // with UNAVAILABLE (EndIdleStreams); zero: never.
  absl::Duration stream_idle_timeout = absl::Minutes(10);
  // Not empty: every VerifyService call must carry "authorization: Bearer
  // <token>" (UNAUTHENTICATED otherwise). Health and reflection stay open.
  std::string auth_token;
};

// Every method of mlaverify.v1.VerifyService as a raw callback method.
// clang-format off
using GeneratedService = v1::VerifyService;
using RawVerifyService =
    GeneratedService::WithRawCallbackMethod_GetServerInfo<
    GeneratedService::WithRawCallbackMethod_CreateSequence<
    GeneratedService::WithRawCallbackMethod_AppendKv<
    GeneratedService::WithRawCallbackMethod_Verify<
    GeneratedService::WithRawCallbackMethod_VerifyStream<
    GeneratedService::WithRawCallbackMethod_Commit<
    GeneratedService::WithRawCallbackMethod_ReleaseSequence<
    GeneratedService::WithRawCallbackMethod_RegisterSystemSharedMemory<
    GeneratedService::WithRawCallbackMethod_RegisterCudaSharedMemory<
    GeneratedService::WithRawCallbackMethod_UnregisterSystemSharedMemory<
    GeneratedService::WithRawCallbackMethod_SystemSharedMemoryStatus<
    GeneratedService::WithRawCallbackMethod_UnregisterCudaSharedMemory<
    GeneratedService::WithRawCallbackMethod_CudaSharedMemoryStatus<
    GeneratedService::WithRawCallbackMethod_OpenStep<
    GeneratedService::WithRawCallbackMethod_AbortStep<
    GeneratedService::WithRawCallbackMethod_GetStep<
        GeneratedService::Service>>>>>>>>>>>>>>>>;
// clang-format on

class VerifyServiceImpl final : public RawVerifyService {
 public:
  // `observer` (may be null) and `state` outlive the service.
  VerifyServiceImpl(const ServiceOptions& options, RpcObserver* observer,
                    const std::atomic<ServingState>* state);
  ~VerifyServiceImpl() override;

  // The engine the RPCs reach; set once, before the state becomes kServing
  // (until then every RPC is refused with UNAVAILABLE). Outlives the service.
  void AttachEngine(engine::Engine* engine);

  // Draining: every open VerifyStream stops reading; an idle one ends at once
  // with UNAVAILABLE, a busy one once its answers are written. Returns how
  // many streams were open.
  int64_t EndStreams();
  // Ends, with UNAVAILABLE, every VerifyStream idle (no request in flight,
  // none read) since before now - stream_idle_timeout. Returns how many.
  // Called periodically (the server's janitor thread).
  int64_t EndIdleStreams(std::chrono::steady_clock::time_point now);
  // Unary calls and stream requests admitted and not finished.
  int64_t calls_in_flight() const { return in_flight_.load(); }
  // Unary calls and stream requests finished since the start.
  int64_t calls_finished() const { return finished_.load(); }

  // The RPCs, as gRPC calls them: request bytes in, response bytes out.
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* CreateSequence(grpc::CallbackServerContext* ctx,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* AppendKv(grpc::CallbackServerContext* ctx,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* Verify(grpc::CallbackServerContext* ctx,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* VerifyStream(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* Commit(grpc::CallbackServerContext* ctx,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ReleaseSequence(grpc::CallbackServerContext* ctx,
                                            const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RegisterSystemSharedMemory(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RegisterCudaSharedMemory(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* request,
                                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* UnregisterSystemSharedMemory(grpc::CallbackServerContext* ctx,
                                                         const grpc::ByteBuffer* request,
                                                         grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryStatus(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* request,
                                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* UnregisterCudaSharedMemory(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryStatus(grpc::CallbackServerContext* ctx,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* OpenStep(grpc::CallbackServerContext* ctx,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* AbortStep(grpc::CallbackServerContext* ctx,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetStep(grpc::CallbackServerContext* ctx,
                                    const grpc::ByteBuffer* request,
                                    grpc::ByteBuffer* response) override;

 private:
  class StreamReactor;
  using Clock = std::chrono::steady_clock;
  using Finisher = absl::AnyInvocable<void(absl::Status)>;

  // Checks the serving state, the token, cancellation, deadline and the
  // request's size, and decodes it; on OK calls body(request, &response,
  // finish), where finish(status) encodes the response and ends the RPC (from
  // any thread). A refused call is finished at once.
  template <typename Request, typename Response, typename Body>
  grpc::ServerUnaryReactor* RunUnary(absl::string_view rpc, grpc::CallbackServerContext* ctx,
                                     const grpc::ByteBuffer* request_bytes,
                                     grpc::ByteBuffer* response_bytes, bool allowed_while_draining,
                                     Body body);
  absl::Status Admit(grpc::CallbackServerContext* ctx, bool allowed_while_draining) const;
  // RESOURCE_EXHAUSTED (counted) when a request of `bytes` is over
  // max_message_bytes.
  absl::Status CheckRequestSize(absl::string_view rpc, size_t bytes) const;
  // A failed call's warning, at most one per 100 ms (the rest counted).
  void LogFailedCall(absl::string_view rpc, grpc::CallbackServerContext* ctx,
                     const absl::Status& status);
  // Turns `request` into engine items (references to its bytes, its regions
  // and `response`'s results) and submits it; `done` runs once with the
  // outcome, after the results are labelled. `timing` receives the engine's
  // time split. `items` and `timing` live until `done` ran. A request that
  // names a region needs a caller on this host: `local_peer` is that check's
  // outcome when the caller already has it (a stream's, worked out once),
  // else it is made here.
  // RESOURCE_EXHAUSTED when the answer's inline tensors (out and lse of the
  // items without shared-memory outputs) would exceed max_message_bytes.
  absl::Status CheckAnswerSize(const v1::VerifyRequest& request, int64_t heads) const;
  void StartVerify(grpc::CallbackServerContext* ctx, const v1::VerifyRequest& request,
                   v1::VerifyResponse* response, std::vector<engine::VerifyItem>* items,
                   engine::VerifyTiming* timing, Finisher done,
                   const absl::Status* local_peer = nullptr);
  // A Verify call or stream request that succeeded: its split, summed for
  // GetServerInfo.
  void RecordVerifySplit(const engine::VerifyTiming& timing, Clock::time_point arrived);
  // One finished call (or stream message).
  void Observe(absl::string_view rpc, grpc::StatusCode code, Clock::time_point arrived,
               double queued_seconds);
  engine::Engine* engine() const { return engine_.load(std::memory_order_acquire); }

  std::atomic<engine::Engine*> engine_{nullptr};
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> finished_{0};
  // RecordVerifySplit's sums, in nanoseconds.
  std::atomic<int64_t> verify_timed_{0};
  std::atomic<int64_t> verify_server_ns_{0};
  std::atomic<int64_t> verify_queue_ns_{0};
  std::atomic<int64_t> verify_device_ns_{0};
  absl::Mutex streams_mu_;
  absl::flat_hash_set<StreamReactor*> streams_ ABSL_GUARDED_BY(streams_mu_);
  // Open streams per connection (the peer address with its port).
  absl::flat_hash_map<std::string, int> streams_per_peer_ ABSL_GUARDED_BY(streams_mu_);
  const ServiceOptions options_;
  RpcObserver* const observer_;
  const std::atomic<ServingState>* const state_;
  SlowCallLog slow_calls_;
  // Failed calls are logged at most ten times a second.
  LogLimiter failed_calls_log_;
};

}  // namespace mlaverify::transport

#endif  // MLAVERIFY_SERVER_TRANSPORT_VERIFY_SERVICE_H_
