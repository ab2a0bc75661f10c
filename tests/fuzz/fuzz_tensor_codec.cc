// libFuzzer target: any bytes as a v1.Tensor, turned into an engine tensor
// reference the way the service does (transport/tensor_codec.h) and handed
// to an engine on the CPU backend as an AppendKv's kv (T taken from the
// tensor) and as a Verify item's q, for a sequence that does not exist. The
// engine's checks run before the sequence is looked up, so a call may get as
// far as NOT_FOUND only with a tensor whose dtype, shape and byte count
// match; nothing may crash or overflow on hostile shapes.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "google/protobuf/stubs/logging.h"
#include "mlaverify/v1/verify.pb.h"
#include "server/engine/engine.h"
#include "server/transport/tensor_codec.h"
#include "spdlog/spdlog.h"

namespace {

constexpr int kLayers = 2, kHeads = 2, kDrafts = 4;

mlaverify::engine::Engine* TheEngine() {
  static mlaverify::engine::Engine* engine = [] {
    mlaverify::engine::EngineConfig config;
    config.num_layers = kLayers;
    config.num_heads = kHeads;
    config.page_size = 16;
    config.pool_bytes = 8 * config.bytes_per_page();
    config.max_sequence_len = 1024;
    std::vector<std::unique_ptr<mlaverify::engine::Device>> devices;
    devices.push_back(mlaverify::engine::MakeCpuDevice(1));
    return mlaverify::engine::Engine::Create(config, std::move(devices))->release();
  }();
  return engine;
}

bool IsBf16Of(const mlaverify::v1::Tensor& t, std::initializer_list<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return t.dtype() == mlaverify::v1::DTYPE_BF16 && !t.has_shared_memory() &&
         std::equal(t.shape().begin(), t.shape().end(), shape.begin(), shape.end()) &&
         static_cast<int64_t>(t.raw().size()) == 2 * n;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // Invalid UTF-8 in string fields is logged by the parser: expected here.
  google::protobuf::SetLogHandler(nullptr);
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using mlaverify::engine::Engine;
  mlaverify::v1::Tensor tensor;
  if (!tensor.ParseFromArray(data, static_cast<int>(size))) return 0;
  Engine* engine = TheEngine();
  constexpr uint64_t kNoSuchSequence = 1;

  mlaverify::engine::AppendCall append;
  append.sequence_id = kNoSuchSequence;
  append.kv = mlaverify::transport::ToTensorRef(tensor);
  absl::Status appended;
  engine->SubmitAppendKv(std::move(append),
                         [&](absl::StatusOr<int64_t> r) { appended = r.status(); });
  const int64_t tokens = tensor.shape_size() == 3 ? tensor.shape(1) : -1;
  if (appended.code() == absl::StatusCode::kNotFound &&
      !(tokens >= 1 && IsBf16Of(tensor, {kLayers, tokens, 576}))) {
    __builtin_trap();
  }

  const std::vector<mlaverify::Bf16> draft_kv(kDrafts * 576);
  const std::vector<int32_t> parents = {-1, 0, 1, 2};
  std::vector<mlaverify::Bf16> out(kDrafts * kHeads * 512);
  std::vector<float> lse(kDrafts * kHeads);
  mlaverify::engine::VerifyItem item{kNoSuchSequence,
                                     parents,
                                     mlaverify::transport::ToTensorRef(tensor),
                                     draft_kv,
                                     absl::MakeSpan(out),
                                     absl::MakeSpan(lse)};
  const absl::Status verified = engine->Verify(0, 0.0f, absl::MakeSpan(&item, 1));
  if (verified.code() == absl::StatusCode::kNotFound && !IsBf16Of(tensor, {kDrafts, kHeads, 576})) {
    __builtin_trap();
  }
  return 0;
}
