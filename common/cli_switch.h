// A boolean command-line switch for CLI11 (header-only; the binaries' mains
// include it, the libraries never do): `--name` alone sets true, and
// `--name=true`, `--name=false`, `--name false` (also yes/no, on/off, 1/0) set
// the value given, so a switch whose default is true can be turned off and a
// script may always spell the value out. --help shows `--name [BOOL]=DEFAULT`.
#ifndef MLAVERIFY_COMMON_CLI_SWITCH_H_
#define MLAVERIFY_COMMON_CLI_SWITCH_H_

#include <string>

#include "CLI/CLI.hpp"

namespace mlaverify {

inline CLI::Option* AddSwitch(CLI::App* app, const std::string& name, bool* value,
                              const std::string& help) {
  // A flag with an optional value: CLI11 gives a bare flag "true" and parses
  // a value with its bool rules; the next argument is taken as the value only
  // when it is not an option or a subcommand name.
  return app->add_flag(name, *value, help)
      ->expected(0, 1)
      ->type_name("[BOOL]")
      ->default_str(*value ? "true" : "false");
}

}  // namespace mlaverify

#endif  // MLAVERIFY_COMMON_CLI_SWITCH_H_
