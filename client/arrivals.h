// When an open loop's Verify calls are due (`mlaverify-client load --rate`):
// at a constant rate, as a Poisson process of that mean rate (independent
// arrivals, as many schedulers' requests merge into), or in bursts of K calls
// at once every K/rate seconds (a batch of schedulers stepping together).
// Every process keeps the mean rate; only the spacing differs. Pure and
// seeded, so a run and its test are reproducible.
#ifndef MLAVERIFY_CLIENT_ARRIVALS_H_
#define MLAVERIFY_CLIENT_ARRIVALS_H_

#include <cstdint>
#include <random>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace mlaverify::client {

enum class ArrivalProcess { kConstant, kPoisson, kBurst };

// "constant", "poisson" or "burst"; INVALID_ARGUMENT names the choices.
absl::StatusOr<ArrivalProcess> ParseArrivalProcess(absl::string_view name);
std::string ArrivalProcessName(ArrivalProcess process);

// The due times of an open loop's calls, in order, in seconds after the
// loop's origin. Thread-safe: the workers take the next slot as they free up.
class ArrivalSchedule {
 public:
  // rate > 0 calls per second; burst_size >= 1 (kBurst only).
  ArrivalSchedule(ArrivalProcess process, double rate, int burst_size, uint64_t seed);

  // The next call's due time. Constant and burst slots are computed from the
  // slot's index (no drift over millions of calls); Poisson ones add an
  // exponential gap of mean 1/rate to the last.
  double Next();

 private:
  const ArrivalProcess process_;
  const double rate_;
  const int burst_size_;
  absl::Mutex mu_;
  int64_t issued_ ABSL_GUARDED_BY(mu_) = 0;
  double poisson_due_ ABSL_GUARDED_BY(mu_) = 0.0;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  std::exponential_distribution<double> gap_ ABSL_GUARDED_BY(mu_);
};

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_ARRIVALS_H_
