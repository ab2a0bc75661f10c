// The CPU backend: the pool in host memory, the math of kernels/cpu_reference.
#include <cstring>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kernels/cpu_reference.h"
#include "kernels/parallel_for.h"
#include "common/status_macros.h"
#include "server/engine/backend.h"

namespace mlaverify::engine {
namespace {

using mlaverify::kLatentDim;
using mlaverify::kValueDim;

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) : threads_(kernels::ResolveThreadCount(threads)) {}

  std::string name() const override { return "cpu"; }

  std::vector<DeviceDescription> devices() const override {
    return {{absl::StrCat("cpu (", threads_, " threads)"), pool_bytes_}};
  }

  absl::Status Init(const PoolGeometry& g) override {
    geometry_ = g;
    const uint64_t elems = static_cast<uint64_t>(g.num_layers) * g.num_pages * g.page_size * kLatentDim;
    pool_bytes_ = elems * sizeof(Bf16);
    // Uninitialised on purpose: pages are written before they are read, and
    // the OS commits memory only as pages are first touched.
    pool_.reset(new (std::nothrow) Bf16[elems]);
    if (pool_ == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", pool_bytes_, " bytes of host memory for the KV pool"));
    }
    return absl::OkStatus();
  }

  absl::Status WriteRows(absl::Span<const int32_t> page_table, int64_t start, int64_t count,
                         absl::Span<const Bf16> data) override {
    ForEachRow(page_table, start, count, [](Bf16* pool_row, const Bf16* row) {
      std::memcpy(pool_row, row, kLatentDim * sizeof(Bf16));
    }, data.data());
    return absl::OkStatus();
  }

  absl::Status ReadRows(absl::Span<const int32_t> page_table, int64_t start, int64_t count,
                        absl::Span<Bf16> data) override {
    ForEachRow(page_table, start, count, [](Bf16* pool_row, Bf16* row) {
      std::memcpy(row, pool_row, kLatentDim * sizeof(Bf16));
    }, data.data());
    return absl::OkStatus();
  }

  absl::Status Verify(absl::Span<const BackendVerifyRequest> requests) override {
    // One request at a time: each is already parallel over its rows, and the
    // per-request argument arrays stay trivially small.
    for (const BackendVerifyRequest& r : requests) {
      const int32_t prefix = r.prefix_len, draft = r.draft_len, layer = r.layer;
      kernels::DraftKvWriteArguments w;
      w.batch = 1;
      w.total_draft_capacity = draft;
      w.draft_kv = r.draft_kv.data();
      w.draft_kv_stride = kLatentDim;
      w.pool = View();
      w.page_table = r.page_table.data();
      w.page_table_stride = static_cast<int64_t>(r.page_table.size());
      w.prefix_len = &prefix;
      w.draft_len = &draft;
      w.layer = &layer;
      RETURN_IF_ERROR(kernels::WriteDraftKvCpu(w));

      kernels::VerifyArguments a;
      a.batch = 1;
      a.num_heads = geometry_.num_heads;
      a.max_draft_len = draft;
      a.total_draft_capacity = draft;
      a.q = r.q.data();
      a.q_token_stride = static_cast<int64_t>(geometry_.num_heads) * kLatentDim;
      a.q_head_stride = kLatentDim;
      a.pool = View();
      a.page_table = r.page_table.data();
      a.page_table_stride = static_cast<int64_t>(r.page_table.size());
      a.prefix_len = &prefix;
      a.draft_len = &draft;
      a.layer = &layer;
      a.default_softmax_scale = r.softmax_scale;
      a.visibility = r.visibility.data();
      a.out = r.out.data();
      a.out_token_stride = static_cast<int64_t>(geometry_.num_heads) * kValueDim;
      a.out_head_stride = kValueDim;
      a.lse = r.lse.data();
      RETURN_IF_ERROR(kernels::VerifyAttentionCpu(a, threads_));
    }
    return absl::OkStatus();
  }

  absl::Status Compact(absl::Span<const int32_t> page_table, int64_t prefix_len,
                       absl::Span<const int32_t> accepted) override {
    std::vector<int32_t> path(mlaverify::kMaxDraftLen, 0);
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
  // Calls fn(pool row, rows row) for positions start..start+count-1 of every
  // layer, `rows` being laid out [num_layers, count, 576].
  template <typename Row, typename Fn>
  void ForEachRow(absl::Span<const int32_t> page_table, int64_t start, int64_t count, Fn fn,
                  Row* rows) {
    const kernels::KvPoolView view = View();
    for (int layer = 0; layer < geometry_.num_layers; ++layer) {
      for (int64_t t = 0; t < count; ++t) {
        fn(pool_.get() + view.RowOffset(layer, page_table.data(), start + t),
           rows + (static_cast<int64_t>(layer) * count + t) * kLatentDim);
      }
    }
  }

  kernels::KvPoolView View() const {
    return kernels::KvPoolView{pool_.get(), geometry_.num_layers, geometry_.num_pages,
                               geometry_.page_size};
  }

  const int threads_;
  PoolGeometry geometry_;
  uint64_t pool_bytes_ = 0;
  std::unique_ptr<Bf16[]> pool_;
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(int threads) {
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace mlaverify::engine
