// ServerInfo for people and scripts: the `info` subcommand's text and JSON,
// and the one-line summary demo and load print before they start.
#ifndef MLAVERIFY_CLIENT_SERVER_INFO_TEXT_H_
#define MLAVERIFY_CLIENT_SERVER_INFO_TEXT_H_

#include <string>

#include "mlaverify/v1/verify.pb.h"
#include "nlohmann/json.hpp"

namespace mlaverify::client {

// Multi-line "key: value" text, one field per line.
std::string FormatServerInfo(const v1::ServerInfo& info);

// "backend cpu (v0.1.0), 4 layers x 8 heads, page 16, 1234/2048 pages free".
std::string ServerInfoSummaryLine(const v1::ServerInfo& info);

// Every field, numbers as JSON numbers (not proto3-JSON strings).
nlohmann::ordered_json ServerInfoToJson(const v1::ServerInfo& info);

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_SERVER_INFO_TEXT_H_
