// `mlaverify-client load --steps`: the load generator in device-driven steps
// (docs/steps.md). `concurrency` workers, each a scheduler stand-in driving
// `items` sequences, open one step per decode step, ring and wait every
// layer through the doorbells (host slots in a system shared-memory region,
// or GPU doorbells on CUDA streams with the tensors in a CUDA region),
// optionally after a stand-in for the scheduler's own work between layers
// (--client-work-us: a busy kernel on every multiprocessor, or a host spin),
// then commit each item. Reports steps/s, the step's latency (open to the
// last commit: what a scheduler waits for per decode step), each layer's
// latency (ring to completion, the client's work excluded), the layers'
// span per step, the open and commit calls, and whether every page came
// back. One target.
#ifndef MLAVERIFY_CLIENT_STEP_LOAD_H_
#define MLAVERIFY_CLIENT_STEP_LOAD_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/latency_stats.h"
#include "client/load.h"
#include "nlohmann/json.hpp"

namespace mlaverify::client {

struct StepLoadReport {
  std::string target;
  LoadOptions options;
  // What ran: the server's geometry and identity, as GetServerInfo said.
  std::string server_version, backend, device, instance_id, parallel_mode;
  int num_layers = 0;
  int num_heads = 0;
  int heads_per_device = 0;
  int ranks = 0;
  int num_drafts = 0;
  double prompt_seconds = 0;  // every worker's first prompts appended, not timed
  double ramp_up_seconds = 0;
  double measured_seconds = 0;
  int64_t steps = 0;  // measured, committed
  int64_t items = 0;
  double steps_per_second = 0;
  double items_per_second = 0;
  LatencySummary step_ms;                 // OpenStep sent to the last Commit answered
  LatencySummary layer_us;                // one layer of one rank: ring to completion seen
  LatencySummary layers_ms;               // a step's first ring to its last completion
  LatencySummary open_ms;                 // the OpenStep call
  LatencySummary commit_ms;               // a step's Commit calls, together
  int64_t lane_waits = 0;                 // OpenStep refused for want of a free lane, retried
  std::map<std::string, int64_t> errors;  // by RPC and code, all phases
  std::string first_error;
  int64_t total_errors = 0;
  int64_t free_pages_before = 0;
  int64_t free_pages_after = 0;
  bool page_leak = false;
  bool ok() const { return total_errors == 0 && !page_leak && steps > 0; }
};

// INVALID_ARGUMENT for options that make no sense in steps (a rate, a
// stream, the floor, several targets), or a doorbell kind the server does
// not take; the server's errors during the run are counted in the report.
absl::StatusOr<StepLoadReport> RunStepLoad(VerifyClient& client, const LoadOptions& options);

void PrintStepLoadReport(const StepLoadReport& report);
nlohmann::ordered_json StepLoadReportToJson(const StepLoadReport& report);

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_STEP_LOAD_H_
