// mlaverify-client: talk to an mlaverify server from the command line.
//
//   mlaverify-client --target 127.0.0.1:50051 info [--json FILE|-]
//   mlaverify-client info --target 127.0.0.1:50051   (global flags go either side)
//   mlaverify-client health
//   mlaverify-client demo [--sequences 2 --prompt-len 200 --steps 4 --drafts 8 --stream]
//   mlaverify-client load [--concurrency 8 --duration-s 10 --connections 16 --json results.json]
//   mlaverify-client soak [--workers 8 --duration-s 600 --cut-fraction 0.05 --json soak.json]
//
// Exit status: 0 on success (info printed; SERVING; demo PASS; load without
// errors or leaked pages; soak PASS), 1 when the check fails, 2 for usage or setup errors.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/demo.h"
#include "client/load.h"
#include "client/replica_set.h"
#include "client/server_info_text.h"
#include "client/shared_memory.h"
#include "client/soak.h"
#include "client/step_load.h"
#include "common/auth_token.h"
#include "common/build_info.h"
#include "common/cli_switch.h"
#include "common/cli_usage.h"
#include "common/heap_tuning.h"
#include "common/mutex_tuning.h"
#include "nlohmann/json.hpp"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace mlaverify::client {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitCheckFailed = 1;
constexpr int kExitSetupError = 2;
// `load` over several targets: it finished on the replicas that stayed up,
// with every page back there, after losing at least one.
constexpr int kExitReplicaLost = 3;

struct GlobalFlags {
  std::string target = "127.0.0.1:50051";
  bool tls = false;
  std::string tls_ca;
  std::string tls_cert;
  std::string tls_key;
  int64_t timeout_ms = 30000;
  int64_t max_message_mib = 256;
  bool wait_for_ready = false;
  int http2_max_frame_bytes = ClientOptions{}.http2_max_frame_bytes;
  int http2_lookahead_bytes = ClientOptions{}.http2_lookahead_bytes;
  std::string auth_token_file;
  int connections = ClientOptions{}.connections;
  int64_t keepalive_time_ms = absl::ToInt64Milliseconds(ClientOptions{}.keepalive_time);
  int64_t keepalive_timeout_ms = absl::ToInt64Milliseconds(ClientOptions{}.keepalive_timeout);
  bool keepalive_permit_without_calls = ClientOptions{}.keepalive_permit_without_calls;
};

// Writes `text` to `path`, or to stdout for "-". False (logged) when it cannot.
bool WriteOutput(const std::string& path, const std::string& text, FILE* stdout_copy) {
  if (path == "-") {
    std::fputs(text.c_str(), stdout_copy);
    std::fflush(stdout_copy);
    return true;
  }
  std::ofstream file(path);
  file << text;
  file.close();
  if (!file) {
    spdlog::error("cannot write {}", path);
    return false;
  }
  std::fprintf(stderr, "wrote %s\n", path.c_str());
  return true;
}

// While alive, what the command prints to stdout goes to stderr, so that
// stdout carries only the JSON or CSV asked for with "-"; `out()` is the
// real stdout.
class StdoutToStderr {
 public:
  explicit StdoutToStderr(bool active) {
    if (!active) return;
    std::fflush(stdout);
    saved_ = dup(STDOUT_FILENO);
    if (saved_ >= 0) dup2(STDERR_FILENO, STDOUT_FILENO);
    out_ = saved_ >= 0 ? fdopen(dup(saved_), "w") : nullptr;
  }
  ~StdoutToStderr() {
    if (saved_ < 0) return;
    std::fflush(stdout);
    dup2(saved_, STDOUT_FILENO);
    close(saved_);
    if (out_ != nullptr) std::fclose(out_);
  }
  FILE* out() const { return out_ != nullptr ? out_ : stdout; }

 private:
  int saved_ = -1;
  FILE* out_ = nullptr;
};

// SIGINT/SIGTERM: during `load` the first one ends the run in progress as if
// its time were up (it releases its sequences and shared memory and reports)
// and the sweep's remaining runs; otherwise, or on a second signal, the
// shared-memory objects this process created are unlinked and the signal
// takes its default course.
std::atomic<int> g_signals{0};
std::atomic<bool> g_load_command{false};
extern "C" void OnSignal(int sig) {
  if (g_signals.fetch_add(1) == 0 && g_load_command.load()) {
    StopRunningLoad();
    return;
  }
  UnlinkSharedMemoryFromSignalHandler();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

// --data-plane and --cuda-device of `demo` and `load`.
void AddDataPlaneOptions(CLI::App* command, std::string* plane, int* cuda_device) {
  command->add_option("--cuda-device", *cuda_device, "cuda-shm: the buffer's device")
      ->capture_default_str();
  command
      ->add_option("--data-plane", *plane,
                   "inline (bytes in the messages), shm (a shared-memory region the command "
                   "creates and registers) or cuda-shm (a device buffer by CUDA IPC handle); "
                   "the server needs --allow-client-shm")
      ->check(CLI::IsMember({"inline", "shm", "cuda-shm"}))
      ->capture_default_str();
}

int RunInfo(VerifyClient& client, const std::string& json_path) {
  absl::StatusOr<v1::ServerInfo> info = client.GetServerInfo();
  if (!info.ok()) {
    spdlog::error("GetServerInfo from {}: {}", client.target(), info.status().ToString());
    return kExitCheckFailed;
  }
  if (!json_path.empty()) {
    if (!WriteOutput(json_path, ServerInfoToJson(*info).dump(2) + "\n", stdout)) {
      return kExitSetupError;
    }
  } else {
    std::printf("%s", FormatServerInfo(*info).c_str());
  }
  return kExitOk;
}

int RunHealth(VerifyClient& client) {
  absl::StatusOr<ServingStatus> status = client.Health();
  if (!status.ok()) {
    spdlog::error("health check of {}: {}", client.target(), status.status().ToString());
    return kExitCheckFailed;
  }
  std::printf("%s\n", std::string(ServingStatusName(*status)).c_str());
  return *status == ServingStatus::kServing ? kExitOk : kExitCheckFailed;
}

// One load, or with `sweep` one per value (the concurrency, or with --rate
// the rate), then a table of all of them; the JSON is the report, or
// {"sweep": ..., "runs": [reports]}.
// Where a results file came from, written into it: when, by which client
// and command line, against which servers (version, backend, instance), and
// the --metadata the operator attached.
struct Provenance {
  std::string command_line;
  std::vector<std::string> metadata;  // "key=value"
};

void AddProvenance(ReplicaSet& replicas, const Provenance& p, nlohmann::ordered_json* out) {
  nlohmann::ordered_json servers = nlohmann::ordered_json::array();
  for (int r = 0; r < static_cast<int>(replicas.size()); ++r) {
    nlohmann::ordered_json server = {{"target", replicas.Name(r)}};
    if (absl::StatusOr<v1::ServerInfo> info = replicas.replica(r).GetServerInfo(); info.ok()) {
      server["version"] = info->version();
      server["backend"] = info->backend();
      server["instance_id"] = info->instance_id();
    } else {
      server["error"] = info.status().ToString();
    }
    servers.push_back(std::move(server));
  }
  nlohmann::ordered_json metadata = nlohmann::ordered_json::object();
  for (const std::string& kv : p.metadata) {
    const size_t eq = kv.find('=');
    metadata[kv.substr(0, eq)] = eq == std::string::npos ? "" : kv.substr(eq + 1);
  }
  (*out)["provenance"] = {
      {"written_utc", absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone())},
      {"client", VersionLine("mlaverify-client")},
      {"command_line", p.command_line},
      {"servers", std::move(servers)}};
  (*out)["metadata"] = std::move(metadata);
}

int RunLoadCommand(ReplicaSet& replicas, const LoadOptions& options,
                   const std::vector<double>& sweep, const std::string& json_path,
                   const std::string& csv_path, const Provenance& provenance) {
  if (json_path == "-" && csv_path == "-") {
    spdlog::error("--json - and --csv - would share stdout; give one of them a file");
    return kExitSetupError;
  }
  const StdoutToStderr redirect(json_path == "-" || csv_path == "-");
  const bool by_rate = options.rate > 0;
  std::vector<LoadOptions> runs;
  if (sweep.empty()) runs.push_back(options);
  for (double v : sweep) {
    LoadOptions o = options;
    if (by_rate) {
      o.rate = v;
    } else {
      o.concurrency = static_cast<int>(v);
      if (o.concurrency != v || o.concurrency < 1) {
        spdlog::error("--sweep {}: concurrency values are whole numbers >= 1", v);
        return kExitSetupError;
      }
    }
    runs.push_back(o);
  }
  std::vector<LoadReport> reports;
  int worst = kExitOk;
  for (const LoadOptions& o : runs) {
    if (LoadStopRequested()) break;  // a signal ended the sweep
    absl::StatusOr<LoadReport> report = RunLoad(replicas, o);
    if (!report.ok()) {
      spdlog::error("load: {}", report.status().ToString());
      return report.status().code() == absl::StatusCode::kInvalidArgument ? kExitSetupError
                                                                          : kExitCheckFailed;
    }
    PrintLoadReport(*report);
    worst = std::max(worst, report->ok()                      ? kExitOk
                            : report->survived_replica_loss() ? kExitReplicaLost
                                                              : kExitCheckFailed);
    reports.push_back(*std::move(report));
  }
  if (reports.empty()) {
    spdlog::error("load: stopped by a signal before its first run");
    return kExitCheckFailed;
  }
  if (!sweep.empty()) {
    std::printf("\nsweep over %s:\n%12s %12s %12s %10s %10s %10s %8s %14s\n",
                by_rate ? "the rate" : "concurrency", by_rate ? "rate" : "concurrency", "calls/s",
                "items/s", "p50 ms", "p95 ms", "p99 ms", "errors", "floor calls/s");
    for (const LoadReport& r : reports) {
      const std::string value =
          by_rate ? absl::StrFormat("%g", r.options.rate) : absl::StrCat(r.options.concurrency);
      std::printf(
          "%12s %12.1f %12.1f %10.3f %10.3f %10.3f %8lld %14s\n", value.c_str(), r.calls_per_second,
          r.items_per_second, r.latency_ms.p50, r.latency_ms.p95, r.latency_ms.p99,
          static_cast<long long>(r.total_errors),
          r.floor.measured ? absl::StrFormat("%.1f", r.floor.calls_per_second).c_str() : "-");
    }
  }
  if (!json_path.empty()) {
    nlohmann::ordered_json out;
    if (sweep.empty()) {
      out = LoadReportToJson(reports[0]);
    } else {
      out["sweep"] = by_rate ? "rate" : "concurrency";
      out["runs"] = nlohmann::ordered_json::array();
      for (const LoadReport& r : reports) out["runs"].push_back(LoadReportToJson(r));
    }
    AddProvenance(replicas, provenance, &out);
    if (!WriteOutput(json_path, out.dump(2) + "\n", redirect.out())) return kExitSetupError;
  }
  if (!csv_path.empty() && !WriteOutput(csv_path, LoadReportsToCsv(reports), redirect.out())) {
    return kExitSetupError;
  }
  return worst;
}

// `load --steps`: one run of device-driven steps against one target.
int RunStepLoadCommand(ReplicaSet& replicas, const LoadOptions& options,
                       const std::vector<double>& sweep, const std::string& json_path,
                       const std::string& csv_path, const Provenance& provenance) {
  if (!sweep.empty() || !csv_path.empty() || replicas.size() != 1) {
    spdlog::error("load --steps: one target, no --sweep or --csv");
    return kExitSetupError;
  }
  const StdoutToStderr redirect(json_path == "-");
  absl::StatusOr<StepLoadReport> report = RunStepLoad(replicas.replica(0), options);
  if (!report.ok()) {
    spdlog::error("load --steps: {}", report.status().ToString());
    return report.status().code() == absl::StatusCode::kInvalidArgument ? kExitSetupError
                                                                        : kExitCheckFailed;
  }
  PrintStepLoadReport(*report);
  if (!json_path.empty()) {
    nlohmann::ordered_json out = StepLoadReportToJson(*report);
    AddProvenance(replicas, provenance, &out);
    if (!WriteOutput(json_path, out.dump(2) + "\n", redirect.out())) return kExitSetupError;
  }
  return report->ok() ? kExitOk : kExitCheckFailed;
}

int RunSoakCommand(VerifyClient& client, const std::string& target, const ClientOptions& options,
                   const SoakOptions& soak, const std::string& json_path) {
  const StdoutToStderr redirect(json_path == "-");
  absl::StatusOr<SoakReport> report = RunSoak(client, target, options, soak);
  if (!report.ok()) {
    spdlog::error("soak: {}", report.status().ToString());
    return report.status().code() == absl::StatusCode::kInvalidArgument ? kExitSetupError
                                                                        : kExitCheckFailed;
  }
  PrintSoakReport(*report);
  if (!json_path.empty()) {
    if (!WriteOutput(json_path, SoakReportToJson(*report).dump(2) + "\n", redirect.out())) {
      return kExitSetupError;
    }
  }
  return report->ok() ? kExitOk : kExitCheckFailed;
}

int Main(int argc, char** argv) {
  // Before any thread starts: a load run's requests and answers (hundreds
  // of KiB per call) then come from the heap without page faults.
  TuneHeapForLargeBuffers();
  TurnOffMutexDeadlockDetection();  // (mutex_tuning.h: why)
  // Before CUDA starts (load --steps --doorbell gpu): one hardware queue per
  // stream, so that a stream held at a doorbell wait holds no other stream's
  // work behind it (docs/steps.md). An operator's own setting stays.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  // Results go to stdout (tables, JSON); diagnostics to stderr.
  // A command-line tool's diagnostics: "mlaverify-client: error: ...", no
  // timestamp (the load's own lines carry their seconds).
  spdlog::set_default_logger(spdlog::stderr_color_mt("mlaverify-client"));
  spdlog::set_pattern("mlaverify-client: %^%l%$: %v");
  CLI::App app{"mlaverify-client: inspect, check and load an mlaverify verify-attention server"};
  app.require_subcommand(1);
  app.set_version_flag("--version", VersionLine("mlaverify-client"));
  UseUsageErrorLines(&app, "mlaverify-client");
  // The global flags may also follow the subcommand ("info --target h:p"):
  // a subcommand hands the flags it does not know to the main command. No
  // subcommand defines a flag of the same name as a global one, so either
  // place means the same.
  app.fallthrough();
  GlobalFlags flags;
  app.add_option("--target", flags.target,
                 "server address host:port; a comma-separated list for several replicas (load "
                 "spreads sequences over them; info, health and demo run on each in turn)")
      ->capture_default_str();
  AddSwitch(&app, "--tls", &flags.tls,
            "use TLS with the default roots (implied by the --tls-* files)");
  app.add_option("--tls-ca", flags.tls_ca, "PEM root CA to verify the server with")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-cert", flags.tls_cert, "PEM client certificate (mTLS; needs --tls-key)")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-key", flags.tls_key, "PEM client private key (mTLS; needs --tls-cert)")
      ->check(CLI::ExistingFile);
  app.add_option("--timeout-ms", flags.timeout_ms, "deadline of each call in ms (0: none)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-message-mib", flags.max_message_mib,
                 "client limit on one message each way, MiB")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--auth-token-file", flags.auth_token_file,
                 "file holding the bearer token servers started with --auth-token-file require");
  app.add_option("--http2-max-frame-bytes", flags.http2_max_frame_bytes,
                 "HTTP/2 max frame size this client accepts (0: gRPC's default, 16384)")
      ->check(CLI::Range(0, (1 << 24) - 1))
      ->capture_default_str();
  app.add_option("--http2-lookahead-bytes", flags.http2_lookahead_bytes,
                 "HTTP/2 per-call receive window (0: gRPC's default)")
      ->check(CLI::Range(0, 1 << 30))
      ->capture_default_str();
  AddSwitch(&app, "--wait-for-ready", &flags.wait_for_ready,
            "wait for the server to come up instead of failing with UNAVAILABLE");
  app.add_option("--connections", flags.connections,
                 "HTTP/2 connections per target; a sequence's calls stay on one, streams and "
                 "other calls take them in turn (1 behind a balancer that spreads connections "
                 "over servers)")
      ->check(CLI::Range(1, kMaxConnections))
      ->capture_default_str();
  app.add_option("--keepalive-time-ms", flags.keepalive_time_ms,
                 "ping a connection with a call open (an idle stream too) after this long "
                 "without traffic; keep it above the server's --http2-min-ping-interval-ms "
                 "(0: no pings)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--keepalive-timeout-ms", flags.keepalive_timeout_ms,
                 "close the connection when a ping is not acknowledged within this")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  AddSwitch(&app, "--keepalive-permit-without-calls", &flags.keepalive_permit_without_calls,
            "also ping connections with no call open");

  CLI::App* info_cmd = app.add_subcommand("info", "print the server's geometry, limits and pages");
  std::string info_json;
  info_cmd->add_option("--json", info_json, "write the info as JSON to this file ('-': stdout)");

  app.add_subcommand("health", "grpc.health.v1 Check; exit 0 only when SERVING");

  CLI::App* demo_cmd =
      app.add_subcommand("demo", "speculative-decoding loop checked against the CPU reference");
  DemoOptions demo;
  demo_cmd->add_option("--sequences", demo.sequences, "sequences, all in every Verify")
      ->capture_default_str();
  demo_cmd->add_option("--prompt-len", demo.prompt_len, "prompt tokens per sequence")
      ->capture_default_str();
  demo_cmd->add_option("--steps", demo.steps, "decode steps")->capture_default_str();
  demo_cmd->add_option("--drafts", demo.drafts, "drafts per step (capped by max_draft_len)")
      ->capture_default_str();
  demo_cmd->add_option("--seed", demo.seed, "random seed")->capture_default_str();
  AddSwitch(demo_cmd, "--stream", &demo.stream, "per-layer calls over VerifyStream");
  AddDataPlaneOptions(demo_cmd, &demo.data_plane, &demo.cuda_device);
  demo_cmd
      ->add_option("--softmax-scale", demo.softmax_scale,
                   "override the server's softmax scale (0: server default)")
      ->capture_default_str();
  demo_cmd->add_option("--max-rel-err", demo.max_rel_err, "largest relative error that passes")
      ->capture_default_str();
  demo_cmd->add_option("--max-lse-err", demo.max_lse_err, "largest LSE error that passes")
      ->capture_default_str();

  CLI::App* load_cmd = app.add_subcommand(
      "load",
      "load generator: closed loop, or open loop with --rate; a fixed duration or call count, "
      "or until stable with --stability-percent; percentiles, histogram, per-second series, "
      "the transport floor with --floor");
  LoadOptions load;
  std::string load_json;
  load_cmd
      ->add_option("--concurrency", load.concurrency,
                   "worker threads, each driving --items sequences")
      ->capture_default_str();
  load_cmd->add_option("--duration-s", load.duration_s, "measured seconds (0: no time bound)")
      ->capture_default_str();
  load_cmd
      ->add_option("--requests", load.requests,
                   "measured Verify calls (0: no count bound); the first bound reached ends "
                   "the run")
      ->capture_default_str();
  load_cmd->add_option("--warmup-s", load.warmup_s, "seconds excluded from the statistics")
      ->capture_default_str();
  // "N" or "LOW:HIGH": kept as text, checked as it is read and parsed into
  // the options after the command line (below).
  const auto add_range_option = [load_cmd](const std::string& flag, std::string* text,
                                           const std::string& help) {
    load_cmd->add_option(flag, *text, help)
        ->check([flag](const std::string& value) {
          int64_t low = 0, high = 0;
          // (CLI11 puts the flag's name before the message.)
          return ParseValueOrRange(flag, value, &low, &high).ok()
                     ? std::string()
                     : absl::StrCat(value,
                                    ": need a count N or a range LOW:HIGH, 0 <= LOW <= HIGH");
        })
        ->capture_default_str();
  };
  std::string load_prompt_len = absl::StrCat(load.prompt_len);
  add_range_option("--prompt-len", &load_prompt_len,
                   "prompt tokens per sequence, or LOW:HIGH for a length drawn uniformly per "
                   "sequence");
  load_cmd
      ->add_option("--items", load.items,
                   "sequences per Verify call (each worker drives this many; one target)")
      ->capture_default_str();
  std::string load_drafts = absl::StrCat(load.drafts);
  add_range_option("--drafts", &load_drafts,
                   "drafts per item and step (capped by max_draft_len), or LOW:HIGH for a tree "
                   "size drawn uniformly per item and step");
  load_cmd
      ->add_option("--max-seq-len", load.max_sequence_len,
                   "replace a sequence once it is this long (0: prompt-len + 512)")
      ->capture_default_str();
  load_cmd->add_option("--seed", load.seed, "random seed")->capture_default_str();
  AddSwitch(load_cmd, "--stream", &load.stream, "one VerifyStream per worker");
  AddDataPlaneOptions(load_cmd, &load.data_plane, &load.cuda_device);
  int64_t shm_staging_mib = 16;
  load_cmd
      ->add_option("--shm-staging-mib", shm_staging_mib,
                   "shm: AppendKv staging per worker; a prompt that fits is made there and "
                   "appended without a copy")
      ->check(CLI::Range(1, 1 << 16))
      ->capture_default_str();
  AddSwitch(load_cmd, "--floor", &load.floor,
            "then measure the bare-transport floor: a gRPC echo of the same message "
            "sizes, RPC kind, concurrency and duration in this process");
  load_cmd
      ->add_option("--rate", load.rate,
                   "open loop: Verify calls per second in all, taken by free workers "
                   "(0: closed loop)")
      ->capture_default_str();
  load_cmd
      ->add_option("--arrivals", load.arrivals,
                   "open loop: constant spacing, poisson (exponential gaps of mean 1/rate) or "
                   "burst (--burst-size calls due at once); each keeps --rate on average")
      ->check(CLI::IsMember({"constant", "poisson", "burst"}))
      ->capture_default_str();
  load_cmd->add_option("--burst-size", load.burst_size, "--arrivals burst: calls due at once")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  std::vector<double> load_sweep;
  load_cmd
      ->add_option("--sweep", load_sweep,
                   "one run per value, comma-separated: the concurrency, or with --rate "
                   "the rate; then a table")
      ->delimiter(',');
  AddSwitch(load_cmd, "--progress", &load.progress, "a progress line a second on stderr");
  load_cmd->add_option("--json", load_json,
                       "write the results to this JSON file ('-': stdout, the text report then "
                       "goes to stderr)");
  std::string load_csv;
  load_cmd->add_option("--csv", load_csv,
                       "write one CSV row per run (a sweep's too) to this file ('-': stdout)");
  Provenance provenance;
  load_cmd
      ->add_option("--metadata", provenance.metadata,
                   "key=value written into the JSON's metadata (repeatable: the card, the "
                   "build, what is being compared); the JSON also records when, which "
                   "client, the command line and each server's version and instance")
      ->check([](const std::string& kv) {
        return kv.find('=') == std::string::npos || kv.front() == '='
                   ? std::string("need key=value with a non-empty key")
                   : std::string();
      });
  load_cmd
      ->add_option("--percentile", load.percentiles,
                   "also report these percentiles, comma-separated (e.g. 99.5,99.99)")
      ->delimiter(',')
      ->check(CLI::Range(0.0, 100.0));
  load_cmd
      ->add_option("--stability-percent", load.stability_percent,
                   "instead of --duration-s: measure in windows until the last 3 agree on "
                   "calls/s and mean latency within this percentage (fails after "
                   "--max-windows); 0: off")
      ->check(CLI::Range(0.0, 100.0))
      ->capture_default_str();
  load_cmd->add_option("--window-s", load.window_s, "stability window length, seconds")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  load_cmd->add_option("--max-windows", load.max_windows, "stability windows at most")
      ->check(CLI::Range(kStableWindows, 1000))
      ->capture_default_str();
  AddSwitch(load_cmd, "--steps", &load.steps,
            "device-driven steps instead of Verify calls: one OpenStep per decode step, every "
            "layer rung and awaited through doorbells, then the commits; reports step and "
            "per-layer latency (needs --allow-client-shm on the server)");
  load_cmd
      ->add_option("--doorbell", load.doorbell,
                   "--steps: host (slots in a system shared-memory region) or gpu (stream "
                   "memory operations on --cuda-device, tensors in a CUDA region)")
      ->check(CLI::IsMember({"host", "gpu"}))
      ->capture_default_str();
  load_cmd
      ->add_option("--client-work-us", load.client_work_us,
                   "--steps: the scheduler's own work before each layer's ring, microseconds "
                   "(gpu: a busy kernel on every multiprocessor; host: a busy loop)")
      ->check(CLI::Range(0.0, 1e6))
      ->capture_default_str();

  CLI::App* soak_cmd = app.add_subcommand(
      "soak",
      "long randomised run: whole sequence lifetimes, every answer checked, some calls "
      "cut short by their deadline; fails on any error, wrong answer or leaked page");
  SoakOptions soak;
  std::string soak_json;
  int64_t cut_deadline_us = 300;
  soak_cmd->add_option("--workers", soak.workers, "worker threads")->capture_default_str();
  soak_cmd->add_option("--duration-s", soak.duration_s, "seconds to run")->capture_default_str();
  soak_cmd->add_option("--max-prompt-len", soak.max_prompt_len, "prompts of 1..this many tokens")
      ->capture_default_str();
  soak_cmd->add_option("--max-steps", soak.max_steps, "verify steps per sequence, 1..this many")
      ->capture_default_str();
  soak_cmd->add_option("--drafts", soak.drafts, "drafts per step, 1..this many")
      ->capture_default_str();
  soak_cmd
      ->add_option("--cut-fraction", soak.cut_fraction,
                   "share of Verify calls sent with the short deadline")
      ->capture_default_str();
  soak_cmd->add_option("--cut-deadline-us", cut_deadline_us, "the short deadline, microseconds")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  soak_cmd->add_option("--seed", soak.seed, "random seed")->capture_default_str();
  soak_cmd->add_option("--json", soak_json, "write the report to this JSON file ('-': stdout)");

  // A subcommand's --help lists its own options only: say where the
  // connection's are (the tool's, accepted before or after the subcommand).
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    sub->footer(
        "Connection options (--target, --connections, --timeout-ms, --tls..., keepalive, ...) "
        "are the tool's, before or after the subcommand: mlaverify-client --help lists them.");
  }

  try {
    provenance.command_line = absl::StrJoin(argv, argv + argc, " ");
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? kExitOk : kExitSetupError;
  }

  ClientOptions options;
  options.use_tls = flags.tls;
  options.tls_root_ca_file = flags.tls_ca;
  options.tls_cert_chain_file = flags.tls_cert;
  options.tls_private_key_file = flags.tls_key;
  options.call_timeout =
      flags.timeout_ms > 0 ? absl::Milliseconds(flags.timeout_ms) : absl::InfiniteDuration();
  options.max_send_message_bytes = flags.max_message_mib << 20;
  options.max_receive_message_bytes = flags.max_message_mib << 20;
  options.wait_for_ready = flags.wait_for_ready;
  options.http2_max_frame_bytes = flags.http2_max_frame_bytes;
  options.http2_lookahead_bytes = flags.http2_lookahead_bytes;
  options.connections = flags.connections;
  options.keepalive_time = flags.keepalive_time_ms > 0 ? absl::Milliseconds(flags.keepalive_time_ms)
                                                       : absl::InfiniteDuration();
  options.keepalive_timeout = absl::Milliseconds(flags.keepalive_timeout_ms);
  options.keepalive_permit_without_calls = flags.keepalive_permit_without_calls;
  if (!flags.auth_token_file.empty()) {
    absl::StatusOr<std::string> token = ReadAuthToken(flags.auth_token_file);
    if (!token.ok()) {
      spdlog::error("--auth-token-file: {}", token.status().ToString());
      return kExitSetupError;
    }
    options.auth_token = *std::move(token);
  }
  const std::vector<std::string> targets = absl::StrSplit(flags.target, ',', absl::SkipEmpty());
  absl::StatusOr<std::unique_ptr<ReplicaSet>> replicas = ReplicaSet::Create(targets, options);
  if (!replicas.ok()) {
    spdlog::error("--target {}: {}", flags.target, replicas.status().ToString());
    return kExitSetupError;
  }
  ReplicaSet& set = **replicas;
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  load.shm_staging_bytes = shm_staging_mib << 20;
  if (load_cmd->parsed()) {
    // Checked when parsed: these cannot fail here.
    int64_t drafts = 0, drafts_max = 0;
    ParseValueOrRange("--prompt-len", load_prompt_len, &load.prompt_len, &load.prompt_len_max)
        .IgnoreError();
    ParseValueOrRange("--drafts", load_drafts, &drafts, &drafts_max).IgnoreError();
    load.drafts = static_cast<int>(std::min<int64_t>(drafts, 1 << 20));
    load.drafts_max = static_cast<int>(std::min<int64_t>(drafts_max, 1 << 20));
  }
  g_load_command.store(load_cmd->parsed());
  if (load_cmd->parsed() && load.steps) {
    return RunStepLoadCommand(set, load, load_sweep, load_json, load_csv, provenance);
  }
  if (load_cmd->parsed()) {
    return RunLoadCommand(set, load, load_sweep, load_json, load_csv, provenance);
  }
  if (soak_cmd->parsed()) {
    if (set.size() > 1) {
      spdlog::error("soak takes one target (got {})", set.size());
      return kExitSetupError;
    }
    soak.cut_deadline = absl::Microseconds(cut_deadline_us);
    return RunSoakCommand(set.replica(0), targets[0], options, soak, soak_json);
  }
  // info, health and demo: each replica in turn; the worst exit status.
  if (info_cmd->parsed() && set.size() > 1 && !info_json.empty() && info_json != "-") {
    spdlog::error("info --json {}: one file takes one target; give --json - for every one",
                  info_json);
    return kExitSetupError;
  }
  int worst = kExitOk;
  for (int r = 0; r < set.size(); ++r) {
    if (set.size() > 1) std::printf("== %s\n", set.Name(r).c_str());
    int rc = kExitOk;
    if (info_cmd->parsed()) {
      rc = RunInfo(set.replica(r), info_json);
    } else if (demo_cmd->parsed()) {
      rc = RunDemo(set.replica(r), demo).passed ? kExitOk : kExitCheckFailed;
    } else {
      rc = RunHealth(set.replica(r));
    }
    worst = std::max(worst, rc);
  }
  return worst;
}

}  // namespace
}  // namespace mlaverify::client

int main(int argc, char** argv) { return mlaverify::client::Main(argc, argv); }
