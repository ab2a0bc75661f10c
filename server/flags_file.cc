#include "server/flags_file.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

// Errors as values (toml::parse_result), not exceptions: this file is the
// only one that includes toml++, so the setting cannot differ between units.
#define TOML_EXCEPTIONS 0
#include "toml++/toml.h"

namespace mlaverify {
namespace {

const char* TypeName(toml::node_type type) {
  switch (type) {
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a float";
    case toml::node_type::boolean:
      return "a boolean";
    case toml::node_type::date:
    case toml::node_type::time:
    case toml::node_type::date_time:
      return "a date or time";
    default:
      return "nothing";
  }
}

const char* Wanted(FlagKind kind) {
  switch (kind) {
    case FlagKind::kSwitch:
      return "true or false";
    case FlagKind::kInteger:
      return "an integer";
    case FlagKind::kNumber:
      return "a number";
    case FlagKind::kSize:
      return "an integer or a size string such as \"1GiB\"";
    case FlagKind::kText:
      return "a string";
    case FlagKind::kIntegerList:
      return "an array of integers such as [1, 2, 4]";
  }
  return "?";
}

// The argument text of one scalar, or nullopt when its TOML type does not
// fit the flag.
std::optional<std::string> ScalarText(const toml::node& node, FlagKind kind) {
  if (const auto* b = node.as_boolean()) {
    if (kind != FlagKind::kSwitch) return std::nullopt;
    return b->get() ? "true" : "false";
  }
  if (const auto* i = node.as_integer()) {
    if (kind == FlagKind::kSwitch || kind == FlagKind::kText) return std::nullopt;
    return absl::StrCat(i->get());
  }
  if (const auto* d = node.as_floating_point()) {
    if (kind != FlagKind::kNumber) return std::nullopt;
    return absl::StrFormat("%.17g", d->get());
  }
  if (const auto* s = node.as_string()) {
    if (kind != FlagKind::kText && kind != FlagKind::kSize) return std::nullopt;
    return s->get();
  }
  return std::nullopt;
}

}  // namespace

std::string ClipForMessage(absl::string_view text, size_t max_chars) {
  std::string out;
  for (size_t k = 0; k < text.size(); ++k) {
    if (out.size() >= max_chars) {
      out += "...";
      break;
    }
    const unsigned char c = static_cast<unsigned char>(text[k]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += absl::StrFormat("\\x%02x", c);
    }
  }
  return out;
}

absl::StatusOr<std::vector<FlagsFileEntry>> ParseFlagsFile(
    const std::string& path, absl::string_view text,
    const std::function<std::optional<FlagKind>(const std::string& flag)>& kind_of,
    const std::function<std::string(const std::string& flag)>& nearest) {
  const std::string where = ClipForMessage(path, 200);
  // toml++ skips a leading UTF-8 byte order mark, rejects duplicate keys,
  // unterminated arrays and strings, and integers beyond 64 bits.
  toml::parse_result parsed = toml::parse(std::string_view(text.data(), text.size()));
  if (!parsed) {
    const toml::parse_error& e = parsed.error();
    return absl::InvalidArgumentError(
        absl::StrCat(where, ":", e.source().begin.line, ":", e.source().begin.column,
                     ": not valid TOML: ", ClipForMessage(std::string(e.description()), 120)));
  }
  const toml::table& table = parsed.table();
  std::vector<FlagsFileEntry> entries;
  for (auto&& [key, node] : table) {
    FlagsFileEntry entry;
    entry.line = static_cast<int>(key.source().begin.line);
    const std::string key_text(key.str());
    const std::string name = ClipForMessage(key_text);
    auto fail = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ":", entry.line, ": ", name, ": ", why));
    };
    if (node.is_table()) {
      return fail(
          "a table (or dotted key) is not a flag; write `flag-name = value` lines, no "
          "[sections]");
    }
    entry.flag = absl::StrCat("--", key_text);
    const std::optional<FlagKind> kind = kind_of(entry.flag);
    if (!kind) {
      std::string why = "no such flag (the file takes the server's flags, without the dashes)";
      if (const std::string meant = nearest ? nearest(entry.flag) : ""; !meant.empty()) {
        absl::StrAppend(&why, "; did you mean ", ClipForMessage(meant.substr(2)), "?");
      }
      return fail(why);
    }
    std::string value;
    if (const toml::array* array = node.as_array(); array != nullptr) {
      if (*kind != FlagKind::kIntegerList) {
        return fail(absl::StrCat("need ", Wanted(*kind), ", got an array"));
      }
      std::vector<std::string> items;
      for (const toml::node& item : *array) {
        if (!item.is_integer()) {
          return fail(absl::StrCat("need ", Wanted(*kind), ", got ", TypeName(item.type()),
                                   " in the array"));
        }
        items.push_back(absl::StrCat(item.as_integer()->get()));
      }
      value = absl::StrJoin(items, ",");
    } else {
      std::optional<std::string> scalar = ScalarText(node, *kind);
      if (!scalar)
        return fail(absl::StrCat("need ", Wanted(*kind), ", got ", TypeName(node.type())));
      value = *std::move(scalar);
    }
    entry.argument = absl::StrCat(entry.flag, "=", value);
    entries.push_back(std::move(entry));
  }
  // toml::table iterates in key order; the file's order reads better in errors.
  std::stable_sort(
      entries.begin(), entries.end(),
      [](const FlagsFileEntry& a, const FlagsFileEntry& b) { return a.line < b.line; });
  return entries;
}

}  // namespace mlaverify
