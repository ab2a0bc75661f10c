// The calls the engine takes, as the transport (or an in-process caller)
// hands them over: a Verify of several items, a prompt AppendKv, and when a
// queued call stops being wanted. Their tensors are TensorRef / OutputRef
// (tensor_ref.h); the engine checks everything about them when the call is
// submitted (call_placement.h).
#ifndef MLAVERIFY_SERVER_ENGINE_CALLS_H_
#define MLAVERIFY_SERVER_ENGINE_CALLS_H_

#include <cstdint>
#include <functional>

#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/engine/engine_observer.h"
#include "server/engine/tensor_ref.h"

namespace mlaverify::engine {

// One item of a Verify call. Its tensors are named by TensorRef / OutputRef
// (caller memory or registered regions; tensor_ref.h); caller memory and the
// strings an OutputRef grows must stay valid until the call's `done` ran.
struct VerifyItem {
  uint64_t sequence_id = 0;
  absl::Span<const int32_t> parents;  // N
  TensorRef q;                        // bf16 [N, H, 576]
  TensorRef draft_kv;                 // bf16 [N, 576]
  OutputRef out;                      // bf16 [N, H, 512], written on success
  OutputRef lse;                      // fp32 [N, H], written on success
  int64_t prefix_len = 0;             // set on success: P the drafts attended to
};

// When a queued call stops being wanted.
struct CallContext {
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> is_cancelled;  // may be empty; polled when the call is taken
};

struct VerifyCall {
  int layer = 0;
  float softmax_scale = 0;  // <= 0: the configured default
  absl::Span<VerifyItem> items;
  CallContext context;
  // If set, receives the call's server-side time split before `done` runs.
  VerifyTiming* timing = nullptr;
};

struct AppendCall {
  uint64_t sequence_id = 0;
  int64_t start_position = 0;  // must equal the sequence's length
  int64_t tokens = 0;
  TensorRef kv;  // bf16 [num_layers, tokens, 576]; caller memory valid until done
  CallContext context;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_CALLS_H_
