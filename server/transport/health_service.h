// grpc.health.v1.Health for this server: Check and Watch answer SERVING for
// "" and mlaverify.v1.VerifyService while the server serves, NOT_SERVING
// otherwise (starting, draining, a device faulted), NOT_FOUND for other
// service names (Watch: SERVICE_UNKNOWN). Written here rather than taken from
// gRPC's default health service so that a drain can end every Watch stream at
// once: an open Watch would otherwise hold the server's exit until the drain
// timeout.
#ifndef MLAVERIFY_SERVER_TRANSPORT_HEALTH_SERVICE_H_
#define MLAVERIFY_SERVER_TRANSPORT_HEALTH_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace mlaverify::transport {

class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  explicit HealthService(std::string service_name);

  // The status every name this server serves reports; each open Watch gets
  // the change.
  void SetServing(bool serving);
  // Ends every Watch stream (after a last NOT_SERVING) and answers later ones
  // the same way. Idempotent.
  void Shutdown();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  grpc::health::v1::HealthCheckResponse* response) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* ctx,
      const grpc::health::v1::HealthCheckRequest* request) override;

 private:
  class WatchReactor;
  bool Known(const std::string& service) const {
    return service.empty() || service == service_name_;
  }

  const std::string service_name_;
  absl::Mutex mu_;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<WatchReactor*> watchers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mlaverify::transport

#endif  // MLAVERIFY_SERVER_TRANSPORT_HEALTH_SERVICE_H_
