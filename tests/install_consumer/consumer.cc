// A scheduler's first lines against an installed mlaverify client: connect,
// read the server's geometry, open a sequence and let its handle release it.
//   consumer HOST:PORT
// Prints "consumer ok: <layers> layers, <heads> heads, sequence released"
// and exits 0, or prints the failing call's status and exits 1.
#include <cstdio>
#include <string>

#include "client/client.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer HOST:PORT\n");
    return 2;
  }
  auto client = mlaverify::client::VerifyClient::Create(argv[1], {});
  if (!client.ok()) {
    std::fprintf(stderr, "Create: %s\n", client.status().ToString().c_str());
    return 1;
  }
  auto info = (*client)->GetServerInfo();
  if (!info.ok()) {
    std::fprintf(stderr, "GetServerInfo: %s\n", info.status().ToString().c_str());
    return 1;
  }
  {
    auto sequence = (*client)->OpenSequence("install-consumer");
    if (!sequence.ok()) {
      std::fprintf(stderr, "OpenSequence: %s\n", sequence.status().ToString().c_str());
      return 1;
    }
  }  // the handle releases the sequence here
  std::printf("consumer ok: %d layers, %d heads, sequence released\n", info->num_layers(),
              info->num_heads());
  return 0;
}
