// The optional bearer token that server and client share: read from a file
// (so it never appears in a process list), compared in constant time.
#ifndef MLAVERIFY_COMMON_AUTH_TOKEN_H_
#define MLAVERIFY_COMMON_AUTH_TOKEN_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mlaverify {

// The token in `path`, trailing whitespace (a final newline) removed.
// NOT_FOUND when the file cannot be opened; INVALID_ARGUMENT when it is not a
// regular file of at most 8 KiB, the token is empty or longer than 4 KiB, or
// it holds anything but visible ASCII (whitespace, control characters, bytes
// above 0x7e).
absl::StatusOr<std::string> ReadAuthToken(const std::string& path);

// a == b, in time that depends on the lengths only (not on where the first
// difference is).
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace mlaverify

#endif  // MLAVERIFY_COMMON_AUTH_TOKEN_H_
