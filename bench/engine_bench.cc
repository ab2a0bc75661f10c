// mlaverify-engine-bench: the engine in process, without gRPC, driven by many
// threads the way schedulers drive the service. Each thread owns a sequence
// with a random prompt of --prefix-len tokens and runs verify steps: one
// Verify of one item (N drafts, a random tree) per layer, waiting for each,
// then an empty Commit (a rejected step, so the length stays the same).
// Reports items/s and the per-Verify latency percentiles, the batch sizes the
// workers formed, and, on a GPU, the kernel's own time for the same shape
// measured in the same run (a CUDA graph of the attention alone, L2 flushed,
// median), so that engine overhead = engine p50 - kernel time. With
// --backend fake the device takes --fake-launch-us (+ --fake-request-us per
// request) per launch and computes nothing: the host side alone, measurable
// on a machine without a GPU.
//
//   mlaverify-engine-bench --backend cuda --devices 0 --prefix-len 1024,16384
//       --threads 1,64 --duration-s 5 --json engine.json
//
// Writes one row per (prefix length, thread count) in the format of
// bench/results/engine-*.json.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/geometry.h"
#include "common/workload.h"
#include "nlohmann/json.hpp"
#include "server/engine/device.h"
#include "server/engine/engine.h"
#include "spdlog/spdlog.h"

#ifdef MLAVERIFY_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/testing/device_problem.h"
#include "kernels/testing/verify_problem.h"
#include "kernels/verify_attention_cuda.h"
#endif

namespace mlaverify {
namespace {

using engine::Engine;

// Counts the batches the workers ran, by size and path.
class BatchCounter final : public engine::EngineObserver {
 public:
  void OnBatch(const engine::BatchReport& r) override {
    absl::MutexLock lock(&mu_);
    ++sizes_[r.requests];
    (r.graph ? graph_ : eager_) += 1;
    reused_ += r.reused_plan ? 1 : 0;
    descriptors_ += r.copy_descriptors;
    device_seconds_ += r.device_seconds;
    pack_seconds_ += r.pack_seconds;
    launch_seconds_ += r.launch_seconds;
    unpack_seconds_ += r.unpack_seconds;
    handoff_seconds_ += r.handoff_seconds;
    ++batches_;
  }
  void OnVerifyDone(const engine::VerifyTiming& t) override {
    absl::MutexLock lock(&mu_);
    queue_seconds_ += t.queue_seconds;
    total_seconds_ += t.total_seconds;
    verify_device_seconds_ += t.device_seconds;
    ++calls_;
  }
  void OnDeviceFault(const std::string&, const absl::Status&) override {}

  void Reset() {
    absl::MutexLock lock(&mu_);
    sizes_.clear();
    graph_ = eager_ = reused_ = batches_ = calls_ = descriptors_ = 0;
    device_seconds_ = queue_seconds_ = total_seconds_ = verify_device_seconds_ = 0;
    pack_seconds_ = launch_seconds_ = unpack_seconds_ = handoff_seconds_ = 0;
  }

  nlohmann::json Json() {
    absl::MutexLock lock(&mu_);
    nlohmann::json hist = nlohmann::json::object();
    for (const auto& [size, count] : sizes_) hist[std::to_string(size)] = count;
    const double n = std::max<int64_t>(calls_, 1);
    const double nb = std::max<int64_t>(batches_, 1);
    return {
        {"batches", batches_},
        {"batch_requests_hist", hist},
        {"graph_batches", graph_},
        {"eager_batches", eager_},
        {"plan_reused_batches", reused_},
        {"mean_copy_descriptors_per_batch", descriptors_ / nb},
        {"mean_pack_us_per_batch", 1e6 * pack_seconds_ / nb},
        {"mean_launch_us_per_batch", 1e6 * launch_seconds_ / nb},
        {"mean_unpack_us_per_batch", 1e6 * unpack_seconds_ / nb},
        {"mean_handoff_us_per_batch", 1e6 * handoff_seconds_ / nb},
        {"mean_device_us_per_batch", batches_ > 0 ? 1e6 * device_seconds_ / batches_ : 0.0},
        {"mean_queue_us", 1e6 * queue_seconds_ / n},
        {"mean_device_us", 1e6 * verify_device_seconds_ / n},
        {"mean_other_us", 1e6 * (total_seconds_ - queue_seconds_ - verify_device_seconds_) / n}};
  }

 private:
  absl::Mutex mu_;
  std::map<int, int64_t> sizes_ ABSL_GUARDED_BY(mu_);
  int64_t graph_ ABSL_GUARDED_BY(mu_) = 0, eager_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t reused_ ABSL_GUARDED_BY(mu_) = 0, batches_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t descriptors_ ABSL_GUARDED_BY(mu_) = 0;
  double pack_seconds_ ABSL_GUARDED_BY(mu_) = 0, launch_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  double unpack_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  double handoff_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t calls_ ABSL_GUARDED_BY(mu_) = 0;
  double device_seconds_ ABSL_GUARDED_BY(mu_) = 0, queue_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  double total_seconds_ ABSL_GUARDED_BY(mu_) = 0, verify_device_seconds_ ABSL_GUARDED_BY(mu_) = 0;
};

#ifdef MLAVERIFY_HAVE_CUDA
// The attention alone for `batch` requests of (prefix, draft, heads), as the
// kernel benchmark times it: a captured graph of the planning launch,
// replayed after an L2 flush, median of `reps`.
absl::StatusOr<double> KernelMicros(int device, int batch, int prefix, int draft, int heads,
                                    int page_size) {
  using namespace kernels::testing;
  if (cudaSetDevice(device) != cudaSuccess) return absl::InternalError("cudaSetDevice");
  VerifyProblemSpec spec;
  spec.prefix_len.assign(batch, prefix);
  spec.draft_len.assign(batch, draft);
  spec.num_heads = heads;
  spec.page_size = page_size;
  spec.num_layers = 1;
  HostVerifyProblem problem = MakeProblem(spec);
  auto config = kernels::PrepareVerifyLaunch(device);
  if (!config.ok()) return config.status();
  DeviceVerifyProblem dev;
  if (absl::Status s = dev.Init(CapacityFor(problem), *config); !s.ok()) return s;
  if (absl::Status s = dev.Upload(problem); !s.ok()) return s;
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  DeviceBuffer flush;
  if (absl::Status s = flush.Allocate(size_t{256} << 20); !s.ok()) return s;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
  absl::Status launched = kernels::LaunchVerifyAttention(dev.Args(), *config, dev.workspace(),
                                                         dev.workspace_bytes(), stream);
  cudaStreamEndCapture(stream, &graph);
  if (!launched.ok()) return launched;
  if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess)
    return absl::InternalError("instantiate");
  absl::StatusOr<GraphTiming> t = TimeGraphReplays(exec, stream, 50, &flush);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  if (!t.ok()) return t.status();
  return t->median_us;
}
#endif

#ifdef MLAVERIFY_HAVE_CUDA
// What bounds the host side of a batch: memcpy from ordinary memory into
// pinned (write-combined and plain) memory and back, in 165 KB pieces (one
// N=16, H=8 item) over 256 MB so caches do not help, on 1..16 threads; and the
// PCIe copy rate for 4 MB, both directions. Printed and returned as JSON.
nlohmann::json ProbeMemory() {
  constexpr size_t kBytes = size_t{256} << 20, kPiece = 165888;
  std::vector<uint8_t> plain(kBytes, 1);
  void *wc = nullptr, *pinned = nullptr, *dev = nullptr;
  cudaHostAlloc(&wc, kBytes, cudaHostAllocWriteCombined);
  cudaHostAlloc(&pinned, kBytes, cudaHostAllocDefault);
  cudaMalloc(&dev, size_t{64} << 20);
  std::memset(wc, 2, kBytes);
  std::memset(pinned, 3, kBytes);
  nlohmann::json out = nlohmann::json::object();
  auto measure = [&](const char* name, uint8_t* dst, const uint8_t* src, int threads) {
    const size_t pieces = kBytes / kPiece;
    const absl::Time t0 = absl::Now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        for (int rep = 0; rep < 2; ++rep) {
          for (size_t k = t; k < pieces; k += threads)
            std::memcpy(dst + k * kPiece, src + k * kPiece, kPiece);
        }
      });
    }
    for (auto& th : ts) th.join();
    const double gbs = 2.0 * pieces * kPiece / absl::ToDoubleSeconds(absl::Now() - t0) / 1e9;
    std::printf("memcpy %-22s %2d threads: %6.1f GB/s\n", name, threads, gbs);
    out[absl::StrCat(name, "_t", threads, "_gb_per_s")] = gbs;
  };
  for (int threads : {1, 4, 8, 16}) {
    measure("plain_to_wc_pinned", static_cast<uint8_t*>(wc), plain.data(), threads);
    measure("plain_to_pinned", static_cast<uint8_t*>(pinned), plain.data(), threads);
    measure("pinned_to_plain", plain.data(), static_cast<const uint8_t*>(pinned), threads);
  }
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (const size_t bytes : {kPiece, size_t{4} << 20}) {
    for (const bool h2d : {true, false}) {
      for (const bool use_wc : {true, false}) {
        if (!h2d && use_wc) continue;
        void* host = use_wc ? wc : pinned;
        float ms = 0;
        cudaEventRecord(a, stream);
        for (int r = 0; r < 20; ++r) {
          if (h2d)
            cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream);
          else
            cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream);
        }
        cudaEventRecord(b, stream);
        cudaEventSynchronize(b);
        cudaEventElapsedTime(&ms, a, b);
        const double us = 1e3 * ms / 20;
        const std::string name =
            absl::StrCat(h2d ? "h2d" : "d2h", use_wc ? "_wc" : "", "_", bytes, "B");
        std::printf("copy %-20s %8.1f us  %6.1f GB/s\n", name.c_str(), us, bytes / us / 1e3);
        out[name + "_us"] = us;
      }
    }
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(stream);
  cudaFree(dev);
  cudaFreeHost(wc);
  cudaFreeHost(pinned);
  return out;
}
#endif

struct Flags {
  std::string backend = "cuda";
  double fake_launch_us = 40;
  double fake_request_us = 1;
  std::vector<int> devices = {0};
  std::string mode = "tp";
  int layers = 61;
  int heads_per_device = 8;
  int page_size = 64;
  int draft_len = 16;
  std::vector<int> prefix_lens = {1024, 16384};
  std::vector<int> threads = {1, 64};
  double duration_s = 5;
  double warmup_s = 1;
  uint64_t pool_bytes = uint64_t{80} << 30;
  int copy_threads = 4;
  bool completion_thread = false;
  bool poll_launches = true;
  bool graphs = true;
  int batches_in_flight = 2;
  std::string inputs = "host";
  bool probe_memory = false;
  std::string json;
  std::string gpu_name;
};

int Run(int argc, char** argv) {
  Flags f;
  CLI::App app{"mlaverify-engine-bench: the engine in process, many threads, no gRPC"};
  app.add_option("--backend", f.backend,
                 "cuda | cpu | fake (a device that takes time and computes nothing: the host "
                 "side measured without a GPU)")
      ->check(CLI::IsMember({"cuda", "cpu", "fake"}))
      ->capture_default_str();
  app.add_option("--fake-launch-us", f.fake_launch_us, "fake backend: device time of every launch")
      ->capture_default_str();
  app.add_option("--fake-request-us", f.fake_request_us,
                 "fake backend: device time added per request of a batch")
      ->capture_default_str();
  app.add_option("--devices", f.devices, "device list (an ordinal may repeat)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--mode", f.mode, "tp | dp")
      ->check(CLI::IsMember({"tp", "dp"}))
      ->capture_default_str();
  app.add_option("--layers", f.layers, "model layers")->capture_default_str();
  app.add_option("--heads-per-device", f.heads_per_device, "query heads each device computes")
      ->capture_default_str();
  app.add_option("--page-size", f.page_size)->capture_default_str();
  app.add_option("--draft-len", f.draft_len, "drafts per item (a random tree)")
      ->capture_default_str();
  app.add_option("--prefix-len", f.prefix_lens, "prompt lengths, one set of rows each")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--threads", f.threads, "submitting threads, one row each")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--duration-s", f.duration_s, "measured seconds per row")->capture_default_str();
  app.add_option("--warmup-s", f.warmup_s, "unmeasured seconds before each row")
      ->capture_default_str();
  app.add_option("--pool-bytes", f.pool_bytes, "KV pool per device")
      ->transform(CLI::AsSizeValue(true))
      ->capture_default_str();
  app.add_option("--copy-threads", f.copy_threads)->capture_default_str();
  app.add_option("--completion-thread", f.completion_thread,
                 "complete finished batches on a completion thread (false: on the device thread)")
      ->capture_default_str();
  app.add_option("--poll-launches", f.poll_launches,
                 "the device thread polls launches and launches queued work (false: submitters "
                 "launch into free slots, the device thread sleeps in the wait)")
      ->capture_default_str();
  app.add_option("--cuda-graphs", f.graphs)->capture_default_str();
  app.add_option("--batches-in-flight", f.batches_in_flight)->capture_default_str();
  app.add_option("--inputs", f.inputs,
                 "host: every thread's q, draft_kv, out and lse in ordinary host memory; device: "
                 "in device memory registered as a region (a scheduler on the GPU)")
      ->check(CLI::IsMember({"host", "device"}))
      ->capture_default_str();
  app.add_flag("--probe-memory", f.probe_memory,
               "first measure host memcpy and PCIe copy bandwidth (what bounds the host side)");
  app.add_option("--json", f.json, "append rows to this results file (created if missing)");
  app.add_option("--gpu-name", f.gpu_name, "the gpu field of the results file");
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::warn);

  const int num_devices = static_cast<int>(f.devices.size());
  const bool tp = f.mode == "tp";
  engine::EngineConfig config;
  config.num_layers = f.layers;
  config.num_heads = tp ? f.heads_per_device * num_devices : f.heads_per_device;
  config.page_size = f.page_size;
  config.pool_bytes = static_cast<int64_t>(f.pool_bytes);
  config.max_sequence_len = *std::max_element(f.prefix_lens.begin(), f.prefix_lens.end()) + 128;
  config.parallel_mode =
      tp ? engine::ParallelMode::kTensorParallel : engine::ParallelMode::kDataParallel;
  config.use_graphs = f.graphs;
  config.copy_threads = f.copy_threads;
  config.completion_thread = f.completion_thread;
  config.poll_launches = f.poll_launches;
  config.batches_in_flight = f.batches_in_flight;
  config.max_live_sequences = 1 << 20;
  config.shared_memory.enabled = true;  // --inputs device registers the threads' buffers
  std::vector<std::unique_ptr<engine::Device>> devices;
  for (int d : f.devices) {
    if (f.backend == "cpu") {
      devices.push_back(engine::MakeCpuDevice(0));
    } else if (f.backend == "fake") {
      engine::FakeDeviceOptions fake;
      fake.timed_only = true;
      fake.launch_time = absl::Microseconds(f.fake_launch_us);
      fake.request_time = absl::Microseconds(f.fake_request_us);
      // As a GPU: caller memory outside registered regions goes through the
      // engine's staging.
      fake.addresses_host_memory = false;
      devices.push_back(engine::MakeFakeDevice(d, fake, nullptr));
    } else {
      auto cuda = engine::MakeCudaDevice(d);
      if (!cuda.ok()) {
        std::fprintf(stderr, "cuda device %d: %s\n", d, cuda.status().ToString().c_str());
        return 2;
      }
      devices.push_back(*std::move(cuda));
    }
  }
  BatchCounter counter;
  const absl::Time start = absl::Now();
  auto engine_or = Engine::Create(config, std::move(devices), &counter);
  if (!engine_or.ok()) {
    std::fprintf(stderr, "engine: %s\n", engine_or.status().ToString().c_str());
    return 2;
  }
  std::unique_ptr<Engine> engine = *std::move(engine_or);
  std::printf(
      "engine: %s x%d (%s), %d layers, %d heads (%d per device), page %d, started in %.2f s\n",
      engine->backend_name().c_str(), num_devices, f.mode.c_str(), f.layers, config.num_heads,
      engine->heads_per_device(), f.page_size, absl::ToDoubleSeconds(absl::Now() - start));

  nlohmann::json results = nlohmann::json::object();
  if (!f.json.empty()) {
    std::ifstream in(f.json);
    if (in) results = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!results.is_object()) results = nlohmann::json::object();
  }
  if (!f.gpu_name.empty()) results["gpu"] = f.gpu_name;
#ifdef MLAVERIFY_HAVE_CUDA
  if (f.probe_memory) results["host_memory_probe"] = ProbeMemory();
#endif
  if (!results.contains("rows")) results["rows"] = nlohmann::json::array();

  const int heads = config.num_heads;
  const int n = f.draft_len;
  for (int prefix : f.prefix_lens) {
    double kernel_us = -1, kernel_us_b32 = -1;
#ifdef MLAVERIFY_HAVE_CUDA
    if (f.backend == "cuda") {
      auto k1 = KernelMicros(f.devices[0], 1, prefix, n, f.heads_per_device, f.page_size);
      auto k32 = KernelMicros(f.devices[0], 32, prefix, n, f.heads_per_device, f.page_size);
      if (k1.ok()) kernel_us = *k1;
      if (k32.ok()) kernel_us_b32 = *k32;
      if (!k1.ok() || !k32.ok()) std::fprintf(stderr, "kernel timing failed\n");
    }
#endif
    for (int threads : f.threads) {
      // Sequences: one per thread, prompt appended in chunks of one random block.
      std::mt19937_64 rng(prefix * 31 + threads);
      const int64_t chunk = std::min(prefix, 512);
      const std::vector<Bf16> block =
          RandomBf16(rng, static_cast<size_t>(f.layers) * chunk * kLatentDim, 1.0f);
      std::vector<uint64_t> ids;
      const absl::Time setup = absl::Now();
      bool setup_ok = true;
      for (int t = 0; t < threads && setup_ok; ++t) {
        auto id = engine->CreateSequence("bench");
        if (!id.ok()) {
          setup_ok = false;
          break;
        }
        ids.push_back(*id);
        for (int64_t at = 0; at < prefix; at += chunk) {
          const int64_t len = std::min<int64_t>(chunk, prefix - at);
          std::vector<Bf16> piece;
          absl::Span<const Bf16> kv = block;
          if (len != chunk) {
            piece.resize(static_cast<size_t>(f.layers) * len * kLatentDim);
            for (int l = 0; l < f.layers; ++l) {
              std::copy_n(block.begin() + static_cast<size_t>(l) * chunk * kLatentDim,
                          len * kLatentDim,
                          piece.begin() + static_cast<size_t>(l) * len * kLatentDim);
            }
            kv = piece;
          }
          auto appended = engine->AppendKv(*id, at, len, kv);
          if (!appended.ok()) {
            std::fprintf(stderr, "append: %s\n", appended.status().ToString().c_str());
            setup_ok = false;
            break;
          }
        }
      }
      if (!setup_ok) {
        std::fprintf(stderr, "L=%d threads=%d: setup failed (pool too small?), row skipped\n",
                     prefix, threads);
        for (uint64_t id : ids) (void)engine->Release(id);
        continue;
      }
      const double setup_s = absl::ToDoubleSeconds(absl::Now() - setup);
      std::atomic<bool> measuring{false}, stop{false};
      std::atomic<int64_t> items{0}, errors{0};
      std::vector<std::vector<float>> latencies(threads);
      std::vector<std::thread> workers;
      for (int t = 0; t < threads; ++t) {
        workers.emplace_back([&, t] {
          std::mt19937_64 r(t + 1);
          const std::vector<Bf16> q =
              RandomBf16(r, static_cast<size_t>(n) * heads * kLatentDim, 2.0f);
          const std::vector<Bf16> dkv = RandomBf16(r, static_cast<size_t>(n) * kLatentDim, 1.0f);
          std::vector<Bf16> out(static_cast<size_t>(n) * heads * kValueDim);
          std::vector<float> lse(static_cast<size_t>(n) * heads);
          // --inputs device: the four tensors in one device allocation,
          // registered as this thread's region.
          const size_t q_bytes = q.size() * sizeof(Bf16), dkv_bytes = dkv.size() * sizeof(Bf16);
          const size_t out_bytes = out.size() * sizeof(Bf16),
                       lse_bytes = lse.size() * sizeof(float);
          const std::string region = absl::StrCat("bench-", prefix, "-", threads, "-", t);
          void* device_memory = nullptr;
          if (f.inputs == "device") {
#ifdef MLAVERIFY_HAVE_CUDA
            const size_t bytes = q_bytes + dkv_bytes + out_bytes + lse_bytes;
            cudaSetDevice(f.devices[0]);
            if (cudaMalloc(&device_memory, bytes) != cudaSuccess) device_memory = nullptr;
            if (device_memory != nullptr) {
              cudaMemcpy(device_memory, q.data(), q_bytes, cudaMemcpyHostToDevice);
              cudaMemcpy(static_cast<uint8_t*>(device_memory) + q_bytes, dkv.data(), dkv_bytes,
                         cudaMemcpyHostToDevice);
              const absl::Status registered = engine->regions().RegisterLocalDevice(
                  region, reinterpret_cast<uint64_t>(device_memory), f.devices[0], bytes);
              if (!registered.ok()) {
                std::fprintf(stderr, "register: %s\n", registered.ToString().c_str());
                cudaFree(device_memory);
                device_memory = nullptr;
              }
            }
#endif
            if (device_memory == nullptr) {
              ++errors;
              stop = true;
              return;
            }
          }
          auto in_region = [&](uint64_t offset, uint64_t bytes) {
            engine::RegionRange range{region, offset, bytes};
            return range;
          };
          latencies[t].reserve(1 << 16);
          while (!stop.load()) {
            const std::vector<int32_t> tree = RandomDraftTree(r, n);
            for (int layer = 0; layer < f.layers && !stop.load(); ++layer) {
              engine::VerifyItem item{
                  ids[t], tree, q, dkv, absl::MakeSpan(out), absl::MakeSpan(lse)};
              if (device_memory != nullptr) {
                item.q = engine::TensorRef();
                item.q.in_region = true;
                item.q.range = in_region(0, q_bytes);
                item.draft_kv = engine::TensorRef();
                item.draft_kv.in_region = true;
                item.draft_kv.range = in_region(q_bytes, dkv_bytes);
                item.out = engine::OutputRef();
                item.out.in_region = true;
                item.out.range = in_region(q_bytes + dkv_bytes, out_bytes);
                item.lse = engine::OutputRef();
                item.lse.in_region = true;
                item.lse.range = in_region(q_bytes + dkv_bytes + out_bytes, lse_bytes);
              }
              const absl::Time t0 = absl::Now();
              const absl::Status s = engine->Verify(layer, 0.0f, absl::MakeSpan(&item, 1));
              const double us = absl::ToDoubleMicroseconds(absl::Now() - t0);
              if (!s.ok()) {
                ++errors;
                std::fprintf(stderr, "verify: %s\n", s.ToString().c_str());
                stop = true;
                break;
              }
              if (measuring.load()) {
                latencies[t].push_back(static_cast<float>(us));
                ++items;
              }
            }
            if (!engine->Commit(ids[t], {}).ok()) ++errors;
          }
#ifdef MLAVERIFY_HAVE_CUDA
          if (device_memory != nullptr) {
            (void)engine->regions().Unregister(region, engine::RegionKind::kCuda);
            cudaFree(device_memory);
          }
#endif
        });
      }
      absl::SleepFor(absl::Seconds(f.warmup_s));
      counter.Reset();
      measuring = true;
      const absl::Time t0 = absl::Now();
      absl::SleepFor(absl::Seconds(f.duration_s));
      measuring = false;
      const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
      nlohmann::json batching = counter.Json();
      stop = true;
      for (auto& w : workers) w.join();
      for (uint64_t id : ids) (void)engine->Release(id);
      std::vector<float> all;
      for (const auto& l : latencies) all.insert(all.end(), l.begin(), l.end());
      std::sort(all.begin(), all.end());
      auto pct = [&all](double p) {
        return all.empty()
                   ? 0.0
                   : static_cast<double>(
                         all[std::min(all.size() - 1, static_cast<size_t>(p * all.size()))]);
      };
      const double items_per_s = static_cast<double>(items.load()) / seconds;
      nlohmann::json row = {{"mode", num_devices == 1 ? "single" : f.mode},
                            {"devices", f.devices},
                            {"backend", f.backend},
                            {"prefix_len", prefix},
                            {"draft_len", n},
                            {"heads_per_device", f.heads_per_device},
                            {"layers", f.layers},
                            {"threads", threads},
                            {"cuda_graphs", engine->graphs_enabled()},
                            {"inputs", f.inputs},
                            {"copy_threads", f.copy_threads},
                            {"completion_thread", f.completion_thread},
                            {"poll_launches", f.poll_launches},
                            {"batches_in_flight", f.batches_in_flight},
                            {"items_per_s", items_per_s},
                            {"p50_us", pct(0.5)},
                            {"p90_us", pct(0.9)},
                            {"p99_us", pct(0.99)},
                            {"max_us", all.empty() ? 0.0 : static_cast<double>(all.back())},
                            {"errors", errors.load()},
                            {"setup_s", setup_s},
                            {"batching", batching}};
      if (f.backend == "fake") {
        row["fake_launch_us"] = f.fake_launch_us;
        row["fake_request_us"] = f.fake_request_us;
      }
      if (kernel_us >= 0) {
        row["kernel_us"] = kernel_us;
        row["kernel_us_batch32"] = kernel_us_b32;
        row["overhead_p50_us"] = pct(0.5) - kernel_us;
      } else {
        row["kernel_us"] = nullptr;
        row["overhead_p50_us"] = nullptr;
      }
      std::printf(
          "%-6s L=%-6d N=%d threads=%-3d  %9.0f items/s  p50 %8.1f us  p99 %8.1f us  kernel %6.1f "
          "us"
          "  overhead p50 %7.1f us  batches %s  errors %lld\n",
          row["mode"].get<std::string>().c_str(), prefix, n, threads, items_per_s, pct(0.5),
          pct(0.99), kernel_us, kernel_us >= 0 ? pct(0.5) - kernel_us : 0.0,
          batching["batch_requests_hist"].dump().c_str(), static_cast<long long>(errors.load()));
      std::printf(
          "       per batch: device %.1f us, host pack %.1f, launch %.1f, hand-off wait %.1f, "
          "complete %.1f us; per call: queued %.1f, device %.1f, other %.1f us\n",
          batching["mean_device_us_per_batch"].get<double>(),
          batching["mean_pack_us_per_batch"].get<double>(),
          batching["mean_launch_us_per_batch"].get<double>(),
          batching["mean_handoff_us_per_batch"].get<double>(),
          batching["mean_unpack_us_per_batch"].get<double>(),
          batching["mean_queue_us"].get<double>(), batching["mean_device_us"].get<double>(),
          batching["mean_other_us"].get<double>());
      std::fflush(stdout);
      results["rows"].push_back(row);
      if (!f.json.empty()) std::ofstream(f.json) << results.dump(2) << "\n";
    }
  }
  const engine::EngineStats stats = engine->Stats();
  if (stats.free_pages != stats.total_pages) {
    std::fprintf(stderr, "PAGE LEAK: %lld of %lld pages free at the end\n",
                 static_cast<long long>(stats.free_pages),
                 static_cast<long long>(stats.total_pages));
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace mlaverify

int main(int argc, char** argv) { return mlaverify::Run(argc, argv); }
