// The gRPC server around a VerifyServiceImpl: listening port, TLS/mTLS,
// message limits, grpc.health.v1 and server reflection, and the serving
// state (starting -> serving -> draining) that health and admission follow.
// Used by mlaverify-server and by the in-process server tests.
#ifndef MLAVERIFY_SERVER_TRANSPORT_GRPC_SERVER_H_
#define MLAVERIFY_SERVER_TRANSPORT_GRPC_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/engine/engine.h"
#include "server/transport/health_service.h"
#include "server/transport/serving_probe.h"
#include "server/transport/verify_service.h"

namespace mlaverify::transport {

struct GrpcServerOptions {
  std::string listen_address = "0.0.0.0:50051";  // port 0: pick a free one
  ServiceOptions service;
  // TLS: PEM files. With a client CA the server requires and verifies
  // client certificates (mTLS). All empty: plaintext.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // HTTP/2 max frame size and per-stream window (lookahead); 0: gRPC's default.
  int http2_max_frame_bytes = 0;
  int http2_lookahead_bytes = 0;
  // Streams one connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS);
  // 0: gRPC's default (no limit).
  int http2_max_concurrent_streams = 0;
  // gRPC's ResourceQuota over its connections' memory; 0: none.
  uint64_t grpc_memory_quota_bytes = 0;
  // Keepalive. The server pings a connection that has been quiet for
  // `keepalive_time_ms` and closes it when the ack takes longer than
  // `keepalive_timeout_ms`: a dead client (or a balancer that dropped the
  // flow) is noticed and its streams end. The pings also count as traffic
  // for a NAT or L4 balancer in between (AWS NLB drops flows idle 350 s).
  int keepalive_time_ms = 60000;
  int keepalive_timeout_ms = 20000;
  // Whether the server pings, and accepts pings on, connections with no call.
  bool keepalive_permit_without_calls = true;
  // Client pings closer together than this (with no data between) are
  // strikes; after `max_ping_strikes` the server sends GOAWAY
  // (ENHANCE_YOUR_CALM). Must stay below the clients' keepalive time.
  int http2_min_ping_interval_ms = 10000;
  int http2_max_ping_strikes = 2;
};

class GrpcServer {
 public:
  // Builds and starts listening; the state is kStarting (health NOT_SERVING,
  // RPCs UNAVAILABLE) until AttachEngine() and SetServing(), so that health
  // can be asked while the engine starts (allocates pools, records graphs).
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(const GrpcServerOptions& options,
                                                           RpcObserver* observer);
  ~GrpcServer();

  int port() const { return port_; }
  ServingState state() const { return state_.load(); }

  // The engine RPCs reach; before SetServing. It outlives the server.
  void AttachEngine(engine::Engine* engine) {
    engine_ = engine;
    service_->AttachEngine(engine);
  }
  // Health SERVING; RPCs admitted.
  void SetServing();
  // A device faulted: health NOT_SERVING, device calls UNAVAILABLE (info and
  // release still answered). Ignored while draining.
  void SetFaulted();
  // The drain an operator relies on: health NOT_SERVING at once, and for
  // `grace` calls are still served (load balancers and readiness probes see
  // NOT_SERVING and move away); then new work is refused with UNAVAILABLE, the
  // listener closes, open VerifyStreams end (idle ones at once, UNAVAILABLE),
  // and calls in flight get `timeout` to finish before gRPC cancels them;
  // then the engine's shared-memory regions are dropped.
  // Returns what happened; idempotent (a second call returns zeros).
  DrainCounts Drain(absl::Duration grace, absl::Duration timeout);
  // Ends the VerifyStreams idle past the service's stream_idle_timeout;
  // returns how many. Called periodically.
  int64_t EndIdleStreams();

  // Readiness that sees the serving path (serving_probe.h): checks this
  // server's own port every `period` with `timeout`, over a plaintext
  // loopback connection, or in process when the port takes TLS only (a
  // connection of its own would need a client certificate). Call once,
  // after Start. Drain stops it.
  void StartServingProbe(absl::Duration period, absl::Duration timeout);
  // The probe's verdict; true when no probe was started.
  bool serving_path_answers() const;

 private:
  GrpcServer() = default;
  void SetHealth(bool serving);

  std::atomic<ServingState> state_{ServingState::kStarting};
  std::unique_ptr<VerifyServiceImpl> service_;
  std::unique_ptr<HealthService> health_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ServingPathProbe> probe_;
  bool tls_ = false;
  engine::Engine* engine_ = nullptr;
  int port_ = 0;
  bool shut_down_ = false;
};

}  // namespace mlaverify::transport

#endif  // MLAVERIFY_SERVER_TRANSPORT_GRPC_SERVER_H_
