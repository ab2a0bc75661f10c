#include "common/auth_token.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace mlaverify {

absl::StatusOr<std::string> ReadAuthToken(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return absl::InvalidArgumentError(absl::StrCat("cannot read token file '", path, "'"));
  std::stringstream contents;
  contents << file.rdbuf();
  std::string token = contents.str();
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
    if (static_cast<unsigned char>(c) <= ' ' || c == 0x7f) {
      return absl::InvalidArgumentError(
          absl::StrCat("the token in '", path, "' has whitespace or control characters inside"));
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
