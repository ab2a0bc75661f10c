// libFuzzer target: any bytes as a series of engine calls (create, append,
// verify with any tree and buffer sizes, commit with any path, release) on a
// small engine over one CPU device. Every call must answer with a status (no
// crash, no sanitizer report), the page accounting must hold after every
// call, and once every sequence is released every page must be free again.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/geometry.h"
#include "server/engine/device.h"
#include "server/engine/engine.h"
#include "spdlog/spdlog.h"

namespace {

using mlaverify::Bf16;
namespace engine = mlaverify::engine;

constexpr int kLayers = 2, kHeads = 2;

engine::Engine& TheEngine() {
  static engine::Engine* e = [] {
    spdlog::set_level(spdlog::level::off);
    engine::EngineConfig c;
    c.num_layers = kLayers;
    c.num_heads = kHeads;
    c.page_size = 4;
    c.pool_bytes = 24 * c.bytes_per_page();
    c.max_sequence_len = 64;
    c.draft_buckets = {1, 2, 4, 8};
    c.batch_buckets = {1, 2, 4};
    c.max_live_sequences = 8;
    std::vector<std::unique_ptr<engine::Device>> devices;
    devices.push_back(engine::MakeCpuDevice(1));
    auto made = engine::Engine::Create(c, std::move(devices));
    if (!made.ok()) __builtin_trap();
    return made->release();
  }();
  return *e;
}

struct Reader {
  const uint8_t* data;
  size_t size;
  size_t at = 0;
  bool done() const { return at >= size; }
  uint8_t Next() { return at < size ? data[at++] : 0; }
};

void CheckPages(engine::Engine& e) {
  const engine::EngineStats s = e.Stats();
  if (s.free_pages < 0 || s.free_pages > s.total_pages) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  engine::Engine& e = TheEngine();
  Reader in{data, size};
  std::vector<uint64_t> ids;
  int ops = 0;
  while (!in.done() && ops++ < 64) {
    const uint8_t op = in.Next() % 5;
    // A sequence to address: one of ours, or an id that names nothing.
    const uint8_t pick = in.Next();
    const uint64_t id = ids.empty() || pick == 255 ? 12345 : ids[pick % ids.size()];
    if (op == 0) {
      auto created = e.CreateSequence(std::string(in.Next() % 300, 'x'));
      if (created.ok()) ids.push_back(*created);
    } else if (op == 1) {
      const int64_t tokens = in.Next() % 20;  // 0: invalid
      const int64_t start = in.Next() % 24;
      const size_t values = static_cast<size_t>(kLayers) * tokens * mlaverify::kLatentDim +
                            (in.Next() % 4 == 0 ? 1 : 0);  // sometimes one too many
      std::vector<Bf16> kv(values, mlaverify::FloatToBf16(0.25f));
      (void)e.AppendKv(id, start, tokens, kv);
    } else if (op == 2) {
      const int items = 1 + in.Next() % 3;
      const int layer = static_cast<int8_t>(in.Next()) % 3;  // -2..2: some out of range
      std::vector<std::vector<int32_t>> parents(items);
      std::vector<std::vector<Bf16>> q(items), kv(items), out(items);
      std::vector<std::vector<float>> lse(items);
      std::vector<engine::VerifyItem> batch(items);
      for (int k = 0; k < items; ++k) {
        const int n = in.Next() % 10;  // 0 and 9 are out of range
        for (int i = 0; i < n; ++i)
          parents[k].push_back(static_cast<int8_t>(in.Next()) % (i + 2) - 1);
        const bool short_q = in.Next() % 8 == 0;
        q[k].assign(static_cast<size_t>(n) * kHeads * mlaverify::kLatentDim - (short_q && n > 0),
                    mlaverify::FloatToBf16(0.5f));
        kv[k].assign(static_cast<size_t>(n) * mlaverify::kLatentDim, mlaverify::FloatToBf16(0.5f));
        out[k].resize(static_cast<size_t>(n) * kHeads * mlaverify::kValueDim);
        lse[k].resize(static_cast<size_t>(n) * kHeads);
        const uint8_t which = in.Next();
        batch[k] = engine::VerifyItem{ids.empty() || which == 255 ? 777 : ids[which % ids.size()],
                                      parents[k],
                                      q[k],
                                      kv[k],
                                      absl::MakeSpan(out[k]),
                                      absl::MakeSpan(lse[k])};
      }
      (void)e.Verify(layer, 0.0f, absl::MakeSpan(batch));
    } else if (op == 3) {
      std::vector<int32_t> path;
      const int len = in.Next() % 5;
      for (int t = 0; t < len; ++t) path.push_back(static_cast<int8_t>(in.Next()) % 10);
      (void)e.Commit(id, path);
    } else {
      (void)e.Release(id);
    }
    CheckPages(e);
  }
  for (uint64_t id : ids) (void)e.Release(id);
  const engine::EngineStats s = e.Stats();
  if (s.free_pages != s.total_pages || s.live_sequences != 0 || s.pending_steps != 0)
    __builtin_trap();
  return 0;
}
