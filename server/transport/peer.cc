#include "server/transport/peer.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"

namespace mlaverify::transport {
namespace {

bool IsLoopbackIpv4(const std::string& host) {
  in_addr addr{};
  if (inet_pton(AF_INET, host.c_str(), &addr) != 1) return false;
  return (ntohl(addr.s_addr) >> 24) == 127;
}

bool IsLoopbackIpv6(const std::string& host) {
  in6_addr addr{};
  if (inet_pton(AF_INET6, host.c_str(), &addr) != 1) return false;
  if (IN6_IS_ADDR_LOOPBACK(&addr)) return true;
  // ::ffff:127.a.b.c, a dual-stack listener's view of an IPv4 loopback peer.
  return IN6_IS_ADDR_V4MAPPED(&addr) && addr.s6_addr[12] == 127;
}

}  // namespace

bool IsLocalPeer(absl::string_view peer) {
  if (absl::StartsWith(peer, "unix:") || absl::StartsWith(peer, "unix-abstract:")) return true;
  if (absl::ConsumePrefix(&peer, "ipv4:")) {
    const size_t colon = peer.rfind(':');
    if (colon == absl::string_view::npos) return false;
    return IsLoopbackIpv4(std::string(peer.substr(0, colon)));
  }
  if (absl::ConsumePrefix(&peer, "ipv6:")) {
    const std::string unescaped =
        absl::StrReplaceAll(peer, {{"%5B", "["}, {"%5b", "["}, {"%5D", "]"}, {"%5d", "]"}});
    absl::string_view rest = unescaped;
    if (!absl::ConsumePrefix(&rest, "[")) return false;
    const size_t close = rest.find(']');
    if (close == absl::string_view::npos) return false;
    std::string host(rest.substr(0, close));
    // A zone index ("fe80::1%25eth0") is never loopback; inet_pton refuses it.
    return IsLoopbackIpv6(host);
  }
  return false;
}

}  // namespace mlaverify::transport
