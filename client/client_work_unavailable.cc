// The client's stand-in GPU work in a build without CUDA.
#include "client/client_work.h"

namespace mlaverify::client {

absl::Status LaunchClientWork(void*, double) {
  return absl::UnimplementedError("this build has no CUDA support: no GPU work to run");
}

}  // namespace mlaverify::client
