// The client's side of the system shared-memory data plane: a POSIX
// shared-memory object this process creates, maps and removes again, and the
// placement of Verify tensors inside it.
//
//   ASSIGN_OR_RETURN(auto shm, SharedMemoryBuffer::Create(bytes));
//   RETURN_IF_ERROR(client->RegisterSystemSharedMemory("sched-0", shm->key(), 0, shm->size()));
//   ShmItemPlacement place = PlaceVerifyItem("sched-0", shm->data(), 0, N, H);
//   item.shm = &place;  // client->Verify copies q/draft_kv in, reads out/lse back
//   ...
//   client->UnregisterSystemSharedMemory("sched-0");  // before the buffer goes
//
// The object is unlinked when the buffer is destroyed, and by
// UnlinkSharedMemoryFromSignalHandler from a SIGINT/SIGTERM handler, so an
// interrupted client leaves nothing in /dev/shm.
#ifndef MLAVERIFY_CLIENT_SHARED_MEMORY_H_
#define MLAVERIFY_CLIENT_SHARED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace mlaverify::client {

class SharedMemoryBuffer {
 public:
  // Creates a new object "/mlaverify-<pid>-<n>" of `bytes` (O_EXCL, mode
  // 0600), sizes and maps it. UNAVAILABLE with errno's words on failure.
  static absl::StatusOr<std::unique_ptr<SharedMemoryBuffer>> Create(size_t bytes);
  ~SharedMemoryBuffer();  // unmaps and unlinks
  SharedMemoryBuffer(const SharedMemoryBuffer&) = delete;
  SharedMemoryBuffer& operator=(const SharedMemoryBuffer&) = delete;

  const std::string& key() const { return key_; }
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  SharedMemoryBuffer(std::string key, uint8_t* data, size_t size, int slot)
      : key_(std::move(key)), data_(data), size_(size), slot_(slot) {}
  std::string key_;
  uint8_t* data_;
  size_t size_;
  int slot_;  // in the signal-cleanup table; -1: not in it
};

// Unlinks every object a live SharedMemoryBuffer created. Async-signal-safe
// (unlink(2) of /dev/shm paths prepared beforehand): for signal handlers.
void UnlinkSharedMemoryFromSignalHandler();

class CudaSharedMemoryBuffer;

// Where one Verify item's tensors sit in a registered region: byte offsets
// from the start of the registered range, each on a 256-byte boundary.
// `base` is this process's address of offset 0 (system shared memory); for a
// CUDA region `cuda` is the buffer instead and `base` stays null.
struct ShmItemPlacement {
  std::string region;
  uint8_t* base = nullptr;
  const CudaSharedMemoryBuffer* cuda = nullptr;
  // The caller keeps q and draft_kv in the region itself (written once, or
  // made there): the request references them and copies nothing in. For
  // system memory a span that points there already is never copied anyway.
  bool inputs_in_place = false;
  // Read out and lse back into the result (false: they stay in the region,
  // the result's vectors empty: a scheduler that uses them on the device).
  bool read_back = true;
  // draft_kv travels inline rather than in the region: an fp8 server checks
  // draft rows for NaN/Inf on the host before it quantizes them, so it
  // refuses them in device memory (CUDA shared memory).
  bool draft_kv_inline = false;
  uint64_t q_offset = 0;         // bf16 [N, H, 576]
  uint64_t draft_kv_offset = 0;  // bf16 [N, 576]
  uint64_t out_offset = 0;       // bf16 [N, H, 512]
  uint64_t lse_offset = 0;       // fp32 [N, H]
  uint64_t end_offset = 0;       // the first byte after the item's tensors
};

// Bytes one item of N drafts and H heads takes (PlaceVerifyItem's span).
uint64_t ShmVerifyItemBytes(int num_drafts, int num_heads);
// Lays an item's tensors out from `offset` (rounded up to 256) of `region`.
ShmItemPlacement PlaceVerifyItem(std::string region, uint8_t* base, uint64_t offset, int num_drafts,
                                 int num_heads);

// A registered range AppendKv may stage prompt chunks in (whole tokens of
// every layer per chunk; the region must hold at least one token's rows).
struct ShmStaging {
  std::string region;
  uint8_t* base = nullptr;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_SHARED_MEMORY_H_
