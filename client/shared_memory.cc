#include "client/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/geometry.h"

namespace mlaverify::client {
namespace {

// Paths of live objects for the signal handler: fixed storage, claimed with
// an atomic flag per slot, so the handler reads only finished strings.
constexpr int kMaxLiveBuffers = 64;
constexpr size_t kMaxPath = 96;
struct CleanupSlot {
  std::atomic<bool> used{false};
  std::atomic<bool> ready{false};
  char path[kMaxPath] = {};
};
CleanupSlot g_cleanup[kMaxLiveBuffers];
std::atomic<uint64_t> g_next_buffer{0};

int ClaimSlot(const std::string& key) {
  const std::string path = "/dev/shm" + key;
  if (path.size() >= kMaxPath) return -1;
  for (int i = 0; i < kMaxLiveBuffers; ++i) {
    bool expected = false;
    if (g_cleanup[i].used.compare_exchange_strong(expected, true)) {
      std::memcpy(g_cleanup[i].path, path.c_str(), path.size() + 1);
      g_cleanup[i].ready.store(true);
      return i;
    }
  }
  return -1;  // more buffers than slots: those are only removed by their destructor
}

void FreeSlot(int slot) {
  if (slot < 0) return;
  g_cleanup[slot].ready.store(false);
  g_cleanup[slot].used.store(false);
}

uint64_t Align256(uint64_t v) { return (v + 255) / 256 * 256; }

}  // namespace

absl::StatusOr<std::unique_ptr<SharedMemoryBuffer>> SharedMemoryBuffer::Create(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("shared-memory buffer of 0 bytes");
  // Names carry 64 random bits: another local user cannot create the name
  // first (O_EXCL would then fail, or worse, a guessed name could be
  // squatted); a name taken anyway is drawn again.
  std::string key;
  int fd = -1;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    uint64_t nonce = 0;
    if (getrandom(&nonce, sizeof nonce, 0) != static_cast<ssize_t>(sizeof nonce)) {
      return absl::UnavailableError(absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    key = absl::StrCat("/mlaverify-", getpid(), "-", g_next_buffer.fetch_add(1), "-",
                       absl::Hex(nonce, absl::kZeroPad16));
    fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("shm_open ", key, ": ", std::strerror(errno)));
  }
  const int slot = ClaimSlot(key);
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(key.c_str());
    FreeSlot(slot);
    return absl::UnavailableError(
        absl::StrCat("ftruncate ", key, " to ", bytes, " bytes: ", std::strerror(err)));
  }
  // The object's pages reserved now: a /dev/shm too small for it fails here
  // with a message instead of a SIGBUS at the first write past its room
  // (ours, or the server's writing outputs into it).
  if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0) {
    close(fd);
    shm_unlink(key.c_str());
    FreeSlot(slot);
    return absl::UnavailableError(
        absl::StrCat("posix_fallocate ", key, " of ", bytes,
                     " bytes (is /dev/shm large enough?): ", std::strerror(err)));
  }
  void* data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (data == MAP_FAILED) {
    shm_unlink(key.c_str());
    FreeSlot(slot);
    return absl::UnavailableError(absl::StrCat("mmap ", key, ": ", std::strerror(err)));
  }
  return std::unique_ptr<SharedMemoryBuffer>(
      new SharedMemoryBuffer(key, static_cast<uint8_t*>(data), bytes, slot));
}

SharedMemoryBuffer::~SharedMemoryBuffer() {
  munmap(data_, size_);
  shm_unlink(key_.c_str());
  FreeSlot(slot_);
}

void UnlinkSharedMemoryFromSignalHandler() {
  for (CleanupSlot& slot : g_cleanup) {
    if (slot.ready.load()) unlink(slot.path);
  }
}

uint64_t ShmVerifyItemBytes(int num_drafts, int num_heads) {
  const uint64_t n = static_cast<uint64_t>(num_drafts), h = static_cast<uint64_t>(num_heads);
  return Align256(n * h * kLatentDim * 2) + Align256(n * kLatentDim * 2) +
         Align256(n * h * kValueDim * 2) + Align256(n * h * 4);
}

ShmItemPlacement PlaceVerifyItem(std::string region, uint8_t* base, uint64_t offset, int num_drafts,
                                 int num_heads) {
  const uint64_t n = static_cast<uint64_t>(num_drafts), h = static_cast<uint64_t>(num_heads);
  ShmItemPlacement p;
  p.region = std::move(region);
  p.base = base;
  p.q_offset = Align256(offset);
  p.draft_kv_offset = p.q_offset + Align256(n * h * kLatentDim * 2);
  p.out_offset = p.draft_kv_offset + Align256(n * kLatentDim * 2);
  p.lse_offset = p.out_offset + Align256(n * h * kValueDim * 2);
  p.end_offset = p.lse_offset + Align256(n * h * 4);
  return p;
}

}  // namespace mlaverify::client
