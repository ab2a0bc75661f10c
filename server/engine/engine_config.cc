#include "server/engine/engine_config.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/geometry.h"

namespace mlaverify::engine {
namespace {

// "num_heads = 7", or with a name from setting_names "--heads 7".
class SettingNamer {
 public:
  explicit SettingNamer(const std::map<std::string, std::string>& names) : names_(names) {}
  std::string Name(const std::string& field) const {
    auto it = names_.find(field);
    return it == names_.end() ? field : it->second;
  }
  template <typename T>
  std::string Is(const std::string& field, const T& value) const {
    auto it = names_.find(field);
    return it == names_.end() ? absl::StrCat(field, " = ", value)
                              : absl::StrCat(it->second, " ", value);
  }

 private:
  const std::map<std::string, std::string>& names_;
};

absl::Status CheckBuckets(const std::vector<int>& buckets, const std::string& field, int max_value,
                          const SettingNamer& n) {
  if (buckets.empty()) return absl::InvalidArgumentError(absl::StrCat(n.Name(field), " is empty"));
  for (size_t k = 0; k < buckets.size(); ++k) {
    if (buckets[k] < 1 || buckets[k] > max_value || (k > 0 && buckets[k] <= buckets[k - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat(n.Is(field, absl::StrCat("[", absl::StrJoin(buckets, ","), "]")),
                       ": need strictly increasing values in 1..", max_value));
    }
  }
  return absl::OkStatus();
}

}  // namespace

const char* ParallelModeName(ParallelMode mode) {
  return mode == ParallelMode::kDataParallel ? "dp" : "tp";
}

absl::Status EngineConfig::Validate(int num_devices) const {
  const SettingNamer n(setting_names);
  if (num_devices < 1) {
    return absl::InvalidArgumentError("no devices: the engine needs at least one");
  }
  if (num_layers < 1 || num_layers > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat(n.Is("num_layers", num_layers), ": need 1..1024"));
  }
  if (num_heads < 1 || num_heads > mlaverify::kMaxHeads) {
    return absl::InvalidArgumentError(
        absl::StrCat(n.Is("num_heads", num_heads), ": need 1..", mlaverify::kMaxHeads));
  }
  if (page_size < 1 || page_size > mlaverify::kMaxPageSize || (page_size & (page_size - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        n.Is("page_size", page_size), ": need a power of two in 1..", mlaverify::kMaxPageSize));
  }
  if (auto s = CheckBuckets(draft_buckets, "draft_buckets", mlaverify::kMaxDraftLen, n); !s.ok())
    return s;
  if (auto s = CheckBuckets(batch_buckets, "batch_buckets", mlaverify::kMaxBatch, n); !s.ok())
    return s;
  if (!(default_softmax_scale > 0.0f) || !std::isfinite(default_softmax_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        n.Is("default_softmax_scale", default_softmax_scale), ": need a finite value > 0"));
  }
  if (max_sequence_len < max_draft_len() + 1 || max_sequence_len > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(n.Is("max_sequence_len", max_sequence_len),
                                                   ": need ", max_draft_len() + 1, "..2^30"));
  }
  // Under a second the janitor (which looks every idle_timeout / 4) would
  // spin, and GetServerInfo, in whole seconds, would report 0 ("never").
  if (idle_timeout != absl::ZeroDuration() &&
      (idle_timeout < absl::Seconds(1) || idle_timeout > absl::Hours(24 * 365))) {
    return absl::InvalidArgumentError(
        absl::StrCat(n.Is("idle_timeout", absl::ToDoubleSeconds(idle_timeout)),
                     ": need 0 (never) or 1..31536000 seconds"));
  }
  if (num_pages() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(n.Is("pool_bytes", pool_bytes), " holds no page: one page of ", page_size,
                     " tokens x ", num_layers, " layers takes ", bytes_per_page(), " bytes"));
  }
  if (num_pages() > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        n.Name("pool_bytes"), " gives more than 2^31 pages: raise ", n.Name("page_size")));
  }
  if (parallel_mode == ParallelMode::kTensorParallel && num_heads % num_devices != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(n.Is("num_heads", num_heads), " does not split over ", num_devices,
                     " tensor-parallel devices: need a multiple of the device count"));
  }
  if (max_queue_delay < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat(n.Name("max_queue_delay"), " must not be negative"));
  }
  if (max_queued_calls < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(n.Is("max_queued_calls", max_queued_calls), ": need >= 1"));
  }
  if (max_queued_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(n.Is("max_queued_bytes", max_queued_bytes), ": need >= 1"));
  }
  if (max_live_sequences < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(n.Is("max_live_sequences", max_live_sequences), ": need >= 1"));
  }
  if (max_label_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(n.Name("max_label_bytes"), " must not be negative"));
  }
  if (batches_in_flight < 1 || batches_in_flight > 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(n.Is("batches_in_flight", batches_in_flight), ": need 1..8"));
  }
  if (pinned_staging_bytes < (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat(n.Is("pinned_staging_bytes", pinned_staging_bytes), ": need at least 1 MiB"));
  }
  if (copy_threads < 1 || copy_threads > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat(n.Is("copy_threads", copy_threads), ": need 1..64"));
  }
  // Each lane is a stream of its own on a GPU: with the worker's stream and
  // the release stream they stay within CUDA_DEVICE_MAX_CONNECTIONS (32),
  // so no lane's gated wait queues behind another stream's work.
  if (steps.lanes_per_device < 0 || steps.lanes_per_device > kMaxStepLanes) {
    return absl::InvalidArgumentError(absl::StrCat(
        n.Is("steps.lanes_per_device", steps.lanes_per_device), ": need 0..", kMaxStepLanes));
  }
  const auto check_timeout = [&](absl::Duration value, absl::Duration max,
                                 const char* field) -> absl::Status {
    if (value < absl::Milliseconds(1) || value > max) {
      return absl::InvalidArgumentError(absl::StrCat(n.Is(field, absl::FormatDuration(value)),
                                                     ": need 1 ms..", absl::FormatDuration(max)));
    }
    return absl::OkStatus();
  };
  if (auto s = check_timeout(steps.default_layer_timeout, steps.max_layer_timeout,
                             "steps.default_layer_timeout");
      !s.ok()) {
    return s;
  }
  if (auto s = check_timeout(steps.default_max_duration, steps.max_max_duration,
                             "steps.default_max_duration");
      !s.ok()) {
    return s;
  }
  return absl::OkStatus();
}

}  // namespace mlaverify::engine
