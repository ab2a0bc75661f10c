#include "common/host_doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <climits>

#include "absl/time/clock.h"

namespace mlaverify {
namespace {

// The value's low half: the futex word (little-endian, so the first 4 bytes).
uint32_t* FutexWord(uint64_t* value) { return reinterpret_cast<uint32_t*>(value); }

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace

uint64_t HostSlot::Load() const { return __atomic_load_n(value(), __ATOMIC_ACQUIRE); }

void HostSlot::Store(uint64_t v) const {
  __atomic_store_n(value(), v, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(waiters(), __ATOMIC_SEQ_CST) != 0) {
    // Process-shared (no FUTEX_PRIVATE_FLAG): the waiter may be another
    // process mapping the same object.
    syscall(SYS_futex, FutexWord(value()), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }
}

void HostSlot::Reset(uint64_t v) const {
  __atomic_store_n(waiters(), 0u, __ATOMIC_SEQ_CST);
  __atomic_store_n(reinterpret_cast<uint32_t*>(slot_ + 12), 0u, __ATOMIC_RELAXED);
  __atomic_store_n(value(), v, __ATOMIC_SEQ_CST);
}

uint64_t HostSlot::WaitAtLeast(uint64_t target, absl::Duration spin, absl::Time deadline,
                               const std::function<bool()>& stop, absl::Duration slice) const {
  uint64_t v = Load();
  if (v >= target) return v;
  const absl::Time spin_end = std::min(absl::Now() + spin, deadline);
  int polls = 0;
  while (true) {
    for (int k = 0; k < 64; ++k) {
      v = Load();
      if (v >= target) return v;
      CpuRelax();
    }
    if ((++polls & 7) == 0 && absl::Now() >= spin_end) break;
  }
  while (true) {
    if (stop && stop()) return v;
    const absl::Time now = absl::Now();
    if (now >= deadline) return v;
    __atomic_fetch_add(waiters(), 1u, __ATOMIC_SEQ_CST);
    v = __atomic_load_n(value(), __ATOMIC_SEQ_CST);
    if (v < target) {
      const timespec ts = absl::ToTimespec(std::min(deadline - now, slice));
      // Returns at once (EAGAIN) if the low half changed since the read.
      syscall(SYS_futex, FutexWord(value()), FUTEX_WAIT, static_cast<uint32_t>(v), &ts, nullptr, 0);
      v = Load();
    }
    __atomic_fetch_sub(waiters(), 1u, __ATOMIC_SEQ_CST);
    if (v >= target) return v;
  }
}

}  // namespace mlaverify
