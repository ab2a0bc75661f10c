#include "client/latency_stats.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_format.h"

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

std::string PercentileKey(double p) {
  std::string key = absl::StrFormat("p%g", p);
  std::replace(key.begin(), key.end(), '.', '_');
  return key;
}

nlohmann::ordered_json LatencySummaryToJson(const LatencySummary& l) {
  nlohmann::ordered_json j = {{"count", l.count}, {"mean", l.mean}, {"p50", l.p50},
                              {"p90", l.p90},     {"p95", l.p95},   {"p99", l.p99},
                              {"p99_9", l.p999},  {"max", l.max}};
  for (const auto& [p, value] : l.chosen) j[PercentileKey(p)] = value;
  return j;
}

std::vector<HistogramBucket> Histogram(absl::Span<const double> sorted) {
  std::vector<HistogramBucket> buckets;
  for (double v : sorted) {
    // The smallest k with 2^(k/4) >= v; exact powers of two stay in their
    // own bucket despite rounding in log2.
    int k = static_cast<int>(std::ceil(4.0 * std::log2(std::max(v, 1e-9))));
    while (std::exp2((k - 1) / 4.0) >= v) --k;
    while (std::exp2(k / 4.0) < v) ++k;
    const double upper = std::exp2(k / 4.0);
    if (buckets.empty() || buckets.back().upper != upper) buckets.push_back({upper, 0});
    ++buckets.back().count;
  }
  return buckets;
}

LatencySummary Summarize(std::vector<double> samples, absl::Span<const double> percentiles) {
  LatencySummary summary;
  for (double p : percentiles) summary.chosen.push_back({p, 0.0});
  if (samples.empty()) return summary;
  std::sort(samples.begin(), samples.end());
  summary.count = static_cast<int64_t>(samples.size());
  summary.mean = std::accumulate(samples.begin(), samples.end(), 0.0) / samples.size();
  summary.p50 = Percentile(samples, 50.0);
  summary.p90 = Percentile(samples, 90.0);
  summary.p95 = Percentile(samples, 95.0);
  summary.p99 = Percentile(samples, 99.0);
  summary.p999 = Percentile(samples, 99.9);
  summary.max = samples.back();
  for (auto& [p, value] : summary.chosen) value = Percentile(samples, p);
  summary.histogram = Histogram(samples);
  return summary;
}

}  // namespace mlaverify::client
