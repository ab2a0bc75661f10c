#include "server/log_format.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "spdlog/pattern_formatter.h"

namespace mlaverify {
namespace {

// Length of the valid UTF-8 sequence at the start of `s` (1..4), or 0 when
// it is not one (a stray continuation byte, a truncated or overlong
// sequence, a surrogate, a code point past U+10FFFF).
size_t Utf8SequenceLength(absl::string_view s) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t b0 = byte(0);
  size_t n;
  uint32_t cp;
  if (b0 >= 0xc2 && b0 <= 0xdf) {
    n = 2;
    cp = b0 & 0x1f;
  } else if (b0 >= 0xe0 && b0 <= 0xef) {
    n = 3;
    cp = b0 & 0x0f;
  } else if (b0 >= 0xf0 && b0 <= 0xf4) {
    n = 4;
    cp = b0 & 0x07;
  } else {
    return 0;
  }
  if (s.size() < n) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((byte(k) & 0xc0) != 0x80) return 0;
    cp = (cp << 6) | (byte(k) & 0x3f);
  }
  if ((n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) || cp > 0x10ffff ||
      (cp >= 0xd800 && cp <= 0xdfff)) {
    return 0;
  }
  return n;
}

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

}  // namespace

void AppendJsonEscaped(absl::string_view text, std::string* out) {
  for (size_t k = 0; k < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[k]);
    if (c >= 0x80) {
      const size_t n = Utf8SequenceLength(text.substr(k));
      if (n == 0) {
        *out += "\\ufffd";
        ++k;
      } else {
        out->append(text.data() + k, n);
        k += n;
      }
      continue;
    }
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          *out += buf;
        } else {
          *out += static_cast<char>(c);
        }
    }
    ++k;
  }
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
  formatter->add_flag<JsonMessageFlag>('*').set_pattern(
      R"({"time":"%Y-%m-%dT%H:%M:%S.%e%z","level":"%l","thread":%t,"msg":"%*"})");
  return formatter;
}

}  // namespace mlaverify
