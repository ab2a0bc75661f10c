// After TuneHeapForLargeBuffers, a call's worth of large blocks taken and
// freed again and again comes back from the heap: no page faults, on the
// main thread or another (glibc gives threads heaps of their own). Without
// it (a child process that never tunes) the same rounds fault.
#include "common/heap_tuning.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <thread>

#include "gtest/gtest.h"

namespace mlaverify {
namespace {

long ThreadFaults() {
  rusage u{};
  getrusage(RUSAGE_THREAD, &u);
  return u.ru_minflt;
}

// Page faults over 200 rounds of a Verify answer's blocks (after 20 rounds
// of warm-up): a request's q, the out tensor, and its encoded copy.
long FaultsOfCallRounds() {
  long before = 0;
  for (int round = 0; round < 220; ++round) {
    if (round == 20) before = ThreadFaults();
    auto* q = static_cast<char*>(std::malloc(144 << 10));
    std::memset(q, round, 144 << 10);
    auto* out = static_cast<char*>(std::malloc(128 << 10));
    std::memset(out, round, 128 << 10);
    auto* encoded = static_cast<char*>(std::malloc(128 << 10));
    std::memcpy(encoded, out, 128 << 10);
    asm volatile("" : : "r"(q), "r"(out), "r"(encoded) : "memory");
    std::free(q);
    std::free(encoded);
    std::free(out);
  }
  return ThreadFaults() - before;
}

bool Sanitized() {
#if defined(__SANITIZE_ADDRESS__)
  return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  return true;
#endif
#endif
  return false;
}

TEST(HeapTuningTest, LargeBlocksAreReusedWithoutPageFaults) {
  if (Sanitized()) GTEST_SKIP() << "the sanitizer's allocator ignores mallopt";
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
      std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr) {
    GTEST_SKIP() << "the environment sets the heap's thresholds";
  }
  // The untuned heap first, in a child: its rounds fault (the exit code
  // says whether more than one fault per round was seen).
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(FaultsOfCallRounds() > 200 ? 0 : 1);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the untuned heap did not fault: this test shows nothing";

  ASSERT_TRUE(TuneHeapForLargeBuffers());
  EXPECT_LE(FaultsOfCallRounds(), 2);
  long other = -1;
  std::thread([&] { other = FaultsOfCallRounds(); }).join();
  EXPECT_LE(other, 2);
}

}  // namespace
}  // namespace mlaverify
