#include "server/transport/health_service.h"

#include <optional>
#include <utility>

namespace mlaverify::transport {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// Writes the status, then each change, one write at a time (the latest status
// wins if several changes arrive during a write); ends when the client
// cancels or the service shuts down.
class HealthService::WatchReactor final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  WatchReactor(HealthService* service, bool known) : service_(service), known_(known) {}

  // Called with the service's lock held (so the reactor cannot go away).
  void Update(bool serving, bool shut_down) {
    {
      absl::MutexLock lock(&mu_);
      if (done_) return;
      pending_ = Status(serving);
      if (shut_down) finish_after_write_ = true;
      if (writing_) return;
      if (!pending_.has_value()) return;
      writing_ = true;
      current_.set_status(*pending_);
      pending_.reset();
    }
    StartWrite(&current_);
  }

  void OnWriteDone(bool ok) override {
    bool write = false, finish = false, draining = false;
    {
      absl::MutexLock lock(&mu_);
      draining = finish_after_write_;
      writing_ = false;
      if (!ok) {
        finish = !done_;
        done_ = true;
      } else if (pending_.has_value()) {
        writing_ = true;
        current_.set_status(*pending_);
        pending_.reset();
        write = true;
      } else if (finish_after_write_ && !done_) {
        done_ = true;
        finish = true;
      }
    }
    if (write) StartWrite(&current_);
    if (finish) {
      Finish(draining ? grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                     "server is draining: watch another replica")
                      : grpc::Status::OK);
    }
  }

  void OnCancel() override {
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      if (!done_ && !writing_) {
        done_ = true;
        finish = true;
      }
      finish_after_write_ = true;
    }
    if (finish) Finish(grpc::Status::CANCELLED);
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&service_->mu_);
      service_->watchers_.erase(this);
    }
    delete this;
  }

 private:
  HealthCheckResponse::ServingStatus Status(bool serving) const {
    if (!known_) return HealthCheckResponse::SERVICE_UNKNOWN;
    return serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
  }

  HealthService* const service_;
  const bool known_;
  absl::Mutex mu_;
  HealthCheckResponse current_;  // the message being written
  std::optional<HealthCheckResponse::ServingStatus> pending_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_after_write_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

HealthService::HealthService(std::string service_name) : service_name_(std::move(service_name)) {}

void HealthService::SetServing(bool serving) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  serving_ = serving;
  for (WatchReactor* w : watchers_) w->Update(serving_, false);
}

void HealthService::Shutdown() {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  shut_down_ = true;
  serving_ = false;
  for (WatchReactor* w : watchers_) w->Update(false, true);
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* ctx,
                                               const HealthCheckRequest* request,
                                               HealthCheckResponse* response) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (!Known(request->service())) {
    reactor->Finish(
        grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service '" + request->service() + "'"));
    return reactor;
  }
  bool serving;
  {
    absl::MutexLock lock(&mu_);
    serving = serving_;
  }
  response->set_status(serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(
    grpc::CallbackServerContext*, const HealthCheckRequest* request) {
  auto* reactor = new WatchReactor(this, Known(request->service()));
  absl::MutexLock lock(&mu_);
  watchers_.insert(reactor);
  reactor->Update(serving_, shut_down_);
  return reactor;
}

}  // namespace mlaverify::transport
