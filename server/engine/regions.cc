#include "server/engine/regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "spdlog/spdlog.h"

namespace mlaverify::engine {
namespace {

constexpr size_t kMaxNameBytes = 128;
constexpr size_t kMaxKeyBytes = 255;  // NAME_MAX of /dev/shm
constexpr uint64_t kMaxRange = uint64_t{1} << 62;

absl::Status CheckName(const std::string& name) {
  if (name.empty() || name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("shared-memory region name of ", name.size(),
                                                   " bytes; need 1..", kMaxNameBytes));
  }
  for (unsigned char c : name) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(
          "shared-memory region name must be printable ASCII without spaces");
    }
  }
  return absl::OkStatus();
}

absl::Status CheckKey(const std::string& key, const std::string& prefix) {
  if (key.size() < 2 || key.size() > kMaxKeyBytes || key[0] != '/' ||
      key.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(
        "shared-memory key must be '/' followed by 1..254 characters and no other '/' (a "
        "shm_open name)");
  }
  for (unsigned char c : key) {
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError("shared-memory key must be printable ASCII");
    }
  }
  if (!absl::StartsWith(key, prefix)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "shared-memory key does not start with the server's --shm-key-prefix '", prefix, "'"));
  }
  return absl::OkStatus();
}

// The escaped form of a client string for messages and logs.
std::string Quoted(absl::string_view s) {
  std::string out = "'";
  for (unsigned char c : s.substr(0, kMaxNameBytes)) {
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(c, absl::kZeroPad2));
    }
  }
  if (s.size() > kMaxNameBytes) out += "...";
  return out + "'";
}

absl::Status FromErrno(int err, absl::string_view what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOMEM:
    case EMFILE:
    case ENFILE:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InvalidArgumentError(message);
  }
}

absl::Status SharedMemoryOff() {
  return absl::FailedPreconditionError(
      "shared memory is off on this server (it runs without --allow-client-shm)");
}

bool KindMatches(const Region& r, RegionKind kind) {
  return kind == RegionKind::kAny || (kind == RegionKind::kCuda) == r.cuda();
}

const char* KindWord(RegionKind kind) {
  switch (kind) {
    case RegionKind::kSystem:
      return "system shared-memory region";
    case RegionKind::kCuda:
      return "CUDA shared-memory region";
    default:
      return "shared-memory region";
  }
}

}  // namespace

Region::~Region() {
  if (mapper_ != nullptr) {
    if (cuda_) {
      if (opened_ipc_) mapper_->CloseCuda(device_);
    } else if (pinned_) {
      mapper_->UnmapHost(host_);
    }
  }
  if (mapping_ != nullptr) munmap(mapping_, mapping_bytes_);
}

// ---- RegionLeases -------------------------------------------------------

RegionLeases::~RegionLeases() { Clear(); }

void RegionLeases::Clear() {
  for (const auto& region : leases_) region->in_flight_.fetch_sub(1);
  leases_.clear();
  ranges_.clear();
}

absl::StatusOr<ResolvedRange> RegionLeases::Resolve(RegionRegistry& registry,
                                                    const RegionRange& ref, uint64_t expected_bytes,
                                                    uint64_t alignment, bool is_output,
                                                    const TensorName& what) {
  if (!registry.enabled()) {
    return absl::FailedPreconditionError(
        absl::StrCat(what.str(),
                     ": shared-memory tensors are off on this server (it runs without "
                     "--allow-client-shm); send the bytes inline"));
  }
  if (ref.byte_size != expected_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(what.str(), ": shared-memory byte_size ",
                                                   ref.byte_size, ", the tensor's shape needs ",
                                                   expected_bytes));
  }
  std::shared_ptr<Region> leased;
  for (const auto& held : leases_) {
    if (held->name() == ref.region) leased = held;
  }
  if (leased == nullptr) {
    absl::StatusOr<std::shared_ptr<Region>> fresh = registry.Lease(ref.region);
    if (!fresh.ok()) {
      return absl::Status(fresh.status().code(),
                          absl::StrCat(what.str(), ": ", fresh.status().message()));
    }
    leased = *fresh;
    leases_.push_back(leased);
  }
  if (ref.offset > leased->byte_size() || ref.byte_size > leased->byte_size() - ref.offset) {
    return absl::OutOfRangeError(absl::StrCat(
        what.str(), ": bytes [", ref.offset, ", ", ref.offset, " + ", ref.byte_size,
        ") are past the end of region ", Quoted(ref.region), " (", leased->byte_size(), " bytes)"));
  }
  // A mapping starts on a page of the object (and a device allocation on a
  // 256-byte boundary), so a tensor's address is aligned as its place is.
  const uint64_t begin = leased->offset_ + ref.offset;
  if (alignment > 1 && begin % alignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what.str(), ": shared-memory offset ", ref.offset, " puts it at byte ", begin,
                     " of the object ", "(region ", Quoted(ref.region), " starts at ",
                     leased->offset_, "), not a multiple of ", alignment, " (the dtype's size)"));
  }
  ranges_.push_back({leased.get(), begin, begin + ref.byte_size, is_output, what});
  return ResolvedRange{leased.get(), ref.offset};
}

absl::Status RegionLeases::CheckOutputsDoNotOverlap() const {
  for (size_t i = 0; i < ranges_.size(); ++i) {
    if (!ranges_[i].is_output) continue;
    for (size_t j = 0; j < ranges_.size(); ++j) {
      if (i == j) continue;
      const Range& a = ranges_[i];
      const Range& b = ranges_[j];
      const bool same_object = a.region->object_device_ == b.region->object_device_ &&
                               a.region->object_inode_ == b.region->object_inode_;
      if (same_object && a.begin < b.end && b.begin < a.end && a.begin != a.end &&
          b.begin != b.end) {
        return absl::InvalidArgumentError(
            absl::StrCat(a.what.str(), ": its bytes [", a.begin, ", ", a.end, ") of region ",
                         Quoted(a.region->name()), "'s object overlaps ", b.what.str(), "'s [",
                         b.begin, ", ", b.end, ") (region ", Quoted(b.region->name()), ")"));
      }
    }
  }
  return absl::OkStatus();
}

// ---- RegionRegistry -----------------------------------------------------

RegionRegistry::RegionRegistry(const RegionOptions& options) : options_(options) {}

RegionRegistry::~RegionRegistry() = default;

void RegionRegistry::SetMapper(RegionMapper* mapper) {
  absl::MutexLock lock(&mu_);
  mapper_ = mapper;
}

absl::Status RegionRegistry::Register(const std::string& name, const std::string& key,
                                      uint64_t offset, uint64_t byte_size) {
  if (!options_.enabled) return SharedMemoryOff();
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  if (absl::Status s = CheckKey(key, options_.key_prefix); !s.ok()) return s;
  if (byte_size == 0) return absl::InvalidArgumentError("shared-memory byte_size is 0");
  if (offset > kMaxRange || byte_size > kMaxRange) {
    return absl::InvalidArgumentError("shared-memory offset or byte_size beyond 2^62");
  }
  ASSIGN_OR_RETURN(RegionMapper* const mapper, MapperIfRoom(name, byte_size));
  // Opening, mapping and pinning happen outside the lock (a slow file
  // system must not hold up the calls resolving references).
  const int fd = shm_open(key.c_str(), O_RDWR, 0);
  if (fd < 0) return FromErrno(errno, absl::StrCat("shm_open ", Quoted(key)));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return FromErrno(err, absl::StrCat("fstat ", Quoted(key)));
  }
  // Only the schedulers' own objects: not another user's that this process
  // happens to be able to open (as root, or through group or other bits).
  if (!S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
    close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        "shared-memory object ", Quoted(key),
        " is not a regular object owned by the server's user (uid ", geteuid(),
        "; the object's owner is uid ", st.st_uid, "): create it as the user the server runs as"));
  }
  if (static_cast<uint64_t>(st.st_size) < offset + byte_size) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("shared-memory object ", Quoted(key), " has ",
                                                   st.st_size, " bytes; the range [", offset, ", ",
                                                   offset + byte_size, ") does not fit"));
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t map_start = offset / page * page;
  auto region = std::shared_ptr<Region>(new Region());
  region->mapping_bytes_ = static_cast<size_t>(offset + byte_size - map_start);
  region->mapping_ = mmap(nullptr, region->mapping_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                          static_cast<off_t>(map_start));
  const int map_errno = errno;
  close(fd);  // the mapping keeps the object
  if (region->mapping_ == MAP_FAILED) {
    region->mapping_ = nullptr;
    return FromErrno(map_errno, absl::StrCat("mmap ", Quoted(key)));
  }
  region->name_ = name;
  region->key_ = key;
  region->object_device_ = static_cast<uint64_t>(st.st_dev);
  region->object_inode_ = static_cast<uint64_t>(st.st_ino);
  region->offset_ = offset;
  region->byte_size_ = byte_size;
  region->host_ = static_cast<uint8_t*>(region->mapping_) + (offset - map_start);
  std::string how = "host copies only (no device to map it for)";
  if (mapper != nullptr) {
    // Mapped for the devices, they read inputs and write outputs in place.
    // A failure (e.g. RLIMIT_MEMLOCK) leaves it usable through host copies.
    absl::StatusOr<HostMapping> mapped =
        mapper->MapHost(region->host_, static_cast<size_t>(byte_size));
    if (mapped.ok()) {
      region->device_ = std::move(mapped->device);
      region->pinned_ = mapped->pinned;
      region->mapper_ = mapper;
      how = mapped->pinned ? "page-locked for the devices" : "addressed in place";
    } else {
      how = absl::StrCat("host copies only: ", mapped.status().message());
    }
  }
  if (absl::Status inserted = Insert(std::move(region)); !inserted.ok()) return inserted;
  spdlog::info("shared-memory region {} registered: {} bytes at offset {} of {}, {}", Quoted(name),
               byte_size, offset, Quoted(key), how);
  return absl::OkStatus();
}

absl::Status RegionRegistry::CheckRoom(const std::string& name, uint64_t byte_size) const {
  if (regions_.count(name) > 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("shared-memory region ", Quoted(name), " is already registered"));
  }
  if (static_cast<int64_t>(regions_.size()) >= options_.max_regions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the server holds ", regions_.size(), " shared-memory regions, its limit (",
                     "--max-shm-regions ", options_.max_regions, ")"));
  }
  if (registered_bytes_ + static_cast<int64_t>(byte_size) > options_.max_total_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("registering ", byte_size, " bytes would bring the shared memory mapped to ",
                     registered_bytes_ + static_cast<int64_t>(byte_size),
                     " bytes, over --max-shm-bytes ", options_.max_total_bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<RegionMapper*> RegionRegistry::MapperIfRoom(const std::string& name,
                                                           uint64_t byte_size) const {
  absl::MutexLock lock(&mu_);
  if (absl::Status room = CheckRoom(name, byte_size); !room.ok()) return room;
  return mapper_;
}

absl::Status RegionRegistry::Insert(std::shared_ptr<Region> region) {
  absl::MutexLock lock(&mu_);
  // Checked again: another registration may have raced this one while the
  // region was mapped (outside the lock). On failure the region goes (and
  // with it the mapping).
  if (absl::Status room = CheckRoom(region->name_, region->byte_size_); !room.ok()) return room;
  registered_bytes_ += static_cast<int64_t>(region->byte_size_);
  const std::string name = region->name_;
  regions_.emplace(name, std::move(region));
  return absl::OkStatus();
}

absl::Status RegionRegistry::RegisterCuda(const std::string& name, const std::string& handle,
                                          int device_id, uint64_t byte_size) {
  if (!options_.enabled) return SharedMemoryOff();
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  if (byte_size == 0) return absl::InvalidArgumentError("shared-memory byte_size is 0");
  if (byte_size > kMaxRange)
    return absl::InvalidArgumentError("shared-memory byte_size beyond 2^62");
  ASSIGN_OR_RETURN(RegionMapper* const mapper, MapperIfRoom(name, byte_size));
  if (mapper == nullptr) {
    return absl::FailedPreconditionError(
        "CUDA shared memory needs the CUDA backend (this server has no device memory)");
  }
  // The size is the client's word: cudaIpcOpenMemHandle does not say how
  // large the allocation is. A byte_size beyond it makes a copy fail with a
  // sticky device error (the device faults): trusted clients only, as the
  // flag's help says.
  return InsertDevice(name, device_id, byte_size, mapper, mapper->OpenCuda(handle, device_id),
                      /*ipc=*/true, "CUDA shared-memory region");
}

absl::Status RegionRegistry::RegisterLocalDevice(const std::string& name, uint64_t address,
                                                 int device_id, uint64_t byte_size) {
  if (!options_.enabled) return SharedMemoryOff();
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  if (byte_size == 0 || address == 0) {
    return absl::InvalidArgumentError("device region of 0 bytes or at address 0");
  }
  ASSIGN_OR_RETURN(RegionMapper* const mapper, MapperIfRoom(name, byte_size));
  if (mapper == nullptr) {
    return absl::FailedPreconditionError("device regions need the CUDA backend");
  }
  return InsertDevice(name, device_id, byte_size, mapper,
                      mapper->AddressLocalDevice(address, device_id), /*ipc=*/false,
                      "device region (in process)");
}

absl::Status RegionRegistry::InsertDevice(const std::string& name, int device_id,
                                          uint64_t byte_size, RegionMapper* mapper,
                                          absl::StatusOr<std::vector<uint64_t>> opened, bool ipc,
                                          absl::string_view how) {
  if (!opened.ok()) return opened.status();
  auto region = std::shared_ptr<Region>(new Region());
  region->name_ = name;
  region->key_ = absl::StrCat("cuda:", device_id);
  region->byte_size_ = byte_size;
  region->cuda_ = true;
  region->device_id_ = device_id;
  region->device_ = *std::move(opened);
  region->pinned_ = true;
  region->opened_ipc_ = ipc;
  region->mapper_ = mapper;
  // Its own object for the overlap check.
  region->object_device_ = ~uint64_t{0};
  region->object_inode_ = reinterpret_cast<uintptr_t>(region.get());
  if (absl::Status inserted = Insert(std::move(region)); !inserted.ok()) return inserted;
  spdlog::info("{} {} registered: {} bytes on device {}", std::string(how), Quoted(name), byte_size,
               device_id);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> RegionRegistry::Unregister(const std::string& name,
                                                                    RegionKind kind) {
  std::vector<std::shared_ptr<Region>> removed;  // unmapped outside the lock
  std::vector<std::string> names;
  {
    absl::MutexLock lock(&mu_);
    if (!name.empty()) {
      const auto it = regions_.find(name);
      if (it == regions_.end() || !KindMatches(*it->second, kind)) {
        return absl::NotFoundError(absl::StrCat("no ", KindWord(kind), " ", Quoted(name),
                                                " is registered",
                                                it == regions_.end() ? ""
                                                : it->second->cuda() ? " (it is a CUDA region)"
                                                                     : " (it is a system region)"));
      }
    }
    std::vector<std::string> busy;
    for (const auto& [region_name, region] : regions_) {
      if (!name.empty() && region_name != name) continue;
      if (!KindMatches(*region, kind)) continue;
      const int64_t held = region->in_flight_.load();
      if (held > 0) busy.push_back(absl::StrCat(Quoted(region_name), " (", held, " calls)"));
    }
    if (!busy.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shared-memory region", busy.size() > 1 ? "s " : " ", absl::StrJoin(busy, ", "),
          " held by calls in flight; nothing was unregistered: retry once they finished"));
    }
    for (auto it = regions_.begin(); it != regions_.end();) {
      if ((!name.empty() && it->first != name) || !KindMatches(*it->second, kind)) {
        ++it;
        continue;
      }
      registered_bytes_ -= static_cast<int64_t>(it->second->byte_size());
      names.push_back(it->first);
      removed.push_back(std::move(it->second));
      it = regions_.erase(it);
    }
  }
  for (const std::string& n : names)
    spdlog::info("shared-memory region {} unregistered", Quoted(n));
  return names;
}

absl::StatusOr<std::vector<RegionStatus>> RegionRegistry::Status(const std::string& name,
                                                                 RegionKind kind) const {
  absl::MutexLock lock(&mu_);
  std::vector<RegionStatus> out;
  for (const auto& [region_name, r] : regions_) {
    if ((!name.empty() && region_name != name) || !KindMatches(*r, kind)) continue;
    out.push_back({r->name_, r->key_, r->offset_, r->byte_size_, r->in_flight_.load(),
                   r->calls_total_.load(), r->pinned_, r->cuda_, r->device_id_});
  }
  if (!name.empty() && out.empty()) {
    return absl::NotFoundError(
        absl::StrCat("no ", KindWord(kind), " ", Quoted(name), " is registered"));
  }
  return out;
}

int64_t RegionRegistry::ReleaseAll() {
  std::map<std::string, std::shared_ptr<Region>, std::less<>> dropped;
  {
    absl::MutexLock lock(&mu_);
    dropped.swap(regions_);
    registered_bytes_ = 0;
  }
  return static_cast<int64_t>(dropped.size());
}

int64_t RegionRegistry::regions() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(regions_.size());
}

int64_t RegionRegistry::registered_bytes() const {
  absl::MutexLock lock(&mu_);
  return registered_bytes_;
}

absl::StatusOr<std::shared_ptr<Region>> RegionRegistry::Lease(absl::string_view name) {
  absl::MutexLock lock(&mu_);
  const auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("no shared-memory region ", Quoted(name),
                                            " is registered (RegisterSystemSharedMemory first)"));
  }
  it->second->in_flight_.fetch_add(1);
  it->second->calls_total_.fetch_add(1);
  return it->second;
}

}  // namespace mlaverify::engine
