#include "client/replica_set.h"

#include <algorithm>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"

namespace mlaverify::client {

absl::StatusOr<std::unique_ptr<ReplicaSet>> ReplicaSet::Create(
    const std::vector<std::string>& targets, const ClientOptions& options,
    absl::Duration retry_down_after) {
  if (targets.empty()) return absl::InvalidArgumentError("no targets");
  std::set<std::string> seen;
  std::vector<std::unique_ptr<VerifyClient>> clients;
  for (const std::string& target : targets) {
    if (!seen.insert(target).second) {
      return absl::InvalidArgumentError(absl::StrCat("target ", target, " given twice"));
    }
    absl::StatusOr<std::unique_ptr<VerifyClient>> client = VerifyClient::Create(target, options);
    if (!client.ok()) return client.status();
    clients.push_back(*std::move(client));
  }
  return std::unique_ptr<ReplicaSet>(new ReplicaSet(std::move(clients), retry_down_after));
}

ReplicaSet::ReplicaSet(std::vector<std::unique_ptr<VerifyClient>> clients,
                       absl::Duration retry_down_after)
    : clients_(std::move(clients)),
      retry_down_after_(retry_down_after),
      states_(clients_.size()),
      down_since_(clients_.size()) {
  for (size_t i = 0; i < clients_.size(); ++i) states_[i].target = clients_[i]->target();
}

std::string ReplicaSet::Name(int index) const {
  return absl::StrCat("replica ", index, " (", clients_[index]->target(), ")");
}

absl::Status ReplicaSet::CheckUp(int index) {
  absl::MutexLock lock(&mu_);
  const ReplicaState& state = states_[index];
  if (state.up) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(Name(index), " is down: ", state.down_reason));
}

absl::Status ReplicaSet::Observe(int index, absl::Status status) {
  if (status.ok()) return status;
  // With a pool, UNAVAILABLE may say only that the call's connection was
  // lost (gRPC opens it again on the next call). The replica is down when
  // health checks on two more connections do not say SERVING either; a
  // faulted or draining server answers NOT_SERVING. The two are adjacent
  // connections picked here, not two turns of the round robin: other
  // threads move the turn in between, and both turns could land on the
  // lost connection, still going down.
  VerifyClient& client = *clients_[index];
  bool confirmed = status.code() == absl::StatusCode::kUnavailable;
  const int first = confirmed ? client.TakeNextConnection() : 0;
  for (int probe = 0; confirmed && probe < std::min(2, client.connections() - 1); ++probe) {
    const absl::StatusOr<ServingStatus> health =
        client.HealthOn((first + probe) % client.connections());
    confirmed = !health.ok() || *health != ServingStatus::kServing;
  }
  if (confirmed) {
    absl::MutexLock lock(&mu_);
    ReplicaState& state = states_[index];
    if (state.up) {
      state.up = false;
      state.down_reason = std::string(status.message());
      down_since_[index] = absl::Now();
      spdlog::warn("{} is down: {}", Name(index), state.down_reason);
    }
  }
  if (size() == 1) return status;
  return absl::Status(status.code(), absl::StrCat(Name(index), ": ", status.message()));
}

bool ReplicaSet::Refresh(int index) {
  {
    absl::MutexLock lock(&mu_);
    if (!states_[index].up && absl::Now() - down_since_[index] < retry_down_after_) return false;
  }
  absl::StatusOr<v1::ServerInfo> info = clients_[index]->GetServerInfo();
  absl::MutexLock lock(&mu_);
  ReplicaState& state = states_[index];
  if (!info.ok()) {
    if (info.status().code() == absl::StatusCode::kUnavailable) {
      if (state.up)
        spdlog::warn("{} is down: {}", Name(index), std::string(info.status().message()));
      state.up = false;
      state.down_reason = std::string(info.status().message());
      down_since_[index] = absl::Now();
    }
    return false;
  }
  if (!state.up) spdlog::info("{} answers again", Name(index));
  state.up = true;
  state.down_reason.clear();
  state.free_pages = info->free_pages();
  if (state.instance_id.empty()) state.instance_id = info->instance_id();
  return true;
}

absl::StatusOr<PlacedSequence> ReplicaSet::CreateSequence(absl::string_view label) {
  // Replicas that answer, ordered by free pages in tenths of the most any
  // has (near-equal counts tie: many sequences created at once all see the
  // same counts, before any prompt is appended), then by the fewest live
  // sequences this client placed there, then round robin.
  std::vector<int> up;
  for (int i = 0; i < size(); ++i) {
    if (Refresh(i)) up.push_back(i);
  }
  // The pick and a reservation (live_sequences + 1) under one lock, so that
  // concurrent creators see each other's picks.
  std::vector<bool> tried(size(), false);
  absl::Status last = absl::OkStatus();
  for (size_t attempt = 0; attempt < up.size(); ++attempt) {
    int index = -1;
    {
      absl::MutexLock lock(&mu_);
      int64_t most_free = 1;
      for (int i : up) most_free = std::max(most_free, states_[i].free_pages);
      const int turn = next_turn_++;
      std::tuple<int64_t, int64_t, int> best;
      for (int i : up) {
        if (tried[i]) continue;
        const std::tuple<int64_t, int64_t, int> key{-(states_[i].free_pages * 10 / most_free),
                                                    states_[i].live_sequences,
                                                    (i - turn % size() + size()) % size()};
        if (index < 0 || key < best) {
          best = key;
          index = i;
        }
      }
      ++states_[index].live_sequences;
    }
    tried[index] = true;
    absl::StatusOr<uint64_t> id = clients_[index]->CreateSequence(label);
    {
      absl::MutexLock lock(&mu_);
      if (id.ok()) {
        ++states_[index].sequences_created;
        return PlacedSequence{index, *id};
      }
      --states_[index].live_sequences;
    }
    last = Observe(index, id.status());
  }
  if (!last.ok()) return last;
  std::vector<std::string> down;
  {
    absl::MutexLock lock(&mu_);
    for (int i = 0; i < size(); ++i) {
      down.push_back(absl::StrCat(Name(i), ": ", states_[i].down_reason));
    }
  }
  return absl::UnavailableError(absl::StrCat("no replica is up (", absl::StrJoin(down, "; "), ")"));
}

absl::StatusOr<AppendKvResult> ReplicaSet::AppendKv(const PlacedSequence& seq,
                                                    int64_t start_position, int num_layers,
                                                    int64_t tokens, absl::Span<const Bf16> kv,
                                                    const ShmStaging* staging,
                                                    const std::function<void(int64_t)>& on_chunk) {
  if (absl::Status up = CheckUp(seq.replica); !up.ok()) return up;
  absl::StatusOr<AppendKvResult> r = clients_[seq.replica]->AppendKv(
      seq.id, start_position, num_layers, tokens, kv, staging, on_chunk);
  if (!r.ok()) return Observe(seq.replica, r.status());
  return r;
}

absl::StatusOr<std::vector<VerifyItemResult>> ReplicaSet::Verify(
    int owner, int layer, absl::Span<const VerifyItemInput> items, float softmax_scale) {
  if (absl::Status up = CheckUp(owner); !up.ok()) return up;
  absl::StatusOr<std::vector<VerifyItemResult>> r =
      clients_[owner]->Verify(layer, items, softmax_scale);
  if (!r.ok()) return Observe(owner, r.status());
  return r;
}

absl::StatusOr<CommitResult> ReplicaSet::Commit(const PlacedSequence& seq,
                                                absl::Span<const int32_t> accepted) {
  if (absl::Status up = CheckUp(seq.replica); !up.ok()) return up;
  absl::StatusOr<CommitResult> r = clients_[seq.replica]->Commit(seq.id, accepted);
  if (!r.ok()) return Observe(seq.replica, r.status());
  return r;
}

absl::StatusOr<int64_t> ReplicaSet::ReleaseSequence(const PlacedSequence& seq) {
  if (absl::Status up = CheckUp(seq.replica); !up.ok()) return up;
  absl::StatusOr<int64_t> r = clients_[seq.replica]->ReleaseSequence(seq.id);
  if (r.ok() || r.status().code() == absl::StatusCode::kNotFound) {
    absl::MutexLock lock(&mu_);
    if (states_[seq.replica].live_sequences > 0) --states_[seq.replica].live_sequences;
  }
  if (!r.ok()) return Observe(seq.replica, r.status());
  return r;
}

std::vector<ReplicaState> ReplicaSet::States() const {
  absl::MutexLock lock(&mu_);
  return states_;
}

}  // namespace mlaverify::client
