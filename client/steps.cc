#include "client/steps.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/gpu_doorbells.h"
#include "common/host_doorbell.h"
#include "common/status_macros.h"

namespace mlaverify::client {
namespace {

void SetTensor(const StepTensorPlace& in, v1::StepTensor* out) {
  out->set_region(in.region);
  out->set_offset(in.offset);
  out->set_layer_stride(in.layer_stride);
}

uint32_t Milliseconds(absl::Duration d) {
  return static_cast<uint32_t>(std::max<int64_t>(0, absl::ToInt64Milliseconds(d)));
}

}  // namespace

v1::OpenStepRequest ToOpenStepRequest(const StepSpec& spec) {
  v1::OpenStepRequest r;
  for (const StepItemSpec& item : spec.items) {
    v1::StepItem* out = r.add_items();
    out->set_sequence_id(item.sequence_id);
    out->mutable_parents()->Add(item.parents.begin(), item.parents.end());
  }
  for (const StepRankSpec& rank : spec.ranks) {
    v1::StepRank* out = r.add_ranks();
    for (const StepItemPlace& p : rank.items) {
      v1::StepItemPlacement* place = out->add_items();
      SetTensor(p.q, place->mutable_q());
      SetTensor(p.draft_kv, place->mutable_draft_kv());
      SetTensor(p.out, place->mutable_out());
      SetTensor(p.lse, place->mutable_lse());
    }
    if (spec.doorbells == Doorbells::kHost) {
      out->set_doorbell_region(rank.doorbell_region);
      out->set_doorbell_offset(rank.doorbell_offset);
      out->set_completion_offset(rank.completion_offset);
    }
  }
  r.set_doorbell(spec.doorbells == Doorbells::kGpu ? v1::DOORBELL_GPU : v1::DOORBELL_HOST);
  r.set_softmax_scale(spec.softmax_scale);
  r.set_layer_timeout_ms(Milliseconds(spec.layer_timeout));
  r.set_max_duration_ms(Milliseconds(spec.max_duration));
  return r;
}

DeviceStep::~DeviceStep() = default;

absl::Status DeviceStep::CheckRank(int rank, int layers, Doorbells kind) const {
  if (kind != doorbells_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", id_, " has ", doorbells_ == Doorbells::kGpu ? "GPU" : "host", " doorbells: use ",
        doorbells_ == Doorbells::kGpu ? "RingOnStream / WaitOnStream" : "Ring / Wait"));
  }
  if (rank < 0 || rank >= static_cast<int>(ranks_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " of a step with ", ranks_.size(), " ranks"));
  }
  if (layers < 1 || layers > num_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat(layers, " layers rung or awaited; the step has 1..", num_layers_));
  }
  return absl::OkStatus();
}

absl::Status DeviceStep::Ended(int rank, uint64_t completion) const {
  return absl::AbortedError(
      absl::StrCat("step ", id_, " ended early (rank ", rank, "'s completion holds ",
                   completion - ranks_[rank].base, " of ", num_layers_,
                   " layers): its outputs are not to be used; GetStep says why"));
}

absl::Status DeviceStep::Ring(int rank, int layers) {
  RETURN_IF_ERROR(CheckRank(rank, layers, Doorbells::kHost));
  HostSlot(ranks_[rank].doorbell).Store(ranks_[rank].base + static_cast<uint64_t>(layers));
  return absl::OkStatus();
}

absl::Status DeviceStep::Wait(int rank, int layers, absl::Duration timeout, absl::Duration spin) {
  RETURN_IF_ERROR(CheckRank(rank, layers, Doorbells::kHost));
  const Rank& r = ranks_[rank];
  const uint64_t target = r.base + static_cast<uint64_t>(layers);
  // Short slices: a GPU stores the completion without waking the futex.
  const uint64_t seen =
      HostSlot(r.completion)
          .WaitAtLeast(target, spin, absl::Now() + timeout, nullptr, absl::Microseconds(200));
  if (seen < target) {
    return absl::DeadlineExceededError(
        absl::StrCat("step ", id_, ": rank ", rank, " ran ", seen - std::min(seen, r.base), " of ",
                     layers, " layers within ", absl::FormatDuration(timeout)));
  }
  if (seen > r.base + static_cast<uint64_t>(num_layers_)) return Ended(rank, seen);
  return absl::OkStatus();
}

absl::Status DeviceStep::RingOnStream(int rank, int layers, void* cuda_stream) {
  RETURN_IF_ERROR(CheckRank(rank, layers, Doorbells::kGpu));
  const Rank& r = ranks_[rank];
  return gpu_doorbells::Ring(cuda_stream, r.doorbell_address,
                             r.base + static_cast<uint64_t>(layers));
}

absl::Status DeviceStep::WaitOnStream(int rank, int layers, void* cuda_stream) {
  RETURN_IF_ERROR(CheckRank(rank, layers, Doorbells::kGpu));
  const Rank& r = ranks_[rank];
  return gpu_doorbells::Wait(cuda_stream, r.completion_address,
                             r.base + static_cast<uint64_t>(layers));
}

absl::StatusOr<int> DeviceStep::Completed(int rank) const {
  if (rank < 0 || rank >= static_cast<int>(ranks_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " of a step with ", ranks_.size(), " ranks"));
  }
  const Rank& r = ranks_[rank];
  uint64_t value = 0;
  if (doorbells_ == Doorbells::kHost) {
    value = HostSlot(r.completion).Load();
  } else {
    ASSIGN_OR_RETURN(value, gpu_doorbells::Read(r.completion_address, r.device));
  }
  if (value > r.base + static_cast<uint64_t>(num_layers_)) return Ended(rank, value);
  return static_cast<int>(value < r.base ? 0 : value - r.base);
}

absl::StatusOr<v1::StepStatus> DeviceStep::Abort() { return client_->AbortStep(id_); }

absl::StatusOr<v1::StepStatus> DeviceStep::Status() { return client_->GetStep(id_); }

// ---- VerifyClient's step calls ----

absl::StatusOr<std::unique_ptr<DeviceStep>> VerifyClient::OpenStep(const StepSpec& spec) {
  if (spec.items.empty()) return absl::InvalidArgumentError("a step needs at least one item");
  if (spec.doorbells == Doorbells::kHost) {
    for (size_t r = 0; r < spec.ranks.size(); ++r) {
      if (spec.ranks[r].doorbell_region_data == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("rank ", r,
                         ": host doorbells need the doorbell region's memory in this process "
                         "(doorbell_region_data)"));
      }
    }
  }
  const v1::OpenStepRequest request = ToOpenStepRequest(spec);
  ASSIGN_OR_RETURN(v1::OpenStepResponse response,
                   Unary(SequenceConnection(spec.items[0].sequence_id),
                         &v1::VerifyService::Stub::OpenStep, request));
  std::unique_ptr<DeviceStep> step(new DeviceStep());
  step->client_ = this;
  step->id_ = response.step_id();
  step->num_layers_ = response.num_layers();
  step->doorbells_ = spec.doorbells;
  step->prefix_len_.assign(response.prefix_len().begin(), response.prefix_len().end());
  if (response.ranks_size() != static_cast<int>(spec.ranks.size())) {
    AbortStep(step->id_).IgnoreError();  // nobody could ring it
    return absl::InternalError(absl::StrCat("OpenStep answered with ", response.ranks_size(),
                                            " ranks for ", spec.ranks.size()));
  }
  for (int r = 0; r < response.ranks_size(); ++r) {
    const v1::StepRankDoorbell& db = response.ranks(r);
    DeviceStep::Rank rank;
    rank.base = db.base();
    rank.device = db.device_id();
    if (spec.doorbells == Doorbells::kHost) {
      rank.doorbell = spec.ranks[r].doorbell_region_data + spec.ranks[r].doorbell_offset;
      rank.completion = spec.ranks[r].doorbell_region_data + spec.ranks[r].completion_offset;
    } else {
      absl::StatusOr<uint64_t> arena = DoorbellArena(db.arena_handle(), db.device_id());
      if (!arena.ok()) {
        AbortStep(step->id_).IgnoreError();  // nobody could ring it
        return arena.status();
      }
      rank.doorbell_address = *arena + db.doorbell_offset();
      rank.completion_address = *arena + db.completion_offset();
    }
    step->ranks_.push_back(rank);
  }
  step->response_ = std::move(response);
  return step;
}

absl::StatusOr<v1::StepStatus> VerifyClient::AbortStep(uint64_t step_id) {
  v1::AbortStepRequest request;
  request.set_step_id(step_id);
  return Unary(NextConnection(), &v1::VerifyService::Stub::AbortStep, request);
}

absl::StatusOr<v1::StepStatus> VerifyClient::GetStep(uint64_t step_id) {
  v1::GetStepRequest request;
  request.set_step_id(step_id);
  return Unary(NextConnection(), &v1::VerifyService::Stub::GetStep, request);
}

absl::StatusOr<uint64_t> VerifyClient::DoorbellArena(const std::string& handle, int device) {
  absl::MutexLock lock(&arenas_mu_);
  auto it = arenas_.find({handle, device});
  if (it != arenas_.end()) return it->second;
  if (arenas_.size() >= kMaxDoorbellArenas) {
    return absl::ResourceExhaustedError(
        absl::StrCat("this client has ", arenas_.size(),
                     " server doorbell arenas open (one per server instance and device): make "
                     "a new client for servers that restarted"));
  }
  ASSIGN_OR_RETURN(uint64_t address, gpu_doorbells::OpenArena(handle, device));
  arenas_[{handle, device}] = address;
  return address;
}

void VerifyClient::CloseDoorbellArenas() {
  absl::MutexLock lock(&arenas_mu_);
  for (const auto& [key, address] : arenas_) gpu_doorbells::CloseArena(address, key.second);
  arenas_.clear();
}

}  // namespace mlaverify::client
