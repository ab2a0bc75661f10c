#include "common/auth_token.h"

#include "absl/strings/str_cat.h"
#include "common/small_file.h"
#include "common/status_macros.h"

namespace mlaverify {

absl::StatusOr<std::string> ReadAuthToken(const std::string& path) {
  // Room for a 4 KiB token and the whitespace an editor may leave after it.
  ASSIGN_OR_RETURN(std::string token, ReadSmallFile(path, 8192, "token"));
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r' || token.back() == ' ' ||
                            token.back() == '\t')) {
    token.pop_back();
  }
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("token file '", path, "' is empty"));
  }
  if (token.size() > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file '", path, "' holds more than 4 KiB"));
  }
  for (char c : token) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte <= ' ' || byte == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("the token in '", path, "' has whitespace or control characters inside"));
    }
    // gRPC sends metadata values as visible ASCII only: a token with other
    // bytes would be accepted here and then be unsendable by every client.
    if (byte > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrCat("the token in '", path, "' has bytes outside visible ASCII (0x21-0x7e)"));
    }
  }
  return token;
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  }
  return diff == 0;
}

}  // namespace mlaverify
