// The engine on the CUDA backend against the same engine on the CPU backend:
// identical calls (prompts, multi-sequence verify steps, commits, rollbacks),
// outputs within bf16 tolerance, pool contents equal to the bit after every
// commit, no pages left behind. Skipped with the reason when no GPU is present.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/testing/device_problem.h"
#include "kernels/verify_attention.h"
#include "server/engine/engine.h"

namespace mlaverify::engine {
namespace {

using mlaverify::kLatentDim;
using mlaverify::kValueDim;

constexpr int kLayers = 3, kHeads = 8, kPage = 16;

std::vector<Bf16> RandomBf16(size_t n, std::mt19937_64& rng, float range) {
  std::uniform_real_distribution<float> u(-range, range);
  std::vector<Bf16> v(n);
  for (auto& x : v) x = FloatToBf16(u(rng));
  return v;
}

class GpuEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static const std::string reason = kernels::testing::NoUsableGpuReason();
    if (!reason.empty()) GTEST_SKIP() << "GPU test skipped: " << reason;
    EngineConfig config;
    config.num_layers = kLayers;
    config.num_heads = kHeads;
    config.page_size = kPage;
    config.pool_bytes = 200 * config.bytes_per_page();
    config.draft_buckets = {1, 4, 16};
    config.batch_buckets = {1, 2, 4};
    config.max_sequence_len = 8192;
    auto cuda = MakeCudaBackend(0);
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    auto gpu = Engine::Create(config, *std::move(cuda));
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    auto cpu = Engine::Create(config, MakeCpuBackend(0));
    ASSERT_TRUE(cpu.ok());
    gpu_ = *std::move(gpu);
    cpu_ = *std::move(cpu);
  }

  void ExpectSameKv(uint64_t gpu_id, uint64_t cpu_id, int64_t length) {
    std::vector<Bf16> a(static_cast<size_t>(kLayers) * length * kLatentDim);
    std::vector<Bf16> b(a.size());
    ASSERT_TRUE(gpu_->ReadKv(gpu_id, 0, length, absl::MakeSpan(a)).ok());
    ASSERT_TRUE(cpu_->ReadKv(cpu_id, 0, length, absl::MakeSpan(b)).ok());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(Bf16)), 0);
  }

  std::unique_ptr<Engine> gpu_, cpu_;
  std::mt19937_64 rng_{99};
};

TEST_F(GpuEngineTest, MatchesTheCpuBackendStepByStep) {
  const std::vector<int64_t> prompts = {1, 300, 1000};
  std::vector<uint64_t> gpu_ids, cpu_ids;
  std::vector<int64_t> lengths;
  for (int64_t p : prompts) {
    const std::vector<Bf16> kv = RandomBf16(kLayers * p * kLatentDim, rng_, 1.0f);
    gpu_ids.push_back(*gpu_->CreateSequence("gpu"));
    cpu_ids.push_back(*cpu_->CreateSequence("cpu"));
    ASSERT_TRUE(gpu_->AppendKv(gpu_ids.back(), 0, p, kv).ok());
    ASSERT_TRUE(cpu_->AppendKv(cpu_ids.back(), 0, p, kv).ok());
    lengths.push_back(p);
    ExpectSameKv(gpu_ids.back(), cpu_ids.back(), p);
  }
  for (int step = 0; step < 4; ++step) {
    const int n_seq = static_cast<int>(gpu_ids.size());
    std::vector<std::vector<int32_t>> parents(n_seq);
    for (int s = 0; s < n_seq; ++s) {
      const int n = 1 + static_cast<int>(rng_() % 16);
      for (int i = 0; i < n; ++i) {
        parents[s].push_back(i == 0 || rng_() % 2 ? i - 1 : static_cast<int32_t>(rng_() % (i + 1)) - 1);
      }
    }
    for (int layer = 0; layer < kLayers; ++layer) {
      std::vector<std::vector<Bf16>> q(n_seq), dkv(n_seq), out_g(n_seq), out_c(n_seq);
      std::vector<std::vector<float>> lse_g(n_seq), lse_c(n_seq);
      std::vector<VerifyItem> items_g(n_seq), items_c(n_seq);
      for (int s = 0; s < n_seq; ++s) {
        const size_t n = parents[s].size();
        q[s] = RandomBf16(n * kHeads * kLatentDim, rng_, 2.0f);
        dkv[s] = RandomBf16(n * kLatentDim, rng_, 1.0f);
        out_g[s].assign(n * kHeads * kValueDim, Bf16QuietNaN());
        out_c[s].assign(n * kHeads * kValueDim, Bf16QuietNaN());
        lse_g[s].assign(n * kHeads, NAN);
        lse_c[s].assign(n * kHeads, NAN);
        items_g[s] = {gpu_ids[s], parents[s], q[s], dkv[s], absl::MakeSpan(out_g[s]),
                      absl::MakeSpan(lse_g[s])};
        items_c[s] = {cpu_ids[s], parents[s], q[s], dkv[s], absl::MakeSpan(out_c[s]),
                      absl::MakeSpan(lse_c[s])};
      }
      ASSERT_TRUE(gpu_->Verify(layer, 0.0f, absl::MakeSpan(items_g)).ok());
      ASSERT_TRUE(cpu_->Verify(layer, 0.0f, absl::MakeSpan(items_c)).ok());
      for (int s = 0; s < n_seq; ++s) {
        double e = 0, norm = 0, lse_err = 0;
        for (size_t k = 0; k < out_g[s].size(); ++k) {
          const double g = Bf16ToFloat(out_g[s][k]), c = Bf16ToFloat(out_c[s][k]);
          e += (g - c) * (g - c);
          norm += c * c;
        }
        for (size_t k = 0; k < lse_g[s].size(); ++k) {
          lse_err = std::max(lse_err, std::fabs(static_cast<double>(lse_g[s][k]) - lse_c[s][k]));
        }
        const double rel = std::sqrt(e / norm);
        EXPECT_TRUE(rel <= 1e-2) << "step " << step << " layer " << layer << " seq " << s
                                 << " rel_err " << rel;
        EXPECT_TRUE(lse_err <= 1e-2) << "lse err " << lse_err;
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
}

}  // namespace
}  // namespace mlaverify::engine
