// Settings of one engine: the model geometry it serves, its KV pool, the
// devices it runs on and how it splits work over them, the CUDA-graph buckets
// and its queue limits. Filled from server flags; Validate() names the first
// bad setting.
#ifndef MLAVERIFY_SERVER_ENGINE_ENGINE_CONFIG_H_
#define MLAVERIFY_SERVER_ENGINE_ENGINE_CONFIG_H_

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/kv_dtype.h"
#include "server/engine/regions.h"

namespace mlaverify::engine {

// How the engine uses several devices (docs/architecture.md, "Multiple devices").
enum class ParallelMode {
  // Tensor parallel: each of T devices computes num_heads / T query heads of
  // every item; the latent KV is replicated on every device (AppendKv, draft
  // writes and Commit go to all of them); one page allocator serves all
  // replicas, so a page id means the same rows everywhere.
  kTensorParallel,
  // Data parallel: each sequence lives on one device, which computes all its
  // heads; every device has its own pool and allocator, so capacity is T
  // times one device's.
  kDataParallel,
};

const char* ParallelModeName(ParallelMode mode);  // "tp", "dp"

// Device-driven verify steps (docs/steps.md, server/engine/steps.h).
inline constexpr int kMaxStepLanes = 16;
struct StepOptions {
  // Steps that may run at once on each device: one lane each, with its own
  // batch buffers, a slot per layer and, on a GPU, its own stream and graphs.
  // 0: the server opens no steps (OpenStep gets FAILED_PRECONDITION).
  int lanes_per_device = 4;
  // A step is aborted when no layer completes for this long (the scheduler
  // stopped ringing, or died), or when its items are not committed this long
  // after the last layer. A request may ask for another, up to the maximum.
  absl::Duration default_layer_timeout = absl::Seconds(2);
  absl::Duration max_layer_timeout = absl::Seconds(60);
  // The whole step, open to its last Commit.
  absl::Duration default_max_duration = absl::Seconds(30);
  absl::Duration max_max_duration = absl::Seconds(600);
  // Ended steps GetStep still describes.
  int ended_steps_remembered = 1024;
};

struct EngineConfig {
  int num_layers = 61;  // Kimi K2 / DeepSeek-V3: 61
  // Query heads of one Verify item (what the client sends). In tensor-parallel
  // mode each device computes num_heads / (number of devices) of them.
  int num_heads = 8;
  int page_size = 64;  // tokens per page, power of two 1..256
  // How a latent row is stored (common/kv_dtype.h): bf16 (1,152 bytes) or
  // fp8 (656 bytes: e4m3 with per-128 scales, rope in bf16). The wire stays
  // bf16; an fp8 pool quantizes rows as they enter it (AppendKv, a Verify's
  // draft rows).
  KvDtype kv_dtype = KvDtype::kBf16;
  // Bytes of KV pool per device; pages = pool_bytes / (num_layers * page_size
  // * KvRowBytes(kv_dtype)).
  int64_t pool_bytes = int64_t{1} << 30;
  // Longest sequence (tokens) a page table holds.
  int64_t max_sequence_len = int64_t{1} << 17;
  // Draft-length and batch buckets: each device worker records one CUDA graph
  // per (draft bucket, batch bucket) pair at startup. The largest draft bucket
  // is the largest N a Verify item may carry; the largest batch bucket is the
  // most items one Verify call may carry and the most items one replay takes.
  std::vector<int> draft_buckets = {1, 2, 4, 8, 16, 32, 64};
  std::vector<int> batch_buckets = {1, 2, 4, 8, 16, 32};
  // DeepSeek-style 1/sqrt(192) (qk_nope + qk_rope head dim); requests may override.
  float default_softmax_scale = 1.0f / std::sqrt(192.0f);
  // Sequences untouched for this long are released; zero: never.
  absl::Duration idle_timeout = absl::ZeroDuration();

  ParallelMode parallel_mode = ParallelMode::kTensorParallel;
  // Replay CUDA graphs where the device supports them (false: every batch is
  // launched eagerly with its exact shape; for comparison and debugging).
  bool use_graphs = true;
  // How long a device worker may hold a partial batch open for more items
  // before it launches; zero (the default) adds no delay: the next batch is
  // whatever queued while the previous one ran.
  absl::Duration max_queue_delay = absl::ZeroDuration();
  // Admission limits over the whole engine: calls (Verify, AppendKv, Commit,
  // Release) accepted but not finished, and the tensor bytes they hold
  // (inputs and outputs). A call over either limit gets RESOURCE_EXHAUSTED.
  int max_queued_calls = 4096;
  int64_t max_queued_bytes = int64_t{2} << 30;
  // Live sequences (created and not released); CreateSequence beyond it gets
  // RESOURCE_EXHAUSTED.
  int64_t max_live_sequences = 65536;
  // Longest label accepted by CreateSequence (bytes).
  int max_label_bytes = 256;
  // Threads per device worker (its completion thread included) that complete
  // a large batch's calls, copying their staged outputs out.
  int copy_threads = 4;
  // True: finished launches are completed by a completion thread per device,
  // handed over in bulk, so that the device thread goes back to launching at
  // once. Off by default: it cost 5-30 % of the engine's items/s at 2-8
  // threads on a 2-core host and 14-36 % at 64 threads on an H100's
  // 16-core host (bench/NOTES.md, "Completion in bulk").
  bool completion_thread = false;
  // True: while launches run, the device thread polls the oldest one and
  // launches what queues behind it the moment a slot frees (a submitter
  // launches only onto an idle device). False: a submitter launches
  // whenever a slot is free, and the device thread sleeps in the device's
  // wait (CUDA: blocking-sync events) until the oldest launch ends. On by
  // default: sleeping cost 34 us per launch at one call in flight on an H100
  // and gained nothing at 64 (bench/NOTES.md, "A device thread that sleeps").
  bool poll_launches = true;
  // Launches (verify batches and pool operations) a device has in flight at
  // most: one slot of page-locked host memory each. Two let the next batch
  // be written and launched while one runs.
  int batches_in_flight = 2;
  // Page-locked host memory through which the CUDA backend moves the tensors
  // whose own memory its devices cannot address (inline request bytes, a
  // region that could not be page-locked). A call that finds too little free
  // gets RESOURCE_EXHAUSTED; an AppendKv larger than all of it,
  // INVALID_ARGUMENT (send it in chunks).
  int64_t pinned_staging_bytes = int64_t{512} << 20;
  // Client shared-memory regions (off unless enabled; limits).
  RegionOptions shared_memory;
  // Device-driven verify steps: lanes, timeouts.
  StepOptions steps;

  // How Validate()'s errors name a setting: field name ("num_heads") -> the
  // name its user set it by ("--heads", filled by the server's main), so an
  // operator reads the flag to fix. A field not in the map is named as the
  // field ("num_heads = 7"); the engine itself knows no flags.
  std::map<std::string, std::string> setting_names;

  int max_draft_len() const { return draft_buckets.empty() ? 0 : draft_buckets.back(); }
  int max_batch() const { return batch_buckets.empty() ? 0 : batch_buckets.back(); }
  int64_t bytes_per_page() const { return int64_t{num_layers} * page_size * KvRowBytes(kv_dtype); }
  int64_t num_pages() const { return pool_bytes / bytes_per_page(); }
  int64_t max_pages_per_sequence() const { return (max_sequence_len + page_size - 1) / page_size; }

  // INVALID_ARGUMENT naming the first bad setting (by `setting_names` where it
  // has one, then as "--heads 7: ..."). `num_devices` is the length
  // of the device list (tensor-parallel mode needs num_heads divisible by it).
  absl::Status Validate(int num_devices = 1) const;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_ENGINE_CONFIG_H_
