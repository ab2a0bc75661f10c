// At most one log line per interval for a repeated event (a client that
// sends thousands of bad calls a second must not flood the log): Allow()
// says whether to write now, and how many were held back since the last one.
// Thread-safe.
#ifndef MLAVERIFY_SERVER_TRANSPORT_LOG_LIMITER_H_
#define MLAVERIFY_SERVER_TRANSPORT_LOG_LIMITER_H_

#include <chrono>
#include <cstdint>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace mlaverify::transport {

class LogLimiter {
 public:
  using Clock = std::chrono::steady_clock;

  explicit LogLimiter(Clock::duration interval) : interval_(interval) {}

  // nullopt: hold this one back. Otherwise write it, noting the returned
  // count of lines held back since the last one written.
  std::optional<int64_t> Allow(Clock::time_point now) {
    absl::MutexLock lock(&mu_);
    if (last_.has_value() && now - *last_ < interval_) {
      ++held_back_;
      return std::nullopt;
    }
    last_ = now;
    const int64_t held = held_back_;
    held_back_ = 0;
    return held;
  }

 private:
  const Clock::duration interval_;
  absl::Mutex mu_;
  std::optional<Clock::time_point> last_ ABSL_GUARDED_BY(mu_);
  int64_t held_back_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace mlaverify::transport

#endif  // MLAVERIFY_SERVER_TRANSPORT_LOG_LIMITER_H_
