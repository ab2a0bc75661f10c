// The operator's HTTP port: Prometheus metrics and Kubernetes-style liveness
// and readiness probes, served by GNU libmicrohttpd from one event-driven
// thread, apart from the gRPC port so that a saturated or draining RPC server
// can still be probed and scraped.
//
//   GET /metrics  200, Prometheus text format 0.0.4 (Metrics::Serialize()).
//   GET /healthz  200 "ok\n" whenever this server answers (liveness).
//   GET /readyz   200 "ready\n" while ready() is true, else 503 "not ready\n"
//                 (readiness: false while starting and while draining).
//   other paths   404; other methods 405.
//
// A slow or idle client costs a connection slot, never a thread: one that
// sends its request a byte at a time cannot keep the probes from being
// answered (a thread-per-connection server would hand it a worker). Limits:
// kMaxConnections open at once (kMaxConnectionsPerPeer from one address),
// kIdleTimeoutSeconds without progress, kRequestHeadSeconds for a whole
// request head however steadily it trickles in, kMaxRequestBytes of head.
#ifndef MLAVERIFY_SERVER_ADMIN_ADMIN_HTTP_SERVER_H_
#define MLAVERIFY_SERVER_ADMIN_ADMIN_HTTP_SERVER_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/admin/metrics.h"

struct MHD_Daemon;

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

  // A probe or a scrape is one short connection at a time: 8 per address
  // leaves the 256 slots to be filled only from 32 addresses, and a peer
  // that holds its 8 locks out only itself (the kubelet's probes come from
  // the node's address).
  static constexpr int kMaxConnections = 256;
  static constexpr int kMaxConnectionsPerPeer = 8;
  // Without a byte for this long a connection is closed (libmicrohttpd's
  // own timeout: inactivity only).
  static constexpr int kIdleTimeoutSeconds = 5;
  // A request head not complete this long after the connection opened
  // (after its previous answer: kIdleTimeoutSeconds more) is cut, however
  // steadily its bytes come: a probe's head is one packet, a slowloris's
  // never ends.
  static constexpr int kRequestHeadSeconds = 3;
  static constexpr int kMaxRequestBytes = 16 << 10;

  // Binds host:port (port 0: an ephemeral port, see port()) and serves from a
  // background thread; connections are accepted once this returns OK.
  // INVALID_ARGUMENT for a port outside 0..65535 or an empty host,
  // FAILED_PRECONDITION if already started, UNAVAILABLE when the address
  // cannot be bound (in use, not local, no permission), with the reason.
  // The socket does not set SO_REUSEPORT, so a second process cannot silently
  // share the port. After Stop, Start may be called again.
  absl::Status Start(const std::string& host, int port);

  // Closes the listening socket and every connection and joins the serving
  // thread. Idempotent; a no-op if never started.
  void Stop();

  // The bound port while started, else 0.
  int port() const;
  // Connections cut because their request head was late, since Start.
  int64_t heads_cut() const;

 private:
  Metrics* const metrics_;
  const std::function<bool()> ready_;

  friend class AdminHttpHandler;  // the daemon's callback, in the .cc
  class HeadDeadlines;            // (.cc)

  // One request's answer, computed on the daemon's thread.
  struct Answer {
    int status = 200;
    std::string body;
    const char* content_type = nullptr;
  };
  Answer Respond(const std::string& method, const std::string& path) const;

  mutable absl::Mutex mu_;
  MHD_Daemon* daemon_ ABSL_GUARDED_BY(mu_) = nullptr;
  int port_ ABSL_GUARDED_BY(mu_) = 0;
  // The request heads in progress, and the thread that cuts late ones.
  std::unique_ptr<HeadDeadlines> heads_ ABSL_GUARDED_BY(mu_);
  std::thread head_sweeper_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mlaverify::admin

#endif  // MLAVERIFY_SERVER_ADMIN_ADMIN_HTTP_SERVER_H_
