#include "server/admin/admin_http_server.h"

#include <fcntl.h>
#include <microhttpd.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "spdlog/spdlog.h"

namespace mlaverify::admin {
namespace {

constexpr char kPlainText[] = "text/plain; charset=utf-8";
// The content type Prometheus expects for the text exposition format.
constexpr char kPrometheusText[] = "text/plain; version=0.0.4; charset=utf-8";

// A listening TCP socket on host:port, or UNAVAILABLE with the reason. Made
// here rather than by the daemon so that a failure says why (the errno of
// the failing call) and so that only SO_REUSEADDR is set: a restarted server
// rebinds while old connections sit in TIME_WAIT, but a port held by a live
// listener stays an error (SO_REUSEPORT would let a second server silently
// take half the scrapes and probes).
absl::StatusOr<int> Listen(const std::string& host, int port) {
  const std::string where = absl::StrCat(host, ":", port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int err = getaddrinfo(host.c_str(), service.c_str(), &hints, &found); err != 0) {
    return absl::UnavailableError(
        absl::StrCat("admin HTTP server cannot listen on ", where, ": ", gai_strerror(err)));
  }
  int last_errno = 0;
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 128) != 0) {
      last_errno = errno;
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("admin HTTP server cannot listen on ", where, ": ",
                                               std::strerror(last_errno)));
  }
  return fd;
}

int BoundPort(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return -1;
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return -1;
}

void LogDaemonError(void* /*unused*/, const char* format, va_list args) {
  char line[512];
  std::vsnprintf(line, sizeof(line), format, args);
  std::string text(line);
  while (!text.empty() && text.back() == '\n') text.pop_back();
  spdlog::debug("admin HTTP: {}", text);
}

}  // namespace

// Every open connection's deadline for its request head: a connection opens
// with the clock running, the head's arrival stops it, the answer's
// completion starts it again for the next head on a kept-alive connection
// (with the idle timeout's time added: such a connection may sit silent
// first). The sweeper cuts (shutdown) connections past their deadline. The daemon
// owns each socket; this keeps a duplicate of its descriptor, so that a
// number the daemon closed, and the kernel gave to a new socket, is never
// shut down by mistake.
class AdminHttpServer::HeadDeadlines {
 public:
  // Steady: a step of the wall clock neither cuts every head nor none.
  using Clock = std::chrono::steady_clock;

  // `limit`: for a connection's first head; `after_answer`: for the next
  // head on a kept-alive connection, which may first sit idle (the idle
  // timeout closes it after that much silence).
  HeadDeadlines(const AdminHttpServer* server, std::chrono::seconds limit,
                std::chrono::seconds after_answer)
      : server_(server), limit_(limit), after_answer_(after_answer) {}
  // After the daemon stopped (which reported every connection closed).
  ~HeadDeadlines() {
    for (const auto& [connection, entry] : entries_) close(entry.fd);
  }
  HeadDeadlines(const HeadDeadlines&) = delete;
  HeadDeadlines& operator=(const HeadDeadlines&) = delete;

  const AdminHttpServer* server() const { return server_; }

  // The daemon's callbacks (its polling thread).
  static void OnConnection(void* self, MHD_Connection* connection, void** /*socket_context*/,
                           MHD_ConnectionNotificationCode code) {
    auto* heads = static_cast<HeadDeadlines*>(self);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
      heads->Opened(connection);
    } else {
      heads->Closed(connection);
    }
  }
  static void OnAnswered(void* self, MHD_Connection* connection, void** /*request_state*/,
                         MHD_RequestTerminationCode /*code*/) {
    static_cast<HeadDeadlines*>(self)->Restart(connection);
  }
  void HeadIn(MHD_Connection* connection) {
    absl::MutexLock lock(&mu_);
    if (auto it = entries_.find(connection); it != entries_.end()) it->second.head_in = true;
  }

  // The sweeper's loop, until Stop().
  void Sweep() {
    while (!stop_.WaitForNotificationWithTimeout(absl::Milliseconds(200))) CutLate(Clock::now());
  }
  void Stop() { stop_.Notify(); }
  int64_t cut() const {
    absl::MutexLock lock(&mu_);
    return cut_;
  }

 private:
  struct Entry {
    int fd = -1;
    Clock::time_point due;
    bool head_in = false;
    bool cut = false;
  };

  void Opened(MHD_Connection* connection) {
    const MHD_ConnectionInfo* info =
        MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (info == nullptr) return;
    // Unwatched if it cannot be duplicated (out of descriptors): the idle
    // timeout still applies to it.
    const int fd = fcntl(info->connect_fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return;
    absl::MutexLock lock(&mu_);
    entries_[connection] = Entry{fd, Clock::now() + limit_, false, false};
  }
  void Restart(MHD_Connection* connection) {
    absl::MutexLock lock(&mu_);
    if (auto it = entries_.find(connection); it != entries_.end()) {
      it->second.head_in = false;
      it->second.due = Clock::now() + after_answer_;
    }
  }
  void Closed(MHD_Connection* connection) {
    absl::MutexLock lock(&mu_);
    if (auto it = entries_.find(connection); it != entries_.end()) {
      close(it->second.fd);
      entries_.erase(it);
    }
  }
  void CutLate(Clock::time_point now) {
    absl::MutexLock lock(&mu_);
    for (auto& [connection, entry] : entries_) {
      if (entry.head_in || entry.cut || now < entry.due) continue;
      // The daemon sees the socket end and closes the connection itself.
      shutdown(entry.fd, SHUT_RDWR);
      entry.cut = true;
      ++cut_;
    }
  }

  const AdminHttpServer* const server_;
  const std::chrono::seconds limit_;
  const std::chrono::seconds after_answer_;
  absl::Notification stop_;
  mutable absl::Mutex mu_;
  std::unordered_map<MHD_Connection*, Entry> entries_ ABSL_GUARDED_BY(mu_);
  int64_t cut_ ABSL_GUARDED_BY(mu_) = 0;
};

// The daemon's request callback. Called once the request head is in (the
// admin endpoints take no body); answers at once.
class AdminHttpHandler {
 public:
  static MHD_Result Handle(void* self, MHD_Connection* connection, const char* url,
                           const char* method, const char* /*version*/, const char* /*upload_data*/,
                           size_t* upload_data_size, void** /*request_state*/) {
    auto* heads = static_cast<AdminHttpServer::HeadDeadlines*>(self);
    heads->HeadIn(connection);
    // A request with a body is answered on the first call; its bytes are
    // dropped unread.
    *upload_data_size = 0;
    const AdminHttpServer::Answer answer = heads->server()->Respond(method, url);
    MHD_Response* response = MHD_create_response_from_buffer(
        answer.body.size(), const_cast<char*>(answer.body.data()), MHD_RESPMEM_MUST_COPY);
    if (response == nullptr) return MHD_NO;  // out of memory: the connection is closed
    MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, answer.content_type);
    const MHD_Result queued =
        MHD_queue_response(connection, static_cast<unsigned int>(answer.status), response);
    MHD_destroy_response(response);
    return queued;
  }
};

AdminHttpServer::AdminHttpServer(Metrics* metrics, std::function<bool()> ready)
    : metrics_(metrics), ready_(std::move(ready)) {}

AdminHttpServer::~AdminHttpServer() { Stop(); }

AdminHttpServer::Answer AdminHttpServer::Respond(const std::string& method,
                                                 const std::string& path) const {
  Answer a;
  a.content_type = kPlainText;
  if (method != "GET" && method != "HEAD") {
    a.status = 405;
    a.body = "method not allowed\n";
  } else if (path == "/metrics" && metrics_ != nullptr) {
    a.body = metrics_->Serialize();
    a.content_type = kPrometheusText;
  } else if (path == "/healthz") {
    a.body = "ok\n";
  } else if (path == "/readyz") {
    if (!ready_ || ready_()) {
      a.body = "ready\n";
    } else {
      a.status = 503;
      a.body = "not ready\n";
    }
  } else {
    a.status = 404;
    a.body = "not found\n";
  }
  return a;
}

absl::Status AdminHttpServer::Start(const std::string& host, int port) {
  if (host.empty()) return absl::InvalidArgumentError("admin HTTP host is empty");
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("admin HTTP port ", port, " is outside 0..65535 (0 picks a free port)"));
  }
  absl::MutexLock lock(&mu_);
  if (daemon_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("admin HTTP server already listening on port ", port_));
  }
  absl::StatusOr<int> fd = Listen(host, port);
  if (!fd.ok()) {
    spdlog::warn("{}", std::string(fd.status().message()));
    return fd.status();
  }
  const int bound_port = BoundPort(*fd);
  heads_ = std::make_unique<HeadDeadlines>(
      this, std::chrono::seconds(kRequestHeadSeconds),
      std::chrono::seconds(kIdleTimeoutSeconds + kRequestHeadSeconds));
  HeadDeadlines* heads = heads_.get();
  // One thread polls every connection (epoll): slow clients hold slots, not
  // threads. The daemon owns the socket from here and closes it on stop.
  daemon_ = MHD_start_daemon(
      MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_USE_ERROR_LOG, 0, nullptr, nullptr,
      &AdminHttpHandler::Handle, heads, MHD_OPTION_EXTERNAL_LOGGER, &LogDaemonError, nullptr,
      MHD_OPTION_LISTEN_SOCKET, *fd, MHD_OPTION_CONNECTION_LIMIT,
      static_cast<unsigned int>(kMaxConnections), MHD_OPTION_PER_IP_CONNECTION_LIMIT,
      static_cast<unsigned int>(kMaxConnectionsPerPeer), MHD_OPTION_CONNECTION_TIMEOUT,
      static_cast<unsigned int>(kIdleTimeoutSeconds), MHD_OPTION_CONNECTION_MEMORY_LIMIT,
      static_cast<size_t>(kMaxRequestBytes), MHD_OPTION_NOTIFY_CONNECTION,
      &HeadDeadlines::OnConnection, heads, MHD_OPTION_NOTIFY_COMPLETED, &HeadDeadlines::OnAnswered,
      heads, MHD_OPTION_END);
  if (daemon_ == nullptr) {
    heads_.reset();
    close(*fd);
    const std::string message =
        absl::StrCat("admin HTTP server cannot serve on ", host, ":", port,
                     ": libmicrohttpd did not start (threads or epoll unavailable)");
    spdlog::warn("{}", message);
    return absl::UnavailableError(message);
  }
  port_ = bound_port;
  head_sweeper_ = std::thread([heads] { heads->Sweep(); });
  spdlog::info("admin HTTP server listening on {}:{} (/metrics, /healthz, /readyz)", host,
               bound_port);
  return absl::OkStatus();
}

void AdminHttpServer::Stop() {
  absl::MutexLock lock(&mu_);
  if (daemon_ == nullptr) return;
  heads_->Stop();
  head_sweeper_.join();
  MHD_stop_daemon(daemon_);  // reports every connection closed to heads_
  daemon_ = nullptr;
  heads_.reset();
  spdlog::info("admin HTTP server on port {} stopped", port_);
  port_ = 0;
}

int AdminHttpServer::port() const {
  absl::MutexLock lock(&mu_);
  return port_;
}

int64_t AdminHttpServer::heads_cut() const {
  absl::MutexLock lock(&mu_);
  return heads_ != nullptr ? heads_->cut() : 0;
}

}  // namespace mlaverify::admin
