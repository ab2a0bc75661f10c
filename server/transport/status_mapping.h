// The one place where engine statuses become gRPC statuses.
#ifndef MLAVERIFY_SERVER_TRANSPORT_STATUS_MAPPING_H_
#define MLAVERIFY_SERVER_TRANSPORT_STATUS_MAPPING_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace mlaverify::transport {

// absl and gRPC share the google.rpc.Code numbering: the code carries over
// unchanged, the message too.
grpc::Status ToGrpcStatus(const absl::Status& status);

// "OK", "INVALID_ARGUMENT", ...: the metric label of a code.
const char* GrpcCodeName(grpc::StatusCode code);

}  // namespace mlaverify::transport

#endif  // MLAVERIFY_SERVER_TRANSPORT_STATUS_MAPPING_H_
