// mlaverify-server: owns the paged latent KV cache of an MLA model and serves
// verify attention over gRPC, with Prometheus metrics and liveness/readiness
// on an admin HTTP port. SIGTERM/SIGINT drain it: health goes NOT_SERVING at
// once, calls are still served for --drain-grace-s, then new work is refused
// with UNAVAILABLE, streams end and calls in flight get --drain-timeout-s to
// finish; the process exits 0 with a line counting what finished and what was
// cut. A second signal during the drain exits at once with status 1.
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/auth_token.h"
#include "common/build_info.h"
#include "common/cli_switch.h"
#include "common/cli_usage.h"
#include "common/heap_tuning.h"
#include "common/mutex_tuning.h"
#include "common/small_file.h"
#include "common/status_macros.h"
#include "server/admin/admin_http_server.h"
#include "server/admin/metrics.h"
#include "server/engine/device.h"
#include "server/engine/engine.h"
#include "server/engine/engine_observer.h"
#include "server/flags_file.h"
#include "server/log_format.h"
#include "server/transport/grpc_server.h"
#include "server/transport/status_mapping.h"
#include "spdlog/spdlog.h"

namespace mlaverify {
namespace {

// Feeds RPC outcomes and engine events to the Prometheus registry.
class MetricsObserver final : public transport::RpcObserver, public engine::EngineObserver {
 public:
  explicit MetricsObserver(admin::Metrics* metrics) : metrics_(metrics) {}
  void OnRpc(absl::string_view rpc, grpc::StatusCode code, double seconds) override {
    metrics_->RecordRpc(rpc, transport::GrpcCodeName(code), seconds);
  }
  void OnBatch(const engine::BatchReport& report) override {
    std::string name = std::to_string(report.device);
    {
      absl::MutexLock lock(&names_mu_);
      if (report.device < static_cast<int>(device_names_.size()))
        name = device_names_[report.device];
    }
    metrics_->RecordBatch(report, name);
  }
  void OnVerifyDone(const engine::VerifyTiming& timing) override {
    metrics_->RecordVerifyTiming(timing);
  }
  void OnOversizedRequest(absl::string_view rpc) override { metrics_->RecordOversizedRequest(rpc); }
  void OnDeviceFault(const std::string& device, const absl::Status&) override {
    metrics_->RecordDeviceFault(device);
  }
  void OnStepEnded(const engine::StepReport& report) override { metrics_->RecordStep(report); }

  // The engine's device names by index (known once it started).
  void SetDeviceNames(std::vector<std::string> names) {
    absl::MutexLock lock(&names_mu_);
    device_names_ = std::move(names);
  }

 private:
  admin::Metrics* const metrics_;
  absl::Mutex names_mu_;
  std::vector<std::string> device_names_ ABSL_GUARDED_BY(names_mu_);
};

struct Flags {
  std::string listen = "0.0.0.0:50051";
  std::string admin_host = "0.0.0.0";
  int admin_port = 9090;
  std::string port_file;
  int layers = 61;
  int heads = 8;
  int page_size = 64;
  uint64_t pool_bytes = uint64_t{1} << 30;
  std::string kv_dtype = "bf16";
  int64_t max_sequence_len = int64_t{1} << 17;
  std::string backend = "auto";
  std::vector<int> devices = {0};
  std::string parallel_mode = "tp";
  bool cuda_graphs = true;
  std::vector<int> draft_buckets = {1, 2, 4, 8, 16, 32, 64};
  std::vector<int> batch_buckets = {1, 2, 4, 8, 16, 32};
  double max_queue_delay_us = 0;
  int max_queued_calls = 4096;
  uint64_t max_queued_bytes = uint64_t{2} << 30;
  int64_t max_live_sequences = 65536;
  int copy_threads = 4;
  bool completion_thread = false;
  bool poll_launches = true;
  int batches_in_flight = 2;
  uint64_t pinned_staging_bytes = uint64_t{512} << 20;
  double idle_timeout_s = 600;
  int step_lanes = engine::StepOptions{}.lanes_per_device;
  int64_t step_layer_timeout_ms =
      absl::ToInt64Milliseconds(engine::StepOptions{}.default_layer_timeout);
  int64_t step_max_duration_ms =
      absl::ToInt64Milliseconds(engine::StepOptions{}.default_max_duration);
  uint64_t max_message_bytes = uint64_t{64} << 20;
  float softmax_scale = 1.0f / std::sqrt(192.0f);
  int cpu_threads = 0;
  int stream_max_in_flight = 8;
  int max_streams = 256;
  int max_streams_per_connection = 64;
  int readiness_grpc_timeout_ms = 1000;
  double stream_idle_timeout_s = 600;
  bool allow_client_shm = false;
  int64_t max_shm_regions = 256;
  uint64_t max_shm_bytes = uint64_t{64} << 30;
  std::string shm_key_prefix = "/mlaverify";
  // HTTP/2 settings for 100 KiB-8 MiB messages (0: gRPC's default): one
  // DATA frame per message instead of 16 KiB ones, and a stream window that
  // lets a whole Verify answer go out without waiting for window updates.
  int http2_max_frame_bytes = (1 << 24) - 1;
  int http2_lookahead_bytes = 8 << 20;
  int http2_max_concurrent_streams = 256;
  uint64_t grpc_memory_quota_bytes = 0;
  int keepalive_time_ms = transport::GrpcServerOptions{}.keepalive_time_ms;
  int keepalive_timeout_ms = transport::GrpcServerOptions{}.keepalive_timeout_ms;
  bool keepalive_permit_without_calls =
      transport::GrpcServerOptions{}.keepalive_permit_without_calls;
  int http2_min_ping_interval_ms = transport::GrpcServerOptions{}.http2_min_ping_interval_ms;
  int http2_max_ping_strikes = transport::GrpcServerOptions{}.http2_max_ping_strikes;
  double drain_grace_s = 5;
  double drain_timeout_s = 10;
  double slow_call_ms = 100;
  int testing_fault_after_launches = 0;
  std::string tls_cert, tls_key, tls_client_ca;
  std::string auth_token_file;
  std::string log_level = "info";
  std::string log_format = "text";
  std::string config_file;
};

// The checks CLI11 cannot express, before anything starts: every bad value is
// a clear error and exit status 2.
absl::Status ValidateFlags(const Flags& f) {
  // host:port, or [v6 address]:port; port 0..65535 (0 picks one).
  const size_t colon = f.listen.rfind(':');
  const std::string port = colon == std::string::npos ? "" : f.listen.substr(colon + 1);
  const bool digits =
      !port.empty() && port.size() <= 5 &&
      std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; });
  if (colon == std::string::npos || colon == 0 || !digits || std::stoi(port) > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen ", ClipForMessage(f.listen),
                     ": need host:port with a port in 0..65535 (0 picks a free one)"));
  }
  if (f.admin_port < -1 || f.admin_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--admin-port ", f.admin_port, ": need -1..65535"));
  }
  constexpr uint64_t kMaxMessage = (uint64_t{1} << 31) - 1;  // gRPC takes an int
  if (f.max_message_bytes < 1024 || f.max_message_bytes > kMaxMessage) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-message-bytes ", f.max_message_bytes, ": need 1024..", kMaxMessage));
  }
  if (f.devices.empty() || *std::min_element(f.devices.begin(), f.devices.end()) < 0) {
    return absl::InvalidArgumentError("--devices: need at least one ordinal, each >= 0");
  }
  if (f.http2_max_frame_bytes != 0 &&
      (f.http2_max_frame_bytes < 16384 || f.http2_max_frame_bytes > (1 << 24) - 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--http2-max-frame-bytes ", f.http2_max_frame_bytes, ": need 0 or 16384..16777215"));
  }
  if (f.http2_lookahead_bytes != 0 && f.http2_lookahead_bytes < 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http2-lookahead-bytes ", f.http2_lookahead_bytes, ": need 0 or >= 65535"));
  }
  if (f.http2_max_concurrent_streams < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--http2-max-concurrent-streams ",
                                                   f.http2_max_concurrent_streams,
                                                   ": need 0 (gRPC's default, no limit) or more"));
  }
  if (f.keepalive_time_ms < 1 || f.keepalive_timeout_ms < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--keepalive-time-ms ", f.keepalive_time_ms,
                                                   ", --keepalive-timeout-ms ",
                                                   f.keepalive_timeout_ms, ": need both >= 1"));
  }
  if (f.http2_min_ping_interval_ms < 0 || f.http2_max_ping_strikes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http2-min-ping-interval-ms ", f.http2_min_ping_interval_ms,
                     ", --http2-max-ping-strikes ", f.http2_max_ping_strikes,
                     ": need both >= 0 (strikes 0: no limit)"));
  }
  if (f.max_shm_regions < 1 || f.max_shm_regions > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-shm-regions ", f.max_shm_regions, ": need 1..65536"));
  }
  if (f.max_shm_bytes < 1 || f.max_shm_bytes > (uint64_t{1} << 50)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-shm-bytes ", f.max_shm_bytes, ": need 1..2^50"));
  }
  if (f.shm_key_prefix.empty() || f.shm_key_prefix[0] != '/' ||
      f.shm_key_prefix.find('/', 1) != std::string::npos || f.shm_key_prefix.size() > 200) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shm-key-prefix '", f.shm_key_prefix.substr(0, 64),
        "': need '/' followed by at most 199 characters and no other '/' ('/' admits every key)"));
  }
  if (f.stream_max_in_flight < 1 || f.stream_max_in_flight > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("--stream-max-in-flight ", f.stream_max_in_flight, ": need 1..1024"));
  }
  if (f.max_streams < 1 || f.max_streams > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-streams ", f.max_streams, ": need 1..65536"));
  }
  if (f.readiness_grpc_timeout_ms < 0 || f.readiness_grpc_timeout_ms > 60000) {
    return absl::InvalidArgumentError(absl::StrCat("--readiness-grpc-timeout-ms ",
                                                   f.readiness_grpc_timeout_ms,
                                                   ": need 0 (no check) or 1..60000"));
  }
  if (f.max_streams_per_connection < 1 || f.max_streams_per_connection > 65536) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-streams-per-connection ", f.max_streams_per_connection, ": need 1..65536"));
  }
  if (f.stream_idle_timeout_s != 0 &&
      !(f.stream_idle_timeout_s >= 1 && f.stream_idle_timeout_s <= 31536000)) {
    return absl::InvalidArgumentError(absl::StrCat("--stream-idle-timeout-s ",
                                                   f.stream_idle_timeout_s,
                                                   ": need 0 (never) or 1..31536000 seconds"));
  }
  for (const auto& [name, value] :
       {std::pair<const char*, double>{"--drain-timeout-s", f.drain_timeout_s},
        {"--drain-grace-s", f.drain_grace_s},
        {"--slow-call-ms", f.slow_call_ms},
        {"--idle-timeout-s", f.idle_timeout_s},
        {"--max-queue-delay-us", f.max_queue_delay_us}}) {
    if (!(value >= 0) || value > 1e9) {
      return absl::InvalidArgumentError(absl::StrCat(name, " ", value, ": need a value >= 0"));
    }
  }
  if (f.testing_fault_after_launches < 0) {
    return absl::InvalidArgumentError("--testing-fault-after-launches: need >= 0");
  }
  return absl::OkStatus();
}

// One device per --devices entry: CUDA devices by ordinal (the same ordinal
// may repeat: each entry is its own pool replica and worker), or host (CPU)
// devices, one per entry, for the CPU backend.
absl::StatusOr<std::vector<std::unique_ptr<engine::Device>>> MakeDevices(const Flags& f,
                                                                         std::string* backend) {
  std::vector<std::unique_ptr<engine::Device>> devices;
  if (f.backend != "cpu") {
    bool usable = true;
    absl::Status why;
    for (size_t k = 0; k < f.devices.size() && usable; ++k) {
      engine::CudaDeviceOptions options;
      // The fault injection applies to the first device only.
      options.fail_after_launches = k == 0 ? f.testing_fault_after_launches : 0;
      auto cuda = engine::MakeCudaDevice(f.devices[k], options);
      if (cuda.ok()) {
        devices.push_back(*std::move(cuda));
      } else {
        usable = false;
        why = cuda.status();
      }
    }
    if (usable) {
      *backend = "cuda";
      return devices;
    }
    devices.clear();
    if (f.backend == "cuda") return why;
    spdlog::info("serving on the CPU backend: {}", std::string(why.message()));
  }
  *backend = "cpu";
  for (size_t k = 0; k < f.devices.size(); ++k)
    devices.push_back(engine::MakeCpuDevice(f.cpu_threads));
  return devices;
}

// A flags file is a few hundred bytes; 1 MiB is far beyond any real one.
constexpr size_t kMaxConfigFileBytes = size_t{1} << 20;

// What a flag takes, for the --config file's type checks: read from the
// flag's definition (a switch has an optional value, a list many; the value
// type is CLI11's type name, with a size transform for "1GiB"-style values).
// Flags a file cannot set (--config, --help, --version) are not configurable.
std::optional<FlagKind> FlagKindOf(const CLI::App& app, const std::string& flag) {
  const CLI::Option* option = app.get_option_no_throw(flag);
  if (option == nullptr || !option->get_configurable()) return std::nullopt;
  if (option->get_expected_min() == 0) return FlagKind::kSwitch;
  if (option->get_items_expected_max() > 1) return FlagKind::kIntegerList;
  const std::string type = option->get_type_name();
  if (absl::StrContains(type, "SIZE")) return FlagKind::kSize;
  if (absl::StartsWith(type, "INT") || absl::StartsWith(type, "UINT")) return FlagKind::kInteger;
  if (absl::StartsWith(type, "FLOAT")) return FlagKind::kNumber;
  return FlagKind::kText;
}

constexpr char kProgram[] = "mlaverify-server";

// --help lists the flags by what they set, in this order. Every flag has a
// group: GroupFlagsForHelp aborts on one left out, so a new flag cannot slip
// into an ungrouped list (tests/server_flags_test.sh runs --help).
const std::vector<std::pair<std::string, std::vector<std::string>>>& FlagGroups() {
  static const auto* groups = new std::vector<std::pair<std::string, std::vector<std::string>>>{
      {"Model and KV pool",
       {"--layers", "--heads", "--page-size", "--pool-bytes", "--kv-dtype", "--max-seq-len",
        "--softmax-scale"}},
      {"Devices and execution",
       {"--backend", "--devices", "--parallel-mode", "--cuda-graphs", "--draft-buckets",
        "--batch-buckets", "--max-queue-delay-us", "--copy-threads", "--completion-thread",
        "--poll-launches", "--batches-in-flight", "--pinned-staging-bytes", "--cpu-threads",
        "--testing-fault-after-launches"}},
      {"Limits",
       {"--max-queued-calls", "--max-queued-bytes", "--max-live-sequences", "--idle-timeout-s",
        "--max-message-bytes"}},
      {"Device-driven steps",
       {"--step-lanes", "--step-layer-timeout-ms", "--step-max-duration-ms"}},
      {"Shared memory",
       {"--allow-client-shm", "--max-shm-regions", "--max-shm-bytes", "--shm-key-prefix"}},
      {"gRPC and HTTP/2",
       {"--listen", "--port-file", "--stream-max-in-flight", "--max-streams",
        "--max-streams-per-connection", "--stream-idle-timeout-s", "--http2-max-frame-bytes",
        "--http2-lookahead-bytes", "--http2-max-concurrent-streams", "--grpc-memory-quota-bytes",
        "--keepalive-time-ms", "--keepalive-timeout-ms", "--keepalive-permit-without-calls",
        "--http2-min-ping-interval-ms", "--http2-max-ping-strikes"}},
      {"Security", {"--auth-token-file", "--tls-cert", "--tls-key", "--tls-client-ca"}},
      {"Operations",
       {"--admin-host", "--admin-port", "--readiness-grpc-timeout-ms", "--slow-call-ms",
        "--drain-grace-s", "--drain-timeout-s", "--log-level", "--log-format", "--config", "--help",
        "--version"}},
  };
  return *groups;
}

void GroupFlagsForHelp(CLI::App* app) {
  std::set<const CLI::Option*> grouped;
  for (const auto& [group, flags] : FlagGroups()) {
    for (const std::string& flag : flags) {
      CLI::Option* option = app->get_option_no_throw(flag);
      if (option == nullptr) {
        std::fprintf(stderr, "GroupFlagsForHelp: %s is in a group but no flag\n", flag.c_str());
        std::abort();
      }
      option->group(group);
      grouped.insert(option);
    }
  }
  for (const CLI::Option* option : app->get_options()) {
    if (grouped.count(option) == 0) {
      std::fprintf(stderr, "GroupFlagsForHelp: %s has no group in FlagGroups()\n",
                   option->get_name().c_str());
      std::abort();
    }
  }
}

// The server's long flag nearest to `typed` ("--pool-byts"), by edit
// distance, if it is close enough to be what was meant; else empty.
// `eligible` (when set) limits the candidates, so that a flags file is
// offered the nearest flag it can set, not nothing when the nearest overall
// is one it cannot.
std::string NearestFlag(const CLI::App& app, const std::string& typed,
                        const std::function<bool(const std::string&)>& eligible = nullptr) {
  auto distance = [](const std::string& a, const std::string& b) {
    std::vector<size_t> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      size_t diagonal = row[0];
      row[0] = i;
      for (size_t j = 1; j <= b.size(); ++j) {
        const size_t above = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
        diagonal = above;
      }
    }
    return row[b.size()];
  };
  const std::string name = typed.substr(0, typed.find('='));
  std::string best;
  size_t best_distance = std::max<size_t>(2, name.size() / 4) + 1;
  for (const CLI::Option* option : app.get_options()) {
    for (const std::string& long_name : option->get_lnames()) {
      const std::string candidate = "--" + long_name;
      if (eligible && !eligible(candidate)) continue;
      const size_t d = distance(name, candidate);
      if (d < best_distance) {
        best_distance = d;
        best = candidate;
      }
    }
  }
  return best;
}

// CLI11 takes an argument list last-first.
void ParseArguments(CLI::App& app, std::vector<std::string> args) {
  std::reverse(args.begin(), args.end());
  app.parse(args);
}

// After the command line parsed: the --config file's values, each checked by
// the flag parser on its own (so a bad value is an error, with its line, even
// where the command line sets that flag too), then the file's flags that the
// command line does not set parsed together with the command line.
absl::Status ApplyFlagsFile(CLI::App& app, const std::string& path, int argc, char** argv) {
  ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(path, kMaxConfigFileBytes, "config"));
  ASSIGN_OR_RETURN(
      const std::vector<FlagsFileEntry> entries,
      ParseFlagsFile(
          path, text, [&app](const std::string& flag) { return FlagKindOf(app, flag); },
          [&app](const std::string& flag) {
            // Only a flag a file can set is a suggestion.
            return NearestFlag(app, flag, [&app](const std::string& candidate) {
              return FlagKindOf(app, candidate).has_value();
            });
          }));
  std::vector<std::string> args;
  for (const FlagsFileEntry& entry : entries) {
    if (app.get_option(entry.flag)->count() == 0) args.push_back(entry.argument);
  }
  for (const FlagsFileEntry& entry : entries) {
    app.clear();
    try {
      ParseArguments(app, {entry.argument});
    } catch (const CLI::ParseError& e) {
      return absl::InvalidArgumentError(absl::StrCat(ClipForMessage(path, 200), ":", entry.line,
                                                     ": ", ClipForMessage(e.what(), 160)));
    }
  }
  args.insert(args.end(), argv + 1, argv + argc);
  app.clear();
  try {
    ParseArguments(app, std::move(args));
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(ClipForMessage(e.what(), 160));
  }
  return absl::OkStatus();
}

// How the engine's errors name its settings: by the flags that set them.
std::map<std::string, std::string> EngineSettingFlags() {
  return {{"num_layers", "--layers"},
          {"num_heads", "--heads"},
          {"page_size", "--page-size"},
          {"pool_bytes", "--pool-bytes"},
          {"kv_dtype", "--kv-dtype"},
          {"max_sequence_len", "--max-seq-len"},
          {"draft_buckets", "--draft-buckets"},
          {"batch_buckets", "--batch-buckets"},
          {"default_softmax_scale", "--softmax-scale"},
          {"idle_timeout", "--idle-timeout-s"},
          {"max_queue_delay", "--max-queue-delay-us"},
          {"max_queued_calls", "--max-queued-calls"},
          {"max_queued_bytes", "--max-queued-bytes"},
          {"max_live_sequences", "--max-live-sequences"},
          {"copy_threads", "--copy-threads"},
          {"completion_thread", "--completion-thread"},
          {"poll_launches", "--poll-launches"},
          {"batches_in_flight", "--batches-in-flight"},
          {"pinned_staging_bytes", "--pinned-staging-bytes"},
          {"steps.lanes_per_device", "--step-lanes"},
          {"steps.default_layer_timeout", "--step-layer-timeout-ms"},
          {"steps.default_max_duration", "--step-max-duration-ms"}};
}

int Run(int argc, char** argv) {
  // Before any thread starts (heap_tuning.h: no page faults per call).
  const bool heap_tuned = TuneHeapForLargeBuffers();
  // Before CUDA starts: one hardware queue per stream (the device worker's,
  // each step lane's, the release stream), so that a step lane held at its
  // doorbell never holds another stream's work queued behind it. An
  // operator's own setting stays.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  TurnOffMutexDeadlockDetection();  // (mutex_tuning.h: why)
  Flags f;
  CLI::App app{"mlaverify-server: MLA verify attention over a paged latent KV cache"};
  app.set_help_flag();  // added again after the flags (below)
  app.add_option("--listen", f.listen, "gRPC address (host:port; port 0 picks one)")
      ->capture_default_str();
  app.add_option("--admin-host", f.admin_host, "admin HTTP bind address")->capture_default_str();
  app.add_option("--admin-port", f.admin_port,
                 "admin HTTP port: /metrics /healthz /readyz (-1: off, 0: pick one)")
      ->capture_default_str();
  app.add_option("--port-file", f.port_file,
                 "once serving, write the bound gRPC and admin ports here (\"grpc admin\")");
  app.add_option("--layers", f.layers, "model layers")->capture_default_str();
  app.add_option("--heads", f.heads,
                 "query heads of one Verify item; in tp mode each device computes heads / devices")
      ->capture_default_str();
  app.add_option("--page-size", f.page_size, "tokens per KV page (power of two, 1..256)")
      ->capture_default_str();
  app.add_option("--pool-bytes", f.pool_bytes, "KV pool size per device, e.g. 1073741824 or 1GiB")
      ->transform(CLI::AsSizeValue(true))
      ->capture_default_str();
  app.add_option("--kv-dtype", f.kv_dtype,
                 "how the pool stores latent KV rows: bf16 (1152 bytes per token and layer) | fp8 "
                 "(656: e4m3 with one fp32 scale per 128 values, rope in bf16)")
      ->check(CLI::IsMember({"bf16", "fp8"}))
      ->capture_default_str();
  app.add_option("--max-seq-len", f.max_sequence_len, "longest sequence in tokens")
      ->capture_default_str();
  app.add_option("--backend", f.backend, "auto | cpu | cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--devices", f.devices,
                 "CUDA device ordinals, one worker each (an ordinal may repeat); with the CPU "
                 "backend, one host device per entry")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--parallel-mode", f.parallel_mode,
                 "tp: heads split over the devices, KV replicated; dp: each sequence on one device")
      ->check(CLI::IsMember({"tp", "dp"}))
      ->capture_default_str();
  AddSwitch(&app, "--cuda-graphs", &f.cuda_graphs,
            "replay one CUDA graph per (batch, draft) bucket (false: eager launches)");
  app.add_option("--draft-buckets", f.draft_buckets,
                 "draft-length buckets; the largest is the max N")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--batch-buckets", f.batch_buckets,
                 "batch buckets; the largest is the max items per Verify and per replay")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--max-queue-delay-us", f.max_queue_delay_us,
                 "how long a device may hold a partial batch for more items (0: no delay)")
      ->capture_default_str();
  app.add_option("--max-queued-calls", f.max_queued_calls,
                 "calls admitted and not finished; beyond: RESOURCE_EXHAUSTED")
      ->capture_default_str();
  app.add_option("--max-queued-bytes", f.max_queued_bytes,
                 "tensor bytes those calls may hold; beyond: RESOURCE_EXHAUSTED")
      ->transform(CLI::AsSizeValue(true))
      ->capture_default_str();
  app.add_option("--max-live-sequences", f.max_live_sequences,
                 "sequences alive at once; beyond: RESOURCE_EXHAUSTED")
      ->capture_default_str();
  app.add_option("--copy-threads", f.copy_threads,
                 "threads per device that complete a large batch's calls (copying their inline "
                 "outputs out)")
      ->capture_default_str();
  AddSwitch(&app, "--completion-thread", &f.completion_thread,
            "a thread per device completes finished batches, handed over in bulk, while the "
            "device thread launches the next (false: the device thread completes them itself)");
  AddSwitch(&app, "--poll-launches", &f.poll_launches,
            "the device thread polls the running launch and launches queued work as a slot "
            "frees (false: submitters launch into free slots, the device thread sleeps until "
            "the oldest launch ends)");
  app.add_option("--batches-in-flight", f.batches_in_flight,
                 "launches a device has in flight at most (the next batch is launched while "
                 "one runs)")
      ->capture_default_str();
  app.add_option("--pinned-staging-bytes", f.pinned_staging_bytes,
                 "page-locked host memory for inline tensors on the GPU path, e.g. 512MiB; a "
                 "call that finds too little free: RESOURCE_EXHAUSTED")
      ->transform(CLI::AsSizeValue(true))
      ->capture_default_str();
  app.add_option("--idle-timeout-s", f.idle_timeout_s,
                 "release sequences idle this long (0: never)")
      ->capture_default_str();
  app.add_option("--step-lanes", f.step_lanes,
                 "device-driven steps open at once per device (OpenStep), each with its own "
                 "stream, buffers and graphs (0: no steps)")
      ->capture_default_str();
  app.add_option("--step-layer-timeout-ms", f.step_layer_timeout_ms,
                 "abort a step when no layer completes this long (its scheduler stopped "
                 "ringing), or when its items are not committed this long after the last layer; "
                 "a request may ask for up to 60 s")
      ->capture_default_str();
  app.add_option("--step-max-duration-ms", f.step_max_duration_ms,
                 "abort a step this long after it opened; a request may ask for up to 600 s")
      ->capture_default_str();
  app.add_option("--max-message-bytes", f.max_message_bytes,
                 "largest gRPC message in either direction")
      ->transform(CLI::AsSizeValue(true))
      ->capture_default_str();
  app.add_option("--softmax-scale", f.softmax_scale,
                 "default softmax scale (requests may override)")
      ->capture_default_str();
  app.add_option("--cpu-threads", f.cpu_threads, "CPU backend threads per verify (0: all)")
      ->capture_default_str();
  app.add_option("--stream-max-in-flight", f.stream_max_in_flight,
                 "requests of one VerifyStream worked on at once (answered in order)")
      ->capture_default_str();
  app.add_option("--max-streams", f.max_streams,
                 "VerifyStreams open at once over all connections (one more: RESOURCE_EXHAUSTED)")
      ->capture_default_str();
  app.add_option("--readiness-grpc-timeout-ms", f.readiness_grpc_timeout_ms,
                 "/readyz is ready only while the gRPC port's own health check, asked every "
                 "second, answers within this long (0: /readyz follows the serving state only)")
      ->capture_default_str();
  app.add_option("--max-streams-per-connection", f.max_streams_per_connection,
                 "VerifyStreams open at once on one connection (one more: RESOURCE_EXHAUSTED)")
      ->capture_default_str();
  app.add_option("--stream-idle-timeout-s", f.stream_idle_timeout_s,
                 "end a VerifyStream with nothing in flight and no request for this long, "
                 "UNAVAILABLE (0: never)")
      ->capture_default_str();
  AddSwitch(&app, "--allow-client-shm", &f.allow_client_shm,
            "accept client shared-memory regions (RegisterSystemSharedMemory) and tensors "
            "in them; only for trusted schedulers on this host");
  app.add_option("--max-shm-regions", f.max_shm_regions, "shared-memory regions registered at once")
      ->capture_default_str();
  app.add_option("--max-shm-bytes", f.max_shm_bytes,
                 "bytes of all registered shared-memory regions together, e.g. 64GiB")
      ->transform(CLI::AsSizeValue(true))
      ->capture_default_str();
  app.add_option("--shm-key-prefix", f.shm_key_prefix,
                 "shared-memory keys a client may register start with this ('/': any); the "
                 "object must also be owned by the server's user")
      ->capture_default_str();
  app.add_option("--http2-max-frame-bytes", f.http2_max_frame_bytes,
                 "HTTP/2 max frame size the server accepts (0: gRPC's default, 16384)")
      ->capture_default_str();
  app.add_option("--http2-lookahead-bytes", f.http2_lookahead_bytes,
                 "HTTP/2 stream window (lookahead) per call (0: gRPC's default)")
      ->capture_default_str();
  app.add_option("--http2-max-concurrent-streams", f.http2_max_concurrent_streams,
                 "HTTP/2 streams (calls) one connection may have open at once; 0: no limit")
      ->capture_default_str();
  app.add_option("--grpc-memory-quota-bytes", f.grpc_memory_quota_bytes,
                 "gRPC's memory quota for its connections' buffers, e.g. 4GiB; 0: none")
      ->transform(CLI::AsSizeValue(true))
      ->capture_default_str();
  app.add_option("--keepalive-time-ms", f.keepalive_time_ms,
                 "ping a connection quiet for this long (keeps NAT/L4 flows alive)")
      ->capture_default_str();
  app.add_option("--keepalive-timeout-ms", f.keepalive_timeout_ms,
                 "close a connection whose ping is not acknowledged within this")
      ->capture_default_str();
  AddSwitch(&app, "--keepalive-permit-without-calls", &f.keepalive_permit_without_calls,
            "ping, and accept pings on, connections with no call open");
  app.add_option("--http2-min-ping-interval-ms", f.http2_min_ping_interval_ms,
                 "client pings closer than this with no data between are strikes (keep it "
                 "below the clients' keepalive time)")
      ->capture_default_str();
  app.add_option("--http2-max-ping-strikes", f.http2_max_ping_strikes,
                 "strikes before GOAWAY (ENHANCE_YOUR_CALM); 0: no limit")
      ->capture_default_str();
  app.add_option("--slow-call-ms", f.slow_call_ms,
                 "log a warning for calls this long in the server, at most one a second (0: off)")
      ->capture_default_str();
  app.add_option("--drain-grace-s", f.drain_grace_s,
                 "on SIGTERM: NOT_SERVING at once, calls still served this long (load balancers "
                 "move away)")
      ->capture_default_str();
  app.add_option("--drain-timeout-s", f.drain_timeout_s,
                 "then: new work refused, calls in flight get this long to finish")
      ->capture_default_str();
  app.add_option("--testing-fault-after-launches", f.testing_fault_after_launches,
                 "testing only: the first device's Nth verify launch runs a trapping kernel "
                 "(a real device fault; 0: never)")
      ->capture_default_str();
  app.add_option("--auth-token-file", f.auth_token_file,
                 "require \"authorization: Bearer <token>\" on every VerifyService call, the token "
                 "read from this file (health and reflection stay open)");
  app.add_option("--tls-cert", f.tls_cert, "server certificate (PEM); with --tls-key enables TLS");
  app.add_option("--tls-key", f.tls_key, "server private key (PEM)");
  app.add_option("--tls-client-ca", f.tls_client_ca,
                 "CA (PEM) that client certificates must chain to (mTLS)");
  app.add_option("--log-level", f.log_level, "trace | debug | info | warn | error | critical | off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}))
      ->capture_default_str();
  app.add_option("--log-format", f.log_format,
                 "text: one readable line per record; json: one JSON object per line "
                 "(time, level, thread, msg)")
      ->check(CLI::IsMember({"text", "json"}))
      ->capture_default_str();
  // A flags file for deployments (deploy/kubernetes/configmap.yaml): TOML
  // lines `flag-name = value`, the same names as the flags; a flag on the
  // command line wins; an unknown name is an error, not ignored.
  app.add_option("--config", f.config_file,
                 "read flags from this TOML file (`flag-name = value` per line; the command "
                 "line wins)")
      ->configurable(false);
  app.set_version_flag("--version", VersionLine("mlaverify-server"));
  UseUsageErrorLines(&app, kProgram);
  // Last, so that the first group --help lists is the first flag's.
  app.set_help_flag("-h,--help", "print this help (flags grouped by what they set) and exit");
  GroupFlagsForHelp(&app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // A misspelt flag: name the one that was probably meant.
    if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
      for (const std::string& extra : app.remaining()) {
        if (!absl::StartsWith(extra, "--")) continue;
        if (const std::string nearest = NearestFlag(app, extra); !nearest.empty()) {
          std::fprintf(stderr, "%s\n",
                       UsageErrorLine(
                           kProgram, absl::StrCat("unknown flag ", extra.substr(0, extra.find('=')),
                                                  "; did you mean ", nearest, "?"))
                           .c_str());
        }
      }
    }
    // --help and --version exit 0; every flag error exits 2, like the checks below.
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (!f.config_file.empty()) {
    if (absl::Status applied = ApplyFlagsFile(app, f.config_file, argc, argv); !applied.ok()) {
      std::fprintf(stderr, "%s\n",
                   UsageErrorLine(kProgram, absl::StrCat("--config: ", applied.message())).c_str());
      return 2;
    }
  }
  if (absl::Status valid = ValidateFlags(f); !valid.ok()) {
    std::fprintf(stderr, "%s\n", UsageErrorLine(kProgram, std::string(valid.message())).c_str());
    return 2;
  }

  spdlog::set_level(spdlog::level::from_str(f.log_level));
  spdlog::set_formatter(MakeLogFormatter(f.log_format));

  // Signals go to one thread (sigwait below), never to a worker mid-call.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  engine::EngineConfig config;
  config.num_layers = f.layers;
  config.num_heads = f.heads;
  config.page_size = f.page_size;
  config.pool_bytes = static_cast<int64_t>(f.pool_bytes);
  ParseKvDtype(f.kv_dtype.c_str(), &config.kv_dtype);  // CLI::IsMember checked the name
  config.max_sequence_len = f.max_sequence_len;
  config.draft_buckets = f.draft_buckets;
  config.batch_buckets = f.batch_buckets;
  config.default_softmax_scale = f.softmax_scale;
  config.idle_timeout = absl::Seconds(f.idle_timeout_s);
  config.parallel_mode = f.parallel_mode == "dp" ? engine::ParallelMode::kDataParallel
                                                 : engine::ParallelMode::kTensorParallel;
  config.use_graphs = f.cuda_graphs;
  config.max_queue_delay = absl::Microseconds(f.max_queue_delay_us);
  config.max_queued_calls = f.max_queued_calls;
  config.max_queued_bytes = static_cast<int64_t>(f.max_queued_bytes);
  config.max_live_sequences = f.max_live_sequences;
  config.copy_threads = f.copy_threads;
  config.completion_thread = f.completion_thread;
  config.poll_launches = f.poll_launches;
  config.batches_in_flight = f.batches_in_flight;
  config.pinned_staging_bytes = static_cast<int64_t>(f.pinned_staging_bytes);
  config.shared_memory.enabled = f.allow_client_shm;
  config.shared_memory.max_regions = f.max_shm_regions;
  config.shared_memory.max_total_bytes = static_cast<int64_t>(f.max_shm_bytes);
  config.shared_memory.key_prefix = f.shm_key_prefix;
  config.steps.lanes_per_device = f.step_lanes;
  config.steps.default_layer_timeout = absl::Milliseconds(f.step_layer_timeout_ms);
  config.steps.default_max_duration = absl::Milliseconds(f.step_max_duration_ms);
  config.setting_names = EngineSettingFlags();
  // Flag errors first, before anything listens.
  if (absl::Status valid = config.Validate(static_cast<int>(f.devices.size())); !valid.ok()) {
    std::fprintf(stderr, "%s\n", UsageErrorLine(kProgram, std::string(valid.message())).c_str());
    return 2;
  }

  // ---- metrics, gRPC (NOT_SERVING until the engine is up) and admin HTTP ----
  admin::Metrics metrics;
  MetricsObserver observer(&metrics);
  transport::GrpcServerOptions options;
  options.listen_address = f.listen;
  options.service.version = kVersion;
  options.service.max_message_bytes = static_cast<int64_t>(f.max_message_bytes);
  options.service.slow_call_seconds = f.slow_call_ms / 1e3;
  options.service.stream_max_in_flight = f.stream_max_in_flight;
  options.service.max_streams = f.max_streams;
  options.service.max_streams_per_connection = f.max_streams_per_connection;
  options.service.stream_idle_timeout = absl::Seconds(f.stream_idle_timeout_s);
  options.http2_max_frame_bytes = f.http2_max_frame_bytes;
  options.http2_max_concurrent_streams = f.http2_max_concurrent_streams;
  options.grpc_memory_quota_bytes = f.grpc_memory_quota_bytes;
  options.http2_lookahead_bytes = f.http2_lookahead_bytes;
  options.keepalive_time_ms = f.keepalive_time_ms;
  options.keepalive_timeout_ms = f.keepalive_timeout_ms;
  options.keepalive_permit_without_calls = f.keepalive_permit_without_calls;
  options.http2_min_ping_interval_ms = f.http2_min_ping_interval_ms;
  options.http2_max_ping_strikes = f.http2_max_ping_strikes;
  if (!f.auth_token_file.empty()) {
    absl::StatusOr<std::string> token = ReadAuthToken(f.auth_token_file);
    if (!token.ok()) {
      std::fprintf(
          stderr, "%s\n",
          UsageErrorLine(kProgram, absl::StrCat("--auth-token-file: ", token.status().message()))
              .c_str());
      return 2;
    }
    options.service.auth_token = *std::move(token);
  }
  options.tls_cert_file = f.tls_cert;
  options.tls_key_file = f.tls_key;
  options.tls_client_ca_file = f.tls_client_ca;
  auto server = transport::GrpcServer::Start(options, &observer);
  if (!server.ok()) {
    spdlog::error("cannot start the gRPC server: {}", server.status().ToString());
    return 2;
  }
  transport::GrpcServer* grpc_server = server->get();
  std::unique_ptr<admin::AdminHttpServer> admin_http;
  if (f.admin_port >= 0) {
    admin_http = std::make_unique<admin::AdminHttpServer>(&metrics, [grpc_server] {
      return grpc_server->state() == transport::ServingState::kServing &&
             grpc_server->serving_path_answers();
    });
    const absl::Status started = admin_http->Start(f.admin_host, f.admin_port);
    if (!started.ok()) {
      spdlog::error("cannot start the admin HTTP server: {}", started.ToString());
      return 2;
    }
  }

  // ---- devices and engine (pools allocated, graphs recorded) ----
  std::string backend_name;
  auto devices = MakeDevices(f, &backend_name);
  if (!devices.ok()) {
    spdlog::error("--backend {}: {}", f.backend, devices.status().ToString());
    return 2;
  }
  const absl::Time engine_start = absl::Now();
  auto engine = engine::Engine::Create(config, *std::move(devices), &observer);
  if (!engine.ok()) {
    spdlog::error("cannot start the engine: {}", engine.status().ToString());
    return 2;
  }
  observer.SetDeviceNames((*engine)->device_names());
  spdlog::info("engine ready in {:.2f} s", absl::ToDoubleSeconds(absl::Now() - engine_start));
  metrics.SetInfo(kVersion, (*engine)->backend_name());
  metrics.SetStatsSource([e = engine->get()] { return e->Stats(); });
  metrics.SetSharedMemorySource([e = engine->get()] {
    return admin::Metrics::SharedMemoryUsage{e->regions().regions(),
                                             e->regions().registered_bytes()};
  });
  metrics.DeclareDevices((*engine)->device_names());
  (*engine)->SetFaultListener([grpc_server, &metrics](const absl::Status&) {
    metrics.SetReady(false);
    grpc_server->SetFaulted();
  });
  grpc_server->AttachEngine(engine->get());

  // ---- idle expiry ----
  std::mutex janitor_mu;
  std::condition_variable janitor_cv;
  bool stopping = false;
  std::thread janitor([&] {
    const absl::Duration period = config.idle_timeout > absl::ZeroDuration()
                                      ? std::min(absl::Seconds(1), config.idle_timeout / 4)
                                      : absl::Seconds(1);
    std::unique_lock<std::mutex> lock(janitor_mu);
    while (
        !janitor_cv.wait_for(lock, absl::ToChronoMilliseconds(period), [&] { return stopping; })) {
      (*engine)->ExpireIdle(absl::Now());
      grpc_server->EndIdleStreams();
    }
  });

  grpc_server->SetServing();
  if (admin_http && f.readiness_grpc_timeout_ms > 0) {
    grpc_server->StartServingProbe(absl::Seconds(1),
                                   absl::Milliseconds(f.readiness_grpc_timeout_ms));
  }
  metrics.SetReady(true);
  // Written once SERVING, so that a script that waits for the file needs no
  // health poll (with a fixed --listen port, health says NOT_SERVING until now).
  if (!f.port_file.empty()) {
    std::ofstream(f.port_file) << grpc_server->port() << " "
                               << (admin_http ? admin_http->port() : -1) << "\n";
  }
  spdlog::info(
      "mlaverify-server {} ready: gRPC port {}, admin port {}, backend {} on {} device(s), {} mode",
      kVersion, grpc_server->port(), admin_http ? admin_http->port() : -1,
      (*engine)->backend_name(), (*engine)->num_devices(), f.parallel_mode);
  if (!heap_tuned) {
    spdlog::info(
        "heap thresholds not set (MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ in the "
        "environment, or mallopt refused)");
  }

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  spdlog::info("signal {}: draining (a second SIGTERM or SIGINT exits at once)", signal_number);
  // An operator who does not want to wait for the drain signals again: the
  // process ends now, exit status 1, calls in flight cut by the connection.
  std::thread([signals] {
    int second = 0;
    sigwait(&signals, &second);
    spdlog::warn("signal {} during the drain: exiting now, without finishing it", second);
    spdlog::default_logger()->flush();
    std::_Exit(1);
  }).detach();
  metrics.SetReady(false);
  const transport::DrainCounts drained =
      grpc_server->Drain(absl::Seconds(f.drain_grace_s), absl::Seconds(f.drain_timeout_s));
  {
    std::lock_guard<std::mutex> lock(janitor_mu);
    stopping = true;
  }
  janitor_cv.notify_all();
  janitor.join();
  if (admin_http) admin_http->Stop();
  const engine::EngineStats stats = (*engine)->Stats();
  spdlog::info(
      "stopped: {} calls finished in the drain, {} cut at the timeout, {} streams ended; "
      "{} live sequences, {} of {} pages free",
      drained.calls_finished, drained.calls_cut, drained.streams_ended, stats.live_sequences,
      stats.free_pages, stats.total_pages);
  // The server (its service calls into the engine) goes before the engine;
  // the metrics stop reading it first.
  metrics.SetSharedMemorySource(nullptr);
  metrics.SetStatsSource(nullptr);
  (*engine)->SetFaultListener(nullptr);
  server->reset();
  return 0;
}

}  // namespace
}  // namespace mlaverify

int main(int argc, char** argv) { return mlaverify::Run(argc, argv); }
