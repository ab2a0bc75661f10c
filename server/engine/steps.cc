#include "server/engine/steps.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/draft_tree.h"
#include "common/geometry.h"
#include "common/host_doorbell.h"
#include "common/log_fields.h"
#include "common/status_macros.h"
#include "server/engine/batch_plan.h"
#include "server/engine/slot_writer.h"
#include "spdlog/spdlog.h"

namespace mlaverify::engine {

const char* StepStateName(StepState state) {
  switch (state) {
    case StepState::kRunning:
      return "running";
    case StepState::kLayersDone:
      return "layers_done";
    case StepState::kAborting:
      return "aborting";
    case StepState::kCommitted:
      return "committed";
    case StepState::kAborted:
      return "aborted";
  }
  return "unknown";
}

bool StepEnded(StepState state) {
  return state == StepState::kCommitted || state == StepState::kAborted;
}

const char* StepAbortReasonName(StepAbortReason reason) {
  switch (reason) {
    case StepAbortReason::kNone:
      return "none";
    case StepAbortReason::kAbortCall:
      return "abort_call";
    case StepAbortReason::kLayerTimeout:
      return "layer_timeout";
    case StepAbortReason::kDeadline:
      return "deadline";
    case StepAbortReason::kSequenceReleased:
      return "sequence_released";
    case StepAbortReason::kDeviceFault:
      return "device_fault";
    case StepAbortReason::kLaneStopped:
      return "lane_stopped";
    case StepAbortReason::kShutdown:
      return "shutdown";
  }
  return "unknown";
}

namespace {

// How often the watcher looks at the open steps: often enough that a Commit
// waiting for the last layer goes on within it, rarely enough to cost
// nothing next to a layer; timeouts are milliseconds and up.
constexpr absl::Duration kPollWhileWaiting = absl::Microseconds(100);
constexpr absl::Duration kPollInterval = absl::Milliseconds(1);

// Bytes of one layer's tensor of an item with `n` drafts over `heads` heads.
struct LayerBytes {
  uint64_t q, draft_kv, out, lse;
};
LayerBytes BytesOf(int64_t n, int heads) {
  const uint64_t nh = static_cast<uint64_t>(n) * heads;
  return {nh * kLatentRowBytes, static_cast<uint64_t>(n) * kLatentRowBytes,
          nh * kValueDim * sizeof(Bf16), nh * sizeof(float)};
}

}  // namespace

struct StepRunner::Rank {
  int device = 0;
  int lane = -1;
  StepLaunch launch;
  StepRankDoorbell doorbell;
  // Where each item's tensors are on this rank's device (layer 0) and their
  // layer strides.
  struct Tensors {
    uint64_t q = 0, draft_kv = 0, out = 0, lse = 0;
    uint64_t q_stride = 0, draft_kv_stride = 0, out_stride = 0, lse_stride = 0;
  };
  std::vector<Tensors> items;
  HostSlot host_doorbell, host_completion;  // host doorbells
  bool launch_done = false;                 // the worker started the lane (or failed to)
  bool started = false;
  int layers_done = 0;
  bool drained = false;
};

struct StepRunner::Step {
  uint64_t id = 0;
  std::vector<StepItemSpec> items;
  std::vector<Rank> ranks;
  int num_layers = 0;
  absl::Duration layer_timeout;
  absl::Time opened, deadline, last_progress, layers_done_at;
  StepState state = StepState::kRunning;
  StepAbortReason abort_reason = StepAbortReason::kNone;
  absl::Status status;
  std::vector<bool> committed;
  int items_committed = 0;
  int layers_done = 0;
  // Every region the step references, held (not unregistrable) for its life.
  RegionLeases leases;
  std::vector<absl::AnyInvocable<void(absl::Status)>> deferred_commits;
  std::vector<absl::AnyInvocable<void(absl::StatusOr<StepInfo>)>> abort_waiters;
  std::vector<absl::AnyInvocable<void()>> release_waiters;
  bool drops_started = false;
  int drops_pending = 0;
};

StepRunner::StepRunner(StepHost* host) : host_(host), options_(host->config().steps) {
  // Step ids: random start (an id of an earlier run names no step here), odd.
  std::random_device seed;
  next_id_.store(((static_cast<uint64_t>(seed()) << 32 | seed()) & ((uint64_t{1} << 62) - 1)) | 1);
  const EngineConfig& c = host_->config();
  lane_slot_ = SlotLayout::For(c.max_batch(), c.max_draft_len(), c.page_size, 0);
  absl::MutexLock lock(&mu_);
  const int devices = host_->num_devices();
  lane_busy_.assign(devices, std::vector<bool>(options_.lanes_per_device, false));
  pair_turn_.assign(devices, std::vector<uint32_t>(options_.lanes_per_device, 0));
  pair_base_.assign(devices,
                    std::vector<uint64_t>(
                        static_cast<size_t>(options_.lanes_per_device) * kDoorbellPairsPerLane, 0));
  stats_.lanes = static_cast<int64_t>(devices) * options_.lanes_per_device;
  watcher_ = std::thread([this] { WatchLoop(); });
}

StepRunner::~StepRunner() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [id, step] : open_) {
      BeginAbort(*step, StepAbortReason::kShutdown,
                 absl::UnavailableError("the server is stopping"));
    }
    wake_.SignalAll();
  }
  watcher_.join();
}

// ---- Open -------------------------------------------------------------

absl::StatusOr<StepOpened> StepRunner::Open(const StepRequest& request) {
  const EngineConfig& config = host_->config();
  const int layers = config.num_layers;
  const int heads = host_->heads_per_device();
  const bool tp = config.parallel_mode == ParallelMode::kTensorParallel;
  if (options_.lanes_per_device == 0) {
    return absl::FailedPreconditionError(
        "this server runs no device-driven steps (--step-lanes 0); use Verify calls");
  }
  const size_t count = request.items.size();
  if (count == 0) return absl::InvalidArgumentError("the step has no items");
  if (static_cast<int>(count) > config.max_batch()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the step has ", count, " items; max_batch is ", config.max_batch()));
  }
  if (std::isnan(request.softmax_scale) || std::isinf(request.softmax_scale)) {
    return absl::InvalidArgumentError("softmax_scale must be finite");
  }
  const float scale =
      request.softmax_scale > 0.0f ? request.softmax_scale : config.default_softmax_scale;
  const auto duration = [](absl::Duration asked, absl::Duration dflt, absl::Duration max,
                           const char* what) -> absl::StatusOr<absl::Duration> {
    if (asked < absl::ZeroDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(what, " must not be negative"));
    }
    if (asked == absl::ZeroDuration()) return dflt;
    if (asked > max) {
      return absl::InvalidArgumentError(absl::StrCat(what, " of ", absl::FormatDuration(asked),
                                                     " is over this server's limit of ",
                                                     absl::FormatDuration(max)));
    }
    return asked;
  };
  ASSIGN_OR_RETURN(const absl::Duration layer_timeout,
                   duration(request.layer_timeout, options_.default_layer_timeout,
                            options_.max_layer_timeout, "layer_timeout"));
  ASSIGN_OR_RETURN(const absl::Duration max_duration,
                   duration(request.max_duration, options_.default_max_duration,
                            options_.max_max_duration, "max_duration"));
  std::vector<std::vector<uint64_t>> visibility(count);
  int max_n = 0;
  for (size_t k = 0; k < count; ++k) {
    const StepItemSpec& it = request.items[k];
    const int64_t n = static_cast<int64_t>(it.parents.size());
    const auto where = [&] {
      return absl::StrCat("items[", k, "] (sequence ", it.sequence_id, ")");
    };
    if (n < 1 || n > config.max_draft_len()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ": ", n, " drafts (parents); need 1..", config.max_draft_len()));
    }
    absl::StatusOr<std::vector<uint64_t>> words = BuildVisibility(it.parents);
    if (!words.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ": ", words.status().message()));
    }
    visibility[k] = *std::move(words);
    max_n = std::max(max_n, static_cast<int>(n));
    for (size_t j = 0; j < k; ++j) {
      if (request.items[j].sequence_id == it.sequence_id) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence ", it.sequence_id, " appears twice (items ", j, " and ", k, ")"));
      }
    }
  }
  ASSIGN_OR_RETURN(const int dp_device, host_->DeviceOfItems(request.items));
  std::vector<int> devices;
  if (tp) {
    for (int d = 0; d < host_->num_devices(); ++d) devices.push_back(d);
  } else {
    devices.push_back(dp_device);
  }
  if (request.ranks.size() != devices.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the step names ", request.ranks.size(), " ranks; this server needs ", devices.size(),
        tp ? " (tensor-parallel mode: one per device, in device order, each with its heads)"
           : " (data-parallel mode: the one device of the items)"));
  }

  auto step = std::make_shared<Step>();
  step->items = request.items;
  step->num_layers = layers;
  step->layer_timeout = layer_timeout;
  step->committed.assign(count, false);
  step->ranks.resize(devices.size());
  RegionLeases& leases = step->leases;
  // Names for error messages (built only on error, but they must live).
  std::deque<std::string> names;
  const auto name_of = [&](size_t rank, const char* tensor) -> const char* {
    names.push_back(devices.size() > 1 ? absl::StrCat(tensor, " of rank ", rank) : tensor);
    return names.back().c_str();
  };
  for (size_t r = 0; r < devices.size(); ++r) {
    const StepRankRequest& rank = request.ranks[r];
    Rank& out = step->ranks[r];
    out.device = devices[r];
    const int d = out.device;
    Device& device = host_->device(d);
    if (absl::Status support = device.DoorbellSupport(request.doorbell_kind); !support.ok()) {
      return absl::Status(support.code(),
                          absl::StrCat(host_->device_name(d), ": ", support.message()));
    }
    if (rank.items.size() != count) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", r, " places ", rank.items.size(), " items; the step has ", count));
    }
    out.items.resize(count);
    for (size_t k = 0; k < count; ++k) {
      const StepItemPlacement& place = rank.items[k];
      const LayerBytes b = BytesOf(static_cast<int64_t>(request.items[k].parents.size()), heads);
      struct Entry {
        const StepTensorPlacement* placement;
        uint64_t bytes;
        uint64_t alignment;
        bool is_output;
        const char* tensor;
        uint64_t* address;
        uint64_t* stride;
      };
      Rank::Tensors& t = out.items[k];
      const Entry entries[4] = {
          {&place.q, b.q, sizeof(Bf16), false, "q", &t.q, &t.q_stride},
          {&place.draft_kv, b.draft_kv, sizeof(Bf16), false, "draft_kv", &t.draft_kv,
           &t.draft_kv_stride},
          {&place.out, b.out, sizeof(Bf16), true, "out", &t.out, &t.out_stride},
          {&place.lse, b.lse, sizeof(float), true, "lse", &t.lse, &t.lse_stride},
      };
      for (const Entry& e : entries) {
        const TensorName what{static_cast<int>(k), request.items[k].sequence_id,
                              name_of(r, e.tensor)};
        const uint64_t stride = e.placement->layer_stride;
        if (stride != 0 && (stride < e.bytes || stride % e.alignment != 0)) {
          return absl::InvalidArgumentError(absl::StrCat(
              what.str(), ": layer_stride ", stride, " must be 0 (one place for every layer) or ",
              "at least the tensor's ", e.bytes, " bytes, a multiple of ", e.alignment));
        }
        if (e.placement->region.empty()) {
          return absl::InvalidArgumentError(absl::StrCat(
              what.str(), ": no region (a step's tensors live in registered regions)"));
        }
        const uint64_t span = static_cast<uint64_t>(layers - 1) * stride + e.bytes;
        if (stride != 0 && span / stride < static_cast<uint64_t>(layers - 1)) {
          return absl::InvalidArgumentError(absl::StrCat(what.str(), ": layer_stride overflows"));
        }
        const RegionRange range{e.placement->region, e.placement->offset, span};
        ASSIGN_OR_RETURN(ResolvedRange resolved, leases.Resolve(host_->regions(), range, span,
                                                                e.alignment, e.is_output, what));
        if (resolved.region->device().empty()) {
          return absl::FailedPreconditionError(
              absl::StrCat(what.str(), ": region \"", e.placement->region,
                           "\" could not be page-locked for the devices, and a step's tensors "
                           "must be where the devices read and write them in place"));
        }
        *e.address = resolved.region->device()[d] + resolved.offset;
        *e.stride = stride;
      }
    }
    if (request.doorbell_kind == DoorbellKind::kHost) {
      const std::pair<uint64_t, const char*> slots[2] = {{rank.doorbell_offset, "doorbell"},
                                                         {rank.completion_offset, "completion"}};
      for (int s = 0; s < 2; ++s) {
        const TensorName what{-1, 0, name_of(r, slots[s].second)};
        if (rank.doorbell_region.empty()) {
          return absl::InvalidArgumentError(
              absl::StrCat(what.str(), ": host doorbells need a system region (doorbell_region)"));
        }
        const RegionRange range{rank.doorbell_region, slots[s].first, kHostSlotBytes};
        ASSIGN_OR_RETURN(ResolvedRange resolved,
                         leases.Resolve(host_->regions(), range, kHostSlotBytes, kHostSlotAlignment,
                                        /*is_output=*/s == 1, what));
        if (resolved.host() == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat(what.str(), ": region \"", rank.doorbell_region,
                           "\" is not a system shared-memory region (host doorbells are host "
                           "memory both processes map)"));
        }
        if (s == 0) {
          out.host_doorbell = HostSlot(resolved.host());
        } else {
          out.host_completion = HostSlot(resolved.host());
          if (!device.addresses_host_memory()) {
            if (resolved.region->device().empty()) {
              return absl::FailedPreconditionError(absl::StrCat(
                  what.str(), ": region \"", rank.doorbell_region,
                  "\" could not be page-locked, and the device stores the completion there"));
            }
            out.launch.completion_device = resolved.region->device()[d] + resolved.offset;
          } else {
            out.launch.completion_device = reinterpret_cast<uint64_t>(resolved.host());
          }
        }
      }
    }
  }
  RETURN_IF_ERROR(leases.CheckOutputsDoNotOverlap());

  // Lanes (and, for GPU doorbells, the words and their values), then the
  // sequences; undone in reverse when a later part fails.
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("the server is stopping");
    for (size_t r = 0; r < step->ranks.size(); ++r) {
      Rank& rank = step->ranks[r];
      for (const auto& [id, open] : open_) {
        for (const Rank& o : open->ranks) {
          if (rank.host_doorbell.valid() &&
              (o.host_completion.data() == rank.host_completion.data() ||
               o.host_completion.data() == rank.host_doorbell.data() ||
               o.host_doorbell.data() == rank.host_completion.data())) {
            for (size_t q = 0; q < r; ++q)
              lane_busy_[step->ranks[q].device][step->ranks[q].lane] = false;
            return absl::FailedPreconditionError(
                absl::StrCat("rank ", r, "'s doorbell slots are in use by open step ", id,
                             ": give each open step slots of its own"));
          }
        }
      }
      std::vector<bool>& busy = lane_busy_[rank.device];
      const auto free = std::find(busy.begin(), busy.end(), false);
      if (free == busy.end()) {
        for (size_t q = 0; q < r; ++q)
          lane_busy_[step->ranks[q].device][step->ranks[q].lane] = false;
        return absl::ResourceExhaustedError(
            absl::StrCat(host_->device_name(rank.device), ": all ", busy.size(),
                         " step lanes are busy (--step-lanes ", options_.lanes_per_device, "); ",
                         open_.size(), " steps are open: commit or abort one, or retry"));
      }
      *free = true;
      rank.lane = static_cast<int>(free - busy.begin());
      StepLaunch& launch = rank.launch;
      launch.lane = rank.lane;
      launch.layers = layers;
      launch.kind = request.doorbell_kind;
      if (request.doorbell_kind == DoorbellKind::kDevice) {
        // The lane's next pair of words and their next values: every value
        // of a pair only grows, so a late ring of an earlier step on it can
        // never reach a later step's targets.
        const int pair =
            rank.lane * kDoorbellPairsPerLane +
            static_cast<int>(pair_turn_[rank.device][rank.lane]++ % kDoorbellPairsPerLane);
        uint64_t& next = pair_base_[rank.device][pair];
        launch.base = next;
        next += static_cast<uint64_t>(layers) + 2;
        launch.doorbell = static_cast<uint64_t>(pair) * kDoorbellPairBytes;
        launch.completion = launch.doorbell + kHostSlotBytes;
      } else {
        launch.base = 0;
        launch.doorbell = reinterpret_cast<uint64_t>(rank.host_doorbell.data());
        launch.completion = reinterpret_cast<uint64_t>(rank.host_completion.data());
      }
    }
    step->id = next_id_.fetch_add(2);
  }
  const auto free_lanes = [&] {
    absl::MutexLock lock(&mu_);
    for (const Rank& rank : step->ranks) lane_busy_[rank.device][rank.lane] = false;
  };
  absl::StatusOr<std::vector<StepHost::Claimed>> claimed = host_->Claim(step->id, request.items);
  if (!claimed.ok()) {
    free_lanes();
    return claimed.status();
  }
  for (size_t r = 0; r < step->ranks.size(); ++r) {
    absl::Status written = WriteLane(*claimed, visibility, scale, max_n, step->ranks[r]);
    if (!written.ok()) {
      host_->Unclaim(step->id, request.items);
      free_lanes();
      return written;
    }
  }

  StepOpened opened;
  opened.step_id = step->id;
  opened.num_layers = layers;
  opened.layer_timeout = layer_timeout;
  opened.max_duration = max_duration;
  for (const auto& c : *claimed) opened.prefix_len.push_back(c.prefix_len);
  for (Rank& rank : step->ranks) {
    StepRankDoorbell& db = rank.doorbell;
    Device& device = host_->device(rank.device);
    db.device = rank.device;
    db.cuda_device = device.cuda_ordinal();
    db.base = rank.launch.base;
    if (request.doorbell_kind == DoorbellKind::kDevice) {
      const DoorbellArena arena = device.doorbell_arena();
      db.arena_ipc_handle = arena.ipc_handle;
      db.arena_bytes = arena.bytes;
      db.arena_host = arena.host;
      db.doorbell_offset = rank.launch.doorbell;
      db.completion_offset = rank.launch.completion;
      db.doorbell_address = arena.address + db.doorbell_offset;
      db.completion_address = arena.address + db.completion_offset;
    } else {
      // Zeroed before the scheduler can ring (it rings after the answer).
      rank.host_doorbell.Reset(0);
      rank.host_completion.Reset(0);
    }
    opened.ranks.push_back(db);
  }
  const absl::Time now = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    step->opened = now;
    step->deadline = now + max_duration;
    step->last_progress = now;
    open_[step->id] = step;
    for (const StepItemSpec& item : request.items) claimed_[item.sequence_id] = step->id;
    ++stats_.opened_total;
  }
  // Outside the lock: a worker may launch (and call back) on this thread.
  for (size_t r = 0; r < step->ranks.size(); ++r) {
    Rank& rank = step->ranks[r];
    host_->EnqueueStepLaunch(rank.device, rank.launch, [this, step, r](const absl::Status& status) {
      absl::MutexLock lock(&mu_);
      Rank& rank = step->ranks[r];
      rank.launch_done = true;
      rank.started = status.ok();
      if (!status.ok()) {
        rank.drained = true;  // never ran
        BeginAbort(*step, StepAbortReason::kDeviceFault, status);
      } else if (step->state == StepState::kAborting) {
        host_->device(rank.device).EndLane(rank.lane, rank.launch.base + step->num_layers + 1);
      }
      wake_.Signal();
    });
  }
  spdlog::debug("step {} opened: {} items, {} ranks, {} doorbells", step->id, count,
                step->ranks.size(),
                request.doorbell_kind == DoorbellKind::kDevice ? "gpu" : "host");
  return opened;
}

absl::Status StepRunner::WriteLane(const std::vector<StepHost::Claimed>& claimed,
                                   const std::vector<std::vector<uint64_t>>& visibility,
                                   float scale, int max_n, Rank& rank) {
  const EngineConfig& c = host_->config();
  const int d = rank.device;
  Device& device = host_->device(d);
  const int lane = rank.lane;
  const int heads = host_->heads_per_device();
  const int64_t max_pages = c.max_pages_per_sequence();
  const int batch = static_cast<int>(claimed.size());
  int32_t* table = device.lane_table(lane);
  for (int k = 0; k < batch; ++k) {
    const std::vector<int32_t>& pages = claimed[k].pages;
    if (static_cast<int64_t>(pages.size()) > max_pages) {
      return absl::InternalError("a step item's page list outgrew its lane table");
    }
    std::copy(pages.begin(), pages.end(), table + k * max_pages);
  }
  std::optional<BatchShape> bucket;
  if (host_->uses_graphs(d)) bucket = ChooseBucket(c.batch_buckets, c.draft_buckets, batch, max_n);
  const BatchShape shape = bucket.has_value() ? *bucket : BatchShape{batch, max_n};
  BatchTarget target;
  target.buffers = &device.lane_buffers(lane);
  target.num_heads = heads;
  target.num_layers = c.num_layers;
  target.num_pages = c.num_pages();
  target.page_size = c.page_size;
  target.kv_dtype = c.kv_dtype;
  const uint32_t q_pitch = static_cast<uint32_t>(heads) * kLatentRowBytes;
  const uint32_t out_pitch = static_cast<uint32_t>(heads) * kValueDim * sizeof(Bf16);
  const uint32_t lse_pitch = static_cast<uint32_t>(heads) * sizeof(float);
  std::vector<PackedRequest> packed(batch);
  for (int layer = 0; layer < c.num_layers; ++layer) {
    const uint64_t l = static_cast<uint64_t>(layer);
    for (int k = 0; k < batch; ++k) {
      const Rank::Tensors& t = rank.items[k];
      PackedRequest& p = packed[k];
      p.prefix_len = static_cast<int32_t>(claimed[k].prefix_len);
      p.draft_len = static_cast<int32_t>(visibility[k].size());
      p.layer = layer;
      p.scale = scale;
      p.table_offset = k * max_pages;
      p.pages = claimed[k].pages.data();
      p.visibility = visibility[k].data();
      p.q = {t.q + l * t.q_stride, q_pitch};
      p.draft_kv = {t.draft_kv + l * t.draft_kv_stride, kLatentRowBytes};
      p.out = {t.out + l * t.out_stride, out_pitch};
      p.lse = {t.lse + l * t.lse_stride, lse_pitch};
    }
    SlotWriter w(device.lane_slot(lane, layer),
                 device.lane_buffers(lane).slots + static_cast<uint64_t>(layer) * lane_slot_.bytes,
                 lane_slot_, GatherCapacity(shape, c.page_size, c.max_batch()));
    RETURN_IF_ERROR(PackBatch(w, target, shape, packed));
    w.Close();
  }
  rank.launch.shape = shape;
  rank.launch.graph = bucket.has_value();
  rank.launch.table_entries = static_cast<int64_t>(batch) * max_pages;
  return absl::OkStatus();
}

// ---- the engine's hooks ------------------------------------------------

bool StepRunner::DeferCommit(uint64_t sequence_id,
                             absl::FunctionRef<absl::AnyInvocable<void(absl::Status)>()> make) {
  absl::MutexLock lock(&mu_);
  auto c = claimed_.find(sequence_id);
  if (c == claimed_.end()) return false;
  auto it = open_.find(c->second);
  if (it == open_.end() || it->second->state != StepState::kRunning) return false;
  it->second->deferred_commits.push_back(make());
  wake_.Signal();  // the watcher polls faster while a Commit waits
  return true;
}

absl::Status StepRunner::CommitAllowed(uint64_t step_id) const {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(step_id);
  if (it == open_.end()) {
    return absl::FailedPreconditionError(absl::StrCat("step ", step_id, " has ended"));
  }
  const Step& step = *it->second;
  switch (step.state) {
    case StepState::kLayersDone:
      return absl::OkStatus();
    case StepState::kRunning:
      return absl::FailedPreconditionError(
          absl::StrCat("step ", step_id, " has run ", step.layers_done, " of ", step.num_layers,
                       " layers: Commit once its completion says every layer ran"));
    default:
      return absl::AbortedError(absl::StrCat("step ", step_id, " was aborted (",
                                             StepAbortReasonName(step.abort_reason),
                                             "): ", step.status.message()));
  }
}

void StepRunner::OnItemCommitted(uint64_t step_id, uint64_t sequence_id) {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(step_id);
  if (it == open_.end()) return;
  Step& step = *it->second;
  for (size_t k = 0; k < step.items.size(); ++k) {
    if (step.items[k].sequence_id == sequence_id && !step.committed[k]) {
      step.committed[k] = true;
      ++step.items_committed;
    }
  }
  claimed_.erase(sequence_id);
  if (step.state == StepState::kLayersDone &&
      step.items_committed == static_cast<int>(step.items.size())) {
    // Ended now, not at the watcher's next look: the scheduler's next step
    // may take the same lane and slots at once.
    step.state = StepState::kCommitted;
    EndStep(step_id, absl::Now());
  }
}

void StepRunner::AbortForRelease(uint64_t step_id, absl::AnyInvocable<void()> then) {
  {
    absl::MutexLock lock(&mu_);
    auto it = open_.find(step_id);
    if (it != open_.end()) {
      Step& step = *it->second;
      BeginAbort(step, StepAbortReason::kSequenceReleased,
                 absl::AbortedError(absl::StrCat(
                     "step ", step_id, " was aborted: one of its sequences was released")));
      step.release_waiters.push_back(std::move(then));
      wake_.Signal();
      return;
    }
  }
  then();  // ended meanwhile
}

// ---- Abort, Get, Stats ---------------------------------------------------

void StepRunner::Abort(uint64_t step_id, absl::AnyInvocable<void(absl::StatusOr<StepInfo>)> done) {
  absl::StatusOr<StepInfo> now;
  {
    absl::MutexLock lock(&mu_);
    auto it = open_.find(step_id);
    if (it != open_.end()) {
      Step& step = *it->second;
      BeginAbort(step, StepAbortReason::kAbortCall,
                 absl::AbortedError(absl::StrCat("step ", step_id, " was aborted by AbortStep")));
      step.abort_waiters.push_back(std::move(done));
      wake_.Signal();
      return;
    }
    now = absl::NotFoundError(absl::StrCat("no step ", step_id, " on this server"));
    for (const StepInfo& info : ended_) {
      if (info.step_id == step_id) now = info;
    }
  }
  done(std::move(now));
}

absl::StatusOr<StepInfo> StepRunner::Get(uint64_t step_id) const {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(step_id);
  if (it != open_.end()) return InfoOf(*it->second);
  for (const StepInfo& info : ended_) {
    if (info.step_id == step_id) return info;
  }
  return absl::NotFoundError(absl::StrCat("no step ", step_id,
                                          " on this server (or it ended before the last ",
                                          ended_.size(), " steps it remembers)"));
}

StepStats StepRunner::Stats() const {
  absl::MutexLock lock(&mu_);
  StepStats s = stats_;
  s.open = static_cast<int64_t>(open_.size());
  s.lanes_busy = 0;
  for (const auto& device : lane_busy_) {
    s.lanes_busy += std::count(device.begin(), device.end(), true);
  }
  return s;
}

StepInfo StepRunner::InfoOf(const Step& step) const {
  StepInfo info;
  info.step_id = step.id;
  info.state = step.state;
  info.num_layers = step.num_layers;
  info.layers_done = step.layers_done;
  info.items = static_cast<int>(step.items.size());
  info.items_committed = step.items_committed;
  info.abort_reason = step.abort_reason;
  info.status = step.status;
  return info;
}

// ---- the watcher ---------------------------------------------------------

void StepRunner::BeginAbort(Step& step, StepAbortReason reason, absl::Status status) {
  if (step.state == StepState::kAborting || StepEnded(step.state)) return;
  step.state = StepState::kAborting;
  step.abort_reason = reason;
  step.status = std::move(status);
  for (Rank& rank : step.ranks) {
    if (rank.started && !rank.drained) {
      host_->device(rank.device).EndLane(rank.lane, rank.launch.base + step.num_layers + 1);
    }
  }
}

void StepRunner::FreeLanes(Step& step) {
  for (const Rank& rank : step.ranks) {
    if (rank.lane >= 0) lane_busy_[rank.device][rank.lane] = false;
  }
}

void StepRunner::EndStep(uint64_t id, absl::Time now) {
  auto it = open_.find(id);
  Step& step = *it->second;
  FreeLanes(step);
  for (const StepItemSpec& item : step.items) {
    auto c = claimed_.find(item.sequence_id);
    if (c != claimed_.end() && c->second == id) claimed_.erase(c);
  }
  const StepInfo info = InfoOf(step);
  ended_.push_back(info);
  while (static_cast<int>(ended_.size()) > options_.ended_steps_remembered) ended_.pop_front();
  if (step.state == StepState::kCommitted) {
    ++stats_.committed_total;
  } else {
    ++stats_.aborted_total[static_cast<int>(step.abort_reason)];
    spdlog::info("step {} aborted ({}) after {} of {} layers: {}", id,
                 StepAbortReasonName(step.abort_reason), step.layers_done, step.num_layers,
                 std::string(step.status.message()));
  }
  StepReport report;
  report.state = step.state;
  report.abort_reason = step.abort_reason;
  report.items = static_cast<int>(step.items.size());
  report.layers_done = step.layers_done;
  report.seconds = absl::ToDoubleSeconds(now - step.opened);
  for (const Rank& rank : step.ranks) {
    if (!rank.started) continue;
    const std::vector<LayerTiming> t = host_->device(rank.device).lane_timings(rank.lane);
    report.layers.insert(report.layers.end(), t.begin(), t.end());
  }
  for (auto& waiter : step.abort_waiters) {
    actions_.push_back([waiter = std::move(waiter), info]() mutable { waiter(info); });
  }
  for (auto& waiter : step.release_waiters) actions_.push_back(std::move(waiter));
  for (auto& commit : step.deferred_commits) {
    const absl::Status status = step.state == StepState::kCommitted
                                    ? absl::OkStatus()
                                    : absl::AbortedError(step.status.message());
    actions_.push_back([commit = std::move(commit), status]() mutable { commit(status); });
  }
  actions_.push_back([this, report = std::move(report)] { host_->OnStepEnded(report); });
  open_.erase(it);
  wake_.Signal();  // the watcher runs the actions
}

void StepRunner::WatchLoop() {
  std::vector<absl::AnyInvocable<void()>> actions;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      bool waiting = !actions_.empty();
      for (const auto& [id, step] : open_) {
        waiting = waiting || !step->deferred_commits.empty() || step->state == StepState::kAborting;
      }
      if (open_.empty() && actions_.empty()) {
        if (stopping_) return;
        wake_.Wait(&mu_);
      } else if (actions_.empty()) {
        wake_.WaitWithTimeout(&mu_, waiting ? kPollWhileWaiting : kPollInterval);
      }
      const absl::Time now = absl::Now();
      std::vector<uint64_t> ended;
      for (auto& [id, step] : open_) {
        if (Poll(*step, now)) ended.push_back(id);
      }
      for (uint64_t id : ended) EndStep(id, now);
      actions.swap(actions_);
    }
    // Outside the lock: these call into the engine (and back into the runner).
    for (auto& action : actions) action();
    actions.clear();
  }
}

bool StepRunner::Poll(Step& step, absl::Time now) {
  std::vector<absl::AnyInvocable<void()>>* actions = &actions_;
  int done = step.num_layers;
  bool drained = true;
  for (Rank& rank : step.ranks) {
    if (rank.started) {
      const LaneProgress p = host_->device(rank.device).lane_progress(rank.lane);
      rank.layers_done = p.layers_done;
      rank.drained = p.drained;
    }
    if (!rank.launch_done) rank.drained = false;
    done = std::min(done, rank.layers_done);
    drained = drained && rank.drained;
  }
  if (done > step.layers_done) {
    step.layers_done = done;
    step.last_progress = now;
  }
  switch (step.state) {
    case StepState::kRunning: {
      if (done == step.num_layers && drained) {
        step.state = StepState::kLayersDone;
        step.layers_done_at = now;
        for (auto& commit : step.deferred_commits) {
          actions->push_back([commit = std::move(commit)]() mutable { commit(absl::OkStatus()); });
        }
        step.deferred_commits.clear();
        return false;
      }
      if (drained) {
        BeginAbort(
            step, StepAbortReason::kLaneStopped,
            absl::AbortedError(absl::StrCat("step ", step.id, ": a lane stopped after ", done,
                                            " of ", step.num_layers, " layers (a device error)")));
      } else if (absl::Status f = host_->fault(); !f.ok()) {
        BeginAbort(step, StepAbortReason::kDeviceFault, f);
      } else if (now >= step.deadline) {
        BeginAbort(step, StepAbortReason::kDeadline,
                   absl::DeadlineExceededError(
                       absl::StrCat("step ", step.id, " passed its maximum duration with ", done,
                                    " of ", step.num_layers, " layers run")));
      } else if (now >= step.last_progress + step.layer_timeout) {
        BeginAbort(step, StepAbortReason::kLayerTimeout,
                   absl::DeadlineExceededError(
                       absl::StrCat("step ", step.id, ": layer ", done, " did not complete within ",
                                    absl::FormatDuration(step.layer_timeout),
                                    " (the scheduler did not ring it, or stopped)")));
      }
      break;
    }
    case StepState::kLayersDone: {
      if (step.items_committed == static_cast<int>(step.items.size())) {
        step.state = StepState::kCommitted;
        return true;
      }
      if (now >= step.deadline) {
        BeginAbort(step, StepAbortReason::kDeadline,
                   absl::DeadlineExceededError(absl::StrCat(
                       "step ", step.id, " passed its maximum duration with ", step.items_committed,
                       " of ", step.items.size(), " items committed")));
      } else if (now >= step.layers_done_at + step.layer_timeout) {
        BeginAbort(step, StepAbortReason::kLayerTimeout,
                   absl::DeadlineExceededError(absl::StrCat(
                       "step ", step.id, ": ", step.items_committed, " of ", step.items.size(),
                       " items committed within ", absl::FormatDuration(step.layer_timeout),
                       " of the last layer")));
      }
      break;
    }
    default:
      break;
  }
  if (step.state != StepState::kAborting) return false;
  for (auto& commit : step.deferred_commits) {
    const absl::Status status = absl::AbortedError(step.status.message());
    actions->push_back([commit = std::move(commit), status]() mutable { commit(status); });
  }
  step.deferred_commits.clear();
  if (!drained) {
    // Again each look: a late ring may have lowered a doorbell.
    for (Rank& rank : step.ranks) {
      if (rank.started && !rank.drained) {
        host_->device(rank.device).EndLane(rank.lane, rank.launch.base + step.num_layers + 1);
      }
    }
    return false;
  }
  if (!step.drops_started) {
    // Every lane ran out: no device work of the step is left, so the items
    // not committed go back as they were before it.
    step.drops_started = true;
    std::shared_ptr<Step> self = open_[step.id];
    for (size_t k = 0; k < step.items.size(); ++k) {
      if (step.committed[k]) continue;
      ++step.drops_pending;
      const uint64_t sequence = step.items[k].sequence_id;
      actions->push_back([this, self, sequence] {
        host_->Drop(self->id, sequence, [this, self, sequence](const absl::Status& status) {
          if (!status.ok()) {
            LogFields ids;
            ids.step = self->id;
            ids.sequence = sequence;
            const ScopedLogFields fields(ids);
            spdlog::warn("step {}: dropping sequence {} failed: {}", self->id, sequence,
                         status.ToString());
          }
          absl::MutexLock lock(&mu_);
          --self->drops_pending;
          wake_.Signal();
        });
      });
    }
  }
  if (step.drops_pending > 0) return false;
  step.state = StepState::kAborted;
  return true;
}

}  // namespace mlaverify::engine
