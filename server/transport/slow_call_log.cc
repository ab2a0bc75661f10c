#include "server/transport/slow_call_log.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log_fields.h"
#include "spdlog/spdlog.h"

namespace mlaverify::transport {

SlowCallLog::SlowCallLog(double threshold_seconds, Clock::duration min_interval)
    : threshold_seconds_(threshold_seconds), min_interval_(min_interval) {}

std::string SlowCallLog::Describe(const Call& call) {
  return absl::StrFormat(
      "%s (%s): %.1f ms in the server, %.1f ms queued for a worker, %.1f ms working", call.rpc,
      call.code, 1e3 * call.total(), 1e3 * call.queued_seconds, 1e3 * call.work_seconds);
}

std::optional<std::string> SlowCallLog::Report(absl::string_view rpc, absl::string_view code,
                                               double queued_seconds, double work_seconds,
                                               Clock::time_point now) {
  if (threshold_seconds_ <= 0 || queued_seconds + work_seconds < threshold_seconds_)
    return std::nullopt;
  Call call{std::string(rpc), std::string(code), queued_seconds, work_seconds};
  int64_t held_back = 0;
  Call slowest_held_back;
  {
    absl::MutexLock lock(&mu_);
    if (last_written_.has_value() && now - *last_written_ < min_interval_) {
      if (held_back_ == 0 || call.total() > slowest_held_back_.total())
        slowest_held_back_ = std::move(call);
      ++held_back_;
      return std::nullopt;
    }
    last_written_ = now;
    held_back = held_back_;
    held_back_ = 0;
    slowest_held_back = std::move(slowest_held_back_);
  }
  std::string line = absl::StrCat("slow ", Describe(call));
  if (held_back > 0) {
    absl::StrAppendFormat(&line, "; %d more slow calls since the last warning, the slowest %s",
                          held_back, Describe(slowest_held_back));
  }
  LogFields slow;
  slow.rpc = rpc;
  slow.code = code;
  slow.duration_ms = 1e3 * (queued_seconds + work_seconds);
  const ScopedLogFields fields(slow);
  spdlog::warn("{}", line);
  return line;
}

}  // namespace mlaverify::transport
