// common/: the bearer-token file and its constant-time comparison; the
// bounded reader of small operator files.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "common/auth_token.h"
#include "common/small_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mlaverify {
namespace {

using ::testing::HasSubstr;

std::string WriteFile(const std::string& name, const std::string& contents) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path, std::ios::binary) << contents;
  return path;
}

TEST(AuthToken, ReadsTheTokenWithoutItsFinalNewline) {
  auto token = ReadAuthToken(WriteFile("t1", "abc-123_XYZ\n"));
  ASSERT_TRUE(token.ok()) << token.status();
  EXPECT_EQ(*token, "abc-123_XYZ");
}

TEST(AuthToken, RejectsMissingEmptyOversizedAndSpacedTokens) {
  EXPECT_THAT(std::string(ReadAuthToken("/nonexistent/token").status().message()),
              HasSubstr("cannot read"));
  EXPECT_THAT(std::string(ReadAuthToken(WriteFile("t2", "\n\n")).status().message()),
              HasSubstr("empty"));
  EXPECT_THAT(
      std::string(ReadAuthToken(WriteFile("t3", std::string(5000, 'a'))).status().message()),
      HasSubstr("4 KiB"));
  EXPECT_THAT(std::string(ReadAuthToken(WriteFile("t4", "two words")).status().message()),
              HasSubstr("whitespace"));
}

TEST(AuthToken, RejectsBytesOutsideVisibleAscii) {
  // gRPC clients cannot send such a token: it must fail at start, not later.
  for (const char* bad : {"caf\xc3\xa9-token\n", "tok\x80-en", "\xfftoken"}) {
    auto token = ReadAuthToken(WriteFile("t5", bad));
    EXPECT_EQ(token.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(token.status().message()), HasSubstr("outside visible ASCII"));
  }
  auto edge = ReadAuthToken(WriteFile("t6", "!~token~!\n"));
  ASSERT_TRUE(edge.ok()) << edge.status();
  EXPECT_EQ(*edge, "!~token~!");
}

TEST(SmallFile, ReadsARegularFileUpToItsLimit) {
  auto contents = ReadSmallFile(WriteFile("s1", "0123456789"), 10, "test");
  ASSERT_TRUE(contents.ok()) << contents.status();
  EXPECT_EQ(*contents, "0123456789");
  auto too_big = ReadSmallFile(WriteFile("s2", "0123456789A"), 10, "test");  // one byte over
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_big.status().message()), HasSubstr("more than 10"));
}

TEST(SmallFile, RefusesDevicesDirectoriesFifosAndMissingFiles) {
  EXPECT_THAT(std::string(ReadSmallFile("/dev/zero", 1024, "test").status().message()),
              HasSubstr("not a regular file"));
  EXPECT_THAT(std::string(ReadSmallFile(::testing::TempDir(), 1024, "test").status().message()),
              HasSubstr("not a regular file"));
  const std::string fifo = ::testing::TempDir() + "/small-file.fifo";
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  // Without O_NONBLOCK this open would wait for a writer forever.
  EXPECT_THAT(std::string(ReadSmallFile(fifo, 1024, "test").status().message()),
              HasSubstr("not a regular file"));
  ::unlink(fifo.c_str());
  auto missing = ReadSmallFile("/nonexistent/x", 1024, "test");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("cannot read test file"));
}

TEST(AuthToken, ConstantTimeEqualsIsEquality) {
  EXPECT_TRUE(ConstantTimeEquals("secret", "secret"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secreT"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secret2"));
  EXPECT_FALSE(ConstantTimeEquals("", "x"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

}  // namespace
}  // namespace mlaverify
