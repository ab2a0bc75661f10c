#include "common/geometry.h"
#include "server/engine/device.h"

namespace mlaverify::engine {
namespace {

constexpr size_t kAlign = 256;

size_t AlignUp(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

}  // namespace

StagingLayout StagingLayout::For(BatchShape shape, int heads, int64_t page_table_stride) {
  StagingLayout l;
  l.shape = shape;
  l.heads = heads;
  l.page_table_stride = page_table_stride;
  const size_t batch = static_cast<size_t>(shape.batch);
  const size_t rows = static_cast<size_t>(shape.rows());
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t here = at;
    at = AlignUp(at + bytes);
    return here;
  };
  // The large arrays first: their offsets stay 256-aligned whatever the
  // small ones after them need.
  l.q = take(rows * heads * kLatentDim * sizeof(Bf16));
  l.draft_kv = take(rows * kLatentDim * sizeof(Bf16));
  l.visibility = take(rows * sizeof(uint64_t));
  l.page_tables = take(batch * static_cast<size_t>(page_table_stride) * sizeof(int32_t));
  l.prefix_len = take(batch * sizeof(int32_t));
  l.draft_len = take(batch * sizeof(int32_t));
  l.layer = take(batch * sizeof(int32_t));
  l.scale = take(batch * sizeof(float));
  l.input_bytes = at;
  at = 0;
  l.out = take(rows * heads * kValueDim * sizeof(Bf16));
  l.lse = take(rows * heads * sizeof(float));
  l.output_bytes = at;
  return l;
}

}  // namespace mlaverify::engine
