#include "client/step_load.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/client_work.h"
#include "client/cuda_shared_memory.h"
#include "client/gpu_doorbells.h"
#include "client/shared_memory.h"
#include "common/geometry.h"
#include "common/host_doorbell.h"
#include "common/status_macros.h"
#include "common/workload.h"
#include "spdlog/spdlog.h"

namespace mlaverify::client {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kAlign = 256;
uint64_t AlignUp(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Busy for `microseconds` on this thread (a scheduler's host work).
void Spin(double microseconds) {
  if (microseconds <= 0) return;
  const Clock::time_point end =
      Clock::now() + std::chrono::nanoseconds(static_cast<int64_t>(microseconds * 1e3));
  while (Clock::now() < end) {
  }
}

// What every worker shares.
struct Plan {
  LoadOptions options;
  bool gpu = false;
  int layers = 0, heads = 0, ranks = 0, drafts = 0;
  int64_t max_len = 0;
  std::string region, cuda_region;  // tensors (and host slots), GPU tensors
  uint8_t* region_data = nullptr;
  uint64_t worker_bytes = 0;    // per worker in the tensor region
  uint64_t staging_offset = 0;  // per-worker prompt staging, after all tensors
  uint64_t staging_bytes = 0;
  // [layers, prompt_len, 576]: made in each worker's staging where it fits
  // there (the append then copies nothing), else this one, shared.
  std::vector<Bf16> prompt;
  // How long a host-doorbell wait spins before it sleeps: long on a GPU
  // server (a layer is microseconds; a scheduler has nothing else to do),
  // short on the CPU backend, whose compute shares the cores.
  absl::Duration spin = absl::Milliseconds(20);
  std::atomic<bool> stop{false};
  std::atomic<bool> measuring{false};
  // Workers with their tensors in place and their first prompts appended:
  // the warm-up starts when all are (prompt uploads are not timed).
  std::atomic<int> ready{0};
  Clock::time_point measure_start;
};

struct WorkerResult {
  std::vector<double> step_ms, layer_us, layers_ms, open_ms, commit_ms;
  int64_t steps = 0, items = 0, lane_waits = 0;
  std::map<std::string, int64_t> errors;
  std::string first_error;
};

class Worker {
 public:
  Worker(int index, VerifyClient& client, Plan& plan)
      : index_(index), client_(client), plan_(plan), rng_(plan.options.seed * 7919 + index) {}

  WorkerResult& result() { return result_; }

  void Run() {
    const bool set_up = Setup();
    // Ready once tried: a failed first append is counted and retried below.
    if (set_up) CreateSequences();
    plan_.ready.fetch_add(1);
    if (!set_up) return;
    while (!plan_.stop.load()) {
      if (sequences_.empty() && !CreateSequences()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      Step();
    }
    Release();
  }

  // Sequences still held at the end (released by Run, else here).
  void Release() {
    for (uint64_t id : sequences_) {
      absl::StatusOr<int64_t> freed = client_.ReleaseSequence(id);
      if (!freed.ok()) Error("ReleaseSequence", freed.status());
    }
    sequences_.clear();
    lengths_.clear();
  }

 private:
  uint64_t Base() const { return static_cast<uint64_t>(index_) * plan_.worker_bytes; }

  void Error(const char* rpc, const absl::Status& status) {
    const std::string key = absl::StrCat(rpc, " ", absl::StatusCodeToString(status.code()));
    ++result_.errors[key];
    if (result_.first_error.empty())
      result_.first_error = absl::StrCat(rpc, ": ", status.ToString());
    if (result_.errors[key] == 1)
      spdlog::warn("load --steps worker {}: {}", index_, status.ToString());
  }

  // The worker's tensors: random inputs written once into place, the
  // placements every step names (one place for every layer), the streams.
  bool Setup() {
    const LoadOptions& o = plan_.options;
    const int n = plan_.drafts, h = plan_.heads;
    uint64_t at = Base();
    const std::string& region = plan_.gpu ? plan_.cuda_region : plan_.region;
    spec_.doorbells = plan_.gpu ? Doorbells::kGpu : Doorbells::kHost;
    spec_.ranks.assign(plan_.ranks, StepRankSpec{});
    for (StepRankSpec& rank : spec_.ranks) {
      for (int k = 0; k < o.items; ++k) {
        const ShmItemPlacement t = PlaceVerifyItem(region, nullptr, at, n, h);
        at = t.end_offset;
        const std::vector<Bf16> q = RandomBf16(rng_, static_cast<size_t>(n) * h * kLatentDim, 2.0f);
        const std::vector<Bf16> kv = RandomBf16(rng_, static_cast<size_t>(n) * kLatentDim, 1.0f);
        if (!Write(t.q_offset, q.data(), q.size() * sizeof(Bf16)) ||
            !Write(t.draft_kv_offset, kv.data(), kv.size() * sizeof(Bf16))) {
          return false;
        }
        rank.items.push_back(StepItemPlace::Of(t));
      }
    }
    staging_ = {plan_.region, plan_.region_data,
                plan_.staging_offset + static_cast<uint64_t>(index_) * plan_.staging_bytes,
                plan_.staging_bytes};
    const size_t values = static_cast<size_t>(plan_.layers) * o.prompt_len * kLatentDim;
    if (plan_.prompt.empty() && values > 0) {
      // The server never looks at the values: one random prompt per worker,
      // made where the append reads it.
      auto* in_place = reinterpret_cast<Bf16*>(staging_.base + staging_.offset);
      FillUniformBf16(rng_, -1.0f, 1.0f, absl::MakeSpan(in_place, values));
      prompt_ = absl::MakeConstSpan(in_place, values);
    } else {
      prompt_ = plan_.prompt;
    }
    if (plan_.gpu) {
      for (int r = 0; r < plan_.ranks; ++r) {
        // Two events per layer: before the ring, after the wait.
        absl::StatusOr<std::unique_ptr<gpu_doorbells::TimedStream>> s =
            gpu_doorbells::TimedStream::Create(o.cuda_device, 2 * plan_.layers);
        if (!s.ok()) {
          Error("setup", s.status());
          plan_.stop.store(true);
          return false;
        }
        streams_.push_back(*std::move(s));
      }
    } else {
      for (StepRankSpec& rank : spec_.ranks) {
        rank.doorbell_region = plan_.region;
        rank.doorbell_offset = AlignUp(at);
        rank.completion_offset = rank.doorbell_offset + kHostSlotBytes;
        rank.doorbell_region_data = plan_.region_data;
        at = rank.doorbell_offset + 2 * kHostSlotBytes;
      }
    }
    return true;
  }

  bool Write(uint64_t offset, const void* data, size_t bytes) {
    if (!plan_.gpu) {
      std::memcpy(plan_.region_data + offset, data, bytes);
      return true;
    }
    if (absl::Status s = cuda_->Write(offset, data, bytes); !s.ok()) {
      Error("setup", s);
      plan_.stop.store(true);
      return false;
    }
    return true;
  }

 public:
  void SetCudaBuffer(const CudaSharedMemoryBuffer* cuda) { cuda_ = cuda; }

 private:
  bool CreateSequences() {
    const LoadOptions& o = plan_.options;
    for (int k = 0; k < o.items; ++k) {
      absl::StatusOr<uint64_t> id = client_.CreateSequence(absl::StrCat("load-steps-", index_));
      if (!id.ok()) {
        Error("CreateSequence", id.status());
        Release();
        return false;
      }
      sequences_.push_back(*id);
      lengths_.push_back(0);
      if (o.prompt_len == 0) continue;
      absl::StatusOr<AppendKvResult> appended =
          client_.AppendKv(*id, 0, plan_.layers, o.prompt_len, prompt_, &staging_);
      if (!appended.ok()) {
        Error("AppendKv", appended.status());
        Release();
        return false;
      }
      lengths_.back() = appended->length;
    }
    return true;
  }

  // This step's items (the placements stay as Setup made them).
  void DrawItems() {
    spec_.items.clear();
    for (uint64_t sequence : sequences_) {
      spec_.items.push_back({sequence, RandomDraftTree(rng_, plan_.drafts)});
    }
  }

  void Step() {
    DrawItems();
    const StepSpec& spec = spec_;
    const Clock::time_point opened_at = Clock::now();
    absl::StatusOr<std::unique_ptr<DeviceStep>> opened = client_.OpenStep(spec);
    const Clock::time_point opened_done = Clock::now();
    if (!opened.ok()) {
      if (opened.status().code() == absl::StatusCode::kResourceExhausted &&
          absl::StrContains(opened.status().message(), "step lanes are busy")) {
        ++result_.lane_waits;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        return;
      }
      Error("OpenStep", opened.status());
      Release();  // their state is unknown now
      return;
    }
    DeviceStep& step = **opened;
    const bool measured = plan_.measuring.load() && opened_at >= plan_.measure_start;
    std::vector<double> layer_us;
    absl::Status ran = plan_.gpu ? RunGpuLayers(step, &layer_us) : RunHostLayers(step, &layer_us);
    double layers_ms = 0;
    if (ran.ok() && plan_.gpu) {
      absl::StatusOr<double> span = streams_[0]->Elapsed(0, 2 * plan_.layers - 1);
      if (span.ok()) layers_ms = *span * 1e3;
    }
    if (!ran.ok()) {
      Error("step", ran);
      absl::StatusOr<v1::StepStatus> aborted = step.Abort();
      if (!aborted.ok()) Error("AbortStep", aborted.status());
      return;
    }
    const Clock::time_point commit_start = Clock::now();
    for (size_t k = 0; k < sequences_.size(); ++k) {
      // A random root-to-node path: what a scheduler accepts.
      const std::vector<int32_t>& parents = spec.items[k].parents;
      const int node = static_cast<int>(rng_() % (parents.size() + 1)) - 1;
      const std::vector<int32_t> path =
          node < 0 ? std::vector<int32_t>{} : PathToNode(parents, node);
      absl::StatusOr<CommitResult> committed = client_.Commit(sequences_[k], path);
      if (!committed.ok()) {
        Error("Commit", committed.status());
        Release();
        return;
      }
      lengths_[k] = committed->length;
    }
    const Clock::time_point end = Clock::now();
    if (!plan_.gpu) layers_ms = layer_span_ms_;
    if (measured && !plan_.stop.load()) {
      result_.step_ms.push_back(Seconds(opened_at, end) * 1e3);
      result_.open_ms.push_back(Seconds(opened_at, opened_done) * 1e3);
      result_.commit_ms.push_back(Seconds(commit_start, end) * 1e3);
      result_.layers_ms.push_back(layers_ms);
      result_.layer_us.insert(result_.layer_us.end(), layer_us.begin(), layer_us.end());
      ++result_.steps;
      result_.items += static_cast<int64_t>(sequences_.size());
    }
    // Sequences that grew past the budget are replaced.
    for (int64_t len : lengths_) {
      if (len + plan_.drafts > plan_.max_len) {
        Release();
        break;
      }
    }
  }

  absl::Status RunHostLayers(DeviceStep& step, std::vector<double>* layer_us) {
    const LoadOptions& o = plan_.options;
    Clock::time_point first{}, last{};
    for (int l = 0; l < plan_.layers; ++l) {
      Spin(o.client_work_us);
      const Clock::time_point rung = Clock::now();
      if (l == 0) first = rung;
      for (int r = 0; r < plan_.ranks; ++r) RETURN_IF_ERROR(step.Ring(r, l + 1));
      for (int r = 0; r < plan_.ranks; ++r) {
        RETURN_IF_ERROR(step.Wait(r, l + 1, absl::Seconds(30), plan_.spin));
      }
      last = Clock::now();
      layer_us->push_back(Seconds(rung, last) * 1e6);
    }
    layer_span_ms_ = Seconds(first, last) * 1e3;
    return absl::OkStatus();
  }

  // Every layer enqueued at once on the ranks' streams, as a scheduler's
  // step would be: [its work] [event] ring, wait [event]; then one sync.
  absl::Status RunGpuLayers(DeviceStep& step, std::vector<double>* layer_us) {
    const LoadOptions& o = plan_.options;
    // Every rank's stream is on --cuda-device: current once per step.
    if (o.client_work_us > 0) RETURN_IF_ERROR(streams_[0]->MakeCurrent());
    for (int l = 0; l < plan_.layers; ++l) {
      for (int r = 0; r < plan_.ranks; ++r) {
        gpu_doorbells::TimedStream& s = *streams_[r];
        if (o.client_work_us > 0) RETURN_IF_ERROR(LaunchClientWork(s.stream(), o.client_work_us));
        RETURN_IF_ERROR(s.Record(2 * l));
        RETURN_IF_ERROR(step.RingOnStream(r, l + 1, s.stream()));
        RETURN_IF_ERROR(step.WaitOnStream(r, l + 1, s.stream()));
        RETURN_IF_ERROR(s.Record(2 * l + 1));
      }
    }
    for (auto& s : streams_) RETURN_IF_ERROR(s->Synchronize());
    // A step that ended early released every wait: its outputs do not count.
    for (int r = 0; r < plan_.ranks; ++r) RETURN_IF_ERROR(step.Completed(r).status());
    for (int l = 0; l < plan_.layers; ++l) {
      for (auto& s : streams_) {
        ASSIGN_OR_RETURN(double seconds, s->Elapsed(2 * l, 2 * l + 1));
        layer_us->push_back(seconds * 1e6);
      }
    }
    return absl::OkStatus();
  }

  const int index_;
  VerifyClient& client_;
  Plan& plan_;
  std::mt19937_64 rng_;
  WorkerResult result_;
  const CudaSharedMemoryBuffer* cuda_ = nullptr;
  StepSpec spec_;  // the ranks' placements (Setup), this step's items (DrawItems)
  std::vector<std::unique_ptr<gpu_doorbells::TimedStream>> streams_;  // per rank
  ShmStaging staging_;                                                // the worker's prompt staging
  absl::Span<const Bf16> prompt_;                                     // in it, or the plan's
  std::vector<uint64_t> sequences_;
  std::vector<int64_t> lengths_;
  double layer_span_ms_ = 0;
};

}  // namespace

absl::StatusOr<StepLoadReport> RunStepLoad(VerifyClient& client, const LoadOptions& options) {
  const LoadOptions& o = options;
  if (o.rate > 0 || o.stream || o.floor || o.stability_percent > 0 || o.requests > 0) {
    return absl::InvalidArgumentError(
        "--steps runs closed-loop device-driven steps: --rate, --stream, --floor, "
        "--stability-percent and --requests do not apply");
  }
  if (o.prompt_len_max > o.prompt_len || o.drafts_max > o.drafts) {
    return absl::InvalidArgumentError(
        "--steps takes a fixed --prompt-len and --drafts (a step's slots are sized once), not "
        "ranges");
  }
  if (o.doorbell != "host" && o.doorbell != "gpu") {
    return absl::InvalidArgumentError(absl::StrCat("--doorbell ", o.doorbell,
                                                   ": host (system shared-memory slots) or gpu "
                                                   "(stream memory operations on --cuda-device)"));
  }
  if (o.concurrency < 1 || o.items < 1 || o.duration_s <= 0 || o.client_work_us < 0) {
    return absl::InvalidArgumentError(
        "--steps needs --concurrency, --items >= 1, --duration-s > 0, --client-work-us >= 0");
  }
  ASSIGN_OR_RETURN(v1::ServerInfo info, client.GetServerInfo());
  const bool gpu = o.doorbell == "gpu";
  if (gpu ? !info.gpu_doorbells() : !info.host_doorbells()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the server (", info.backend(), ", step lanes ", info.step_lanes_per_device(),
                     ") takes no ", o.doorbell, " doorbells",
                     gpu ? " (GPU doorbells need the CUDA backend)" : ""));
  }
  if (!info.client_shared_memory()) {
    return absl::InvalidArgumentError(
        "the server takes no shared memory (start it with --allow-client-shm)");
  }
  auto plan = std::make_unique<Plan>();
  plan->options = o;
  plan->gpu = gpu;
  plan->layers = info.num_layers();
  plan->heads = info.heads_per_device();
  plan->ranks = info.parallel_mode() == "tp" ? std::max(1, info.devices_size()) : 1;
  plan->drafts = std::min(o.drafts, info.max_draft_len());
  if (info.backend() == "cpu") plan->spin = absl::Microseconds(50);
  plan->max_len = o.max_sequence_len > 0 ? o.max_sequence_len : o.prompt_len + 512;
  plan->max_len = std::min<int64_t>(plan->max_len, info.max_sequence_len());
  if (o.items > info.max_batch()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--items ", o.items, ": the server's max_batch is ", info.max_batch()));
  }
  // One worker's tensors (and host slots), 256-aligned as Setup lays them.
  const uint64_t item = ShmVerifyItemBytes(plan->drafts, plan->heads);
  plan->worker_bytes = plan->ranks * (o.items * item + AlignUp(2 * kHostSlotBytes));
  plan->staging_bytes =
      AlignUp(PromptStagingBytes(plan->layers, o.prompt_len, o.shm_staging_bytes));
  plan->staging_offset = o.concurrency * plan->worker_bytes;
  const uint64_t system_bytes = plan->staging_offset + o.concurrency * plan->staging_bytes;
  ASSIGN_OR_RETURN(std::unique_ptr<SharedMemoryBuffer> shm,
                   SharedMemoryBuffer::Create(system_bytes));
  plan->region = absl::StrCat("load-steps-", getpid());
  RETURN_IF_ERROR(client.RegisterSystemSharedMemory(plan->region, shm->key(), 0, shm->size()));
  plan->region_data = shm->data();
  std::unique_ptr<CudaSharedMemoryBuffer> cuda;
  absl::Status setup;
  if (gpu) {
    absl::StatusOr<std::unique_ptr<CudaSharedMemoryBuffer>> made =
        CudaSharedMemoryBuffer::Create(o.cuda_device, o.concurrency * plan->worker_bytes);
    setup = made.status();
    if (setup.ok()) {
      cuda = *std::move(made);
      plan->cuda_region = absl::StrCat("load-steps-gpu-", getpid());
      setup = client.RegisterCudaSharedMemory(plan->cuda_region, cuda->ipc_handle(), o.cuda_device,
                                              cuda->size());
    }
  }
  const size_t prompt_values = static_cast<size_t>(plan->layers) * o.prompt_len * kLatentDim;
  if (setup.ok() && prompt_values * sizeof(Bf16) > plan->staging_bytes) {
    std::mt19937_64 rng(o.seed);
    plan->prompt.resize(prompt_values);
    FillUniformBf16(rng, -1.0f, 1.0f, absl::MakeSpan(plan->prompt));
  }
  StepLoadReport report;
  report.target = client.target();
  report.options = o;
  report.server_version = info.version();
  report.backend = info.backend();
  report.device = info.devices_size() > 0 ? info.devices(0).name() : "";
  report.instance_id = info.instance_id();
  report.parallel_mode = info.parallel_mode();
  report.num_layers = plan->layers;
  report.num_heads = info.num_heads();
  report.heads_per_device = plan->heads;
  report.ranks = plan->ranks;
  report.num_drafts = plan->drafts;
  report.free_pages_before = info.free_pages();
  std::vector<std::unique_ptr<Worker>> workers;
  if (setup.ok()) {
    for (int w = 0; w < o.concurrency; ++w) {
      workers.push_back(std::make_unique<Worker>(w, client, *plan));
      workers.back()->SetCudaBuffer(cuda.get());
    }
    std::vector<std::thread> threads;
    for (auto& w : workers) threads.emplace_back([&w] { w->Run(); });
    // Every worker's prompts appended (not timed), a warm-up, then the
    // measured window.
    const Clock::time_point ramp_start = Clock::now();
    while (plan->ready.load() < o.concurrency && !plan->stop.load() && !LoadStopRequested()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    report.prompt_seconds = Seconds(ramp_start, Clock::now());
    const Clock::time_point start = Clock::now();
    const auto sleep_until = [&](Clock::time_point t) {
      while (Clock::now() < t && !plan->stop.load() && !LoadStopRequested()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    };
    sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(o.warmup_s)));
    plan->measure_start = Clock::now();
    plan->measuring.store(true);
    report.ramp_up_seconds = Seconds(start, plan->measure_start);
    const Clock::time_point end =
        plan->measure_start +
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.duration_s));
    while (Clock::now() < end && !plan->stop.load() && !LoadStopRequested()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(o.progress ? 1000 : 10));
      if (o.progress) {
        int64_t steps = 0;
        for (auto& w : workers) steps += w->result().steps;  // a racy read, for the eye only
        spdlog::info("load --steps: {:.0f} s, {} steps", Seconds(plan->measure_start, Clock::now()),
                     steps);
      }
    }
    report.measured_seconds = Seconds(plan->measure_start, Clock::now());
    plan->stop.store(true);
    for (auto& t : threads) t.join();
  }
  std::vector<double> step_ms, layer_us, layers_ms, open_ms, commit_ms;
  for (auto& w : workers) {
    WorkerResult& r = w->result();
    step_ms.insert(step_ms.end(), r.step_ms.begin(), r.step_ms.end());
    layer_us.insert(layer_us.end(), r.layer_us.begin(), r.layer_us.end());
    layers_ms.insert(layers_ms.end(), r.layers_ms.begin(), r.layers_ms.end());
    open_ms.insert(open_ms.end(), r.open_ms.begin(), r.open_ms.end());
    commit_ms.insert(commit_ms.end(), r.commit_ms.begin(), r.commit_ms.end());
    report.steps += r.steps;
    report.items += r.items;
    report.lane_waits += r.lane_waits;
    for (const auto& [key, count] : r.errors) {
      report.errors[key] += count;
      report.total_errors += count;
    }
    if (report.first_error.empty()) report.first_error = r.first_error;
  }
  if (!setup.ok()) {
    report.errors["setup"] += 1;
    report.total_errors += 1;
    report.first_error = setup.ToString();
  }
  report.step_ms = Summarize(std::move(step_ms), o.percentiles);
  report.layer_us = Summarize(std::move(layer_us), o.percentiles);
  report.layers_ms = Summarize(std::move(layers_ms), o.percentiles);
  report.open_ms = Summarize(std::move(open_ms), o.percentiles);
  report.commit_ms = Summarize(std::move(commit_ms), o.percentiles);
  if (report.measured_seconds > 0) {
    report.steps_per_second = report.steps / report.measured_seconds;
    report.items_per_second = report.items / report.measured_seconds;
  }
  // Once no step holds them (an aborted step's end can lag).
  for (const auto& [name, cuda] : {std::pair{plan->cuda_region, true}, {plan->region, false}}) {
    if (name.empty()) continue;
    if (const absl::Status gone = UnregisterWhenReleased(client, name, cuda); !gone.ok()) {
      spdlog::warn("load --steps: unregistering shared memory '{}': {}", name, gone.ToString());
    }
  }
  absl::StatusOr<v1::ServerInfo> after = client.GetServerInfo();
  if (after.ok()) {
    report.free_pages_after = after->free_pages();
    report.page_leak = after->instance_id() == report.instance_id &&
                       report.free_pages_after != report.free_pages_before;
  } else {
    report.errors["GetServerInfo"] += 1;
    report.total_errors += 1;
  }
  return report;
}

void PrintStepLoadReport(const StepLoadReport& r) {
  const LoadOptions& o = r.options;
  std::printf(
      "load --steps: %d workers x %d items, %s doorbells, %d layers x %d heads (%d rank%s), "
      "N=%d, prompt %lld, client work %.0f us, %s (%s)\n",
      o.concurrency, o.items, o.doorbell.c_str(), r.num_layers, r.heads_per_device, r.ranks,
      r.ranks == 1 ? "" : "s", r.num_drafts, static_cast<long long>(o.prompt_len), o.client_work_us,
      r.backend.c_str(), r.device.c_str());
  std::printf("steps:        %lld in %.1f s: %.1f steps/s, %.1f items/s, %lld lane waits\n",
              static_cast<long long>(r.steps), r.measured_seconds, r.steps_per_second,
              r.items_per_second, static_cast<long long>(r.lane_waits));
  const auto line = [](const char* name, const LatencySummary& l, const char* unit) {
    std::printf("%-13s p50 %.3f  p90 %.3f  p99 %.3f  max %.3f %s (%lld)\n", name, l.p50, l.p90,
                l.p99, l.max, unit, static_cast<long long>(l.count));
  };
  line("step:", r.step_ms, "ms");
  line("layer:", r.layer_us, "us");
  line("layers:", r.layers_ms, "ms");
  line("open:", r.open_ms, "ms");
  line("commits:", r.commit_ms, "ms");
  std::printf("pages:        %lld free before, %lld after%s\n",
              static_cast<long long>(r.free_pages_before),
              static_cast<long long>(r.free_pages_after), r.page_leak ? " (LEAK)" : "");
  for (const auto& [key, count] : r.errors) {
    std::printf("errors:       %s: %lld\n", key.c_str(), static_cast<long long>(count));
  }
  if (!r.first_error.empty()) std::printf("first error:  %s\n", r.first_error.c_str());
  std::printf("%s\n", r.ok() ? "PASS" : "FAIL");
}

nlohmann::ordered_json StepLoadReportToJson(const StepLoadReport& r) {
  const LoadOptions& o = r.options;
  return {
      {"target", r.target},
      {"pass", r.ok()},
      {"mode", "steps"},
      {"server",
       {{"version", r.server_version},
        {"backend", r.backend},
        {"device", r.device},
        {"instance_id", r.instance_id},
        {"parallel_mode", r.parallel_mode}}},
      {"options",
       {{"concurrency", o.concurrency},
        {"items", o.items},
        {"duration_s", o.duration_s},
        {"warmup_s", o.warmup_s},
        {"prompt_len", o.prompt_len},
        {"drafts", r.num_drafts},
        {"doorbell", o.doorbell},
        {"client_work_us", o.client_work_us},
        {"cuda_device", o.cuda_device},
        {"seed", o.seed}}},
      {"num_layers", r.num_layers},
      {"num_heads", r.num_heads},
      {"heads_per_device", r.heads_per_device},
      {"ranks", r.ranks},
      {"prompt_seconds", r.prompt_seconds},
      {"ramp_up_seconds", r.ramp_up_seconds},
      {"measured_seconds", r.measured_seconds},
      {"steps", r.steps},
      {"items", r.items},
      {"steps_per_second", r.steps_per_second},
      {"items_per_second", r.items_per_second},
      {"step_ms", LatencySummaryToJson(r.step_ms)},
      {"layer_us", LatencySummaryToJson(r.layer_us)},
      {"layers_ms", LatencySummaryToJson(r.layers_ms)},
      {"open_ms", LatencySummaryToJson(r.open_ms)},
      {"commit_ms", LatencySummaryToJson(r.commit_ms)},
      {"lane_waits", r.lane_waits},
      {"errors", r.errors},
      {"first_error", r.first_error},
      {"total_errors", r.total_errors},
      {"free_pages_before", r.free_pages_before},
      {"free_pages_after", r.free_pages_after},
      {"page_leak", r.page_leak},
  };
}

}  // namespace mlaverify::client
