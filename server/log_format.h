// The server's log line formats (--log-format): "text", one human-readable
// line per record, or "json", one JSON object per line for log collectors:
//   {"time":"2026-12-02T10:00:00.123+00:00","level":"info","thread":1234,"msg":"..."}
// The message is escaped as a JSON string by nlohmann-json (quotes,
// backslashes, newlines and every control character; invalid UTF-8 becomes
// U+FFFD, one per maximal invalid subsequence), so a message carrying
// client-supplied text stays one parseable line. A record written inside a
// ScopedLogFields (common/log_fields.h) carries its fields after "msg":
//   {...,"msg":"...","rpc":"Verify","code":"OK","duration_ms":467.800}
#ifndef MLAVERIFY_SERVER_LOG_FORMAT_H_
#define MLAVERIFY_SERVER_LOG_FORMAT_H_

#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "spdlog/formatter.h"

namespace mlaverify {

// A formatter for `format` ("text" or "json"; anything else is a programmer
// error, the flag parser only lets these two through).
std::unique_ptr<spdlog::formatter> MakeLogFormatter(absl::string_view format);

// Appends `text` to `out` as the inside of a JSON string (no quotes around).
void AppendJsonEscaped(absl::string_view text, std::string* out);

}  // namespace mlaverify

#endif  // MLAVERIFY_SERVER_LOG_FORMAT_H_
