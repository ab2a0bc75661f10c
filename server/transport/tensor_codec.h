// Checking and viewing the Tensor messages of the wire contract as engine
// buffers, without copies: inputs are spans over the request's bytes or over
// a registered shared-memory region, outputs are spans over response bytes
// sized here or over the region the request placed them in.
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
#include "server/transport/shared_memory.h"

namespace mlaverify::transport {

// Where a call's shared-memory references resolve: the server's registry and
// the call's leases (held until its work completed). A default one (no
// registry) answers every reference FAILED_PRECONDITION.
struct SharedMemoryScope {
  SharedMemoryRegistry* registry = nullptr;
  RegionLeases* leases = nullptr;
};

// A view of `tensor` as bf16 values of exactly `shape`, inline or in shared
// memory. INVALID_ARGUMENT naming `what` for a wrong dtype, shape or byte
// count; a shared-memory reference fails as RegionLeases::Resolve says.
absl::StatusOr<absl::Span<const Bf16>> Bf16Input(const v1::Tensor& tensor,
                                                 std::initializer_list<int64_t> shape,
                                                 absl::string_view what,
                                                 const SharedMemoryScope& shm = {});

// Shapes `tensor` as bf16/fp32 `shape` with zero-filled raw bytes and
// returns a writable view of them.
absl::Span<Bf16> Bf16Output(v1::Tensor* tensor, std::initializer_list<int64_t> shape);
absl::Span<float> Fp32Output(v1::Tensor* tensor, std::initializer_list<int64_t> shape);

// Shapes `tensor` as bf16/fp32 `shape` referencing `ref` (no bytes) and
// returns a writable view of the referenced range; errors as for inputs.
absl::StatusOr<absl::Span<Bf16>> Bf16SharedOutput(const v1::SharedMemoryRef& ref,
                                                  std::initializer_list<int64_t> shape,
                                                  absl::string_view what,
                                                  const SharedMemoryScope& shm, v1::Tensor* tensor);
absl::StatusOr<absl::Span<float>> Fp32SharedOutput(const v1::SharedMemoryRef& ref,
                                                   std::initializer_list<int64_t> shape,
                                                   absl::string_view what,
                                                   const SharedMemoryScope& shm,
                                                   v1::Tensor* tensor);

// "[2, 8, 576]"
std::string ShapeString(const v1::Tensor& tensor);

}  // namespace mlaverify::transport

#endif  // MLAVERIFY_SERVER_TRANSPORT_TENSOR_CODEC_H_
