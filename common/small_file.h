// Reading the small files an operator points a flag at (tokens, TLS keys,
// flag files): a regular file of bounded size, or a clear error. A FIFO or a
// device such as /dev/zero would otherwise hang the reader or grow its memory
// without bound.
#ifndef MLAVERIFY_COMMON_SMALL_FILE_H_
#define MLAVERIFY_COMMON_SMALL_FILE_H_

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace mlaverify {

// PEM files (certificates, keys, CAs) are a few KiB; 1 MiB leaves room for
// long chains.
inline constexpr size_t kMaxPemFileBytes = size_t{1} << 20;

// The contents of `path`. NOT_FOUND when it cannot be opened; INVALID_ARGUMENT
// when it is not a regular file (after symlinks), holds more than `max_bytes`
// or cannot be read; each message names `what` and the path. Opening never blocks (O_NONBLOCK), so
// a FIFO is refused rather than waited on.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t max_bytes,
                                          absl::string_view what);

}  // namespace mlaverify

#endif  // MLAVERIFY_COMMON_SMALL_FILE_H_
