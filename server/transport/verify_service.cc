#include "server/transport/verify_service.h"

#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/geometry.h"
#include "server/transport/status_mapping.h"
#include "server/transport/tensor_codec.h"
#include "spdlog/spdlog.h"

namespace mlaverify::transport {
namespace {

using mlaverify::kLatentDim;
using mlaverify::kValueDim;
using Clock = std::chrono::steady_clock;

}  // namespace

VerifyServiceImpl::VerifyServiceImpl(engine::Engine* engine, const ServiceOptions& options,
                                     RpcObserver* observer,
                                     const std::atomic<ServingState>* state)
    : engine_(engine),
      options_(options),
      observer_(observer),
      state_(state),
      slow_calls_(options.slow_call_seconds, std::chrono::seconds(1)),
      queue_(options.worker_threads) {}

VerifyServiceImpl::~VerifyServiceImpl() = default;

absl::Status VerifyServiceImpl::Admit(grpc::CallbackServerContext* ctx,
                                      bool allowed_while_draining) const {
  const ServingState state = state_->load();
  if (state == ServingState::kStarting) {
    return absl::UnavailableError("server is starting: retry when health reports SERVING");
  }
  if (state == ServingState::kDraining && !allowed_while_draining) {
    return absl::UnavailableError("server is draining: send new work to another replica");
  }
  if (ctx->IsCancelled()) return absl::CancelledError("the client cancelled the call");
  if (ctx->deadline() < std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError("the call's deadline passed before the work started");
  }
  return absl::OkStatus();
}

void VerifyServiceImpl::Observe(absl::string_view rpc, grpc::StatusCode code, Clock::time_point arrived,
                                Clock::time_point started) {
  const Clock::time_point now = Clock::now();
  const double queued = std::chrono::duration<double>(started - arrived).count();
  const double working = std::chrono::duration<double>(now - started).count();
  if (observer_ != nullptr) observer_->OnRpc(rpc, code, queued + working);
  slow_calls_.Report(rpc, GrpcCodeName(code), queued, working, now);
}

template <typename Body>
grpc::ServerUnaryReactor* VerifyServiceImpl::RunUnary(absl::string_view rpc,
                                                      grpc::CallbackServerContext* ctx,
                                                      bool allowed_while_draining, Body body) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const Clock::time_point start = Clock::now();
  queue_.Submit([this, rpc, ctx, reactor, start, allowed_while_draining, body]() mutable {
    const Clock::time_point started = Clock::now();
    absl::Status status = Admit(ctx, allowed_while_draining);
    if (status.ok()) status = body();
    const grpc::Status reply = ToGrpcStatus(status);
    if (!status.ok() && status.code() != absl::StatusCode::kNotFound) {
      spdlog::warn("{} from {}: {}", std::string(rpc), ctx->peer(), status.ToString());
    }
    Observe(rpc, reply.error_code(), start, started);
    reactor->Finish(reply);
  });
  return reactor;
}

grpc::ServerUnaryReactor* VerifyServiceImpl::GetServerInfo(grpc::CallbackServerContext* ctx,
                                                           const v1::GetServerInfoRequest*,
                                                           v1::ServerInfo* r) {
  return RunUnary("GetServerInfo", ctx, /*allowed_while_draining=*/true, [this, r] {
    const engine::EngineConfig& c = engine_->config();
    const engine::EngineStats s = engine_->Stats();
    r->set_version(options_.version);
    r->set_backend(engine_->backend_name());
    for (const auto& d : engine_->devices()) {
      v1::DeviceInfo* info = r->add_devices();
      info->set_name(d.name);
      info->set_memory_bytes(d.memory_bytes);
    }
    r->set_num_layers(c.num_layers);
    r->set_num_heads(c.num_heads);
    r->set_latent_dim(kLatentDim);
    r->set_value_dim(kValueDim);
    r->set_rope_dim(mlaverify::kRopeDim);
    r->set_page_size(c.page_size);
    r->set_total_pages(s.total_pages);
    r->set_free_pages(s.free_pages);
    r->set_max_draft_len(c.max_draft_len());
    for (int b : c.draft_buckets) r->add_draft_buckets(b);
    for (int b : c.batch_buckets) r->add_batch_buckets(b);
    r->set_max_batch(c.max_batch());
    r->set_max_message_bytes(options_.max_message_bytes);
    r->set_default_softmax_scale(c.default_softmax_scale);
    r->set_idle_timeout_seconds(absl::ToInt64Seconds(c.idle_timeout));
    r->set_live_sequences(s.live_sequences);
    r->set_max_sequence_len(c.max_sequence_len);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::CreateSequence(
    grpc::CallbackServerContext* ctx, const v1::CreateSequenceRequest* request,
    v1::CreateSequenceResponse* response) {
  return RunUnary("CreateSequence", ctx, false, [this, request, response]() -> absl::Status {
    ASSIGN_OR_RETURN(const uint64_t id, engine_->CreateSequence(request->label()));
    response->set_sequence_id(id);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::AppendKv(grpc::CallbackServerContext* ctx,
                                                      const v1::AppendKvRequest* request,
                                                      v1::AppendKvResponse* response) {
  return RunUnary("AppendKv", ctx, false, [this, request, response]() -> absl::Status {
    const v1::Tensor& kv = request->kv();
    const int64_t layers = engine_->config().num_layers;
    // T comes from the tensor itself; everything else must match the geometry.
    const int64_t tokens = kv.shape_size() == 3 ? kv.shape(1) : -1;
    if (tokens < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv: shape ", ShapeString(kv), ", expected [", layers, ", T, 576] with T >= 1"));
    }
    ASSIGN_OR_RETURN(absl::Span<const Bf16> data, Bf16Input(kv, {layers, tokens, kLatentDim}, "kv"));
    ASSIGN_OR_RETURN(const int64_t length, engine_->AppendKv(request->sequence_id(),
                                                            request->start_position(), tokens,
                                                            data));
    response->set_length(length);
    return absl::OkStatus();
  });
}

absl::Status VerifyServiceImpl::DoVerify(const v1::VerifyRequest& request,
                                         v1::VerifyResponse* response) {
  const int64_t heads = engine_->config().num_heads;
  const int max_draft = engine_->config().max_draft_len();
  response->set_request_id(request.request_id());
  response->set_layer(request.layer());
  std::vector<engine::VerifyItem> items(request.items_size());
  int64_t drafts = 0;
  for (int k = 0; k < request.items_size(); ++k) {
    const v1::VerifyItem& in = request.items(k);
    const int64_t n = in.parents_size();
    const std::string where = absl::StrCat("items[", k, "] (sequence ", in.sequence_id(), ")");
    // Draft count first, so that a huge N is named as such rather than as a
    // tensor mismatch.
    if (n < 1 || n > max_draft) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", n, " drafts (parents); need 1..",
                                                     max_draft));
    }
    engine::VerifyItem& item = items[k];
    item.sequence_id = in.sequence_id();
    item.parents = absl::MakeConstSpan(in.parents().data(), in.parents_size());
    ASSIGN_OR_RETURN(item.q, Bf16Input(in.q(), {n, heads, kLatentDim}, absl::StrCat(where, " q")));
    ASSIGN_OR_RETURN(item.draft_kv,
                     Bf16Input(in.draft_kv(), {n, kLatentDim}, absl::StrCat(where, " draft_kv")));
    drafts += n;
  }
  // Outputs are sized only once every input passed, so a rejected request
  // allocates nothing large.
  response->mutable_results()->Reserve(request.items_size());
  for (int k = 0; k < request.items_size(); ++k) {
    const int64_t n = request.items(k).parents_size();
    v1::VerifyResult* result = response->add_results();
    result->set_sequence_id(items[k].sequence_id);
    items[k].out = Bf16Output(result->mutable_out(), {n, heads, kValueDim});
    items[k].lse = Fp32Output(result->mutable_lse(), {n, heads});
  }
  RETURN_IF_ERROR(engine_->Verify(request.layer(), request.softmax_scale(), absl::MakeSpan(items)));
  for (int k = 0; k < request.items_size(); ++k) {
    response->mutable_results(k)->set_prefix_len(items[k].prefix_len);
  }
  if (observer_ != nullptr) observer_->OnVerify(request.items_size(), drafts);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* VerifyServiceImpl::Verify(grpc::CallbackServerContext* ctx,
                                                    const v1::VerifyRequest* request,
                                                    v1::VerifyResponse* response) {
  return RunUnary("Verify", ctx, false,
                  [this, request, response] { return DoVerify(*request, response); });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::Commit(grpc::CallbackServerContext* ctx,
                                                    const v1::CommitRequest* request,
                                                    v1::CommitResponse* response) {
  return RunUnary("Commit", ctx, false, [this, request, response]() -> absl::Status {
    ASSIGN_OR_RETURN(const engine::CommitResult result,
                     engine_->Commit(request->sequence_id(),
                                     absl::MakeConstSpan(request->accepted().data(),
                                                         request->accepted_size())));
    response->set_length(result.length);
    response->set_accepted_count(result.accepted_count);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::ReleaseSequence(
    grpc::CallbackServerContext* ctx, const v1::ReleaseSequenceRequest* request,
    v1::ReleaseSequenceResponse* response) {
  // Allowed while draining: a scheduler cleaning up frees pages sooner.
  return RunUnary("ReleaseSequence", ctx, true, [this, request, response]() -> absl::Status {
    ASSIGN_OR_RETURN(const int64_t freed, engine_->Release(request->sequence_id()));
    response->set_freed_pages(freed);
    return absl::OkStatus();
  });
}

// One read, one engine call on the work queue, one write, then the next
// read: requests of a stream are answered in order, and at most one engine
// call per stream is in flight. A failed request is answered with its status
// in the response; the stream ends when the client half-closes or cancels.
class VerifyServiceImpl::StreamReactor final
    : public grpc::ServerBidiReactor<v1::VerifyRequest, v1::VerifyResponse> {
 public:
  StreamReactor(VerifyServiceImpl* service, grpc::CallbackServerContext* ctx)
      : service_(service), ctx_(ctx) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // client half-closed (or the call broke): no more requests
      Finish(grpc::Status::OK);
      return;
    }
    const Clock::time_point start = Clock::now();
    service_->queue_.Submit([this, start] {
      const Clock::time_point started = Clock::now();
      response_.Clear();
      absl::Status status = service_->Admit(ctx_, /*allowed_while_draining=*/false);
      if (status.ok()) status = service_->DoVerify(request_, &response_);
      if (!status.ok()) {
        response_.Clear();
        response_.set_request_id(request_.request_id());
        response_.set_layer(request_.layer());
        response_.set_error_code(static_cast<int32_t>(status.code()));
        response_.set_error_message(std::string(status.message()));
      }
      service_->Observe("VerifyStream", ToGrpcStatus(status).error_code(), start, started);
      StartWrite(&response_);
    });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "stream write failed"));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  VerifyServiceImpl* const service_;
  grpc::CallbackServerContext* const ctx_;
  v1::VerifyRequest request_;
  v1::VerifyResponse response_;
};

grpc::ServerBidiReactor<v1::VerifyRequest, v1::VerifyResponse>* VerifyServiceImpl::VerifyStream(
    grpc::CallbackServerContext* ctx) {
  return new StreamReactor(this, ctx);
}

}  // namespace mlaverify::transport
