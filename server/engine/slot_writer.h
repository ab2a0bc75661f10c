// Writing a launch's slot (device.h, SlotLayout): the copy lists that bring
// a verify batch's bytes to the device and its outputs back, its request
// arrays and visibility words. Used by the device worker for every batch
// and by the step runner for every layer of a device-driven step (a lane's
// slots), so both describe a batch the same way.
#ifndef MLAVERIFY_SERVER_ENGINE_SLOT_WRITER_H_
#define MLAVERIFY_SERVER_ENGINE_SLOT_WRITER_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/copy_list.h"
#include "server/engine/device.h"

namespace mlaverify::engine {

// Where one tensor of a request is, as the launching device addresses it:
// token i's rows (this device's heads) start at address + i * pitch.
struct ShardTensor {
  uint64_t address = 0;
  uint32_t pitch = 0;
};

// Fills one slot: `host` is the slot as this process writes it, `device`
// the same slot as the launch's gather reads it (the slot's own arrays are
// copied from there).
class SlotWriter {
 public:
  SlotWriter(uint8_t* host, uint64_t device, const SlotLayout& layout, int gather_capacity)
      : host_(host), device_(device), layout_(layout), gather_capacity_(gather_capacity) {}

  // Adds a descriptor to the gather list; false when it is full.
  bool Gather(uint64_t src, uint32_t src_pitch, uint64_t dst, uint32_t dst_pitch,
              uint32_t row_bytes, uint32_t rows);
  // Adds a descriptor to the output list; false when it is full.
  bool Output(uint64_t src, uint32_t src_pitch, uint64_t dst, uint32_t dst_pitch,
              uint32_t row_bytes, uint32_t rows);
  template <typename T>
  T* Host(size_t offset) const {
    return reinterpret_cast<T*>(host_ + offset);
  }
  uint64_t Device(size_t offset) const { return device_ + offset; }
  int gathers() const { return gathers_; }
  int outputs() const { return outputs_; }
  const SlotLayout& layout() const { return layout_; }
  // Drops every descriptor added so far.
  void Reset() { gathers_ = outputs_ = 0; }
  // Writes the lists' lengths (the last thing before the launch).
  void Close();

 private:
  kernels::CopyListHeader* List() const { return Host<kernels::CopyListHeader>(layout_.list); }
  kernels::CopyListHeader* OutputList() const {
    return Host<kernels::CopyListHeader>(layout_.outputs);
  }

  uint8_t* const host_;
  const uint64_t device_;
  const SlotLayout& layout_;
  const int gather_capacity_;
  int gathers_ = 0;
  int outputs_ = 0;
};

// One request of a verify batch as its slot describes it.
struct PackedRequest {
  int32_t prefix_len = 0;
  int32_t draft_len = 0;
  int32_t layer = 0;
  float scale = 0;
  // Where its page ids start in the table the launch reads, and the ids
  // (at least enough for prefix_len + draft_len positions).
  int64_t table_offset = 0;
  const int32_t* pages = nullptr;
  const uint64_t* visibility = nullptr;  // [draft_len]
  ShardTensor q, draft_kv, out, lse;
};

// What the device needs to know to describe a batch.
struct BatchTarget {
  const DeviceBuffers* buffers = nullptr;  // the launch's batch buffers
  int num_heads = 0;                       // heads the device computes
  int num_layers = 0;
  int64_t num_pages = 0;
  int page_size = 0;
  KvDtype kv_dtype = KvDtype::kBf16;
};

// Writes a batch of `shape` (requests past `requests.size()` are padding:
// no drafts, nothing read) after whatever the slot's gather list holds:
// each request's queries into the query buffer, its draft rows straight
// into the pool (a bf16 pool) or into the draft buffer (an fp8 pool, which
// the launch quantizes), the request arrays, the visibility words and the
// output list (each output row to its caller's memory). INTERNAL when a
// list outgrows the slot.
absl::Status PackBatch(SlotWriter& w, const BatchTarget& target, BatchShape shape,
                       absl::Span<const PackedRequest> requests);

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_SLOT_WRITER_H_
