// libFuzzer target: any bytes as a v1.Tensor, checked against the shapes the
// service expects (the AppendKv shape with T taken from the tensor, as the
// service does, and a Verify q shape). A view must come back only for a
// tensor whose dtype, shape and byte count match, and never crash or
// overflow on hostile shapes.
#include <cstddef>
#include <cstdint>

#include "google/protobuf/stubs/logging.h"
#include "mlaverify/v1/verify.pb.h"
#include "server/transport/tensor_codec.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Invalid UTF-8 in string fields is logged by the parser: expected here.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mlaverify::v1::Tensor tensor;
  if (!tensor.ParseFromArray(data, static_cast<int>(size))) return 0;
  (void)mlaverify::transport::ShapeString(tensor);
  const int64_t tokens = tensor.shape_size() == 3 ? tensor.shape(1) : -1;
  if (tokens >= 1) {
    auto view = mlaverify::transport::Bf16Input(tensor, {61, tokens, 576}, "kv");
    if (view.ok() && static_cast<int64_t>(view->size()) != 61 * tokens * 576) __builtin_trap();
  }
  auto q = mlaverify::transport::Bf16Input(tensor, {4, 8, 576}, "q");
  if (q.ok() && (q->size() != 4 * 8 * 576 || tensor.raw().size() != 4 * 8 * 576 * 2)) {
    __builtin_trap();
  }
  return 0;
}
