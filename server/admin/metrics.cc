#include "server/admin/metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "prometheus/client_metric.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace mlaverify::admin {
namespace {

// 10 µs .. 10 s, four buckets a decade (1, 2, 3, 5; no neighbours more than
// 2x apart): a CPU-backend Verify of one short sequence finishes in tens of
// microseconds and a GPU Verify in a few hundred, where a coarser grid would
// hide a doubling; a large batch on a loaded server or a Commit waiting behind
// it can take seconds. (Round mantissas also print exactly: prometheus-cpp
// writes 16 digits, which turns 0.56 into 0.5600000000000001.)
const std::vector<double>& DurationBuckets() {
  static const auto* const kBuckets = [] {
    auto* buckets = new std::vector<double>;
    for (int exponent = -5; exponent <= 0; ++exponent) {
      for (const char* mantissa : {"1", "2", "3", "5"}) {
        // From the decimal text, so that the bound is the double nearest to
        // it and prints as such ("3e-05"), not as a product's rounding.
        buckets->push_back(std::strtod(absl::StrCat(mantissa, "e", exponent).c_str(), nullptr));
      }
    }
    buckets->push_back(10);
    return buckets;
  }();
  return *kBuckets;
}

// 5 µs .. 1 s, five buckets a decade: the parts of one Verify (queue wait,
// device time per batch) are tens of microseconds on a GPU.
const std::vector<double>& FineBuckets() {
  static const auto* const kBuckets = new std::vector<double>{
      5e-6, 1e-5,   1.5e-5, 2e-5, 3e-5, 5e-5,   7.5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 5e-4, 7.5e-4,
      1e-3, 1.5e-3, 2e-3,   3e-3, 5e-3, 7.5e-3, 1e-2,   2e-2, 5e-2,   0.1,  0.25, 0.5,  1};
  return *kBuckets;
}

const std::vector<double>& BatchSizeBuckets() {
  static const auto* const kBuckets =
      new std::vector<double>{1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256};
  return *kBuckets;
}

prometheus::Gauge& AddGauge(prometheus::Registry& registry, const std::string& name,
                            const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry).Add({});
}

prometheus::Counter& AddCounter(prometheus::Registry& registry, const std::string& name,
                                const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add({});
}

prometheus::MetricFamily OneValue(const std::string& name, const std::string& help,
                                  prometheus::MetricType type, double value) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = type;
  prometheus::ClientMetric metric;
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family.metric.push_back(std::move(metric));
  return family;
}

// The fields of /proc/self/stat after the command name (which may hold spaces
// and parentheses, hence the last ')'); index 0 is field 3, the state.
std::vector<std::string> ProcSelfStatFields() {
  std::string text;
  if (FILE* file = std::fopen("/proc/self/stat", "r")) {
    char buf[1024];
    const size_t n = std::fread(buf, 1, sizeof(buf), file);
    std::fclose(file);
    text.assign(buf, n);
  }
  const size_t paren = text.rfind(')');
  if (paren == std::string::npos) return {};
  return absl::StrSplit(text.substr(paren + 1), ' ', absl::SkipWhitespace());
}

// Field `number` of /proc/self/stat as proc(5) numbers them (1-based).
double StatField(const std::vector<std::string>& fields, int number) {
  const size_t index = static_cast<size_t>(number - 3);
  return index < fields.size() ? std::strtod(fields[index].c_str(), nullptr) : 0;
}

// The machine's boot time (btime of /proc/stat), in seconds since the epoch.
double BootTimeSeconds() {
  double btime = 0;
  if (FILE* file = std::fopen("/proc/stat", "r")) {
    char line[256];
    while (std::fgets(line, sizeof(line), file) != nullptr) {
      if (std::strncmp(line, "btime ", 6) == 0) {
        btime = std::strtod(line + 6, nullptr);
        break;
      }
    }
    std::fclose(file);
  }
  return btime;
}

// Open file descriptors: the entries of /proc/self/fd, less the one the
// listing itself holds open.
int OpenFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  int entries = 0;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++entries;
  }
  closedir(dir);
  return std::max(0, entries - 1);
}

}  // namespace

Metrics::Metrics() : registry_(std::make_shared<prometheus::Registry>()) {
  prometheus::Registry& r = *registry_;
  requests_family_ = &prometheus::BuildCounter()
                          .Name("mlaverify_requests_total")
                          .Help("RPCs finished, by method and gRPC status code.")
                          .Register(r);
  errors_family_ = &prometheus::BuildCounter()
                        .Name("mlaverify_request_errors_total")
                        .Help("RPCs finished with a status other than OK, by method and code.")
                        .Register(r);
  duration_family_ = &prometheus::BuildHistogram()
                          .Name("mlaverify_request_duration_seconds")
                          .Help("Wall time of RPC handlers in seconds, by method.")
                          .Register(r);
  verify_batches_family_ =
      &prometheus::BuildCounter()
           .Name("mlaverify_verify_batches_total")
           .Help(
               "Verify batches run by the backend; path=graph replayed a CUDA graph, "
               "path=eager launched directly.")
           .Register(r);
  build_info_family_ = &prometheus::BuildGauge()
                            .Name("mlaverify_build_info")
                            .Help("Always 1; the labels name the server version and backend.")
                            .Register(r);

  bucket_family_ =
      &prometheus::BuildCounter()
           .Name("mlaverify_verify_graph_bucket_total")
           .Help("CUDA-graph replays by the (batch, draft) bucket the batch was padded to.")
           .Register(r);
  device_seconds_family_ = &prometheus::BuildHistogram()
                                .Name("mlaverify_device_batch_seconds")
                                .Help("Device time of one verify batch (CUDA events), by device.")
                                .Register(r);
  device_faults_family_ =
      &prometheus::BuildCounter()
           .Name("mlaverify_device_faults_total")
           .Help("Device faults (after one, the device refuses all work), by device.")
           .Register(r);
  oversized_requests_family_ =
      &prometheus::BuildCounter()
           .Name("mlaverify_oversized_requests_total")
           .Help(
               "Requests over the server's max_message_bytes answered RESOURCE_EXHAUSTED (a "
               "stream stays open), by RPC.")
           .Register(r);
  // At 0 from the start, for every RPC that carries a request body.
  for (const char* rpc : {"GetServerInfo", "CreateSequence", "AppendKv", "Verify", "VerifyStream",
                          "Commit", "ReleaseSequence"}) {
    oversized_requests_family_->Add({{"rpc", rpc}});
  }
  pool_pages_family_ = &prometheus::BuildGauge()
                            .Name("mlaverify_pool_pages")
                            .Help(
                                "KV pages per pool (one per device in DP mode, one for all in TP "
                                "mode), by pool and state (used, free).")
                            .Register(r);
  batch_requests_ = &prometheus::BuildHistogram()
                         .Name("mlaverify_verify_batch_requests")
                         .Help("Requests (items) per verify batch a device ran: the batching.")
                         .Register(r)
                         .Add({}, BatchSizeBuckets());
  verify_rows_ = &AddCounter(r, "mlaverify_verify_rows_total",
                             "Draft tokens (rows) of verify batches the devices ran.");
  padded_rows_ = &AddCounter(r, "mlaverify_verify_padded_rows_total",
                             "Padding rows: graph bucket rows minus the batch's draft tokens.");
  plan_reused_ = &AddCounter(r, "mlaverify_verify_plan_reused_total",
                             "Verify batches that reused the previous launch's plan.");
  auto& split = prometheus::BuildHistogram()
                    .Name("mlaverify_verify_server_seconds")
                    .Help(
                        "Server time of a Verify call by part: queue (waiting for a device), "
                        "device (its batch's device time), other (checks, staging copies, "
                        "completion).")
                    .Register(r);
  server_queue_seconds_ = &split.Add({{"part", "queue"}}, FineBuckets());
  server_device_seconds_ = &split.Add({{"part", "device"}}, FineBuckets());
  server_other_seconds_ = &split.Add({{"part", "other"}}, FineBuckets());
  queued_calls_ = &AddGauge(r, "mlaverify_queued_calls", "Calls admitted and not finished.");
  queued_bytes_ = &AddGauge(r, "mlaverify_queued_bytes", "Tensor bytes held by those calls.");
  staging_bytes_ = &AddGauge(r, "mlaverify_host_staging_bytes",
                             "Page-locked host staging for inline tensors (--pinned-staging-bytes; "
                             "0 on the CPU backend).");
  staging_in_use_ =
      &AddGauge(r, "mlaverify_host_staging_in_use_bytes", "Of it, bytes held by calls in flight.");
  // Both paths exist from the start so that dashboards and rate() see an
  // explicit zero rather than a missing series.
  verify_batches_eager_ = &verify_batches_family_->Add({{"path", "eager"}});
  verify_batches_graph_ = &verify_batches_family_->Add({{"path", "graph"}});
  ready_ = &AddGauge(r, "mlaverify_ready",
                     "1 while the server accepts work, 0 while starting or draining.");
  kv_pages_total_ = &AddGauge(r, "mlaverify_kv_pages_capacity", "KV pool capacity in pages.");
  kv_pages_used_ = &AddGauge(r, "mlaverify_kv_pages_used", "KV pages held by sequences.");
  kv_pages_free_ = &AddGauge(r, "mlaverify_kv_pages_free", "KV pages on the free list.");
  kv_row_bytes_family_ = &prometheus::BuildGauge()
                              .Name("mlaverify_kv_row_bytes")
                              .Help(
                                  "Bytes of one token's latent KV row of one layer in the pool, "
                                  "by dtype (--kv-dtype: bf16 1152, fp8 656).")
                              .Register(r);
  shm_regions_ = &AddGauge(r, "mlaverify_shm_regions",
                           "Client shared-memory regions registered (--allow-client-shm).");
  shm_bytes_ = &AddGauge(r, "mlaverify_shm_registered_bytes",
                         "Bytes of the registered shared-memory regions together.");
  sequences_live_ = &AddGauge(r, "mlaverify_sequences_live", "Sequences created and not released.");
  verify_steps_pending_ =
      &AddGauge(r, "mlaverify_verify_steps_pending",
                "Sequences with an open verify step (verified, not committed).");

  steps_ended_family_ =
      &prometheus::BuildCounter()
           .Name("mlaverify_device_steps_ended_total")
           .Help(
               "Device-driven verify steps ended, by outcome (committed, aborted) "
               "and the abort's reason (none when committed).")
           .Register(r);
  // At 0 from the start: rate() and alerts see every outcome.
  steps_ended_family_->Add({{"outcome", "committed"}, {"reason", "none"}});
  for (int k = 1; k < engine::kStepAbortReasons; ++k) {
    steps_ended_family_->Add(
        {{"outcome", "aborted"},
         {"reason", engine::StepAbortReasonName(static_cast<engine::StepAbortReason>(k))}});
  }
  step_seconds_ =
      &prometheus::BuildHistogram()
           .Name("mlaverify_device_step_seconds")
           .Help("A device-driven step from OpenStep to its end (last Commit or abort).")
           .Register(r)
           .Add({}, FineBuckets());
  step_layer_device_seconds_ =
      &prometheus::BuildHistogram()
           .Name("mlaverify_device_step_layer_seconds")
           .Help("Device time of one layer of a device-driven step on one rank, gather to scatter.")
           .Register(r)
           .Add({}, FineBuckets());
  step_layer_doorbell_wait_seconds_ =
      &prometheus::BuildHistogram()
           .Name("mlaverify_device_step_doorbell_wait_seconds")
           .Help(
               "Time from a step's previous layer's scatter start to this layer's gather start "
               "(0 for the first layer): the scheduler's own work between layers.")
           .Register(r)
           .Add({}, FineBuckets());
  steps_open_ = &AddGauge(r, "mlaverify_device_steps_open", "Device-driven steps open now.");
  step_lanes_ = &AddGauge(r, "mlaverify_step_lanes", "Step lanes over all devices (--step-lanes).");
  step_lanes_busy_ =
      &AddGauge(r, "mlaverify_step_lanes_busy", "Step lanes running a step or running one out.");
  steps_opened_ =
      &AddCounter(r, "mlaverify_device_steps_opened_total", "Device-driven steps opened.");

  using engine::EngineStats;
  const struct {
    const char* name;
    const char* help;
    int64_t EngineStats::*field;
  } kMirrored[] = {
      {"mlaverify_tokens_appended_total", "Prompt tokens written by AppendKv.",
       &EngineStats::tokens_appended_total},
      {"mlaverify_tokens_committed_total", "Draft tokens accepted by Commit.",
       &EngineStats::tokens_committed_total},
      {"mlaverify_steps_committed_total", "Verify steps closed by Commit.",
       &EngineStats::steps_committed_total},
      {"mlaverify_sequences_created_total", "Sequences created.",
       &EngineStats::sequences_created_total},
      {"mlaverify_sequences_expired_total", "Sequences released by the idle timeout.",
       &EngineStats::sequences_expired_total},
      {"mlaverify_verify_items_total", "Verify items (one sequence and layer each) computed.",
       &EngineStats::verify_items_total},
      {"mlaverify_verify_draft_tokens_total", "Draft tokens over all computed Verify items.",
       &EngineStats::drafts_verified_total},
  };
  static_assert(std::size(kMirrored) == kMirroredTotals,
                "one MirroredCounter per mirrored engine total");
  absl::MutexLock lock(&refresh_mu_);
  for (size_t i = 0; i < std::size(kMirrored); ++i) {
    mirrored_[i].counter = &AddCounter(r, kMirrored[i].name, kMirrored[i].help);
    mirrored_[i].field = kMirrored[i].field;
  }
}

Metrics::~Metrics() = default;

// Returns a copy: flat_hash_map moves its values on rehash, so a reference
// would dangle once the lock is dropped.
Metrics::RpcSeries Metrics::SeriesFor(absl::string_view rpc, absl::string_view code) {
  std::string key = absl::StrCat(rpc, "\n", code);
  {
    absl::ReaderMutexLock lock(&series_mu_);
    auto it = series_.find(key);
    if (it != series_.end()) return it->second;
  }
  RpcSeries series;
  const std::string rpc_str(rpc);
  const std::string code_str(code);
  series.requests = &requests_family_->Add({{"rpc", rpc_str}, {"code", code_str}});
  if (code != "OK") {
    series.errors = &errors_family_->Add({{"rpc", rpc_str}, {"code", code_str}});
  }
  series.duration = &duration_family_->Add({{"rpc", rpc_str}}, DurationBuckets());
  absl::MutexLock lock(&series_mu_);
  // A racing first call may have inserted the same series; Family::Add
  // returned the same metrics to both, so either entry is right.
  return series_.try_emplace(std::move(key), series).first->second;
}

void Metrics::RecordRpc(absl::string_view rpc, absl::string_view code, double seconds) {
  const RpcSeries series = SeriesFor(rpc, code);
  series.requests->Increment();
  if (series.errors != nullptr) series.errors->Increment();
  series.duration->Observe(seconds < 0 ? 0 : seconds);
}

void Metrics::RecordBatch(const engine::BatchReport& report, absl::string_view device) {
  (report.graph ? verify_batches_graph_ : verify_batches_eager_)->Increment();
  batch_requests_->Observe(report.requests);
  verify_rows_->Increment(report.rows);
  if (report.reused_plan) plan_reused_->Increment();
  prometheus::Counter* bucket = nullptr;
  prometheus::Histogram* seconds = nullptr;
  {
    absl::MutexLock lock(&labelled_mu_);
    if (report.graph) {
      padded_rows_->Increment(report.shape.rows() - report.rows);
      const std::string key = absl::StrCat(report.shape.batch, "x", report.shape.draft_len);
      auto [it, added] = buckets_.try_emplace(key, nullptr);
      if (added) {
        it->second = &bucket_family_->Add({{"batch_bucket", absl::StrCat(report.shape.batch)},
                                           {"draft_bucket", absl::StrCat(report.shape.draft_len)}});
      }
      bucket = it->second;
    }
    auto [it, added] = device_seconds_.try_emplace(std::string(device), nullptr);
    if (added)
      it->second = &device_seconds_family_->Add({{"device", std::string(device)}}, FineBuckets());
    seconds = it->second;
  }
  if (bucket != nullptr) bucket->Increment();
  seconds->Observe(report.device_seconds);
}

void Metrics::RecordVerifyTiming(const engine::VerifyTiming& t) {
  server_queue_seconds_->Observe(t.queue_seconds);
  server_device_seconds_->Observe(t.device_seconds);
  server_other_seconds_->Observe(
      std::max(0.0, t.total_seconds - t.queue_seconds - t.device_seconds));
}

void Metrics::DeclareDevices(const std::vector<std::string>& devices) {
  for (const std::string& device : devices) device_faults_family_->Add({{"device", device}});
}

void Metrics::RecordDeviceFault(absl::string_view device) {
  device_faults_family_->Add({{"device", std::string(device)}}).Increment();
}

void Metrics::RecordOversizedRequest(absl::string_view rpc) {
  oversized_requests_family_->Add({{"rpc", std::string(rpc)}}).Increment();
}

void Metrics::SetStatsSource(std::function<engine::EngineStats()> source) {
  absl::MutexLock lock(&refresh_mu_);
  stats_source_ = std::move(source);
  // The new source's totals count from zero: its whole total is new to the
  // mirrored counters.
  for (MirroredCounter& m : mirrored_) m.last_seen = 0;
}

void Metrics::SetSharedMemorySource(std::function<SharedMemoryUsage()> source) {
  absl::MutexLock lock(&refresh_mu_);
  shm_source_ = std::move(source);
}

void Metrics::SetInfo(absl::string_view version, absl::string_view backend) {
  absl::MutexLock lock(&info_mu_);
  if (build_info_ != nullptr) build_info_family_->Remove(build_info_);
  build_info_ = &build_info_family_->Add(
      {{"version", std::string(version)}, {"backend", std::string(backend)}});
  build_info_->Set(1);
}

void Metrics::SetReady(bool ready) { ready_->Set(ready ? 1 : 0); }

void Metrics::RecordStep(const engine::StepReport& report) {
  const bool committed = report.state == engine::StepState::kCommitted;
  steps_ended_family_
      ->Add({{"outcome", committed ? "committed" : "aborted"},
             {"reason", engine::StepAbortReasonName(report.abort_reason)}})
      .Increment();
  step_seconds_->Observe(report.seconds);
  for (const engine::LayerTiming& layer : report.layers) {
    step_layer_device_seconds_->Observe(layer.device_seconds);
    step_layer_doorbell_wait_seconds_->Observe(layer.doorbell_wait_seconds);
  }
}

void Metrics::RefreshFromEngine() {
  absl::MutexLock lock(&refresh_mu_);
  if (shm_source_) {
    const SharedMemoryUsage shm = shm_source_();
    shm_regions_->Set(static_cast<double>(shm.regions));
    shm_bytes_->Set(static_cast<double>(shm.bytes));
  }
  if (!stats_source_) return;
  const engine::EngineStats stats = stats_source_();
  kv_pages_total_->Set(static_cast<double>(stats.total_pages));
  kv_pages_used_->Set(static_cast<double>(stats.total_pages - stats.free_pages));
  kv_pages_free_->Set(static_cast<double>(stats.free_pages));
  if (kv_row_bytes_ == nullptr) {
    kv_row_bytes_ = &kv_row_bytes_family_->Add({{"dtype", KvDtypeName(stats.kv_dtype)}});
  }
  kv_row_bytes_->Set(static_cast<double>(stats.kv_row_bytes));
  sequences_live_->Set(static_cast<double>(stats.live_sequences));
  verify_steps_pending_->Set(static_cast<double>(stats.pending_steps));
  queued_calls_->Set(static_cast<double>(stats.queued_calls));
  queued_bytes_->Set(static_cast<double>(stats.queued_bytes));
  staging_bytes_->Set(static_cast<double>(stats.staging_bytes));
  staging_in_use_->Set(static_cast<double>(stats.staging_bytes_in_use));
  for (const engine::PoolStats& pool : stats.pools) {
    pool_pages_family_->Add({{"pool", pool.devices}, {"state", "used"}})
        .Set(static_cast<double>(pool.total_pages - pool.free_pages));
    pool_pages_family_->Add({{"pool", pool.devices}, {"state", "free"}})
        .Set(static_cast<double>(pool.free_pages));
  }
  steps_open_->Set(static_cast<double>(stats.steps.open));
  step_lanes_->Set(static_cast<double>(stats.steps.lanes));
  step_lanes_busy_->Set(static_cast<double>(stats.steps.lanes_busy));
  if (stats.steps.opened_total > steps_opened_seen_) {
    steps_opened_->Increment(static_cast<double>(stats.steps.opened_total - steps_opened_seen_));
  }
  steps_opened_seen_ = stats.steps.opened_total;
  // prometheus-cpp counters only go up, so a mirrored total advances by what
  // the engine added since the last refresh. A total that went down (not
  // expected from one engine) becomes the new baseline rather than a
  // decrement, so the exported counter stays monotonic.
  for (MirroredCounter& m : mirrored_) {
    const int64_t total = stats.*m.field;
    if (total > m.last_seen) m.counter->Increment(static_cast<double>(total - m.last_seen));
    m.last_seen = total;
  }
}

std::vector<prometheus::MetricFamily> ProcessMetrics() {
  using prometheus::MetricType;
  const std::vector<std::string> stat = ProcSelfStatFields();
  static const double kTicksPerSecond = static_cast<double>(sysconf(_SC_CLK_TCK));
  static const double kPageBytes = static_cast<double>(sysconf(_SC_PAGESIZE));
  // Fixed for the life of the process: read once.
  static const double kStartTime = BootTimeSeconds() + StatField(stat, 22) / kTicksPerSecond;
  rlimit fds{};
  getrlimit(RLIMIT_NOFILE, &fds);
  std::vector<prometheus::MetricFamily> families;
  families.push_back(
      OneValue("process_cpu_seconds_total", "User and system CPU time of the process in seconds.",
               MetricType::Counter, (StatField(stat, 14) + StatField(stat, 15)) / kTicksPerSecond));
  families.push_back(OneValue("process_resident_memory_bytes", "Resident memory in bytes.",
                              MetricType::Gauge, StatField(stat, 24) * kPageBytes));
  families.push_back(OneValue("process_virtual_memory_bytes", "Virtual memory in bytes.",
                              MetricType::Gauge, StatField(stat, 23)));
  families.push_back(
      OneValue("process_open_fds", "Open file descriptors.", MetricType::Gauge, OpenFds()));
  families.push_back(OneValue(
      "process_max_fds", "Limit on open file descriptors (RLIMIT_NOFILE, soft).", MetricType::Gauge,
      fds.rlim_cur == RLIM_INFINITY ? -1 : static_cast<double>(fds.rlim_cur)));
  families.push_back(OneValue("process_start_time_seconds",
                              "Start time of the process since the Unix epoch in seconds.",
                              MetricType::Gauge, kStartTime));
  return families;
}

std::string Metrics::Serialize() {
  RefreshFromEngine();
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (prometheus::MetricFamily& family : ProcessMetrics()) families.push_back(std::move(family));
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace mlaverify::admin
