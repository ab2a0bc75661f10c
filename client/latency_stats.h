// Exact latency percentiles from recorded samples (no histogram buckets):
// the load generator keeps every sample, so the numbers it reports are the
// samples' own order statistics.
#ifndef MLAVERIFY_CLIENT_LATENCY_STATS_H_
#define MLAVERIFY_CLIENT_LATENCY_STATS_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace mlaverify::client {

// Nearest-rank percentile of ascending `sorted` samples: the smallest sample
// such that at least p% of the samples are <= it (rank ceil(p/100 * n),
// 1-based, at least 1). p in [0, 100]; 0 for no samples.
double Percentile(absl::Span<const double> sorted, double p);

struct LatencySummary {
  int64_t count = 0;
  double mean = 0.0;
  double p50 = 0.0;
  double p90 = 0.0;
  double p99 = 0.0;
  double p999 = 0.0;
  double max = 0.0;
};

// Sorts `samples` (any unit; the summary keeps it) and summarises them.
LatencySummary Summarize(std::vector<double> samples);

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_LATENCY_STATS_H_
