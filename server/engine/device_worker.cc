#include "server/engine/device_worker.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/geometry.h"
#include "spdlog/spdlog.h"

namespace mlaverify::engine {
namespace {

// Below this many bytes of host copies a batch is packed (or unpacked) by
// one thread: waking helpers costs more than it saves.
constexpr size_t kParallelCopyBytes = size_t{512} << 10;

}  // namespace

DeviceWorker::DeviceWorker(int index, std::unique_ptr<Device> device, std::string name,
                           const WorkerOptions& options, EngineObserver* observer,
                           std::function<void(int, const absl::Status&)> on_fault)
    : index_(index),
      device_(std::move(device)),
      name_(std::move(name)),
      options_(options),
      observer_(observer),
      on_fault_(std::move(on_fault)),
      pack_runner_(options.copy_threads),
      unpack_runner_(options.copy_threads) {}

DeviceWorker::~DeviceWorker() { Stop(); }

absl::Status DeviceWorker::Start(const DeviceGeometry& geometry) {
  geometry_ = geometry;
  if (absl::Status s = device_->BindThread(); !s.ok()) return s;
  if (absl::Status s = device_->Init(geometry); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(name_, ": ", s.message()));
  }
  uses_graphs_ = options_.use_graphs && device_->SupportsGraphs();
  if (uses_graphs_) {
    const absl::Time begin = absl::Now();
    int64_t graph_bytes = 0;
    int graphs = 0;
    for (int set = 0; set < geometry.staging_sets; ++set) {
      for (int b : options_.batch_buckets) {
        for (int n : options_.draft_buckets) {
          absl::StatusOr<int64_t> bytes = device_->CaptureGraphs(set, BatchShape{b, n});
          if (!bytes.ok()) {
            return absl::Status(bytes.status().code(),
                                absl::StrCat(name_, ": capturing the graph of batch ", b,
                                             " x draft ", n, ": ", bytes.status().message()));
          }
          graph_bytes += *bytes;
          ++graphs;
        }
      }
    }
    spdlog::info(
        "{}: captured the verify graphs of {} buckets x {} staging sets in {:.3f} s, "
        "{:.1f} MiB of device memory",
        name_, graphs / geometry.staging_sets, geometry.staging_sets,
        absl::ToDoubleSeconds(absl::Now() - begin), static_cast<double>(graph_bytes) / (1 << 20));
  } else {
    spdlog::info("{}: no CUDA graphs ({}): every batch is launched eagerly", name_,
                 options_.use_graphs ? "the device has none" : "disabled");
  }
  {
    absl::MutexLock lock(&mu_);
    for (int set = 0; set < geometry.staging_sets; ++set) free_sets_.push_back(set);
  }
  launch_thread_ = std::thread([this] { LaunchLoop(); });
  completion_thread_ = std::thread([this] { CompletionLoop(); });
  started_ = true;
  return absl::OkStatus();
}

void DeviceWorker::Stop() {
  if (!started_) return;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  launch_thread_.join();
  completion_thread_.join();
  started_ = false;
}

void DeviceWorker::Enqueue(VerifyShard shard) {
  absl::MutexLock lock(&mu_);
  Entry e;
  e.shard = shard;
  queue_.push_back(std::move(e));
  queue_size_.store(static_cast<int>(queue_.size()), std::memory_order_release);
  ++queued_shards_;
}

void DeviceWorker::Enqueue(DeviceOp op) {
  absl::MutexLock lock(&mu_);
  Entry e;
  e.is_op = true;
  e.op = std::move(op);
  queue_.push_back(std::move(e));
  queue_size_.store(static_cast<int>(queue_.size()), std::memory_order_release);
}

absl::Status DeviceWorker::fault() const {
  absl::MutexLock lock(&mu_);
  return fault_;
}

int DeviceWorker::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

void DeviceWorker::Fault(const absl::Status& status) {
  absl::Status recorded;
  {
    absl::MutexLock lock(&mu_);
    if (!fault_.ok()) return;
    fault_ = absl::InternalError(absl::StrCat("device ", name_, " faulted: ", status.message()));
    recorded = fault_;
  }
  spdlog::error("{}; every call that needs this device fails from now on",
                std::string(recorded.message()));
  if (observer_ != nullptr) observer_->OnDeviceFault(name_, recorded);
  if (on_fault_) on_fault_(index_, recorded);
}

void DeviceWorker::FailShards(absl::Span<const VerifyShard> shards, const absl::Status& status,
                              const ShardTiming& timing) {
  for (const VerifyShard& s : shards) s.owner->ShardDone(s.index, status, timing);
}

std::vector<VerifyShard> DeviceWorker::TakeBatch() {
  const size_t max_items = static_cast<size_t>(options_.batch_buckets.back());
  std::vector<VerifyShard> batch;
  while (!queue_.empty() && !queue_.front().is_op && batch.size() < max_items) {
    const VerifyShard& next = queue_.front().shard;
    // A second write of the same rows must not race the first inside one
    // launch: it waits for the next batch.
    const bool conflict = std::any_of(batch.begin(), batch.end(), [&](const VerifyShard& s) {
      return s.sequence == next.sequence && s.layer == next.layer;
    });
    if (conflict) break;
    batch.push_back(next);
    queue_.pop_front();
    --queued_shards_;
  }
  queue_size_.store(static_cast<int>(queue_.size()), std::memory_order_release);
  return batch;
}

void DeviceWorker::LaunchLoop() {
  if (absl::Status s = device_->BindThread(); !s.ok()) Fault(s);
  const int max_items = options_.batch_buckets.back();
  mu_.Lock();
  while (true) {
    if (queue_.empty() && !stopping_ && options_.spin > absl::ZeroDuration()) {
      // Poll for a while before sleeping: a call that arrives within the
      // spin starts without a wake-up.
      mu_.Unlock();
      const absl::Time until = absl::Now() + options_.spin;
      while (queue_size_.load(std::memory_order_acquire) == 0 && absl::Now() < until) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
      mu_.Lock();
    }
    mu_.Await(absl::Condition(
        +[](DeviceWorker* w)
             ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return w->stopping_ || !w->queue_.empty(); },
        this));
    if (queue_.empty()) break;  // stopping, and everything queued has run
    if (queue_.front().is_op) {
      DeviceOp op = std::move(queue_.front().op);
      queue_.pop_front();
      queue_size_.store(static_cast<int>(queue_.size()), std::memory_order_release);
      mu_.Unlock();
      RunOp(std::move(op));
      mu_.Lock();
      continue;
    }
    // The next batch is whatever has queued by the time a staging set is
    // free (while the previous batches run), plus, with a queue delay, what
    // arrives within it.
    mu_.Await(absl::Condition(
        +[](DeviceWorker* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) {
          return !w->free_sets_.empty() || !w->fault_.ok();
        },
        this));
    if (options_.max_queue_delay > absl::ZeroDuration() && queued_shards_ < max_items) {
      struct Full {
        DeviceWorker* w;
        int max;
        static bool Eval(Full* f) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return f->w->stopping_ || f->w->queued_shards_ >= f->max;
        }
      } full{this, max_items};
      mu_.AwaitWithTimeout(absl::Condition(&Full::Eval, &full), options_.max_queue_delay);
    }
    std::vector<VerifyShard> batch = TakeBatch();
    mu_.Unlock();
    RunBatch(std::move(batch), absl::Now());
    mu_.Lock();
  }
  launch_done_ = true;
  mu_.Unlock();
}

void DeviceWorker::RunOp(DeviceOp op) {
  if (op.admit) {
    const absl::Status admitted = op.admit();
    if (!admitted.ok()) {
      op.done(admitted);
      return;
    }
  }
  if (absl::Status f = fault(); !f.ok()) {
    op.done(f);
    return;
  }
  absl::Status status;
  switch (op.kind) {
    case DeviceOp::Kind::kWriteRows:
      status = device_->WriteRows(op.page_table, op.start, op.count, op.rows_in);
      break;
    case DeviceOp::Kind::kReadRows:
      status = device_->ReadRows(op.page_table, op.start, op.count, op.rows_out);
      break;
    case DeviceOp::Kind::kCompact:
      status = device_->Compact(op.page_table, op.prefix_len, op.accepted);
      break;
    case DeviceOp::Kind::kBarrier:
      // Everything queued before it has been issued to the device; what is
      // issued after runs after it (one stream, or a synchronous device).
      break;
  }
  if (!status.ok()) {
    plan_.Clear();
    Fault(status);
    status = fault();
  }
  op.done(status);
}

void DeviceWorker::RunBatch(std::vector<VerifyShard> shards, absl::Time taken) {
  ShardTiming timing;
  timing.taken = taken;
  std::vector<VerifyShard> batch;
  batch.reserve(shards.size());
  for (const VerifyShard& s : shards) {
    const absl::Status admitted = s.owner->AdmitShard(s.index);
    if (admitted.ok()) {
      batch.push_back(s);
    } else {
      s.owner->ShardDone(s.index, admitted, timing);
    }
  }
  if (batch.empty()) return;
  int set = -1;
  bool previous_running = false;
  {
    absl::MutexLock lock(&mu_);
    if (fault_.ok()) {
      // Oldest free set first: sets are used in turn.
      set = free_sets_.front();
      free_sets_.erase(free_sets_.begin());
      previous_running = running_batches_ > 0;
    }
  }
  if (set < 0) {
    FailShards(batch, fault(), timing);
    return;
  }

  const int requests = static_cast<int>(batch.size());
  int max_draft = 0;
  int rows = 0;
  for (const VerifyShard& s : batch) {
    max_draft = std::max(max_draft, static_cast<int>(s.draft_len));
    rows += s.draft_len;
  }
  std::optional<BatchShape> bucket;
  if (uses_graphs_) {
    bucket = ChooseBucket(options_.batch_buckets, options_.draft_buckets, requests, max_draft);
  }
  const bool graph = bucket.has_value();
  const BatchShape shape = graph ? *bucket : BatchShape{requests, max_draft};
  const StagingView v = device_->Staging(set, shape);
  const int heads = geometry_.num_heads;

  // Per-request scalars, page tables and visibility words: small, on this
  // thread. Padding requests have no drafts and read nothing.
  // Staging may be write-combined memory: written once, never read back
  // (the per-request arrays are built here and copied).
  std::vector<int> first_row(requests);
  std::vector<int32_t> prefix(shape.batch, 0), drafts(shape.batch, 0), layers(shape.batch, 0);
  std::vector<float> scales(shape.batch, batch[0].scale);
  int row = 0;
  for (int b = 0; b < requests; ++b) {
    const VerifyShard& s = batch[b];
    first_row[b] = row;
    prefix[b] = s.prefix_len;
    drafts[b] = s.draft_len;
    layers[b] = s.layer;
    scales[b] = s.scale;
    std::memcpy(v.page_table(b), s.page_table.data(), s.page_table.size() * sizeof(int32_t));
    std::memcpy(v.visibility() + row, s.visibility, s.draft_len * sizeof(uint64_t));
    row += s.draft_len;
  }
  std::memcpy(v.prefix_len(), prefix.data(), shape.batch * sizeof(int32_t));
  std::memcpy(v.draft_len(), drafts.data(), shape.batch * sizeof(int32_t));
  std::memcpy(v.layer(), layers.data(), shape.batch * sizeof(int32_t));
  std::memcpy(v.scale(), scales.data(), shape.batch * sizeof(float));
  // The tensors: this device's heads of each token's queries, and the drafts' rows.
  const size_t q_row_bytes = static_cast<size_t>(heads) * kLatentDim * sizeof(Bf16);
  auto pack = [&](int k) {
    const VerifyShard& s = batch[k];
    if (s.device_resident) return;  // copied on the device (below)
    Bf16* q = v.q() + static_cast<int64_t>(first_row[k]) * heads * kLatentDim;
    if (s.q_token_stride == static_cast<int64_t>(heads) * kLatentDim) {
      std::memcpy(q, s.q, s.draft_len * q_row_bytes);
    } else {
      for (int i = 0; i < s.draft_len; ++i) {
        std::memcpy(q + static_cast<int64_t>(i) * heads * kLatentDim, s.q + i * s.q_token_stride,
                    q_row_bytes);
      }
    }
    std::memcpy(v.draft_kv() + static_cast<int64_t>(first_row[k]) * kLatentDim, s.draft_kv,
                static_cast<size_t>(s.draft_len) * kLatentRowBytes);
  };
  if (static_cast<size_t>(rows) * (q_row_bytes + kLatentRowBytes) >= kParallelCopyBytes) {
    pack_runner_.Run(requests, pack);
  } else {
    for (int k = 0; k < requests; ++k) pack(k);
  }

  // Device-resident shards: their rows are copied device to device, after
  // the staged inputs and after the attention.
  std::vector<DeviceCopy> in_copies, out_copies;
  for (int k = 0; k < requests; ++k) {
    const VerifyShard& s = batch[k];
    if (!s.device_resident) continue;
    const size_t row = static_cast<size_t>(first_row[k]);
    const size_t n = static_cast<size_t>(s.draft_len);
    const size_t q_row = static_cast<size_t>(heads) * kLatentDim * sizeof(Bf16);
    in_copies.push_back({v.layout.q + row * q_row, q_row, const_cast<Bf16*>(s.q),
                         static_cast<size_t>(s.q_token_stride) * sizeof(Bf16), q_row, n});
    in_copies.push_back({v.layout.draft_kv + row * kLatentRowBytes, kLatentRowBytes,
                         const_cast<Bf16*>(s.draft_kv), kLatentRowBytes, kLatentRowBytes, n});
    const size_t out_row = static_cast<size_t>(heads) * kValueDim * sizeof(Bf16);
    out_copies.push_back({v.layout.out + row * out_row, out_row, s.out,
                          static_cast<size_t>(s.out_token_stride) * sizeof(Bf16), out_row, n});
    const size_t lse_row = static_cast<size_t>(heads) * sizeof(float);
    out_copies.push_back({v.layout.lse + row * lse_row, lse_row, s.lse,
                          static_cast<size_t>(s.lse_token_stride) * sizeof(float), lse_row, n});
  }

  LaunchOptions launch;
  launch.set = set;
  launch.shape = shape;
  launch.graph = graph;
  launch.inputs_from_device = in_copies;
  launch.outputs_to_device = out_copies;
  launch.reuse_plan = plan_.Matches(shape, prefix, drafts);
  launch.overlap_input = options_.overlap_inputs && previous_running;
  const absl::Time packed = absl::Now();
  const absl::Status launched = device_->Launch(launch);
  const absl::Time issued = absl::Now();
  if (!launched.ok()) {
    plan_.Clear();
    Fault(launched);
    FailShards(batch, fault(), timing);
    absl::MutexLock lock(&mu_);
    free_sets_.push_back(set);
    return;
  }
  plan_.Record(shape, prefix, drafts);

  InFlight f;
  f.set = set;
  f.shape = shape;
  f.shards = std::move(batch);
  f.first_row = std::move(first_row);
  f.taken = taken;
  f.report.device = index_;
  f.report.requests = requests;
  f.report.rows = rows;
  f.report.shape = shape;
  f.report.graph = graph;
  f.report.reused_plan = launch.reuse_plan;
  f.report.overlapped_input = launch.overlap_input;
  f.report.pack_seconds = absl::ToDoubleSeconds(packed - taken);
  f.report.launch_seconds = absl::ToDoubleSeconds(issued - packed);
  absl::MutexLock lock(&mu_);
  in_flight_.push_back(std::move(f));
  ++running_batches_;
}

void DeviceWorker::CompletionLoop() {
  if (absl::Status s = device_->BindThread(); !s.ok()) Fault(s);
  const int heads = geometry_.num_heads;
  while (true) {
    InFlight f;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](DeviceWorker* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) {
            return w->launch_done_ || !w->in_flight_.empty();
          },
          this));
      if (in_flight_.empty()) return;
      f = std::move(in_flight_.front());
      in_flight_.pop_front();
    }
    ShardTiming timing;
    timing.taken = f.taken;
    timing.batch_requests = f.report.requests;
    absl::StatusOr<double> seconds = device_->Wait(f.set);
    const absl::Time finished = absl::Now();
    {
      absl::MutexLock lock(&mu_);
      --running_batches_;
    }
    absl::Status status;
    if (!seconds.ok()) {
      // The launch thread sees the fault before its next launch (and its
      // plan fingerprint no longer matters).
      Fault(seconds.status());
      status = fault();
    } else {
      timing.device_seconds = *seconds;
      const StagingView v = device_->Staging(f.set, f.shape);
      const size_t out_row_bytes = static_cast<size_t>(heads) * kValueDim * sizeof(Bf16);
      auto unpack = [&](int k) {
        const VerifyShard& s = f.shards[k];
        if (s.device_resident) return;  // the device copied its outputs
        const int64_t row = f.first_row[k];
        const Bf16* out = v.out() + row * heads * kValueDim;
        const float* lse = v.lse() + row * heads;
        if (s.out_token_stride == static_cast<int64_t>(heads) * kValueDim &&
            s.lse_token_stride == heads) {
          std::memcpy(s.out, out, s.draft_len * out_row_bytes);
          std::memcpy(s.lse, lse, static_cast<size_t>(s.draft_len) * heads * sizeof(float));
        } else {
          for (int i = 0; i < s.draft_len; ++i) {
            std::memcpy(s.out + i * s.out_token_stride,
                        out + static_cast<int64_t>(i) * heads * kValueDim, out_row_bytes);
            std::memcpy(s.lse + i * s.lse_token_stride, lse + static_cast<int64_t>(i) * heads,
                        heads * sizeof(float));
          }
        }
      };
      const int shards = static_cast<int>(f.shards.size());
      if (static_cast<size_t>(f.report.rows) * out_row_bytes >= kParallelCopyBytes) {
        unpack_runner_.Run(shards, unpack);
      } else {
        for (int k = 0; k < shards; ++k) unpack(k);
      }
      f.report.device_seconds = *seconds;
      f.report.unpack_seconds = absl::ToDoubleSeconds(absl::Now() - finished);
      if (observer_ != nullptr) observer_->OnBatch(f.report);
    }
    {
      // The outputs are out of staging: the set may take the next batch.
      absl::MutexLock lock(&mu_);
      free_sets_.push_back(f.set);
    }
    // Completions run the callers' callbacks (finishing RPCs): spread over
    // the copy threads for large batches.
    const int n = static_cast<int>(f.shards.size());
    auto complete = [&](int k) { f.shards[k].owner->ShardDone(f.shards[k].index, status, timing); };
    if (n >= 8) {
      unpack_runner_.Run(n, complete);
    } else {
      for (int k = 0; k < n; ++k) complete(k);
    }
  }
}

}  // namespace mlaverify::engine
