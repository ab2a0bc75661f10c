// The system shared-memory data plane: POSIX shared-memory ranges that
// co-located clients register by name, so that tensors travel as
// (region, offset, byte_size) references instead of bytes through gRPC.
// Modelled on Triton Inference Server's system shared-memory extension.
//
// The registry maps each registered range once (read-write, MAP_SHARED) and
// keeps it mapped while any call holds it: a call takes a lease on every
// region it references (RegionLeases) before its work is queued and drops it
// after the work completed, and Unregister refuses a region a lease holds.
// Every reference is checked against its region's bounds and the dtype's
// alignment; outputs may not overlap any other range of the same call.
//
// Trust: a client that shrinks a registered object (ftruncate) after
// registering it makes the server's next access to the lost pages fault
// (SIGBUS). Shared memory is therefore off unless the operator enables it,
// for schedulers on the same host under the same administration.
//
// No gRPC or protobuf here: the service converts its messages to these calls.
// Thread-safe.
#ifndef MLAVERIFY_SERVER_TRANSPORT_SHARED_MEMORY_H_
#define MLAVERIFY_SERVER_TRANSPORT_SHARED_MEMORY_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace mlaverify::transport {

struct SharedMemoryOptions {
  bool enabled = false;  // --allow-client-shm
  int64_t max_regions = 256;
  int64_t max_total_bytes = int64_t{64} << 30;  // of all registered ranges together
};

struct SharedMemoryRegionStatus {
  std::string name;
  std::string key;
  uint64_t offset = 0;
  uint64_t byte_size = 0;
  int64_t calls_in_flight = 0;
  int64_t calls_total = 0;
  bool pinned = false;
  bool cuda = false;   // CUDA shared memory (device memory by IPC handle)
  int device_id = -1;  // its device (cuda only)
};

// CUDA shared memory: mapping a client's exported device memory on the
// engine's devices (the engine's OpenIpcMemory / CloseIpcMemory).
struct CudaIpcOpener {
  std::function<absl::StatusOr<std::vector<void*>>(const std::string& handle, int device_id)> open;
  std::function<void(const std::vector<void*>&)> close;
};

// Page-locking of mapped regions for direct device copies (the engine's
// PinHostMemory); pin returns OK or why not (the region is then used
// unpinned).
struct HostMemoryPinner {
  std::function<absl::Status(void*, size_t)> pin;
  std::function<void(void*)> unpin;
};

// One mapped range. Owned by the registry and by the leases on it; unmapped
// when the last of them lets go.
class SharedMemoryRegion {
 public:
  ~SharedMemoryRegion();
  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;

  const std::string& name() const { return name_; }
  uint64_t byte_size() const { return byte_size_; }
  bool cuda() const { return cuda_; }
  // The first byte of the registered range (offset 0 of every reference);
  // null for CUDA regions.
  uint8_t* data() const { return data_; }
  // CUDA regions: the first byte as each engine worker's device addresses it.
  const std::vector<uint8_t*>& device_data() const { return device_data_; }

 private:
  friend class SharedMemoryRegistry;
  friend class RegionLeases;
  SharedMemoryRegion() = default;

  std::string name_, key_;
  uint64_t offset_ = 0, byte_size_ = 0;
  // The object itself: two names over one object are told apart only by
  // these (the overlap check compares object bytes, not names).
  uint64_t device_ = 0, inode_ = 0;
  void* mapping_ = nullptr;  // page-aligned start of the mmap
  size_t mapping_bytes_ = 0;
  uint8_t* data_ = nullptr;
  std::function<void(void*)> unpin_;  // set when pinned
  bool cuda_ = false;
  int device_id_ = -1;
  std::vector<uint8_t*> device_data_;
  std::function<void(const std::vector<void*>&)> close_ipc_;
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> calls_total_{0};
};

class SharedMemoryRegistry;

// The regions one call references, leased until it is destroyed (after the
// call's work completed), and the byte ranges it uses in them for the overlap
// check. Not thread-safe: one call's decoding thread fills it.
class RegionLeases {
 public:
  RegionLeases() = default;
  ~RegionLeases();
  RegionLeases(const RegionLeases&) = delete;
  RegionLeases& operator=(const RegionLeases&) = delete;

  // Whether `region` is a registered CUDA region (false also when unknown:
  // Resolve then says NOT_FOUND).
  static bool IsCuda(const SharedMemoryRegistry& registry, absl::string_view region);

  // The bytes of `byte_size` at `offset` of `region`, leased for this call.
  // FAILED_PRECONDITION (shared memory off), NOT_FOUND (unknown region),
  // INVALID_ARGUMENT (byte_size is not `expected_bytes`; the tensor's place
  // in the object, region offset + offset, not a multiple of `alignment`),
  // OUT_OF_RANGE (past the region's end); `what` names the tensor.
  absl::StatusOr<uint8_t*> Resolve(SharedMemoryRegistry& registry, absl::string_view region,
                                   uint64_t offset, uint64_t byte_size, uint64_t expected_bytes,
                                   uint64_t alignment, bool is_output, absl::string_view what);
  // The same for a CUDA region: the bytes as each engine worker's device
  // addresses them. A region of the other kind is INVALID_ARGUMENT.
  absl::StatusOr<std::vector<uint8_t*>> ResolveDevice(SharedMemoryRegistry& registry,
                                                      absl::string_view region, uint64_t offset,
                                                      uint64_t byte_size, uint64_t expected_bytes,
                                                      uint64_t alignment, bool is_output,
                                                      absl::string_view what);
  // INVALID_ARGUMENT naming both tensors when an output range overlaps any
  // other range resolved through this object, in the same shared-memory
  // object (also through two regions over one object).
  absl::Status CheckOutputsDoNotOverlap() const;
  bool empty() const { return leases_.empty(); }
  // Drops every lease now (the destructor does the same).
  void Clear();

 private:
  // The checks both Resolves share; the leased region.
  absl::StatusOr<SharedMemoryRegion*> Check(SharedMemoryRegistry& registry,
                                            absl::string_view region, uint64_t offset,
                                            uint64_t byte_size, uint64_t expected_bytes,
                                            uint64_t alignment, bool is_output, bool cuda,
                                            absl::string_view what);
  struct Range {
    const SharedMemoryRegion* region;
    uint64_t begin, end;  // byte offsets in the object (region offset included)
    bool is_output;
    std::string what;
  };
  std::vector<std::shared_ptr<SharedMemoryRegion>> leases_;  // each region once
  std::vector<Range> ranges_;
};

class SharedMemoryRegistry {
 public:
  explicit SharedMemoryRegistry(const SharedMemoryOptions& options);
  ~SharedMemoryRegistry();

  bool enabled() const { return options_.enabled; }
  // Regions registered from now on are page-locked through `pinner` (set
  // once, when the engine is attached; until then regions stay unpinned).
  void SetPinner(HostMemoryPinner pinner);
  const SharedMemoryOptions& options() const { return options_; }

  // Opens `key` read-write and maps [offset, offset + byte_size). Errors as
  // RegisterSystemSharedMemory documents them in verify.proto.
  absl::Status Register(const std::string& name, const std::string& key, uint64_t offset,
                        uint64_t byte_size);
  // Maps the client's exported device memory (`handle`: cudaIpcMemHandle
  // bytes, on device `device_id`) as region `name` of `byte_size` bytes on
  // every engine device. Errors as RegisterCudaSharedMemory documents them.
  absl::Status RegisterCuda(const std::string& name, const std::string& handle, int device_id,
                            uint64_t byte_size);
  // CUDA regions can be registered from now on (set when a CUDA engine is
  // attached; until then RegisterCuda is FAILED_PRECONDITION).
  void SetCudaOpener(CudaIpcOpener opener);
  // Removes `name` (empty: every region) unless a call holds it; returns the
  // names removed. Atomic: on error nothing is removed.
  absl::StatusOr<std::vector<std::string>> Unregister(const std::string& name);
  // `name` (empty: every region), by name.
  absl::StatusOr<std::vector<SharedMemoryRegionStatus>> Status(const std::string& name) const;
  // Drops every region whatever holds it (the server drains: no call is left
  // running; leases still held keep their mappings until they let go).
  // Returns how many there were.
  int64_t ReleaseAll();

  int64_t regions() const;
  int64_t registered_bytes() const;

 private:
  friend class RegionLeases;
  // The region of `name`, its in-flight count raised (under the lock, so
  // that Unregister's check sees it), or NOT_FOUND.
  absl::StatusOr<std::shared_ptr<SharedMemoryRegion>> Lease(absl::string_view name);

  const SharedMemoryOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<SharedMemoryRegion>, std::less<>> regions_
      ABSL_GUARDED_BY(mu_);
  int64_t registered_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  HostMemoryPinner pinner_ ABSL_GUARDED_BY(mu_);
  CudaIpcOpener cuda_opener_ ABSL_GUARDED_BY(mu_);
  // Checks name uniqueness and the limits for `byte_size` more (under mu_).
  absl::Status CheckRoom(const std::string& name, uint64_t byte_size) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds a mapped region if CheckRoom still allows it.
  absl::Status Insert(std::shared_ptr<SharedMemoryRegion> region);
};

}  // namespace mlaverify::transport

#endif  // MLAVERIFY_SERVER_TRANSPORT_SHARED_MEMORY_H_
