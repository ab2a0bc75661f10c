#include "server/transport/tensor_codec.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace mlaverify::transport {
namespace {

// Elements of a shape, or -1 when a dimension is negative or the product
// exceeds 2^40 (no tensor of the contract is near that: the check keeps the
// arithmetic below from overflowing on hostile shapes).
int64_t Elements(std::initializer_list<int64_t> shape) {
  constexpr int64_t kMaxElements = int64_t{1} << 40;
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > kMaxElements / d)) return -1;
    n *= d;
  }
  return n;
}

template <typename T>
absl::Span<T> Output(v1::Tensor* tensor, v1::DType dtype, std::initializer_list<int64_t> shape) {
  tensor->set_dtype(dtype);
  tensor->clear_shape();
  for (int64_t d : shape) tensor->add_shape(d);
  std::string* raw = tensor->mutable_raw();
  const int64_t n = Elements(shape);
  raw->assign(static_cast<size_t>(n) * sizeof(T), '\0');
  // std::string storage of this size is heap memory from operator new:
  // aligned for any scalar type.
  return absl::MakeSpan(reinterpret_cast<T*>(raw->data()), static_cast<size_t>(n));
}

// The writable range `ref` names, checked as an output of `elements` values
// of T.
template <typename T>
absl::StatusOr<absl::Span<T>> SharedRange(const v1::SharedMemoryRef& ref, int64_t elements,
                                          bool is_output, absl::string_view what,
                                          const SharedMemoryScope& shm) {
  if (shm.registry == nullptr || shm.leases == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": shared-memory tensors are not accepted here; send the bytes inline"));
  }
  absl::StatusOr<uint8_t*> data =
      shm.leases->Resolve(*shm.registry, ref.region(), ref.offset(), ref.byte_size(),
                          static_cast<uint64_t>(elements) * sizeof(T), alignof(T), is_output, what);
  if (!data.ok()) return data.status();
  return absl::MakeSpan(reinterpret_cast<T*>(*data), static_cast<size_t>(elements));
}

template <typename T>
absl::StatusOr<absl::Span<T>> SharedOutput(const v1::SharedMemoryRef& ref, v1::DType dtype,
                                           std::initializer_list<int64_t> shape,
                                           absl::string_view what, const SharedMemoryScope& shm,
                                           v1::Tensor* tensor) {
  const int64_t n = Elements(shape);
  absl::StatusOr<absl::Span<T>> range = SharedRange<T>(ref, n, /*is_output=*/true, what, shm);
  if (!range.ok()) return range.status();
  tensor->set_dtype(dtype);
  tensor->clear_shape();
  for (int64_t d : shape) tensor->add_shape(d);
  *tensor->mutable_shared_memory() = ref;
  return range;
}

}  // namespace

std::string ShapeString(const v1::Tensor& tensor) {
  return absl::StrCat("[", absl::StrJoin(tensor.shape(), ", "), "]");
}

absl::StatusOr<absl::Span<const Bf16>> Bf16Input(const v1::Tensor& tensor,
                                                 std::initializer_list<int64_t> shape,
                                                 absl::string_view what,
                                                 const SharedMemoryScope& shm) {
  if (tensor.dtype() != v1::DTYPE_BF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": dtype ", v1::DType_Name(tensor.dtype()), ", expected DTYPE_BF16"));
  }
  const std::string expected = absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
  bool same = tensor.shape_size() == static_cast<int>(shape.size());
  int k = 0;
  for (int64_t d : shape) {
    if (!same) break;
    same = tensor.shape(k++) == d;
  }
  if (!same) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": shape ", ShapeString(tensor), ", expected ", expected));
  }
  const int64_t n = Elements(shape);
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": shape ", expected, " is negative or too large"));
  }
  if (tensor.has_shared_memory()) {
    absl::StatusOr<absl::Span<Bf16>> range =
        SharedRange<Bf16>(tensor.shared_memory(), n, /*is_output=*/false, what, shm);
    if (!range.ok()) return range.status();
    return absl::Span<const Bf16>(*range);
  }
  if (static_cast<int64_t>(tensor.raw().size()) != n * 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", tensor.raw().size(), " bytes of data, shape ", expected, " needs ", n * 2));
  }
  return absl::MakeConstSpan(reinterpret_cast<const Bf16*>(tensor.raw().data()),
                             static_cast<size_t>(n));
}

absl::Span<Bf16> Bf16Output(v1::Tensor* tensor, std::initializer_list<int64_t> shape) {
  return Output<Bf16>(tensor, v1::DTYPE_BF16, shape);
}

absl::Span<float> Fp32Output(v1::Tensor* tensor, std::initializer_list<int64_t> shape) {
  return Output<float>(tensor, v1::DTYPE_FP32, shape);
}

absl::StatusOr<absl::Span<Bf16>> Bf16SharedOutput(const v1::SharedMemoryRef& ref,
                                                  std::initializer_list<int64_t> shape,
                                                  absl::string_view what,
                                                  const SharedMemoryScope& shm,
                                                  v1::Tensor* tensor) {
  return SharedOutput<Bf16>(ref, v1::DTYPE_BF16, shape, what, shm, tensor);
}

absl::StatusOr<absl::Span<float>> Fp32SharedOutput(const v1::SharedMemoryRef& ref,
                                                   std::initializer_list<int64_t> shape,
                                                   absl::string_view what,
                                                   const SharedMemoryScope& shm,
                                                   v1::Tensor* tensor) {
  return SharedOutput<float>(ref, v1::DTYPE_FP32, shape, what, shm, tensor);
}

}  // namespace mlaverify::transport
