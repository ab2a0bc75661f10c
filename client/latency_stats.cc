#include "client/latency_stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace mlaverify::client {

double Percentile(absl::Span<const double> sorted, double p) {
  if (sorted.empty()) return 0.0;
  const int64_t n = static_cast<int64_t>(sorted.size());
  // The rank is computed in integers of 1/1000 percent, so p = 99.9 on 1000
  // samples is rank 999 and not 1000 through a rounding error in p * n.
  const int64_t p_milli = std::llround(std::clamp(p, 0.0, 100.0) * 1000.0);
  const int64_t rank = (p_milli * n + 100000 - 1) / 100000;  // ceil(p/100 * n)
  return sorted[std::clamp<int64_t>(rank, 1, n) - 1];
}

LatencySummary Summarize(std::vector<double> samples) {
  LatencySummary summary;
  if (samples.empty()) return summary;
  std::sort(samples.begin(), samples.end());
  summary.count = static_cast<int64_t>(samples.size());
  summary.mean = std::accumulate(samples.begin(), samples.end(), 0.0) / samples.size();
  summary.p50 = Percentile(samples, 50.0);
  summary.p90 = Percentile(samples, 90.0);
  summary.p99 = Percentile(samples, 99.0);
  summary.p999 = Percentile(samples, 99.9);
  summary.max = samples.back();
  return summary;
}

}  // namespace mlaverify::client
