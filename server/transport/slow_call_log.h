// Warnings for RPCs that took longer than a threshold in the server, split
// into the time the call waited for a worker thread and the time its engine
// work took, so that an operator who sees a latency outlier on the client can
// tell whether it happened inside the server, and where.
//
// At most one warning per `min_interval` (a server that is slow on every call
// would otherwise log thousands of lines a second); the ones held back are
// counted, and the slowest of them described, in the next warning written.
//
// Thread-safety: Report may be called from any thread.
#ifndef MLAVERIFY_SERVER_TRANSPORT_SLOW_CALL_LOG_H_
#define MLAVERIFY_SERVER_TRANSPORT_SLOW_CALL_LOG_H_

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace mlaverify::transport {

class SlowCallLog {
 public:
  using Clock = std::chrono::steady_clock;

  // `threshold_seconds` <= 0 turns the log off.
  SlowCallLog(double threshold_seconds, Clock::duration min_interval);

  // One finished call: `queued_seconds` waiting for a worker thread, then
  // `work_seconds` in the handler. Returns the warning it wrote (also sent to
  // spdlog), or nullopt when the call was fast or a warning was written less
  // than `min_interval` before `now`.
  std::optional<std::string> Report(absl::string_view rpc, absl::string_view code,
                                    double queued_seconds, double work_seconds,
                                    Clock::time_point now);

 private:
  const double threshold_seconds_;
  const Clock::duration min_interval_;
  absl::Mutex mu_;
  struct Call {
    std::string rpc, code;
    double queued_seconds = 0.0, work_seconds = 0.0;
    double total() const { return queued_seconds + work_seconds; }
  };
  static std::string Describe(const Call& call);

  std::optional<Clock::time_point> last_written_ ABSL_GUARDED_BY(mu_);
  int64_t held_back_ ABSL_GUARDED_BY(mu_) = 0;
  Call slowest_held_back_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mlaverify::transport

#endif  // MLAVERIFY_SERVER_TRANSPORT_SLOW_CALL_LOG_H_
