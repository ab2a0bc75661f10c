// Settings of one engine (one pool, one backend). Filled from server flags.
#ifndef MLAVERIFY_SERVER_ENGINE_ENGINE_CONFIG_H_
#define MLAVERIFY_SERVER_ENGINE_ENGINE_CONFIG_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace mlaverify::engine {

struct EngineConfig {
  int num_layers = 61;   // Kimi K2 / DeepSeek-V3: 61
  int num_heads = 8;     // query heads this engine computes (H / tensor-parallel degree)
  int page_size = 64;    // tokens per page, power of two 1..256
  // Bytes of KV pool; pages = pool_bytes / (num_layers * page_size * 1152).
  int64_t pool_bytes = int64_t{1} << 30;
  // Longest sequence (tokens) a page table holds.
  int64_t max_sequence_len = int64_t{1} << 17;
  // Draft-length and batch buckets (CUDA graphs are recorded per pair); the
  // largest draft bucket is the largest N a Verify item may carry, the largest
  // batch bucket the most items in one Verify.
  std::vector<int> draft_buckets = {1, 2, 4, 8, 16, 32, 64};
  std::vector<int> batch_buckets = {1, 2, 4, 8, 16, 32};
  // DeepSeek-style 1/sqrt(192) (qk_nope + qk_rope head dim); requests may override.
  float default_softmax_scale = 1.0f / std::sqrt(192.0f);
  // Sequences untouched for this long are released; zero: never.
  absl::Duration idle_timeout = absl::ZeroDuration();

  int max_draft_len() const { return draft_buckets.empty() ? 0 : draft_buckets.back(); }
  int max_batch() const { return batch_buckets.empty() ? 0 : batch_buckets.back(); }
  int64_t bytes_per_page() const { return int64_t{num_layers} * page_size * 576 * 2; }
  int64_t num_pages() const { return pool_bytes / bytes_per_page(); }
  int64_t max_pages_per_sequence() const { return (max_sequence_len + page_size - 1) / page_size; }

  // INVALID_ARGUMENT naming the first bad setting.
  absl::Status Validate() const;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_ENGINE_CONFIG_H_
