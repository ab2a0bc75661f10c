#include "server/engine/slot_writer.h"

#include <algorithm>
#include <cstring>

#include "common/geometry.h"
#include "kernels/verify_attention.h"

namespace mlaverify::engine {
namespace {

uint32_t U32(int64_t v) { return static_cast<uint32_t>(v); }

}  // namespace

bool SlotWriter::Gather(uint64_t src, uint32_t src_pitch, uint64_t dst, uint32_t dst_pitch,
                        uint32_t row_bytes, uint32_t rows) {
  if (rows == 0 || row_bytes == 0) return true;
  if (gathers_ >= gather_capacity_) return false;
  kernels::CopyListEntries(List())[gathers_++] = {src, dst, src_pitch, dst_pitch, row_bytes, rows};
  return true;
}

bool SlotWriter::Output(uint64_t src, uint32_t src_pitch, uint64_t dst, uint32_t dst_pitch,
                        uint32_t row_bytes, uint32_t rows) {
  if (rows == 0 || row_bytes == 0) return true;
  if (outputs_ >= layout_.output_capacity) return false;
  kernels::CopyListEntries(OutputList())[outputs_++] = {src,       dst,       src_pitch,
                                                        dst_pitch, row_bytes, rows};
  return true;
}

void SlotWriter::Close() {
  List()->count = gathers_;
  OutputList()->count = outputs_;
}

absl::Status PackBatch(SlotWriter& w, const BatchTarget& target, BatchShape shape,
                       absl::Span<const PackedRequest> requests) {
  const SlotLayout& l = w.layout();
  const DeviceBuffers& buf = *target.buffers;
  const RequestArraysLayout& r = l.requests;
  auto* prefix = w.Host<int32_t>(l.request_block + r.prefix_len);
  auto* drafts = w.Host<int32_t>(l.request_block + r.draft_len);
  auto* layers = w.Host<int32_t>(l.request_block + r.layer);
  auto* scales = w.Host<float>(l.request_block + r.scale);
  auto* offsets = w.Host<int64_t>(l.request_block + r.table_offset);
  auto* visibility = w.Host<uint64_t>(l.visibility);
  const int heads = target.num_heads;
  const size_t q_row = static_cast<size_t>(heads) * kLatentRowBytes;
  const size_t out_row = static_cast<size_t>(heads) * kValueDim * sizeof(Bf16);
  const size_t lse_row = static_cast<size_t>(heads) * sizeof(float);
  const int64_t page_size = target.page_size;
  // Addresses rows only (no data pointer).
  const kernels::KvPoolView pool{nullptr, target.num_layers, target.num_pages, target.page_size,
                                 target.kv_dtype};
  const bool quantize_drafts = target.kv_dtype != KvDtype::kBf16;
  const int count = static_cast<int>(requests.size());
  int row = 0;
  for (int b = 0; b < shape.batch; ++b) {
    if (b >= count) {
      prefix[b] = drafts[b] = layers[b] = 0;
      scales[b] = count > 0 ? requests[0].scale : 1.0f;
      offsets[b] = 0;
      continue;
    }
    const PackedRequest& s = requests[b];
    prefix[b] = s.prefix_len;
    drafts[b] = s.draft_len;
    layers[b] = s.layer;
    scales[b] = s.scale;
    offsets[b] = s.table_offset;
    std::memcpy(visibility + row, s.visibility,
                static_cast<size_t>(s.draft_len) * sizeof(uint64_t));
    const uint32_t n = U32(s.draft_len);
    bool fits = w.Gather(s.q.address, s.q.pitch, buf.q + row * q_row, U32(q_row), U32(q_row), n);
    if (quantize_drafts) {
      fits = fits && w.Gather(s.draft_kv.address, s.draft_kv.pitch,
                              buf.draft_kv + static_cast<uint64_t>(row) * kLatentRowBytes,
                              U32(kLatentRowBytes), U32(kLatentRowBytes), n);
    }
    // Draft rows straight into the pool, one descriptor per run inside a page.
    for (int i = 0; i < s.draft_len && fits && !quantize_drafts;) {
      const int64_t position = static_cast<int64_t>(s.prefix_len) + i;
      const int64_t in_page = position % page_size;
      const int run = static_cast<int>(std::min<int64_t>(page_size - in_page, s.draft_len - i));
      const uint64_t dst =
          buf.pool +
          static_cast<uint64_t>(pool.RowOffset(s.layer, s.pages, position)) * sizeof(Bf16);
      fits = w.Gather(s.draft_kv.address + static_cast<uint64_t>(i) * s.draft_kv.pitch,
                      s.draft_kv.pitch, dst, U32(kLatentRowBytes), U32(kLatentRowBytes), U32(run));
      i += run;
    }
    fits = fits &&
           w.Output(buf.out + row * out_row, U32(out_row), s.out.address, s.out.pitch, U32(out_row),
                    n) &&
           w.Output(buf.lse + row * lse_row, U32(lse_row), s.lse.address, s.lse.pitch, U32(lse_row),
                    n);
    if (!fits) return absl::InternalError("a batch's copy list outgrew its slot");
    row += s.draft_len;
  }
  const bool fits =
      w.Gather(w.Device(l.request_block), 0, buf.requests, 0, U32(r.bytes), 1) &&
      w.Gather(w.Device(l.visibility), 0, buf.visibility, 0, U32(row * sizeof(uint64_t)), 1) &&
      w.Gather(w.Device(l.outputs), 0, buf.outputs, 0, U32(kernels::CopyListBytes(w.outputs())), 1);
  if (!fits) return absl::InternalError("a batch's copy list outgrew its slot");
  return absl::OkStatus();
}

}  // namespace mlaverify::engine
