// Structured fields of the log records one thread writes while a
// ScopedLogFields lives: `--log-format json` (server/log_format.h) writes the
// set ones as members of each record, so that a collector can filter by RPC,
// status code, sequence or peer without parsing the message:
//   {"time":...,"level":"warning","thread":7,"msg":"slow Verify (OK): ...",
//    "rpc":"Verify","code":"OK","duration_ms":467.8}
// The text format leaves the line as it is (the message already says them).
// Thread-local and header-only: the engine sets a sequence without knowing
// how records are written, and the formatter runs on the logging thread
// (the server's loggers are synchronous).
#ifndef MLAVERIFY_COMMON_LOG_FIELDS_H_
#define MLAVERIFY_COMMON_LOG_FIELDS_H_

#include <cstdint>
#include <optional>

#include "absl/strings/string_view.h"

namespace mlaverify {

struct LogFields {
  // Empty / unset: not written. The views must outlive the scope that
  // carries them (they point at the caller's strings).
  absl::string_view source;  // who wrote the record when not this code: "grpc", "protobuf"
  absl::string_view rpc;     // "Verify", "AppendKv", ...
  absl::string_view code;    // the gRPC status code's name: "OK", "RESOURCE_EXHAUSTED", ...
  absl::string_view peer;    // the caller's address as gRPC gives it
  std::optional<uint64_t> sequence;
  std::optional<uint64_t> step;
  std::optional<double> duration_ms;
};

// Sets the calling thread's fields until it goes out of scope, then puts
// back the ones before it (scopes nest; the inner one replaces, it does not
// merge).
class ScopedLogFields {
 public:
  explicit ScopedLogFields(const LogFields& fields) : fields_(fields), previous_(current_) {
    current_ = &fields_;
  }
  ~ScopedLogFields() { current_ = previous_; }
  ScopedLogFields(const ScopedLogFields&) = delete;
  ScopedLogFields& operator=(const ScopedLogFields&) = delete;

  // The calling thread's fields; nullptr when no scope is open.
  static const LogFields* Current() { return current_; }

 private:
  const LogFields fields_;
  const LogFields* const previous_;
  static inline thread_local const LogFields* current_ = nullptr;
};

}  // namespace mlaverify

#endif  // MLAVERIFY_COMMON_LOG_FIELDS_H_
