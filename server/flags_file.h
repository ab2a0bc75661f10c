// The server's --config file: TOML with one `flag-name = value` line per flag
// (the names of the command-line flags without the dashes), read with a real
// TOML parser (toml++). Anything that is not such a line is an error naming
// the file, the line and the key: a syntax error, a duplicate key, a table or
// dotted key, an unknown name, a value of the wrong TOML type for its flag, an
// integer beyond 64 bits. The values come back as command-line arguments, so
// that the flag parser applies its own conversions and range checks to them.
//
// No gRPC, no CLI11: main.cc says what kind of value each flag takes.
#ifndef MLAVERIFY_SERVER_FLAGS_FILE_H_
#define MLAVERIFY_SERVER_FLAGS_FILE_H_

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mlaverify {

// What a flag takes, hence which TOML types its key may have.
enum class FlagKind {
  kSwitch,       // a boolean: true / false
  kInteger,      // an integer
  kNumber,       // an integer or a float
  kSize,         // a byte count: an integer, or a string such as "1GiB"
  kText,         // a string
  kIntegerList,  // an array of integers (or one integer)
};

// One `name = value` line of the file, as the flag argument it stands for.
struct FlagsFileEntry {
  std::string flag;      // "--layers"
  std::string argument;  // "--layers=4"; a list is comma-joined: "--devices=0,1"
  int line = 0;          // 1-based line of the key in the file
};

// Parses `text`, the contents of the file `path` (named in errors only).
// `kind_of` gets a flag name with its dashes ("--layers") and says what it
// takes, or nullopt for a name that is no flag of the file (unknown, or one
// such as --config that a file cannot set). Entries come back in file order.
// Errors are InvalidArgument with one short line: "PATH:LINE: KEY: why"
// (a value quoted in it is cut to a few dozen characters). `nearest` (may be
// empty) names the flag an unknown key probably meant ("--layers"), or "".
absl::StatusOr<std::vector<FlagsFileEntry>> ParseFlagsFile(
    const std::string& path, absl::string_view text,
    const std::function<std::optional<FlagKind>(const std::string& flag)>& kind_of,
    const std::function<std::string(const std::string& flag)>& nearest = {});

// `text` cut to at most `max_chars` characters with "..." appended when cut,
// and every byte outside printable ASCII written as \xNN: for echoing values
// and parser messages in one short line.
std::string ClipForMessage(absl::string_view text, size_t max_chars = 60);

}  // namespace mlaverify

#endif  // MLAVERIFY_SERVER_FLAGS_FILE_H_
