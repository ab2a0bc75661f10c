// The byte layouts shared by the worker (which writes slots) and the devices
// (which allocate and read them): device.h's RequestArraysLayout, SlotLayout
// and the copy-list capacities.
#include <algorithm>

#include "kernels/copy_list.h"
#include "server/engine/device.h"

namespace mlaverify::engine {
namespace {

size_t AlignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

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
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t here = at;
    at = AlignUp(at + bytes, 16);
    return here;
  };
  l.table_offset = take(b * sizeof(int64_t));
  l.prefix_len = take(b * sizeof(int32_t));
  l.draft_len = take(b * sizeof(int32_t));
  l.layer = take(b * sizeof(int32_t));
  l.scale = take(b * sizeof(float));
  l.bytes = at;
  return l;
}

int GatherCapacity(BatchShape shape, int page_size, int max_batch) {
  return shape.batch * (1 + DraftRuns(shape.draft_len, page_size)) + 2 * max_batch + 3;
}

SlotLayout SlotLayout::For(int max_batch, int max_draft_len, int page_size,
                           int64_t max_pages_per_sequence) {
  SlotLayout l;
  l.list_capacity = GatherCapacity({max_batch, max_draft_len}, page_size, max_batch);
  l.output_capacity = ScatterCapacity({max_batch, max_draft_len});
  l.value_capacity = max_pages_per_sequence +
                     int64_t{max_batch} * ((max_draft_len + page_size - 1) / page_size + 1);
  l.requests = RequestArraysLayout::For(max_batch);
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t here = at;
    at = AlignUp(at + bytes, 256);
    return here;
  };
  l.list = take(kernels::CopyListBytes(l.list_capacity));
  l.request_block = take(l.requests.bytes);
  l.visibility = take(static_cast<size_t>(max_batch) * max_draft_len * sizeof(uint64_t));
  l.outputs = take(kernels::CopyListBytes(l.output_capacity));
  l.op = take((2 + 64) * sizeof(int32_t));
  l.values = take(static_cast<size_t>(l.value_capacity) * sizeof(int32_t));
  l.bytes = at;
  return l;
}

}  // namespace mlaverify::engine
