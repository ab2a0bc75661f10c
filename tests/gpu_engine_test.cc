// The engine on CUDA devices against the same engine on one CPU device:
// identical calls (prompts, multi-sequence verify steps, the same calls
// submitted one item at a time so the worker batches them, commits,
// rollbacks), outputs within bf16 tolerance, pool contents equal to the bit
// after every commit (on every replica in tensor-parallel mode), no pages
// left behind. Every item's tensors are spread over the three data planes
// (inline host bytes, a page-locked system region, device memory registered
// as a region), a different mix each step. Runs single-device,
// tensor-parallel and data-parallel over device 0 listed twice,
// single-device with graphs off (the eager path) and with one token per page
// (page tables that move on the device), each also over an fp8 pool (both
// engines --kv-dtype fp8: the same quantized bytes in both pools, compared to
// the bit; the CUDA attention reads them as bf16 (value x scale rounded to
// bf16), the CPU's in fp32, so outputs stay within the same 1e-2). Skipped
// with the reason when no GPU is present.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/workload.h"
#include "gtest/gtest.h"
#include "kernels/testing/device_problem.h"
#include "server/engine/device.h"
#include "server/engine/engine.h"

namespace mlaverify::engine {
namespace {

constexpr int kLayers = 3;
constexpr size_t kRegionBytes = size_t{8} << 20;

struct Mode {
  std::string name;
  std::vector<int> devices;
  ParallelMode parallel;
  int heads;  // per Verify item
  bool graphs;
  int page_size = 16;
  KvDtype kv_dtype = KvDtype::kBf16;
};

// Where a tensor of a test item lives.
enum class Plane { kInline, kSystem, kDevice };

void PrintTo(const Mode& mode, std::ostream* os) { *os << mode.name; }

class GpuEngineTest : public ::testing::TestWithParam<Mode> {
 protected:
  void SetUp() override {
    static const std::string reason = kernels::testing::NoUsableGpuReason();
    if (!reason.empty()) GTEST_SKIP() << "GPU test skipped: " << reason;
    const Mode& mode = GetParam();
    heads_ = mode.heads;
    EngineConfig config;
    config.num_layers = kLayers;
    config.num_heads = mode.heads;
    config.page_size = mode.page_size;
    config.kv_dtype = mode.kv_dtype;
    config.pool_bytes = (3200 / mode.page_size + 100) * config.bytes_per_page();
    config.shared_memory.enabled = true;
    config.draft_buckets = {1, 4, 16};
    config.batch_buckets = {1, 2, 4};
    config.max_sequence_len = 8192;
    config.parallel_mode = mode.parallel;
    config.use_graphs = mode.graphs;
    std::vector<std::unique_ptr<Device>> devices;
    for (int ordinal : mode.devices) {
      auto cuda = MakeCudaDevice(ordinal);
      ASSERT_TRUE(cuda.ok()) << cuda.status();
      devices.push_back(*std::move(cuda));
    }
    auto gpu = Engine::Create(config, std::move(devices));
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    config.parallel_mode = ParallelMode::kTensorParallel;
    std::vector<std::unique_ptr<Device>> cpu_devices;
    cpu_devices.push_back(MakeCpuDevice(0));
    auto cpu = Engine::Create(config, std::move(cpu_devices));
    ASSERT_TRUE(cpu.ok());
    gpu_ = *std::move(gpu);
    cpu_ = *std::move(cpu);
    EXPECT_EQ(gpu_->graphs_enabled(), mode.graphs);
    // The two regions: a POSIX shared-memory object and device memory.
    shm_key_ = absl::StrCat("/mlaverify-gpu-engine-test-", getpid());
    const int fd = shm_open(shm_key_.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, kRegionBytes), 0);
    system_ = static_cast<uint8_t*>(
        mmap(nullptr, kRegionBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    ASSERT_NE(system_, MAP_FAILED);
    ASSERT_TRUE(gpu_->regions().Register("sys", shm_key_, 0, kRegionBytes).ok());
    ASSERT_EQ(cudaSetDevice(mode.devices[0]), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&device_, kRegionBytes), cudaSuccess);
    ASSERT_TRUE(gpu_->regions()
                    .RegisterLocalDevice("dev", reinterpret_cast<uint64_t>(device_),
                                         mode.devices[0], kRegionBytes)
                    .ok());
  }

  void TearDown() override {
    if (gpu_ != nullptr) {
      EXPECT_TRUE(gpu_->regions().Unregister("", RegionKind::kAny).ok());
    }
    if (device_ != nullptr) cudaFree(device_);
    if (system_ != nullptr && system_ != MAP_FAILED) munmap(system_, kRegionBytes);
    if (!shm_key_.empty()) shm_unlink(shm_key_.c_str());
  }

  // Places `bytes` of an input in `plane` (copying them there) or names
  // them inline; `used` is the next free offset of each region.
  TensorRef Input(Plane plane, const std::vector<Bf16>& values, uint64_t used[2]) {
    if (plane == Plane::kInline) return TensorRef(values);
    TensorRef t;
    t.in_region = true;
    t.range = Take(plane, values.size() * sizeof(Bf16), sizeof(Bf16), used);
    if (plane == Plane::kSystem) {
      std::memcpy(system_ + t.range.offset, values.data(), t.range.byte_size);
    } else {
      EXPECT_EQ(cudaMemcpy(static_cast<uint8_t*>(device_) + t.range.offset, values.data(),
                           t.range.byte_size, cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    return t;
  }
  template <typename T>
  OutputRef Output(Plane plane, std::vector<T>& values, uint64_t used[2]) {
    if (plane == Plane::kInline) return OutputRef(absl::MakeSpan(values));
    OutputRef o;
    o.in_region = true;
    o.range = Take(plane, values.size() * sizeof(T), sizeof(T), used);
    // NaN until the engine writes it.
    if (plane == Plane::kSystem) {
      std::memset(system_ + o.range.offset, 0xFF, o.range.byte_size);
    } else {
      EXPECT_EQ(
          cudaMemset(static_cast<uint8_t*>(device_) + o.range.offset, 0xFF, o.range.byte_size),
          cudaSuccess);
    }
    return o;
  }
  // An output written into a region, copied back into `values`.
  template <typename T>
  void ReadBack(const OutputRef& o, std::vector<T>& values) {
    if (!o.in_region) return;
    if (o.range.region == "sys") {
      std::memcpy(values.data(), system_ + o.range.offset, o.range.byte_size);
    } else {
      EXPECT_EQ(cudaMemcpy(values.data(), static_cast<uint8_t*>(device_) + o.range.offset,
                           o.range.byte_size, cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
  }
  RegionRange Take(Plane plane, uint64_t bytes, uint64_t alignment, uint64_t used[2]) {
    const int k = plane == Plane::kSystem ? 0 : 1;
    // Now and then only the dtype's alignment: the copy kernels take any
    // alignment the dtype allows.
    const uint64_t offset = used[k] + (rng_() % 4 == 0 ? alignment : 0);
    used[k] = (offset + bytes + 255) / 256 * 256;
    EXPECT_LE(used[k], kRegionBytes);
    return RegionRange{k == 0 ? "sys" : "dev", offset, bytes};
  }

  void ExpectSameKv(uint64_t gpu_id, uint64_t cpu_id, int64_t length) {
    // Rows as stored: 576 bf16 values, or 328 2-byte units of an fp8 row.
    const int64_t row_elements = KvRowBytes(GetParam().kv_dtype) / static_cast<int>(sizeof(Bf16));
    std::vector<Bf16> b(static_cast<size_t>(kLayers) * length * row_elements);
    ASSERT_TRUE(cpu_->ReadKv(cpu_id, 0, length, absl::MakeSpan(b)).ok());
    const int replicas =
        GetParam().parallel == ParallelMode::kTensorParallel ? gpu_->num_devices() : 1;
    for (int r = 0; r < replicas; ++r) {
      std::vector<Bf16> a(b.size());
      ASSERT_TRUE(gpu_->ReadKv(gpu_id, 0, length, absl::MakeSpan(a), r).ok());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(Bf16)), 0) << "replica " << r;
    }
  }

  void ExpectClose(const std::vector<Bf16>& out_g, const std::vector<Bf16>& out_c,
                   const std::vector<float>& lse_g, const std::vector<float>& lse_c,
                   const std::string& where) {
    double e = 0, norm = 0, lse_err = 0;
    for (size_t k = 0; k < out_g.size(); ++k) {
      const double g = Bf16ToFloat(out_g[k]), c = Bf16ToFloat(out_c[k]);
      e += (g - c) * (g - c);
      norm += c * c;
    }
    for (size_t k = 0; k < lse_g.size(); ++k) {
      lse_err = std::max(lse_err, std::fabs(static_cast<double>(lse_g[k]) - lse_c[k]));
    }
    const double rel = std::sqrt(e / norm);
    EXPECT_TRUE(rel <= 1e-2) << where << " rel_err " << rel;  // NaN fails
    EXPECT_TRUE(lse_err <= 1e-2) << where << " lse err " << lse_err;
  }

  int heads_ = 0;
  std::unique_ptr<Engine> gpu_, cpu_;
  std::mt19937_64 rng_{99};
  std::string shm_key_;
  uint8_t* system_ = nullptr;
  void* device_ = nullptr;
};

TEST_P(GpuEngineTest, MatchesTheCpuEngineStepByStep) {
  const std::vector<int64_t> prompts = {1, 300, 1000};
  std::vector<uint64_t> gpu_ids, cpu_ids;
  std::vector<int64_t> lengths;
  for (int64_t p : prompts) {
    const std::vector<Bf16> kv = RandomBf16(rng_, kLayers * p * kLatentDim, 1.0f);
    gpu_ids.push_back(*gpu_->CreateSequence("gpu"));
    cpu_ids.push_back(*cpu_->CreateSequence("cpu"));
    ASSERT_TRUE(gpu_->AppendKv(gpu_ids.back(), 0, p, kv).ok());
    ASSERT_TRUE(cpu_->AppendKv(cpu_ids.back(), 0, p, kv).ok());
    lengths.push_back(p);
    ExpectSameKv(gpu_ids.back(), cpu_ids.back(), p);
  }
  const int n_seq = static_cast<int>(gpu_ids.size());
  for (int step = 0; step < 4; ++step) {
    std::vector<std::vector<int32_t>> parents(n_seq);
    for (int s = 0; s < n_seq; ++s) {
      const int n = 1 + static_cast<int>(rng_() % 16);
      for (int i = 0; i < n; ++i) {
        parents[s].push_back(i == 0 || rng_() % 2 ? i - 1
                                                  : static_cast<int32_t>(rng_() % (i + 1)) - 1);
      }
    }
    for (int layer = 0; layer < kLayers; ++layer) {
      std::vector<std::vector<Bf16>> q(n_seq), dkv(n_seq), out_g(n_seq), out_c(n_seq);
      std::vector<std::vector<float>> lse_g(n_seq), lse_c(n_seq);
      std::vector<VerifyItem> items_g(n_seq), items_c(n_seq);
      uint64_t used[2] = {0, 0};
      for (int s = 0; s < n_seq; ++s) {
        const size_t n = parents[s].size();
        q[s] = RandomBf16(rng_, n * heads_ * kLatentDim, 2.0f);
        dkv[s] = RandomBf16(rng_, n * kLatentDim, 1.0f);
        out_g[s].assign(n * heads_ * kValueDim, Bf16QuietNaN());
        out_c[s].assign(n * heads_ * kValueDim, Bf16QuietNaN());
        lse_g[s].assign(n * heads_, NAN);
        lse_c[s].assign(n * heads_, NAN);
        // Each tensor on its own plane, a different mix per item and step
        // (out and lse share one: both in a region or neither).
        const auto plane = [&](int k) { return static_cast<Plane>((s + step + layer + k) % 3); };
        items_g[s].sequence_id = gpu_ids[s];
        items_g[s].parents = parents[s];
        items_g[s].q = Input(plane(0), q[s], used);
        // An fp8 pool refuses draft rows in device memory (the engine checks
        // them for NaN/Inf on the host before quantizing): system memory
        // instead.
        const Plane kv_plane = GetParam().kv_dtype != KvDtype::kBf16 && plane(1) == Plane::kDevice
                                   ? Plane::kSystem
                                   : plane(1);
        items_g[s].draft_kv = Input(kv_plane, dkv[s], used);
        items_g[s].out = Output(plane(2), out_g[s], used);
        items_g[s].lse = Output(plane(2), lse_g[s], used);
        items_c[s] = {cpu_ids[s],
                      parents[s],
                      q[s],
                      dkv[s],
                      absl::MakeSpan(out_c[s]),
                      absl::MakeSpan(lse_c[s])};
      }
      if (step % 2 == 0) {
        // One call with every sequence (batch bucket 4, one padding request).
        ASSERT_TRUE(gpu_->Verify(layer, 0.0f, absl::MakeSpan(items_g)).ok());
      } else {
        // One call per sequence, submitted together: the worker batches them.
        std::vector<absl::Notification> done(n_seq);
        std::vector<absl::Status> status(n_seq);
        for (int s = 0; s < n_seq; ++s) {
          VerifyCall call;
          call.layer = layer;
          call.items = absl::MakeSpan(&items_g[s], 1);
          gpu_->SubmitVerify(std::move(call), [&, s](absl::Status st) {
            status[s] = std::move(st);
            done[s].Notify();
          });
        }
        for (int s = 0; s < n_seq; ++s) {
          done[s].WaitForNotification();
          ASSERT_TRUE(status[s].ok()) << status[s];
        }
      }
      ASSERT_TRUE(cpu_->Verify(layer, 0.0f, absl::MakeSpan(items_c)).ok());
      for (int s = 0; s < n_seq; ++s) {
        ReadBack(items_g[s].out, out_g[s]);
        ReadBack(items_g[s].lse, lse_g[s]);
        ExpectClose(out_g[s], out_c[s], lse_g[s], lse_c[s],
                    absl::StrCat("step ", step, " layer ", layer, " seq ", s));
      }
    }
    for (int s = 0; s < n_seq; ++s) {
      // Odd steps of sequence 1 reject everything; the rest accept the path
      // to the last draft.
      std::vector<int32_t> path;
      if (!(s == 1 && step % 2 == 1)) {
        for (int a = static_cast<int>(parents[s].size()) - 1; a >= 0; a = parents[s][a]) {
          path.insert(path.begin(), a);
        }
      }
      auto g = gpu_->Commit(gpu_ids[s], path);
      auto c = cpu_->Commit(cpu_ids[s], path);
      ASSERT_TRUE(g.ok() && c.ok());
      EXPECT_EQ(g->length, c->length);
      lengths[s] = g->length;
      ExpectSameKv(gpu_ids[s], cpu_ids[s], lengths[s]);
    }
  }
  for (size_t s = 0; s < gpu_ids.size(); ++s) {
    ASSERT_TRUE(gpu_->Release(gpu_ids[s]).ok());
    ASSERT_TRUE(cpu_->Release(cpu_ids[s]).ok());
  }
  EXPECT_EQ(gpu_->Stats().free_pages, gpu_->Stats().total_pages);
  EXPECT_TRUE(gpu_->fault().ok()) << gpu_->fault();
}

// A CUDA engine with --kv-dtype fp8 starts, and its pool holds 1.75x the
// pages of a bf16 pool of the same bytes (656 vs 1,152 bytes per row).
TEST(GpuEngineFp8Test, StartsWithAnFp8Pool) {
  static const std::string reason = kernels::testing::NoUsableGpuReason();
  if (!reason.empty()) GTEST_SKIP() << "GPU test skipped: " << reason;
  EngineConfig config;
  config.num_layers = kLayers;
  config.kv_dtype = KvDtype::kFp8;
  config.pool_bytes = 64 * config.bytes_per_page();
  config.draft_buckets = {1, 4};
  config.batch_buckets = {1, 2};
  std::vector<std::unique_ptr<Device>> devices;
  auto cuda = MakeCudaDevice(0);
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  devices.push_back(*std::move(cuda));
  auto engine = Engine::Create(config, std::move(devices));
  ASSERT_TRUE(engine.ok()) << engine.status();
  EngineConfig bf16 = config;
  bf16.kv_dtype = KvDtype::kBf16;
  EXPECT_GE(static_cast<double>(bf16.bytes_per_page()) / config.bytes_per_page(), 1.75);
}

INSTANTIATE_TEST_SUITE_P(
    Modes, GpuEngineTest,
    ::testing::Values(
        Mode{"single", {0}, ParallelMode::kTensorParallel, 8, true},
        Mode{"tp_0_0", {0, 0}, ParallelMode::kTensorParallel, 16, true},
        Mode{"dp_0_0", {0, 0}, ParallelMode::kDataParallel, 8, true},
        Mode{"single_eager", {0}, ParallelMode::kTensorParallel, 8, false},
        Mode{"single_page1", {0}, ParallelMode::kTensorParallel, 8, true, 1},
        Mode{"single_fp8", {0}, ParallelMode::kTensorParallel, 8, true, 16, KvDtype::kFp8},
        Mode{"tp_0_0_fp8", {0, 0}, ParallelMode::kTensorParallel, 16, true, 16, KvDtype::kFp8},
        Mode{"dp_0_0_fp8", {0, 0}, ParallelMode::kDataParallel, 8, true, 16, KvDtype::kFp8},
        Mode{"single_eager_fp8", {0}, ParallelMode::kTensorParallel, 8, false, 16, KvDtype::kFp8},
        Mode{"single_page1_fp8", {0}, ParallelMode::kTensorParallel, 8, true, 1, KvDtype::kFp8}),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace mlaverify::engine
