// The engine with device-driven steps (server/engine/steps.h), as the step
// tests drive it: a registered system region ("sys") and, on a GPU, a
// device region ("dev"); steps whose every layer's tensors are placed
// there; the scheduler's side of the doorbells; each layer's outputs
// checked against the CPU reference over a mirror of each sequence.
// Shared by steps_test.cc (CPU backend, fake device) and gpu_steps_test.cc;
// the GPU test supplies the device memory and GPU doorbell hooks, so this
// header needs no CUDA.
#ifndef MLAVERIFY_TESTS_STEP_FIXTURE_H_
#define MLAVERIFY_TESTS_STEP_FIXTURE_H_

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/draft_tree.h"
#include "common/host_doorbell.h"
#include "common/workload.h"
#include "gtest/gtest.h"
#include "server/engine/device.h"
#include "server/engine/engine.h"
#include "tests/engine_reference.h"

namespace mlaverify::engine {

// One item's data for every layer.
struct ItemData {
  uint64_t sequence = 0;
  std::vector<int32_t> parents;
  std::vector<std::vector<Bf16>> q, draft_kv;  // per layer
};

class StepFixture : public ::testing::Test {
 protected:
  static constexpr int kLayers = 3, kHeads = 4, kPage = 8;
  static constexpr size_t kRegionBytes = size_t{8} << 20;

  void TearDown() override {
    engine_.reset();
    if (region_ != nullptr) munmap(region_, kRegionBytes);
    if (!key_.empty()) shm_unlink(key_.c_str());
  }

  // An engine over `devices` (tensor parallel when several, unless `mode`)
  // with the system region registered as "sys".
  void MakeOn(std::vector<std::unique_ptr<Device>> devices, int lanes = 2,
              ParallelMode mode = ParallelMode::kTensorParallel) {
    config_.num_layers = kLayers;
    config_.num_heads = kHeads;
    config_.page_size = kPage;
    config_.pool_bytes = 96 * config_.bytes_per_page();
    config_.max_sequence_len = 2048;
    config_.draft_buckets = {1, 2, 4, 8, 16};
    config_.batch_buckets = {1, 2, 4};
    config_.pinned_staging_bytes = 4 << 20;
    config_.shared_memory.enabled = true;
    config_.parallel_mode = mode;
    config_.steps.lanes_per_device = lanes;
    auto engine = Engine::Create(config_, std::move(devices));
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    key_ = absl::StrCat("/mlaverify-steps-test-", getpid());
    const int fd = shm_open(key_.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, kRegionBytes), 0);
    region_ = static_cast<uint8_t*>(
        mmap(nullptr, kRegionBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    ASSERT_NE(region_, MAP_FAILED);
    ASSERT_TRUE(engine_->regions().Register("sys", key_, 0, kRegionBytes).ok());
    used_ = {0, 0};
  }

  // Where a step's tensors go: the system region, or the device one.
  enum class Where { kSystem, kDevice };

  uint64_t Take(Where where, uint64_t bytes) {
    uint64_t& used = used_[where == Where::kDevice];
    const uint64_t at = used;
    used = (used + bytes + 255) / 256 * 256;
    EXPECT_LE(used, kRegionBytes);
    return at;
  }

  void Put(Where where, uint64_t offset, const void* data, size_t bytes) {
    if (where == Where::kSystem) {
      std::memcpy(region_ + offset, data, bytes);
    } else {
      write_device_(offset, data, bytes);
    }
  }
  void Get(Where where, uint64_t offset, void* data, size_t bytes) {
    if (where == Where::kSystem) {
      std::memcpy(data, region_ + offset, bytes);
    } else {
      read_device_(offset, data, bytes);
    }
  }

  uint64_t NewSequence(int64_t length, Mirror* mirror) {
    auto id = engine_->CreateSequence("step");
    EXPECT_TRUE(id.ok());
    mirror->layers.assign(kLayers, {});
    const std::vector<Bf16> kv = RandomBf16(rng_, kLayers * length * kLatentDim, 1.0f);
    auto appended = engine_->AppendKv(*id, 0, length, kv);
    EXPECT_TRUE(appended.ok()) << appended.status();
    for (int l = 0; l < kLayers; ++l) {
      mirror->layers[l].assign(kv.begin() + l * length * kLatentDim,
                               kv.begin() + (l + 1) * length * kLatentDim);
    }
    return *id;
  }

  ItemData RandomItem(uint64_t sequence, int n) {
    ItemData d;
    d.sequence = sequence;
    d.parents = RandomDraftTree(rng_, n);
    for (int l = 0; l < kLayers; ++l) {
      d.q.push_back(RandomBf16(rng_, static_cast<size_t>(n) * kHeads * kLatentDim, 2.0f));
      d.draft_kv.push_back(RandomBf16(rng_, static_cast<size_t>(n) * kLatentDim, 1.0f));
    }
    return d;
  }

  // A step over `items`: every tensor of every layer placed (`where`), one
  // rank per device in TP mode (each its heads), the host slots in "sys".
  struct Placed {
    StepRequest request;
    Where where = Where::kSystem;
    // Per rank and item: where layer 0's out and lse are.
    std::vector<std::vector<uint64_t>> out, lse;
  };

  Placed Place(const std::vector<ItemData>& items, DoorbellKind kind = DoorbellKind::kHost,
               Where where = Where::kSystem) {
    Placed p;
    p.where = where;
    p.request.doorbell_kind = kind;
    const std::string region = where == Where::kDevice ? "dev" : "sys";
    const int ranks =
        config_.parallel_mode == ParallelMode::kTensorParallel ? engine_->num_devices() : 1;
    const int heads = engine_->heads_per_device();
    for (const ItemData& it : items) p.request.items.push_back({it.sequence, it.parents});
    p.out.resize(ranks);
    p.lse.resize(ranks);
    for (int r = 0; r < ranks; ++r) {
      StepRankRequest rank;
      for (const ItemData& it : items) {
        const uint64_t n = it.parents.size();
        StepItemPlacement place;
        const uint64_t q_bytes = n * heads * kLatentRowBytes, kv_bytes = n * kLatentRowBytes;
        const uint64_t out_bytes = n * heads * kValueDim * sizeof(Bf16);
        const uint64_t lse_bytes = n * heads * sizeof(float);
        place.q = {region, Take(where, q_bytes * kLayers), q_bytes};
        place.draft_kv = {region, Take(where, kv_bytes * kLayers), kv_bytes};
        place.out = {region, Take(where, out_bytes * kLayers), out_bytes};
        place.lse = {region, Take(where, lse_bytes * kLayers), lse_bytes};
        // This rank's heads of q, and the drafts, for every layer.
        std::vector<uint8_t> q(q_bytes), poison(std::max(out_bytes, lse_bytes), 0xFF);
        for (int l = 0; l < kLayers; ++l) {
          for (uint64_t i = 0; i < n; ++i) {
            std::memcpy(q.data() + i * heads * kLatentRowBytes,
                        it.q[l].data() + (i * kHeads + r * heads) * kLatentDim,
                        heads * kLatentRowBytes);
          }
          Put(where, place.q.offset + l * q_bytes, q.data(), q_bytes);
          Put(where, place.draft_kv.offset + l * kv_bytes, it.draft_kv[l].data(), kv_bytes);
          // Poisoned: an output the step never wrote shows as NaN.
          Put(where, place.out.offset + l * out_bytes, poison.data(), out_bytes);
          Put(where, place.lse.offset + l * lse_bytes, poison.data(), lse_bytes);
        }
        p.out[r].push_back(place.out.offset);
        p.lse[r].push_back(place.lse.offset);
        rank.items.push_back(place);
      }
      rank.doorbell_region = "sys";
      rank.doorbell_offset = Take(Where::kSystem, kHostSlotBytes);
      rank.completion_offset = Take(Where::kSystem, kHostSlotBytes);
      p.request.ranks.push_back(rank);
    }
    return p;
  }

  // The scheduler's side of rank r's doorbells: host slots, a host device's
  // arena, or (GPU) the device words through the test's hooks.
  void Ring(const Placed& p, const StepOpened& o, int r, uint64_t value) {
    const StepRankDoorbell& db = o.ranks[r];
    if (p.request.doorbell_kind == DoorbellKind::kHost) {
      HostSlot(region_ + p.request.ranks[r].doorbell_offset).Store(value);
    } else if (db.arena_host != nullptr) {
      HostSlot(db.arena_host + db.doorbell_offset).Store(value);
    } else {
      ring_device_(db.doorbell_address, value);
    }
  }
  uint64_t Completion(const Placed& p, const StepOpened& o, int r) {
    const StepRankDoorbell& db = o.ranks[r];
    if (p.request.doorbell_kind == DoorbellKind::kHost) {
      return HostSlot(region_ + p.request.ranks[r].completion_offset).Load();
    }
    if (db.arena_host != nullptr) return HostSlot(db.arena_host + db.completion_offset).Load();
    return read_device_word_(db.completion_address);
  }
  // Waits until rank r's completion reached `target`; returns what it read.
  uint64_t AwaitCompletion(const Placed& p, const StepOpened& o, int r, uint64_t target) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    uint64_t seen = Completion(p, o, r);
    while (seen < target && absl::Now() < deadline) {
      absl::SleepFor(absl::Microseconds(50));
      seen = Completion(p, o, r);
    }
    return seen;
  }

  // Rings layers [0, layers) on every rank and waits until they ran.
  void RingAndWait(const Placed& p, const StepOpened& o, int layers) {
    for (size_t r = 0; r < o.ranks.size(); ++r) Ring(p, o, r, o.ranks[r].base + layers);
    for (size_t r = 0; r < o.ranks.size(); ++r) {
      const uint64_t target = o.ranks[r].base + layers;
      const uint64_t seen = AwaitCompletion(p, o, r, target);
      ASSERT_GE(seen, target) << "rank " << r << " did not complete layer " << layers - 1;
      ASSERT_LE(seen, o.ranks[r].base + kLayers) << "the step ended early";
    }
  }

  // Layer `l`'s outputs of every rank against the reference (heads joined):
  // to the bit on host devices (the same CPU math), within bf16 rounding on
  // a GPU.
  void ExpectLayer(const Placed& p, const std::vector<ItemData>& items,
                   const std::vector<Mirror>& mirrors, int l) {
    const int heads = engine_->heads_per_device();
    for (size_t k = 0; k < items.size(); ++k) {
      const ItemData& it = items[k];
      const uint64_t n = it.parents.size();
      std::vector<Bf16> ref_out;
      std::vector<float> ref_lse;
      Reference(mirrors[k], l, it.draft_kv[l], it.parents, it.q[l], kHeads,
                config_.default_softmax_scale, &ref_out, &ref_lse, config_.kv_dtype);
      for (size_t r = 0; r < p.out.size(); ++r) {
        const uint64_t out_bytes = n * heads * kValueDim * sizeof(Bf16);
        const uint64_t lse_bytes = n * heads * sizeof(float);
        std::vector<Bf16> out(n * heads * kValueDim);
        std::vector<float> lse(n * heads);
        Get(p.where, p.out[r][k] + l * out_bytes, out.data(), out_bytes);
        Get(p.where, p.lse[r][k] + l * lse_bytes, lse.data(), lse_bytes);
        double err = 0, norm = 0, lse_err = 0;
        bool bitwise = true;
        for (uint64_t i = 0; i < n; ++i) {
          for (int h = 0; h < heads; ++h) {
            const size_t mine = i * heads + h, ref = i * kHeads + r * heads + h;
            for (int c = 0; c < kValueDim; ++c) {
              const Bf16 a = out[mine * kValueDim + c], b = ref_out[ref * kValueDim + c];
              bitwise = bitwise && std::memcmp(&a, &b, sizeof(Bf16)) == 0;
              const double d = static_cast<double>(Bf16ToFloat(a)) - Bf16ToFloat(b);
              err += d * d;
              norm += static_cast<double>(Bf16ToFloat(b)) * Bf16ToFloat(b);
            }
            bitwise = bitwise && lse[mine] == ref_lse[ref];
            lse_err = std::max(lse_err, std::fabs(static_cast<double>(lse[mine]) - ref_lse[ref]));
          }
        }
        const double rel = std::sqrt(err / std::max(norm, 1e-30));
        const std::string where = absl::StrCat("item ", k, " rank ", r, " layer ", l, ": rel_err ",
                                               rel, " lse ", lse_err);
        if (exact_) {
          EXPECT_TRUE(bitwise) << where;
        } else {
          EXPECT_LE(rel, 1e-2) << where;  // NaN fails
          EXPECT_LE(lse_err, 1e-3) << where;
        }
      }
    }
  }

  void ExpectKvEquals(uint64_t id, const Mirror& m, int replica = 0) {
    const int64_t len = m.length();
    std::vector<Bf16> kv(static_cast<size_t>(kLayers) * len * kLatentDim);
    ASSERT_TRUE(engine_->ReadKv(id, 0, len, absl::MakeSpan(kv), replica).ok());
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_EQ(
          std::memcmp(kv.data() + l * len * kLatentDim, m.layers[l].data(), len * kLatentRowBytes),
          0)
          << "layer " << l;
    }
  }

  // The longest root-to-node path ending at the last draft.
  static std::vector<int32_t> LastPath(const std::vector<int32_t>& parents) {
    std::vector<int32_t> path;
    for (int a = static_cast<int>(parents.size()) - 1; a >= 0; a = parents[a]) path.push_back(a);
    std::reverse(path.begin(), path.end());
    return path;
  }

  static void Accept(Mirror* m, const ItemData& it, const std::vector<int32_t>& path) {
    for (int l = 0; l < kLayers; ++l) {
      for (int32_t a : path) {
        m->layers[l].insert(m->layers[l].end(), it.draft_kv[l].begin() + a * kLatentDim,
                            it.draft_kv[l].begin() + (a + 1) * kLatentDim);
      }
    }
  }

  // Commits every item of a step that ran: the first accepts its last
  // draft's path, the others none; the mirrors follow.
  void CommitLastPathOfFirst(const std::vector<ItemData>& items, std::vector<Mirror>& mirrors) {
    for (size_t k = 0; k < items.size(); ++k) {
      const std::vector<int32_t> path =
          k == 0 ? LastPath(items[k].parents) : std::vector<int32_t>{};
      auto committed = engine_->Commit(items[k].sequence, path);
      ASSERT_TRUE(committed.ok()) << committed.status();
      Accept(&mirrors[k], items[k], path);
      EXPECT_EQ(committed->length, mirrors[k].length());
    }
  }

  // Waits until the step ended (the runner drops an aborted step's items).
  StepInfo WaitEnded(uint64_t step) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      auto info = engine_->GetStep(step);
      EXPECT_TRUE(info.ok()) << info.status();
      if (!info.ok() || StepEnded(info->state)) return info.ok() ? *info : StepInfo{};
      absl::SleepFor(absl::Milliseconds(1));
    }
    ADD_FAILURE() << "step " << step << " did not end";
    return {};
  }

  EngineConfig config_;
  std::unique_ptr<Engine> engine_;
  std::string key_;
  uint8_t* region_ = nullptr;
  std::vector<uint64_t> used_ = {0, 0};  // per Where
  std::mt19937_64 rng_{777};
  bool exact_ = true;  // outputs compared to the bit (host devices)
  // The GPU test's hooks: the device region and GPU doorbells.
  std::function<void(uint64_t offset, const void* data, size_t bytes)> write_device_;
  std::function<void(uint64_t offset, void* data, size_t bytes)> read_device_;
  std::function<void(uint64_t address, uint64_t value)> ring_device_;
  std::function<uint64_t(uint64_t address)> read_device_word_;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_TESTS_STEP_FIXTURE_H_
