// A byte count as error messages and logs write it: "N bytes" under 1 MiB,
// else "X.Y MiB".
#ifndef MLAVERIFY_COMMON_BYTE_SIZE_TEXT_H_
#define MLAVERIFY_COMMON_BYTE_SIZE_TEXT_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace mlaverify {

inline std::string ByteSizeText(int64_t bytes) {
  if (bytes < (int64_t{1} << 20)) return absl::StrCat(bytes, " bytes");
  return absl::StrFormat("%.1f MiB", static_cast<double>(bytes) / (1 << 20));
}

}  // namespace mlaverify

#endif  // MLAVERIFY_COMMON_BYTE_SIZE_TEXT_H_
