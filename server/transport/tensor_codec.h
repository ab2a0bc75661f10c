// Checking and viewing the Tensor messages of the wire contract as engine
// buffers, without copies: inputs are spans over the request's bytes, outputs
// are spans over response bytes sized here.
#ifndef MLAVERIFY_SERVER_TRANSPORT_TENSOR_CODEC_H_
#define MLAVERIFY_SERVER_TRANSPORT_TENSOR_CODEC_H_

#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/bf16.h"
#include "mlaverify/v1/verify.pb.h"

namespace mlaverify::transport {

// A view of `tensor` as bf16 values of exactly `shape`. INVALID_ARGUMENT
// naming `what` for a wrong dtype, shape or byte count; UNIMPLEMENTED for
// shared-memory tensors (reserved in v1).
absl::StatusOr<absl::Span<const Bf16>> Bf16Input(const v1::Tensor& tensor,
                                                 std::initializer_list<int64_t> shape,
                                                 absl::string_view what);

// Shapes `tensor` as bf16/fp32 `shape` with zero-filled raw bytes and
// returns a writable view of them.
absl::Span<Bf16> Bf16Output(v1::Tensor* tensor, std::initializer_list<int64_t> shape);
absl::Span<float> Fp32Output(v1::Tensor* tensor, std::initializer_list<int64_t> shape);

// "[2, 8, 576]"
std::string ShapeString(const v1::Tensor& tensor);

}  // namespace mlaverify::transport

#endif  // MLAVERIFY_SERVER_TRANSPORT_TENSOR_CODEC_H_
