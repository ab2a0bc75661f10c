#include "server/admin/admin_http_server.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "httplib.h"
#include "spdlog/spdlog.h"

namespace mlaverify::admin {
namespace {

// Scrapes and probes are a few requests a second at most; four workers let a
// slow scraper and a probe run side by side without httplib's default of one
// thread per core.
constexpr int kWorkerThreads = 4;

// Bounds how long Stop() waits on an idle keep-alive client (httplib checks
// for shutdown only between keep-alive waits). Probes and scrapes reconnect
// cheaply, so little is lost by closing idle connections early.
constexpr time_t kKeepAliveTimeoutSeconds = 1;

constexpr char kPlainText[] = "text/plain; charset=utf-8";
// The content type Prometheus expects for the text exposition format.
constexpr char kPrometheusText[] = "text/plain; version=0.0.4; charset=utf-8";

// httplib's default sets SO_REUSEPORT on Linux, which lets a second server
// bind the same port and silently take half the scrapes and probes. Only
// SO_REUSEADDR here: a restarted server can rebind while old connections sit
// in TIME_WAIT, but a port held by a live listener stays an error.
void SetSocketOptions(int sock) {
  int yes = 1;
  setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
}

}  // namespace

AdminHttpServer::AdminHttpServer(Metrics* metrics, std::function<bool()> ready)
    : metrics_(metrics), ready_(std::move(ready)) {}

AdminHttpServer::~AdminHttpServer() { Stop(); }

absl::Status AdminHttpServer::Start(const std::string& host, int port) {
  if (host.empty()) return absl::InvalidArgumentError("admin HTTP host is empty");
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("admin HTTP port ", port, " is outside 0..65535 (0 picks a free port)"));
  }
  absl::MutexLock lock(&mu_);
  if (server_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("admin HTTP server already listening on port ", port_));
  }

  auto server = std::make_unique<httplib::Server>();
  server->new_task_queue = [] { return new httplib::ThreadPool(kWorkerThreads); };
  server->set_socket_options(SetSocketOptions);
  server->set_keep_alive_timeout(kKeepAliveTimeoutSeconds);

  if (metrics_ != nullptr) {
    server->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics_->Serialize(), kPrometheusText);
    });
  }
  server->Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok\n", kPlainText);
  });
  server->Get("/readyz", [this](const httplib::Request&, httplib::Response& res) {
    if (!ready_ || ready_()) {
      res.set_content("ready\n", kPlainText);
    } else {
      res.status = 503;
      res.set_content("not ready\n", kPlainText);
    }
  });
  // httplib calls this for every status >= 400, including our own 503: only
  // fill in the body of its bare 404.
  server->set_error_handler(
      httplib::Server::HandlerWithResponse([](const httplib::Request&, httplib::Response& res) {
        if (res.status != 404 || !res.body.empty()) {
          return httplib::Server::HandlerResponse::Unhandled;
        }
        res.set_content("not found\n", kPlainText);
        return httplib::Server::HandlerResponse::Handled;
      }));
  // Without a handler httplib copies the exception text into a response
  // header; log it here and answer with a plain 500 instead.
  server->set_exception_handler(
      [](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        spdlog::warn("admin HTTP {} {} failed: {}", req.method, req.path, what);
        res.status = 500;
        res.set_content("internal error\n", kPlainText);
      });

  // httplib reports a failed bind only as -1 / false; errno still holds the
  // cause of the last failing socket call (bind, or getaddrinfo's lookups).
  errno = 0;
  int bound_port = -1;
  if (port == 0) {
    bound_port = server->bind_to_any_port(host);
  } else if (server->bind_to_port(host, port)) {
    bound_port = port;
  }
  if (bound_port < 0) {
    const int err = errno;
    std::string message = absl::StrCat("admin HTTP server cannot listen on ", host, ":", port);
    if (err != 0) absl::StrAppend(&message, ": ", std::strerror(err));
    spdlog::warn("{}", message);
    return absl::UnavailableError(message);
  }

  server_ = std::move(server);
  port_ = bound_port;
  listen_done_.store(false);
  // The socket is already listening (bind_* calls listen()), so connections
  // made before this thread reaches accept() wait in the backlog.
  thread_ = std::thread([this, server = server_.get(), bound_port] {
    if (!server->listen_after_bind()) {
      spdlog::warn("admin HTTP server on port {} stopped accepting: {}", bound_port,
                   std::strerror(errno));
    }
    listen_done_.store(true);
  });
  spdlog::info("admin HTTP server listening on {}:{} (/metrics, /healthz, /readyz)", host,
               bound_port);
  return absl::OkStatus();
}

void AdminHttpServer::Stop() {
  absl::MutexLock lock(&mu_);
  if (server_ == nullptr) return;
  // httplib's stop() does nothing until the serving thread has entered its
  // accept loop, so a single call right after Start could leave that thread
  // in accept() for good. Repeat until the loop has returned; once it has
  // run, further stop() calls are harmless no-ops.
  while (!listen_done_.load()) {
    server_->stop();
    absl::SleepFor(absl::Milliseconds(1));
  }
  thread_.join();
  server_.reset();
  spdlog::info("admin HTTP server on port {} stopped", port_);
  port_ = 0;
}

int AdminHttpServer::port() const {
  absl::MutexLock lock(&mu_);
  return port_;
}

}  // namespace mlaverify::admin
