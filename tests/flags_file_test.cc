// The server's --config file reader (server/flags_file.h): TOML read by a
// real parser, every way a file can be wrong an error of one short line that
// names the file, the line and the key.
#include "server/flags_file.h"

#include <optional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace mlaverify {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

std::optional<FlagKind> KindOf(const std::string& flag) {
  if (flag == "--layers") return FlagKind::kInteger;
  if (flag == "--softmax-scale") return FlagKind::kNumber;
  if (flag == "--pool-bytes") return FlagKind::kSize;
  if (flag == "--backend") return FlagKind::kText;
  if (flag == "--allow-client-shm") return FlagKind::kSwitch;
  if (flag == "--draft-buckets") return FlagKind::kIntegerList;
  return std::nullopt;
}

absl::StatusOr<std::vector<FlagsFileEntry>> Parse(const std::string& text) {
  return ParseFlagsFile("flags.toml", text, KindOf);
}

// The error of `text`, checked to be one short line.
std::string ErrorOf(const std::string& text) {
  absl::StatusOr<std::vector<FlagsFileEntry>> parsed = Parse(text);
  EXPECT_FALSE(parsed.ok()) << text;
  if (parsed.ok()) return "";
  const std::string message(parsed.status().message());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  EXPECT_LT(message.size(), 300u) << message;
  return message;
}

std::vector<std::string> Arguments(const std::vector<FlagsFileEntry>& entries) {
  std::vector<std::string> args;
  for (const FlagsFileEntry& e : entries) args.push_back(e.argument);
  return args;
}

TEST(FlagsFileTest, GoodFileBecomesArgumentsInFileOrder) {
  auto parsed = Parse(
      "# comment\n"
      "layers = 4\n"
      "backend = \"cpu\"   # trailing comment\n"
      "allow-client-shm = true\n"
      "draft-buckets = [1, 2,\n  4]\n"
      "pool-bytes = \"64MiB\"\n"
      "softmax-scale = 0.125\n");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_THAT(Arguments(*parsed),
              ElementsAre("--layers=4", "--backend=cpu", "--allow-client-shm=true",
                          "--draft-buckets=1,2,4", "--pool-bytes=64MiB", "--softmax-scale=0.125"));
  EXPECT_EQ((*parsed)[0].line, 2);
  EXPECT_EQ((*parsed)[3].line, 5);
  EXPECT_EQ((*parsed)[3].flag, "--draft-buckets");
}

TEST(FlagsFileTest, IntegerForNumberAndSizeFlags) {
  auto parsed = Parse("softmax-scale = 1\npool-bytes = 1048576\nallow-client-shm = false\n");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_THAT(Arguments(*parsed),
              ElementsAre("--softmax-scale=1", "--pool-bytes=1048576", "--allow-client-shm=false"));
}

TEST(FlagsFileTest, DuplicateKeyIsAnErrorOnItsSecondLine) {
  EXPECT_THAT(ErrorOf("layers = 2\nbackend = \"cpu\"\nlayers = 3\n"),
              AllOf(HasSubstr("flags.toml:3"), HasSubstr("layers")));
}

TEST(FlagsFileTest, UnterminatedArrayIsAnError) {
  EXPECT_THAT(ErrorOf("layers = 2\ndraft-buckets = [1, 2\n"),
              AllOf(HasSubstr("flags.toml:2"), HasSubstr("end-of-file")));
}

TEST(FlagsFileTest, IntegerOverflowIsAnError) {
  EXPECT_THAT(ErrorOf("layers = 99999999999999999999\n"),
              AllOf(HasSubstr("flags.toml:1"), HasSubstr("64 bits")));
}

TEST(FlagsFileTest, HugeValueIsNotEchoed) {
  const std::string digits(2'000'000, '9');
  EXPECT_THAT(ErrorOf("layers = " + digits + "\n"), HasSubstr("flags.toml:1"));
  const std::string word(2'000'000, 'x');
  EXPECT_THAT(ErrorOf("layers = \"" + word + "\"\n"),
              AllOf(HasSubstr("flags.toml:1: layers: need an integer, got a string")));
  EXPECT_THAT(ErrorOf(word + " = 1\n"), HasSubstr("no such flag"));
}

TEST(FlagsFileTest, ByteOrderMarkIsSkipped) {
  auto parsed = Parse("\xef\xbb\xbflayers = 2\n");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_THAT(Arguments(*parsed), ElementsAre("--layers=2"));
}

TEST(FlagsFileTest, TablesAndDottedKeysAreErrors) {
  EXPECT_THAT(ErrorOf("layers = 2\n[server]\nbackend = \"cpu\"\n"),
              AllOf(HasSubstr("flags.toml:2: server: a table"), Not(HasSubstr("INI")),
                    Not(HasSubstr("++"))));
  EXPECT_THAT(ErrorOf("server.layers = 2\n"), HasSubstr("flags.toml:1: server: a table"));
}

TEST(FlagsFileTest, UnknownKeyIsAnError) {
  EXPECT_THAT(ErrorOf("layers = 2\nlayerz = 3\n"),
              AllOf(HasSubstr("flags.toml:2: layerz: no such flag"), Not(HasSubstr("mean"))));
  // With a suggester, the nearest flag is named.
  auto parsed = ParseFlagsFile("flags.toml", "layerz = 3\n", KindOf, [](const std::string& flag) {
    return flag == "--layerz" ? std::string("--layers") : "";
  });
  EXPECT_THAT(std::string(parsed.status().message()),
              HasSubstr("layerz: no such flag (the file takes the server's flags, without the "
                        "dashes); did you mean layers?"));
}

TEST(FlagsFileTest, WrongTypesAreErrors) {
  EXPECT_THAT(ErrorOf("layers = \"4\"\n"), HasSubstr("layers: need an integer, got a string"));
  EXPECT_THAT(ErrorOf("layers = 4.5\n"), HasSubstr("layers: need an integer, got a float"));
  EXPECT_THAT(ErrorOf("allow-client-shm = \"yes\"\n"),
              HasSubstr("allow-client-shm: need true or false, got a string"));
  EXPECT_THAT(ErrorOf("allow-client-shm = 1\n"), HasSubstr("need true or false, got an integer"));
  EXPECT_THAT(ErrorOf("backend = 3\n"), HasSubstr("backend: need a string, got an integer"));
  EXPECT_THAT(ErrorOf("draft-buckets = [1, \"2\"]\n"),
              HasSubstr("draft-buckets: need an array of integers"));
  EXPECT_THAT(ErrorOf("layers = [1]\n"), HasSubstr("layers: need an integer, got an array"));
  EXPECT_THAT(ErrorOf("layers = 1979-05-27\n"), HasSubstr("got a date or time"));
}

TEST(FlagsFileTest, SyntaxErrorNamesLineAndSaysToml) {
  EXPECT_THAT(ErrorOf("layers = 2\nbackend cpu\n"),
              AllOf(HasSubstr("flags.toml:2:"), HasSubstr("not valid TOML")));
  // A control character in a message is written escaped, never raw.
  EXPECT_THAT(ErrorOf("backend = \"a\x01z\"\n"), Not(HasSubstr("\x01")));
}

TEST(FlagsFileTest, ClipForMessageCutsAndEscapes) {
  EXPECT_EQ(ClipForMessage("abc"), "abc");
  EXPECT_EQ(ClipForMessage("a\nb\xef"), "a\\x0ab\\xef");
  EXPECT_EQ(ClipForMessage(std::string(100, 'x'), 10), std::string(10, 'x') + "...");
}

}  // namespace
}  // namespace mlaverify
