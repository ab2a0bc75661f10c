// `mlaverify-client demo`: a short speculative-decoding run against a live
// server whose every answer is checked against the client's own CPU
// reference over a mirror of what it sent.
#ifndef MLAVERIFY_CLIENT_DEMO_H_
#define MLAVERIFY_CLIENT_DEMO_H_

#include <cstdint>
#include <string>
#include <vector>

#include "client/client.h"

namespace mlaverify::client {

struct DemoOptions {
  int sequences = 2;         // items in every Verify call (<= server max_batch)
  int64_t prompt_len = 200;  // prompt tokens per sequence (0: start empty)
  int steps = 4;             // decode steps
  int drafts = 8;            // N per step, capped by the server's max_draft_len
  uint64_t seed = 1;
  bool stream = false;  // per-layer calls over one VerifyStream
  // "inline" or "shm": tensors through a shared-memory region the demo
  // creates, registers and removes (the server needs --allow-client-shm).
  std::string data_plane = "inline";  // or "cuda-shm": a device buffer by IPC handle
  int cuda_device = 0;                // cuda-shm: the buffer's device
  float softmax_scale = 0.0f;         // > 0 overrides the server's default per request
  double max_rel_err = 1e-2;          // ||out - ref|| / ||ref|| allowed per item and layer
  double max_lse_err = 1e-2;          // |lse - ref| allowed, natural-log units
  int reference_threads = 0;          // CPU reference threads; <= 0: all
};

struct DemoSummary {
  bool passed = false;
  double max_rel_err = 0.0;
  double max_lse_err = 0.0;
  int64_t verify_calls = 0;
  int64_t items_checked = 0;
  std::vector<std::string> failures;  // one line per failed check or RPC
};

// Runs the demo and prints its progress and per-step table to stdout. Never
// throws; every problem ends up in `failures`. Releases every sequence it
// created, also after a failure.
DemoSummary RunDemo(VerifyClient& client, const DemoOptions& options);

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_DEMO_H_
