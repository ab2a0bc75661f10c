#include "common/heap_tuning.h"

#include <malloc.h>

#include <cstdlib>

namespace mlaverify {

bool TuneHeapForLargeBuffers() {
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
      std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr) {
    return false;
  }
  // (Setting either also stops glibc's own adjustment of both.)
  return mallopt(M_MMAP_THRESHOLD, static_cast<int>(kHeapMmapThresholdBytes)) == 1 &&
         mallopt(M_TRIM_THRESHOLD, static_cast<int>(kHeapTrimThresholdBytes)) == 1;
}

}  // namespace mlaverify
