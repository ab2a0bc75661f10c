// GPU doorbells in a build without CUDA: there is no device memory to wait on.
#include "client/gpu_doorbells.h"

namespace mlaverify::client::gpu_doorbells {
namespace {

absl::Status NoCuda() {
  return absl::UnimplementedError(
      "this build has no CUDA support: GPU doorbells are not available (use host doorbells)");
}

}  // namespace

absl::StatusOr<uint64_t> OpenArena(const std::string&, int) { return NoCuda(); }
void CloseArena(uint64_t, int) {}
absl::Status Ring(void*, uint64_t, uint64_t) { return NoCuda(); }
absl::Status Wait(void*, uint64_t, uint64_t) { return NoCuda(); }
absl::StatusOr<uint64_t> Read(uint64_t, int) { return NoCuda(); }

absl::StatusOr<std::unique_ptr<TimedStream>> TimedStream::Create(int, int) { return NoCuda(); }
TimedStream::~TimedStream() = default;
absl::Status TimedStream::MakeCurrent() const { return NoCuda(); }
absl::Status TimedStream::Record(int) { return NoCuda(); }
absl::Status TimedStream::Synchronize() { return NoCuda(); }
absl::StatusOr<double> TimedStream::Elapsed(int, int) const { return NoCuda(); }

}  // namespace mlaverify::client::gpu_doorbells
