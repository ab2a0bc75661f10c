// --log-format json (server/log_format.h): every record one line that a JSON
// parser reads back, with the message exactly as logged, whatever it holds.
#include "server/log_format.h"

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "common/log_fields.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "spdlog/logger.h"
#include "spdlog/sinks/ostream_sink.h"

namespace mlaverify {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::Not;

// Logs each message through a logger with `format` and returns the lines.
std::vector<std::string> LogLines(const std::string& format,
                                  const std::vector<std::string>& messages) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_st>(out);
  spdlog::logger logger("test", sink);
  logger.set_formatter(MakeLogFormatter(format));
  for (const std::string& m : messages) logger.warn("{}", m);
  std::vector<std::string> lines;
  std::istringstream in(out.str());
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(LogFormatTest, JsonLinesParseAndKeepTheMessage) {
  const std::vector<std::string> messages = {
      "plain",
      R"(label "a\"b" from a client)",
      "two\nlines\r\nand a tab\t, SOH \x01 and DEL \x7f",
      "back\\slash",
      "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80",  // valid UTF-8 stays as it is
      "",
  };
  const std::vector<std::string> lines = LogLines("json", messages);
  ASSERT_EQ(lines.size(), messages.size());
  for (size_t k = 0; k < lines.size(); ++k) {
    SCOPED_TRACE(lines[k]);
    const nlohmann::json record = nlohmann::json::parse(lines[k]);
    EXPECT_EQ(record.at("msg").get<std::string>(), messages[k]);
    EXPECT_EQ(record.at("level").get<std::string>(), "warning");
    EXPECT_TRUE(record.at("thread").is_number_integer());
    EXPECT_THAT(
        record.at("time").get<std::string>(),
        MatchesRegex(R"(20[0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9:.]+[+-][0-9][0-9]:[0-9][0-9])"));
  }
}

// Bytes that are not UTF-8 (a client label can be any bytes) become U+FFFD:
// the line still parses.
TEST(LogFormatTest, InvalidUtf8BecomesReplacementCharacter) {
  const std::vector<std::string> lines =
      LogLines("json", {"bad \xff byte, cut \xe2\x82, overlong \xc0\xaf, surrogate \xed\xa0\x80"});
  ASSERT_EQ(lines.size(), 1u);
  const nlohmann::json record = nlohmann::json::parse(lines[0]);
  const std::string msg = record.at("msg").get<std::string>();
  EXPECT_THAT(msg, HasSubstr("bad \xef\xbf\xbd byte"));
  // A truncated sequence is one replacement (Unicode's maximal subpart).
  EXPECT_THAT(msg, HasSubstr("cut \xef\xbf\xbd,"));
  EXPECT_THAT(msg, HasSubstr("overlong \xef\xbf\xbd"));
  EXPECT_THAT(msg, HasSubstr("surrogate \xef\xbf\xbd"));
  EXPECT_THAT(msg, Not(HasSubstr("\xff"))) << "no invalid byte passes through";
}

TEST(LogFormatTest, TextIsOneReadableLine) {
  const std::vector<std::string> lines = LogLines("text", {"hello"});
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_THAT(lines[0], MatchesRegex(R"(20[0-9-]+T[0-9:.]+ warning \[[0-9]+\] hello)"));
}

// Records written inside a ScopedLogFields carry its fields as members (a
// collector filters on them); outside, none; nested scopes replace and put
// back; the text format is the same line either way.
TEST(LogFormatTest, JsonRecordsCarryTheThreadsFields) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_st>(out);
  spdlog::logger logger("test", sink);
  logger.set_formatter(MakeLogFormatter("json"));
  const std::string peer = "ipv4:127.0.0.1:5\"x";
  {
    LogFields call;
    call.rpc = "Verify";
    call.code = "RESOURCE_EXHAUSTED";
    call.peer = peer;
    call.duration_ms = 12.5;
    const ScopedLogFields outer(call);
    logger.warn("outer");
    {
      LogFields ids;
      ids.sequence = 42;
      ids.step = 7;
      const ScopedLogFields inner(ids);
      logger.warn("inner");
    }
    logger.warn("outer again");
  }
  logger.warn("none");
  std::vector<nlohmann::json> records;
  std::istringstream in(out.str());
  for (std::string line; std::getline(in, line);) records.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(records.size(), 4u) << out.str();
  for (int k : {0, 2}) {
    EXPECT_EQ(records[k].at("rpc"), "Verify");
    EXPECT_EQ(records[k].at("code"), "RESOURCE_EXHAUSTED");
    EXPECT_EQ(records[k].at("peer"), peer);
    EXPECT_DOUBLE_EQ(records[k].at("duration_ms").get<double>(), 12.5);
    EXPECT_FALSE(records[k].contains("sequence"));
  }
  EXPECT_EQ(records[1].at("sequence"), 42);
  EXPECT_EQ(records[1].at("step"), 7);
  EXPECT_FALSE(records[1].contains("rpc"));
  for (const char* key : {"rpc", "code", "peer", "sequence", "step", "duration_ms", "source"}) {
    EXPECT_FALSE(records[3].contains(key)) << key;
  }
  EXPECT_EQ(ScopedLogFields::Current(), nullptr);

  LogFields call;
  call.rpc = "Verify";
  const ScopedLogFields fields(call);
  EXPECT_THAT(LogLines("text", {"same"}), ::testing::ElementsAre(MatchesRegex(".* same")));
}

}  // namespace
}  // namespace mlaverify
