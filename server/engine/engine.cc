#include "server/engine/engine.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/draft_tree.h"
#include "common/status_macros.h"
#include "kernels/verify_attention.h"
#include "spdlog/spdlog.h"

namespace mlaverify::engine {
namespace {

using mlaverify::kLatentDim;
using mlaverify::kValueDim;

// How many recently expired ids NOT_FOUND can still explain.
constexpr size_t kExpiredIdsRemembered = 4096;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t NowNanos() { return absl::ToUnixNanos(absl::Now()); }

}  // namespace

struct Engine::Sequence {
  Sequence(uint64_t id_in, std::string label_in) : id(id_in), label(std::move(label_in)) {}

  const uint64_t id;
  const std::string label;
  // Read without the lock by ExpireIdle's scan; re-checked under it.
  std::atomic<int64_t> last_used_ns{NowNanos()};

  absl::Mutex mu;
  bool released ABSL_GUARDED_BY(mu) = false;
  int64_t length ABSL_GUARDED_BY(mu) = 0;   // committed tokens P
  std::vector<int32_t> pages ABSL_GUARDED_BY(mu);
  // The open verify step, if any.
  bool pending ABSL_GUARDED_BY(mu) = false;
  std::vector<int32_t> parents ABSL_GUARDED_BY(mu);
  std::vector<uint64_t> visibility ABSL_GUARDED_BY(mu);
  std::vector<bool> layer_verified ABSL_GUARDED_BY(mu);
  int layers_verified ABSL_GUARDED_BY(mu) = 0;

  void Touch() { last_used_ns.store(NowNanos(), std::memory_order_relaxed); }
};

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineConfig& config,
                                                       std::unique_ptr<Backend> backend) {
  RETURN_IF_ERROR(config.Validate());
  if (backend == nullptr) return absl::InvalidArgumentError("no backend");
  PoolGeometry geometry;
  geometry.num_layers = config.num_layers;
  geometry.num_pages = config.num_pages();
  geometry.page_size = config.page_size;
  geometry.num_heads = config.num_heads;
  geometry.max_batch = config.max_batch();
  geometry.max_draft_len = config.max_draft_len();
  geometry.max_pages_per_sequence = config.max_pages_per_sequence();
  RETURN_IF_ERROR(backend->Init(geometry));
  spdlog::info("engine: backend {}, {} layers, {} heads, page size {}, {} pages ({:.1f} MiB), "
               "max draft {}, max batch {}",
               backend->name(), config.num_layers, config.num_heads, config.page_size,
               geometry.num_pages, static_cast<double>(config.pool_bytes) / (1 << 20),
               config.max_draft_len(), config.max_batch());
  return std::unique_ptr<Engine>(new Engine(config, std::move(backend)));
}

Engine::Engine(const EngineConfig& config, std::unique_ptr<Backend> backend)
    : config_(config), backend_(std::move(backend)), pages_(config.num_pages()) {}

Engine::~Engine() = default;

EngineStats Engine::Stats() const {
  EngineStats s;
  s.total_pages = pages_.total_pages();
  s.free_pages = pages_.free_pages();
  {
    absl::MutexLock lock(&table_mu_);
    s.live_sequences = static_cast<int64_t>(sequences_.size());
  }
  s.pending_steps = pending_steps_.load();
  s.tokens_appended_total = tokens_appended_.load();
  s.tokens_committed_total = tokens_committed_.load();
  s.drafts_verified_total = drafts_verified_.load();
  s.verify_items_total = verify_items_.load();
  s.steps_committed_total = steps_committed_.load();
  s.sequences_created_total = sequences_created_.load();
  s.sequences_expired_total = sequences_expired_.load();
  return s;
}

absl::StatusOr<uint64_t> Engine::CreateSequence(const std::string& label) {
  uint64_t id;
  {
    absl::MutexLock lock(&table_mu_);
    id = next_id_++;
    sequences_.emplace(id, std::make_shared<Sequence>(id, label));
  }
  sequences_created_.fetch_add(1);
  spdlog::debug("seq {} created (label '{}')", id, label);
  return id;
}

absl::StatusOr<std::shared_ptr<Engine::Sequence>> Engine::Find(uint64_t id) const {
  {
    absl::MutexLock lock(&table_mu_);
    auto it = sequences_.find(id);
    if (it != sequences_.end()) return it->second;
  }
  return NotFound(id);
}

absl::Status Engine::NotFound(uint64_t id) const {
  absl::MutexLock lock(&table_mu_);
  if (expired_.contains(id)) {
    return absl::NotFoundError(absl::StrCat("sequence ", id, " expired after being idle for ",
                                            absl::FormatDuration(config_.idle_timeout)));
  }
  return absl::NotFoundError(
      absl::StrCat("sequence ", id, " not found (never created, or released)"));
}

absl::StatusOr<int64_t> Engine::AppendKv(uint64_t sequence_id, int64_t start_position,
                                         int64_t tokens, absl::Span<const Bf16> kv) {
  if (tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("append of ", tokens, " tokens: need >= 1"));
  }
  const int64_t expected = int64_t{config_.num_layers} * tokens * kLatentDim;
  if (static_cast<int64_t>(kv.size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat("kv holds ", kv.size(), " values; [",
                                                   config_.num_layers, ", ", tokens,
                                                   ", 576] needs ", expected));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Find(sequence_id));
  absl::MutexLock lock(&seq->mu);
  if (seq->released) return NotFound(sequence_id);
  if (seq->pending) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", sequence_id, " has a pending verify step of ",
                     seq->parents.size(), " drafts: Commit it before appending"));
  }
  if (start_position != seq->length) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", sequence_id, " has length ", seq->length,
                     "; the chunk starts at ", start_position));
  }
  const int64_t new_length = seq->length + tokens;
  if (new_length > config_.max_sequence_len) {
    return absl::ResourceExhaustedError(
        absl::StrCat("sequence ", sequence_id, " would reach ", new_length,
                     " tokens; max_sequence_len is ", config_.max_sequence_len));
  }
  const int64_t extra = CeilDiv(new_length, config_.page_size) - static_cast<int64_t>(seq->pages.size());
  std::vector<int32_t> added;
  if (extra > 0) {
    ASSIGN_OR_RETURN(added, pages_.Allocate(extra));
    seq->pages.insert(seq->pages.end(), added.begin(), added.end());
  }
  absl::Status written = backend_->WriteRows(seq->pages, seq->length, tokens, kv);
  if (!written.ok()) {
    seq->pages.resize(seq->pages.size() - added.size());
    pages_.Free(added);
    return written;
  }
  seq->length = new_length;
  seq->Touch();
  tokens_appended_.fetch_add(tokens);
  spdlog::debug("seq {} appended {} tokens, length {}", sequence_id, tokens, new_length);
  return new_length;
}

absl::Status Engine::Verify(int layer, float softmax_scale, absl::Span<VerifyItem> items) {
  const int heads = config_.num_heads;
  if (items.empty()) return absl::InvalidArgumentError("verify request has no items");
  if (static_cast<int>(items.size()) > config_.max_batch()) {
    return absl::InvalidArgumentError(absl::StrCat("verify request has ", items.size(),
                                                   " items; max_batch is ", config_.max_batch()));
  }
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " is outside 0..", config_.num_layers - 1));
  }
  if (std::isnan(softmax_scale) || std::isinf(softmax_scale)) {
    return absl::InvalidArgumentError("softmax_scale must be finite");
  }
  const float scale = softmax_scale > 0.0f ? softmax_scale : config_.default_softmax_scale;

  // Everything that needs no sequence state, checked before any lock.
  std::vector<std::vector<uint64_t>> visibility(items.size());
  for (size_t k = 0; k < items.size(); ++k) {
    const VerifyItem& it = items[k];
    const int64_t n = static_cast<int64_t>(it.parents.size());
    if (n < 1 || n > config_.max_draft_len()) {
      return absl::InvalidArgumentError(absl::StrCat("item ", k, " (sequence ", it.sequence_id,
                                                     "): ", n, " drafts; need 1..",
                                                     config_.max_draft_len()));
    }
    absl::StatusOr<std::vector<uint64_t>> words = mlaverify::BuildVisibility(it.parents);
    if (!words.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("item ", k, " (sequence ", it.sequence_id,
                                                     "): ", words.status().message()));
    }
    visibility[k] = *std::move(words);
    if (static_cast<int64_t>(it.q.size()) != n * heads * kLatentDim ||
        static_cast<int64_t>(it.draft_kv.size()) != n * kLatentDim ||
        static_cast<int64_t>(it.out.size()) != n * heads * kValueDim ||
        static_cast<int64_t>(it.lse.size()) != n * heads) {
      return absl::InvalidArgumentError(absl::StrCat(
          "item ", k, " (sequence ", it.sequence_id, "): buffer sizes do not match N=", n,
          ", H=", heads, " (q [N,H,576], draft_kv [N,576], out [N,H,512], lse [N,H])"));
    }
    for (size_t j = 0; j < k; ++j) {
      if (items[j].sequence_id == it.sequence_id) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence ", it.sequence_id, " appears twice (items ", j, " and ", k, ")"));
      }
    }
  }

  // Lock the sequences in id order (no deadlock with concurrent calls).
  std::vector<std::shared_ptr<Sequence>> seqs(items.size());
  for (size_t k = 0; k < items.size(); ++k) {
    ASSIGN_OR_RETURN(seqs[k], Find(items[k].sequence_id));
  }
  std::vector<size_t> order(items.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return items[a].sequence_id < items[b].sequence_id; });
  for (size_t k : order) seqs[k]->mu.Lock();
  struct Unlocker {
    std::vector<std::shared_ptr<Sequence>>& seqs;
    ~Unlocker() {
      for (auto& s : seqs) s->mu.Unlock();
    }
  } unlocker{seqs};

  // State checks and page needs, still changing nothing.
  int64_t pages_needed = 0;
  std::vector<int64_t> extra(items.size(), 0);
  for (size_t k = 0; k < items.size(); ++k) {
    Sequence& s = *seqs[k];
    s.mu.AssertHeld();
    const int64_t n = static_cast<int64_t>(items[k].parents.size());
    if (s.released) return NotFound(s.id);
    if (s.pending) {
      if (!std::equal(s.parents.begin(), s.parents.end(), items[k].parents.begin(),
                      items[k].parents.end())) {
        return absl::FailedPreconditionError(absl::StrCat(
            "sequence ", s.id, " has a pending step with ", s.parents.size(),
            " drafts and another tree; every layer of a step must send the same parents "
            "(Commit the step to start a new one)"));
      }
      continue;
    }
    if (s.length + n > config_.max_sequence_len) {
      return absl::ResourceExhaustedError(
          absl::StrCat("sequence ", s.id, " would reach ", s.length + n,
                       " tokens; max_sequence_len is ", config_.max_sequence_len));
    }
    extra[k] = std::max<int64_t>(
        0, CeilDiv(s.length + n, config_.page_size) - static_cast<int64_t>(s.pages.size()));
    pages_needed += extra[k];
  }
  ASSIGN_OR_RETURN(std::vector<int32_t> new_pages, pages_.Allocate(pages_needed));

  // Open new steps; remember them to undo on a backend failure.
  std::vector<size_t> opened;
  size_t next_page = 0;
  for (size_t k = 0; k < items.size(); ++k) {
    Sequence& s = *seqs[k];
    s.mu.AssertHeld();
    if (s.pending) continue;
    s.pages.insert(s.pages.end(), new_pages.begin() + next_page,
                   new_pages.begin() + next_page + extra[k]);
    next_page += extra[k];
    s.pending = true;
    s.parents.assign(items[k].parents.begin(), items[k].parents.end());
    s.visibility = visibility[k];
    s.layer_verified.assign(config_.num_layers, false);
    s.layers_verified = 0;
    opened.push_back(k);
  }

  std::vector<BackendVerifyRequest> requests(items.size());
  for (size_t k = 0; k < items.size(); ++k) {
    Sequence& s = *seqs[k];
    s.mu.AssertHeld();
    BackendVerifyRequest& r = requests[k];
    r.page_table = s.pages;
    r.prefix_len = static_cast<int32_t>(s.length);
    r.draft_len = static_cast<int32_t>(items[k].parents.size());
    r.layer = layer;
    r.softmax_scale = scale;
    r.visibility = s.visibility;
    r.q = items[k].q;
    r.draft_kv = items[k].draft_kv;
    r.out = items[k].out;
    r.lse = items[k].lse;
  }
  const absl::Status computed = backend_->Verify(requests);
  if (!computed.ok()) {
    for (size_t k = 0; k < items.size(); ++k) {
      Sequence& s = *seqs[k];
      s.mu.AssertHeld();
      const bool was_opened = std::find(opened.begin(), opened.end(), k) != opened.end();
      if (was_opened) {
        s.pages.resize(s.pages.size() - extra[k]);
        s.pending = false;
        s.parents.clear();
        s.visibility.clear();
      } else if (s.layer_verified[layer]) {
        // The layer's draft rows may be half rewritten: it must be verified again.
        s.layer_verified[layer] = false;
        --s.layers_verified;
      }
    }
    pages_.Free(new_pages);
    spdlog::error("verify layer {} failed in backend {}: {}", layer, backend_->name(),
                  computed.ToString());
    return computed;
  }
  pending_steps_.fetch_add(static_cast<int64_t>(opened.size()));
  int64_t drafts = 0;
  for (size_t k = 0; k < items.size(); ++k) {
    Sequence& s = *seqs[k];
    s.mu.AssertHeld();
    if (!s.layer_verified[layer]) {
      s.layer_verified[layer] = true;
      ++s.layers_verified;
    }
    items[k].prefix_len = s.length;
    drafts += static_cast<int64_t>(items[k].parents.size());
    s.Touch();
  }
  verify_items_.fetch_add(static_cast<int64_t>(items.size()));
  drafts_verified_.fetch_add(drafts);
  return absl::OkStatus();
}

absl::StatusOr<CommitResult> Engine::Commit(uint64_t sequence_id,
                                            absl::Span<const int32_t> accepted) {
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Find(sequence_id));
  absl::MutexLock lock(&seq->mu);
  Sequence& s = *seq;
  if (s.released) return NotFound(sequence_id);
  if (!s.pending) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", sequence_id, " has no pending verify step: Verify before Commit"));
  }
  RETURN_IF_ERROR(mlaverify::ValidateAcceptedPath(s.parents, accepted));
  const int k = static_cast<int>(accepted.size());
  if (k > 0 && s.layers_verified < config_.num_layers) {
    return absl::FailedPreconditionError(absl::StrCat(
        "sequence ", sequence_id, ": only ", s.layers_verified, " of ", config_.num_layers,
        " layers were verified in this step; accepting drafts needs their KV in every layer "
        "(commit an empty path to drop the step)"));
  }
  if (k > 0) RETURN_IF_ERROR(backend_->Compact(s.pages, s.length, accepted));
  s.length += k;
  s.pending = false;
  s.parents.clear();
  s.visibility.clear();
  s.layer_verified.clear();
  s.layers_verified = 0;
  // Pages past the new length held only rejected drafts.
  const size_t keep = static_cast<size_t>(CeilDiv(s.length, config_.page_size));
  if (s.pages.size() > keep) {
    pages_.Free(absl::MakeConstSpan(s.pages).subspan(keep));
    s.pages.resize(keep);
  }
  s.Touch();
  pending_steps_.fetch_sub(1);
  steps_committed_.fetch_add(1);
  tokens_committed_.fetch_add(k);
  spdlog::debug("seq {} committed {} drafts, length {}", sequence_id, k, s.length);
  return CommitResult{s.length, k};
}

int64_t Engine::ReleaseLocked(Sequence& s) {
  s.mu.AssertHeld();
  const int64_t freed = static_cast<int64_t>(s.pages.size());
  pages_.Free(s.pages);
  s.pages.clear();
  if (s.pending) pending_steps_.fetch_sub(1);
  s.pending = false;
  s.released = true;
  return freed;
}

absl::StatusOr<int64_t> Engine::Release(uint64_t sequence_id) {
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Find(sequence_id));
  int64_t freed;
  {
    absl::MutexLock lock(&seq->mu);
    if (seq->released) return NotFound(sequence_id);
    freed = ReleaseLocked(*seq);
    absl::MutexLock table_lock(&table_mu_);
    sequences_.erase(sequence_id);
  }
  spdlog::debug("seq {} released, {} pages freed", sequence_id, freed);
  return freed;
}

int Engine::ExpireIdle(absl::Time now) {
  if (config_.idle_timeout <= absl::ZeroDuration()) return 0;
  const int64_t cutoff = absl::ToUnixNanos(now - config_.idle_timeout);
  std::vector<std::shared_ptr<Sequence>> candidates;
  {
    absl::MutexLock lock(&table_mu_);
    for (const auto& [id, seq] : sequences_) {
      if (seq->last_used_ns.load(std::memory_order_relaxed) < cutoff) candidates.push_back(seq);
    }
  }
  int expired = 0;
  for (const auto& seq : candidates) {
    absl::MutexLock lock(&seq->mu);
    // Used again since the scan, or released by its owner meanwhile.
    if (seq->released || seq->last_used_ns.load(std::memory_order_relaxed) >= cutoff) continue;
    const int64_t freed = ReleaseLocked(*seq);
    {
      absl::MutexLock table_lock(&table_mu_);
      sequences_.erase(seq->id);
      expired_.insert(seq->id);
      expired_order_.push_back(seq->id);
      if (expired_order_.size() > kExpiredIdsRemembered) {
        expired_.erase(expired_order_.front());
        expired_order_.pop_front();
      }
    }
    ++expired;
    spdlog::info("seq {} ('{}') expired after {} idle, {} pages freed", seq->id, seq->label,
                 absl::FormatDuration(config_.idle_timeout), freed);
  }
  sequences_expired_.fetch_add(expired);
  return expired;
}

absl::Status Engine::ReadKv(uint64_t sequence_id, int64_t start, int64_t count,
                            absl::Span<Bf16> kv) {
  ASSIGN_OR_RETURN(std::shared_ptr<Sequence> seq, Find(sequence_id));
  absl::MutexLock lock(&seq->mu);
  if (seq->released) return NotFound(sequence_id);
  const int64_t capacity = static_cast<int64_t>(seq->pages.size()) * config_.page_size;
  if (start < 0 || count < 0 || start + count > capacity ||
      static_cast<int64_t>(kv.size()) != int64_t{config_.num_layers} * count * kLatentDim) {
    return absl::InvalidArgumentError(absl::StrCat("read of [", start, ", ", start + count,
                                                   ") outside the ", capacity,
                                                   " positions the sequence's pages hold"));
  }
  return backend_->ReadRows(seq->pages, start, count, kv);
}

}  // namespace mlaverify::engine
