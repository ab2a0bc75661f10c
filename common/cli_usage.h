// How the command-line tools word usage errors, header-only like
// cli_switch.h (the binaries' mains include it, the libraries never do): one
// line on stderr, "PROGRAM: what was wrong", no log timestamp or level, the
// way Unix tools report a bad command line, then exit 2.
#ifndef MLAVERIFY_COMMON_CLI_USAGE_H_
#define MLAVERIFY_COMMON_CLI_USAGE_H_

#include <cctype>
#include <string>

#include "CLI/CLI.hpp"

namespace mlaverify {

// "PROGRAM: message" with the message's first letter lowered where CLI11
// starts a sentence ("The following argument..." reads "the following...").
inline std::string UsageErrorLine(const std::string& program, std::string message) {
  if (message.size() > 1 && std::isupper(static_cast<unsigned char>(message[0])) &&
      std::islower(static_cast<unsigned char>(message[1]))) {
    message[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(message[0])));
  }
  return program + ": " + message;
}

// CLI11's parse errors in that form, pointing at --help.
inline void UseUsageErrorLines(CLI::App* app, const std::string& program) {
  app->failure_message([program](const CLI::App*, const CLI::Error& e) {
    return UsageErrorLine(program, e.what()) + " (--help lists the flags)\n";
  });
}

}  // namespace mlaverify

#endif  // MLAVERIFY_COMMON_CLI_USAGE_H_
