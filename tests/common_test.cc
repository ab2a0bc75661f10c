// common/: the bearer-token file and its constant-time comparison.
#include <cstdio>
#include <fstream>
#include <string>

#include "common/auth_token.h"
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

TEST(AuthToken, ConstantTimeEqualsIsEquality) {
  EXPECT_TRUE(ConstantTimeEquals("secret", "secret"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secreT"));
  EXPECT_FALSE(ConstantTimeEquals("secret", "secret2"));
  EXPECT_FALSE(ConstantTimeEquals("", "x"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

}  // namespace
}  // namespace mlaverify
