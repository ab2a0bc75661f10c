// How a caller names a tensor of a call: bytes in its own memory, or a range
// of a shared-memory region it registered (regions.h). The transport turns
// each protobuf Tensor into one of these without looking at shapes; the
// engine checks everything (dtype, shape, size, bounds, alignment, overlap)
// once, when the call is submitted.
#ifndef MLAVERIFY_SERVER_ENGINE_TENSOR_REF_H_
#define MLAVERIFY_SERVER_ENGINE_TENSOR_REF_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/bf16.h"

namespace mlaverify::engine {

// The element types of the wire contract, plus whatever else a client sent
// (named in errors by `dtype_name`).
enum class DType { kBf16, kFp32, kOther };

// A range of a registered region.
struct RegionRange {
  absl::string_view region;  // the name it was registered under (valid for the call)
  uint64_t offset = 0;       // from the start of the registered range
  uint64_t byte_size = 0;
};

// An input tensor. Exactly one of `bytes` (caller memory) and `range` (a
// region) holds it: `bytes` unless `in_region`. In-process callers that pass
// a span give no shape: then only the element count is checked.
struct TensorRef {
  TensorRef() = default;
  // In-process callers: bf16 values in caller memory.
  TensorRef(absl::Span<const Bf16> values)  // NOLINT: implicit, as a span
      : bytes(reinterpret_cast<const uint8_t*>(values.data()), values.size() * sizeof(Bf16)) {}
  TensorRef(const std::vector<Bf16>& values)  // NOLINT: implicit, as a span
      : TensorRef(absl::MakeConstSpan(values)) {}

  DType dtype = DType::kBf16;
  std::string dtype_name;  // for kOther, as the client named it
  // Checked against the tensor's expected shape when given (the transport
  // always gives it, viewing the request's own shape field).
  bool has_shape = false;
  absl::Span<const int64_t> shape;
  bool in_region = false;
  absl::Span<const uint8_t> bytes;
  RegionRange range;
};

// A tensor's name in errors ("items[1] (sequence 42) q"), built only when
// needed: the calls that pass every check pay nothing for it.
struct TensorName {
  int item = -1;  // -1: a call's only tensor
  uint64_t sequence = 0;
  const char* tensor = "";  // a literal
  std::string str() const {
    if (item < 0) return tensor;
    return absl::StrCat("items[", item, "] (sequence ", sequence, ") ", tensor);
  }
};

// Where an output goes: a caller buffer of the exact size, a string the
// engine fills (the transport's response bytes: a rejected call allocates
// nothing large; sized once the call passed its checks where the devices
// write host memory, else given its bytes from the staging block after the
// call ran, never zero-filled first), or a region range.
struct OutputRef {
  OutputRef() = default;
  OutputRef(absl::Span<Bf16> values)  // NOLINT: implicit, as a span
      : buffer(reinterpret_cast<uint8_t*>(values.data()), values.size() * sizeof(Bf16)) {}
  OutputRef(absl::Span<float> values)  // NOLINT: implicit, as a span
      : buffer(reinterpret_cast<uint8_t*>(values.data()), values.size() * sizeof(float)) {}

  absl::Span<uint8_t> buffer;
  std::string* grow = nullptr;  // used when `buffer` is empty and not in a region
  bool in_region = false;
  RegionRange range;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_TENSOR_REF_H_
