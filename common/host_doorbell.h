// Host doorbells: the 64-bit slots of a device-driven verify step
// (docs/steps.md) when they live in host memory that the scheduler's process
// and the server's both map (a registered POSIX shared-memory region): the
// CPU backend, CI, and the system shared-memory plane.
//
// A slot is 16 bytes at a 16-byte aligned place:
//   bytes 0..7    value    uint64, little-endian
//   bytes 8..11   waiters  uint32: threads asleep on the value's futex (the
//                          value's low 32 bits, a process-shared futex)
//   bytes 12..15  reserved (zero)
// During a step the value only grows (layers rung, layers done). A writer
// stores the value, then wakes the futex where `waiters` is not zero; a
// waiter spins for a bounded time, then counts itself in `waiters`, reads
// again and sleeps in slices. Store and the waiter's count-then-read are
// sequentially consistent, so a wake-up is never lost: either the writer
// sees the waiter or the waiter sees the new value. A writer that cannot
// wake (a GPU storing through a stream memory operation) is still seen at
// the end of the waiter's current slice.
// Used by the server (engine) and the clients (C++ here; the Python package
// follows the same layout). Depends on nothing but Abseil and futex(2).
#ifndef MLAVERIFY_COMMON_HOST_DOORBELL_H_
#define MLAVERIFY_COMMON_HOST_DOORBELL_H_

#include <cstddef>
#include <cstdint>
#include <functional>

#include "absl/time/time.h"

namespace mlaverify {

inline constexpr size_t kHostSlotBytes = 16;
inline constexpr size_t kHostSlotAlignment = 16;

// A view of one slot; the memory belongs to the caller (a mapped region).
// Thread- and process-safe: every access is atomic.
class HostSlot {
 public:
  explicit HostSlot(void* slot = nullptr) : slot_(static_cast<uint8_t*>(slot)) {}
  bool valid() const { return slot_ != nullptr; }
  void* data() const { return slot_; }

  uint64_t Load() const;
  // Stores `value` and wakes every thread asleep on the slot.
  void Store(uint64_t value) const;
  // Sets the value and clears the waiter count (before the slot is handed
  // to a step: nobody waits on it then).
  void Reset(uint64_t value = 0) const;

  // Waits until the value is >= `target`: spins for `spin` first, then
  // sleeps on the futex in slices of at most `slice` (so that `stop`, when
  // given, is polled, and a writer that stored without waking is seen),
  // until `deadline`. Returns the last value read: below `target` when the
  // deadline passed or `stop` said so.
  uint64_t WaitAtLeast(uint64_t target, absl::Duration spin, absl::Time deadline,
                       const std::function<bool()>& stop = nullptr,
                       absl::Duration slice = absl::Milliseconds(2)) const;

 private:
  uint64_t* value() const { return reinterpret_cast<uint64_t*>(slot_); }
  uint32_t* waiters() const { return reinterpret_cast<uint32_t*>(slot_ + 8); }
  uint8_t* slot_;
};

}  // namespace mlaverify

#endif  // MLAVERIFY_COMMON_HOST_DOORBELL_H_
