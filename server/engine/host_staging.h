// Page-locked host memory that every device reads and writes in place, for
// the tensors whose own memory the devices cannot address (inline request
// bytes, an in-process caller's vectors, a system region that could not be
// page-locked): the engine copies a call's such inputs in when the call is
// submitted (on the submitting thread) and its such outputs out when it
// completes; the batch's copy lists read and write the staging directly.
// Only the CUDA backend has one (host devices address every host byte).
//
// A first-fit allocator over one arena with coalescing free ranges;
// exhaustion is RESOURCE_EXHAUSTED with the numbers. Thread-safe.
#ifndef MLAVERIFY_SERVER_ENGINE_HOST_STAGING_H_
#define MLAVERIFY_SERVER_ENGINE_HOST_STAGING_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace mlaverify::engine {

class HostStaging {
 public:
  struct Block {
    uint8_t* host = nullptr;
    size_t bytes = 0;  // as allocated (rounded up)
  };

  // `memory` holds `bytes`; `device[w]` is its first byte as worker w's
  // device addresses it; `release` frees `memory` when the staging goes.
  HostStaging(uint8_t* memory, size_t bytes, std::vector<uint64_t> device,
              std::function<void(uint8_t*)> release);
  ~HostStaging();
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  // A block of at least `bytes` (rounded up to 256), or RESOURCE_EXHAUSTED
  // naming `what`, the size and the free space (--pinned-staging-bytes).
  absl::StatusOr<Block> Allocate(size_t bytes, const char* what);
  void Free(const Block& block);

  // `host` (inside the arena) as worker `worker`'s device addresses it.
  uint64_t DeviceAddress(int worker, const uint8_t* host) const {
    return device_[worker] + static_cast<uint64_t>(host - memory_);
  }
  size_t capacity() const { return bytes_; }
  size_t in_use() const;

 private:
  uint8_t* const memory_;
  const size_t bytes_;
  const std::vector<uint64_t> device_;
  const std::function<void(uint8_t*)> release_;
  mutable absl::Mutex mu_;
  std::map<size_t, size_t> free_ ABSL_GUARDED_BY(mu_);  // offset -> bytes, coalesced
  size_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_HOST_STAGING_H_
