// Where the KV pool lives and the math runs. The engine owns sequences and
// page accounting; a backend owns the pool storage (host memory for the CPU
// backend, device memory for CUDA) and executes writes, verify batches and
// compactions on page tables the engine gives it. Calls for different
// sequences may run concurrently (their pages are disjoint).
#ifndef MLAVERIFY_SERVER_ENGINE_BACKEND_H_
#define MLAVERIFY_SERVER_ENGINE_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/bf16.h"

namespace mlaverify::engine {

struct PoolGeometry {
  int num_layers = 0;
  int64_t num_pages = 0;
  int page_size = 0;
  int num_heads = 0;
  // Limits of one Verify batch and one sequence: device backends size their
  // staging buffers and workspace from them once.
  int max_batch = 0;
  int max_draft_len = 0;
  int64_t max_pages_per_sequence = 0;
};

struct DeviceDescription {
  std::string name;
  uint64_t memory_bytes = 0;
};

// One sequence's part of a verify batch, in host memory, already validated.
struct BackendVerifyRequest {
  absl::Span<const int32_t> page_table;  // covers positions 0..prefix_len+draft_len-1
  int32_t prefix_len = 0;
  int32_t draft_len = 0;
  int32_t layer = 0;
  float softmax_scale = 0.0f;
  absl::Span<const uint64_t> visibility;  // [N] ancestor-or-self bit sets
  absl::Span<const Bf16> q;               // [N, H, 576]
  absl::Span<const Bf16> draft_kv;        // [N, 576]
  absl::Span<Bf16> out;                   // [N, H, 512]
  absl::Span<float> lse;                  // [N, H]
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string name() const = 0;
  virtual std::vector<DeviceDescription> devices() const = 0;

  // Allocates the pool; called once, before any other call.
  virtual absl::Status Init(const PoolGeometry& geometry) = 0;

  // Writes positions start..start+count-1 of every layer from
  // data [num_layers, count, 576].
  virtual absl::Status WriteRows(absl::Span<const int32_t> page_table, int64_t start,
                                 int64_t count, absl::Span<const Bf16> data) = 0;

  // Reads them back into data [num_layers, count, 576] (tests, debugging).
  virtual absl::Status ReadRows(absl::Span<const int32_t> page_table, int64_t start, int64_t count,
                                absl::Span<Bf16> data) = 0;

  // For each request: writes its drafts at P..P+N-1 of its layer, then
  // computes the tree-masked attention into out/lse.
  virtual absl::Status Verify(absl::Span<const BackendVerifyRequest> requests) = 0;

  // Moves the accepted drafts (a root-to-node path, increasing indices) from
  // P+accepted[t] to P+t in every layer.
  virtual absl::Status Compact(absl::Span<const int32_t> page_table, int64_t prefix_len,
                               absl::Span<const int32_t> accepted) = 0;
};

// Host-memory pool; math from kernels/cpu_reference.h on `threads` threads
// (<= 0: all hardware threads).
std::unique_ptr<Backend> MakeCpuBackend(int threads);

// Pool in device memory of CUDA device `device`, the kernels of
// kernels/verify_attention_cuda.h launched eagerly on one stream, one batch
// at a time. UNAVAILABLE when the device cannot be used; UNIMPLEMENTED in a
// build without CUDA.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device);

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_BACKEND_H_
