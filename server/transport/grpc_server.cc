#include "server/transport/grpc_server.h"

#include <google/protobuf/stubs/logging.h>
#include <grpc/support/log.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/log_fields.h"
#include "common/small_file.h"
#include "spdlog/spdlog.h"

namespace mlaverify::transport {
namespace {

constexpr char kServiceName[] = "mlaverify.v1.VerifyService";

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const GrpcServerOptions& o) {
  if (o.tls_cert_file.empty() && o.tls_key_file.empty()) {
    if (!o.tls_client_ca_file.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
    }
    return grpc::InsecureServerCredentials();
  }
  if (o.tls_cert_file.empty() || o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("TLS needs both --tls-cert and --tls-key");
  }
  grpc::SslServerCredentialsOptions ssl;
  auto cert = ReadSmallFile(o.tls_cert_file, kMaxPemFileBytes, "TLS certificate");
  if (!cert.ok()) return cert.status();
  auto key = ReadSmallFile(o.tls_key_file, kMaxPemFileBytes, "TLS key");
  if (!key.ok()) return key.status();
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!o.tls_client_ca_file.empty()) {
    auto ca = ReadSmallFile(o.tls_client_ca_file, kMaxPemFileBytes, "client CA");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

// libprotobuf logs a line to stderr for every string field with invalid
// UTF-8 it fails to parse: a client could write the server's log at will.
// Its lines go to spdlog at debug level instead (a fatal one still aborts).
void LogProtobufAtDebug(google::protobuf::LogLevel level, const char* filename, int line,
                        const std::string& message) {
  LogFields protobuf;
  protobuf.source = "protobuf";
  const ScopedLogFields fields(protobuf);
  if (level >= google::protobuf::LOGLEVEL_FATAL) {
    spdlog::critical("libprotobuf {}:{}: {}", filename, line, message);
  } else {
    spdlog::debug("libprotobuf {}:{}: {}", filename, line, message);
  }
}

// gRPC's own log lines (its core writes them to stderr in glog style) go
// through spdlog like every other line, so that --log-format json keeps
// every line a JSON object and --log-level applies. gRPC still decides what
// it logs (GRPC_VERBOSITY, errors by default).
void LogGrpcThroughSpdlog(gpr_log_func_args* args) {
  const char* file = args->file != nullptr ? args->file : "";
  if (const char* slash = std::strrchr(file, '/'); slash != nullptr) file = slash + 1;
  const char* message = args->message != nullptr ? args->message : "";
  LogFields grpc;
  grpc.source = "grpc";
  const ScopedLogFields fields(grpc);
  switch (args->severity) {
    case GPR_LOG_SEVERITY_DEBUG:
      spdlog::debug("grpc {}:{}: {}", file, args->line, message);
      break;
    case GPR_LOG_SEVERITY_INFO:
      spdlog::info("grpc {}:{}: {}", file, args->line, message);
      break;
    default:
      spdlog::error("grpc {}:{}: {}", file, args->line, message);
      break;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(const GrpcServerOptions& options,
                                                              RpcObserver* observer) {
  auto creds = Credentials(options);
  if (!creds.ok()) return creds.status();
  google::protobuf::SetLogHandler(&LogProtobufAtDebug);
  gpr_set_log_function(&LogGrpcThroughSpdlog);
  std::unique_ptr<GrpcServer> s(new GrpcServer());
  s->service_ = std::make_unique<VerifyServiceImpl>(options.service, observer, &s->state_);

  s->health_ = std::make_unique<HealthService>(kServiceName);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // No SO_REUSEPORT: a second server on the same port would share its new
  // connections at random, and sequences live in one process.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  if (options.http2_max_frame_bytes > 0) {
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, options.http2_max_frame_bytes);
  }
  if (options.http2_lookahead_bytes > 0) {
    builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES,
                               options.http2_lookahead_bytes);
  }
  if (options.http2_max_concurrent_streams > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                               options.http2_max_concurrent_streams);
  }
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, options.keepalive_time_ms);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, options.keepalive_timeout_ms);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS,
                             options.keepalive_permit_without_calls ? 1 : 0);
  // The server's own pings keep going on an idle stream (gRPC's default
  // stops after 2 pings without data, which leaves an idle VerifyStream
  // unguarded against a balancer's idle timeout).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_SENT_PING_INTERVAL_WITHOUT_DATA_MS,
                             options.keepalive_time_ms);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             options.http2_min_ping_interval_ms);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, options.http2_max_ping_strikes);
  if (options.grpc_memory_quota_bytes > 0) {
    grpc::ResourceQuota quota("mlaverify-server");
    quota.Resize(static_cast<size_t>(options.grpc_memory_quota_bytes));
    builder.SetResourceQuota(quota);
  }
  // Identity only: gRPC 1.51 inflates a compressed message whole before its
  // size check (a 1 MiB gzip message becomes 1 GiB in memory, before any
  // authentication). With the algorithms disabled a compressed call is
  // refused UNIMPLEMENTED from its headers, before a byte is inflated;
  // clients learn it from grpc-accept-encoding. The tensors are bf16/fp8
  // values, which compress poorly anyway.
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_DEFLATE, false);
  builder.SetCompressionAlgorithmSupportStatus(GRPC_COMPRESS_GZIP, false);
  builder.AddListeningPort(options.listen_address, *creds, &s->port_);
  builder.RegisterService(s->service_.get());
  builder.RegisterService(s->health_.get());
  // Received messages up to twice the limit reach the service, which answers
  // them RESOURCE_EXHAUSTED itself (a stream stays open, the request is
  // counted); answers are held to the limit.
  builder.SetMaxReceiveMessageSize(TransportReceiveLimit(options.service.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.service.max_message_bytes));
  s->tls_ = !options.tls_cert_file.empty();
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen_address, " (address in use or invalid)"));
  }
  s->SetHealth(false);
  spdlog::info("gRPC listening on port {} ({})", s->port_,
               options.tls_cert_file.empty()        ? "plaintext"
               : options.tls_client_ca_file.empty() ? "TLS"
                                                    : "mTLS");
  return s;
}

GrpcServer::~GrpcServer() { Drain(absl::ZeroDuration(), absl::ZeroDuration()); }

void GrpcServer::SetHealth(bool serving) {
  if (health_ != nullptr) health_->SetServing(serving);
}

void GrpcServer::SetServing() {
  state_.store(ServingState::kServing);
  SetHealth(true);
  spdlog::info("serving");
}

void GrpcServer::SetFaulted() {
  // (Ignored unless serving: a drain or a start in progress keeps its state.)
  ServingState serving = ServingState::kServing;
  if (!state_.compare_exchange_strong(serving, ServingState::kFaulted)) return;
  SetHealth(false);
  spdlog::error("NOT_SERVING: a device faulted");
}

void GrpcServer::StartServingProbe(absl::Duration period, absl::Duration timeout) {
  if (probe_ != nullptr || server_ == nullptr) return;
  grpc::ChannelArguments args;
  // A connection of its own, never one a client's channel shares.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  std::shared_ptr<grpc::Channel> channel =
      tls_ ? server_->InProcessChannel(args)
           : grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port_),
                                       grpc::InsecureChannelCredentials(), args);
  probe_ = std::make_unique<ServingPathProbe>(std::move(channel), period, timeout);
  spdlog::info("/readyz also asks the gRPC port's health every {} ({} deadline, {})",
               absl::FormatDuration(period), absl::FormatDuration(timeout),
               tls_ ? "in process: the port takes TLS" : "over loopback");
}

bool GrpcServer::serving_path_answers() const { return probe_ == nullptr || probe_->answering(); }

int64_t GrpcServer::EndIdleStreams() {
  return service_->EndIdleStreams(std::chrono::steady_clock::now());
}

DrainCounts GrpcServer::Drain(absl::Duration grace, absl::Duration timeout) {
  DrainCounts counts;
  // A server that never started listening (Start failed) has nothing to drain.
  if (shut_down_ || server_ == nullptr) return counts;
  shut_down_ = true;
  // Readiness says "not ready" from here on through the state alone.
  if (probe_ != nullptr) probe_->Stop();
  SetHealth(false);
  if (grace > absl::ZeroDuration()) {
    state_.store(ServingState::kDrainGrace);
    spdlog::info("draining: NOT_SERVING; calls still served for {} while load balancers move away",
                 absl::FormatDuration(grace));
    absl::SleepFor(grace);
  }
  state_.store(ServingState::kDraining);
  // NOT_SERVING for good, and every Watch stream ends (an open one would
  // otherwise hold the exit until the timeout).
  health_->Shutdown();
  counts.calls_in_flight_at_close = service_->calls_in_flight();
  const int64_t finished_before = service_->calls_finished();
  counts.streams_ended = service_->EndStreams();
  spdlog::info(
      "draining: new work refused, {} calls in flight get up to {} to finish, {} streams "
      "ended",
      counts.calls_in_flight_at_close, absl::FormatDuration(timeout), counts.streams_ended);
  server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(timeout));
  // Calls still in flight here were cancelled by the deadline (their engine
  // work still completes before Wait returns).
  counts.calls_cut = service_->calls_in_flight();
  server_->Wait();
  counts.calls_finished = service_->calls_finished() - finished_before - counts.calls_cut;
  spdlog::info("gRPC server stopped: {} calls finished in the drain, {} cut at the timeout",
               counts.calls_finished, counts.calls_cut);
  if (engine_ != nullptr) {
    if (const int64_t regions = engine_->regions().ReleaseAll(); regions > 0) {
      spdlog::info("released {} shared-memory regions", regions);
    }
  }
  return counts;
}

}  // namespace mlaverify::transport
