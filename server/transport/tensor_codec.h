// The protobuf Tensor messages of the wire contract as engine tensor
// references (server/engine/tensor_ref.h), without checks and without
// copies: the engine checks dtype, shape, size and region ranges once. The
// references point into the request (and, for outputs returned inline, into
// the response), which outlive the engine's call.
#ifndef MLAVERIFY_SERVER_TRANSPORT_TENSOR_CODEC_H_
#define MLAVERIFY_SERVER_TRANSPORT_TENSOR_CODEC_H_

#include <string>

#include "mlaverify/v1/verify.pb.h"
#include "server/engine/tensor_ref.h"

namespace mlaverify::transport {

// An input tensor: its dtype, shape, and its raw bytes or region range.
engine::TensorRef ToTensorRef(const v1::Tensor& tensor);

// An output: into `ref`'s region range when `ref` is set (`has_ref`), else
// into `inline_tensor`'s raw bytes, which the engine fills once the call
// passed its checks (OutputRef::grow).
engine::OutputRef ToOutputRef(bool has_ref, const v1::SharedMemoryRef& ref,
                              v1::Tensor* inline_tensor);

// Labels an output tensor of the response (dtype, shape; the reference it
// was written to, if any) once the call succeeded.
void LabelOutput(v1::Tensor* tensor, v1::DType dtype, std::initializer_list<int64_t> shape,
                 const v1::SharedMemoryRef* ref);

}  // namespace mlaverify::transport

#endif  // MLAVERIFY_SERVER_TRANSPORT_TENSOR_CODEC_H_
