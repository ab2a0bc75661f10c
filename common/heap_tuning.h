// The C library's heap, set for a process whose every call allocates and
// frees buffers of a few hundred KiB (a Verify request's q and draft_kv
// strings, an answer's out tensors: 128 KiB per item at N=16, 8 heads): the
// server, and the client's command-line tool (its load generator shares the
// host with the server). Programs call it from main; the client library
// leaves its host process's heap alone.
// glibc's defaults serve blocks of 128 KiB and more with mmap and give freed
// heap tops back at 128 KiB, its thresholds only creeping up as blocks are
// freed: such a block is then zero-filled page by page (tens of page faults,
// tens of µs) on every call that takes one. Fixed thresholds keep freed
// blocks in the heap for the next call.
#ifndef MLAVERIFY_COMMON_HEAP_TUNING_H_
#define MLAVERIFY_COMMON_HEAP_TUNING_H_

#include <cstddef>

namespace mlaverify {

// Blocks below this come from the heap (glibc's ceiling for the setting).
inline constexpr size_t kHeapMmapThresholdBytes = size_t{32} << 20;
// Free memory at a heap's top is given back to the system past this.
inline constexpr size_t kHeapTrimThresholdBytes = size_t{256} << 20;

// Sets both thresholds; call before the program starts its threads. Does nothing
// when MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ is set in the
// environment (the operator chose). Returns whether it set them.
bool TuneHeapForLargeBuffers();

}  // namespace mlaverify

#endif  // MLAVERIFY_COMMON_HEAP_TUNING_H_
