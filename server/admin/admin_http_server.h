// The operator's HTTP port: Prometheus metrics and Kubernetes-style liveness
// and readiness probes, served by cpp-httplib on its own threads, apart from
// the gRPC port so that a saturated or draining RPC server can still be probed
// and scraped.
//
//   GET /metrics  200, Prometheus text format 0.0.4 (Metrics::Serialize()).
//   GET /healthz  200 "ok\n" whenever this server answers (liveness).
//   GET /readyz   200 "ready\n" while ready() is true, else 503 "not ready\n"
//                 (readiness: false while starting and while draining).
//   anything else 404.
#ifndef MLAVERIFY_SERVER_ADMIN_ADMIN_HTTP_SERVER_H_
#define MLAVERIFY_SERVER_ADMIN_ADMIN_HTTP_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/admin/metrics.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace mlaverify::admin {

// Thread-safe: Start, Stop and port may be called from any thread.
class AdminHttpServer {
 public:
  // `metrics` is not owned and must outlive the server; null leaves /metrics
  // unserved (404). `ready` is called from the server's threads on every
  // /readyz, so it must be thread-safe and cheap; an empty function means
  // ready whenever serving.
  AdminHttpServer(Metrics* metrics, std::function<bool()> ready);
  // Stops the server if it is running.
  ~AdminHttpServer();
  AdminHttpServer(const AdminHttpServer&) = delete;
  AdminHttpServer& operator=(const AdminHttpServer&) = delete;

  // Binds host:port (port 0: an ephemeral port, see port()) and serves from a
  // background thread; connections are accepted once this returns OK.
  // INVALID_ARGUMENT for a port outside 0..65535 or an empty host,
  // FAILED_PRECONDITION if already started, UNAVAILABLE when the address
  // cannot be bound (in use, not local, no permission), with the reason.
  // The socket does not set SO_REUSEPORT, so a second process cannot silently
  // share the port. After Stop, Start may be called again.
  absl::Status Start(const std::string& host, int port);

  // Closes the listening socket, waits for in-flight requests (at most about
  // the one-second keep-alive timeout for an idle client) and joins the
  // serving thread. Idempotent; a no-op if never started.
  void Stop();

  // The bound port while started, else 0.
  int port() const;

 private:
  Metrics* const metrics_;
  const std::function<bool()> ready_;

  mutable absl::Mutex mu_;
  std::unique_ptr<httplib::Server> server_ ABSL_GUARDED_BY(mu_);
  std::thread thread_ ABSL_GUARDED_BY(mu_);
  int port_ ABSL_GUARDED_BY(mu_) = 0;
  // Set by the serving thread when httplib's listen loop has returned.
  std::atomic<bool> listen_done_{true};
};

}  // namespace mlaverify::admin

#endif  // MLAVERIFY_SERVER_ADMIN_ADMIN_HTTP_SERVER_H_
