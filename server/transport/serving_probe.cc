#include "server/transport/serving_probe.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "spdlog/spdlog.h"

namespace mlaverify::transport {

ServingPathProbe::ServingPathProbe(std::shared_ptr<grpc::Channel> channel, absl::Duration period,
                                   absl::Duration timeout)
    : channel_(std::move(channel)),
      stub_(grpc::health::v1::Health::NewStub(channel_)),
      period_(period),
      timeout_(timeout) {
  // The first check before returning: a server that writes its port file
  // next is ready (or known not to be) by then.
  CheckOnce();
  thread_ = std::thread([this] { Run(); });
}

ServingPathProbe::~ServingPathProbe() { Stop(); }

void ServingPathProbe::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void ServingPathProbe::CheckOnce() {
  const absl::Time started = absl::Now();
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(timeout_));
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub_->Check(&context, request, &response);
  const bool ok =
      status.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  answering_.store(ok, std::memory_order_release);
  checks_.fetch_add(1, std::memory_order_acq_rel);
  if (ok == reported_answering_) return;  // only changes are logged
  reported_answering_ = ok;
  if (ok) {
    spdlog::info("the gRPC port answers its own health check: /readyz ready");
  } else {
    spdlog::warn("the gRPC port's own health check failed ({}, {:.0f} ms): /readyz not ready",
                 status.ok() ? "NOT_SERVING" : status.error_message(),
                 absl::ToDoubleMilliseconds(absl::Now() - started));
  }
}

void ServingPathProbe::Run() {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), period_)) return;
    }
    CheckOnce();
  }
}

}  // namespace mlaverify::transport
