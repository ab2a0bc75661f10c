// Exact latency percentiles from recorded samples (no histogram buckets):
// the load generator keeps every sample, so the numbers it reports are the
// samples' own order statistics.
#ifndef MLAVERIFY_CLIENT_LATENCY_STATS_H_
#define MLAVERIFY_CLIENT_LATENCY_STATS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "nlohmann/json.hpp"

namespace mlaverify::client {

// Nearest-rank percentile of ascending `sorted` samples: the smallest sample
// such that at least p% of the samples are <= it (rank ceil(p/100 * n),
// 1-based, at least 1). p in [0, 100]; 0 for no samples.
double Percentile(absl::Span<const double> sorted, double p);

// A histogram bucket: samples in (previous bucket's upper, upper].
struct HistogramBucket {
  double upper = 0.0;
  int64_t count = 0;
};

struct LatencySummary {
  int64_t count = 0;
  double mean = 0.0;
  double p50 = 0.0;
  double p90 = 0.0;
  double p95 = 0.0;
  double p99 = 0.0;
  double p999 = 0.0;
  double max = 0.0;
  // The percentiles asked for besides those above: (p, value).
  std::vector<std::pair<double, double>> chosen;
  // Buckets with samples only, ascending; bounds 2^(k/4) of the unit (four
  // per doubling, each bound 19% above the last), so that any latency from
  // microseconds to minutes lands within 19% of its bucket's bound.
  std::vector<HistogramBucket> histogram;
};

// Sorts `samples` (any unit; the summary keeps it) and summarises them,
// with the nearest-rank value of each of `percentiles` (each in [0, 100]).
LatencySummary Summarize(std::vector<double> samples, absl::Span<const double> percentiles = {});

// "p99.5" -> "p99_5": the JSON and CSV name of a chosen percentile.
std::string PercentileKey(double p);

// count, mean, p50, p90, p95, p99, p99_9, max and each chosen percentile by
// its PercentileKey (the histogram is left to the caller).
nlohmann::ordered_json LatencySummaryToJson(const LatencySummary& l);

// The histogram of ascending `sorted` samples (see LatencySummary).
std::vector<HistogramBucket> Histogram(absl::Span<const double> sorted);

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_LATENCY_STATS_H_
