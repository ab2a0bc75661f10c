// Prometheus metrics of one server process: RPC outcomes and latency recorded
// by the transport, verify batch counts, and engine page/sequence accounting
// pulled from the engine each time the metrics are scraped.
//
// Thread-safety: every method may be called from any thread. The Record*
// methods sit on the request path (Verify runs once per layer, so thousands of
// times a second): after the first call for a given rpc/code pair they take a
// reader lock and one hash lookup, then update the metrics (atomic adds and
// the histogram's own short lock).
#ifndef MLAVERIFY_SERVER_ADMIN_METRICS_H_
#define MLAVERIFY_SERVER_ADMIN_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/engine/engine.h"
#include "server/engine/engine_observer.h"

namespace prometheus {
class Counter;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
struct MetricFamily;
}  // namespace prometheus

namespace mlaverify::admin {

// The standard process metrics of Prometheus clients (prometheus-cpp 1.0 has
// no collector for them), read from /proc/self/stat, /proc/self/fd and
// getrlimit at each call: process_cpu_seconds_total,
// process_resident_memory_bytes, process_virtual_memory_bytes,
// process_open_fds, process_max_fds (-1: unlimited) and
// process_start_time_seconds. Linux only; a field /proc does not give is 0.
std::vector<prometheus::MetricFamily> ProcessMetrics();

class Metrics {
 public:
  Metrics();
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // One finished RPC. `rpc` is the method name ("Verify"), `code` the gRPC
  // status code name ("OK", "INVALID_ARGUMENT"), `seconds` the handler's wall
  // time. Counts mlaverify_requests_total{rpc,code}, observes
  // mlaverify_request_duration_seconds{rpc} and, for every code but "OK",
  // mlaverify_request_errors_total{rpc,code}.
  void RecordRpc(absl::string_view rpc, absl::string_view code, double seconds);

  // One verify batch a device ran (engine::EngineObserver::OnBatch):
  // mlaverify_verify_batches_total{path} ("graph": a CUDA graph replay padded
  // to its bucket, "eager": launched with its exact shape), the batch-size
  // histogram, the bucket counts of graph replays, rows and padded rows,
  // plan reuse, and the device time per batch, by device.
  void RecordBatch(const engine::BatchReport& report, absl::string_view device);

  // One finished Verify call's server-side split (queue wait, device time,
  // the rest): mlaverify_verify_server_seconds{part}.
  void RecordVerifyTiming(const engine::VerifyTiming& timing);

  // A device-driven step ended (engine::EngineObserver::OnStepEnded):
  // mlaverify_device_steps_ended_total{outcome,reason} (outcome committed or
  // aborted; reason the abort's, "none" when committed), the step's seconds
  // from open to end, and per layer its device time and the time it waited
  // for its doorbell (the scheduler's own compute between layers).
  void RecordStep(const engine::StepReport& report);

  // A device faulted: mlaverify_device_faults_total{device}.
  void RecordDeviceFault(absl::string_view device);
  // Creates each device's fault series at 0, so that an alert's increase()
  // sees the first fault (a series born at 1 shows no increase).
  void DeclareDevices(const std::vector<std::string>& devices);
  // A request over --max-message-bytes: mlaverify_oversized_requests_total{rpc}.
  void RecordOversizedRequest(absl::string_view rpc);

  // Where engine accounting comes from; called on every Serialize(), from the
  // scraping thread, while an internal mutex is held, so it must be cheap and
  // must not call back into this object. Replacing the source keeps the
  // mirrored counters where they are and adds the new source's totals on top
  // (counters never go down). An empty function stops the refresh.
  void SetStatsSource(std::function<engine::EngineStats()> source);

  // Client shared-memory regions registered now and their bytes
  // (mlaverify_shm_regions, mlaverify_shm_registered_bytes), read on every
  // Serialize() like the engine's stats; same rules for the function.
  struct SharedMemoryUsage {
    int64_t regions = 0;
    int64_t bytes = 0;
  };
  void SetSharedMemorySource(std::function<SharedMemoryUsage()> source);

  // mlaverify_build_info{version,backend} 1. A later call replaces the labels.
  void SetInfo(absl::string_view version, absl::string_view backend);

  // mlaverify_ready: 1 while the server accepts work, 0 while starting or
  // draining (mirrors gRPC health and /readyz).
  void SetReady(bool ready);

  // Refreshes the engine-derived series from the stats source and returns
  // every metric in the Prometheus text exposition format 0.0.4, with the
  // process_* metrics read from /proc at the call (see ProcessMetrics).
  std::string Serialize();

 private:
  // The series one rpc/code pair touches; pointers into registry_, which owns
  // the metrics and keeps them at fixed addresses.
  struct RpcSeries {
    prometheus::Counter* requests = nullptr;
    prometheus::Counter* errors = nullptr;  // null for "OK"
    prometheus::Histogram* duration = nullptr;
  };

  // Engine totals exported as counters (listed in the constructor).
  static constexpr int kMirroredTotals = 7;

  // A counter that follows one monotonic engine total.
  struct MirroredCounter {
    prometheus::Counter* counter = nullptr;
    int64_t engine::EngineStats::*field = nullptr;
    int64_t last_seen = 0;  // the engine's total at the previous refresh
  };

  RpcSeries SeriesFor(absl::string_view rpc, absl::string_view code);
  void RefreshFromEngine();

  // Owns every metric below; declared first so it outlives the raw pointers.
  std::shared_ptr<prometheus::Registry> registry_;

  prometheus::Family<prometheus::Counter>* requests_family_;
  prometheus::Family<prometheus::Counter>* errors_family_;
  prometheus::Family<prometheus::Histogram>* duration_family_;
  prometheus::Family<prometheus::Counter>* verify_batches_family_;
  prometheus::Family<prometheus::Gauge>* build_info_family_;
  prometheus::Family<prometheus::Counter>* bucket_family_;
  prometheus::Family<prometheus::Histogram>* device_seconds_family_;
  prometheus::Family<prometheus::Counter>* device_faults_family_;
  prometheus::Family<prometheus::Counter>* oversized_requests_family_;
  prometheus::Family<prometheus::Gauge>* pool_pages_family_;

  prometheus::Counter* verify_batches_eager_;
  prometheus::Counter* verify_batches_graph_;
  prometheus::Histogram* batch_requests_;
  prometheus::Counter* verify_rows_;
  prometheus::Counter* padded_rows_;
  prometheus::Counter* plan_reused_;
  prometheus::Histogram* server_queue_seconds_;
  prometheus::Histogram* server_device_seconds_;
  prometheus::Histogram* server_other_seconds_;
  prometheus::Gauge* queued_calls_;
  prometheus::Gauge* queued_bytes_;
  prometheus::Gauge* staging_bytes_;
  prometheus::Gauge* staging_in_use_;
  prometheus::Gauge* ready_;
  prometheus::Gauge* kv_pages_total_;
  prometheus::Gauge* kv_pages_used_;
  prometheus::Gauge* kv_pages_free_;
  prometheus::Family<prometheus::Gauge>* kv_row_bytes_family_;
  prometheus::Gauge* kv_row_bytes_ ABSL_GUARDED_BY(refresh_mu_) = nullptr;
  prometheus::Gauge* sequences_live_;
  prometheus::Gauge* verify_steps_pending_;
  // Device-driven steps.
  prometheus::Family<prometheus::Counter>* steps_ended_family_;
  prometheus::Histogram* step_seconds_;
  prometheus::Histogram* step_layer_device_seconds_;
  prometheus::Histogram* step_layer_doorbell_wait_seconds_;
  prometheus::Gauge* steps_open_;
  prometheus::Gauge* step_lanes_;
  prometheus::Gauge* step_lanes_busy_;
  prometheus::Counter* steps_opened_;
  int64_t steps_opened_seen_ ABSL_GUARDED_BY(refresh_mu_) = 0;

  absl::Mutex series_mu_;
  // Key: rpc + '\n' + code (neither contains a newline).
  absl::flat_hash_map<std::string, RpcSeries> series_ ABSL_GUARDED_BY(series_mu_);

  // Per-label series created on first use (bucket pairs, devices, pools).
  absl::Mutex labelled_mu_;
  absl::flat_hash_map<std::string, prometheus::Counter*> buckets_ ABSL_GUARDED_BY(labelled_mu_);
  absl::flat_hash_map<std::string, prometheus::Histogram*> device_seconds_
      ABSL_GUARDED_BY(labelled_mu_);

  absl::Mutex info_mu_;
  prometheus::Gauge* build_info_ ABSL_GUARDED_BY(info_mu_) = nullptr;

  // Serialises refreshes so that two concurrent scrapes cannot both add the
  // same engine delta to a mirrored counter.
  absl::Mutex refresh_mu_;
  std::function<engine::EngineStats()> stats_source_ ABSL_GUARDED_BY(refresh_mu_);
  std::function<SharedMemoryUsage()> shm_source_ ABSL_GUARDED_BY(refresh_mu_);
  prometheus::Gauge* shm_regions_;
  prometheus::Gauge* shm_bytes_;
  MirroredCounter mirrored_[kMirroredTotals] ABSL_GUARDED_BY(refresh_mu_);
};

}  // namespace mlaverify::admin

#endif  // MLAVERIFY_SERVER_ADMIN_METRICS_H_
