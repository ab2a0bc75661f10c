#include "server/transport/slow_call_log.h"

#include "absl/strings/str_format.h"
#include "spdlog/spdlog.h"

namespace mlaverify::transport {

SlowCallLog::SlowCallLog(double threshold_seconds, Clock::duration min_interval)
    : threshold_seconds_(threshold_seconds), min_interval_(min_interval) {}

std::optional<std::string> SlowCallLog::Report(absl::string_view rpc, absl::string_view code,
                                               double queued_seconds, double work_seconds,
                                               Clock::time_point now) {
  if (threshold_seconds_ <= 0 || queued_seconds + work_seconds < threshold_seconds_) return std::nullopt;
  int64_t held_back = 0;
  {
    absl::MutexLock lock(&mu_);
    if (last_written_.has_value() && now - *last_written_ < min_interval_) {
      ++held_back_;
      return std::nullopt;
    }
    last_written_ = now;
    held_back = held_back_;
    held_back_ = 0;
  }
  std::string line = absl::StrFormat("slow %s (%s): %.1f ms in the server, %.1f ms queued for a worker, %.1f ms working",
                                     rpc, code, 1e3 * (queued_seconds + work_seconds), 1e3 * queued_seconds,
                                     1e3 * work_seconds);
  if (held_back > 0) absl::StrAppendFormat(&line, "; %d more slow calls since the last warning", held_back);
  spdlog::warn("{}", line);
  return line;
}

}  // namespace mlaverify::transport
