#include "client/load.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/server_info_text.h"
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
// Error bucket for answers with NaN/Inf: not a gRPC code, still a failure.
constexpr char kNonFiniteOutput[] = "NON_FINITE_OUTPUT";

// What every worker reads: the plan, and the bounds of the run.
struct LoadPlan {
  int num_layers = 0;
  int num_heads = 0;
  int num_drafts = 0;
  int64_t prompt_len = 0;
  int64_t max_sequence_len = 0;
  bool stream = false;
  // When every stream ends, whenever it was opened; nullopt: never.
  std::optional<Clock::time_point> stream_deadline;
  uint64_t seed = 0;

  Clock::time_point measure_start;
  std::optional<Clock::time_point> deadline;
  int64_t request_limit = 0;  // 0: none
};

class RunControl {
 public:
  explicit RunControl(const LoadPlan& plan) : plan_(plan) {}

  // The ramp-up: every worker first gets its sequence (prompt appended, or
  // given up after its failures), then waits here until RunLoad has seen all
  // of them ready and set the run's clock (Start). The prompts' uploads are
  // megabytes each and share the channel with the Verify calls: timed, the
  // first steps' Verify calls waited behind other workers' uploads (a 453 ms
  // maximum against a 13 ms p99.9 on the H200; bench/NOTES.md, "The service
  // on the eager CUDA backend").
  void WorkerReady() {
    absl::MutexLock lock(&mu_);
    ++ready_;
  }
  void AwaitAllReady(int workers) {
    absl::MutexLock lock(&mu_);
    const auto all_ready = [this, workers]()
                               ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ready_ >= workers; };
    mu_.Await(absl::Condition(&all_ready));
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
  // with a request bound, got one of the measured slots).
  bool BeginVerify(bool* measured) {
    if (stop_.load(std::memory_order_relaxed)) return false;
    const Clock::time_point now = Clock::now();
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

  bool stopped() const { return stop_.load(std::memory_order_relaxed); }
  void Stop() { stop_.store(true, std::memory_order_relaxed); }

 private:
  const LoadPlan& plan_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> issued_{0};
  absl::Mutex mu_;
  int ready_ ABSL_GUARDED_BY(mu_) = 0;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
};

struct WorkerResult {
  std::vector<double> latencies_ms;
  LoadReport::SlowestCall slowest;
  int64_t verify_calls = 0;
  int64_t draft_tokens = 0;
  int64_t steps_committed = 0;
  int64_t sequences_created = 0;
  std::map<std::string, int64_t> errors;
  // Sequences the worker could not (or did not get to) release.
  std::vector<uint64_t> unreleased;
};

class LoadWorker {
 public:
  LoadWorker(VerifyClient& client, const LoadPlan& plan, RunControl& control, int index)
      : client_(client),
        plan_(plan),
        control_(control),
        index_(index),
        rng_(plan.seed + 0x9e3779b97f4a7c15ull * (index + 1)) {}

  WorkerResult Run() {
    // The server never looks at the values, so one random set per worker is
    // reused for every call: the client's CPU goes to sending, not to rand().
    if (plan_.prompt_len > 0) {
      prompt_.resize(static_cast<size_t>(plan_.num_layers) * plan_.prompt_len * kLatentDim);
      FillUniformBf16(rng_, -1.0f, 1.0f, absl::MakeSpan(prompt_));
    }
    q_.resize(static_cast<size_t>(plan_.num_drafts) * plan_.num_heads * kLatentDim);
    FillUniformBf16(rng_, -2.0f, 2.0f, absl::MakeSpan(q_));
    draft_kv_.resize(static_cast<size_t>(plan_.num_drafts) * kLatentDim);
    FillUniformBf16(rng_, -1.0f, 1.0f, absl::MakeSpan(draft_kv_));

    // Ramp-up (untimed): this worker's first sequence, or its failures up
    // to the limit, before the run's clock starts.
    while (!sequence_id_.has_value() && consecutive_failures_ < kMaxConsecutiveFailures)
      StartSequence();
    control_.WorkerReady();
    control_.AwaitStart();

    while (!control_.stopped()) {
      if (consecutive_failures_ >= kMaxConsecutiveFailures) {
        spdlog::warn("load worker {}: {} operations failed in a row; stopping this worker", index_,
                     consecutive_failures_);
        break;
      }
      if (!sequence_id_.has_value() && !StartSequence()) continue;
      if (!RunStep()) break;
    }
    if (sequence_id_.has_value()) result_.unreleased.push_back(*sequence_id_);
    if (stream_ != nullptr) {
      // Errors past the end of the run (e.g. the stream's own deadline) are
      // not the server's fault; the stream is only being put away.
      stream_->Close().IgnoreError();
    }
    return std::move(result_);
  }

 private:
  void RecordError(const absl::Status& status) {
    ++result_.errors[absl::StatusCodeToString(status.code())];
    ++consecutive_failures_;
    if (consecutive_failures_ == 1) {
      spdlog::warn("load worker {}: {}", index_, status.ToString());
    }
    std::this_thread::sleep_for(kFailureBackoff);
  }

  bool StartSequence() {
    absl::StatusOr<uint64_t> id = client_.CreateSequence(absl::StrCat("load-", index_));
    if (!id.ok()) {
      RecordError(id.status());
      return false;
    }
    ++result_.sequences_created;
    sequence_id_ = *id;
    length_ = 0;
    if (plan_.prompt_len > 0) {
      absl::StatusOr<AppendKvResult> appended =
          client_.AppendKv(*id, 0, plan_.num_layers, plan_.prompt_len, prompt_);
      if (!appended.ok()) {
        RecordError(appended.status());
        DropSequence();
        return false;
      }
      length_ = appended->length;
    }
    return true;
  }

  // Releases the current sequence after a failure left its state unknown. A
  // sequence the server no longer knows is gone already; any other failure
  // leaves it for the final release.
  void DropSequence() {
    if (!sequence_id_.has_value()) return;
    absl::StatusOr<int64_t> freed = client_.ReleaseSequence(*sequence_id_);
    if (!freed.ok() && freed.status().code() != absl::StatusCode::kNotFound) {
      RecordError(freed.status());
      result_.unreleased.push_back(*sequence_id_);
    }
    sequence_id_.reset();
  }

  absl::StatusOr<std::vector<VerifyItemResult>> VerifyLayer(int layer,
                                                            const VerifyItemInput& item) {
    if (!plan_.stream) return client_.Verify(layer, {&item, 1});
    if (stream_ == nullptr) {
      const absl::Duration lifetime = plan_.stream_deadline.has_value()
                                          ? absl::FromChrono(*plan_.stream_deadline - Clock::now())
                                          : absl::InfiniteDuration();
      ASSIGN_OR_RETURN(stream_, client_.OpenVerifyStream(lifetime));
    }
    return stream_->Verify(layer, {&item, 1});
  }

  // One verify step of the worker's sequence. False when the run is over.
  bool RunStep() {
    const std::vector<int32_t> parents = RandomDraftTree(rng_, plan_.num_drafts);
    const VerifyItemInput item{*sequence_id_, parents, q_, draft_kv_};
    for (int layer = 0; layer < plan_.num_layers; ++layer) {
      bool measured = false;
      if (!control_.BeginVerify(&measured)) return false;
      const Clock::time_point start = Clock::now();
      absl::StatusOr<std::vector<VerifyItemResult>> results = VerifyLayer(layer, item);
      const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
      if (!results.ok()) {
        RecordError(results.status());
        // A stream that failed may be broken; a fresh one costs little.
        stream_.reset();
        DropSequence();
        return true;
      }
      const std::vector<Bf16>& out = results->front().out;
      const std::vector<float>& lse = results->front().lse;
      const bool finite =
          std::all_of(out.begin(), out.end(),
                      [](Bf16 v) { return std::isfinite(Bf16ToFloat(v)); }) &&
          std::all_of(lse.begin(), lse.end(), [](float v) { return std::isfinite(v); });
      if (!finite) {
        ++result_.errors[kNonFiniteOutput];
      }
      if (measured) {
        if (ms > result_.slowest.ms) {
          result_.slowest = {ms, std::chrono::duration<double>(start - plan_.measure_start).count(),
                             index_, layer, length_};
        }
        result_.latencies_ms.push_back(ms);
        ++result_.verify_calls;
        result_.draft_tokens += plan_.num_drafts;
      }
    }
    const std::vector<int32_t> accepted = RandomAcceptedPath(rng_, parents);
    absl::StatusOr<CommitResult> committed = client_.Commit(*sequence_id_, accepted);
    if (!committed.ok()) {
      RecordError(committed.status());
      DropSequence();
      return true;
    }
    consecutive_failures_ = 0;
    ++result_.steps_committed;
    length_ = committed->length;
    if (length_ + plan_.num_drafts > plan_.max_sequence_len) {
      absl::StatusOr<int64_t> freed = client_.ReleaseSequence(*sequence_id_);
      if (!freed.ok()) {
        RecordError(freed.status());
        result_.unreleased.push_back(*sequence_id_);
      }
      sequence_id_.reset();
    }
    return true;
  }

  VerifyClient& client_;
  const LoadPlan& plan_;
  RunControl& control_;
  const int index_;
  std::mt19937_64 rng_;
  std::vector<Bf16> prompt_;    // [num_layers, prompt_len, 576]
  std::vector<Bf16> q_;         // [N, H, 576]
  std::vector<Bf16> draft_kv_;  // [N, 576]
  std::unique_ptr<VerifyStreamSession> stream_;
  std::optional<uint64_t> sequence_id_;
  int64_t length_ = 0;
  int consecutive_failures_ = 0;
  WorkerResult result_;
};

}  // namespace

absl::StatusOr<LoadReport> RunLoad(VerifyClient& client, const LoadOptions& options) {
  if (options.concurrency < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--concurrency ", options.concurrency, ": need at least 1"));
  }
  if (options.duration_s <= 0 && options.requests <= 0) {
    return absl::InvalidArgumentError(
        "the load needs an end: give --duration-s > 0, --requests > 0, or both");
  }
  if (options.drafts < 1 || options.prompt_len < 0 || options.warmup_s < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--drafts %d, --prompt-len %d, --warmup-s %g: need drafts >= 1 and the others >= 0",
        options.drafts, options.prompt_len, options.warmup_s));
  }
  ASSIGN_OR_RETURN(v1::ServerInfo info, client.GetServerInfo());

  LoadReport report;
  report.target = client.target();
  report.options = options;
  report.num_layers = info.num_layers();
  report.num_heads = info.num_heads();
  report.num_drafts = std::min(options.drafts, info.max_draft_len());
  report.free_pages_before = info.free_pages();
  const std::string instance_before = info.instance_id();

  LoadPlan plan;
  plan.num_layers = info.num_layers();
  plan.num_heads = info.num_heads();
  plan.num_drafts = report.num_drafts;
  plan.prompt_len = options.prompt_len;
  plan.max_sequence_len =
      options.max_sequence_len > 0 ? options.max_sequence_len : options.prompt_len + 512;
  if (info.max_sequence_len() > 0) {
    plan.max_sequence_len = std::min(plan.max_sequence_len, info.max_sequence_len());
  }
  if (plan.num_drafts < 1 || plan.num_layers < 1 || plan.num_heads < 1) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "server geometry leaves nothing to verify: max_draft_len %d, %d layers, %d heads",
        info.max_draft_len(), info.num_layers(), info.num_heads()));
  }
  if (plan.max_sequence_len < plan.prompt_len + plan.num_drafts) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "sequence length budget %d cannot hold the prompt (%d) and one step (%d drafts)",
        plan.max_sequence_len, plan.prompt_len, plan.num_drafts));
  }
  plan.stream = options.stream;
  plan.seed = options.seed;

  absl::PrintF("server %s: %s\n", client.target(), ServerInfoSummaryLine(info));
  absl::PrintF(
      "load: %d workers, %s after %.1f s warm-up, N=%d, prompt %d, sequences up to %d "
      "tokens, %s calls\n",
      options.concurrency,
      options.duration_s > 0 && options.requests > 0
          ? absl::StrFormat("%.1f s or %d calls", options.duration_s, options.requests)
      : options.duration_s > 0 ? absl::StrFormat("%.1f s", options.duration_s)
                               : absl::StrFormat("%d calls", options.requests),
      options.warmup_s, plan.num_drafts, plan.prompt_len, plan.max_sequence_len,
      options.stream ? "streamed" : "unary");

  RunControl control(plan);
  std::vector<WorkerResult> results(options.concurrency);
  std::vector<std::thread> threads;
  threads.reserve(options.concurrency);
  for (int w = 0; w < options.concurrency; ++w) {
    threads.emplace_back([&, w] { results[w] = LoadWorker(client, plan, control, w).Run(); });
  }
  const Clock::time_point ramp_up_start = Clock::now();
  control.AwaitAllReady(options.concurrency);
  const Clock::time_point start = Clock::now();
  report.ramp_up_seconds = std::chrono::duration<double>(start - ramp_up_start).count();
  absl::PrintF("ramp-up:      %d sequences ready (prompts appended) in %.2f s, not timed\n",
               options.concurrency, report.ramp_up_seconds);
  plan.measure_start = start + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(options.warmup_s));
  if (options.duration_s > 0) {
    plan.deadline = plan.measure_start + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(options.duration_s));
  }
  plan.request_limit = options.requests;
  // A stream outlives the run by at most one call's deadline: enough for the
  // call in flight at the end, and a hung server still cannot hold the run.
  // With only a request bound, the run may take up to every measured call at
  // its deadline.
  const absl::Duration call_timeout = client.options().call_timeout;
  if (call_timeout != absl::InfiniteDuration()) {
    const absl::Duration after_warmup = options.duration_s > 0
                                            ? absl::Seconds(options.duration_s) + call_timeout
                                            : call_timeout * (options.requests + 1);
    plan.stream_deadline = plan.measure_start + std::chrono::duration_cast<Clock::duration>(
                                                    absl::ToChronoMicroseconds(after_warmup));
  }

  control.Start();
  for (std::thread& thread : threads) thread.join();
  const Clock::time_point end = Clock::now();
  report.measured_seconds =
      std::max(0.0, std::chrono::duration<double>(end - plan.measure_start).count());

  std::vector<double> latencies;
  for (WorkerResult& result : results) {
    latencies.insert(latencies.end(), result.latencies_ms.begin(), result.latencies_ms.end());
    if (result.slowest.ms > report.slowest.ms) report.slowest = result.slowest;
    report.verify_calls += result.verify_calls;
    report.draft_tokens += result.draft_tokens;
    report.steps_committed += result.steps_committed;
    report.sequences_created += result.sequences_created;
    for (const auto& [code, count] : result.errors) report.errors[code] += count;
    for (uint64_t id : result.unreleased) {
      absl::StatusOr<int64_t> freed = client.ReleaseSequence(id);
      if (!freed.ok()) ++report.errors[absl::StatusCodeToString(freed.status().code())];
    }
  }
  report.latency_ms = Summarize(std::move(latencies));
  if (report.measured_seconds > 0) {
    report.calls_per_second = report.verify_calls / report.measured_seconds;
    report.draft_tokens_per_second = report.draft_tokens / report.measured_seconds;
  }

  absl::StatusOr<v1::ServerInfo> after = client.GetServerInfo();
  if (!after.ok()) {
    ++report.errors[absl::StatusCodeToString(after.status().code())];
    report.free_pages_after = -1;
    report.pages_unchecked =
        absl::StrCat("the server did not answer at the end (", after.status().ToString(), ")");
  } else if (after->instance_id() != instance_before) {
    report.free_pages_after = after->free_pages();
    report.pages_unchecked = absl::StrCat("the server restarted during the run (instance ",
                                          instance_before, " then ", after->instance_id(), ")");
  } else {
    report.free_pages_after = after->free_pages();
    report.page_leak = report.free_pages_after != report.free_pages_before;
  }
  for (const auto& [code, count] : report.errors) report.total_errors += count;
  return report;
}

void PrintLoadReport(const LoadReport& report) {
  const LatencySummary& l = report.latency_ms;
  absl::PrintF("\nmeasured:     %.2f s after warm-up\n", report.measured_seconds);
  absl::PrintF("verify calls: %d (%.1f calls/s, %.1f draft tokens/s)\n", report.verify_calls,
               report.calls_per_second, report.draft_tokens_per_second);
  absl::PrintF("latency ms:   p50 %.3f  p90 %.3f  p99 %.3f  p99.9 %.3f  max %.3f  (mean %.3f)\n",
               l.p50, l.p90, l.p99, l.p999, l.max, l.mean);
  if (report.slowest.worker >= 0) {
    absl::PrintF(
        "slowest call: %.3f ms, %.3f s into the window (worker %d, layer %d, sequence at %d "
        "tokens)\n",
        report.slowest.ms, report.slowest.started_s, report.slowest.worker, report.slowest.layer,
        report.slowest.sequence_len);
  }
  absl::PrintF("steps:        %d committed, %d sequences created\n", report.steps_committed,
               report.sequences_created);
  std::vector<std::string> errors;
  for (const auto& [code, count] : report.errors) errors.push_back(absl::StrCat(code, " ", count));
  absl::PrintF("errors:       %s\n", errors.empty() ? "none" : absl::StrJoin(errors, ", "));
  if (!report.pages_unchecked.empty()) {
    absl::PrintF("pages:        not checked: %s\n", report.pages_unchecked);
  } else {
    absl::PrintF("pages:        %d free before, %d after release%s\n", report.free_pages_before,
                 report.free_pages_after, report.page_leak ? ": PAGE LEAK" : ", all returned");
  }
  absl::PrintF("result:       %s\n", report.ok() ? "PASS" : "FAIL");
}

nlohmann::ordered_json LoadReportToJson(const LoadReport& report) {
  const LoadOptions& o = report.options;
  const LatencySummary& l = report.latency_ms;
  return {
      {"target", report.target},
      {"pass", report.ok()},
      {"options",
       {{"concurrency", o.concurrency},
        {"duration_s", o.duration_s},
        {"requests", o.requests},
        {"warmup_s", o.warmup_s},
        {"prompt_len", o.prompt_len},
        {"drafts", o.drafts},
        {"stream", o.stream},
        {"seed", o.seed}}},
      {"geometry",
       {{"num_layers", report.num_layers},
        {"num_heads", report.num_heads},
        {"num_drafts", report.num_drafts}}},
      {"ramp_up_seconds", report.ramp_up_seconds},
      {"measured_seconds", report.measured_seconds},
      {"verify_calls", report.verify_calls},
      {"draft_tokens", report.draft_tokens},
      {"calls_per_second", report.calls_per_second},
      {"draft_tokens_per_second", report.draft_tokens_per_second},
      {"steps_committed", report.steps_committed},
      {"sequences_created", report.sequences_created},
      {"latency_ms",
       {{"count", l.count},
        {"mean", l.mean},
        {"p50", l.p50},
        {"p90", l.p90},
        {"p99", l.p99},
        {"p99_9", l.p999},
        {"max", l.max}}},
      {"slowest_call",
       {{"ms", report.slowest.ms},
        {"started_s", report.slowest.started_s},
        {"worker", report.slowest.worker},
        {"layer", report.slowest.layer},
        {"sequence_len", report.slowest.sequence_len}}},
      {"errors", report.errors},
      {"total_errors", report.total_errors},
      {"free_pages_before", report.free_pages_before},
      {"free_pages_after", report.free_pages_after},
      {"page_leak", report.page_leak},
      {"pages_unchecked", report.pages_unchecked},
  };
}

}  // namespace mlaverify::client
