#include "server/transport/grpc_server.h"

#include <fstream>
#include <sstream>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace mlaverify::transport {
namespace {

constexpr char kServiceName[] = "mlaverify.v1.VerifyService";

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::InvalidArgumentError(absl::StrCat("cannot read ", what, " file '", path, "'"));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

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
  auto cert = ReadFile(o.tls_cert_file, "TLS certificate");
  if (!cert.ok()) return cert.status();
  auto key = ReadFile(o.tls_key_file, "TLS key");
  if (!key.ok()) return key.status();
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  if (!o.tls_client_ca_file.empty()) {
    auto ca = ReadFile(o.tls_client_ca_file, "client CA");
    if (!ca.ok()) return ca.status();
    ssl.pem_root_certs = *ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(const GrpcServerOptions& options,
                                                              RpcObserver* observer) {
  auto creds = Credentials(options);
  if (!creds.ok()) return creds.status();
  std::unique_ptr<GrpcServer> s(new GrpcServer());
  s->service_ = std::make_unique<VerifyServiceImpl>(options.service, observer, &s->state_);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // No SO_REUSEPORT: a second server on the same port would share its new
  // connections at random, and sequences live in one process.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(options.listen_address, *creds, &s->port_);
  builder.RegisterService(s->service_.get());
  const int max_bytes = static_cast<int>(options.service.max_message_bytes);
  builder.SetMaxReceiveMessageSize(max_bytes);
  builder.SetMaxSendMessageSize(max_bytes);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.listen_address, " (address in use or invalid)"));
  }
  s->SetHealth(false);
  spdlog::info("gRPC listening on port {} ({})", s->port_,
               options.tls_cert_file.empty() ? "plaintext"
               : options.tls_client_ca_file.empty() ? "TLS"
                                                    : "mTLS");
  return s;
}

GrpcServer::~GrpcServer() { Drain(absl::ZeroDuration()); }

void GrpcServer::SetHealth(bool serving) {
  if (server_ == nullptr) return;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  if (health == nullptr) return;
  health->SetServingStatus("", serving);
  health->SetServingStatus(kServiceName, serving);
}

void GrpcServer::SetServing() {
  state_.store(ServingState::kServing);
  SetHealth(true);
  spdlog::info("serving");
}

void GrpcServer::SetFaulted() {
  ServingState serving = ServingState::kServing;
  if (!state_.compare_exchange_strong(serving, ServingState::kFaulted)) return;
  SetHealth(false);
  spdlog::error("NOT_SERVING: a device faulted");
}

void GrpcServer::Drain(absl::Duration grace) {
  // A server that never started listening (Start failed) has nothing to drain.
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  state_.store(ServingState::kDraining);
  SetHealth(false);
  spdlog::info("draining: waiting up to {} for calls in flight", absl::FormatDuration(grace));
  server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoSeconds(grace));
  server_->Wait();
  spdlog::info("gRPC server stopped");
}

}  // namespace mlaverify::transport
