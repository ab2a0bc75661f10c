// Readiness that sees the serving path: a thread asks the server's own gRPC
// port a grpc.health.v1 Check every `period`, over a channel of its own,
// with a deadline of `timeout`. /readyz (mlaverify-server) reports ready only
// while the last check answered SERVING in time, so a transport that is
// flooded or wedged (calls wait seconds, while the admin port still
// answers) takes the replica out of rotation.
#ifndef MLAVERIFY_SERVER_TRANSPORT_SERVING_PROBE_H_
#define MLAVERIFY_SERVER_TRANSPORT_SERVING_PROBE_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace mlaverify::transport {

class ServingPathProbe {
 public:
  // Runs the first check (at most `timeout`), then starts the thread.
  ServingPathProbe(std::shared_ptr<grpc::Channel> channel, absl::Duration period,
                   absl::Duration timeout);
  ~ServingPathProbe();  // Stop()
  ServingPathProbe(const ServingPathProbe&) = delete;
  ServingPathProbe& operator=(const ServingPathProbe&) = delete;

  // Whether the last check answered SERVING within the timeout (false until
  // the first one did). Cheap: an atomic read.
  bool answering() const { return answering_.load(std::memory_order_acquire); }
  // Checks done since the start (for tests).
  int64_t checks() const { return checks_.load(std::memory_order_acquire); }
  // Ends the thread (waits for a check in flight, at most `timeout`).
  // Idempotent.
  void Stop();

 private:
  void Run();
  void CheckOnce();

  const std::shared_ptr<grpc::Channel> channel_;
  const std::unique_ptr<grpc::health::v1::Health::Stub> stub_;
  const absl::Duration period_;
  const absl::Duration timeout_;
  std::atomic<bool> answering_{false};
  std::atomic<int64_t> checks_{0};
  // What the log last said (CheckOnce runs on one thread at a time: the
  // constructor's, then the probe's). True at the start, so that a first
  // check that answers logs nothing.
  bool reported_answering_ = true;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace mlaverify::transport

#endif  // MLAVERIFY_SERVER_TRANSPORT_SERVING_PROBE_H_
