// `mlaverify-client load`: load generator. `concurrency` worker threads each
// drive `items` sequences through verify steps (per layer one Verify carrying
// all of them, then a Commit each), closed loop (as fast as the server
// answers) or open loop (calls at a fixed rate), for a bounded time, a number
// of calls, or until the rate and latency are stable over consecutive
// windows. The run reports exact latency percentiles with a histogram and a
// per-second series, throughput, the server's own time split, errors by RPC
// and gRPC code, calls per connection, prompt upload rates, whether every
// page came back, and on request the bare-transport floor for the same
// messages over the same number of connections.
#ifndef MLAVERIFY_CLIENT_LOAD_H_
#define MLAVERIFY_CLIENT_LOAD_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/client.h"
#include "client/latency_stats.h"
#include "client/replica_set.h"
#include "nlohmann/json.hpp"

namespace mlaverify::client {

struct LoadOptions {
  int concurrency = 8;
  // The run ends at whichever bound comes first; at least one must be set.
  double duration_s = 10.0;  // measured seconds after warm-up; <= 0: no time bound
  int64_t requests = 0;      // measured Verify calls; 0: no count bound
  // Calls that start earlier are not measured. The clock starts after the
  // ramp-up: every worker has created its first sequence and appended its prompt.
  double warmup_s = 2.0;
  int64_t prompt_len = 64;
  // Above prompt_len: each new sequence's prompt length is drawn uniformly
  // from [prompt_len, prompt_len_max] (`--prompt-len 512:4096`); 0: fixed.
  int64_t prompt_len_max = 0;
  int drafts = 4;  // N, capped by the server's max_draft_len
  // Above drafts: each step's tree size per item is drawn uniformly from
  // [drafts, drafts_max] (`--drafts 4:16`), capped likewise; 0: fixed.
  int drafts_max = 0;
  // Sequences per Verify call (a scheduler verifying its whole batch per
  // layer): each worker drives this many, every call carries all of them.
  // Above 1: one target.
  int items = 1;
  // A sequence longer than this is released and replaced (bounds memory per
  // worker). 0: prompt_len + 512, capped by the server's max_sequence_len.
  int64_t max_sequence_len = 0;
  bool stream = false;  // each worker uses one VerifyStream
  // > 0: open loop. Verify calls are scheduled at this many per second in
  // all, each taken by the next free worker (`concurrency` bounds the calls
  // in flight); a call's latency counts from its slot, so a server that
  // falls behind shows in the percentiles instead of slowing the schedule.
  double rate = 0;
  // The open loop's spacing (client/arrivals.h): "constant", "poisson"
  // (exponential gaps of mean 1/rate) or "burst" (burst_size calls due at
  // once every burst_size/rate seconds). Each keeps the mean rate.
  std::string arrivals = "constant";
  int burst_size = 8;
  // "inline" (tensor bytes in the messages) or "shm" (a system shared-memory
  // region the run creates, registers on every target and removes again:
  // each worker's q, draft_kv, out and lse, and its AppendKv chunks, live
  // there; servers need --allow-client-shm).
  std::string data_plane = "inline";
  // "cuda-shm": one device buffer on `cuda_device`, exported by CUDA IPC:
  // every item's q and draft_kv written there once, out and lse left there
  // (the server writes them before it answers); prompts inline.
  int cuda_device = 0;
  // shm: each worker's AppendKv staging area. A prompt that fits is made
  // right there (as a co-located prefill would leave it) and appended in
  // one call without a copy; a longer one is staged chunk by chunk.
  int64_t shm_staging_bytes = int64_t{16} << 20;
  // After the run, the bare-transport floor for the same messages
  // (client/transport_floor.h): same request/answer sizes, RPC kind,
  // concurrency and duration, against an echo in this process.
  bool floor = false;
  bool progress = true;  // a line a second on stderr during ramp-up and run
  uint64_t seed = 1;
  // Device-driven steps (docs/steps.md, client/step_load.h) instead of
  // Verify calls: each worker opens a step per decode step, rings and waits
  // every layer through the doorbells, then commits its items.
  bool steps = false;
  // "host": slots in a system shared-memory region the run creates; "gpu":
  // stream memory operations on --cuda-device, tensors in a CUDA region.
  std::string doorbell = "host";
  // The scheduler's own work before each layer's ring: a busy kernel on
  // every multiprocessor of --cuda-device (gpu), a busy host loop (host).
  double client_work_us = 0;
  // Percentiles reported besides p50/p90/p95/p99/p99.9, each in (0, 100].
  std::vector<double> percentiles;
  // > 0: instead of a fixed duration, measure in windows of `window_s` until
  // the last 3 windows' calls/s and mean latency are each within this many
  // percent of their mean (perf_analyzer's stability rule), or until
  // `max_windows` windows passed (then the run fails as unstable). The
  // report covers the last 3 windows.
  double stability_percent = 0;
  double window_s = 5.0;
  int max_windows = 10;
};

// Windows whose calls/s and mean latency must agree for a stable measurement.
inline constexpr int kStableWindows = 3;

struct LoadReport {
  std::string target;
  LoadOptions options;
  int num_drafts = 0;      // N actually used (the lower end of a range)
  int num_drafts_max = 0;  // the upper end (num_drafts when fixed)
  int num_layers = 0;
  int num_heads = 0;
  // Untimed: until every worker had its first sequence (prompt appended).
  double ramp_up_seconds = 0.0;
  // Of the measured calls: items' drafts per call, on average (the mean of
  // a --drafts range as drawn; N when fixed).
  double mean_drafts_per_item = 0.0;
  double measured_seconds = 0.0;
  int64_t verify_calls = 0;     // measured, successful
  int64_t verify_items = 0;     // items in those calls
  int64_t draft_tokens = 0;     // drafts in those calls
  int64_t steps_committed = 0;  // all commits, warm-up included
  int64_t sequences_created = 0;
  double calls_per_second = 0.0;
  double items_per_second = 0.0;
  int64_t late_starts = 0;  // open loop: calls started over 1 ms after their slot
  double draft_tokens_per_second = 0.0;
  // Prompt uploads (AppendKv, every phase): bytes of latent KV sent, the
  // time the calls took summed over workers, and the aggregate rate over the
  // ramp-up, in which every worker uploads its first prompt at once.
  int64_t append_bytes = 0;
  double append_call_seconds = 0.0;
  int64_t ramp_up_append_bytes = 0;
  double append_gb_per_s_per_call = 0.0;  // append_bytes / append_call_seconds
  // ramp_up_append_bytes over the ramp-up's appends, from the first start
  // to the last end (prompt generation before them excluded).
  double append_gb_per_s_ramp_up = 0.0;
  LatencySummary latency_ms;  // of measured, successful Verify calls
  // Decode steps as a scheduler waits for them: one tree per item, every
  // layer's Verify, then the items' Commits. A step counts when its first
  // call started in the reported window and every call of it succeeded;
  // closed loop only (with --rate each layer waits for its slot: none).
  // Tokens: per item and step, the accepted drafts plus the target's own
  // next token (what the step adds to the sequence).
  int64_t steps_measured = 0;
  LatencySummary step_ms;
  int64_t step_tokens = 0;
  double tokens_per_second = 0.0;
  // HTTP/2 connections per target (ClientOptions::connections), and the
  // calls each carried over the whole run, summed over the targets by index.
  int connections = 1;
  std::vector<ConnectionStats> connection_calls;
  // Per second of the measured window (by the call's start): successful
  // calls, failed ones, and their latency.
  struct Second {
    int second = 0;
    int64_t calls = 0;
    int64_t errors = 0;
    double p50_ms = 0, p99_ms = 0;
  };
  std::vector<Second> series;
  // With options.stability_percent: the windows measured, each one's calls/s
  // and mean latency, and whether the last kStableWindows agreed.
  struct Stability {
    bool asked = false;
    bool reached = false;
    std::vector<double> calls_per_second;
    std::vector<double> mean_ms;
  } stability;
  // The server's own split of the calls it answered in the measured window
  // (GetServerInfo's sums, read when the window opened and at the end,
  // summed over the targets): mean microseconds per call from arrival to
  // answer, waiting for a device, device time, and the rest (decoding,
  // host copies, completion).
  struct ServerSplit {
    int64_t calls = 0;
    double server_us = 0, queue_us = 0, device_us = 0, rest_us = 0;
  } server_split;
  // The floor (options.floor): sizes of one request and one answer as sent.
  struct Floor {
    bool measured = false;
    int64_t request_bytes = 0;
    int64_t reply_bytes = 0;
    int64_t calls = 0;
    double calls_per_second = 0;
    LatencySummary latency_ms;
    int64_t errors = 0;
    std::string first_error;
  } floor;
  // The slowest of those calls: when it started (seconds after the measured
  // window opened), which worker sent it, for which layer, and the
  // sequence's length then, so that an outlier can be matched with the
  // server's slow-call warning and with what the run was doing at the time.
  struct SlowestCall {
    double ms = 0.0;
    double started_s = 0.0;
    int worker = -1;  // -1: no measured call
    int layer = 0;
    int64_t sequence_len = 0;
  } slowest;
  std::map<std::string, int64_t> errors;  // by gRPC code name, all phases
  // The same failures by RPC ("Verify", "AppendKv", ...) and code.
  std::map<std::string, std::map<std::string, int64_t>> errors_by_rpc;
  // One of the counted failures in full ("AppendKv: UNAVAILABLE: ..."): the
  // first a worker met, from the lowest-numbered worker that met one.
  std::string first_error;
  int64_t total_errors = 0;
  int64_t free_pages_before = 0;
  int64_t free_pages_after = 0;
  bool page_leak = false;  // free pages after release != before, same server instance
  // Why the page count could not be checked at the end (the server did not
  // answer, or a restarted server answered); empty when it was checked.
  std::string pages_unchecked;
  // Per target, in the order given. With several targets a replica that went
  // down or restarted during the run is `lost`: its sequences went with it,
  // the calls that failed on it are counted here (not in `errors`), and the
  // run went on with the others.
  struct Replica {
    std::string target;
    int64_t sequences_created = 0;
    int64_t free_pages_before = 0;
    int64_t free_pages_after = -1;  // -1: not checked (lost)
    bool page_leak = false;
    bool lost = false;
    std::string lost_reason;
    int64_t errors_while_down = 0;
    std::string first_error;
  };
  std::vector<Replica> replicas;
  bool any_replica_lost() const {
    for (const Replica& r : replicas) {
      if (r.lost) return true;
    }
    return false;
  }
  bool unstable() const { return stability.asked && !stability.reached; }
  // An open loop (--rate) answered under kOpenLoopMinAnswered of the rate it
  // asked for: the figures describe a saturated server, not that rate.
  static constexpr double kOpenLoopMinAnswered = 0.8;
  bool rate_missed() const {
    return options.rate > 0 && calls_per_second < kOpenLoopMinAnswered * options.rate;
  }
  // No error, every page back, stable and at its rate: what PASS needs
  // besides every replica having stayed up.
  bool clean() const {
    return total_errors == 0 && !page_leak && pages_unchecked.empty() && !unstable() &&
           !rate_missed();
  }
  bool ok() const { return clean() && !any_replica_lost(); }
  // Finished on the replicas that stayed up, with no other error and every
  // page back on them, after losing at least one.
  bool survived_replica_loss() const { return any_replica_lost() && clean(); }
};

// Runs the load. INVALID_ARGUMENT for options that would never end or make
// no sense; RESOURCE_EXHAUSTED at once, before any sequence is made, when
// concurrency x items sequences of prompt + drafts tokens cannot fit the
// targets' free pages or live-sequence limits (the message gives the
// numbers). The server's errors during the run are counted in the report,
// not returned. Over several replicas each worker's sequences are placed by
// the ReplicaSet (most free pages) and every call goes to the owner; a
// replica lost during the run is reported, and the workers carry on with the
// others.
absl::StatusOr<LoadReport> RunLoad(ReplicaSet& replicas, const LoadOptions& options);

// Asks the RunLoad in progress to end as if its time were up (the workers
// stop after their call in flight; the run releases its sequences and shared
// memory and reports), and every later one to end before it starts
// (CANCELLED). Async-signal-safe. LoadStopRequested: whether it was asked.
void StopRunningLoad();
bool LoadStopRequested();

// Shared by `load` and `load --steps`:
// A worker's prompt staging for AppendKv: what --shm-staging-mib allows, no
// more than a prompt of `prompt_len` needs, at least one token of every layer.
uint64_t PromptStagingBytes(int layers, int64_t prompt_len, int64_t shm_staging_bytes);
// Unregisters system region `name` (a CUDA region when `cuda`) once no call
// or step of the server holds it any more: FAILED_PRECONDITION (held) is
// retried for up to 5 s. A call the client gave up on (its deadline), or a
// step's end, may lag the client's own view by that much.
absl::Status UnregisterWhenReleased(VerifyClient& client, const std::string& name, bool cuda);

// `--prompt-len` and `--drafts`: "N" (a fixed value: *high = 0) or "LOW:HIGH"
// with 0 <= LOW <= HIGH (a range drawn from uniformly). INVALID_ARGUMENT
// names `flag` and what was wrong.
absl::Status ParseValueOrRange(absl::string_view flag, absl::string_view text, int64_t* low,
                               int64_t* high);

void PrintLoadReport(const LoadReport& report);
nlohmann::ordered_json LoadReportToJson(const LoadReport& report);
// One CSV header and one row per report (a run of a sweep): the options that
// vary, rates, latency percentiles (the chosen ones too), errors, the floor.
std::string LoadReportsToCsv(const std::vector<LoadReport>& reports);

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_LOAD_H_
