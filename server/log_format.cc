#include "server/log_format.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log_fields.h"
#include "nlohmann/json.hpp"
#include "spdlog/pattern_formatter.h"

namespace mlaverify {
namespace {

// %* in the JSON pattern: the record's message as JSON string contents.
class JsonMessageFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    std::string escaped;
    AppendJsonEscaped(absl::string_view(msg.payload.data(), msg.payload.size()), &escaped);
    dest.append(escaped.data(), escaped.data() + escaped.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonMessageFlag>();
  }
};

// %& in the JSON pattern: the thread's LogFields (common/log_fields.h) as
// members after "msg", each with its leading comma; nothing when none is set.
class JsonFieldsFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const LogFields* fields = ScopedLogFields::Current();
    if (fields == nullptr) return;
    std::string out;
    const auto text = [&out](const char* name, absl::string_view value) {
      if (value.empty()) return;
      absl::StrAppend(&out, ",\"", name, "\":\"");
      AppendJsonEscaped(value, &out);
      out += '"';
    };
    text("source", fields->source);
    text("rpc", fields->rpc);
    text("code", fields->code);
    text("peer", fields->peer);
    if (fields->sequence.has_value()) absl::StrAppend(&out, ",\"sequence\":", *fields->sequence);
    if (fields->step.has_value()) absl::StrAppend(&out, ",\"step\":", *fields->step);
    if (fields->duration_ms.has_value() && std::isfinite(*fields->duration_ms)) {
      absl::StrAppendFormat(&out, ",\"duration_ms\":%.3f", *fields->duration_ms);
    }
    dest.append(out.data(), out.data() + out.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonFieldsFlag>();
  }
};

}  // namespace

void AppendJsonEscaped(absl::string_view text, std::string* out) {
  // nlohmann-json's serialiser: quotes, backslashes and control characters
  // escaped, invalid UTF-8 replaced by U+FFFD; the quotes around it dropped.
  const std::string quoted =
      nlohmann::json(std::string(text))
          .dump(-1, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
  out->append(quoted, 1, quoted.size() - 2);
}

std::unique_ptr<spdlog::formatter> MakeLogFormatter(absl::string_view format) {
  if (format == "text") {
    return std::make_unique<spdlog::pattern_formatter>("%Y-%m-%dT%H:%M:%S.%e %^%l%$ [%t] %v");
  }
  if (format != "json") {
    std::fprintf(stderr, "MakeLogFormatter: unknown format\n");
    std::abort();
  }
  // Level names (%l) and the other fields are plain ASCII without quotes.
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  formatter->add_flag<JsonMessageFlag>('*').add_flag<JsonFieldsFlag>('&').set_pattern(
      R"({"time":"%Y-%m-%dT%H:%M:%S.%e%z","level":"%l","thread":%t,"msg":"%*"%&})");
  return formatter;
}

}  // namespace mlaverify
