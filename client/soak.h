// `mlaverify-client soak`: a long, checked, randomised run. `workers` threads
// each loop over whole sequence lifetimes (create, append a random prompt,
// a few verify steps of random trees with every layer's answer checked
// against the client's CPU reference, a random accepted path committed,
// release), and a share of the Verify calls is sent with a deadline too short
// to make it (the server must answer DEADLINE_EXCEEDED or CANCELLED, or the
// result, and stay consistent). The run fails on any other error, any wrong
// answer, or pages or sequences not back at the end.
#ifndef MLAVERIFY_CLIENT_SOAK_H_
#define MLAVERIFY_CLIENT_SOAK_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "nlohmann/json.hpp"

namespace mlaverify::client {

struct SoakOptions {
  int workers = 8;
  double duration_s = 60;
  int64_t max_prompt_len = 64;  // prompts of 1..max tokens
  int max_steps = 3;            // steps per sequence, 1..max
  int drafts = 8;               // N of 1..drafts per step (capped by the server)
  double cut_fraction = 0.05;   // Verify calls sent with a short deadline
  // The short deadlines: d, 4d and 16d, picked at random per cut call, so
  // calls end while queued, while running and just after answering.
  absl::Duration cut_deadline = absl::Microseconds(300);
  uint64_t seed = 1;
  int reference_threads = 1;
};

struct SoakReport {
  double seconds = 0;
  int64_t sequences = 0;
  int64_t verify_calls = 0;
  int64_t checked_items = 0;
  int64_t cut_calls = 0;     // sent with the short deadline
  int64_t cut_answered = 0;  // of those, answered in time (and checked)
  int64_t commits = 0;
  double max_rel_err = 0;
  std::map<std::string, int64_t> unexpected;  // error kind -> count
  std::string first_unexpected;
  int64_t free_pages_before = 0, free_pages_after = 0;
  int64_t live_before = 0, live_after = 0;
  bool ok() const {
    return unexpected.empty() && free_pages_after == free_pages_before && live_after == live_before;
  }
};

// Runs the soak through `client`; the cut-short calls go through three more
// clients to `target` made from `client_options` with the short deadlines.
// INVALID_ARGUMENT for bad options; the report says whether the run passed.
absl::StatusOr<SoakReport> RunSoak(VerifyClient& client, const std::string& target,
                                   const ClientOptions& client_options, const SoakOptions& options);

void PrintSoakReport(const SoakReport& report);
nlohmann::ordered_json SoakReportToJson(const SoakReport& report);

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_SOAK_H_
