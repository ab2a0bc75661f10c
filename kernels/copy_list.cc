#include "kernels/copy_list.h"

#include <cstring>

namespace mlaverify::kernels {

void RunCopyListOnHost(const CopyListHeader* list) {
  const CopyDescriptor* entries = CopyListEntries(list);
  for (int32_t c = 0; c < list->count; ++c) {
    const CopyDescriptor& d = entries[c];
    for (uint32_t r = 0; r < d.rows; ++r) {
      // memmove: a page-table relocation may copy within one arena.
      std::memmove(reinterpret_cast<void*>(d.dst + static_cast<uint64_t>(r) * d.dst_pitch),
                   reinterpret_cast<const void*>(d.src + static_cast<uint64_t>(r) * d.src_pitch),
                   d.row_bytes);
    }
  }
}

}  // namespace mlaverify::kernels
