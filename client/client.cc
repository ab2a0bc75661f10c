#include "client/client.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/geometry.h"
#include "common/small_file.h"
#include "common/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace mlaverify::client {
namespace {

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeCredentials(
    const ClientOptions& options) {
  const bool want_tls = options.use_tls || !options.tls_root_ca_file.empty() ||
                        !options.tls_cert_chain_file.empty() ||
                        !options.tls_private_key_file.empty();
  if (!want_tls) return grpc::InsecureChannelCredentials();
  if (options.tls_cert_chain_file.empty() != options.tls_private_key_file.empty()) {
    return absl::InvalidArgumentError(
        "mTLS needs both a client certificate and its private key; got only one of them");
  }
  grpc::SslCredentialsOptions ssl;
  if (!options.tls_root_ca_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_root_certs,
                     ReadSmallFile(options.tls_root_ca_file, kMaxPemFileBytes, "TLS root CA"));
  }
  if (!options.tls_cert_chain_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadSmallFile(options.tls_cert_chain_file,
                                                       kMaxPemFileBytes, "TLS client certificate"));
    ASSIGN_OR_RETURN(
        ssl.pem_private_key,
        ReadSmallFile(options.tls_private_key_file, kMaxPemFileBytes, "TLS client private key"));
  }
  return grpc::SslCredentials(ssl);
}

// gRPC channel arguments are ints; a limit above INT_MAX means "no limit"
// for practical purposes.
int ClampToInt(int64_t bytes) { return static_cast<int>(std::min<int64_t>(bytes, INT_MAX)); }

std::chrono::system_clock::time_point DeadlineAfter(absl::Duration timeout) {
  return std::chrono::system_clock::now() +
         std::chrono::microseconds(absl::ToInt64Microseconds(timeout));
}

}  // namespace

struct Connection {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::VerifyService::Stub> stub;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_stub;
  std::atomic<int64_t> calls{0}, failed{0}, streams_opened{0};
};

absl::string_view ServingStatusName(ServingStatus status) {
  switch (status) {
    case ServingStatus::kServing:
      return "SERVING";
    case ServingStatus::kNotServing:
      return "NOT_SERVING";
    case ServingStatus::kServiceUnknown:
      return "SERVICE_UNKNOWN";
    case ServingStatus::kUnknown:
      break;
  }
  return "UNKNOWN";
}

// ---- VerifyStreamSession ----------------------------------------------------

VerifyStreamSession::~VerifyStreamSession() {
  if (final_status_.has_value() || stream_ == nullptr) return;
  Abandon(absl::CancelledError("VerifyStream session destroyed")).IgnoreError();
}

absl::StatusOr<std::vector<VerifyItemResult>> VerifyStreamSession::Verify(
    int layer, absl::Span<const VerifyItemInput> items, float softmax_scale) {
  absl::StatusOr<std::vector<VerifyItemResult>> results =
      VerifyOnStream(layer, items, softmax_scale);
  connection_->calls.fetch_add(1, std::memory_order_relaxed);
  if (!results.ok()) connection_->failed.fetch_add(1, std::memory_order_relaxed);
  return results;
}

absl::StatusOr<std::vector<VerifyItemResult>> VerifyStreamSession::VerifyOnStream(
    int layer, absl::Span<const VerifyItemInput> items, float softmax_scale) {
  if (final_status_.has_value()) {
    if (!final_status_->ok()) return *final_status_;
    return absl::FailedPreconditionError("VerifyStream is closed");
  }
  ASSIGN_OR_RETURN(v1::VerifyRequest request,
                   BuildVerifyRequest(layer, items, softmax_scale, next_request_id_++));
  if (!stream_->Write(request)) {
    return Break(absl::UnavailableError(
        absl::StrCat("VerifyStream write of request ", request.request_id(), " failed")));
  }
  v1::VerifyResponse response;
  if (!stream_->Read(&response)) {
    return Break(absl::UnavailableError(
        absl::StrCat("VerifyStream ended before answering request ", request.request_id())));
  }
  if (response.request_id() != request.request_id()) {
    // The stream is answered in order; anything else means the two sides no
    // longer agree on which answer belongs to which request.
    return Abandon(absl::InternalError(absl::StrCat("VerifyStream answered request ",
                                                    response.request_id(), " while request ",
                                                    request.request_id(), " was outstanding")));
  }
  if (response.error_code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(response.error_code()),
                        response.error_message());
  }
  return ParseVerifyResponse(items, response);
}

absl::Status VerifyStreamSession::Break(absl::Status why) {
  // Drain so Finish sees the end of the stream, then prefer the server's
  // status (it says why the stream died) over the local description.
  v1::VerifyResponse ignored;
  while (stream_->Read(&ignored)) {
  }
  absl::Status server_status = FromGrpcStatus(stream_->Finish());
  final_status_ = server_status.ok() ? std::move(why) : std::move(server_status);
  return *final_status_;
}

absl::Status VerifyStreamSession::Abandon(absl::Status why) {
  context_.TryCancel();
  v1::VerifyResponse ignored;
  while (stream_->Read(&ignored)) {
  }
  stream_->Finish().IgnoreError();  // CANCELLED, by us
  final_status_ = std::move(why);
  return *final_status_;
}

absl::Status VerifyStreamSession::Close() {
  if (final_status_.has_value()) return final_status_->ok() ? absl::OkStatus() : *final_status_;
  stream_->WritesDone();
  v1::VerifyResponse unexpected;
  int extra_responses = 0;
  while (stream_->Read(&unexpected)) ++extra_responses;
  absl::Status status = FromGrpcStatus(stream_->Finish());
  if (status.ok() && extra_responses > 0) {
    status = absl::InternalError(
        absl::StrCat("VerifyStream sent ", extra_responses, " answers nobody asked for"));
  }
  final_status_ = status;
  return status;
}

// ---- VerifyClient -----------------------------------------------------------

absl::StatusOr<std::unique_ptr<VerifyClient>> VerifyClient::Create(std::string target,
                                                                   ClientOptions options) {
  if (target.empty()) return absl::InvalidArgumentError("target address is empty");
  if (options.connections < 1 || options.connections > kMaxConnections) {
    return absl::InvalidArgumentError(
        absl::StrCat("connections ", options.connections, ": need 1..", kMaxConnections));
  }
  const bool keepalive = options.keepalive_time != absl::InfiniteDuration();
  if (keepalive && (options.keepalive_time < absl::Milliseconds(1) ||
                    options.keepalive_timeout < absl::Milliseconds(1))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keepalive time ", absl::FormatDuration(options.keepalive_time), " and timeout ",
        absl::FormatDuration(options.keepalive_timeout), ": need both >= 1 ms"));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials, MakeCredentials(options));
  grpc::ChannelArguments arguments;
  arguments.SetMaxSendMessageSize(ClampToInt(options.max_send_message_bytes));
  arguments.SetMaxReceiveMessageSize(ClampToInt(options.max_receive_message_bytes));
  if (options.http2_max_frame_bytes > 0) {
    arguments.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, options.http2_max_frame_bytes);
  }
  if (options.http2_lookahead_bytes > 0) {
    arguments.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, options.http2_lookahead_bytes);
  }
  if (keepalive) {
    arguments.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS,
                     ClampToInt(absl::ToInt64Milliseconds(options.keepalive_time)));
    arguments.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                     ClampToInt(absl::ToInt64Milliseconds(options.keepalive_timeout)));
    arguments.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS,
                     options.keepalive_permit_without_calls ? 1 : 0);
    // gRPC stops pinging after 2 pings with no data sent by default, which
    // would leave an idle VerifyStream unguarded against an idle timeout.
    arguments.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    // ... and spaces pings without data at least 5 minutes apart, whatever
    // the keepalive time says.
    arguments.SetInt(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS,
                     ClampToInt(absl::ToInt64Milliseconds(options.keepalive_time)));
  }
  // Channels with equal arguments share one global subchannel pool, hence
  // one TCP connection; a pool of its own per channel makes each a real
  // connection (and the index tells them apart in channelz).
  arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::vector<std::unique_ptr<Connection>> connections;
  for (int i = 0; i < options.connections; ++i) {
    grpc::ChannelArguments own = arguments;
    own.SetInt("mlaverify.connection_index", i);
    auto connection = std::make_unique<Connection>();
    connection->channel = grpc::CreateCustomChannel(target, credentials, own);
    connection->stub = v1::VerifyService::NewStub(connection->channel);
    connection->health_stub = grpc::health::v1::Health::NewStub(connection->channel);
    connections.push_back(std::move(connection));
  }
  return std::unique_ptr<VerifyClient>(
      new VerifyClient(std::move(target), std::move(options), std::move(connections)));
}

VerifyClient::VerifyClient(std::string target, ClientOptions options,
                           std::vector<std::unique_ptr<Connection>> connections)
    : target_(std::move(target)),
      options_(std::move(options)),
      connections_(std::move(connections)) {}

VerifyClient::~VerifyClient() { CloseDoorbellArenas(); }

size_t VerifyClient::NextConnectionIndex() {
  return next_connection_.fetch_add(1, std::memory_order_relaxed) % connections_.size();
}

Connection& VerifyClient::NextConnection() { return *connections_[NextConnectionIndex()]; }

v1::VerifyService::Stub* VerifyClient::StubOf(Connection& connection) {
  return connection.stub.get();
}

void VerifyClient::CountCall(Connection& connection, bool ok) {
  connection.calls.fetch_add(1, std::memory_order_relaxed);
  if (!ok) connection.failed.fetch_add(1, std::memory_order_relaxed);
}

std::vector<ConnectionStats> VerifyClient::GetConnectionStats() const {
  std::vector<ConnectionStats> stats;
  for (const std::unique_ptr<Connection>& c : connections_) {
    stats.push_back({c->calls.load(std::memory_order_relaxed),
                     c->failed.load(std::memory_order_relaxed),
                     c->streams_opened.load(std::memory_order_relaxed)});
  }
  return stats;
}

void VerifyClient::PrepareContext(grpc::ClientContext* context, const CallOptions* call) const {
  const absl::Duration timeout = call != nullptr && call->timeout != absl::InfiniteDuration()
                                     ? call->timeout
                                     : options_.call_timeout;
  if (timeout != absl::InfiniteDuration()) context->set_deadline(DeadlineAfter(timeout));
  context->set_wait_for_ready(options_.wait_for_ready);
  AddMetadata(context, call);
}

void VerifyClient::AddMetadata(grpc::ClientContext* context, const CallOptions* call) const {
  const auto given = [call](absl::string_view key) {
    if (call == nullptr) return false;
    for (const auto& [k, v] : call->metadata) {
      if (absl::EqualsIgnoreCase(k, key)) return true;
    }
    return false;
  };
  if (!options_.auth_token.empty() && !given("authorization")) {
    context->AddMetadata("authorization", "Bearer " + options_.auth_token);
  }
  if (call == nullptr) return;
  // gRPC's metadata keys are lower case (a capital letter fails the call).
  for (const auto& [key, value] : call->metadata)
    context->AddMetadata(absl::AsciiStrToLower(key), value);
}

absl::StatusOr<v1::ServerInfo> VerifyClient::GetServerInfo() {
  ASSIGN_OR_RETURN(
      v1::ServerInfo info,
      Unary(NextConnection(), &v1::VerifyService::Stub::GetServerInfo, v1::GetServerInfoRequest()));
  absl::MutexLock lock(&mu_);
  server_message_limit_ = info.max_message_bytes();
  return info;
}

absl::StatusOr<ServingStatus> VerifyClient::Health(const std::string& service) {
  return HealthOn(static_cast<int>(NextConnectionIndex()), service);
}

absl::StatusOr<ServingStatus> VerifyClient::HealthOn(int connection_index,
                                                     const std::string& service) {
  if (connection_index < 0 || connection_index >= connections()) {
    return absl::InvalidArgumentError(
        absl::StrCat("connection ", connection_index, " of ", connections()));
  }
  grpc::ClientContext context;
  PrepareContext(&context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  Connection& connection = *connections_[connection_index];
  const grpc::Status checked = connection.health_stub->Check(&context, request, &response);
  CountCall(connection, checked.ok());
  RETURN_IF_ERROR(FromGrpcStatus(checked));
  switch (response.status()) {
    case grpc::health::v1::HealthCheckResponse::SERVING:
      return ServingStatus::kServing;
    case grpc::health::v1::HealthCheckResponse::NOT_SERVING:
      return ServingStatus::kNotServing;
    case grpc::health::v1::HealthCheckResponse::SERVICE_UNKNOWN:
      return ServingStatus::kServiceUnknown;
    default:
      return ServingStatus::kUnknown;
  }
}

absl::StatusOr<uint64_t> VerifyClient::CreateSequence(absl::string_view label) {
  v1::CreateSequenceRequest request;
  request.set_label(std::string(label));
  ASSIGN_OR_RETURN(auto response,
                   Unary(NextConnection(), &v1::VerifyService::Stub::CreateSequence, request));
  return response.sequence_id();
}

absl::StatusOr<int64_t> VerifyClient::ServerMessageLimit() {
  {
    absl::MutexLock lock(&mu_);
    if (server_message_limit_.has_value()) return *server_message_limit_;
  }
  ASSIGN_OR_RETURN(v1::ServerInfo info, GetServerInfo());
  return info.max_message_bytes();
}

absl::StatusOr<AppendKvResult> VerifyClient::AppendKv(
    uint64_t sequence_id, int64_t start_position, int num_layers, int64_t tokens,
    absl::Span<const Bf16> kv, const ShmStaging* staging,
    const std::function<void(int64_t tokens)>& on_chunk) {
  using mlaverify::kLatentDim;
  if (num_layers < 1 || tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AppendKv needs num_layers >= 1 and tokens >= 1; got ", num_layers, " and ", tokens));
  }
  const int64_t expected = static_cast<int64_t>(num_layers) * tokens * kLatentDim;
  if (static_cast<int64_t>(kv.size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat("AppendKv: kv holds ", kv.size(), " values; [",
                                                   num_layers, ", ", tokens, ", ", kLatentDim,
                                                   "] needs ", expected));
  }
  if (staging != nullptr) {
    return AppendKvThroughStaging(sequence_id, start_position, num_layers, tokens, kv, *staging,
                                  on_chunk);
  }
  ASSIGN_OR_RETURN(int64_t server_limit, ServerMessageLimit());
  // A server that reports no limit (0) is bounded by this channel's own.
  int64_t limit = server_limit > 0 ? std::min(server_limit, options_.max_send_message_bytes)
                                   : options_.max_send_message_bytes;
  // Capped for speed (kAppendKvMessageCap), unless a token would not fit.
  if (MaxAppendChunkTokens(kAppendKvMessageCap, num_layers) >= 1) {
    limit = std::min(limit, kAppendKvMessageCap);
  }
  const int64_t max_chunk_tokens = MaxAppendChunkTokens(limit, num_layers);
  if (max_chunk_tokens < 1) {
    return absl::ResourceExhaustedError(
        absl::StrCat("one token of ", num_layers, " layers (",
                     static_cast<int64_t>(num_layers) * kLatentDim * sizeof(Bf16),
                     " bytes) does not fit an AppendKv message under ", limit, " bytes"));
  }
  return SendAppendChunks(
      start_position, tokens, PlanAppendChunks(tokens, max_chunk_tokens),
      [&](const TokenRange& range) {
        return BuildAppendKvChunk(sequence_id, start_position, num_layers, tokens, kv, range);
      },
      on_chunk);
}

absl::StatusOr<AppendKvResult> VerifyClient::SendAppendChunks(
    int64_t start_position, int64_t tokens, const std::vector<TokenRange>& chunks,
    absl::FunctionRef<v1::AppendKvRequest(const TokenRange&)> build,
    const std::function<void(int64_t tokens)>& on_chunk) {
  AppendKvResult result;
  for (const TokenRange& range : chunks) {
    const v1::AppendKvRequest request = build(range);
    absl::StatusOr<v1::AppendKvResponse> answered = Unary(
        SequenceConnection(request.sequence_id()), &v1::VerifyService::Stub::AppendKv, request);
    if (!answered.ok()) {
      const absl::Status& status = answered.status();
      if (chunks.size() == 1) return status;
      // Keep the server's code; say how far the prompt got so the caller can
      // resume at the right position or release the sequence.
      return absl::Status(
          status.code(),
          absl::StrCat(status.message(), " [AppendKv chunk ", result.chunks + 1, " of ",
                       chunks.size(), " at position ", start_position + range.begin, "; ",
                       range.begin, " of ", tokens, " tokens were appended]"));
    }
    const int64_t length = answered->length();
    if (length != start_position + range.end) {
      return absl::InternalError(absl::StrCat("AppendKv of tokens up to position ",
                                              start_position + range.end, " answered length ",
                                              length));
    }
    result.length = length;
    ++result.chunks;
    if (on_chunk) on_chunk(range.end - range.begin);
  }
  return result;
}

absl::StatusOr<AppendKvResult> VerifyClient::AppendKvThroughStaging(
    uint64_t sequence_id, int64_t start_position, int num_layers, int64_t tokens,
    absl::Span<const Bf16> kv, const ShmStaging& staging,
    const std::function<void(int64_t tokens)>& on_chunk) {
  using mlaverify::kLatentDim;
  const uint64_t token_bytes = static_cast<uint64_t>(num_layers) * kLatentDim * sizeof(Bf16);
  const int64_t max_chunk_tokens = static_cast<int64_t>(staging.bytes / token_bytes);
  if (max_chunk_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("AppendKv staging of ", staging.bytes,
                                                   " bytes holds no token of ", num_layers,
                                                   " layers (", token_bytes, " bytes)"));
  }
  const auto* begin = reinterpret_cast<const uint8_t*>(kv.data());
  const uint8_t* area = staging.base + staging.offset;
  const bool in_place = tokens <= max_chunk_tokens && begin >= area &&
                        begin + kv.size() * sizeof(Bf16) <= area + staging.bytes;
  const std::vector<TokenRange> chunks =
      in_place ? std::vector<TokenRange>{{0, tokens}} : PlanAppendChunks(tokens, max_chunk_tokens);
  return SendAppendChunks(
      start_position, tokens, chunks,
      [&](const TokenRange& range) {
        const uint64_t offset =
            in_place ? static_cast<uint64_t>(begin - staging.base) : staging.offset;
        if (!in_place) GatherAppendChunk(num_layers, tokens, kv, range, staging.base + offset);
        return BuildAppendKvChunkReference(sequence_id, start_position, num_layers, range,
                                           staging.region, offset);
      },
      on_chunk);
}

absl::Status VerifyClient::RegisterSystemSharedMemory(const std::string& name,
                                                      const std::string& key, uint64_t offset,
                                                      uint64_t byte_size) {
  v1::RegisterSystemSharedMemoryRequest request;
  request.set_name(name);
  request.set_key(key);
  request.set_offset(offset);
  request.set_byte_size(byte_size);
  return Unary(NextConnection(), &v1::VerifyService::Stub::RegisterSystemSharedMemory, request)
      .status();
}

absl::Status VerifyClient::RegisterCudaSharedMemory(const std::string& name,
                                                    const std::string& handle, int device_id,
                                                    uint64_t byte_size) {
  v1::RegisterCudaSharedMemoryRequest request;
  request.set_name(name);
  request.set_raw_handle(handle);
  request.set_device_id(device_id);
  request.set_byte_size(byte_size);
  return Unary(NextConnection(), &v1::VerifyService::Stub::RegisterCudaSharedMemory, request)
      .status();
}

absl::StatusOr<std::vector<std::string>> VerifyClient::UnregisterSystemSharedMemory(
    const std::string& name) {
  v1::UnregisterSystemSharedMemoryRequest request;
  request.set_name(name);
  ASSIGN_OR_RETURN(
      auto response,
      Unary(NextConnection(), &v1::VerifyService::Stub::UnregisterSystemSharedMemory, request));
  return std::vector<std::string>(response.unregistered().begin(), response.unregistered().end());
}

absl::StatusOr<std::vector<v1::SystemSharedMemoryRegion>> VerifyClient::SystemSharedMemoryStatus(
    const std::string& name) {
  v1::SystemSharedMemoryStatusRequest request;
  request.set_name(name);
  ASSIGN_OR_RETURN(
      auto response,
      Unary(NextConnection(), &v1::VerifyService::Stub::SystemSharedMemoryStatus, request));
  return std::vector<v1::SystemSharedMemoryRegion>(response.regions().begin(),
                                                   response.regions().end());
}

absl::StatusOr<std::vector<std::string>> VerifyClient::UnregisterCudaSharedMemory(
    const std::string& name) {
  v1::UnregisterCudaSharedMemoryRequest request;
  request.set_name(name);
  ASSIGN_OR_RETURN(
      auto response,
      Unary(NextConnection(), &v1::VerifyService::Stub::UnregisterCudaSharedMemory, request));
  return std::vector<std::string>(response.unregistered().begin(), response.unregistered().end());
}

absl::StatusOr<std::vector<v1::CudaSharedMemoryRegion>> VerifyClient::CudaSharedMemoryStatus(
    const std::string& name) {
  v1::CudaSharedMemoryStatusRequest request;
  request.set_name(name);
  ASSIGN_OR_RETURN(auto response, Unary(NextConnection(),
                                        &v1::VerifyService::Stub::CudaSharedMemoryStatus, request));
  return std::vector<v1::CudaSharedMemoryRegion>(response.regions().begin(),
                                                 response.regions().end());
}

absl::StatusOr<std::vector<VerifyItemResult>> VerifyClient::Verify(
    int layer, absl::Span<const VerifyItemInput> items, float softmax_scale,
    const CallOptions& call) {
  ASSIGN_OR_RETURN(v1::VerifyRequest request,
                   BuildVerifyRequest(layer, items, softmax_scale, /*request_id=*/0));
  ASSIGN_OR_RETURN(v1::VerifyResponse response,
                   Unary(SequenceConnection(items.empty() ? 0 : items[0].sequence_id),
                         &v1::VerifyService::Stub::Verify, request, &call));
  return ParseVerifyResponse(items, response);
}

absl::StatusOr<CommitResult> VerifyClient::Commit(uint64_t sequence_id,
                                                  absl::Span<const int32_t> accepted) {
  v1::CommitRequest request;
  request.set_sequence_id(sequence_id);
  request.mutable_accepted()->Add(accepted.begin(), accepted.end());
  ASSIGN_OR_RETURN(auto response, Unary(SequenceConnection(sequence_id),
                                        &v1::VerifyService::Stub::Commit, request));
  return CommitResult{response.length(), response.accepted_count()};
}

absl::StatusOr<SequenceHandle> VerifyClient::OpenSequence(absl::string_view label) {
  ASSIGN_OR_RETURN(uint64_t id, CreateSequence(label));
  return SequenceHandle(this, id);
}

SequenceHandle& SequenceHandle::operator=(SequenceHandle&& other) noexcept {
  if (this != &other) {
    (void)Release();
    client_ = std::exchange(other.client_, nullptr);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

absl::StatusOr<int64_t> SequenceHandle::Release() {
  if (client_ == nullptr) return 0;
  VerifyClient* client = std::exchange(client_, nullptr);
  return client->ReleaseSequence(std::exchange(id_, 0));
}

uint64_t SequenceHandle::Detach() {
  client_ = nullptr;
  return std::exchange(id_, 0);
}

absl::StatusOr<int64_t> VerifyClient::ReleaseSequence(uint64_t sequence_id) {
  v1::ReleaseSequenceRequest request;
  request.set_sequence_id(sequence_id);
  ASSIGN_OR_RETURN(auto response, Unary(SequenceConnection(sequence_id),
                                        &v1::VerifyService::Stub::ReleaseSequence, request));
  return response.freed_pages();
}

absl::StatusOr<std::unique_ptr<VerifyStreamSession>> VerifyClient::OpenVerifyStream(
    absl::Duration lifetime, const CallOptions& call) {
  std::unique_ptr<VerifyStreamSession> session(new VerifyStreamSession());
  if (lifetime != absl::InfiniteDuration()) {
    session->context_.set_deadline(DeadlineAfter(lifetime));
  }
  session->context_.set_wait_for_ready(options_.wait_for_ready);
  AddMetadata(&session->context_, &call);
  const size_t index = NextConnectionIndex();
  Connection& connection = *connections_[index];
  connection.streams_opened.fetch_add(1, std::memory_order_relaxed);
  session->connection_ = &connection;
  session->connection_index_ = static_cast<int>(index);
  session->stream_ = connection.stub->VerifyStream(&session->context_);
  if (session->stream_ == nullptr) {
    return absl::InternalError("gRPC returned no VerifyStream");
  }
  return session;
}

}  // namespace mlaverify::client
