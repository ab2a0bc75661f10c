#include "client/arrivals.h"

#include "absl/strings/str_cat.h"

namespace mlaverify::client {

absl::StatusOr<ArrivalProcess> ParseArrivalProcess(absl::string_view name) {
  if (name == "constant") return ArrivalProcess::kConstant;
  if (name == "poisson") return ArrivalProcess::kPoisson;
  if (name == "burst") return ArrivalProcess::kBurst;
  return absl::InvalidArgumentError(
      absl::StrCat("--arrivals ", std::string(name), ": need constant, poisson or burst"));
}

std::string ArrivalProcessName(ArrivalProcess process) {
  switch (process) {
    case ArrivalProcess::kConstant:
      return "constant";
    case ArrivalProcess::kPoisson:
      return "poisson";
    case ArrivalProcess::kBurst:
      return "burst";
  }
  return "unknown";
}

ArrivalSchedule::ArrivalSchedule(ArrivalProcess process, double rate, int burst_size, uint64_t seed)
    : process_(process),
      rate_(rate),
      burst_size_(burst_size < 1 ? 1 : burst_size),
      rng_(seed),
      gap_(rate) {}

double ArrivalSchedule::Next() {
  absl::MutexLock lock(&mu_);
  const int64_t slot = issued_++;
  switch (process_) {
    case ArrivalProcess::kConstant:
      return static_cast<double>(slot) / rate_;
    case ArrivalProcess::kBurst:
      // The burst's calls share its start; bursts come burst_size / rate apart.
      return static_cast<double>(slot / burst_size_ * burst_size_) / rate_;
    case ArrivalProcess::kPoisson:
      // The first call is due at the origin, as with the other processes.
      if (slot > 0) poisson_due_ += gap_(rng_);
      return poisson_due_;
  }
  return 0.0;
}

}  // namespace mlaverify::client
