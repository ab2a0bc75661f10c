#pragma once

#include "absl/strings/string_view.h"

namespace mlaverify::transport {

// Whether a gRPC peer string (grpc::ServerContextBase::peer()) names a
// client on this host: a unix socket, an IPv4 address in 127.0.0.0/8, the
// IPv6 loopback ::1, or an IPv4-mapped 127.x address. gRPC 1.51 writes IPv6
// peers URI-escaped ("ipv6:%5B::1%5D:5000"); brackets are taken escaped or
// not. Anything that does not parse is not local.
bool IsLocalPeer(absl::string_view peer);

}  // namespace mlaverify::transport
