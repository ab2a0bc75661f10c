#include "client/demo.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cuda_shared_memory.h"
#include "client/reference_check.h"
#include "client/server_info_text.h"
#include "common/draft_tree.h"
#include "common/geometry.h"
#include "common/workload.h"

namespace mlaverify::client {
namespace {

using mlaverify::kLatentDim;
using mlaverify::kValueDim;

// Value ranges of the random inputs: |q| up to 2 and |kv| up to 1 give scores
// of a few units at the default scale, so the softmax is neither flat nor
// one-hot and a wrong mask or row shows up in the output.
constexpr float kQueryRange = 2.0f;
constexpr float kKvRange = 1.0f;

struct DemoSequence {
  uint64_t id = 0;
  SequenceMirror mirror;
  // The current step: the tree, every layer's draft KV (kept for the mirror's
  // commit) and the current layer's queries.
  std::vector<int32_t> parents;
  std::vector<std::vector<Bf16>> draft_kv;  // [layer][N * 576]
  std::vector<Bf16> q;                      // [N, H, 576] of the layer in flight
  double worst_rel_err = 0.0;
  double worst_lse_err = 0.0;

  DemoSequence(uint64_t sequence_id, int num_layers) : id(sequence_id), mirror(num_layers) {}
};

// Keeps NaN: std::max(a, NaN) would return a and hide the failure.
double WorseOf(double current, double candidate) {
  return (candidate > current || candidate != candidate) ? candidate : current;
}

class DemoRun {
 public:
  DemoRun(VerifyClient& client, const DemoOptions& options)
      : client_(client), options_(options), rng_(options.seed) {}

  DemoSummary Run() {
    if (Setup()) {
      for (int step = 0; step < options_.steps; ++step) {
        if (!Step(step)) break;
      }
    }
    Cleanup();
    summary_.passed = summary_.failures.empty();
    absl::PrintF(
        "\nsummary: %d Verify calls, %d item checks, max rel err %.3e, max lse err "
        "%.3e, %d failure(s): %s\n",
        summary_.verify_calls, summary_.items_checked, summary_.max_rel_err, summary_.max_lse_err,
        summary_.failures.size(), summary_.passed ? "PASS" : "FAIL");
    return std::move(summary_);
  }

 private:
  void Fail(std::string line) {
    absl::PrintF("FAIL: %s\n", line);
    summary_.failures.push_back(std::move(line));
  }

  // Reads the geometry, creates the sequences and appends their prompts.
  bool Setup() {
    absl::StatusOr<v1::ServerInfo> info = client_.GetServerInfo();
    if (!info.ok()) {
      Fail(absl::StrCat("GetServerInfo: ", info.status().ToString()));
      return false;
    }
    info_ = *std::move(info);
    absl::PrintF("server %s: %s\n", client_.target(), ServerInfoSummaryLine(info_));
    if (info_.latent_dim() != kLatentDim || info_.value_dim() != kValueDim) {
      Fail(absl::StrFormat("server geometry latent %d / value %d; this client computes %d / %d",
                           info_.latent_dim(), info_.value_dim(), kLatentDim, kValueDim));
      return false;
    }
    // The reference stores rows as the server's pool does. A server that
    // predates the field sends "": bf16, the only dtype it had.
    if (!info_.kv_dtype().empty() && !ParseKvDtype(info_.kv_dtype().c_str(), &kv_dtype_)) {
      Fail(absl::StrCat("the server stores KV as \"", info_.kv_dtype(),
                        "\", which this client cannot check (bf16, fp8)"));
      return false;
    }
    num_layers_ = info_.num_layers();
    num_heads_ = info_.num_heads();
    num_drafts_ = std::min(options_.drafts, info_.max_draft_len());
    if (num_drafts_ < 1 || num_layers_ < 1 || num_heads_ < 1) {
      Fail(absl::StrFormat("nothing to verify: %d drafts (server max %d), %d layers, %d heads",
                           num_drafts_, info_.max_draft_len(), num_layers_, num_heads_));
      return false;
    }
    if (options_.sequences < 1 || options_.sequences > info_.max_batch()) {
      Fail(
          absl::StrFormat("--sequences %d: one Verify carries every sequence, so it must be "
                          "in 1..%d (the server's max_batch)",
                          options_.sequences, info_.max_batch()));
      return false;
    }
    if (options_.data_plane == "shm") {
      if (!SetupSharedMemory()) return false;
    } else if (options_.data_plane == "cuda-shm") {
      if (!SetupCudaSharedMemory()) return false;
    } else if (options_.data_plane != "inline") {
      Fail(absl::StrCat("--data-plane ", options_.data_plane, ": need inline, shm or cuda-shm"));
      return false;
    }
    scale_ = options_.softmax_scale > 0.0f ? options_.softmax_scale : info_.default_softmax_scale();
    free_pages_before_ = info_.free_pages();
    absl::PrintF(
        "demo: %d sequences, prompt %d tokens, %d steps of %d drafts, %s calls, %s data plane, "
        "softmax scale %.6g, seed %d\n",
        options_.sequences, options_.prompt_len, options_.steps, num_drafts_,
        options_.stream ? "streamed" : "unary", options_.data_plane, scale_, options_.seed);

    for (int s = 0; s < options_.sequences; ++s) {
      absl::StatusOr<uint64_t> id = client_.CreateSequence(absl::StrCat("demo-", s));
      if (!id.ok()) {
        Fail(absl::StrCat("CreateSequence: ", id.status().ToString()));
        return false;
      }
      sequences_.emplace_back(*id, num_layers_);
      DemoSequence& seq = sequences_.back();
      if (options_.prompt_len <= 0) continue;
      std::vector<Bf16> prompt(static_cast<size_t>(num_layers_) * options_.prompt_len * kLatentDim);
      FillUniformBf16(rng_, -kKvRange, kKvRange, absl::MakeSpan(prompt));
      absl::StatusOr<AppendKvResult> appended =
          client_.AppendKv(seq.id, 0, num_layers_, options_.prompt_len, prompt,
                           shm_ != nullptr ? &staging_ : nullptr);
      if (!appended.ok()) {
        Fail(absl::StrCat("AppendKv sequence ", seq.id, ": ", appended.status().ToString()));
        return false;
      }
      seq.mirror.AppendPrompt(prompt, options_.prompt_len);
      absl::PrintF(
          "sequence %d: %d prompt tokens x %d layers (%.1f MiB) in %d AppendKv "
          "message(s)\n",
          seq.id, appended->length, num_layers_,
          static_cast<double>(prompt.size() * sizeof(Bf16)) / (1 << 20), appended->chunks);
      if (appended->length != seq.mirror.length()) {
        Fail(absl::StrFormat("sequence %d: server length %d after AppendKv, client sent %d", seq.id,
                             appended->length, seq.mirror.length()));
        return false;
      }
    }
    if (options_.stream) {
      // Bounds the stream by what the demo can take at worst: every call at
      // its deadline.
      const absl::Duration lifetime =
          client_.options().call_timeout * (static_cast<int64_t>(options_.steps) * num_layers_ + 1);
      absl::StatusOr<std::unique_ptr<VerifyStreamSession>> stream =
          client_.OpenVerifyStream(lifetime);
      if (!stream.ok()) {
        Fail(absl::StrCat("VerifyStream: ", stream.status().ToString()));
        return false;
      }
      stream_ = *std::move(stream);
    }
    absl::PrintF("\n%4s %8s %4s %6s %9s %8s %11s %11s %14s\n", "step", "sequence", "N", "depth",
                 "accepted", "prefix", "rel_err", "lse_err", "verify_ms/layer");
    return true;
  }

  absl::StatusOr<std::vector<VerifyItemResult>> VerifyLayer(
      int layer, absl::Span<const VerifyItemInput> items) {
    if (stream_ != nullptr) return stream_->Verify(layer, items, options_.softmax_scale);
    return client_.Verify(layer, items, options_.softmax_scale);
  }

  // One decode step: a tree per sequence, one Verify per layer carrying every
  // sequence, each answer checked, then a random accepted path committed.
  bool Step(int step) {
    for (DemoSequence& seq : sequences_) {
      seq.parents = RandomDraftTree(rng_, num_drafts_);
      seq.draft_kv.assign(num_layers_, std::vector<Bf16>(num_drafts_ * kLatentDim));
      for (std::vector<Bf16>& layer_kv : seq.draft_kv) {
        FillUniformBf16(rng_, -kKvRange, kKvRange, absl::MakeSpan(layer_kv));
      }
      seq.q.resize(static_cast<size_t>(num_drafts_) * num_heads_ * kLatentDim);
      seq.worst_rel_err = 0.0;
      seq.worst_lse_err = 0.0;
    }
    double verify_seconds = 0.0;
    for (int layer = 0; layer < num_layers_; ++layer) {
      std::vector<VerifyItemInput> items;
      for (size_t k = 0; k < sequences_.size(); ++k) {
        DemoSequence& seq = sequences_[k];
        FillUniformBf16(rng_, -kQueryRange, kQueryRange, absl::MakeSpan(seq.q));
        items.push_back({seq.id, seq.parents, seq.q, seq.draft_kv[layer],
                         placements_.empty() ? nullptr : &placements_[k]});
      }
      const auto start = std::chrono::steady_clock::now();
      absl::StatusOr<std::vector<VerifyItemResult>> results = VerifyLayer(layer, items);
      verify_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      ++summary_.verify_calls;
      if (!results.ok()) {
        Fail(absl::StrFormat("step %d layer %d Verify: %s", step, layer,
                             results.status().ToString()));
        return false;
      }
      for (size_t k = 0; k < sequences_.size(); ++k) {
        DemoSequence& seq = sequences_[k];
        absl::StatusOr<ReferenceComparison> check =
            CompareWithReference(seq.mirror, layer, items[k], scale_, (*results)[k],
                                 options_.reference_threads, kv_dtype_);
        ++summary_.items_checked;
        if (!check.ok()) {
          Fail(absl::StrFormat("step %d layer %d sequence %d: %s", step, layer, seq.id,
                               check.status().ToString()));
          return false;
        }
        seq.worst_rel_err = WorseOf(seq.worst_rel_err, check->rel_err);
        seq.worst_lse_err = WorseOf(seq.worst_lse_err, check->lse_max_abs_err);
        summary_.max_rel_err = WorseOf(summary_.max_rel_err, check->rel_err);
        summary_.max_lse_err = WorseOf(summary_.max_lse_err, check->lse_max_abs_err);
        if (!check->ok(options_.max_rel_err, options_.max_lse_err)) {
          Fail(
              absl::StrFormat("step %d layer %d sequence %d: rel err %.3e (max %.1e), lse err "
                              "%.3e (max %.1e), %d non-finite values",
                              step, layer, seq.id, check->rel_err, options_.max_rel_err,
                              check->lse_max_abs_err, options_.max_lse_err, check->non_finite));
        }
      }
    }
    const double ms_per_layer = 1e3 * verify_seconds / num_layers_;

    for (DemoSequence& seq : sequences_) {
      const std::vector<int32_t> accepted = RandomAcceptedPath(rng_, seq.parents);
      const std::vector<int> depth = NodeDepths(seq.parents);
      const int64_t prefix = seq.mirror.length();
      absl::StatusOr<CommitResult> committed = client_.Commit(seq.id, accepted);
      if (!committed.ok()) {
        Fail(absl::StrFormat("step %d sequence %d Commit [%s]: %s", step, seq.id,
                             absl::StrJoin(accepted, ","), committed.status().ToString()));
        return false;
      }
      seq.mirror.AppendAccepted(seq.draft_kv, accepted);
      absl::PrintF("%4d %8d %4d %6d %9d %8d %11.3e %11.3e %14.3f\n", step, seq.id, num_drafts_,
                   *std::max_element(depth.begin(), depth.end()), accepted.size(), prefix,
                   seq.worst_rel_err, seq.worst_lse_err, ms_per_layer);
      if (committed->length != seq.mirror.length() ||
          committed->accepted_count != static_cast<int>(accepted.size())) {
        Fail(
            absl::StrFormat("step %d sequence %d: Commit of %d drafts answered length %d and "
                            "%d accepted; expected %d and %d",
                            step, seq.id, accepted.size(), committed->length,
                            committed->accepted_count, seq.mirror.length(), accepted.size()));
        return false;
      }
    }
    return true;
  }

  // One region: every sequence's Verify tensors, then a prompt staging area.
  bool SetupSharedMemory() {
    constexpr uint64_t kMaxStaging = uint64_t{64} << 20;
    const uint64_t item = (ShmVerifyItemBytes(num_drafts_, num_heads_) + 255) / 256 * 256;
    const uint64_t token_bytes = static_cast<uint64_t>(num_layers_) * kLatentDim * sizeof(Bf16);
    const uint64_t staging = std::max<uint64_t>(
        token_bytes,
        std::min<uint64_t>(kMaxStaging, static_cast<uint64_t>(options_.prompt_len) * token_bytes));
    absl::StatusOr<std::unique_ptr<SharedMemoryBuffer>> shm =
        SharedMemoryBuffer::Create(item * options_.sequences + staging);
    if (!shm.ok()) {
      Fail(absl::StrCat("shared memory: ", shm.status().ToString()));
      return false;
    }
    shm_ = *std::move(shm);
    shm_name_ = absl::StrCat("mlaverify-demo-", getpid());
    if (absl::Status s =
            client_.RegisterSystemSharedMemory(shm_name_, shm_->key(), 0, shm_->size());
        !s.ok()) {
      Fail(absl::StrCat("RegisterSystemSharedMemory: ", s.ToString()));
      shm_.reset();
      return false;
    }
    shm_registered_ = true;
    for (int k = 0; k < options_.sequences; ++k) {
      placements_.push_back(
          PlaceVerifyItem(shm_name_, shm_->data(), item * k, num_drafts_, num_heads_));
    }
    staging_ = {shm_name_, shm_->data(), item * options_.sequences, staging};
    absl::PrintF("shared memory: %s registered as %s (%d bytes)\n", shm_->key(), shm_name_,
                 shm_->size());
    return true;
  }

  // One device buffer on --cuda-device for every sequence's Verify tensors
  // (q and draft_kv written to it per call, out and lse read back to check
  // them); prompts go inline, and so do the draft rows for an fp8 server,
  // which refuses rows in device memory (it checks them for NaN/Inf on the
  // host before quantizing).
  bool SetupCudaSharedMemory() {
    const uint64_t item = (ShmVerifyItemBytes(num_drafts_, num_heads_) + 255) / 256 * 256;
    absl::StatusOr<std::unique_ptr<CudaSharedMemoryBuffer>> buffer =
        CudaSharedMemoryBuffer::Create(options_.cuda_device, item * options_.sequences);
    if (!buffer.ok()) {
      Fail(absl::StrCat("CUDA shared memory: ", buffer.status().ToString()));
      return false;
    }
    cuda_ = *std::move(buffer);
    shm_name_ = absl::StrCat("mlaverify-demo-cuda-", getpid());
    if (absl::Status s = client_.RegisterCudaSharedMemory(shm_name_, cuda_->ipc_handle(),
                                                          options_.cuda_device, cuda_->size());
        !s.ok()) {
      Fail(absl::StrCat("RegisterCudaSharedMemory: ", s.ToString()));
      cuda_.reset();
      return false;
    }
    shm_registered_ = true;
    for (int k = 0; k < options_.sequences; ++k) {
      placements_.push_back(PlaceVerifyItem(shm_name_, nullptr, item * k, num_drafts_, num_heads_));
      placements_.back().cuda = cuda_.get();
      placements_.back().draft_kv_inline = kv_dtype_ != KvDtype::kBf16;
    }
    absl::PrintF("CUDA shared memory: %d bytes on device %d registered as %s\n", cuda_->size(),
                 options_.cuda_device, shm_name_);
    return true;
  }

  // Closes the stream, releases every sequence and reports the page balance.
  void Cleanup() {
    if (shm_registered_) {
      // Every call has been answered by now, so no call holds the region.
      absl::StatusOr<std::vector<std::string>> gone =
          client_.UnregisterSystemSharedMemory(shm_name_);
      if (!gone.ok())
        Fail(absl::StrCat("UnregisterSystemSharedMemory: ", gone.status().ToString()));
      shm_registered_ = false;
    }
    if (stream_ != nullptr) {
      if (absl::Status closed = stream_->Close(); !closed.ok()) {
        Fail(absl::StrCat("VerifyStream close: ", closed.ToString()));
      }
      stream_.reset();
    }
    int64_t freed = 0;
    for (const DemoSequence& seq : sequences_) {
      absl::StatusOr<int64_t> pages = client_.ReleaseSequence(seq.id);
      if (!pages.ok()) {
        Fail(absl::StrFormat("ReleaseSequence %d: %s", seq.id, pages.status().ToString()));
        continue;
      }
      freed += *pages;
    }
    if (sequences_.empty()) return;
    absl::StatusOr<v1::ServerInfo> after = client_.GetServerInfo();
    if (!after.ok()) {
      Fail(absl::StrCat("GetServerInfo after release: ", after.status().ToString()));
      return;
    }
    // Informational, not a check: other clients of the same server move the
    // free count too. `load` makes it a check.
    absl::PrintF("\nreleased %d sequences (%d pages); free pages %d before, %d after%s\n",
                 sequences_.size(), freed, free_pages_before_, after->free_pages(),
                 after->free_pages() == free_pages_before_ ? "" : " (changed)");
  }

  VerifyClient& client_;
  const DemoOptions options_;
  std::mt19937_64 rng_;
  DemoSummary summary_;
  v1::ServerInfo info_;
  KvDtype kv_dtype_ = KvDtype::kBf16;
  int num_layers_ = 0;
  int num_heads_ = 0;
  int num_drafts_ = 0;
  float scale_ = 0.0f;
  int64_t free_pages_before_ = 0;
  std::vector<DemoSequence> sequences_;
  std::unique_ptr<VerifyStreamSession> stream_;
  // The shared-memory data plane (shm_ null: inline).
  std::unique_ptr<SharedMemoryBuffer> shm_;
  std::string shm_name_;
  bool shm_registered_ = false;
  std::unique_ptr<CudaSharedMemoryBuffer> cuda_;  // the cuda-shm plane's buffer
  std::vector<ShmItemPlacement> placements_;      // by sequence
  ShmStaging staging_;
};

}  // namespace

DemoSummary RunDemo(VerifyClient& client, const DemoOptions& options) {
  return DemoRun(client, options).Run();
}

}  // namespace mlaverify::client
