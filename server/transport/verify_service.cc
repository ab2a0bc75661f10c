#include "server/transport/verify_service.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <memory>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/auth_token.h"
#include "common/bf16.h"
#include "common/geometry.h"
#include "common/log_fields.h"
#include "common/status_macros.h"
#include "server/transport/message_encoding.h"
#include "server/transport/peer.h"
#include "server/transport/status_mapping.h"
#include "server/transport/tensor_codec.h"
#include "spdlog/spdlog.h"

namespace mlaverify::transport {
namespace {

// Request bytes as `message`; INVALID_ARGUMENT naming the RPC and the type
// when they do not parse (garbage, a truncated field, invalid UTF-8 in a
// string field).
absl::Status Decode(absl::string_view rpc, const grpc::ByteBuffer& bytes,
                    google::protobuf::Message* message) {
  if (!bytes.Valid()) {
    // (A call whose client cancelled it is refused as CANCELLED before this.)
    return absl::InvalidArgumentError(
        absl::StrCat(rpc, ": the call ended without a request message"));
  }
  grpc::ByteBuffer consumed(bytes);  // shares the slices; decoding consumes them
  const grpc::Status status =
      grpc::SerializationTraits<google::protobuf::Message>::Deserialize(&consumed, message);
  if (status.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(rpc, ": the request's ", bytes.Length(),
                                                 " bytes do not parse as ",
                                                 message->GetDescriptor()->full_name()));
}

// Memory is shared with processes on this host only: every call that
// registers, names, lists or removes a region comes over loopback or a unix
// socket, or it is refused (`what` says which use it was).
absl::Status CheckLocalPeer(grpc::CallbackServerContext* ctx, const std::string& peer,
                            absl::string_view what) {
  // A call relayed by a proxy (deploy/http2-front: nghttpx adds the header
  // and drops any the client sent) comes from wherever its client is, even
  // over a loopback connection.
  const auto& metadata = ctx->client_metadata();
  if (metadata.find("x-forwarded-for") != metadata.end() ||
      metadata.find("forwarded") != metadata.end()) {
    return absl::PermissionDeniedError(absl::StrCat(
        what, " relayed by a proxy (x-forwarded-for) from ", peer,
        ": only a client on the server's host (loopback or a unix socket) can use shared "
        "memory, and only on the server's own port"));
  }
  if (IsLocalPeer(peer)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      what, " from ", peer,
      ": only a client on the server's host (loopback or a unix socket) can use shared memory"));
}

absl::Status CheckLocalPeer(grpc::CallbackServerContext* ctx, absl::string_view what) {
  return CheckLocalPeer(ctx, ctx->peer(), what);
}

bool NamesRegion(const v1::Tensor& t) { return t.has_shared_memory(); }

bool NamesRegion(const v1::VerifyRequest& request) {
  for (const v1::VerifyItem& item : request.items()) {
    if (NamesRegion(item.q()) || NamesRegion(item.draft_kv()) || item.has_out_shared_memory() ||
        item.has_lse_shared_memory()) {
      return true;
    }
  }
  return false;
}

// The engine's step info as the wire's StepStatus.
void ToStepStatus(const engine::StepInfo& info, v1::StepStatus* out) {
  out->set_step_id(info.step_id);
  out->set_state(engine::StepStateName(info.state));
  out->set_num_layers(info.num_layers);
  out->set_layers_done(info.layers_done);
  out->set_items(info.items);
  out->set_items_committed(info.items_committed);
  if (info.abort_reason != engine::StepAbortReason::kNone) {
    out->set_abort_reason(engine::StepAbortReasonName(info.abort_reason));
    out->set_error_code(static_cast<int>(info.status.code()));
    out->set_error_message(std::string(info.status.message()));
  }
}

engine::StepTensorPlacement ToStepTensor(const v1::StepTensor& t) {
  return {t.region(), t.offset(), t.layer_stride()};
}

absl::StatusOr<engine::StepRequest> ToStepRequest(const v1::OpenStepRequest& in) {
  engine::StepRequest r;
  switch (in.doorbell()) {
    case v1::DOORBELL_HOST:
      r.doorbell_kind = engine::DoorbellKind::kHost;
      break;
    case v1::DOORBELL_GPU:
      r.doorbell_kind = engine::DoorbellKind::kDevice;
      break;
    default:
      return absl::InvalidArgumentError(
          "doorbell: DOORBELL_HOST (slots in a system region) or DOORBELL_GPU (words in the "
          "server's device memory)");
  }
  for (const v1::StepItem& item : in.items()) {
    r.items.push_back({item.sequence_id(), {item.parents().begin(), item.parents().end()}});
  }
  for (const v1::StepRank& rank : in.ranks()) {
    engine::StepRankRequest out;
    for (const v1::StepItemPlacement& p : rank.items()) {
      out.items.push_back({ToStepTensor(p.q()), ToStepTensor(p.draft_kv()), ToStepTensor(p.out()),
                           ToStepTensor(p.lse())});
    }
    out.doorbell_region = rank.doorbell_region();
    out.doorbell_offset = rank.doorbell_offset();
    out.completion_offset = rank.completion_offset();
    r.ranks.push_back(std::move(out));
  }
  r.softmax_scale = in.softmax_scale();
  r.layer_timeout = absl::Milliseconds(in.layer_timeout_ms());
  r.max_duration = absl::Milliseconds(in.max_duration_ms());
  return r;
}

engine::CallContext ContextOf(grpc::CallbackServerContext* ctx) {
  engine::CallContext c;
  c.deadline = absl::FromChrono(ctx->deadline());
  c.is_cancelled = [ctx] { return ctx->IsCancelled(); };
  return c;
}

}  // namespace

VerifyServiceImpl::VerifyServiceImpl(const ServiceOptions& options, RpcObserver* observer,
                                     const std::atomic<ServingState>* state)
    : options_(options),
      observer_(observer),
      state_(state),
      slow_calls_(options.slow_call_seconds, std::chrono::seconds(1)),
      failed_calls_log_(std::chrono::milliseconds(100)) {}

VerifyServiceImpl::~VerifyServiceImpl() = default;

void VerifyServiceImpl::AttachEngine(engine::Engine* engine) {
  engine_.store(engine, std::memory_order_release);
}

absl::Status VerifyServiceImpl::Admit(grpc::CallbackServerContext* ctx,
                                      bool allowed_while_draining) const {
  const ServingState state = state_->load();
  if (state == ServingState::kStarting || engine() == nullptr) {
    return absl::UnavailableError("server is starting: retry when health reports SERVING");
  }
  if (state == ServingState::kDraining && !allowed_while_draining) {
    return absl::UnavailableError("server is draining: send new work to another replica");
  }
  // (kDrainGrace: still served while load balancers move away.)
  if (state == ServingState::kFaulted && !allowed_while_draining) {
    return absl::UnavailableError(
        absl::StrCat(engine()->fault().message(), "; this server is NOT_SERVING"));
  }
  if (!options_.auth_token.empty()) {
    const auto& metadata = ctx->client_metadata();
    const auto it = metadata.find("authorization");
    constexpr absl::string_view kBearer = "Bearer ";
    const bool ok =
        it != metadata.end() &&
        absl::string_view(it->second.data(), it->second.size()).substr(0, kBearer.size()) ==
            kBearer &&
        ConstantTimeEquals(
            absl::string_view(it->second.data(), it->second.size()).substr(kBearer.size()),
            options_.auth_token);
    if (!ok) {
      return absl::UnauthenticatedError(
          "missing or wrong bearer token (authorization: Bearer <token>)");
    }
  }
  if (ctx->IsCancelled()) return absl::CancelledError("the client cancelled the call");
  if (ctx->deadline() < std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError("the call's deadline passed before the work started");
  }
  return absl::OkStatus();
}

int TransportReceiveLimit(int64_t max_message_bytes) {
  return static_cast<int>(
      std::min<int64_t>(2 * max_message_bytes, std::numeric_limits<int32_t>::max()));
}

absl::Status VerifyServiceImpl::CheckRequestSize(absl::string_view rpc, size_t bytes) const {
  if (bytes <= static_cast<size_t>(options_.max_message_bytes)) return absl::OkStatus();
  if (observer_ != nullptr) observer_->OnOversizedRequest(rpc);
  return absl::ResourceExhaustedError(absl::StrCat(
      rpc, " request of ", bytes, " bytes is over the server's max_message_bytes ",
      options_.max_message_bytes, " (GetServerInfo): send fewer items or tokens per message"));
}

void VerifyServiceImpl::LogFailedCall(absl::string_view rpc, grpc::CallbackServerContext* ctx,
                                      const absl::Status& status) {
  if (status.ok() || status.code() == absl::StatusCode::kNotFound) return;
  if (const std::optional<int64_t> held = failed_calls_log_.Allow(Clock::now())) {
    const std::string peer = ctx->peer();
    const std::string code = absl::StatusCodeToString(status.code());
    LogFields call;
    call.rpc = rpc;
    call.code = code;
    call.peer = peer;
    const ScopedLogFields fields(call);
    spdlog::warn("{} from {}: {}{}", std::string(rpc), peer, status.ToString(),
                 *held > 0 ? absl::StrCat(" (", *held,
                                          " more failed calls since the last "
                                          "such line, not logged)")
                           : std::string());
  }
}

void VerifyServiceImpl::Observe(absl::string_view rpc, grpc::StatusCode code,
                                Clock::time_point arrived, double queued_seconds) {
  const Clock::time_point now = Clock::now();
  const double total = std::chrono::duration<double>(now - arrived).count();
  if (observer_ != nullptr) observer_->OnRpc(rpc, code, total);
  slow_calls_.Report(rpc, GrpcCodeName(code), queued_seconds, total - queued_seconds, now);
}

void VerifyServiceImpl::RecordVerifySplit(const engine::VerifyTiming& timing,
                                          Clock::time_point arrived) {
  const auto ns = [](double seconds) { return static_cast<int64_t>(seconds * 1e9); };
  verify_timed_.fetch_add(1, std::memory_order_relaxed);
  verify_server_ns_.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - arrived).count(),
      std::memory_order_relaxed);
  verify_queue_ns_.fetch_add(ns(timing.queue_seconds), std::memory_order_relaxed);
  verify_device_ns_.fetch_add(ns(timing.device_seconds), std::memory_order_relaxed);
}

template <typename Request, typename Response, typename Body>
grpc::ServerUnaryReactor* VerifyServiceImpl::RunUnary(absl::string_view rpc,
                                                      grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* request_bytes,
                                                      grpc::ByteBuffer* response_bytes,
                                                      bool allowed_while_draining, Body body) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const Clock::time_point arrived = Clock::now();
  in_flight_.fetch_add(1);
  // The decoded request lives until the call is finished; the response
  // until gRPC wrote it (its encoding references its large fields in place).
  struct Messages {
    Request request;
    std::shared_ptr<Response> response = std::make_shared<Response>();
  };
  auto* messages = new Messages;
  auto finish = [this, rpc, ctx, reactor, arrived, messages, response_bytes](absl::Status status,
                                                                             double queued = 0) {
    if (status.ok()) status = EncodeInPlace(std::move(messages->response), response_bytes);
    delete messages;
    in_flight_.fetch_sub(1);
    finished_.fetch_add(1);
    const grpc::Status reply = ToGrpcStatus(status);
    LogFailedCall(rpc, ctx, status);
    Observe(rpc, reply.error_code(), arrived, queued);
    reactor->Finish(reply);
  };
  absl::Status admitted = Admit(ctx, allowed_while_draining);
  if (admitted.ok()) admitted = CheckRequestSize(rpc, request_bytes->Length());
  if (admitted.ok()) admitted = Decode(rpc, *request_bytes, &messages->request);
  // A message missing or cut short because the client went away is a
  // cancellation, not bad input.
  if (!admitted.ok() && ctx->IsCancelled()) {
    admitted = absl::CancelledError("the client cancelled the call");
  }
  if (!admitted.ok()) {
    finish(std::move(admitted));
  } else {
    body(messages->request, messages->response.get(), std::move(finish));
  }
  return reactor;
}

grpc::ServerUnaryReactor* VerifyServiceImpl::GetServerInfo(grpc::CallbackServerContext* ctx,
                                                           const grpc::ByteBuffer* request_bytes,
                                                           grpc::ByteBuffer* response_bytes) {
  return RunUnary<v1::GetServerInfoRequest, v1::ServerInfo>(
      "GetServerInfo", ctx, request_bytes, response_bytes, /*allowed_while_draining=*/true,
      [this](const auto& /*request*/, auto* r, auto finish) {
        const engine::Engine& e = *engine();
        const engine::EngineConfig& c = e.config();
        const engine::EngineStats s = e.Stats();
        r->set_version(options_.version);
        r->set_backend(e.backend_name());
        for (const auto& d : e.devices()) {
          v1::DeviceInfo* info = r->add_devices();
          info->set_name(d.name);
          info->set_memory_bytes(d.memory_bytes);
        }
        r->set_num_layers(c.num_layers);
        r->set_num_heads(c.num_heads);
        r->set_latent_dim(kLatentDim);
        r->set_value_dim(kValueDim);
        r->set_rope_dim(kRopeDim);
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
        r->set_parallel_mode(engine::ParallelModeName(c.parallel_mode));
        r->set_heads_per_device(e.heads_per_device());
        for (const engine::PoolStats& p : s.pools) {
          v1::PoolInfo* pool = r->add_pools();
          pool->set_devices(p.devices);
          pool->set_total_pages(p.total_pages);
          pool->set_free_pages(p.free_pages);
          pool->set_live_sequences(p.live_sequences);
        }
        r->set_cuda_graphs(e.graphs_enabled());
        r->set_max_queued_calls(c.max_queued_calls);
        r->set_max_queued_bytes(c.max_queued_bytes);
        r->set_max_live_sequences(c.max_live_sequences);
        r->set_instance_id(e.instance_id());
        r->set_kv_dtype(KvDtypeName(c.kv_dtype));
        r->set_kv_row_bytes(KvRowBytes(c.kv_dtype));
        r->set_client_shared_memory(e.regions().enabled());
        r->set_verify_calls_timed(verify_timed_.load());
        r->set_verify_server_seconds_total(verify_server_ns_.load() * 1e-9);
        r->set_verify_queue_seconds_total(verify_queue_ns_.load() * 1e-9);
        r->set_verify_device_seconds_total(verify_device_ns_.load() * 1e-9);
        r->set_step_lanes_per_device(c.steps.lanes_per_device);
        r->set_step_layer_timeout_ms(absl::ToInt64Milliseconds(c.steps.default_layer_timeout));
        r->set_step_max_duration_ms(absl::ToInt64Milliseconds(c.steps.default_max_duration));
        r->set_host_doorbells(e.DoorbellSupport(engine::DoorbellKind::kHost).ok());
        r->set_gpu_doorbells(e.DoorbellSupport(engine::DoorbellKind::kDevice).ok());
        finish(absl::OkStatus());
      });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::CreateSequence(grpc::CallbackServerContext* ctx,
                                                            const grpc::ByteBuffer* request_bytes,
                                                            grpc::ByteBuffer* response_bytes) {
  return RunUnary<v1::CreateSequenceRequest, v1::CreateSequenceResponse>(
      "CreateSequence", ctx, request_bytes, response_bytes, false,
      [this](const auto& request, auto* response, auto finish) {
        absl::StatusOr<uint64_t> id = engine()->CreateSequence(request.label());
        if (id.ok()) response->set_sequence_id(*id);
        finish(id.status());
      });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::AppendKv(grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* request_bytes,
                                                      grpc::ByteBuffer* response_bytes) {
  return RunUnary<v1::AppendKvRequest, v1::AppendKvResponse>(
      "AppendKv", ctx, request_bytes, response_bytes, false,
      [this, ctx](const auto& request, auto* response, auto finish) {
        if (NamesRegion(request.kv())) {
          if (absl::Status local = CheckLocalPeer(ctx, "an AppendKv naming a region");
              !local.ok()) {
            return finish(local);
          }
        }
        engine::AppendCall call;
        call.sequence_id = request.sequence_id();
        call.start_position = request.start_position();
        call.kv = ToTensorRef(request.kv());  // T comes from its shape (the engine checks it)
        call.context = ContextOf(ctx);
        engine()->SubmitAppendKv(std::move(call), [response, finish = std::move(finish)](
                                                      absl::StatusOr<int64_t> length) mutable {
          if (length.ok()) response->set_length(*length);
          finish(length.status());
        });
      });
}

absl::Status VerifyServiceImpl::CheckAnswerSize(const v1::VerifyRequest& request,
                                                int64_t heads) const {
  // Protobuf framing around the tensor bytes, rounded up: per result its ids
  // and two labelled tensors (dtype, shape, length prefixes), per answer its
  // ids. An over-estimate refuses only answers within bytes of the limit.
  constexpr int64_t kPerResult = 192, kPerAnswer = 64;
  int64_t bytes = kPerAnswer;
  for (const v1::VerifyItem& item : request.items()) {
    const int64_t rows = static_cast<int64_t>(item.parents_size()) * heads;
    bytes += kPerResult;
    if (!item.has_out_shared_memory())
      bytes += rows * kValueDim * static_cast<int64_t>(sizeof(Bf16));
    if (!item.has_lse_shared_memory()) bytes += rows * static_cast<int64_t>(sizeof(float));
  }
  if (bytes <= options_.max_message_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the inline answer (out and lse of ", request.items_size(), " items) would be about ", bytes,
      " bytes, over the server's max_message_bytes ", options_.max_message_bytes,
      " (GetServerInfo): put out and lse in shared memory or send fewer items per call"));
}

void VerifyServiceImpl::StartVerify(grpc::CallbackServerContext* ctx,
                                    const v1::VerifyRequest& request, v1::VerifyResponse* response,
                                    std::vector<engine::VerifyItem>* items,
                                    engine::VerifyTiming* timing, Finisher done,
                                    const absl::Status* local_peer) {
  const int64_t heads = engine()->config().num_heads;
  // Checked before the engine sees the call: an answer gRPC would refuse to
  // send must not open steps or take pages first.
  if (absl::Status fits = CheckAnswerSize(request, heads); !fits.ok()) return done(fits);
  if (NamesRegion(request)) {
    absl::Status local =
        local_peer != nullptr ? *local_peer : CheckLocalPeer(ctx, "a Verify naming a region");
    if (!local.ok()) return done(std::move(local));
  }
  response->set_request_id(request.request_id());
  response->set_layer(request.layer());
  // Each Tensor becomes a reference the engine checks (once, for every data
  // plane); inline outputs go into the response's results, which the engine
  // fills only once the call passed its checks.
  items->resize(request.items_size());
  response->mutable_results()->Reserve(request.items_size());
  for (int k = 0; k < request.items_size(); ++k) {
    const v1::VerifyItem& in = request.items(k);
    v1::VerifyResult* result = response->add_results();
    engine::VerifyItem& item = (*items)[k];
    item.sequence_id = in.sequence_id();
    item.parents = absl::MakeConstSpan(in.parents().data(), in.parents_size());
    item.q = ToTensorRef(in.q());
    item.draft_kv = ToTensorRef(in.draft_kv());
    item.out =
        ToOutputRef(in.has_out_shared_memory(), in.out_shared_memory(), result->mutable_out());
    item.lse =
        ToOutputRef(in.has_lse_shared_memory(), in.lse_shared_memory(), result->mutable_lse());
  }
  engine::VerifyCall call;
  call.layer = request.layer();
  call.softmax_scale = request.softmax_scale();
  call.items = absl::MakeSpan(*items);
  call.context = ContextOf(ctx);
  call.timing = timing;
  engine()->SubmitVerify(std::move(call), [&request, response, items, heads,
                                           done = std::move(done)](absl::Status status) mutable {
    if (status.ok()) {
      for (size_t k = 0; k < items->size(); ++k) {
        const v1::VerifyItem& in = request.items(static_cast<int>(k));
        const int64_t n = in.parents_size();
        v1::VerifyResult* result = response->mutable_results(static_cast<int>(k));
        result->set_sequence_id(in.sequence_id());
        result->set_prefix_len((*items)[k].prefix_len);
        LabelOutput(result->mutable_out(), v1::DTYPE_BF16, {n, heads, kValueDim},
                    in.has_out_shared_memory() ? &in.out_shared_memory() : nullptr);
        LabelOutput(result->mutable_lse(), v1::DTYPE_FP32, {n, heads},
                    in.has_lse_shared_memory() ? &in.lse_shared_memory() : nullptr);
      }
    }
    done(std::move(status));
  });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::Verify(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* request_bytes,
                                                    grpc::ByteBuffer* response_bytes) {
  const Clock::time_point arrived = Clock::now();
  return RunUnary<v1::VerifyRequest, v1::VerifyResponse>(
      "Verify", ctx, request_bytes, response_bytes, false,
      [this, ctx, arrived](const auto& request, auto* response, auto finish) {
        // The items and the time split live until the engine is done with them.
        struct State {
          std::vector<engine::VerifyItem> items;
          engine::VerifyTiming timing;
        };
        auto* state = new State;
        StartVerify(
            ctx, request, response, &state->items, &state->timing,
            [this, state, arrived, finish = std::move(finish)](absl::Status status) mutable {
              if (status.ok()) RecordVerifySplit(state->timing, arrived);
              const double queued = state->timing.queue_seconds;
              delete state;
              finish(std::move(status), queued);
            });
      });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::Commit(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* request_bytes,
                                                    grpc::ByteBuffer* response_bytes) {
  return RunUnary<v1::CommitRequest, v1::CommitResponse>(
      "Commit", ctx, request_bytes, response_bytes, false,
      [this](const auto& request, auto* response, auto finish) {
        engine()->SubmitCommit(
            request.sequence_id(),
            absl::MakeConstSpan(request.accepted().data(), request.accepted_size()),
            [response, finish = std::move(finish)](absl::StatusOr<engine::CommitResult> r) mutable {
              if (r.ok()) {
                response->set_length(r->length);
                response->set_accepted_count(r->accepted_count);
              }
              finish(r.status());
            });
      });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::ReleaseSequence(grpc::CallbackServerContext* ctx,
                                                             const grpc::ByteBuffer* request_bytes,
                                                             grpc::ByteBuffer* response_bytes) {
  // Allowed while draining: a scheduler cleaning up frees pages sooner.
  return RunUnary<v1::ReleaseSequenceRequest, v1::ReleaseSequenceResponse>(
      "ReleaseSequence", ctx, request_bytes, response_bytes, true,
      [this](const auto& request, auto* response, auto finish) {
        engine()->SubmitRelease(request.sequence_id(), [response, finish = std::move(finish)](
                                                           absl::StatusOr<int64_t> freed) mutable {
          if (freed.ok()) response->set_freed_pages(*freed);
          finish(freed.status());
        });
      });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::RegisterSystemSharedMemory(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request_bytes,
    grpc::ByteBuffer* response_bytes) {
  return RunUnary<v1::RegisterSystemSharedMemoryRequest, v1::RegisterSystemSharedMemoryResponse>(
      "RegisterSystemSharedMemory", ctx, request_bytes, response_bytes, false,
      [this, ctx](const auto& request, auto* /*response*/, auto finish) {
        if (absl::Status local = CheckLocalPeer(ctx, "shared-memory registration"); !local.ok())
          return finish(local);
        finish(engine()->regions().Register(request.name(), request.key(), request.offset(),
                                            request.byte_size()));
      });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::RegisterCudaSharedMemory(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request_bytes,
    grpc::ByteBuffer* response_bytes) {
  return RunUnary<v1::RegisterCudaSharedMemoryRequest, v1::RegisterCudaSharedMemoryResponse>(
      "RegisterCudaSharedMemory", ctx, request_bytes, response_bytes, false,
      [this, ctx](const auto& request, auto* /*response*/, auto finish) {
        if (absl::Status local = CheckLocalPeer(ctx, "CUDA shared-memory registration");
            !local.ok())
          return finish(local);
        finish(engine()->regions().RegisterCuda(request.name(), request.raw_handle(),
                                                request.device_id(), request.byte_size()));
      });
}

namespace {

// Unregister of either RPC: the names removed, or the error.
template <typename Response>
absl::Status Unregistered(absl::StatusOr<std::vector<std::string>> names, Response* response) {
  if (names.ok()) {
    for (std::string& n : *names) response->add_unregistered(std::move(n));
  }
  return names.status();
}

}  // namespace

grpc::ServerUnaryReactor* VerifyServiceImpl::UnregisterSystemSharedMemory(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request_bytes,
    grpc::ByteBuffer* response_bytes) {
  // Allowed while draining: a client cleaning up. (Regions of either kind,
  // as before CUDA regions had their own RPC.)
  return RunUnary<v1::UnregisterSystemSharedMemoryRequest,
                  v1::UnregisterSystemSharedMemoryResponse>(
      "UnregisterSystemSharedMemory", ctx, request_bytes, response_bytes, true,
      [this, ctx](const auto& request, auto* response, auto finish) {
        if (absl::Status local = CheckLocalPeer(ctx, "UnregisterSystemSharedMemory"); !local.ok())
          return finish(local);
        finish(Unregistered(
            engine()->regions().Unregister(request.name(), engine::RegionKind::kAny), response));
      });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::UnregisterCudaSharedMemory(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request_bytes,
    grpc::ByteBuffer* response_bytes) {
  return RunUnary<v1::UnregisterCudaSharedMemoryRequest, v1::UnregisterCudaSharedMemoryResponse>(
      "UnregisterCudaSharedMemory", ctx, request_bytes, response_bytes, true,
      [this, ctx](const auto& request, auto* response, auto finish) {
        if (absl::Status local = CheckLocalPeer(ctx, "UnregisterCudaSharedMemory"); !local.ok())
          return finish(local);
        finish(Unregistered(
            engine()->regions().Unregister(request.name(), engine::RegionKind::kCuda), response));
      });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::SystemSharedMemoryStatus(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request_bytes,
    grpc::ByteBuffer* response_bytes) {
  return RunUnary<v1::SystemSharedMemoryStatusRequest, v1::SystemSharedMemoryStatusResponse>(
      "SystemSharedMemoryStatus", ctx, request_bytes, response_bytes, true,
      [this, ctx](const auto& request, auto* response, auto finish) {
        if (absl::Status local = CheckLocalPeer(ctx, "SystemSharedMemoryStatus"); !local.ok())
          return finish(local);
        absl::StatusOr<std::vector<engine::RegionStatus>> regions =
            engine()->regions().Status(request.name(), engine::RegionKind::kAny);
        if (regions.ok()) {
          for (const engine::RegionStatus& r : *regions) {
            v1::SystemSharedMemoryRegion* out = response->add_regions();
            out->set_name(r.name);
            out->set_key(r.key);
            out->set_offset(r.offset);
            out->set_byte_size(r.byte_size);
            out->set_calls_in_flight(r.calls_in_flight);
            out->set_calls_total(r.calls_total);
            out->set_pinned(r.pinned);
            out->set_cuda(r.cuda);
            out->set_device_id(r.device_id);
          }
        }
        finish(regions.status());
      });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::CudaSharedMemoryStatus(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request_bytes,
    grpc::ByteBuffer* response_bytes) {
  return RunUnary<v1::CudaSharedMemoryStatusRequest, v1::CudaSharedMemoryStatusResponse>(
      "CudaSharedMemoryStatus", ctx, request_bytes, response_bytes, true,
      [this, ctx](const auto& request, auto* response, auto finish) {
        if (absl::Status local = CheckLocalPeer(ctx, "CudaSharedMemoryStatus"); !local.ok())
          return finish(local);
        absl::StatusOr<std::vector<engine::RegionStatus>> regions =
            engine()->regions().Status(request.name(), engine::RegionKind::kCuda);
        if (regions.ok()) {
          for (const engine::RegionStatus& r : *regions) {
            v1::CudaSharedMemoryRegion* out = response->add_regions();
            out->set_name(r.name);
            out->set_device_id(r.device_id);
            out->set_byte_size(r.byte_size);
            out->set_calls_in_flight(r.calls_in_flight);
            out->set_calls_total(r.calls_total);
          }
        }
        finish(regions.status());
      });
}

// Reads ahead up to stream_max_in_flight requests, submits each to the
// engine as it arrives, and writes the answers in request order, one write at
// a time. A failed request (also one whose bytes do not parse) is answered
// with its status in the response; the stream ends when the client
// half-closes (after the last answer) or breaks.
// An answer the client has not read yet is held encoded, its request and
// items already freed, and its bytes count against the engine's
// --max-queued-bytes until written: a client that never reads stops new work
// from being admitted instead of growing the server's memory.
// Start* and Finish are called without the reactor's lock held; the flags
// set under it keep one read and one write outstanding at most.
class VerifyServiceImpl::StreamReactor final
    : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // Registered in the service's streams_ by the caller, before Begin().
  StreamReactor(VerifyServiceImpl* service, grpc::CallbackServerContext* ctx, std::string peer)
      : service_(service),
        ctx_(ctx),
        peer_(std::move(peer)),
        local_peer_(CheckLocalPeer(ctx, peer_, "a VerifyStream request naming a region")),
        max_in_flight_(std::max(1, service->options_.stream_max_in_flight)),
        last_active_(Clock::now()) {}

  void Begin() {
    grpc::ByteBuffer* request = nullptr;
    {
      absl::MutexLock lock(&mu_);
      reading_ = std::make_unique<Slot>();
      request = &reading_->request_bytes;
      read_outstanding_ = true;
    }
    StartRead(request);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // client half-closed (or the call broke): no more requests
      bool finish = false;
      {
        absl::MutexLock lock(&mu_);
        read_outstanding_ = false;
        read_closed_ = true;
        reading_.reset();
        finish = ReadyToFinish();
      }
      if (finish) Finish(FinalStatus());
      return;
    }
    const Clock::time_point arrived = Clock::now();
    Slot* slot = nullptr;
    grpc::ByteBuffer* next_request = nullptr;  // the next read's target, if one starts
    {
      absl::MutexLock lock(&mu_);
      last_active_ = arrived;
      read_outstanding_ = false;
      if (finished_) return;  // the stream already ended (drain): the request is dropped
      slot = reading_.get();
      slot->arrived = arrived;
      slots_.push_back(std::move(reading_));
      const bool read_more =
          !broken_ && !draining_ && static_cast<int>(slots_.size()) < max_in_flight_;
      read_outstanding_ = read_more;
      if (read_more) {
        reading_ = std::make_unique<Slot>();
        next_request = &reading_->request_bytes;
      } else {
        read_paused_ = true;
      }
    }
    Start(slot);
    if (next_request != nullptr) StartRead(next_request);
  }

  void OnWriteDone(bool ok) override {
    const grpc::ByteBuffer* next = nullptr;
    grpc::ByteBuffer* resume_read = nullptr;  // the resumed read's target
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      last_active_ = Clock::now();
      writing_ = false;
      PopAnswered();
      if (!ok) broken_ = true;
      if (broken_) {
        while (!slots_.empty() && slots_.front()->done) PopAnswered();
      } else if (!slots_.empty() && slots_.front()->done) {
        writing_ = true;
        next = &slots_.front()->answer;
      }
      if (read_paused_ && !read_closed_ && !broken_ && !draining_ &&
          static_cast<int>(slots_.size()) < max_in_flight_) {
        read_paused_ = false;
        read_outstanding_ = true;
        reading_ = std::make_unique<Slot>();
        resume_read = &reading_->request_bytes;
      }
      finish = ReadyToFinish();
    }
    if (next != nullptr) StartWrite(next);
    if (resume_read != nullptr) StartRead(resume_read);
    if (finish) Finish(FinalStatus());
  }

  void OnDone() override {
    {
      absl::MutexLock lock(&service_->streams_mu_);
      service_->streams_.erase(this);
      auto it = service_->streams_per_peer_.find(peer_);
      if (it != service_->streams_per_peer_.end() && --it->second <= 0) {
        service_->streams_per_peer_.erase(it);
      }
    }
    {
      // Answers still owed when the stream ended (it broke with writes
      // queued): their held bytes go back to the budget.
      absl::MutexLock lock(&mu_);
      while (!slots_.empty()) PopAnswered();
    }
    delete this;
  }

  // The server drains: no more reads; end now if nothing is owed, else once
  // the owed answers are written. Called with the service's streams_mu_ held
  // (so the reactor cannot be deleted meanwhile).
  void BeginDrain() {
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      draining_ = true;
      finish = ReadyToFinish();
    }
    if (finish) Finish(FinalStatus());
  }

  // Ends the stream (UNAVAILABLE) when nothing is in flight and nothing
  // happened on it since `cutoff`; true if it ends. Called with the
  // service's streams_mu_ held, like BeginDrain.
  bool EndIfIdleSince(Clock::time_point cutoff) {
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || draining_ || !slots_.empty() || writing_ || last_active_ >= cutoff) {
        return false;
      }
      draining_ = true;
      idle_ended_ = true;
      if (!ReadyToFinish()) return false;
    }
    Finish(FinalStatus());
    return true;
  }

 private:
  struct Slot {
    grpc::ByteBuffer request_bytes;
    v1::VerifyRequest request;
    // Handed to the encoded answer, which references its out tensors.
    std::shared_ptr<v1::VerifyResponse> response = std::make_shared<v1::VerifyResponse>();
    std::vector<engine::VerifyItem> items;
    engine::VerifyTiming timing;
    Clock::time_point arrived;
    // Set once done: the encoded answer, and the bytes of it counted in the
    // engine's queued bytes until it is written or dropped.
    grpc::ByteBuffer answer;
    int64_t held_bytes = 0;
    bool done = false;
  };

  // Drops the oldest slot, answered (written, or not to be written), and
  // gives its held bytes back to the engine's budget.
  void PopAnswered() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (slots_.front()->held_bytes > 0) {
      service_->engine()->ReleaseAnswerBytes(slots_.front()->held_bytes);
    }
    slots_.pop_front();
  }

  // Submits one request; its completion queues the answer.
  void Start(Slot* slot) {
    service_->in_flight_.fetch_add(1);
    auto complete = [this, slot](absl::Status status) {
      service_->in_flight_.fetch_sub(1);
      service_->finished_.fetch_add(1);
      Completed(slot, std::move(status));
    };
    // Decoded first: every answer, a refusal too, carries its request_id.
    const size_t bytes = slot->request_bytes.Length();
    absl::Status admitted = Decode("VerifyStream", slot->request_bytes, &slot->request);
    slot->request_bytes.Clear();
    if (admitted.ok()) admitted = service_->Admit(ctx_, /*allowed_while_draining=*/false);
    if (admitted.ok()) admitted = service_->CheckRequestSize("VerifyStream", bytes);
    if (!admitted.ok()) return complete(admitted);
    service_->StartVerify(ctx_, slot->request, slot->response.get(), &slot->items, &slot->timing,
                          std::move(complete), &local_peer_);
  }

  void Completed(Slot* slot, absl::Status status) {
    if (status.ok()) service_->RecordVerifySplit(slot->timing, slot->arrived);
    service_->LogFailedCall("VerifyStream", ctx_, status);
    if (!status.ok()) {
      v1::VerifyResponse& response = *slot->response;
      response.Clear();
      response.set_request_id(slot->request.request_id());
      response.set_layer(slot->request.layer());
      response.set_error_code(static_cast<int32_t>(status.code()));
      response.set_error_message(std::string(status.message()));
    }
    service_->Observe("VerifyStream", ToGrpcStatus(status).error_code(), slot->arrived,
                      slot->timing.queue_seconds);
    if (absl::Status encoded = EncodeInPlace(std::move(slot->response), &slot->answer);
        !encoded.ok()) {
      spdlog::error("VerifyStream: {}", encoded.ToString());  // the client sees the stream break
    }
    // Only the encoded answer (and the response it references) waits for
    // the client.
    v1::VerifyRequest().Swap(&slot->request);
    std::vector<engine::VerifyItem>().swap(slot->items);
    engine::Engine* engine = service_->engine();
    if (engine != nullptr) {
      slot->held_bytes = static_cast<int64_t>(slot->answer.Length());
      engine->HoldAnswerBytes(slot->held_bytes);
    }
    const grpc::ByteBuffer* write = nullptr;
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      slot->done = true;
      if (broken_ || finished_) {
        // No more writes: drop answers in order until the stream can end.
        while (!slots_.empty() && slots_.front()->done) PopAnswered();
        finish = ReadyToFinish();
      } else if (!writing_ && slots_.front()->done) {
        writing_ = true;
        write = &slots_.front()->answer;
      }
    }
    if (write != nullptr) StartWrite(write);
    if (finish) Finish(FinalStatus());
  }

  // Every request answered (or dropped once the stream broke), no write
  // outstanding, and no more requests to read: the client half-closed, the
  // stream broke, or the server drains (a read still outstanding then ends
  // with the stream).
  bool ReadyToFinish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_ || !slots_.empty()) return false;
    if (draining_) {
      finished_ = true;
      return true;
    }
    if (read_outstanding_ || (!read_closed_ && !broken_)) return false;
    finished_ = true;
    return true;
  }

  grpc::Status FinalStatus() {
    absl::MutexLock lock(&mu_);
    if (broken_) return grpc::Status(grpc::StatusCode::CANCELLED, "stream write failed");
    if (idle_ended_ && !read_closed_) {
      return grpc::Status(
          grpc::StatusCode::UNAVAILABLE,
          absl::StrCat("VerifyStream idle for ",
                       absl::FormatDuration(service_->options_.stream_idle_timeout),
                       " (the server's --stream-idle-timeout-s): open a new stream"));
    }
    if (draining_ && !read_closed_) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "server is draining: open a stream to another replica");
    }
    return grpc::Status::OK;
  }

  VerifyServiceImpl* const service_;
  grpc::CallbackServerContext* const ctx_;
  const std::string peer_;  // the connection, for the per-connection count
  // Whether requests naming a region may come here: a stream's peer and
  // metadata are the same for its life, so it is worked out once.
  const absl::Status local_peer_;
  const int max_in_flight_;
  absl::Mutex mu_;
  // The last request read or answer written (the stream's start before).
  Clock::time_point last_active_ ABSL_GUARDED_BY(mu_);
  bool idle_ended_ ABSL_GUARDED_BY(mu_) = false;  // draining_ set by EndIfIdleSince
  // The slot the outstanding read fills. Replaced under mu_ only by whoever
  // starts the next read (read_outstanding_ false before, true after), which
  // takes the request's address under mu_ and calls StartRead after
  // unlocking; while that read is outstanding nothing else replaces it.
  std::unique_ptr<Slot> reading_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);  // answers owed, in order
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool read_outstanding_ ABSL_GUARDED_BY(mu_) = false;
  bool read_paused_ ABSL_GUARDED_BY(mu_) = false;
  bool read_closed_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

int64_t VerifyServiceImpl::EndStreams() {
  absl::MutexLock lock(&streams_mu_);
  for (StreamReactor* stream : streams_) stream->BeginDrain();
  return static_cast<int64_t>(streams_.size());
}

int64_t VerifyServiceImpl::EndIdleStreams(Clock::time_point now) {
  if (options_.stream_idle_timeout <= absl::ZeroDuration()) return 0;
  const Clock::time_point cutoff = now - absl::ToChronoNanoseconds(options_.stream_idle_timeout);
  int64_t ended = 0;
  absl::MutexLock lock(&streams_mu_);
  for (StreamReactor* stream : streams_) {
    if (stream->EndIfIdleSince(cutoff)) ++ended;
  }
  if (ended > 0) {
    spdlog::info("{} idle VerifyStream(s) ended (--stream-idle-timeout-s {})", ended,
                 absl::ToDoubleSeconds(options_.stream_idle_timeout));
  }
  return ended;
}

namespace {

// A VerifyStream refused before it started: ends at once with `status`.
class RefusedStream final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit RefusedStream(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* VerifyServiceImpl::VerifyStream(
    grpc::CallbackServerContext* ctx) {
  // The token and the serving state are checked before the stream takes a
  // slot: a client without the token cannot hold the scheduler's.
  if (absl::Status admitted = Admit(ctx, /*allowed_while_draining=*/false); !admitted.ok()) {
    LogFailedCall("VerifyStream", ctx, admitted);
    Observe("VerifyStream", ToGrpcStatus(admitted).error_code(), Clock::now(), 0);
    return new RefusedStream(ToGrpcStatus(admitted));
  }
  std::string peer = ctx->peer();
  StreamReactor* stream = nullptr;
  int64_t open = 0;
  int on_connection = 0;
  {
    absl::MutexLock lock(&streams_mu_);
    open = static_cast<int64_t>(streams_.size());
    int& count = streams_per_peer_[peer];
    on_connection = count;
    if (open < options_.max_streams && count < options_.max_streams_per_connection) {
      ++count;
      stream = new StreamReactor(this, ctx, std::move(peer));
      streams_.insert(stream);
    } else if (count == 0) {
      streams_per_peer_.erase(peer);
    }
  }
  if (stream != nullptr) {
    stream->Begin();
    return stream;
  }
  const absl::Status refused =
      open >= options_.max_streams
          ? absl::ResourceExhaustedError(
                absl::StrCat(open, " VerifyStreams are open, the server's limit (--max-streams ",
                             options_.max_streams, "): close idle streams or use another replica"))
          : absl::ResourceExhaustedError(
                absl::StrCat(on_connection,
                             " VerifyStreams are open on this connection, the server's limit "
                             "(--max-streams-per-connection ",
                             options_.max_streams_per_connection,
                             "): spread streams over more connections or close idle ones"));
  LogFailedCall("VerifyStream", ctx, refused);
  Observe("VerifyStream", grpc::StatusCode::RESOURCE_EXHAUSTED, Clock::now(), 0);
  return new RefusedStream(ToGrpcStatus(refused));
}

grpc::ServerUnaryReactor* VerifyServiceImpl::OpenStep(grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* request_bytes,
                                                      grpc::ByteBuffer* response_bytes) {
  return RunUnary<v1::OpenStepRequest, v1::OpenStepResponse>(
      "OpenStep", ctx, request_bytes, response_bytes, false,
      [this, ctx](const auto& request, auto* response, auto finish) {
        // A step's slots and tensors are memory both processes map.
        if (absl::Status local = CheckLocalPeer(ctx, "OpenStep"); !local.ok()) return finish(local);
        absl::StatusOr<engine::StepRequest> step = ToStepRequest(request);
        if (!step.ok()) return finish(step.status());
        absl::StatusOr<engine::StepOpened> opened = engine()->OpenStep(*step);
        if (!opened.ok()) return finish(opened.status());
        response->set_step_id(opened->step_id);
        response->set_num_layers(opened->num_layers);
        for (int64_t p : opened->prefix_len) response->add_prefix_len(p);
        for (const engine::StepRankDoorbell& db : opened->ranks) {
          v1::StepRankDoorbell* out = response->add_ranks();
          out->set_device_id(db.cuda_device);
          out->set_base(db.base);
          out->set_arena_handle(db.arena_ipc_handle);
          out->set_arena_bytes(db.arena_bytes);
          out->set_doorbell_offset(db.doorbell_offset);
          out->set_completion_offset(db.completion_offset);
        }
        response->set_layer_timeout_ms(
            static_cast<uint32_t>(absl::ToInt64Milliseconds(opened->layer_timeout)));
        response->set_max_duration_ms(
            static_cast<uint32_t>(absl::ToInt64Milliseconds(opened->max_duration)));
        finish(absl::OkStatus());
      });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::AbortStep(grpc::CallbackServerContext* ctx,
                                                       const grpc::ByteBuffer* request_bytes,
                                                       grpc::ByteBuffer* response_bytes) {
  // Allowed while draining: a scheduler cleaning up ends its steps sooner.
  return RunUnary<v1::AbortStepRequest, v1::StepStatus>(
      "AbortStep", ctx, request_bytes, response_bytes, true,
      [this](const auto& request, auto* response, auto finish) {
        engine()->SubmitAbortStep(
            request.step_id(),
            [response, finish = std::move(finish)](absl::StatusOr<engine::StepInfo> info) mutable {
              if (info.ok()) ToStepStatus(*info, response);
              finish(info.status());
            });
      });
}

grpc::ServerUnaryReactor* VerifyServiceImpl::GetStep(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* request_bytes,
                                                     grpc::ByteBuffer* response_bytes) {
  return RunUnary<v1::GetStepRequest, v1::StepStatus>(
      "GetStep", ctx, request_bytes, response_bytes, true,
      [this](const auto& request, auto* response, auto finish) {
        absl::StatusOr<engine::StepInfo> info = engine()->GetStep(request.step_id());
        if (info.ok()) ToStepStatus(*info, response);
        finish(info.status());
      });
}

}  // namespace mlaverify::transport
