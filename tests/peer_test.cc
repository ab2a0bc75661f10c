// Which gRPC peers count as on this host for shared memory.
#include "server/transport/peer.h"

#include <gtest/gtest.h>

namespace mlaverify::transport {
namespace {

TEST(IsLocalPeer, LoopbackAndUnixSocketsAreLocal) {
  EXPECT_TRUE(IsLocalPeer("unix:/tmp/mlaverify.sock"));
  EXPECT_TRUE(IsLocalPeer("unix-abstract:mlaverify"));
  EXPECT_TRUE(IsLocalPeer("ipv4:127.0.0.1:41234"));
  EXPECT_TRUE(IsLocalPeer("ipv4:127.8.9.10:1"));
  // gRPC 1.51 writes IPv6 peers URI-escaped; later releases with brackets.
  EXPECT_TRUE(IsLocalPeer("ipv6:%5B::1%5D:50051"));
  EXPECT_TRUE(IsLocalPeer("ipv6:[::1]:50051"));
  EXPECT_TRUE(IsLocalPeer("ipv6:%5B0:0:0:0:0:0:0:1%5D:50051"));
  EXPECT_TRUE(IsLocalPeer("ipv6:%5B::ffff:127.0.0.1%5D:50051"));
  EXPECT_TRUE(IsLocalPeer("ipv6:[::ffff:127.1.2.3]:50051"));
}

TEST(IsLocalPeer, OtherAddressesAndGarbageAreNot) {
  EXPECT_FALSE(IsLocalPeer("ipv4:10.0.0.7:41234"));
  EXPECT_FALSE(IsLocalPeer("ipv4:128.0.0.1:41234"));
  EXPECT_FALSE(IsLocalPeer("ipv4:1127.0.0.1:41234"));
  EXPECT_FALSE(IsLocalPeer("ipv4:127.0.0.1"));  // no port: not what gRPC writes
  EXPECT_FALSE(IsLocalPeer("ipv6:%5B::2%5D:50051"));
  EXPECT_FALSE(IsLocalPeer("ipv6:%5B::ffff:10.0.0.1%5D:50051"));
  EXPECT_FALSE(IsLocalPeer("ipv6:%5Bfe80::1%25lo%5D:50051"));
  EXPECT_FALSE(IsLocalPeer("ipv6:::1:50051"));  // unbracketed: ambiguous
  EXPECT_FALSE(IsLocalPeer("ipv6:%5B::1:50051"));
  EXPECT_FALSE(IsLocalPeer("ipv6:[::1"));
  EXPECT_FALSE(IsLocalPeer("ipv4:127.0.0.1x:1"));
  EXPECT_FALSE(IsLocalPeer(""));
  EXPECT_FALSE(IsLocalPeer("vsock:2:50051"));
  EXPECT_FALSE(IsLocalPeer("127.0.0.1:50051"));
}

}  // namespace
}  // namespace mlaverify::transport
