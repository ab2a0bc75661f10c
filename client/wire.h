// Conversions between the client library's types and the v1 wire messages,
// and the AppendKv chunk arithmetic. Pure functions with no channel, so the
// checks on what the server sends back are testable without a server.
#ifndef MLAVERIFY_CLIENT_WIRE_H_
#define MLAVERIFY_CLIENT_WIRE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/shared_memory.h"
#include "common/bf16.h"
#include "grpcpp/support/status.h"
#include "mlaverify/v1/verify.pb.h"

namespace mlaverify::client {

// One sequence's part of a Verify call. The spans are borrowed for the call.
struct VerifyItemInput {
  uint64_t sequence_id = 0;
  absl::Span<const int32_t> parents;  // [N], the draft tree
  absl::Span<const Bf16> q;           // [N, H, 576] absorbed queries
  absl::Span<const Bf16> draft_kv;    // [N, 576] the drafts' latent KV
  // Not null: the shared-memory data plane for this item. q and draft_kv
  // are copied into the placement (unless they already point there) and sent
  // as references; the server writes out and lse there, and the result is
  // read back from it.
  const ShmItemPlacement* shm = nullptr;
};

// The server's answer for one item, checked against the item's shape.
struct VerifyItemResult {
  uint64_t sequence_id = 0;
  int num_drafts = 0;      // N
  int num_heads = 0;       // H
  std::vector<Bf16> out;   // [N, H, 512]
  std::vector<float> lse;  // [N, H], natural log
  int64_t prefix_len = 0;  // committed tokens the drafts attended to
};

// Same code and message; the client adds nothing to the server's words.
absl::Status FromGrpcStatus(const grpc::Status& status);

// Fills `tensor` with bf16 `values` of the given shape (product must match).
void SetBf16Tensor(absl::Span<const int64_t> shape, absl::Span<const Bf16> values,
                   v1::Tensor* tensor);

// Builds a VerifyRequest. Checks locally what the client can know without the
// server's geometry: at least one item, a non-empty tree per item, q a whole
// number of [N, H, 576] rows with H >= 1, draft_kv exactly [N, 576].
// INVALID_ARGUMENT otherwise. The tree itself is validated by the server.
absl::StatusOr<v1::VerifyRequest> BuildVerifyRequest(int layer,
                                                     absl::Span<const VerifyItemInput> items,
                                                     float softmax_scale, uint64_t request_id);

// Checks a VerifyResponse against the request's items and unpacks it: one
// result per item in order, matching sequence ids, out bf16 [N, H, 512] and
// lse fp32 [N, H] with inline bytes of exactly that size (or, for an item
// placed in shared memory, references to exactly its placement, whose bytes
// are then read). INTERNAL for a response of the wrong structure (count, ids,
// dtype, shape, no inline bytes, another reference), DATA_LOSS when the bytes
// do not match the declared shape.
absl::StatusOr<std::vector<VerifyItemResult>> ParseVerifyResponse(
    absl::Span<const VerifyItemInput> items, const v1::VerifyResponse& response);

// ---- AppendKv chunking ------------------------------------------------------

// Share of the message limit a chunk's tensor bytes may use; the rest covers
// the protobuf envelope and leaves room for a limit the server measures
// slightly differently.
inline constexpr double kAppendKvHeadroom = 0.9;

// AppendKv messages stay under this even where the limits allow more: on
// the H200 host one stream of 15 MB chunks uploaded 0.54 GB/s against 0.46
// GB/s with 57 MB ones (bench/NOTES.md, "The data planes"); buffers above
// glibc's 32 MiB mmap threshold are fresh, page-faulted memory on every
// message, on both ends.
inline constexpr int64_t kAppendKvMessageCap = int64_t{16} << 20;

// Tokens of [num_layers, T, 576] bf16 KV that fit one AppendKv message under
// `message_limit_bytes` with the headroom above. 0 when not even one token
// fits (the caller reports that; sending would only be refused).
int64_t MaxAppendChunkTokens(int64_t message_limit_bytes, int num_layers);

// A half-open range [begin, end) of token indices.
struct TokenRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

// Splits `tokens` into consecutive ranges of at most `max_chunk_tokens`
// (>= 1), in order, covering every token once. Empty for tokens == 0.
std::vector<TokenRange> PlanAppendChunks(int64_t tokens, int64_t max_chunk_tokens);

// Builds the AppendKv request for `range` of a prompt whose KV is
// kv [num_layers, total_tokens, 576]: the chunk's tensor is
// [num_layers, range.size(), 576], each layer's rows gathered from its slice.
// The chunk starts at position start_position + range.begin.
v1::AppendKvRequest BuildAppendKvChunk(uint64_t sequence_id, int64_t start_position, int num_layers,
                                       int64_t total_tokens, absl::Span<const Bf16> kv,
                                       TokenRange range);

// The same chunk gathered into `dst` (range.size() * num_layers * 576 bf16),
// e.g. a shared-memory staging area.
void GatherAppendChunk(int num_layers, int64_t total_tokens, absl::Span<const Bf16> kv,
                       TokenRange range, uint8_t* dst);

// The AppendKv request of a chunk that lies at `offset` of registered
// shared-memory region `region` (a reference, no bytes).
v1::AppendKvRequest BuildAppendKvChunkReference(uint64_t sequence_id, int64_t start_position,
                                                int num_layers, TokenRange range,
                                                const std::string& region, uint64_t offset);

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_WIRE_H_
