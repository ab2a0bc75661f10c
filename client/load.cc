#include "client/load.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "client/arrivals.h"
#include "client/cuda_shared_memory.h"
#include "client/replica_set.h"
#include "client/server_info_text.h"
#include "client/shared_memory.h"
#include "client/transport_floor.h"
#include "client/wire.h"
#include "common/geometry.h"
#include "common/status_macros.h"
#include "common/workload.h"
#include "spdlog/spdlog.h"

namespace mlaverify::client {
namespace {

using Clock = std::chrono::steady_clock;
using mlaverify::kLatentDim;

// A worker that fails this many operations in a row (server gone, pool full
// for good) stops instead of spinning on errors until the deadline.
constexpr int kMaxConsecutiveFailures = 100;
// Pause after a failed operation, so a failing server is not hammered.
constexpr auto kFailureBackoff = std::chrono::milliseconds(20);
// After UNAVAILABLE (a server restarting, draining, or not up yet) the
// pause doubles per failure in a row up to a second, so that the 100
// failures a worker may have span about 95 s: a restart is ridden through.
constexpr auto kUnavailableBackoffMax = std::chrono::milliseconds(1000);

std::chrono::milliseconds FailureBackoff(absl::StatusCode code, int consecutive_failures) {
  if (code != absl::StatusCode::kUnavailable) return kFailureBackoff;
  const int doublings = std::min(std::max(consecutive_failures - 1, 0), 6);
  return std::min(kFailureBackoff * (1 << doublings), kUnavailableBackoffMax);
}
// Error bucket for answers with NaN/Inf: not a gRPC code, still a failure.
constexpr char kNonFiniteOutput[] = "NON_FINITE_OUTPUT";

// Whether every value lies within `percent` of their mean (a zero mean
// never does: a window without calls is no measurement).
bool WithinPercent(absl::Span<const double> values, double percent) {
  double mean = 0;
  for (double v : values) mean += v / values.size();
  if (!(mean > 0)) return false;
  for (double v : values) {
    if (std::abs(v - mean) > mean * percent / 100) return false;
  }
  return true;
}

// What every worker reads: the plan, and the bounds of the run.
struct LoadPlan {
  int num_layers = 0;
  int num_heads = 0;
  // Drafts per item and step, and prompt tokens per sequence: drawn
  // uniformly from [low, max] (fixed when equal).
  int num_drafts = 0;
  int num_drafts_max = 0;
  int items = 1;  // sequences per Verify call
  int64_t prompt_len = 0;
  int64_t prompt_len_max = 0;
  int64_t max_sequence_len = 0;
  bool stream = false;
  // Shared-memory data plane: each worker's placement and AppendKv staging
  // (indexed by worker); empty for inline.
  std::vector<ShmItemPlacement> placements;
  std::vector<ShmStaging> stagings;
  // When every stream ends, whenever it was opened; nullopt: never.
  std::optional<Clock::time_point> stream_deadline;
  uint64_t seed = 0;

  Clock::time_point measure_start;
  std::optional<Clock::time_point> deadline;
  // Open loop: Verify calls start at `rate` per second in all, from
  // `rate_origin` on, spaced by `arrivals` (0: closed loop, each worker as
  // fast as answered).
  double rate = 0;
  Clock::time_point rate_origin;
  ArrivalSchedule* arrivals = nullptr;
  int64_t request_limit = 0;  // 0: none
};

// Set by StopRunningLoad (a signal handler): every run from then on ends at
// once, the one in progress as if its time were up. Lock-free, so the
// handler touches nothing that may go away under it.
std::atomic<bool> g_stop_requested{false};
static_assert(std::atomic<bool>::is_always_lock_free);

class RunControl {
 public:
  explicit RunControl(const LoadPlan& plan) : plan_(plan) {}

  // The ramp-up: every worker first gets its sequence (prompt appended, or
  // given up after its failures), then waits here until RunLoad has seen all
  // of them ready and set the run's clock (Start). The prompts' uploads are
  // megabytes each and share the channel with the Verify calls: timed, the
  // first steps' Verify calls waited behind other workers' uploads (a 453 ms
  // maximum against a 13 ms p99.9 on the H200; bench/NOTES.md, "Prompt uploads
  // on the Verify channel").
  void WorkerReady() {
    absl::MutexLock lock(&mu_);
    ++ready_;
  }
  // Whether every worker was ready within `timeout`.
  bool AwaitAllReadyFor(int workers, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    const auto all_ready = [this, workers]()
                               ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ready_ >= workers; };
    return mu_.AwaitWithTimeout(absl::Condition(&all_ready), timeout);
  }
  int ready() {
    absl::MutexLock lock(&mu_);
    return ready_;
  }
  void AwaitStart() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&started_));
  }
  // Releases the workers; `plan`'s clock fields are written before this and
  // read by the workers only after AwaitStart (ordered by mu_).
  void Start() {
    absl::MutexLock lock(&mu_);
    started_ = true;
  }

  // Called before each Verify. False when the run is over; otherwise sets
  // `measured` to whether the call counts (it starts after the warm-up and,
  // with a request bound, got one of the measured slots) and `start` to the
  // time its latency counts from: now, or with a rate the call's slot in the
  // schedule (waited for; a call that starts after its slot because every
  // worker was busy counts from the slot, so the latency includes the wait).
  bool BeginVerify(bool* measured, Clock::time_point* start) {
    if (stopped()) return false;
    Clock::time_point now = Clock::now();
    if (plan_.rate > 0) {
      const Clock::time_point due =
          plan_.rate_origin + std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(plan_.arrivals->Next()));
      // The run ends at its deadline, also with slots still owed (a server
      // that fell behind leaves a backlog; it is not worked off).
      if (plan_.deadline.has_value() && (due >= *plan_.deadline || now >= *plan_.deadline)) {
        Stop();
        return false;
      }
      if (due > now) {
        // In short sleeps, so that a stop is seen within 10 ms even when
        // the slot is far ahead (a low rate with many workers).
        while (Clock::now() < due) {
          if (stopped()) return false;
          std::this_thread::sleep_until(
              std::min(due, Clock::now() + std::chrono::milliseconds(10)));
        }
      } else if (now - due > std::chrono::milliseconds(1)) {
        late_.fetch_add(1, std::memory_order_relaxed);
      }
      now = due;
    }
    *start = now;
    if (plan_.deadline.has_value() && now >= *plan_.deadline) {
      Stop();
      return false;
    }
    *measured = now >= plan_.measure_start;
    if (*measured && plan_.request_limit > 0 &&
        issued_.fetch_add(1, std::memory_order_relaxed) >= plan_.request_limit) {
      Stop();
      return false;
    }
    return true;
  }

  bool stopped() const {
    return stop_.load(std::memory_order_relaxed) ||
           g_stop_requested.load(std::memory_order_relaxed);
  }
  // Totals for the progress line and the stability windows.
  void CountCall(int items, double ms) {
    calls_.fetch_add(1, std::memory_order_relaxed);
    items_.fetch_add(items, std::memory_order_relaxed);
    latency_ns_.fetch_add(static_cast<int64_t>(ms * 1e6), std::memory_order_relaxed);
  }
  // For the ramp-up's progress lines: workers whose prompt data is made (a
  // long prompt takes seconds to generate before any byte is sent), prompt
  // bytes the server accepted (per AppendKv chunk, so a long prompt shows as
  // it goes) and whole prompts appended.
  void CountPromptMade() { prompts_made_.fetch_add(1, std::memory_order_relaxed); }
  void CountAppendedBytes(int64_t bytes) { appended_.fetch_add(bytes, std::memory_order_relaxed); }
  void CountPromptAppended() { prompts_.fetch_add(1, std::memory_order_relaxed); }
  int64_t prompts_made() const { return prompts_made_.load(std::memory_order_relaxed); }
  int64_t appended_bytes() const { return appended_.load(std::memory_order_relaxed); }
  int64_t prompts_appended() const { return prompts_.load(std::memory_order_relaxed); }
  // Sum of the measured calls' latencies so far, ms.
  double latency_ms_sum() const { return latency_ns_.load(std::memory_order_relaxed) / 1e6; }
  void CountError() { errors_.fetch_add(1, std::memory_order_relaxed); }
  int64_t calls() const { return calls_.load(std::memory_order_relaxed); }
  int64_t items() const { return items_.load(std::memory_order_relaxed); }
  int64_t errors() const { return errors_.load(std::memory_order_relaxed); }
  // With a rate: calls that started over 1 ms after their slot.
  int64_t late_starts() const { return late_.load(std::memory_order_relaxed); }
  void Stop() { stop_.store(true, std::memory_order_relaxed); }

 private:
  const LoadPlan& plan_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> issued_{0};
  std::atomic<int64_t> calls_{0}, items_{0}, errors_{0}, latency_ns_{0}, appended_{0}, prompts_{0},
      prompts_made_{0};
  std::atomic<int64_t> late_{0};
  absl::Mutex mu_;
  int ready_ ABSL_GUARDED_BY(mu_) = 0;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
};

struct WorkerResult {
  std::vector<double> latencies_ms;
  // When each of those calls started, seconds after the measured window
  // opened (same order); and when each failure after the ramp-up happened.
  std::vector<double> started_s;
  std::vector<double> error_s;
  // Each measured call's layer and its first sequence's length (same order):
  // the report names the slowest call of the reported window, which with
  // stability windows is not the whole measured period.
  std::vector<int32_t> layers;
  std::vector<int64_t> sequence_lens;
  std::vector<int32_t> call_drafts;  // drafts of all the call's items
  // Whole decode steps (every layer and the commits): how long each took,
  // when it started (as above) and the tokens it added to its sequences.
  std::vector<double> step_ms;
  std::vector<double> step_started_s;
  std::vector<int64_t> step_tokens;
  int64_t steps_committed = 0;
  int64_t sequences_created = 0;
  int64_t append_bytes = 0;
  double append_seconds = 0.0;
  int64_t ramp_up_append_bytes = 0;
  std::optional<Clock::time_point> first_append_start, last_append_end;  // in the ramp-up
  std::map<std::string, int64_t> errors;
  std::map<std::string, std::map<std::string, int64_t>> errors_by_rpc;
  std::string first_error;  // "RPC: status" of the first counted failure
  // Failed calls whose replica was down by then, per replica (several
  // targets only: the run goes on with the other replicas).
  std::map<int, int64_t> lost_replica_errors;
  std::map<int, std::string> first_lost_error;
  // Sequences the worker could not (or did not get to) release.
  std::vector<PlacedSequence> unreleased;
};

class LoadWorker {
 public:
  LoadWorker(ReplicaSet& replicas, const LoadPlan& plan, RunControl& control, int index)
      : replicas_(replicas),
        plan_(plan),
        control_(control),
        index_(index),
        rng_(plan.seed + 0x9e3779b97f4a7c15ull * (index + 1)) {}

  WorkerResult Run() {
    // The server never looks at the values, so one random set per worker is
    // reused for every call: the client's CPU goes to sending, not to rand().
    // A prompt repeats a random block (FillPrompt): drawn value by value, 61
    // layers of 2,000 tokens took 8 workers 10 s on 2 cores.
    if (plan_.prompt_len_max > 0) {
      // Made once for the longest prompt; a shorter one sends its first part.
      const size_t values =
          static_cast<size_t>(plan_.num_layers) * plan_.prompt_len_max * kLatentDim;
      const ShmStaging* staging = plan_.stagings.empty() ? nullptr : &plan_.stagings[index_];
      if (staging != nullptr && values * sizeof(Bf16) <= staging->bytes) {
        // Made where the append reads it: the call carries a reference only.
        auto* in_place = reinterpret_cast<Bf16*>(staging->base + staging->offset);
        FillPrompt(absl::MakeSpan(in_place, values));
        prompt_view_ = absl::MakeConstSpan(in_place, values);
      } else {
        prompt_.resize(values);
        FillPrompt(absl::MakeSpan(prompt_));
        prompt_view_ = prompt_;
      }
    }
    control_.CountPromptMade();
    // For the largest tree; a smaller one sends the first rows.
    q_.resize(static_cast<size_t>(plan_.num_drafts_max) * plan_.num_heads * kLatentDim);
    FillUniformBf16(rng_, -2.0f, 2.0f, absl::MakeSpan(q_));
    draft_kv_.resize(static_cast<size_t>(plan_.num_drafts_max) * kLatentDim);
    FillUniformBf16(rng_, -1.0f, 1.0f, absl::MakeSpan(draft_kv_));
    // Every item of a call gets the same inputs; with shared memory each has
    // its own placement (outputs may not overlap), the inputs copied in once,
    // as a co-located scheduler would make them there.
    for (int k = 0; k < plan_.items; ++k) {
      absl::Span<const Bf16> q = q_, kv = draft_kv_;
      const ShmItemPlacement* place = nullptr;
      if (!plan_.placements.empty() && plan_.placements[0].cuda != nullptr) {
        // Written to the device once; every call references them there.
        place = &plan_.placements[static_cast<size_t>(index_) * plan_.items + k];
        const absl::Status wrote =
            place->cuda->Write(place->q_offset, q_.data(), q_.size() * sizeof(Bf16));
        const absl::Status wrote_kv = place->cuda->Write(place->draft_kv_offset, draft_kv_.data(),
                                                         draft_kv_.size() * sizeof(Bf16));
        if (!wrote.ok() || !wrote_kv.ok()) {
          RecordError("CudaSharedMemory", !wrote.ok() ? wrote : wrote_kv);
        }
      } else if (!plan_.placements.empty()) {
        place = &plan_.placements[static_cast<size_t>(index_) * plan_.items + k];
        auto* q_shm = reinterpret_cast<Bf16*>(place->base + place->q_offset);
        auto* kv_shm = reinterpret_cast<Bf16*>(place->base + place->draft_kv_offset);
        std::copy(q_.begin(), q_.end(), q_shm);
        std::copy(draft_kv_.begin(), draft_kv_.end(), kv_shm);
        q = absl::MakeConstSpan(q_shm, q_.size());
        kv = absl::MakeConstSpan(kv_shm, draft_kv_.size());
      }
      item_inputs_.push_back({0, {}, q, kv, place});
      item_full_.push_back({q, kv});
    }

    // Ramp-up (untimed): this worker's first sequences, or its failures up
    // to the limit, before the run's clock starts.
    while (group_.empty() && consecutive_failures_ < kMaxConsecutiveFailures) StartGroup();
    result_.ramp_up_append_bytes = result_.append_bytes;
    ramped_up_ = true;
    control_.WorkerReady();
    control_.AwaitStart();

    while (!control_.stopped()) {
      if (consecutive_failures_ >= kMaxConsecutiveFailures) {
        spdlog::warn("load worker {}: {} operations failed in a row; stopping this worker", index_,
                     consecutive_failures_);
        break;
      }
      if (group_.empty() && !StartGroup()) continue;
      if (!RunStep()) break;
    }
    for (const PlacedSequence& seq : group_) result_.unreleased.push_back(seq);
    if (stream_ != nullptr) {
      // Errors past the end of the run (e.g. the stream's own deadline) are
      // not the server's fault; the stream is only being put away.
      stream_->Close().IgnoreError();
    }
    return std::move(result_);
  }

 private:
  // `replica`: the replica the failed call went to (-1: none, e.g. no
  // replica was up to create a sequence on).
  void RecordError(const char* rpc, const absl::Status& status, int replica = -1) {
    if (replicas_.size() > 1 && replica >= 0 && !replicas_.CheckUp(replica).ok()) {
      // Its replica is gone; the next sequence goes to another one.
      if (result_.lost_replica_errors[replica]++ == 0) {
        result_.first_lost_error[replica] = status.ToString();
      }
      return;
    }
    ++result_.errors[absl::StatusCodeToString(status.code())];
    ++result_.errors_by_rpc[rpc][absl::StatusCodeToString(status.code())];
    if (result_.first_error.empty())
      result_.first_error = absl::StrCat(rpc, ": ", status.ToString());
    control_.CountError();
    // (The clock is set only once the ramp-up is over.)
    if (ramped_up_) {
      result_.error_s.push_back(
          std::chrono::duration<double>(Clock::now() - plan_.measure_start).count());
    }
    ++consecutive_failures_;
    if (consecutive_failures_ == 1) {
      spdlog::warn("load worker {}: {}", index_, status.ToString());
    }
    // Slept in slices, so that a run that ends meanwhile is not held.
    const Clock::time_point until =
        Clock::now() + FailureBackoff(status.code(), consecutive_failures_);
    while (Clock::now() < until && !control_.stopped()) {
      std::this_thread::sleep_for(
          std::min<Clock::duration>(until - Clock::now(), std::chrono::milliseconds(20)));
    }
  }

  // The worker's `items` sequences, each with its prompt. With several items
  // there is one target (RunLoad checks), so all of them share a replica.
  bool StartGroup() {
    for (int k = 0; k < plan_.items; ++k) {
      absl::StatusOr<PlacedSequence> placed =
          replicas_.CreateSequence(absl::StrCat("load-", index_));
      if (!placed.ok()) {
        RecordError("CreateSequence", placed.status());
        DropGroup();
        return false;
      }
      ++result_.sequences_created;
      group_.push_back(*placed);
      lengths_.push_back(0);
      const int64_t prompt_len = Draw(plan_.prompt_len, plan_.prompt_len_max);
      if (prompt_len == 0) continue;
      const absl::Span<const Bf16> prompt =
          prompt_view_.first(static_cast<size_t>(plan_.num_layers) * prompt_len * kLatentDim);
      const int64_t token_bytes = int64_t{plan_.num_layers} * kLatentDim * sizeof(Bf16);
      const Clock::time_point start = Clock::now();
      absl::StatusOr<AppendKvResult> appended =
          replicas_.AppendKv(*placed, 0, plan_.num_layers, prompt_len, prompt,
                             plan_.stagings.empty() ? nullptr : &plan_.stagings[index_],
                             [this, token_bytes](int64_t tokens) {
                               control_.CountAppendedBytes(tokens * token_bytes);
                             });
      const Clock::time_point end = Clock::now();
      result_.append_seconds += std::chrono::duration<double>(end - start).count();
      if (!ramped_up_) {
        if (!result_.first_append_start.has_value()) result_.first_append_start = start;
        result_.last_append_end = end;
      }
      if (!appended.ok()) {
        RecordError("AppendKv", appended.status(), placed->replica);
        DropGroup();
        return false;
      }
      result_.append_bytes += static_cast<int64_t>(prompt.size() * sizeof(Bf16));
      control_.CountPromptAppended();
      lengths_.back() = appended->length;
    }
    return true;
  }

  // Releases the current sequences after a failure left their state
  // unknown. A sequence the server no longer knows is gone already; any other
  // failure leaves it for the final release.
  void DropGroup() {
    for (const PlacedSequence& seq : group_) {
      // A sequence of a replica that is down went with it.
      if (!replicas_.CheckUp(seq.replica).ok()) continue;
      absl::StatusOr<int64_t> freed = replicas_.ReleaseSequence(seq);
      if (!freed.ok() && freed.status().code() != absl::StatusCode::kNotFound) {
        RecordError("ReleaseSequence", freed.status(), seq.replica);
        result_.unreleased.push_back(seq);
      }
    }
    group_.clear();
    lengths_.clear();
  }

  absl::StatusOr<std::vector<VerifyItemResult>> VerifyLayer(
      int layer, absl::Span<const VerifyItemInput> items) {
    const int owner = group_.front().replica;
    if (!plan_.stream) return replicas_.Verify(owner, layer, items);
    RETURN_IF_ERROR(replicas_.CheckUp(owner));
    if (stream_ != nullptr && stream_replica_ != owner) {
      stream_->Close().IgnoreError();  // the new sequences live elsewhere
      stream_.reset();
    }
    if (stream_ == nullptr) {
      const absl::Duration lifetime = plan_.stream_deadline.has_value()
                                          ? absl::FromChrono(*plan_.stream_deadline - Clock::now())
                                          : absl::InfiniteDuration();
      absl::StatusOr<std::unique_ptr<VerifyStreamSession>> opened =
          replicas_.replica(owner).OpenVerifyStream(lifetime);
      if (!opened.ok()) return replicas_.Observe(owner, opened.status());
      stream_ = *std::move(opened);
      stream_replica_ = owner;
    }
    absl::StatusOr<std::vector<VerifyItemResult>> results = stream_->Verify(layer, items);
    if (!results.ok()) return replicas_.Observe(owner, results.status());
    return results;
  }

  // One verify step of the worker's sequences (a tree each, every layer in
  // one call per layer). False when the run is over.
  bool RunStep() {
    const int items = static_cast<int>(group_.size());
    std::vector<std::vector<int32_t>> parents(items);
    int32_t call_drafts = 0;
    for (int k = 0; k < items; ++k) {
      const int n = static_cast<int>(Draw(plan_.num_drafts, plan_.num_drafts_max));
      call_drafts += n;
      parents[k] = RandomDraftTree(rng_, n);
      item_inputs_[k].sequence_id = group_[k].id;
      item_inputs_[k].parents = parents[k];
      item_inputs_[k].q =
          item_full_[k].q.first(static_cast<size_t>(n) * plan_.num_heads * kLatentDim);
      item_inputs_[k].draft_kv = item_full_[k].draft_kv.first(static_cast<size_t>(n) * kLatentDim);
    }
    const absl::Span<const VerifyItemInput> call(item_inputs_.data(), items);
    bool step_measured = false;
    Clock::time_point step_start;
    for (int layer = 0; layer < plan_.num_layers; ++layer) {
      bool measured = false;
      Clock::time_point start;
      if (!control_.BeginVerify(&measured, &start)) return false;
      if (layer == 0) {
        // Closed loop only: with --rate every layer waits for its own slot,
        // so a step's span would measure the pacing, not the server.
        step_measured = measured && plan_.rate == 0;
        step_start = start;
      }
      absl::StatusOr<std::vector<VerifyItemResult>> results = VerifyLayer(layer, call);
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
      if (!results.ok()) {
        RecordError(plan_.stream ? "VerifyStream" : "Verify", results.status(),
                    group_.front().replica);
        // A stream that failed may be broken; a fresh one costs little.
        stream_.reset();
        DropGroup();
        return true;
      }
      for (const VerifyItemResult& r : *results) {
        const bool finite =
            std::all_of(r.out.begin(), r.out.end(),
                        [](Bf16 v) { return std::isfinite(Bf16ToFloat(v)); }) &&
            std::all_of(r.lse.begin(), r.lse.end(), [](float v) { return std::isfinite(v); });
        if (!finite) {
          ++result_.errors[kNonFiniteOutput];
          if (result_.first_error.empty()) {
            result_.first_error = absl::StrCat(kNonFiniteOutput, ": an answer with NaN or Inf");
          }
        }
      }
      if (measured) {
        result_.latencies_ms.push_back(ms);
        result_.started_s.push_back(
            std::chrono::duration<double>(start - plan_.measure_start).count());
        result_.layers.push_back(layer);
        result_.sequence_lens.push_back(lengths_.front());
        result_.call_drafts.push_back(call_drafts);
        control_.CountCall(items, ms);
      }
    }
    bool full = false;
    int64_t tokens = 0;
    for (int k = 0; k < items; ++k) {
      const std::vector<int32_t> accepted = RandomAcceptedPath(rng_, parents[k]);
      tokens += static_cast<int64_t>(accepted.size()) + 1;
      absl::StatusOr<CommitResult> committed = replicas_.Commit(group_[k], accepted);
      if (!committed.ok()) {
        RecordError("Commit", committed.status(), group_[k].replica);
        DropGroup();
        return true;
      }
      lengths_[k] = committed->length;
      full = full || lengths_[k] + plan_.num_drafts_max > plan_.max_sequence_len;
    }
    consecutive_failures_ = 0;
    result_.steps_committed += items;
    if (step_measured) {
      result_.step_ms.push_back(
          std::chrono::duration<double, std::milli>(Clock::now() - step_start).count());
      result_.step_started_s.push_back(
          std::chrono::duration<double>(step_start - plan_.measure_start).count());
      result_.step_tokens.push_back(tokens);
    }
    if (full) {
      for (const PlacedSequence& seq : group_) {
        absl::StatusOr<int64_t> freed = replicas_.ReleaseSequence(seq);
        if (!freed.ok()) {
          RecordError("ReleaseSequence", freed.status(), seq.replica);
          result_.unreleased.push_back(seq);
        }
      }
      group_.clear();
      lengths_.clear();
    }
    return true;
  }

  // Uniform draws from [-1, 1] for the first kPromptBlock values, then that
  // block over and over. Its length is no multiple of a token's 576 values,
  // so tokens do not repeat with it.
  static constexpr size_t kPromptBlock = size_t{1} << 20;
  void FillPrompt(absl::Span<Bf16> values) {
    const size_t block = std::min(values.size(), kPromptBlock);
    FillUniformBf16(rng_, -1.0f, 1.0f, values.first(block));
    for (size_t at = block; at < values.size(); at += block) {
      std::copy_n(values.begin(), std::min(block, values.size() - at), values.begin() + at);
    }
  }

  // A value of [low, high], uniformly (low when the range is one value).
  int64_t Draw(int64_t low, int64_t high) {
    if (high <= low) return low;
    return std::uniform_int_distribution<int64_t>(low, high)(rng_);
  }

  ReplicaSet& replicas_;
  const LoadPlan& plan_;
  RunControl& control_;
  const int index_;
  std::mt19937_64 rng_;
  std::vector<Bf16> prompt_;            // [num_layers, prompt_len, 576]
  absl::Span<const Bf16> prompt_view_;  // prompt_, or the prompt made in shared memory
  bool ramped_up_ = false;
  std::vector<Bf16> q_;         // [N, H, 576]
  std::vector<Bf16> draft_kv_;  // [N, 576]
  std::unique_ptr<VerifyStreamSession> stream_;
  int stream_replica_ = -1;  // the replica stream_ is open to
  // The inputs of one call's items (the ids, trees and tensor spans set per
  // step) and each item's tensors for the largest tree.
  std::vector<VerifyItemInput> item_inputs_;
  struct FullInputs {
    absl::Span<const Bf16> q, draft_kv;
  };
  std::vector<FullInputs> item_full_;
  std::vector<PlacedSequence> group_;  // the live sequences, items of every call
  std::vector<int64_t> lengths_;       // their committed lengths
  int consecutive_failures_ = 0;
  WorkerResult result_;
};

}  // namespace

void StopRunningLoad() { g_stop_requested.store(true); }

bool LoadStopRequested() { return g_stop_requested.load(); }

absl::StatusOr<LoadReport> RunLoad(ReplicaSet& replicas, const LoadOptions& options) {
  if (options.concurrency < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--concurrency ", options.concurrency, ": need at least 1"));
  }
  if (!(options.rate >= 0) || options.rate > 1e7) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rate ", options.rate, ": need 0 (closed loop) or a rate up to 1e7 calls/s"));
  }
  const bool stability = options.stability_percent > 0;
  if (!stability && options.duration_s <= 0 && options.requests <= 0) {
    return absl::InvalidArgumentError(
        "the load needs an end: give --duration-s > 0, --requests > 0, --stability-percent > 0, "
        "or several");
  }
  if (stability && (!(options.stability_percent <= 100) || !(options.window_s > 0) ||
                    options.max_windows < kStableWindows || options.max_windows > 1000)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--stability-percent %g, --window-s %g, --max-windows %d: need a percentage in (0, 100], "
        "a window > 0 s and %d..1000 windows",
        options.stability_percent, options.window_s, options.max_windows, kStableWindows));
  }
  for (double p : options.percentiles) {
    if (!(p > 0 && p <= 100)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("--percentile %g: need a percentile in (0, 100]", p));
    }
  }
  if (options.drafts < 1 || options.prompt_len < 0 || options.warmup_s < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--drafts %d, --prompt-len %d, --warmup-s %g: need drafts >= 1 and the others >= 0",
        options.drafts, options.prompt_len, options.warmup_s));
  }
  if ((options.prompt_len_max != 0 && options.prompt_len_max < options.prompt_len) ||
      (options.drafts_max != 0 && options.drafts_max < options.drafts)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--prompt-len %d:%d, --drafts %d:%d: a range's upper end may not be below its lower end",
        options.prompt_len, options.prompt_len_max, options.drafts, options.drafts_max));
  }
  ASSIGN_OR_RETURN(const ArrivalProcess arrivals, ParseArrivalProcess(options.arrivals));
  if (arrivals != ArrivalProcess::kConstant && options.rate <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--arrivals ", options.arrivals, " spaces an open loop's calls: it needs --rate > 0"));
  }
  if (options.burst_size < 1 || options.burst_size > 1000000) {
    return absl::InvalidArgumentError(
        absl::StrCat("--burst-size ", options.burst_size, ": need 1..1000000 calls"));
  }
  // Every replica must answer at the start and serve the same geometry.
  std::vector<v1::ServerInfo> infos;
  std::vector<std::string> targets;
  for (int r = 0; r < replicas.size(); ++r) {
    absl::StatusOr<v1::ServerInfo> replica_info = replicas.replica(r).GetServerInfo();
    if (!replica_info.ok()) {
      return absl::Status(replica_info.status().code(),
                          absl::StrCat(replicas.Name(r), ": ", replica_info.status().message()));
    }
    if (!infos.empty() && (replica_info->num_layers() != infos[0].num_layers() ||
                           replica_info->num_heads() != infos[0].num_heads() ||
                           replica_info->max_draft_len() != infos[0].max_draft_len())) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "%s serves %d layers, %d heads, N <= %d; %s serves %d, %d, %d", replicas.Name(r),
          replica_info->num_layers(), replica_info->num_heads(), replica_info->max_draft_len(),
          replicas.Name(0), infos[0].num_layers(), infos[0].num_heads(), infos[0].max_draft_len()));
    }
    infos.push_back(*std::move(replica_info));
    targets.push_back(replicas.replica(r).target());
  }
  const v1::ServerInfo& info = infos[0];

  LoadReport report;
  report.target = absl::StrJoin(targets, ",");
  report.options = options;
  report.num_layers = info.num_layers();
  report.num_heads = info.num_heads();
  report.num_drafts = std::min(options.drafts, info.max_draft_len());
  report.num_drafts_max =
      std::min(std::max(options.drafts, options.drafts_max), info.max_draft_len());
  for (int r = 0; r < replicas.size(); ++r) {
    LoadReport::Replica replica;
    replica.target = targets[r];
    replica.free_pages_before = infos[r].free_pages();
    report.free_pages_before += infos[r].free_pages();
    report.replicas.push_back(replica);
  }

  LoadPlan plan;
  plan.num_layers = info.num_layers();
  plan.num_heads = info.num_heads();
  plan.num_drafts = report.num_drafts;
  plan.num_drafts_max = report.num_drafts_max;
  plan.items = options.items;
  if (options.items < 1 || options.items > info.max_batch()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--items %d: need 1..%d (the server's max_batch)", options.items, info.max_batch()));
  }
  if (options.items > 1 && replicas.size() > 1) {
    return absl::InvalidArgumentError(
        "--items above 1 takes one target: the items of a call must live on one replica");
  }
  plan.prompt_len = options.prompt_len;
  plan.prompt_len_max = std::max(options.prompt_len, options.prompt_len_max);
  plan.max_sequence_len =
      options.max_sequence_len > 0 ? options.max_sequence_len : plan.prompt_len_max + 512;
  if (info.max_sequence_len() > 0) {
    plan.max_sequence_len = std::min(plan.max_sequence_len, info.max_sequence_len());
  }
  if (plan.num_drafts < 1 || plan.num_layers < 1 || plan.num_heads < 1) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "server geometry leaves nothing to verify: max_draft_len %d, %d layers, %d heads",
        info.max_draft_len(), info.num_layers(), info.num_heads()));
  }
  if (plan.max_sequence_len < plan.prompt_len_max + plan.num_drafts_max) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sequence length budget %d cannot hold the longest prompt (%d) and one step (%d drafts)",
        plan.max_sequence_len, plan.prompt_len_max, plan.num_drafts_max));
  }
  plan.stream = options.stream;
  plan.seed = options.seed;

  // Every worker's first sequences must fit before the ramp-up starts:
  // without this check a pool too small for them showed only as workers
  // retrying their prompt uploads until they gave up.
  {
    const int64_t sequences = int64_t{options.concurrency} * options.items;
    // (Ranges at their upper ends: the run may draw them.)
    const int64_t tokens = plan.prompt_len_max + plan.num_drafts_max;
    int64_t free_pages = 0, total_pages = 0, live_room = 0;
    bool live_limited = true;
    for (const v1::ServerInfo& i : infos) {
      free_pages += i.free_pages();
      total_pages += i.total_pages();
      if (i.max_live_sequences() > 0) {
        live_room += std::max<int64_t>(0, i.max_live_sequences() - i.live_sequences());
      } else {
        live_limited = false;
      }
    }
    if (info.page_size() > 0) {
      const int64_t pages_each = (tokens + info.page_size() - 1) / info.page_size();
      if (sequences * pages_each > free_pages) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "the pool cannot hold the run's first sequences: %d workers x %d items = %d "
            "sequences of %d tokens (prompt %d + %d drafts) need %d pages of %d tokens (%d "
            "each); the server%s %d free of %d. Lower --concurrency, --items or --prompt-len",
            options.concurrency, options.items, sequences, tokens, plan.prompt_len_max,
            plan.num_drafts_max, sequences * pages_each, info.page_size(), pages_each,
            infos.size() > 1 ? "s have" : " has", free_pages, total_pages));
      }
      // Sequences grow to max_sequence_len before they are replaced; a pool
      // that holds the first steps but not that is worth a warning only
      // (releases and the server's own limits decide what happens then).
      const int64_t pages_at_max =
          (plan.max_sequence_len + info.page_size() - 1) / info.page_size();
      if (sequences * pages_at_max > free_pages) {
        absl::FPrintF(stderr,
                      "load: warning: %d sequences at up to %d tokens may need %d pages; %d are "
                      "free (calls will fail RESOURCE_EXHAUSTED if they do)\n",
                      sequences, plan.max_sequence_len, sequences * pages_at_max, free_pages);
      }
    }
    if (live_limited && sequences > live_room) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%d workers x %d items = %d sequences, but the server%s room for %d more live "
          "sequences (--max-live-sequences)",
          options.concurrency, options.items, sequences, infos.size() > 1 ? "s have" : " has",
          live_room));
    }
  }

  // The shared-memory data plane: one region for the whole run, registered
  // under the same name on every target; removed again however the run ends.
  std::unique_ptr<SharedMemoryBuffer> shm;
  std::unique_ptr<CudaSharedMemoryBuffer> cuda;  // the cuda-shm plane's buffer
  const std::string shm_name = absl::StrCat("mlaverify-load-", getpid());
  struct Unregister {
    ReplicaSet& replicas;
    const std::string& name;
    int registered = 0;
    ~Unregister() {
      for (int r = 0; r < registered; ++r) {
        const absl::Status gone = UnregisterWhenReleased(replicas.replica(r), name, /*cuda=*/false);
        if (!gone.ok()) {
          spdlog::warn("{}: unregistering shared memory '{}': {}", replicas.Name(r), name,
                       gone.ToString());
        }
      }
    }
  } unregister{replicas, shm_name};
  if (options.data_plane == "shm") {
    const uint64_t staging =
        PromptStagingBytes(plan.num_layers, plan.prompt_len_max, options.shm_staging_bytes);
    const uint64_t item =
        (ShmVerifyItemBytes(plan.num_drafts_max, plan.num_heads) + 255) / 256 * 256;
    const uint64_t items = item * static_cast<uint64_t>(plan.items);
    const uint64_t per_worker = items + (staging + 255) / 256 * 256;
    ASSIGN_OR_RETURN(shm, SharedMemoryBuffer::Create(per_worker * options.concurrency));
    for (int w = 0; w < options.concurrency; ++w) {
      const uint64_t base = per_worker * w;
      for (int k = 0; k < plan.items; ++k) {
        plan.placements.push_back(PlaceVerifyItem(shm_name, shm->data(), base + item * k,
                                                  plan.num_drafts_max, plan.num_heads));
      }
      plan.stagings.push_back({shm_name, shm->data(), base + items, staging});
    }
    for (int r = 0; r < replicas.size(); ++r) {
      absl::Status registered =
          replicas.replica(r).RegisterSystemSharedMemory(shm_name, shm->key(), 0, shm->size());
      if (!registered.ok()) {
        return absl::Status(
            registered.code(),
            absl::StrCat(replicas.Name(r), ": registering shared memory: ", registered.message()));
      }
      ++unregister.registered;
    }
  } else if (options.data_plane == "cuda-shm") {
    // One device buffer: every worker's items' placements. Inputs written
    // once and referenced where they are, outputs left on the device (as a
    // scheduler on the GPU uses them); prompts go inline.
    const uint64_t item =
        (ShmVerifyItemBytes(plan.num_drafts_max, plan.num_heads) + 255) / 256 * 256;
    ASSIGN_OR_RETURN(cuda, CudaSharedMemoryBuffer::Create(
                               options.cuda_device,
                               item * static_cast<uint64_t>(plan.items) * options.concurrency));
    for (int w = 0; w < options.concurrency; ++w) {
      for (int k = 0; k < plan.items; ++k) {
        const uint64_t base = item * (static_cast<uint64_t>(w) * plan.items + k);
        plan.placements.push_back(
            PlaceVerifyItem(shm_name, nullptr, base, plan.num_drafts_max, plan.num_heads));
        ShmItemPlacement& p = plan.placements.back();
        p.cuda = cuda.get();
        p.inputs_in_place = true;
        p.read_back = false;
      }
    }
    for (int r = 0; r < replicas.size(); ++r) {
      absl::Status registered = replicas.replica(r).RegisterCudaSharedMemory(
          shm_name, cuda->ipc_handle(), options.cuda_device, cuda->size());
      if (!registered.ok()) {
        return absl::Status(registered.code(),
                            absl::StrCat(replicas.Name(r), ": registering CUDA shared memory: ",
                                         registered.message()));
      }
      ++unregister.registered;
    }
  } else if (options.data_plane != "inline") {
    return absl::InvalidArgumentError(
        absl::StrCat("--data-plane ", options.data_plane, ": need inline, shm or cuda-shm"));
  }

  for (int r = 0; r < replicas.size(); ++r) {
    absl::PrintF("server %s: %s\n", targets[r], ServerInfoSummaryLine(infos[r]));
  }
  const auto range_text = [](int64_t low, int64_t high) {
    return high > low ? absl::StrCat(low, "..", high) : absl::StrCat(low);
  };
  absl::PrintF(
      "load: %d workers x %d items per call, %s after %.1f s warm-up, N=%s, prompt %s, "
      "sequences up to %d tokens, %s calls, %s data plane%s\n",
      options.concurrency, options.items,
      options.duration_s > 0 && options.requests > 0
          ? absl::StrFormat("%.1f s or %d calls", options.duration_s, options.requests)
      : options.duration_s > 0 ? absl::StrFormat("%.1f s", options.duration_s)
                               : absl::StrFormat("%d calls", options.requests),
      options.warmup_s, range_text(plan.num_drafts, plan.num_drafts_max),
      range_text(plan.prompt_len, plan.prompt_len_max), plan.max_sequence_len,
      options.stream ? "streamed" : "unary", options.data_plane,
      options.rate > 0
          ? absl::StrFormat(
                ", open loop at %g calls/s (%s arrivals%s)", options.rate, options.arrivals,
                arrivals == ArrivalProcess::kBurst ? absl::StrCat(" of ", options.burst_size)
                                                   : std::string())
          : std::string(", closed loop"));

  if (g_stop_requested.load()) return absl::CancelledError("the load was stopped before it began");
  ArrivalSchedule schedule(arrivals, options.rate > 0 ? options.rate : 1.0, options.burst_size,
                           options.seed);
  plan.arrivals = &schedule;
  RunControl control(plan);
  std::vector<WorkerResult> results(options.concurrency);
  std::vector<std::thread> threads;
  threads.reserve(options.concurrency);
  for (int w = 0; w < options.concurrency; ++w) {
    threads.emplace_back([&, w] { results[w] = LoadWorker(replicas, plan, control, w).Run(); });
  }
  const Clock::time_point ramp_up_start = Clock::now();
  // A line a second while the prompts are made and go up (seconds at large
  // concurrency and prompt lengths). The bytes count per AppendKv chunk the
  // server accepted, so a long prompt shows as it goes, not at its end.
  int64_t ramp_bytes_before = 0;
  for (int second = 1; !control.AwaitAllReadyFor(options.concurrency, absl::Seconds(1)); ++second) {
    if (!options.progress) continue;
    const int64_t bytes = control.appended_bytes();
    std::fprintf(stderr,
                 "[ramp-up %3d s] %lld of %d workers made their prompt data; %.2f GB appended "
                 "(%.2f GB in the last second), %lld of %d prompts whole; %d of %d workers "
                 "ready\n",
                 second, static_cast<long long>(control.prompts_made()), options.concurrency,
                 bytes / 1e9, (bytes - ramp_bytes_before) / 1e9,
                 static_cast<long long>(control.prompts_appended()),
                 options.concurrency * options.items, control.ready(), options.concurrency);
    ramp_bytes_before = bytes;
  }
  const Clock::time_point start = Clock::now();
  report.ramp_up_seconds = std::chrono::duration<double>(start - ramp_up_start).count();
  absl::PrintF("ramp-up:      %d sequences ready (prompts appended) in %.2f s, not timed\n",
               options.concurrency * options.items, report.ramp_up_seconds);
  plan.measure_start = start + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(options.warmup_s));
  if (options.duration_s > 0 && !stability) {
    plan.deadline = plan.measure_start + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(options.duration_s));
  }
  plan.request_limit = options.requests;
  plan.rate = options.rate;
  plan.rate_origin = start;
  // A stream outlives the run by at most one call's deadline: enough for the
  // call in flight at the end, and a hung server still cannot hold the run.
  // With only a request bound, the run may take up to every measured call at
  // its deadline.
  const absl::Duration call_timeout = replicas.replica(0).options().call_timeout;
  if (call_timeout != absl::InfiniteDuration()) {
    const absl::Duration after_warmup =
        stability ? absl::Seconds(options.window_s * options.max_windows) + call_timeout
        : options.duration_s > 0 ? absl::Seconds(options.duration_s) + call_timeout
                                 : call_timeout * (options.requests + 1);
    plan.stream_deadline = plan.measure_start + std::chrono::duration_cast<Clock::duration>(
                                                    absl::ToChronoMicroseconds(after_warmup));
  }

  // GetServerInfo's verify sums over every target.
  const auto read_split = [&replicas]() {
    LoadReport::ServerSplit sums;
    for (int r = 0; r < replicas.size(); ++r) {
      absl::StatusOr<v1::ServerInfo> i = replicas.replica(r).GetServerInfo();
      if (!i.ok()) continue;
      sums.calls += i->verify_calls_timed();
      sums.server_us += i->verify_server_seconds_total();
      sums.queue_us += i->verify_queue_seconds_total();
      sums.device_us += i->verify_device_seconds_total();
    }
    return sums;
  };
  control.Start();
  std::this_thread::sleep_until(plan.measure_start);
  const LoadReport::ServerSplit split_before = read_split();
  // A line a second on stderr while the workers run: measured calls so far,
  // the last second's rate, errors.
  std::atomic<bool> workers_done{false};
  std::thread progress;
  if (options.progress) {
    progress = std::thread([&] {
      int64_t last_calls = 0;
      for (int second = 1; !workers_done.load(); ++second) {
        const Clock::time_point tick = plan.measure_start + std::chrono::seconds(second);
        while (!workers_done.load() && Clock::now() < tick) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        if (workers_done.load()) break;
        const int64_t calls = control.calls();
        std::fprintf(stderr, "[%3d s] %lld calls (%lld/s, %lld items), %lld errors\n", second,
                     static_cast<long long>(calls), static_cast<long long>(calls - last_calls),
                     static_cast<long long>(control.items()),
                     static_cast<long long>(control.errors()));
        last_calls = calls;
      }
    });
  }
  // Stability windows: the run ends once the last kStableWindows agree, or
  // after max_windows; only the agreeing windows are reported.
  Clock::time_point report_from = plan.measure_start;
  std::optional<Clock::time_point> report_to;
  if (stability) {
    const auto window = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(options.window_s));
    report.stability.asked = true;
    int64_t calls_before = control.calls();
    double latency_before = control.latency_ms_sum();
    for (int w = 1; w <= options.max_windows && !control.stopped(); ++w) {
      const Clock::time_point window_end = plan.measure_start + window * w;
      while (!control.stopped() && Clock::now() < window_end) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (control.stopped()) break;  // a signal or the request bound
      const int64_t calls = control.calls();
      const double latency = control.latency_ms_sum();
      report.stability.calls_per_second.push_back((calls - calls_before) / options.window_s);
      report.stability.mean_ms.push_back(
          calls > calls_before ? (latency - latency_before) / (calls - calls_before) : 0.0);
      calls_before = calls;
      latency_before = latency;
      if (w >= kStableWindows &&
          WithinPercent(
              absl::MakeConstSpan(report.stability.calls_per_second).subspan(w - kStableWindows),
              options.stability_percent) &&
          WithinPercent(absl::MakeConstSpan(report.stability.mean_ms).subspan(w - kStableWindows),
                        options.stability_percent)) {
        report.stability.reached = true;
      }
      report_to = window_end;
      report_from = window_end - window * std::min(w, kStableWindows);
      if (report.stability.reached) break;
    }
    control.Stop();
  }
  for (std::thread& thread : threads) thread.join();
  workers_done.store(true);
  if (progress.joinable()) progress.join();
  const Clock::time_point end = Clock::now();
  const LoadReport::ServerSplit split_after = read_split();
  report.late_starts = control.late_starts();
  if (const int64_t calls = split_after.calls - split_before.calls; calls > 0) {
    LoadReport::ServerSplit& d = report.server_split;
    d.calls = calls;
    d.server_us = (split_after.server_us - split_before.server_us) * 1e6 / calls;
    d.queue_us = (split_after.queue_us - split_before.queue_us) * 1e6 / calls;
    d.device_us = (split_after.device_us - split_before.device_us) * 1e6 / calls;
    d.rest_us = d.server_us - d.queue_us - d.device_us;
  }
  report.measured_seconds =
      std::max(0.0, std::chrono::duration<double>(report_to.value_or(end) - report_from).count());
  // The reported window, in seconds after the measured window opened.
  const double from_s = std::chrono::duration<double>(report_from - plan.measure_start).count();
  const double to_s = report_to.has_value()
                          ? std::chrono::duration<double>(*report_to - plan.measure_start).count()
                          : std::numeric_limits<double>::infinity();

  std::vector<double> latencies;
  int64_t draft_tokens = 0;
  std::vector<double> step_latencies;
  // Per second of the whole measured period: latencies and failures.
  std::vector<std::vector<double>> second_latencies;
  std::vector<int64_t> second_errors;
  const auto second_of = [&](double t) -> std::optional<size_t> {
    if (!(t >= 0)) return std::nullopt;
    const size_t second = static_cast<size_t>(t);
    if (second >= second_latencies.size()) {
      second_latencies.resize(second + 1);
      second_errors.resize(second + 1, 0);
    }
    return second;
  };
  std::optional<Clock::time_point> ramp_first, ramp_last;
  for (size_t w = 0; w < results.size(); ++w) {
    WorkerResult& result = results[w];
    for (size_t i = 0; i < result.latencies_ms.size(); ++i) {
      const double t = result.started_s[i];
      const double ms = result.latencies_ms[i];
      if (const std::optional<size_t> second = second_of(t)) {
        second_latencies[*second].push_back(ms);
      }
      if (t >= from_s && t < to_s) {
        latencies.push_back(ms);
        draft_tokens += result.call_drafts[i];
        if (ms > report.slowest.ms) {
          report.slowest = {ms, t, static_cast<int>(w), result.layers[i], result.sequence_lens[i]};
        }
      }
    }
    for (double t : result.error_s) {
      if (const std::optional<size_t> second = second_of(t)) ++second_errors[*second];
    }
    for (size_t i = 0; i < result.step_ms.size(); ++i) {
      const double t = result.step_started_s[i];
      if (t >= from_s && t < to_s) {
        step_latencies.push_back(result.step_ms[i]);
        report.step_tokens += result.step_tokens[i];
      }
    }
    report.steps_committed += result.steps_committed;
    report.sequences_created += result.sequences_created;
    report.append_bytes += result.append_bytes;
    report.append_call_seconds += result.append_seconds;
    report.ramp_up_append_bytes += result.ramp_up_append_bytes;
    if (result.first_append_start.has_value()) {
      ramp_first =
          std::min(ramp_first.value_or(*result.first_append_start), *result.first_append_start);
      ramp_last = std::max(ramp_last.value_or(*result.last_append_end), *result.last_append_end);
    }
    for (const auto& [code, count] : result.errors) report.errors[code] += count;
    for (const auto& [rpc, codes] : result.errors_by_rpc) {
      for (const auto& [code, count] : codes) report.errors_by_rpc[rpc][code] += count;
    }
    if (report.first_error.empty()) report.first_error = result.first_error;
    for (const auto& [r, count] : result.lost_replica_errors) {
      LoadReport::Replica& replica = report.replicas[r];
      if (replica.errors_while_down == 0) replica.first_error = result.first_lost_error[r];
      replica.errors_while_down += count;
    }
    for (const PlacedSequence& seq : result.unreleased) {
      if (replicas.size() > 1 && !replicas.CheckUp(seq.replica).ok()) continue;  // gone with it
      absl::StatusOr<int64_t> freed = replicas.ReleaseSequence(seq);
      if (!freed.ok()) {
        ++report.errors[absl::StatusCodeToString(freed.status().code())];
        ++report.errors_by_rpc["ReleaseSequence"][absl::StatusCodeToString(freed.status().code())];
        if (report.first_error.empty()) {
          report.first_error = absl::StrCat("ReleaseSequence: ", freed.status().ToString());
        }
      }
    }
  }
  const std::vector<ReplicaState> states = replicas.States();
  for (int r = 0; r < replicas.size(); ++r) {
    report.replicas[r].sequences_created = states[r].sequences_created;
  }
  // Calls of the reported window (all of the measured period, or with
  // stability windows the agreeing ones); every call carries `items` items.
  report.verify_calls = static_cast<int64_t>(latencies.size());
  report.verify_items = report.verify_calls * plan.items;
  report.draft_tokens = draft_tokens;
  if (report.verify_items > 0) {
    report.mean_drafts_per_item = static_cast<double>(draft_tokens) / report.verify_items;
  }
  report.latency_ms = Summarize(std::move(latencies), options.percentiles);
  report.steps_measured = static_cast<int64_t>(step_latencies.size());
  report.step_ms = Summarize(std::move(step_latencies), options.percentiles);
  for (size_t second = 0; second < second_latencies.size(); ++second) {
    LatencySummary l = Summarize(std::move(second_latencies[second]));
    report.series.push_back(
        {static_cast<int>(second), l.count, second_errors[second], l.p50, l.p99});
  }
  report.connections = replicas.replica(0).connections();
  report.connection_calls.assign(report.connections, ConnectionStats{});
  for (int r = 0; r < replicas.size(); ++r) {
    const std::vector<ConnectionStats> stats = replicas.replica(r).GetConnectionStats();
    for (size_t c = 0; c < stats.size() && c < report.connection_calls.size(); ++c) {
      report.connection_calls[c].calls += stats[c].calls;
      report.connection_calls[c].failed += stats[c].failed;
      report.connection_calls[c].streams_opened += stats[c].streams_opened;
    }
  }
  if (report.append_call_seconds > 0) {
    report.append_gb_per_s_per_call = report.append_bytes / report.append_call_seconds / 1e9;
  }
  if (ramp_first.has_value() && *ramp_last > *ramp_first) {
    report.append_gb_per_s_ramp_up =
        report.ramp_up_append_bytes /
        std::chrono::duration<double>(*ramp_last - *ramp_first).count() / 1e9;
  }
  if (report.measured_seconds > 0) {
    report.calls_per_second = report.verify_calls / report.measured_seconds;
    report.items_per_second = report.verify_items / report.measured_seconds;
    report.draft_tokens_per_second = report.draft_tokens / report.measured_seconds;
    report.tokens_per_second = report.step_tokens / report.measured_seconds;
  }

  // Pages back on every replica. With one target, a server that is gone or
  // restarted leaves the page count unchecked and the run fails; with
  // several, such a replica is lost (its sequences went with it) and the
  // totals cover the replicas that were checked.
  const bool several = replicas.size() > 1;
  if (several) report.free_pages_before = 0;
  int checked = 0;
  for (int r = 0; r < replicas.size(); ++r) {
    LoadReport::Replica& replica = report.replicas[r];
    absl::StatusOr<v1::ServerInfo> after = replicas.replica(r).GetServerInfo();
    std::string why;
    if (!after.ok()) {
      why = absl::StrCat("did not answer at the end (", after.status().ToString(), ")");
      if (!several) ++report.errors[absl::StatusCodeToString(after.status().code())];
    } else if (after->instance_id() != infos[r].instance_id()) {
      why = absl::StrCat("restarted during the run (instance ", infos[r].instance_id(), " then ",
                         after->instance_id(), ")");
    }
    if (!several && !why.empty()) {
      report.free_pages_after = after.ok() ? after->free_pages() : -1;
      report.pages_unchecked = absl::StrCat("the server ", why);
      continue;
    }
    if (!why.empty() || replica.errors_while_down > 0) {
      replica.lost = true;
      replica.lost_reason =
          !why.empty() ? why : absl::StrCat("was down during the run: ", states[r].down_reason);
      if (!why.empty()) continue;
    }
    replica.free_pages_after = after->free_pages();
    replica.page_leak = replica.free_pages_after != replica.free_pages_before;
    if (replica.lost) continue;  // answered again, but its sequences are gone
    ++checked;
    if (several) report.free_pages_before += replica.free_pages_before;
    report.free_pages_after += replica.free_pages_after;
    report.page_leak = report.page_leak || replica.page_leak;
  }
  if (several && checked == 0) report.pages_unchecked = "no replica answered at the end";
  for (const auto& [code, count] : report.errors) report.total_errors += count;

  if (options.floor) {
    // One request and one answer of the run's shape, as they travel; with a
    // --drafts range, of the mean tree size the run drew (rounded).
    const int n = report.mean_drafts_per_item > 0
                      ? static_cast<int>(std::lround(report.mean_drafts_per_item))
                      : (plan.num_drafts + plan.num_drafts_max) / 2;
    const std::vector<int32_t> chain = [&] {
      std::vector<int32_t> p(n);
      for (int i = 0; i < n; ++i) p[i] = i - 1;
      return p;
    }();
    const std::vector<Bf16> q(static_cast<size_t>(n) * plan.num_heads * kLatentDim);
    const std::vector<Bf16> kv(static_cast<size_t>(n) * kLatentDim);
    // A call carries --items items: the floor echoes the whole call's bytes.
    std::vector<std::vector<uint8_t>> scratch(plan.items);
    std::vector<ShmItemPlacement> scratch_place(plan.items);
    std::vector<VerifyItemInput> items;
    for (int k = 0; k < plan.items; ++k) {
      const ShmItemPlacement* place = nullptr;
      if (!plan.placements.empty()) {
        // The request references the region; nothing is copied where the
        // run's workers wrote (a scratch copy of the placement's offsets).
        const ShmItemPlacement& p =
            plan.placements[std::min<size_t>(k, plan.placements.size() - 1)];
        scratch[k].resize(p.end_offset - p.q_offset);
        scratch_place[k] = p;
        scratch_place[k].base = scratch[k].data() - p.q_offset;
        place = &scratch_place[k];
      }
      items.push_back(VerifyItemInput{static_cast<uint64_t>(k + 1), chain, q, kv, place});
    }
    ASSIGN_OR_RETURN(v1::VerifyRequest request, BuildVerifyRequest(0, items, 0.0f, 1));
    v1::VerifyResponse answer;
    answer.set_request_id(1);
    const int64_t out_bytes = int64_t{n} * plan.num_heads * kValueDim * 2;
    const int64_t lse_bytes = int64_t{n} * plan.num_heads * 4;
    for (int k = 0; k < plan.items; ++k) {
      v1::VerifyResult* result = answer.add_results();
      result->set_sequence_id(static_cast<uint64_t>(k + 1));
      result->set_prefix_len(plan.prompt_len);
      if (items[k].shm != nullptr) {
        *result->mutable_out()->mutable_shared_memory() = request.items(k).out_shared_memory();
        *result->mutable_lse()->mutable_shared_memory() = request.items(k).lse_shared_memory();
      } else {
        result->mutable_out()->mutable_raw()->assign(static_cast<size_t>(out_bytes), '\0');
        result->mutable_lse()->mutable_raw()->assign(static_cast<size_t>(lse_bytes), '\0');
      }
    }
    FloorOptions f;
    f.concurrency = options.concurrency;
    f.connections = report.connections;
    f.stream = options.stream;
    f.request_bytes = static_cast<int64_t>(request.ByteSizeLong());
    f.reply_bytes = static_cast<int64_t>(answer.ByteSizeLong());
    f.duration_s = stability                ? options.window_s * kStableWindows
                   : options.duration_s > 0 ? options.duration_s
                                            : 5.0;
    f.warmup_s = std::min(options.warmup_s, 1.0);
    f.http2_max_frame_bytes = replicas.replica(0).options().http2_max_frame_bytes;
    f.http2_lookahead_bytes = replicas.replica(0).options().http2_lookahead_bytes;
    absl::PrintF(
        "floor:        bare gRPC echo of %d-byte requests and %d-byte answers, %s, %d "
        "threads over %d connections, %.1f s\n",
        f.request_bytes, f.reply_bytes, f.stream ? "streamed" : "unary", f.concurrency,
        f.connections, f.duration_s);
    ASSIGN_OR_RETURN(FloorReport floor, MeasureTransportFloor(f));
    report.floor.measured = true;
    report.floor.request_bytes = f.request_bytes;
    report.floor.reply_bytes = f.reply_bytes;
    report.floor.calls = floor.calls;
    report.floor.calls_per_second = floor.calls_per_second;
    report.floor.latency_ms = floor.latency_ms;
    report.floor.errors = floor.errors;
    report.floor.first_error = floor.first_error;
  }
  return report;
}

absl::Status ParseValueOrRange(absl::string_view flag, absl::string_view text, int64_t* low,
                               int64_t* high) {
  const std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  int64_t a = 0, b = 0;
  const bool parsed = (parts.size() == 1 || parts.size() == 2) && absl::SimpleAtoi(parts[0], &a) &&
                      (parts.size() == 1 || absl::SimpleAtoi(parts[1], &b));
  if (!parsed || a < 0 || (parts.size() == 2 && b < a)) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(flag), " ", std::string(text),
                     ": need a count N or a range LOW:HIGH with 0 <= LOW <= HIGH"));
  }
  *low = a;
  *high = parts.size() == 2 ? b : 0;
  return absl::OkStatus();
}

void PrintLoadReport(const LoadReport& report) {
  const LatencySummary& l = report.latency_ms;
  absl::PrintF("\nmeasured:     %.2f s after warm-up\n", report.measured_seconds);
  absl::PrintF("verify calls: %d (%.1f calls/s, %.1f items/s, %.1f draft tokens/s)\n",
               report.verify_calls, report.calls_per_second, report.items_per_second,
               report.draft_tokens_per_second);
  if (report.num_drafts_max > report.num_drafts) {
    absl::PrintF("drafts:       %d..%d per item, %.2f on average\n", report.num_drafts,
                 report.num_drafts_max, report.mean_drafts_per_item);
  }
  std::string chosen;
  for (const auto& [p, value] : l.chosen) absl::StrAppendFormat(&chosen, "  p%g %.3f", p, value);
  absl::PrintF(
      "latency ms:   p50 %.3f  p90 %.3f  p95 %.3f  p99 %.3f  p99.9 %.3f  max %.3f  (mean "
      "%.3f)%s\n",
      l.p50, l.p90, l.p95, l.p99, l.p999, l.max, l.mean, chosen);
  const LoadReport::Stability& st = report.stability;
  if (st.asked) {
    absl::PrintF("stability:    %s after %d windows of %g s (within %g%%); calls/s by window: %s\n",
                 st.reached ? "stable" : "UNSTABLE", st.calls_per_second.size(),
                 report.options.window_s, report.options.stability_percent,
                 absl::StrJoin(st.calls_per_second, " ", [](std::string* out, double v) {
                   absl::StrAppendFormat(out, "%.1f", v);
                 }));
  }
  std::vector<std::string> per_connection;
  for (const ConnectionStats& c : report.connection_calls) {
    per_connection.push_back(absl::StrCat(c.calls));
  }
  absl::PrintF("connections:  %d per target; calls over the run on each: %s\n", report.connections,
               absl::StrJoin(per_connection, " "));
  if (report.options.rate > 0) {
    absl::PrintF(
        "open loop:    %g calls/s asked (%s arrivals), %.1f answered; %d calls started over 1 "
        "ms late (every worker busy: latency counts from the slot)\n",
        report.options.rate, report.options.arrivals, report.calls_per_second, report.late_starts);
  }
  if (report.slowest.worker >= 0) {
    absl::PrintF(
        "slowest call: %.3f ms, %.3f s into the window (worker %d, layer %d, sequence at %d "
        "tokens)\n",
        report.slowest.ms, report.slowest.started_s, report.slowest.worker, report.slowest.layer,
        report.slowest.sequence_len);
  }
  absl::PrintF("steps:        %d committed, %d sequences created\n", report.steps_committed,
               report.sequences_created);
  if (report.steps_measured > 0) {
    const LatencySummary& s = report.step_ms;
    absl::PrintF(
        "step ms:      p50 %.3f  p90 %.3f  p95 %.3f  p99 %.3f  max %.3f  (%d steps of %d layers "
        "and the commits; %.1f tokens/s accepted)\n",
        s.p50, s.p90, s.p95, s.p99, s.max, report.steps_measured, report.num_layers,
        report.tokens_per_second);
  }
  if (report.append_bytes > 0) {
    absl::PrintF(
        "append:       %.1f MB of prompt KV, %.2f GB/s per call, %.2f GB/s aggregate in the "
        "ramp-up\n",
        report.append_bytes / 1e6, report.append_gb_per_s_per_call, report.append_gb_per_s_ramp_up);
  }
  const LoadReport::ServerSplit& sp = report.server_split;
  if (sp.calls > 0) {
    absl::PrintF(
        "server split: %d calls, mean us: %.1f in the server = %.1f queued + %.1f device + %.1f "
        "rest\n",
        sp.calls, sp.server_us, sp.queue_us, sp.device_us, sp.rest_us);
  }
  if (report.floor.measured) {
    const LoadReport::Floor& f = report.floor;
    absl::PrintF(
        "floor:        %d calls (%.1f calls/s over %d connections), ms p50 %.3f p99 %.3f%s; the "
        "run's p50 is %.3f ms above it\n",
        f.calls, f.calls_per_second, report.connections, f.latency_ms.p50, f.latency_ms.p99,
        f.errors > 0 ? absl::StrCat(", ", f.errors, " errors (", f.first_error, ")") : "",
        l.p50 - f.latency_ms.p50);
  }
  std::vector<std::string> errors;
  for (const auto& [rpc, codes] : report.errors_by_rpc) {
    for (const auto& [code, count] : codes)
      errors.push_back(absl::StrCat(rpc, " ", code, " ", count));
  }
  for (const auto& [code, count] : report.errors) {
    if (code == kNonFiniteOutput) errors.push_back(absl::StrCat(code, " ", count));
  }
  absl::PrintF("errors:       %s\n", errors.empty() ? "none" : absl::StrJoin(errors, ", "));
  if (!report.first_error.empty()) absl::PrintF("first error:  %s\n", report.first_error);
  if (report.replicas.size() > 1) {
    for (size_t r = 0; r < report.replicas.size(); ++r) {
      const LoadReport::Replica& replica = report.replicas[r];
      if (replica.lost) {
        absl::PrintF("replica %d:    %s: %d sequences, LOST: %s; %d calls failed on it%s%s\n", r,
                     replica.target, replica.sequences_created, replica.lost_reason,
                     replica.errors_while_down, replica.first_error.empty() ? "" : " (first: ",
                     replica.first_error.empty() ? "" : replica.first_error + ")");
      } else {
        absl::PrintF("replica %d:    %s: %d sequences, pages %d free before, %d after%s\n", r,
                     replica.target, replica.sequences_created, replica.free_pages_before,
                     replica.free_pages_after, replica.page_leak ? ": PAGE LEAK" : "");
      }
    }
  }
  if (!report.pages_unchecked.empty()) {
    absl::PrintF("pages:        not checked: %s\n", report.pages_unchecked);
  } else {
    absl::PrintF("pages:        %d free before, %d after release%s\n", report.free_pages_before,
                 report.free_pages_after, report.page_leak ? ": PAGE LEAK" : ", all returned");
  }
  std::string verdict = "FAIL";
  if (report.ok()) {
    verdict = "PASS";
  } else if (report.survived_replica_loss()) {
    verdict = "PASS WITH REPLICA LOSS";
  } else if (report.unstable()) {
    verdict = "FAIL (not stable)";
  } else if (report.rate_missed()) {
    verdict = absl::StrFormat(
        "FAIL (open loop answered %.1f of the %g calls/s asked: under %.0f %%)",
        report.calls_per_second, report.options.rate, 100 * LoadReport::kOpenLoopMinAnswered);
  }
  absl::PrintF("result:       %s\n", verdict);
}

uint64_t PromptStagingBytes(int layers, int64_t prompt_len, int64_t shm_staging_bytes) {
  const uint64_t token_bytes = static_cast<uint64_t>(layers) * kLatentDim * 2;
  return std::max<uint64_t>(
      token_bytes,
      std::min<uint64_t>(static_cast<uint64_t>(std::max<int64_t>(shm_staging_bytes, 0)),
                         static_cast<uint64_t>(prompt_len) * token_bytes));
}

absl::Status UnregisterWhenReleased(VerifyClient& client, const std::string& name, bool cuda) {
  absl::Status gone;
  for (int attempt = 0; attempt < 50; ++attempt) {
    gone = cuda ? client.UnregisterCudaSharedMemory(name).status()
                : client.UnregisterSystemSharedMemory(name).status();
    if (gone.code() != absl::StatusCode::kFailedPrecondition) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return gone;
}

nlohmann::ordered_json LoadReportToJson(const LoadReport& report) {
  const LoadOptions& o = report.options;
  nlohmann::ordered_json replicas_json = nlohmann::ordered_json::array();
  for (const LoadReport::Replica& r : report.replicas) {
    replicas_json.push_back({{"target", r.target},
                             {"sequences_created", r.sequences_created},
                             {"free_pages_before", r.free_pages_before},
                             {"free_pages_after", r.free_pages_after},
                             {"page_leak", r.page_leak},
                             {"lost", r.lost},
                             {"lost_reason", r.lost_reason},
                             {"errors_while_down", r.errors_while_down},
                             {"first_error", r.first_error}});
  }
  const LatencySummary& l = report.latency_ms;
  nlohmann::ordered_json latency = LatencySummaryToJson(l);
  // Non-empty buckets: samples in (the previous bucket's le, le] ms.
  nlohmann::ordered_json histogram = nlohmann::ordered_json::array();
  for (const HistogramBucket& b : l.histogram) {
    histogram.push_back({{"le", b.upper}, {"count", b.count}});
  }
  nlohmann::ordered_json series = nlohmann::ordered_json::array();
  for (const LoadReport::Second& sec : report.series) {
    series.push_back({{"second", sec.second},
                      {"calls", sec.calls},
                      {"errors", sec.errors},
                      {"p50_ms", sec.p50_ms},
                      {"p99_ms", sec.p99_ms}});
  }
  nlohmann::ordered_json connection_calls = nlohmann::ordered_json::array();
  for (const ConnectionStats& c : report.connection_calls) {
    connection_calls.push_back(
        {{"calls", c.calls}, {"failed", c.failed}, {"streams_opened", c.streams_opened}});
  }
  return {
      {"target", report.target},
      {"pass", report.ok()},
      {"rate_missed", report.rate_missed()},
      {"options",
       {{"concurrency", o.concurrency},
        {"duration_s", o.duration_s},
        {"requests", o.requests},
        {"warmup_s", o.warmup_s},
        {"prompt_len", o.prompt_len},
        {"prompt_len_max", std::max(o.prompt_len, o.prompt_len_max)},
        {"drafts", o.drafts},
        {"drafts_max", std::max(o.drafts, o.drafts_max)},
        {"items", o.items},
        {"stream", o.stream},
        {"data_plane", o.data_plane},
        {"floor", o.floor},
        {"rate", o.rate},
        {"arrivals", o.arrivals},
        {"burst_size", o.burst_size},
        {"connections", report.connections},
        {"percentiles", o.percentiles},
        {"stability_percent", o.stability_percent},
        {"window_s", o.window_s},
        {"max_windows", o.max_windows},
        {"seed", o.seed}}},
      {"geometry",
       {{"num_layers", report.num_layers},
        {"num_heads", report.num_heads},
        {"num_drafts", report.num_drafts},
        {"num_drafts_max", report.num_drafts_max}}},
      {"ramp_up_seconds", report.ramp_up_seconds},
      {"measured_seconds", report.measured_seconds},
      {"verify_calls", report.verify_calls},
      {"draft_tokens", report.draft_tokens},
      {"mean_drafts_per_item", report.mean_drafts_per_item},
      {"calls_per_second", report.calls_per_second},
      {"verify_items", report.verify_items},
      {"late_starts", report.late_starts},
      {"items_per_second", report.items_per_second},
      {"draft_tokens_per_second", report.draft_tokens_per_second},
      {"steps_committed", report.steps_committed},
      {"decode_steps",
       {{"measured", report.steps_measured},
        {"layers", report.num_layers},
        {"tokens", report.step_tokens},
        {"tokens_per_second", report.tokens_per_second},
        {"latency_ms", LatencySummaryToJson(report.step_ms)}}},
      {"append",
       {{"bytes", report.append_bytes},
        {"call_seconds", report.append_call_seconds},
        {"gb_per_s_per_call", report.append_gb_per_s_per_call},
        {"ramp_up_bytes", report.ramp_up_append_bytes},
        {"gb_per_s_ramp_up", report.append_gb_per_s_ramp_up}}},
      {"sequences_created", report.sequences_created},
      {"connections", report.connections},
      {"connection_calls", connection_calls},
      {"latency_ms", latency},
      {"latency_histogram_ms", histogram},
      {"series", series},
      {"stability",
       report.stability.asked
           ? nlohmann::ordered_json{{"reached", report.stability.reached},
                                    {"percent", o.stability_percent},
                                    {"window_s", o.window_s},
                                    {"windows", report.stability.calls_per_second.size()},
                                    {"calls_per_second", report.stability.calls_per_second},
                                    {"mean_ms", report.stability.mean_ms}}
           : nlohmann::ordered_json(nullptr)},
      {"slowest_call",
       {{"ms", report.slowest.ms},
        {"started_s", report.slowest.started_s},
        {"worker", report.slowest.worker},
        {"layer", report.slowest.layer},
        {"sequence_len", report.slowest.sequence_len}}},
      {"server_split_us",
       {{"calls", report.server_split.calls},
        {"server", report.server_split.server_us},
        {"queue", report.server_split.queue_us},
        {"device", report.server_split.device_us},
        {"rest", report.server_split.rest_us}}},
      {"floor", report.floor.measured
                    ? nlohmann::ordered_json{{"request_bytes", report.floor.request_bytes},
                                             {"reply_bytes", report.floor.reply_bytes},
                                             {"calls", report.floor.calls},
                                             {"calls_per_second", report.floor.calls_per_second},
                                             {"connections", report.connections},
                                             {"p50_ms", report.floor.latency_ms.p50},
                                             {"p99_ms", report.floor.latency_ms.p99},
                                             {"errors", report.floor.errors}}
                    : nlohmann::ordered_json(nullptr)},
      {"errors", report.errors},
      {"errors_by_rpc", report.errors_by_rpc},
      {"first_error", report.first_error},
      {"total_errors", report.total_errors},
      {"free_pages_before", report.free_pages_before},
      {"free_pages_after", report.free_pages_after},
      {"page_leak", report.page_leak},
      {"pages_unchecked", report.pages_unchecked},
      {"survived_replica_loss", report.survived_replica_loss()},
      {"replicas", replicas_json},
  };
}

std::string LoadReportsToCsv(const std::vector<LoadReport>& reports) {
  std::vector<double> chosen;
  if (!reports.empty()) {
    for (const auto& [p, value] : reports[0].latency_ms.chosen) chosen.push_back(p);
  }
  std::string csv =
      "concurrency,connections,items,stream,data_plane,rate,calls_per_second,items_per_second,"
      "p50_ms,p90_ms,p95_ms,p99_ms,p99_9_ms,max_ms,mean_ms";
  for (double p : chosen) absl::StrAppend(&csv, ",", PercentileKey(p), "_ms");
  absl::StrAppend(&csv, ",errors,floor_calls_per_second,floor_p50_ms,pass\n");
  for (const LoadReport& r : reports) {
    const LatencySummary& l = r.latency_ms;
    absl::StrAppendFormat(&csv, "%d,%d,%d,%d,%s,%g,%.3f,%.3f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f",
                          r.options.concurrency, r.connections, r.options.items,
                          r.options.stream ? 1 : 0, r.options.data_plane, r.options.rate,
                          r.calls_per_second, r.items_per_second, l.p50, l.p90, l.p95, l.p99,
                          l.p999, l.max, l.mean);
    for (const auto& [p, value] : l.chosen) absl::StrAppendFormat(&csv, ",%.4f", value);
    if (r.floor.measured) {
      absl::StrAppendFormat(&csv, ",%d,%.3f,%.4f", r.total_errors, r.floor.calls_per_second,
                            r.floor.latency_ms.p50);
    } else {
      absl::StrAppendFormat(&csv, ",%d,,", r.total_errors);
    }
    absl::StrAppend(&csv, r.ok() ? ",1\n" : ",0\n");
  }
  return csv;
}

}  // namespace mlaverify::client
