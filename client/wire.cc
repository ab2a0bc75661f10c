#include "client/wire.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cuda_shared_memory.h"
#include "common/geometry.h"
#include "common/status_macros.h"

namespace mlaverify::client {
namespace {

using mlaverify::kLatentDim;
using mlaverify::kValueDim;

// Everything in an AppendKv request besides the tensor bytes is a few dozen
// bytes; this bound is generous so a tiny limit still leaves a sane budget.
constexpr int64_t kAppendKvEnvelopeBytes = 1024;

std::string ShapeString(const v1::Tensor& t) {
  return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]");
}

// Checks dtype, shape and inline byte count of one returned tensor (dtype
// and shape only for element_bytes 0); `what` names it in the message
// ("item 2 out").
absl::Status CheckTensor(const v1::Tensor& tensor, v1::DType dtype, absl::Span<const int64_t> shape,
                         size_t element_bytes, absl::string_view what) {
  if (tensor.dtype() != dtype) {
    return absl::InternalError(absl::StrCat("server returned ", what, " with dtype ",
                                            v1::DType_Name(tensor.dtype()), "; expected ",
                                            v1::DType_Name(dtype)));
  }
  if (!std::equal(tensor.shape().begin(), tensor.shape().end(), shape.begin(), shape.end())) {
    return absl::InternalError(absl::StrCat("server returned ", what, " with shape ",
                                            ShapeString(tensor), "; expected [",
                                            absl::StrJoin(shape, ", "), "]"));
  }
  if (element_bytes == 0) return absl::OkStatus();  // a reference: checked by the caller
  if (tensor.data_case() != v1::Tensor::kRaw) {
    return absl::InternalError(absl::StrCat("server returned ", what,
                                            " without inline bytes (data case ",
                                            static_cast<int>(tensor.data_case()), ")"));
  }
  int64_t elements = 1;
  for (int64_t d : shape) elements *= d;
  const size_t expected_bytes = static_cast<size_t>(elements) * element_bytes;
  if (tensor.raw().size() != expected_bytes) {
    return absl::DataLossError(absl::StrCat("server returned ", what, " of shape ",
                                            ShapeString(tensor), " with ", tensor.raw().size(),
                                            " bytes; the shape needs ", expected_bytes));
  }
  return absl::OkStatus();
}

// Checks that a returned tensor references exactly [offset, offset+bytes)
// of `region`.
absl::Status CheckReference(const v1::Tensor& tensor, const std::string& region, uint64_t offset,
                            uint64_t bytes, absl::string_view what) {
  if (tensor.data_case() != v1::Tensor::kSharedMemory) {
    return absl::InternalError(
        absl::StrCat("server returned ", what, " inline; it was placed in shared memory"));
  }
  const v1::SharedMemoryRef& ref = tensor.shared_memory();
  if (ref.region() != region || ref.offset() != offset || ref.byte_size() != bytes) {
    return absl::InternalError(absl::StrCat(
        "server returned ", what, " at ", ref.region(), "+", ref.offset(), " (", ref.byte_size(),
        " bytes); it was placed at ", region, "+", offset, " (", bytes, " bytes)"));
  }
  return absl::OkStatus();
}

void SetShmTensor(v1::DType dtype, absl::Span<const int64_t> shape, const std::string& region,
                  uint64_t offset, uint64_t bytes, v1::Tensor* tensor) {
  tensor->set_dtype(dtype);
  tensor->clear_shape();
  for (int64_t d : shape) tensor->add_shape(d);
  v1::SharedMemoryRef* ref = tensor->mutable_shared_memory();
  ref->set_region(region);
  ref->set_offset(offset);
  ref->set_byte_size(bytes);
}

// Copies `values` to `offset` of the placement unless they are there already.
absl::Status PlaceBytes(const ShmItemPlacement& p, uint64_t offset, absl::Span<const Bf16> values) {
  if (p.inputs_in_place) return absl::OkStatus();
  if (p.cuda != nullptr) return p.cuda->Write(offset, values.data(), values.size() * sizeof(Bf16));
  uint8_t* dst = p.base + offset;
  if (reinterpret_cast<const uint8_t*>(values.data()) != dst) {
    std::memcpy(dst, values.data(), values.size() * sizeof(Bf16));
  }
  return absl::OkStatus();
}

// Reads `bytes` at `offset` of the placement's region into `dst`.
absl::Status ReadPlaced(const ShmItemPlacement& p, uint64_t offset, void* dst, size_t bytes) {
  if (p.cuda != nullptr) return p.cuda->Read(offset, dst, bytes);
  std::memcpy(dst, p.base + offset, bytes);
  return absl::OkStatus();
}

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // grpc::StatusCode and absl::StatusCode both use the google.rpc.Code numbers.
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

void SetBf16Tensor(absl::Span<const int64_t> shape, absl::Span<const Bf16> values,
                   v1::Tensor* tensor) {
  tensor->set_dtype(v1::DTYPE_BF16);
  tensor->clear_shape();
  for (int64_t d : shape) tensor->add_shape(d);
  // Bf16 is the raw 16-bit pattern and every supported host is little-endian,
  // which is the wire's byte order.
  tensor->set_raw(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(Bf16));
}

absl::StatusOr<v1::VerifyRequest> BuildVerifyRequest(int layer,
                                                     absl::Span<const VerifyItemInput> items,
                                                     float softmax_scale, uint64_t request_id) {
  if (items.empty()) {
    return absl::InvalidArgumentError("Verify needs at least one item");
  }
  v1::VerifyRequest request;
  request.set_layer(layer);
  request.set_softmax_scale(softmax_scale);
  request.set_request_id(request_id);
  for (size_t k = 0; k < items.size(); ++k) {
    const VerifyItemInput& item = items[k];
    const int64_t n = static_cast<int64_t>(item.parents.size());
    if (n == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("item ", k, " (sequence ", item.sequence_id, ") has no drafts"));
    }
    const int64_t q_row = n * kLatentDim;
    if (item.q.empty() || item.q.size() % q_row != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "item ", k, " (sequence ", item.sequence_id, "): q holds ", item.q.size(),
          " values, not a whole number of [", n, ", H, ", kLatentDim, "] with H >= 1"));
    }
    if (static_cast<int64_t>(item.draft_kv.size()) != n * kLatentDim) {
      return absl::InvalidArgumentError(absl::StrCat(
          "item ", k, " (sequence ", item.sequence_id, "): draft_kv holds ", item.draft_kv.size(),
          " values; [", n, ", ", kLatentDim, "] needs ", n * kLatentDim));
    }
    const int64_t heads = static_cast<int64_t>(item.q.size()) / q_row;
    v1::VerifyItem* wire = request.add_items();
    wire->set_sequence_id(item.sequence_id);
    const int64_t q_shape[] = {n, heads, kLatentDim};
    const int64_t kv_shape[] = {n, kLatentDim};
    wire->mutable_parents()->Add(item.parents.begin(), item.parents.end());
    if (item.shm == nullptr) {
      SetBf16Tensor(q_shape, item.q, wire->mutable_q());
      SetBf16Tensor(kv_shape, item.draft_kv, wire->mutable_draft_kv());
      continue;
    }
    const ShmItemPlacement& p = *item.shm;
    RETURN_IF_ERROR(PlaceBytes(p, p.q_offset, item.q));
    SetShmTensor(v1::DTYPE_BF16, q_shape, p.region, p.q_offset, item.q.size() * sizeof(Bf16),
                 wire->mutable_q());
    if (p.draft_kv_inline) {
      SetBf16Tensor(kv_shape, item.draft_kv, wire->mutable_draft_kv());
    } else {
      RETURN_IF_ERROR(PlaceBytes(p, p.draft_kv_offset, item.draft_kv));
      SetShmTensor(v1::DTYPE_BF16, kv_shape, p.region, p.draft_kv_offset,
                   item.draft_kv.size() * sizeof(Bf16), wire->mutable_draft_kv());
    }
    v1::SharedMemoryRef* out = wire->mutable_out_shared_memory();
    out->set_region(p.region);
    out->set_offset(p.out_offset);
    out->set_byte_size(static_cast<uint64_t>(n * heads * kValueDim) * sizeof(Bf16));
    v1::SharedMemoryRef* lse = wire->mutable_lse_shared_memory();
    lse->set_region(p.region);
    lse->set_offset(p.lse_offset);
    lse->set_byte_size(static_cast<uint64_t>(n * heads) * sizeof(float));
  }
  return request;
}

absl::StatusOr<std::vector<VerifyItemResult>> ParseVerifyResponse(
    absl::Span<const VerifyItemInput> items, const v1::VerifyResponse& response) {
  if (static_cast<size_t>(response.results_size()) != items.size()) {
    return absl::InternalError(absl::StrCat("server returned ", response.results_size(),
                                            " results for ", items.size(), " items"));
  }
  std::vector<VerifyItemResult> results(items.size());
  for (size_t k = 0; k < items.size(); ++k) {
    const VerifyItemInput& item = items[k];
    const v1::VerifyResult& wire = response.results(static_cast<int>(k));
    if (wire.sequence_id() != item.sequence_id) {
      return absl::InternalError(absl::StrCat("result ", k, " is for sequence ", wire.sequence_id(),
                                              "; item ", k, " was sequence ", item.sequence_id));
    }
    const int64_t n = static_cast<int64_t>(item.parents.size());
    const int64_t heads = static_cast<int64_t>(item.q.size()) / (n * kLatentDim);
    const int64_t out_shape[] = {n, heads, kValueDim};
    const int64_t lse_shape[] = {n, heads};
    const std::string where = absl::StrCat("item ", k, " (sequence ", item.sequence_id, ")");
    const uint64_t out_bytes = static_cast<uint64_t>(n * heads * kValueDim) * sizeof(Bf16);
    const uint64_t lse_bytes = static_cast<uint64_t>(n * heads) * sizeof(float);
    if (item.shm != nullptr) {
      RETURN_IF_ERROR(
          CheckTensor(wire.out(), v1::DTYPE_BF16, out_shape, 0, absl::StrCat(where, " out")));
      RETURN_IF_ERROR(
          CheckTensor(wire.lse(), v1::DTYPE_FP32, lse_shape, 0, absl::StrCat(where, " lse")));
      RETURN_IF_ERROR(CheckReference(wire.out(), item.shm->region, item.shm->out_offset, out_bytes,
                                     absl::StrCat(where, " out")));
      RETURN_IF_ERROR(CheckReference(wire.lse(), item.shm->region, item.shm->lse_offset, lse_bytes,
                                     absl::StrCat(where, " lse")));
    } else {
      RETURN_IF_ERROR(CheckTensor(wire.out(), v1::DTYPE_BF16, out_shape, sizeof(Bf16),
                                  absl::StrCat(where, " out")));
      RETURN_IF_ERROR(CheckTensor(wire.lse(), v1::DTYPE_FP32, lse_shape, sizeof(float),
                                  absl::StrCat(where, " lse")));
    }
    if (wire.prefix_len() < 0) {
      return absl::InternalError(
          absl::StrCat(where, ": server returned prefix_len ", wire.prefix_len()));
    }
    VerifyItemResult& result = results[k];
    result.sequence_id = item.sequence_id;
    result.num_drafts = static_cast<int>(n);
    result.num_heads = static_cast<int>(heads);
    result.prefix_len = wire.prefix_len();
    if (item.shm != nullptr && !item.shm->read_back) continue;  // they stay in the region
    result.out.resize(n * heads * kValueDim);
    result.lse.resize(n * heads);
    if (item.shm != nullptr) {
      RETURN_IF_ERROR(ReadPlaced(*item.shm, item.shm->out_offset, result.out.data(), out_bytes));
      RETURN_IF_ERROR(ReadPlaced(*item.shm, item.shm->lse_offset, result.lse.data(), lse_bytes));
    } else {
      std::memcpy(result.out.data(), wire.out().raw().data(), out_bytes);
      std::memcpy(result.lse.data(), wire.lse().raw().data(), lse_bytes);
    }
  }
  return results;
}

int64_t MaxAppendChunkTokens(int64_t message_limit_bytes, int num_layers) {
  if (message_limit_bytes <= 0 || num_layers <= 0) return 0;
  const int64_t budget =
      static_cast<int64_t>(static_cast<double>(message_limit_bytes) * kAppendKvHeadroom) -
      kAppendKvEnvelopeBytes;
  const int64_t bytes_per_token = static_cast<int64_t>(num_layers) * kLatentDim * sizeof(Bf16);
  return budget <= 0 ? 0 : budget / bytes_per_token;
}

std::vector<TokenRange> PlanAppendChunks(int64_t tokens, int64_t max_chunk_tokens) {
  std::vector<TokenRange> chunks;
  if (tokens <= 0 || max_chunk_tokens <= 0) return chunks;
  chunks.reserve((tokens + max_chunk_tokens - 1) / max_chunk_tokens);
  for (int64_t begin = 0; begin < tokens; begin += max_chunk_tokens) {
    chunks.push_back({begin, std::min(tokens, begin + max_chunk_tokens)});
  }
  return chunks;
}

namespace {

// The request of a chunk, its tensor shaped [num_layers, range.size(), 576]
// without data.
v1::AppendKvRequest AppendKvChunkHeader(uint64_t sequence_id, int64_t start_position,
                                        int num_layers, TokenRange range) {
  v1::AppendKvRequest request;
  request.set_sequence_id(sequence_id);
  request.set_start_position(start_position + range.begin);
  v1::Tensor* tensor = request.mutable_kv();
  tensor->set_dtype(v1::DTYPE_BF16);
  tensor->add_shape(num_layers);
  tensor->add_shape(range.size());
  tensor->add_shape(kLatentDim);
  return request;
}

}  // namespace

void GatherAppendChunk(int num_layers, int64_t total_tokens, absl::Span<const Bf16> kv,
                       TokenRange range, uint8_t* dst) {
  // Each layer's chunk is a contiguous run of rows in the caller's layout;
  // the chunk stacks those runs layer after layer.
  const size_t run_bytes = static_cast<size_t>(range.size()) * kLatentDim * sizeof(Bf16);
  for (int layer = 0; layer < num_layers; ++layer) {
    const Bf16* src = kv.data() + (layer * total_tokens + range.begin) * kLatentDim;
    std::memcpy(dst + layer * run_bytes, src, run_bytes);
  }
}

v1::AppendKvRequest BuildAppendKvChunk(uint64_t sequence_id, int64_t start_position, int num_layers,
                                       int64_t total_tokens, absl::Span<const Bf16> kv,
                                       TokenRange range) {
  v1::AppendKvRequest request = AppendKvChunkHeader(sequence_id, start_position, num_layers, range);
  std::string* raw = request.mutable_kv()->mutable_raw();
  raw->resize(static_cast<size_t>(range.size()) * num_layers * kLatentDim * sizeof(Bf16));
  GatherAppendChunk(num_layers, total_tokens, kv, range, reinterpret_cast<uint8_t*>(raw->data()));
  return request;
}

v1::AppendKvRequest BuildAppendKvChunkReference(uint64_t sequence_id, int64_t start_position,
                                                int num_layers, TokenRange range,
                                                const std::string& region, uint64_t offset) {
  v1::AppendKvRequest request = AppendKvChunkHeader(sequence_id, start_position, num_layers, range);
  v1::SharedMemoryRef* ref = request.mutable_kv()->mutable_shared_memory();
  ref->set_region(region);
  ref->set_offset(offset);
  ref->set_byte_size(static_cast<uint64_t>(range.size()) * num_layers * kLatentDim * sizeof(Bf16));
  return request;
}

}  // namespace mlaverify::client
