#include "server/engine/device_worker.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/geometry.h"
#include "spdlog/spdlog.h"

namespace mlaverify::engine {

namespace {

// Below this many bytes copied out a batch completes on the device thread
// alone.
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
      completion_runner_(options.copy_threads) {}

DeviceWorker::~DeviceWorker() { Stop(); }

absl::Status DeviceWorker::Start(const DeviceGeometry& geometry) {
  geometry_ = geometry;
  if (absl::Status s = device_->BindThread(); !s.ok()) return s;
  if (absl::Status s = device_->Init(geometry); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(name_, ": ", s.message()));
  }
  asynchronous_ = device_->asynchronous();
  target_.buffers = &device_->buffers();
  target_.num_heads = geometry.num_heads;
  target_.num_layers = geometry.num_layers;
  target_.num_pages = geometry.num_pages;
  target_.page_size = geometry.page_size;
  target_.kv_dtype = geometry.kv_dtype;
  // The launch thread launches where no submitting thread may: on a device
  // whose launches compute (the CPU backend), and when a queue delay holds
  // partial batches back.
  launch_thread_launches_ = !asynchronous_ || options_.max_queue_delay > absl::ZeroDuration();
  {
    absl::MutexLock lock(&launch_mu_);
    tables_ = std::make_unique<PageTableArena>(geometry.table_entries);
  }
  uses_graphs_ = options_.use_graphs && device_->SupportsGraphs();
  if (uses_graphs_) {
    const absl::Time begin = absl::Now();
    int64_t graph_bytes = 0;
    int graphs = 0;
    for (int b : options_.batch_buckets) {
      for (int n : options_.draft_buckets) {
        absl::StatusOr<int64_t> bytes = device_->CaptureGraphs(BatchShape{b, n});
        if (!bytes.ok()) {
          return absl::Status(bytes.status().code(),
                              absl::StrCat(name_, ": capturing the graph of batch ", b, " x draft ",
                                           n, ": ", bytes.status().message()));
        }
        graph_bytes += *bytes;
        ++graphs;
      }
    }
    spdlog::info(
        "{}: captured the verify graphs of {} buckets in {:.3f} s, {:.1f} MiB of device "
        "memory",
        name_, graphs, absl::ToDoubleSeconds(absl::Now() - begin),
        static_cast<double>(graph_bytes) / (1 << 20));
  } else {
    spdlog::info("{}: no CUDA graphs ({}): every batch is launched eagerly", name_,
                 options_.use_graphs ? "the device has none" : "disabled");
  }
  launch_thread_ = std::thread([this] { LaunchThreadLoop(); });
  device_thread_ = std::thread([this] { DeviceLoop(); });
  if (options_.completion_thread) completion_thread_ = std::thread([this] { CompletionLoop(); });
  started_ = true;
  return absl::OkStatus();
}

void DeviceWorker::Stop() {
  if (!started_) return;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  // Whatever is still queued is launched (or failed) before the threads end.
  if (!launch_thread_launches_) LaunchWhilePossible();
  launch_thread_.join();
  device_thread_.join();
  if (completion_thread_.joinable()) completion_thread_.join();
  started_ = false;
}

void DeviceWorker::Enqueue(VerifyShard shard) {
  Entry e;
  e.shard = std::move(shard);
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(e));
  ++queued_shards_;
  queue_size_.store(static_cast<int>(queue_.size()), std::memory_order_release);
}

void DeviceWorker::Enqueue(DeviceOp op) {
  Entry e;
  e.is_op = true;
  e.op = std::move(op);
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(e));
  queue_size_.store(static_cast<int>(queue_.size()), std::memory_order_release);
}

void DeviceWorker::Kick() {
  // The launch thread waits on a condition of mu_'s state: it re-evaluates
  // on its own. Polling (options_.poll_launches), on a busy device the
  // device thread launches; otherwise the submitter launches while a slot is
  // free, and with every slot taken the device thread launches once the
  // oldest ends. The fence orders this thread's enqueue before its look at
  // the launches in flight, as the device thread orders the other way round
  // (so one of the two always sees the other's work).
  if (launch_thread_launches_) return;
  // Nothing queued (this worker got none of the call's work, or a launcher
  // already took it): nothing to launch, and no fence to pay.
  if (queue_size_.load(std::memory_order_acquire) == 0) return;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  const int busy_at = options_.poll_launches ? 1 : geometry_.slots;
  if (in_flight_size_.load(std::memory_order_seq_cst) >= busy_at) return;
  LaunchWhilePossible();
}

absl::Status DeviceWorker::fault() const {
  if (!faulted_.load(std::memory_order_acquire)) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  return fault_;
}

void DeviceWorker::Fault(const absl::Status& status) {
  absl::Status recorded;
  {
    absl::MutexLock lock(&mu_);
    if (!fault_.ok()) return;
    fault_ = absl::InternalError(absl::StrCat("device ", name_, " faulted: ", status.message()));
    faulted_.store(true, std::memory_order_release);
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

bool DeviceWorker::Launchable() const {
  if (queue_.empty()) return false;
  if (!fault_.ok()) return true;  // to fail it
  const Entry& head = queue_.front();
  // (Neither takes a slot.)
  if (head.is_op &&
      (head.op.kind == DeviceOp::Kind::kBarrier || head.op.kind == DeviceOp::Kind::kStep)) {
    return true;
  }
  return static_cast<int>(in_flight_.size()) < geometry_.slots;
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
    batch.push_back(std::move(queue_.front().shard));
    queue_.pop_front();
    --queued_shards_;
  }
  queue_size_.store(static_cast<int>(queue_.size()), std::memory_order_release);
  return batch;
}

void DeviceWorker::LaunchWhilePossible() {
  while (true) {
    if (!launch_mu_.TryLock()) return;  // the holder launches what is queued
    LaunchQueued();
    launch_mu_.Unlock();
    // Work enqueued while the lock was held, whose submitter found it held.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (queue_size_.load(std::memory_order_seq_cst) == 0) return;
    absl::MutexLock lock(&mu_);
    if (!Launchable()) return;
  }
}

void DeviceWorker::LaunchQueued() {
  while (true) {
    std::vector<VerifyShard> batch;
    DeviceOp op;
    bool is_op = false;
    // Only after a fault (an empty std::deque allocates: not per launch).
    std::optional<std::deque<Entry>> failed;
    absl::Status fault;
    {
      absl::MutexLock lock(&mu_);
      if (!Launchable()) return;
      launching_ = true;
      if (!fault_.ok()) {
        failed.emplace().swap(queue_);
        queued_shards_ = 0;
        fault = fault_;
      } else if (queue_.front().is_op) {
        op = std::move(queue_.front().op);
        queue_.pop_front();
        is_op = true;
      } else {
        batch = TakeBatch();
      }
      queue_size_.store(static_cast<int>(queue_.size()), std::memory_order_release);
    }
    if (failed.has_value()) {
      // After a fault every piece of work fails with it (table changes no
      // longer matter: the device is not used again).
      ShardTiming timing;
      timing.taken = absl::Now();
      for (Entry& e : *failed) {
        if (e.is_op) {
          if (e.op.done) e.op.done(fault);
        } else {
          e.shard.owner->ShardDone(e.shard.index, fault, timing);
        }
      }
    } else if (is_op) {
      RunOp(std::move(op));
    } else {
      RunBatch(std::move(batch), absl::Now());
    }
    absl::MutexLock lock(&mu_);
    launching_ = false;
  }
}

void DeviceWorker::ApplyTable(uint64_t sequence, const std::shared_ptr<const TableDelta>& delta,
                              bool release) {
  if (delta != nullptr) {
    if (absl::Status s = tables_->Apply(sequence, *delta); !s.ok()) Fault(s);
  }
  if (release) tables_->Release(sequence);
}

absl::Status DeviceWorker::BeginSlot(int slot, SlotWriter* w) {
  const bool full = tables_->needs_full_upload();
  tables_->TakeWrites(&writes_, &values_);
  const SlotLayout& l = geometry_.slot;
  bool fits = !full && static_cast<int64_t>(values_.size()) <= l.value_capacity &&
              static_cast<int>(writes_.size()) <= MaxTableWrites(geometry_.max_batch);
  if (fits) {
    std::copy(values_.begin(), values_.end(), w->Host<int32_t>(l.values));
    const uint64_t table = device_->buffers().table;
    for (const TableWrite& t : writes_) {
      const uint64_t src = t.from >= 0 ? table + 4 * static_cast<uint64_t>(t.from)
                                       : w->Device(l.values) + 4 * static_cast<uint64_t>(t.value);
      fits = fits && w->Gather(src, 0, table + 4 * static_cast<uint64_t>(t.at), 0,
                               static_cast<uint32_t>(4 * t.count), 1);
    }
  }
  if (fits) return absl::OkStatus();
  // A compaction of the arena, or more changes than a slot holds: the whole
  // arena goes up, in stream order, before this launch.
  spdlog::info("{}: uploading the whole page-table arena ({} of {} entries in use)", name_,
               tables_->used_entries(), tables_->entries());
  w->Reset();
  return device_->UploadTable(tables_->Snapshot());
}

void DeviceWorker::PushInFlight(InFlight f) {
  ++launch_count_;
  absl::MutexLock lock(&mu_);
  in_flight_.push_back(std::move(f));
  in_flight_size_.store(static_cast<int>(in_flight_.size()), std::memory_order_release);
}

void DeviceWorker::RunBatch(std::vector<VerifyShard> shards, absl::Time taken) {
  ShardTiming timing;
  timing.taken = taken;
  // The page tables follow every shard taken, whether it runs or not: the
  // engine's next changes are relative to them.
  for (const VerifyShard& s : shards) ApplyTable(s.sequence, s.table, false);
  std::vector<VerifyShard> batch;
  batch.reserve(shards.size());
  for (VerifyShard& s : shards) {
    const absl::Status admitted = s.owner->AdmitShard(s.index);
    if (admitted.ok()) {
      batch.push_back(std::move(s));
    } else {
      s.owner->ShardDone(s.index, admitted, timing);
    }
  }
  if (batch.empty()) return;
  if (absl::Status f = fault(); !f.ok()) {
    FailShards(batch, f, timing);
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
  const SlotLayout& l = geometry_.slot;
  const DeviceBuffers& buf = device_->buffers();
  const int slot = NextSlot();
  const uint64_t slot_device = buf.slots + static_cast<uint64_t>(slot) * l.bytes;
  SlotWriter w(device_->slot(slot), slot_device, l,
               GatherCapacity(shape, geometry_.page_size, geometry_.max_batch));
  absl::Status status = BeginSlot(slot, &w);

  // The requests as the slot describes them (padding: PackBatch).
  std::vector<int32_t> prefix_now(shape.batch, 0), drafts_now(shape.batch, 0);
  packed_.resize(batch.size());
  const int64_t page_size = geometry_.page_size;
  for (size_t b = 0; b < batch.size() && status.ok(); ++b) {
    const VerifyShard& s = batch[b];
    int64_t offset = -1;
    const std::vector<int32_t>* pages = tables_->Entries(s.sequence, &offset);
    const int64_t needed =
        (static_cast<int64_t>(s.prefix_len) + s.draft_len + page_size - 1) / page_size;
    if (offset < 0 || pages == nullptr || static_cast<int64_t>(pages->size()) < needed) {
      status = absl::InternalError(absl::StrCat("sequence ", s.sequence, " has ",
                                                pages == nullptr ? 0 : pages->size(),
                                                " pages on the device, its batch needs ", needed));
      break;
    }
    prefix_now[b] = s.prefix_len;
    drafts_now[b] = s.draft_len;
    PackedRequest& p = packed_[b];
    p.prefix_len = s.prefix_len;
    p.draft_len = s.draft_len;
    p.layer = s.layer;
    p.scale = s.scale;
    p.table_offset = offset;
    p.pages = pages->data();
    p.visibility = s.visibility;
    p.q = s.q;
    p.draft_kv = s.draft_kv;
    p.out = s.out;
    p.lse = s.lse;
  }
  if (status.ok()) status = PackBatch(w, target_, shape, packed_);
  if (!status.ok()) {
    Fault(status);
    FailShards(batch, fault(), timing);
    return;
  }
  w.Close();

  LaunchOptions launch;
  launch.slot = slot;
  launch.shape = shape;
  launch.graph = graph;
  launch.reuse_plan = plan_.Matches(shape, prefix_now, drafts_now);
  const absl::Time packed = absl::Now();
  const absl::Status launched = device_->Launch(launch);
  const absl::Time issued = absl::Now();
  if (!launched.ok()) {
    plan_.Clear();
    Fault(launched);
    FailShards(batch, fault(), timing);
    return;
  }
  plan_.Record(shape, prefix_now, drafts_now);

  InFlight f;
  f.slot = slot;
  f.shards = std::move(batch);
  f.taken = taken;
  f.report.device = index_;
  f.report.requests = requests;
  f.report.rows = rows;
  f.report.shape = shape;
  f.report.graph = graph;
  f.report.reused_plan = launch.reuse_plan;
  f.report.copy_descriptors = w.gathers() + w.outputs();
  f.report.pack_seconds = absl::ToDoubleSeconds(packed - taken);
  f.report.launch_seconds = absl::ToDoubleSeconds(issued - packed);
  PushInFlight(std::move(f));
}

void DeviceWorker::RunOp(DeviceOp op) {
  ApplyTable(op.sequence, op.table, op.release_table);
  auto finish = [&op](const absl::Status& status) {
    if (op.done) op.done(status);
  };
  if (op.admit) {
    const absl::Status admitted = op.admit();
    if (!admitted.ok()) {
      finish(admitted);
      return;
    }
  }
  if (absl::Status f = fault(); !f.ok()) {
    finish(f);
    return;
  }
  if (op.kind == DeviceOp::Kind::kBarrier) {
    // Everything queued before it has been launched; what is launched after
    // runs after it (one stream, or a synchronous device).
    finish(absl::OkStatus());
    return;
  }
  if (op.kind == DeviceOp::Kind::kStep) {
    // The lane waits for everything launched before this point, then runs
    // its layers as they are rung, beside what is launched after.
    absl::Status started = device_->LaunchStep(op.step);
    if (!started.ok()) {
      Fault(started);
      started = fault();
    }
    finish(started);
    return;
  }
  const SlotLayout& l = geometry_.slot;
  const int slot = NextSlot();
  const uint64_t slot_device = device_->buffers().slots + static_cast<uint64_t>(slot) * l.bytes;
  SlotWriter w(device_->slot(slot), slot_device, l, l.list_capacity);
  absl::Status status = BeginSlot(slot, &w);
  const int64_t offset = tables_->OffsetOf(op.sequence);
  if (status.ok() && offset < 0) {
    status = absl::InternalError(
        absl::StrCat("sequence ", op.sequence, " has no page table on device ", name_));
  }
  if (status.ok() && op.kind == DeviceOp::Kind::kCompact) {
    auto* params = w.Host<int32_t>(l.op);
    params[0] = static_cast<int32_t>(op.prefix_len);
    params[1] = static_cast<int32_t>(op.accepted.size());
    std::copy(op.accepted.begin(), op.accepted.end(), params + 2);
  }
  w.Close();
  if (status.ok()) {
    switch (op.kind) {
      case DeviceOp::Kind::kWriteRows:
        status =
            device_->LaunchWriteRows(slot, w.gathers(), offset, op.start, op.count, op.rows_in);
        break;
      case DeviceOp::Kind::kCompact:
        status = device_->LaunchCompact(slot, w.gathers(), offset);
        break;
      case DeviceOp::Kind::kReadRows:
        // Synchronous (tests): the table writes, then the rows.
        status = device_->LaunchGather(slot, w.gathers());
        if (status.ok()) {
          ++launch_count_;
          status = device_->Wait(slot).status();
        }
        if (status.ok()) status = device_->ReadRows(offset, op.start, op.count, op.rows_out);
        if (!status.ok()) {
          Fault(status);
          status = fault();
        }
        finish(status);
        return;
      case DeviceOp::Kind::kBarrier:
      case DeviceOp::Kind::kStep:
        break;
    }
  }
  if (!status.ok()) {
    Fault(status);
    finish(fault());
    return;
  }
  InFlight f;
  f.slot = slot;
  f.is_op = true;
  f.op = std::move(op);
  f.taken = absl::Now();
  PushInFlight(std::move(f));
}

void DeviceWorker::LaunchThreadLoop() {
  if (absl::Status s = device_->BindThread(); !s.ok()) Fault(s);
  const int max_items = options_.batch_buckets.back();
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      struct Ready {
        DeviceWorker* w;
        static bool Eval(Ready* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          DeviceWorker* w = r->w;
          if (!w->launch_thread_launches_) return w->stopping_;
          return w->Launchable() || (w->stopping_ && w->queue_.empty());
        }
      } ready{this};
      mu_.Await(absl::Condition(&Ready::Eval, &ready));
      if (!launch_thread_launches_ || !Launchable()) break;  // stopping, nothing left
      if (options_.max_queue_delay > absl::ZeroDuration() && queued_shards_ < max_items &&
          !queue_.front().is_op) {
        // Hold a partial batch open for more items, at most the delay.
        struct Full {
          DeviceWorker* w;
          int max;
          static bool Eval(Full* f) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return f->w->stopping_ || f->w->queued_shards_ >= f->max;
          }
        } full{this, max_items};
        mu_.AwaitWithTimeout(absl::Condition(&Full::Eval, &full), options_.max_queue_delay);
      }
    }
    absl::MutexLock launch(&launch_mu_);
    LaunchQueued();
  }
  absl::MutexLock lock(&mu_);
  launch_thread_done_ = true;
}

void DeviceWorker::DeviceLoop() {
  if (absl::Status s = device_->BindThread(); !s.ok()) Fault(s);
  // The device thread launches on a busy asynchronous device (Kick leaves it
  // the work then), polling the oldest launch meanwhile.
  const bool launches = !launch_thread_launches_;
  while (true) {
    if (launches) LaunchWhilePossible();
    int slot = 0;
    {
      absl::MutexLock lock(&mu_);
      struct Work {
        DeviceWorker* w;
        static bool Eval(Work* k) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          DeviceWorker* w = k->w;
          if (!w->in_flight_.empty()) return true;
          // (Nothing in flight: queued work is launched by its submitter.)
          // Stopping: nothing queued and nothing being launched, and the
          // launch thread (where it launches) gone.
          return w->stopping_ && w->queue_.empty() && !w->launching_ &&
                 (!w->launch_thread_launches_ || w->launch_thread_done_);
        }
      } work{this};
      mu_.Await(absl::Condition(&Work::Eval, &work));
      if (in_flight_.empty()) break;  // stopping
      slot = in_flight_.front().slot;
    }
    // While the oldest launch runs, what queues behind it goes out as soon
    // as a slot is free (polling); otherwise its submitters launched it, or
    // it waits for the slot this wait frees.
    if (launches && options_.poll_launches) {
      while (!device_->Finished(slot)) {
        if (queue_size_.load(std::memory_order_acquire) > 0 &&
            in_flight_size_.load(std::memory_order_acquire) < geometry_.slots) {
          LaunchWhilePossible();
        }
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
    }
    absl::StatusOr<double> seconds = device_->Wait(slot);
    InFlight f;
    {
      absl::MutexLock lock(&mu_);
      f = std::move(in_flight_.front());
      in_flight_.pop_front();
      in_flight_size_.store(static_cast<int>(in_flight_.size()), std::memory_order_seq_cst);
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);  // see Kick
    f.finished = absl::Now();
    if (!seconds.ok()) Fault(seconds.status());
    f.device_seconds = std::move(seconds);
    // The slot is free: launch what queued meanwhile before completing this
    // launch's calls, so the device does not wait for them.
    if (launches) LaunchWhilePossible();
    if (!options_.completion_thread) {
      Complete(f);
      continue;
    }
    {
      absl::MutexLock lock(&done_mu_);
      // Nothing else to do (no launch in flight, nothing queued) and nothing
      // handed over still being completed: completing it here saves the
      // hand-off's wake-up, in order all the same.
      const bool alone = finished_.empty() && !completing_ &&
                         in_flight_size_.load(std::memory_order_acquire) == 0 &&
                         queue_size_.load(std::memory_order_acquire) == 0;
      if (!alone) {
        finished_.push_back(std::move(f));
        continue;
      }
      // Held so that the completion thread's next batch waits for this one.
      completing_ = true;
    }
    Complete(f);
    absl::MutexLock lock(&done_mu_);
    completing_ = false;
  }
  absl::MutexLock lock(&done_mu_);
  device_thread_done_ = true;
}

void DeviceWorker::CompletionLoop() {
  std::deque<InFlight> batch;
  while (true) {
    {
      absl::MutexLock lock(&done_mu_);
      struct Work {
        DeviceWorker* w;
        static bool Eval(Work* k) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return (!k->w->finished_.empty() && !k->w->completing_) || k->w->device_thread_done_;
        }
      } work{this};
      done_mu_.Await(absl::Condition(&Work::Eval, &work));
      if (finished_.empty()) return;  // the device thread ended
      // Everything handed over so far, in one go: one wake-up however many.
      batch.swap(finished_);
      completing_ = true;
    }
    for (InFlight& f : batch) Complete(f);
    batch.clear();
    absl::MutexLock lock(&done_mu_);
    completing_ = false;
  }
}

void DeviceWorker::Complete(InFlight& f) {
  const absl::Time started = absl::Now();
  const absl::StatusOr<double>& seconds = f.device_seconds;
  const absl::Status status = seconds.ok() ? absl::OkStatus() : fault();
  if (f.is_op) {
    if (f.op.done) f.op.done(status);
    return;
  }
  ShardTiming timing;
  timing.taken = f.taken;
  timing.batch_requests = f.report.requests;
  timing.device_seconds = seconds.ok() ? *seconds : 0;
  // Completions run the callers' callbacks (copying staged outputs out and
  // finishing RPCs): spread over the copy threads when they copy much
  // (waking the helpers costs more than a few small completions).
  const int n = static_cast<int>(f.shards.size());
  size_t copy_bytes = 0;
  for (const VerifyShard& shard : f.shards) copy_bytes += shard.copy_out_bytes;
  auto complete = [&](int k) { f.shards[k].owner->ShardDone(f.shards[k].index, status, timing); };
  if (n >= 8 && copy_bytes >= kParallelCopyBytes) {
    completion_runner_.Run(n, complete);
  } else {
    for (int k = 0; k < n; ++k) complete(k);
  }
  if (seconds.ok()) {
    const absl::Time done = absl::Now();
    f.report.device_seconds = *seconds;
    f.report.handoff_seconds = absl::ToDoubleSeconds(started - f.finished);
    f.report.unpack_seconds = absl::ToDoubleSeconds(done - started);
    if (observer_ != nullptr) observer_->OnBatch(f.report);
  }
}

}  // namespace mlaverify::engine
