// A response as gRPC sends it, without copying its large fields. Protobuf's
// own serializer writes the message (so the bytes are exactly what
// SerializeToString would give); bytes and string fields of at least
// kAliasMinBytes are not copied but referenced in place by slices that keep
// the message alive until gRPC released the last of them (after the write).
// A Verify answer's out tensors (128 KiB per item at N=16, 8 heads) then go
// from the bytes the engine wrote straight to the socket.
#ifndef MLAVERIFY_SERVER_TRANSPORT_MESSAGE_ENCODING_H_
#define MLAVERIFY_SERVER_TRANSPORT_MESSAGE_ENCODING_H_

#include <google/protobuf/message.h>
#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <memory>

#include "absl/status/status.h"

namespace mlaverify::transport {

// Fields shorter than this are copied with the framing around them (a slice
// per field costs more than copying a few hundred bytes).
inline constexpr size_t kAliasMinBytes = 1024;

// Encodes `message` into `bytes` (replacing what it held). `message` must not
// change from here on: it is freed once neither `bytes` nor any copy of it
// (gRPC's, until the write completed) references it. INTERNAL when the
// message cannot be serialized (over 2 GiB).
absl::Status EncodeInPlace(std::shared_ptr<const google::protobuf::Message> message,
                           grpc::ByteBuffer* bytes);

}  // namespace mlaverify::transport

#endif  // MLAVERIFY_SERVER_TRANSPORT_MESSAGE_ENCODING_H_
