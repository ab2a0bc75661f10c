// HostDevice: the KV pool and the staging sets in host memory, verify batches
// computed with the CPU reference (kernels/cpu_reference.h). As the CPU
// backend it launches every batch eagerly; with FakeDeviceOptions it also
// keeps the books a GPU's graphs would need (which shapes were captured, which
// launch used which), sleeps to simulate a slow device and injects faults, so
// that the worker's batching, bucket choice, padding and fault handling are
// tested without a GPU.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/geometry.h"
#include "common/status_macros.h"
#include "kernels/cpu_reference.h"
#include "kernels/parallel_for.h"
#include "server/engine/device.h"

namespace mlaverify::engine {
namespace {

// 256-byte aligned, uninitialised host memory.
struct AlignedBuffer {
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data;
  size_t bytes = 0;

  bool Allocate(size_t n) {
    bytes = (std::max<size_t>(n, 1) + 255) / 256 * 256;
    data.reset(static_cast<uint8_t*>(std::aligned_alloc(256, bytes)));
    return data != nullptr;
  }
};

class HostDevice final : public Device {
 public:
  HostDevice(std::string name, int threads, std::optional<FakeDeviceOptions> fake,
             FakeDeviceRecord* record)
      : name_(std::move(name)),
        threads_(kernels::ResolveThreadCount(threads)),
        fake_(fake),
        record_(record) {}

  std::string name() const override { return name_; }

  DeviceDescription Describe() const override {
    return {fake_ ? absl::StrCat("fake device (", name_, ")")
                  : absl::StrCat("cpu (", threads_, " threads)"),
            pool_.bytes};
  }

  absl::Status Init(const DeviceGeometry& g) override {
    g_ = g;
    const size_t pool_bytes =
        static_cast<size_t>(g.num_layers) * g.num_pages * g.page_size * kLatentDim * sizeof(Bf16);
    if (!pool_.Allocate(pool_bytes)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", pool_bytes, " bytes of host memory for the KV pool"));
    }
    // Every pool byte is written once here, as a GPU's pool is allocated
    // whole: the memory is committed at start (no out-of-memory later, a
    // resident size that stays flat), and all-ones bytes are bf16 NaN, so a
    // read of a row never written shows up as NaN in an answer.
    std::memset(pool_.data.get(), 0xFF, pool_.bytes);
    const StagingLayout max =
        StagingLayout::For({g.max_batch, g.max_draft_len}, g.num_heads, g.max_pages_per_sequence);
    sets_.resize(g.staging_sets);
    for (StagingSet& s : sets_) {
      if (!s.input.Allocate(max.input_bytes) || !s.output.Allocate(max.output_bytes)) {
        return absl::ResourceExhaustedError("cannot allocate host staging buffers");
      }
    }
    return absl::OkStatus();
  }

  bool SupportsGraphs() const override { return fake_ && fake_->graphs; }

  absl::StatusOr<int64_t> CaptureGraphs(int set, BatchShape shape) override {
    if (!SupportsGraphs()) return absl::FailedPreconditionError(name_ + " records no graphs");
    sets_[set].captured.push_back(shape);
    if (record_ != nullptr) {
      absl::MutexLock lock(&record_->mu);
      record_->captured.push_back(shape);
    }
    return 0;
  }

  StagingView Staging(int set, BatchShape shape) override {
    StagingView v;
    v.layout = StagingLayout::For(shape, g_.num_heads, g_.max_pages_per_sequence);
    v.input = sets_[set].input.data.get();
    v.output = sets_[set].output.data.get();
    return v;
  }

  absl::Status Launch(const LaunchOptions& o) override {
    if (!o.inputs_from_device.empty() || !o.outputs_to_device.empty()) {
      return absl::InternalError(absl::StrCat(name(), ": a batch with device-memory tensors"));
    }
    StagingSet& s = sets_[o.set];
    s.status = Run(o);
    return absl::OkStatus();
  }

  absl::StatusOr<double> Wait(int set) override {
    StagingSet& s = sets_[set];
    if (!s.status.ok()) return s.status;
    return s.seconds;
  }

  absl::Status WriteRows(absl::Span<const int32_t> page_table, int64_t start, int64_t count,
                         const Bf16* rows) override {
    RETURN_IF_ERROR(Simulate());
    if (record_ != nullptr) {
      absl::MutexLock lock(&record_->mu);
      ++record_->write_rows;
    }
    ForEachRow(
        page_table, start, count,
        [](Bf16* pool_row, const Bf16* row) { std::memcpy(pool_row, row, kLatentRowBytes); }, rows);
    return absl::OkStatus();
  }

  absl::Status ReadRows(absl::Span<const int32_t> page_table, int64_t start, int64_t count,
                        Bf16* rows) override {
    RETURN_IF_ERROR(CheckFault());
    ForEachRow(
        page_table, start, count,
        [](Bf16* pool_row, Bf16* row) { std::memcpy(row, pool_row, kLatentRowBytes); }, rows);
    return absl::OkStatus();
  }

  absl::Status Compact(absl::Span<const int32_t> page_table, int64_t prefix_len,
                       absl::Span<const int32_t> accepted) override {
    RETURN_IF_ERROR(Simulate());
    if (record_ != nullptr) {
      absl::MutexLock lock(&record_->mu);
      ++record_->compacts;
    }
    std::vector<int32_t> path(kMaxDraftLen, 0);
    std::copy(accepted.begin(), accepted.end(), path.begin());
    const int32_t prefix = static_cast<int32_t>(prefix_len);
    const int32_t count = static_cast<int32_t>(accepted.size());
    kernels::CompactArguments c;
    c.batch = 1;
    c.pool = View();
    c.page_table = page_table.data();
    c.page_table_stride = static_cast<int64_t>(page_table.size());
    c.prefix_len = &prefix;
    c.accepted_len = &count;
    c.accepted = path.data();
    return kernels::CompactAcceptedKvCpu(c);
  }

 private:
  struct StagingSet {
    AlignedBuffer input, output;
    std::vector<BatchShape> captured;
    absl::Status status;
    double seconds = 0;
  };

  // A fault, once injected, stays (a sticky device error).
  absl::Status CheckFault() const {
    if (faulted_) return absl::InternalError(absl::StrCat(name_, ": injected fault"));
    return absl::OkStatus();
  }

  absl::Status Simulate() {
    RETURN_IF_ERROR(CheckFault());
    if (fake_ && fake_->latency > absl::ZeroDuration()) absl::SleepFor(fake_->latency);
    return absl::OkStatus();
  }

  absl::Status Run(const LaunchOptions& o) {
    const absl::Time started = absl::Now();
    const StagingView v = Staging(o.set, o.shape);
    if (fake_) {
      ++launches_;
      int requests = 0;
      for (int b = 0; b < o.shape.batch; ++b) requests += v.draft_len()[b] > 0 ? 1 : 0;
      if (record_ != nullptr) {
        absl::MutexLock lock(&record_->mu);
        record_->launches.push_back(o);
        record_->launch_requests.push_back(requests);
      }
      if (fake_->fail_launch > 0 && launches_ == fake_->fail_launch) faulted_ = true;
      if (o.graph) {
        const std::vector<BatchShape>& captured = sets_[o.set].captured;
        if (std::find(captured.begin(), captured.end(), o.shape) == captured.end()) {
          return absl::InternalError(absl::StrCat(
              name_, ": graph launch of batch ", o.shape.batch, " x draft ", o.shape.draft_len,
              " on staging set ", o.set, ", which was never captured"));
        }
      }
    } else if (o.graph) {
      return absl::InternalError(absl::StrCat(name_, " has no graphs"));
    }
    RETURN_IF_ERROR(Simulate());
    const int heads = g_.num_heads;
    int64_t row = 0;
    for (int b = 0; b < o.shape.batch; ++b) {
      const int32_t prefix = v.prefix_len()[b], draft = v.draft_len()[b], layer = v.layer()[b];
      if (draft == 0) continue;  // padding
      if (draft > o.shape.draft_len || row + draft > o.shape.rows()) {
        return absl::InternalError(absl::StrCat(name_, ": request ", b, " has ", draft,
                                                " drafts, more than its launch shape holds"));
      }
      kernels::DraftKvWriteArguments w;
      w.batch = 1;
      w.total_draft_capacity = draft;
      w.draft_kv = v.draft_kv() + row * kLatentDim;
      w.draft_kv_stride = kLatentDim;
      w.pool = View();
      w.page_table = v.page_table(b);
      w.page_table_stride = v.layout.page_table_stride;
      w.prefix_len = &prefix;
      w.draft_len = &draft;
      w.layer = &layer;
      RETURN_IF_ERROR(kernels::WriteDraftKvCpu(w));

      kernels::VerifyArguments a;
      a.batch = 1;
      a.num_heads = heads;
      a.max_draft_len = draft;
      a.total_draft_capacity = draft;
      a.q = v.q() + row * heads * kLatentDim;
      a.q_token_stride = static_cast<int64_t>(heads) * kLatentDim;
      a.q_head_stride = kLatentDim;
      a.pool = View();
      a.page_table = v.page_table(b);
      a.page_table_stride = v.layout.page_table_stride;
      a.prefix_len = &prefix;
      a.draft_len = &draft;
      a.layer = &layer;
      a.default_softmax_scale = v.scale()[b];
      a.visibility = v.visibility() + row;
      a.out = v.out() + row * heads * kValueDim;
      a.out_token_stride = static_cast<int64_t>(heads) * kValueDim;
      a.out_head_stride = kValueDim;
      a.lse = v.lse() + row * heads;
      RETURN_IF_ERROR(kernels::VerifyAttentionCpu(a, threads_));
      row += draft;
    }
    sets_[o.set].seconds = absl::ToDoubleSeconds(absl::Now() - started);
    return absl::OkStatus();
  }

  // Calls fn(pool row, rows row) for positions start..start+count-1 of every
  // layer, `rows` being laid out [num_layers, count, 576].
  template <typename Row, typename Fn>
  void ForEachRow(absl::Span<const int32_t> page_table, int64_t start, int64_t count, Fn fn,
                  Row* rows) {
    const kernels::KvPoolView view = View();
    for (int layer = 0; layer < g_.num_layers; ++layer) {
      for (int64_t t = 0; t < count; ++t) {
        fn(view.data + view.RowOffset(layer, page_table.data(), start + t),
           rows + (static_cast<int64_t>(layer) * count + t) * kLatentDim);
      }
    }
  }

  kernels::KvPoolView View() const {
    return kernels::KvPoolView{reinterpret_cast<Bf16*>(pool_.data.get()), g_.num_layers,
                               g_.num_pages, g_.page_size};
  }

  const std::string name_;
  const int threads_;
  const std::optional<FakeDeviceOptions> fake_;
  FakeDeviceRecord* const record_;
  DeviceGeometry g_;
  AlignedBuffer pool_;
  std::vector<StagingSet> sets_;
  int launches_ = 0;
  bool faulted_ = false;
};

}  // namespace

std::unique_ptr<Device> MakeCpuDevice(int threads) {
  return std::make_unique<HostDevice>("cpu", threads, std::nullopt, nullptr);
}

std::unique_ptr<Device> MakeFakeDevice(int index, const FakeDeviceOptions& options,
                                       FakeDeviceRecord* record, int threads) {
  return std::make_unique<HostDevice>(absl::StrCat("fake:", index), threads, options, record);
}

}  // namespace mlaverify::engine
