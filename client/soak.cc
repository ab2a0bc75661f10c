#include "client/soak.h"

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/reference_check.h"
#include "common/geometry.h"
#include "common/workload.h"

namespace mlaverify::client {
namespace {

// What all workers add up, under one lock (updated once per call).
struct Tally {
  absl::Mutex mu;
  SoakReport report ABSL_GUARDED_BY(mu);

  void Unexpected(const std::string& kind, const std::string& what) {
    absl::MutexLock lock(&mu);
    if (report.unexpected.empty()) report.first_unexpected = what;
    ++report.unexpected[kind];
  }
};

class Worker {
 public:
  Worker(VerifyClient& client, std::vector<VerifyClient*> short_clients, const v1::ServerInfo& info,
         const SoakOptions& options, int index, Tally* tally)
      : client_(client),
        short_clients_(std::move(short_clients)),
        options_(options),
        layers_(info.num_layers()),
        heads_(info.num_heads()),
        max_drafts_(std::max(1, std::min(options.drafts, info.max_draft_len()))),
        scale_(info.default_softmax_scale()),
        rng_(options.seed * 1000003 + index),
        tally_(tally) {}

  void Run(absl::Time until) {
    while (absl::Now() < until) OneSequence(until);
  }

 private:
  void OneSequence(absl::Time until) {
    absl::StatusOr<uint64_t> id = client_.CreateSequence("soak");
    if (!id.ok())
      return tally_->Unexpected("CreateSequence " + CodeName(id.status()), id.status().ToString());
    {
      absl::MutexLock lock(&tally_->mu);
      ++tally_->report.sequences;
    }
    SequenceMirror mirror(layers_);
    const int64_t prompt = std::uniform_int_distribution<int64_t>(1, options_.max_prompt_len)(rng_);
    const std::vector<Bf16> kv =
        RandomBf16(rng_, static_cast<size_t>(layers_) * prompt * kLatentDim, 1.0f);
    absl::StatusOr<AppendKvResult> appended = client_.AppendKv(*id, 0, layers_, prompt, kv);
    if (!appended.ok()) {
      tally_->Unexpected("AppendKv " + CodeName(appended.status()), appended.status().ToString());
    } else {
      mirror.AppendPrompt(kv, prompt);
      const int steps = std::uniform_int_distribution<int>(1, options_.max_steps)(rng_);
      for (int s = 0; s < steps && absl::Now() < until; ++s) {
        if (!Step(*id, &mirror)) break;
      }
    }
    absl::StatusOr<int64_t> released = client_.ReleaseSequence(*id);
    if (!released.ok()) {
      tally_->Unexpected("ReleaseSequence " + CodeName(released.status()),
                         released.status().ToString());
    }
  }

  // One step: every layer verified (some calls cut short), answers checked,
  // then a random path committed if every layer answered, else an empty one.
  // False when the sequence should not be used further.
  bool Step(uint64_t id, SequenceMirror* mirror) {
    const int n = std::uniform_int_distribution<int>(1, max_drafts_)(rng_);
    const std::vector<int32_t> parents = RandomDraftTree(rng_, n);
    std::vector<std::vector<Bf16>> draft_kv(layers_);
    bool every_layer = true;
    std::bernoulli_distribution cut(options_.cut_fraction);
    for (int layer = 0; layer < layers_; ++layer) {
      draft_kv[layer] = RandomBf16(rng_, static_cast<size_t>(n) * kLatentDim, 1.0f);
      const std::vector<Bf16> q =
          RandomBf16(rng_, static_cast<size_t>(n) * heads_ * kLatentDim, 2.0f);
      const VerifyItemInput item{id, parents, q, draft_kv[layer]};
      const bool cut_short = cut(rng_);
      VerifyClient& c = cut_short ? *short_clients_[std::uniform_int_distribution<size_t>(
                                        0, short_clients_.size() - 1)(rng_)]
                                  : client_;
      absl::StatusOr<std::vector<VerifyItemResult>> results =
          c.Verify(layer, absl::MakeConstSpan(&item, 1));
      {
        absl::MutexLock lock(&tally_->mu);
        ++tally_->report.verify_calls;
        if (cut_short) ++tally_->report.cut_calls;
        if (cut_short && results.ok()) ++tally_->report.cut_answered;
      }
      if (!results.ok()) {
        const absl::StatusCode code = results.status().code();
        if (cut_short &&
            (code == absl::StatusCode::kDeadlineExceeded || code == absl::StatusCode::kCancelled)) {
          every_layer = false;
          continue;
        }
        tally_->Unexpected("Verify " + CodeName(results.status()), results.status().ToString());
        return false;
      }
      absl::StatusOr<ReferenceComparison> check = CompareWithReference(
          *mirror, layer, item, scale_, (*results)[0], options_.reference_threads);
      if (!check.ok()) {
        tally_->Unexpected("reference " + CodeName(check.status()), check.status().ToString());
        return false;
      }
      {
        absl::MutexLock lock(&tally_->mu);
        ++tally_->report.checked_items;
        if (check->rel_err > tally_->report.max_rel_err || check->rel_err != check->rel_err) {
          tally_->report.max_rel_err = check->rel_err;
        }
      }
      if (!check->ok(1e-2, 1e-2)) {
        tally_->Unexpected(
            "wrong answer",
            absl::StrFormat("sequence %d layer %d: rel err %.3e, lse err %.3e, %d non-finite", id,
                            layer, check->rel_err, check->lse_max_abs_err, check->non_finite));
        return false;
      }
    }
    const std::vector<int32_t> accepted =
        every_layer ? RandomAcceptedPath(rng_, parents) : std::vector<int32_t>{};
    absl::StatusOr<CommitResult> committed = client_.Commit(id, accepted);
    if (!committed.ok()) {
      // A step whose only verified layers were cut before they ran was taken
      // back by the server: there is nothing to commit.
      if (!every_layer && committed.status().code() == absl::StatusCode::kFailedPrecondition)
        return true;
      tally_->Unexpected("Commit " + CodeName(committed.status()), committed.status().ToString());
      return false;
    }
    {
      absl::MutexLock lock(&tally_->mu);
      ++tally_->report.commits;
    }
    mirror->AppendAccepted(draft_kv, accepted);
    if (committed->length != mirror->length()) {
      tally_->Unexpected("Commit length", absl::StrFormat("sequence %d: length %d, expected %d", id,
                                                          committed->length, mirror->length()));
      return false;
    }
    return true;
  }

  static std::string CodeName(const absl::Status& s) { return absl::StatusCodeToString(s.code()); }

  VerifyClient& client_;
  const std::vector<VerifyClient*> short_clients_;
  const SoakOptions options_;
  const int layers_, heads_, max_drafts_;
  const float scale_;
  std::mt19937_64 rng_;
  Tally* const tally_;
};

}  // namespace

absl::StatusOr<SoakReport> RunSoak(VerifyClient& client, const std::string& target,
                                   const ClientOptions& client_options,
                                   const SoakOptions& options) {
  if (options.workers < 1 || options.duration_s <= 0 || options.max_prompt_len < 1 ||
      options.max_steps < 1 || options.drafts < 1 || options.cut_fraction < 0 ||
      options.cut_fraction > 1) {
    return absl::InvalidArgumentError(
        "soak needs --workers >= 1, --duration-s > 0, --max-prompt-len >= 1, --max-steps >= 1, "
        "--drafts >= 1 and --cut-fraction in 0..1");
  }
  absl::StatusOr<v1::ServerInfo> info = client.GetServerInfo();
  if (!info.ok()) return info.status();
  std::vector<std::unique_ptr<VerifyClient>> short_clients;
  std::vector<VerifyClient*> short_client_pointers;
  for (int factor : {1, 4, 16}) {
    ClientOptions short_options = client_options;
    short_options.call_timeout = options.cut_deadline * factor;
    absl::StatusOr<std::unique_ptr<VerifyClient>> made =
        VerifyClient::Create(target, short_options);
    if (!made.ok()) return made.status();
    short_clients.push_back(*std::move(made));
    short_client_pointers.push_back(short_clients.back().get());
  }
  Tally tally;
  {
    absl::MutexLock lock(&tally.mu);
    tally.report.free_pages_before = info->free_pages();
    tally.report.live_before = info->live_sequences();
  }
  const absl::Time start = absl::Now();
  const absl::Time until = start + absl::Seconds(options.duration_s);
  std::vector<std::unique_ptr<Worker>> workers;
  std::vector<std::thread> threads;
  for (int w = 0; w < options.workers; ++w) {
    workers.push_back(
        std::make_unique<Worker>(client, short_client_pointers, *info, options, w, &tally));
    threads.emplace_back([&, w] { workers[w]->Run(until); });
  }
  for (std::thread& t : threads) t.join();
  absl::StatusOr<v1::ServerInfo> after = client.GetServerInfo();
  absl::MutexLock lock(&tally.mu);
  SoakReport report = tally.report;
  report.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!after.ok()) {
    report.unexpected["GetServerInfo at the end"]++;
    if (report.first_unexpected.empty()) report.first_unexpected = after.status().ToString();
    report.free_pages_after = -1;
    report.live_after = -1;
  } else {
    report.free_pages_after = after->free_pages();
    report.live_after = after->live_sequences();
  }
  return report;
}

void PrintSoakReport(const SoakReport& r) {
  absl::PrintF(
      "soak: %.1f s, %d sequences, %d Verify calls (%d cut short, %d of those answered), "
      "%d items checked (max rel err %.3e), %d commits\n",
      r.seconds, r.sequences, r.verify_calls, r.cut_calls, r.cut_answered, r.checked_items,
      r.max_rel_err, r.commits);
  if (r.unexpected.empty()) {
    absl::PrintF("unexpected:   none\n");
  } else {
    for (const auto& [kind, count] : r.unexpected)
      absl::PrintF("unexpected:   %s x%d\n", kind, count);
    absl::PrintF("first:        %s\n", r.first_unexpected);
  }
  absl::PrintF("pages:        %d free before, %d after; live sequences %d before, %d after\n",
               r.free_pages_before, r.free_pages_after, r.live_before, r.live_after);
  absl::PrintF("result:       %s\n", r.ok() ? "PASS" : "FAIL");
}

nlohmann::ordered_json SoakReportToJson(const SoakReport& r) {
  nlohmann::ordered_json unexpected = nlohmann::ordered_json::object();
  for (const auto& [kind, count] : r.unexpected) unexpected[kind] = count;
  return {{"seconds", r.seconds},
          {"sequences", r.sequences},
          {"verify_calls", r.verify_calls},
          {"cut_calls", r.cut_calls},
          {"cut_answered", r.cut_answered},
          {"checked_items", r.checked_items},
          {"max_rel_err", r.max_rel_err},
          {"commits", r.commits},
          {"unexpected", unexpected},
          {"first_unexpected", r.first_unexpected},
          {"free_pages_before", r.free_pages_before},
          {"free_pages_after", r.free_pages_after},
          {"live_before", r.live_before},
          {"live_after", r.live_after},
          {"passed", r.ok()}};
}

}  // namespace mlaverify::client
