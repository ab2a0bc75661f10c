// The byte layouts shared by the worker (which writes slots) and the devices
// (which allocate and read them): device.h's RequestArraysLayout, SlotLayout
// and the copy-list capacities.
#include <algorithm>

#include "common/geometry.h"
#include "kernels/copy_list.h"
#include "server/engine/device.h"

namespace mlaverify::engine {
namespace {

// Lays consecutive arrays out, each starting on an `align` boundary.
struct Carver {
  size_t align;
  size_t at = 0;
  size_t Take(size_t bytes) {
    const size_t here = at;
    at = (at + bytes + align - 1) / align * align;
    return here;
  }
};

// Pages a run of n consecutive positions can touch, so descriptors of one
// request's draft rows.
int DraftRuns(int draft_len, int page_size) {
  if (draft_len <= 0) return 0;
  return std::min(draft_len, (draft_len - 1) / page_size + 2);
}

}  // namespace

RequestArraysLayout RequestArraysLayout::For(int max_batch) {
  RequestArraysLayout l;
  const size_t b = static_cast<size_t>(max_batch);
  Carver c{16};
  l.table_offset = c.Take(b * sizeof(int64_t));
  l.prefix_len = c.Take(b * sizeof(int32_t));
  l.draft_len = c.Take(b * sizeof(int32_t));
  l.layer = c.Take(b * sizeof(int32_t));
  l.scale = c.Take(b * sizeof(float));
  l.bytes = c.at;
  return l;
}

int GatherCapacity(BatchShape shape, int page_size, int max_batch) {
  return shape.batch * (1 + DraftRuns(shape.draft_len, page_size)) + MaxTableWrites(max_batch) + 3;
}

SlotLayout SlotLayout::For(int max_batch, int max_draft_len, int page_size,
                           int64_t max_pages_per_sequence) {
  SlotLayout l;
  l.list_capacity = GatherCapacity({max_batch, max_draft_len}, page_size, max_batch);
  l.output_capacity = ScatterCapacity({max_batch, max_draft_len});
  l.value_capacity = max_pages_per_sequence +
                     int64_t{max_batch} * ((max_draft_len + page_size - 1) / page_size + 1);
  l.requests = RequestArraysLayout::For(max_batch);
  Carver c{256};
  l.list = c.Take(kernels::CopyListBytes(l.list_capacity));
  l.request_block = c.Take(l.requests.bytes);
  l.visibility = c.Take(static_cast<size_t>(max_batch) * max_draft_len * sizeof(uint64_t));
  l.outputs = c.Take(kernels::CopyListBytes(l.output_capacity));
  l.op = c.Take((2 + kMaxDraftLen) * sizeof(int32_t));
  l.values = c.Take(static_cast<size_t>(l.value_capacity) * sizeof(int32_t));
  l.bytes = c.at;
  return l;
}

}  // namespace mlaverify::engine
