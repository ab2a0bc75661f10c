// libmlaverify_native.so: the C++ client's Verify (unary, and over a
// VerifyStream) behind a C ABI, for the Python package's native path
// (client/python/mlaverify/native.py, through ctypes: one build loads in any
// Python version, and ctypes releases the GIL during each call). Only for
// items placed in shared memory (system or CUDA), whose requests carry region
// names and offsets: the Python side checks the request against the server's
// geometry, puts the inputs in place and reads the outputs; this library sends
// the request and checks the answer with client/wire.cc's code. A call skips
// grpcio's Python-side machinery (for a stream, its request-iterator thread
// and the reader thread that hands each answer back).
//
// Errors: functions that can fail return the gRPC code number (0: OK) and
// write the message, NUL-terminated and cut to fit, into `message` (`cap`
// bytes). Objects: each *_create/*_open has its *_destroy; a stream must be
// destroyed before its client; an item is immutable and may be shared by
// threads. A client is thread-safe; a stream takes one call at a time (a
// mutex serializes callers).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/shared_memory.h"
#include "client/wire.h"
#include "common/bf16.h"
#include "common/mutex_tuning.h"

namespace mlaverify::client {
namespace {

constexpr size_t kLatent = 576;

int Fail(const absl::Status& status, char* message, size_t cap) {
  if (message != nullptr && cap > 0) {
    const size_t n = std::min(cap - 1, status.message().size());
    std::memcpy(message, status.message().data(), n);
    message[n] = '\0';
  }
  return static_cast<int>(status.code());
}

}  // namespace

// One sequence's item placed in a registered region. Offsets are what the
// SharedMemoryRef carries. The inputs are in the region already and the
// outputs stay there (the Python side reads them).
struct NativeItem {
  uint64_t sequence_id = 0;
  std::vector<int32_t> parents;
  size_t num_heads = 0;
  ShmItemPlacement placement;

  // The library's item. q and draft_kv are never read (inputs_in_place):
  // their spans carry only the sizes the request takes N and H from.
  VerifyItemInput Input() const {
    VerifyItemInput item;
    item.sequence_id = sequence_id;
    item.parents = parents;
    item.q = absl::Span<const Bf16>(nullptr, parents.size() * num_heads * kLatent);
    item.draft_kv = absl::Span<const Bf16>(nullptr, parents.size() * kLatent);
    item.shm = &placement;
    return item;
  }
};

struct NativeClient {
  std::unique_ptr<VerifyClient> client;
};

struct NativeStream {
  absl::Mutex mu;
  std::unique_ptr<VerifyStreamSession> session ABSL_PT_GUARDED_BY(mu);
};

}  // namespace mlaverify::client

using mlaverify::client::Fail;
using mlaverify::client::NativeClient;
using mlaverify::client::NativeItem;
using mlaverify::client::NativeStream;

// The library is built with hidden visibility: only these are its interface.
#define MLAVERIFY_NATIVE_EXPORT __attribute__((visibility("default")))

// A call's options from the C arguments: timeout_s > 0 its own deadline,
// metadata[2 * pairs] alternating keys and values.
mlaverify::client::CallOptions CallOptionsOf(double timeout_s, const char* const* metadata,
                                             int pairs) {
  mlaverify::client::CallOptions call;
  if (timeout_s > 0) call.timeout = absl::Seconds(timeout_s);
  for (int k = 0; metadata != nullptr && k < pairs; ++k) {
    if (metadata[2 * k] == nullptr || metadata[2 * k + 1] == nullptr) continue;
    call.metadata.emplace_back(metadata[2 * k], metadata[2 * k + 1]);
  }
  return call;
}

extern "C" {

// A client of `target` over one connection. timeout_s <= 0: no deadline per
// call; keepalive_time_s <= 0: no pings; auth_token "" : none.
MLAVERIFY_NATIVE_EXPORT int mlaverify_native_client_create(
    const char* target, double timeout_s, const char* auth_token, int wait_for_ready,
    double keepalive_time_s, double keepalive_timeout_s, int keepalive_permit_without_calls,
    int64_t max_message_bytes, NativeClient** out, char* message, size_t cap) {
  using namespace mlaverify::client;
  mlaverify::TurnOffMutexDeadlockDetection();  // (mutex_tuning.h: why; process-wide)
  ClientOptions options;
  options.connections = 1;
  options.call_timeout = timeout_s > 0 ? absl::Seconds(timeout_s) : absl::InfiniteDuration();
  options.auth_token = auth_token == nullptr ? "" : auth_token;
  options.wait_for_ready = wait_for_ready != 0;
  options.keepalive_time =
      keepalive_time_s > 0 ? absl::Seconds(keepalive_time_s) : absl::InfiniteDuration();
  options.keepalive_timeout = absl::Seconds(keepalive_timeout_s);
  options.keepalive_permit_without_calls = keepalive_permit_without_calls != 0;
  options.max_send_message_bytes = max_message_bytes;
  options.max_receive_message_bytes = max_message_bytes;
  absl::StatusOr<std::unique_ptr<VerifyClient>> client =
      VerifyClient::Create(target == nullptr ? "" : target, std::move(options));
  if (!client.ok()) return Fail(client.status(), message, cap);
  *out = new NativeClient{*std::move(client)};
  return 0;
}

MLAVERIFY_NATIVE_EXPORT void mlaverify_native_client_destroy(NativeClient* client) {
  delete client;
}

// metadata[2 * metadata_pairs]: keys and values sent with the stream's opening.
MLAVERIFY_NATIVE_EXPORT int mlaverify_native_stream_open(NativeClient* client,
                                                         const char* const* metadata,
                                                         int metadata_pairs, NativeStream** out,
                                                         char* message, size_t cap) {
  auto session = client->client->OpenVerifyStream(absl::InfiniteDuration(),
                                                  CallOptionsOf(0, metadata, metadata_pairs));
  if (!session.ok()) return Fail(session.status(), message, cap);
  auto* stream = new NativeStream();
  {
    absl::MutexLock lock(&stream->mu);
    stream->session = *std::move(session);
  }
  *out = stream;
  return 0;
}

// Half-closes the stream and returns the server's final status.
MLAVERIFY_NATIVE_EXPORT int mlaverify_native_stream_close(NativeStream* stream, char* message,
                                                          size_t cap) {
  absl::MutexLock lock(&stream->mu);
  const absl::Status status = stream->session->Close();
  return status.ok() ? 0 : Fail(status, message, cap);
}

// Cancels the stream if it is still open.
MLAVERIFY_NATIVE_EXPORT void mlaverify_native_stream_destroy(NativeStream* stream) {
  delete stream;
}

// An item of `num_drafts` drafts (parents[num_drafts]) and `num_heads` heads
// placed in registered region `region`; null when a count is below 1 or a
// pointer is null.
MLAVERIFY_NATIVE_EXPORT NativeItem* mlaverify_native_item_create(
    uint64_t sequence_id, const int32_t* parents, int num_drafts, int num_heads, const char* region,
    uint64_t q_offset, uint64_t draft_kv_offset, uint64_t out_offset, uint64_t lse_offset) {
  if (num_drafts < 1 || num_heads < 1 || parents == nullptr || region == nullptr) return nullptr;
  auto* item = new NativeItem();
  item->sequence_id = sequence_id;
  item->parents.assign(parents, parents + num_drafts);
  item->num_heads = static_cast<size_t>(num_heads);
  item->placement.region = region;
  item->placement.inputs_in_place = true;
  item->placement.read_back = false;
  item->placement.q_offset = q_offset;
  item->placement.draft_kv_offset = draft_kv_offset;
  item->placement.out_offset = out_offset;
  item->placement.lse_offset = lse_offset;
  return item;
}

MLAVERIFY_NATIVE_EXPORT void mlaverify_native_item_destroy(NativeItem* item) { delete item; }

// One layer's Verify of items[count]: over `stream` when not null, else a
// unary call of `client` with its own deadline (timeout_s > 0; else the
// client's) and metadata[2 * metadata_pairs] (keys and values; not for a
// stream message: a stream's metadata goes with its opening). On success
// prefix_lens[k] is item k's committed length the drafts attended to (the
// answer was checked against the items).
MLAVERIFY_NATIVE_EXPORT int mlaverify_native_verify(NativeClient* client, NativeStream* stream,
                                                    int layer, const NativeItem* const* items,
                                                    int count, float softmax_scale,
                                                    double timeout_s, const char* const* metadata,
                                                    int metadata_pairs, int64_t* prefix_lens,
                                                    char* message, size_t cap) {
  using namespace mlaverify::client;
  if (count < 1) {
    return Fail(absl::InvalidArgumentError("Verify needs at least one item"), message, cap);
  }
  std::vector<VerifyItemInput> inputs;
  inputs.reserve(static_cast<size_t>(count));
  for (int k = 0; k < count; ++k) inputs.push_back(items[k]->Input());
  absl::StatusOr<std::vector<VerifyItemResult>> results;
  if (stream != nullptr) {
    absl::MutexLock lock(&stream->mu);
    results = stream->session->Verify(layer, inputs, softmax_scale);
  } else {
    results = client->client->Verify(layer, inputs, softmax_scale,
                                     CallOptionsOf(timeout_s, metadata, metadata_pairs));
  }
  if (!results.ok()) return Fail(results.status(), message, cap);
  for (int k = 0; k < count; ++k) prefix_lens[k] = (*results)[static_cast<size_t>(k)].prefix_len;
  return 0;
}

}  // extern "C"
