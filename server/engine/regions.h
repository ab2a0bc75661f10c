// Shared-memory regions that co-located clients register once, so that the
// tensors of their calls travel as (region, offset, byte_size) references
// instead of bytes (Triton Inference Server's system and CUDA shared-memory
// extensions are the model):
//   - system regions: a POSIX shared-memory range, mapped once read-write
//     and page-locked for the devices where that is possible, so that the
//     devices read and write it in place;
//   - CUDA regions: device memory a client exported (cudaIpcMemHandle),
//     opened once on every device of the engine, or (in process) device
//     memory named by its address.
// A call takes a lease on every region it references (RegionLeases) while it
// is validated and keeps it until its work completed; Unregister refuses a
// region a lease holds. Every reference is checked against its region's
// bounds and the dtype's alignment; outputs may not overlap any other range
// of the same call, also through two regions over one object.
//
// Trust: a client that shrinks a registered object (ftruncate) after
// registering it makes the server's next access to the lost pages fault
// (SIGBUS), and a CUDA region's byte_size is the client's word. Shared
// memory is therefore off unless the operator enables it, for schedulers on
// the same host under the same administration.
//
// Owned by the engine; the transport only converts its messages. Thread-safe.
#ifndef MLAVERIFY_SERVER_ENGINE_REGIONS_H_
#define MLAVERIFY_SERVER_ENGINE_REGIONS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/engine/tensor_ref.h"

namespace mlaverify::engine {

struct RegionOptions {
  bool enabled = false;  // --allow-client-shm
  int64_t max_regions = 256;
  int64_t max_total_bytes = int64_t{64} << 30;  // of all registered ranges together
  // --shm-key-prefix: a key must start with it ("/" admits every key). The
  // server reads and writes what a client names, so the objects it may open
  // are narrowed to the schedulers' own: those under this prefix, owned by
  // the server's effective user (see docs/operations.md, "Security model").
  std::string key_prefix = "/mlaverify";
};

// Which regions an Unregister or a Status call means.
enum class RegionKind { kAny, kSystem, kCuda };

struct RegionStatus {
  std::string name;
  std::string key;  // the shm_open name, or "cuda:<device>"
  uint64_t offset = 0;
  uint64_t byte_size = 0;
  int64_t calls_in_flight = 0;
  int64_t calls_total = 0;
  bool pinned = false;  // the devices read and write it in place
  bool cuda = false;
  int device_id = -1;  // CUDA regions
};

// Host memory as the devices address it: each worker's address of its first
// byte, and whether it had to be page-locked for that (a GPU).
struct HostMapping {
  std::vector<uint64_t> device;
  bool pinned = false;
};

// How regions reach the devices; the engine implements it over its workers.
// Addresses are indexed by worker.
class RegionMapper {
 public:
  virtual ~RegionMapper() = default;
  // Makes [data, data + bytes) of host memory addressable by every device
  // (page-locked and mapped on a GPU; host devices address it as it is).
  // The error says why not (e.g. RLIMIT_MEMLOCK); the region is then used
  // through host copies.
  virtual absl::StatusOr<HostMapping> MapHost(void* data, size_t bytes) = 0;
  virtual void UnmapHost(void* data) = 0;
  // Opens exported device memory on every device. FAILED_PRECONDITION on a
  // backend without device memory, INVALID_ARGUMENT for a device or handle
  // that is not the engine's or does not open.
  virtual absl::StatusOr<std::vector<uint64_t>> OpenCuda(absl::string_view handle,
                                                         int device_id) = 0;
  virtual void CloseCuda(const std::vector<uint64_t>& addresses) = 0;
  // In-process device memory: `address` as device `device_id` addresses it,
  // as each worker addresses it (peer access where the worker's device is
  // another). INVALID_ARGUMENT where a worker cannot reach it.
  virtual absl::StatusOr<std::vector<uint64_t>> AddressLocalDevice(uint64_t address,
                                                                   int device_id) = 0;
};

// One registered range. Owned by the registry and by the leases on it;
// unmapped (or closed) when the last of them lets go.
class Region {
 public:
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  const std::string& name() const { return name_; }
  uint64_t byte_size() const { return byte_size_; }
  bool cuda() const { return cuda_; }
  // The first byte of the registered range in this process (offset 0 of
  // every reference); null for CUDA regions.
  uint8_t* host() const { return host_; }
  // The first byte as each worker's device addresses it; empty when the
  // devices cannot address it (a system region that could not be pinned).
  const std::vector<uint64_t>& device() const { return device_; }

 private:
  friend class RegionRegistry;
  friend class RegionLeases;
  Region() = default;

  std::string name_, key_;
  uint64_t offset_ = 0, byte_size_ = 0;
  // The object itself: two names over one object are told apart only by
  // these (the overlap check compares object bytes, not names).
  uint64_t object_device_ = 0, object_inode_ = 0;
  void* mapping_ = nullptr;  // page-aligned start of the mmap
  size_t mapping_bytes_ = 0;
  uint8_t* host_ = nullptr;
  std::vector<uint64_t> device_;
  bool pinned_ = false;
  bool cuda_ = false;
  int device_id_ = -1;
  RegionMapper* mapper_ = nullptr;  // undoes the mapping
  bool opened_ipc_ = false;
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> calls_total_{0};
};

class RegionRegistry;

// A tensor range resolved for one call.
struct ResolvedRange {
  const Region* region = nullptr;
  uint64_t offset = 0;  // from the region's start
  uint8_t* host() const { return region->host() == nullptr ? nullptr : region->host() + offset; }
};

// The regions one call references, leased until Clear() or destruction
// (after the call's work completed), and the byte ranges it uses in them for
// the overlap check. Not thread-safe: one call's submitting thread fills it.
class RegionLeases {
 public:
  RegionLeases() = default;
  ~RegionLeases();
  RegionLeases(const RegionLeases&) = delete;
  RegionLeases& operator=(const RegionLeases&) = delete;
  RegionLeases(RegionLeases&& other) noexcept { *this = std::move(other); }
  RegionLeases& operator=(RegionLeases&& other) noexcept {
    Clear();
    leases_.swap(other.leases_);
    ranges_.swap(other.ranges_);
    return *this;
  }

  // The range `ref` names, leased for this call, checked to hold exactly
  // `expected_bytes` aligned to `alignment` inside the region.
  // FAILED_PRECONDITION (shared memory off), NOT_FOUND (unknown region),
  // INVALID_ARGUMENT (byte_size is not `expected_bytes`; the tensor's place
  // in the object not a multiple of `alignment`), OUT_OF_RANGE (past the
  // region's end); `what` names the tensor (its text built only for errors).
  absl::StatusOr<ResolvedRange> Resolve(RegionRegistry& registry, const RegionRange& ref,
                                        uint64_t expected_bytes, uint64_t alignment, bool is_output,
                                        const TensorName& what);
  // INVALID_ARGUMENT naming both tensors when an output range overlaps any
  // other range resolved through this object, in the same object.
  absl::Status CheckOutputsDoNotOverlap() const;
  bool empty() const { return leases_.empty(); }
  void Clear();

 private:
  struct Range {
    const Region* region;
    uint64_t begin, end;  // byte offsets in the object (region offset included)
    bool is_output;
    TensorName what;
  };
  std::vector<std::shared_ptr<Region>> leases_;  // each region once
  std::vector<Range> ranges_;
};

class RegionRegistry {
 public:
  explicit RegionRegistry(const RegionOptions& options);
  ~RegionRegistry();

  bool enabled() const { return options_.enabled; }
  const RegionOptions& options() const { return options_; }
  // The devices' side (set once by the engine, before any registration).
  void SetMapper(RegionMapper* mapper);

  // Opens `key` read-write and maps [offset, offset + byte_size). Errors as
  // RegisterSystemSharedMemory documents them in verify.proto.
  absl::Status Register(const std::string& name, const std::string& key, uint64_t offset,
                        uint64_t byte_size);
  // Opens the client's exported device memory (`handle`: cudaIpcMemHandle
  // bytes, on device `device_id`) as region `name` of `byte_size` bytes on
  // every device. Errors as RegisterCudaSharedMemory documents them.
  absl::Status RegisterCuda(const std::string& name, const std::string& handle, int device_id,
                            uint64_t byte_size);
  // In-process callers: device memory of this process at `address` on
  // device `device_id` as region `name`. Same errors as RegisterCuda.
  absl::Status RegisterLocalDevice(const std::string& name, uint64_t address, int device_id,
                                   uint64_t byte_size);
  // Removes `name` of `kind` (empty: every region of that kind) unless a
  // call holds one; returns the names removed. NOT_FOUND for an unknown name
  // (or one of the other kind); FAILED_PRECONDITION when a lease holds one
  // (then nothing is removed).
  absl::StatusOr<std::vector<std::string>> Unregister(const std::string& name, RegionKind kind);
  // `name` (empty: every region) of `kind`, by name.
  absl::StatusOr<std::vector<RegionStatus>> Status(const std::string& name, RegionKind kind) const;
  // Drops every region whatever holds it (the server drains: no call is left
  // running; leases still held keep their mappings until they let go).
  int64_t ReleaseAll();

  int64_t regions() const;
  int64_t registered_bytes() const;

 private:
  friend class RegionLeases;
  // The region of `name`, its in-flight count raised (under the lock, so
  // that Unregister's check sees it), or NOT_FOUND.
  absl::StatusOr<std::shared_ptr<Region>> Lease(absl::string_view name);
  absl::Status CheckRoom(const std::string& name, uint64_t byte_size) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The mapper to register with, when a region of `name` and `byte_size`
  // has room (checked again by Insert: registrations map outside the lock).
  absl::StatusOr<RegionMapper*> MapperIfRoom(const std::string& name, uint64_t byte_size) const;
  absl::Status Insert(std::shared_ptr<Region> region);
  // The common part of RegisterCuda and RegisterLocalDevice.
  absl::Status InsertDevice(const std::string& name, int device_id, uint64_t byte_size,
                            RegionMapper* mapper, absl::StatusOr<std::vector<uint64_t>> opened,
                            bool ipc, absl::string_view how);

  const RegionOptions options_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Region>, std::less<>> regions_ ABSL_GUARDED_BY(mu_);
  int64_t registered_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  RegionMapper* mapper_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_REGIONS_H_
