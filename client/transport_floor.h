// The bare-transport floor of a load: a gRPC echo (mlaverify.floor.v1,
// proto/mlaverify/floor/v1/floor.proto) served in this process on loopback
// and driven like the load drives the server: the same request and answer
// sizes, RPC kind, concurrency, connections (thread t on connection t mod
// connections, each a channel with its own subchannel pool, as in
// VerifyClient's pool), HTTP/2 settings and duration. No engine sits behind
// it, so its latency and rate are what the transport alone costs for those
// messages on this host.
#ifndef MLAVERIFY_CLIENT_TRANSPORT_FLOOR_H_
#define MLAVERIFY_CLIENT_TRANSPORT_FLOOR_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "client/latency_stats.h"

namespace mlaverify::client {

struct FloorOptions {
  int concurrency = 1;
  int connections = 1;        // HTTP/2 connections the threads share, 1..256
  bool stream = false;        // one ping-pong stream per thread; else unary calls
  int64_t request_bytes = 0;  // payload of each request
  int64_t reply_bytes = 0;    // payload of each answer
  double duration_s = 5.0;    // measured, after the warm-up
  double warmup_s = 1.0;
  // HTTP/2 settings of both ends (0: gRPC's default), as ClientOptions.
  int http2_max_frame_bytes = 0;
  int http2_lookahead_bytes = 0;
};

struct FloorReport {
  int64_t calls = 0;  // measured
  double calls_per_second = 0.0;
  LatencySummary latency_ms;
  int64_t errors = 0;
  std::string first_error;
};

// Starts the echo server, runs the calls, stops it. INVALID_ARGUMENT for
// options that make no sense; UNAVAILABLE when the server cannot start.
absl::StatusOr<FloorReport> MeasureTransportFloor(const FloorOptions& options);

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_TRANSPORT_FLOOR_H_
