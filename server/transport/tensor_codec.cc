#include "server/transport/tensor_codec.h"

#include "absl/strings/str_cat.h"

namespace mlaverify::transport {
namespace {

engine::RegionRange ToRange(const v1::SharedMemoryRef& ref) {
  return {ref.region(), ref.offset(), ref.byte_size()};
}

}  // namespace

engine::TensorRef ToTensorRef(const v1::Tensor& tensor) {
  engine::TensorRef t;
  switch (tensor.dtype()) {
    case v1::DTYPE_BF16:
      t.dtype = engine::DType::kBf16;
      break;
    case v1::DTYPE_FP32:
      t.dtype = engine::DType::kFp32;
      break;
    default:
      t.dtype = engine::DType::kOther;
      t.dtype_name = v1::DType_IsValid(tensor.dtype())
                         ? v1::DType_Name(tensor.dtype())
                         : absl::StrCat("dtype ", static_cast<int>(tensor.dtype()));
  }
  t.has_shape = true;
  t.shape = absl::MakeConstSpan(tensor.shape().data(), tensor.shape().size());
  if (tensor.has_shared_memory()) {
    t.in_region = true;
    t.range = ToRange(tensor.shared_memory());
  } else {
    t.bytes = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(tensor.raw().data()),
                                  tensor.raw().size());
  }
  return t;
}

engine::OutputRef ToOutputRef(bool has_ref, const v1::SharedMemoryRef& ref,
                              v1::Tensor* inline_tensor) {
  engine::OutputRef o;
  if (has_ref) {
    o.in_region = true;
    o.range = ToRange(ref);
  } else {
    o.grow = inline_tensor->mutable_raw();
  }
  return o;
}

void LabelOutput(v1::Tensor* tensor, v1::DType dtype, std::initializer_list<int64_t> shape,
                 const v1::SharedMemoryRef* ref) {
  tensor->set_dtype(dtype);
  tensor->clear_shape();
  for (int64_t d : shape) tensor->add_shape(d);
  if (ref != nullptr) *tensor->mutable_shared_memory() = *ref;
}

}  // namespace mlaverify::transport
