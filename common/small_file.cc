#include "common/small_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace mlaverify {
namespace {

// Closes the descriptor on every return path.
class FileCloser {
 public:
  explicit FileCloser(int fd) : fd_(fd) {}
  ~FileCloser() { ::close(fd_); }
  FileCloser(const FileCloser&) = delete;
  FileCloser& operator=(const FileCloser&) = delete;

 private:
  int fd_;
};

}  // namespace

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, size_t max_bytes,
                                          absl::string_view what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat("cannot read ", what, " file '", path, "': ", std::strerror(errno)));
  }
  FileCloser closer(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " file '", path, "' is not a regular file"));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, " file '", path, "' holds ", st.st_size,
                                                   " bytes, more than ", max_bytes));
  }
  // Read one byte past the limit: a file that grew after fstat is refused too.
  std::string contents(max_bytes + 1, '\0');
  size_t got = 0;
  while (got < contents.size()) {
    const ssize_t n = ::read(fd, contents.data() + got, contents.size() - got);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::InvalidArgumentError(
          absl::StrCat("cannot read ", what, " file '", path, "': ", std::strerror(errno)));
    }
    got += static_cast<size_t>(n);
  }
  if (got > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " file '", path, "' holds more than ", max_bytes, " bytes"));
  }
  contents.resize(got);
  return contents;
}

}  // namespace mlaverify
