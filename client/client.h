// The mlaverify client library: one VerifyClient per server address, wrapping
// the v1 VerifyService stubs and grpc.health.v1 Check in absl::Status /
// absl::StatusOr. A failed RPC comes back with the server's gRPC code and
// message unchanged; answers the server should never give (wrong shapes,
// byte counts, result counts) come back as INTERNAL or DATA_LOSS.
//
//   ASSIGN_OR_RETURN(auto client, VerifyClient::Create("127.0.0.1:50051", {}));
//   ASSIGN_OR_RETURN(uint64_t seq, client->CreateSequence("req-17"));
//   RETURN_IF_ERROR(client->AppendKv(seq, 0, layers, prompt_len, prompt_kv).status());
//   for each step: for each layer: client->Verify(layer, items); then Commit.
#ifndef MLAVERIFY_CLIENT_CLIENT_H_
#define MLAVERIFY_CLIENT_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/steps.h"
#include "client/wire.h"
#include "common/bf16.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/support/sync_stream.h"
#include "mlaverify/v1/verify.grpc.pb.h"

namespace mlaverify::client {

// One HTTP/2 connection of a VerifyClient: a channel and its stubs, with
// counters (client.cc).
struct Connection;

// What one call may set beyond the client's options: its own deadline
// (instead of ClientOptions::call_timeout) and metadata sent with it. A key
// given here replaces the client's pairs of that key (so a per-call
// "authorization" is sent instead of the client's token, never beside it).
struct CallOptions {
  absl::Duration timeout = absl::InfiniteDuration();  // infinite: the client's call_timeout
  std::vector<std::pair<std::string, std::string>> metadata;
};

struct ClientOptions {
  // TLS is used when `use_tls` is set or any of the files below is given;
  // otherwise the channel is plaintext (loopback, or inside a mesh that
  // terminates TLS). Files are PEM.
  bool use_tls = false;
  std::string tls_root_ca_file;      // empty: gRPC's default roots
  std::string tls_cert_chain_file;   // client certificate for mTLS; needs the key
  std::string tls_private_key_file;  // its private key; needs the certificate
  // Channel limits on one message each way. Verify answers grow with
  // items * N * H * 1 KiB, so the receive limit is far above gRPC's 4 MiB
  // default. AppendKv chunks stay under min(server limit, send limit).
  int64_t max_send_message_bytes = int64_t{256} << 20;
  int64_t max_receive_message_bytes = int64_t{256} << 20;
  // HTTP/2 settings for 100 KiB-8 MiB messages (0: gRPC's default): the
  // largest frame this side accepts, and the per-call receive window.
  int http2_max_frame_bytes = (1 << 24) - 1;
  int http2_lookahead_bytes = 8 << 20;
  // Deadline of each unary call; absl::InfiniteDuration() sets none.
  absl::Duration call_timeout = absl::Seconds(30);
  // Queue calls while the channel connects instead of failing them at once
  // with UNAVAILABLE (for scripts that start the server and the client
  // together). The call deadline still applies.
  bool wait_for_ready = false;
  // Sent as "authorization: Bearer <token>" with every call when not empty
  // (servers started with --auth-token-file require it).
  std::string auth_token;
  // HTTP/2 connections to the target, 1..kMaxConnections: one channel each,
  // with its own subchannel pool, so each is a TCP connection of its own.
  // A bare gRPC 1.51 echo of Verify-sized messages (147 KiB in, 128 KiB out,
  // 64 streams) on the H200 host: 6.3k calls/s over one connection, 18.2k
  // over 4, 24.8k over 16, 22.0k over 64; 16 is the measured peak, and
  // channels connect on first use, so a client that makes few calls opens
  // few connections (`load --floor` measures it for any count).
  // The target must name one server: a name or balancer that spreads
  // connections over several servers would split a sequence's calls between
  // them (use 1 there, or list the replicas).
  int connections = 16;
  // Keepalive: a connection with a call open (an idle VerifyStream included)
  // is pinged after `keepalive_time` without traffic and closed when the ack
  // takes longer than `keepalive_timeout` (its calls fail UNAVAILABLE; the
  // next call reconnects). 30 s keeps NAT and L4 balancer flows alive (their
  // idle timeouts are minutes; AWS NLB 350 s) and stays above the server's
  // --http2-min-ping-interval-ms (10 s), below which the server counts the
  // pings as abuse and closes the connection. InfiniteDuration: no pings.
  absl::Duration keepalive_time = absl::Seconds(30);
  absl::Duration keepalive_timeout = absl::Seconds(10);
  // Also ping connections with no call open (keeps idle pooled connections
  // up through a NAT; the server must run with
  // --keepalive-permit-without-calls, its default).
  bool keepalive_permit_without_calls = false;
};

// The most connections one VerifyClient opens to its target.
inline constexpr int kMaxConnections = 256;

// Calls made over one connection of a VerifyClient (streams count once per
// Verify on them); `failed` of those ended with an error.
struct ConnectionStats {
  int64_t calls = 0;
  int64_t failed = 0;
  int64_t streams_opened = 0;
};

enum class ServingStatus { kUnknown, kServing, kNotServing, kServiceUnknown };

// "UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" (the proto names).
absl::string_view ServingStatusName(ServingStatus status);

struct AppendKvResult {
  int64_t length = 0;  // sequence length after the last chunk
  int chunks = 0;      // AppendKv messages sent
};

struct CommitResult {
  int64_t length = 0;  // sequence length after the commit
  int accepted_count = 0;
};

// A VerifyStream: one ordered stream of per-layer Verify calls, typically one
// per scheduler thread. Each Verify writes one request and reads its answer
// (matched by request_id). A failed request (error_code != 0) returns that
// status and the stream stays usable; a broken stream (write/read failure or
// an out-of-order answer) returns its final status from then on.
// Not thread-safe: one caller at a time. Destroying an open session cancels it.
class VerifyStreamSession {
 public:
  ~VerifyStreamSession();
  VerifyStreamSession(const VerifyStreamSession&) = delete;
  VerifyStreamSession& operator=(const VerifyStreamSession&) = delete;

  absl::StatusOr<std::vector<VerifyItemResult>> Verify(int layer,
                                                       absl::Span<const VerifyItemInput> items,
                                                       float softmax_scale = 0.0f);

  // The client's connection this stream travels on.
  int connection() const { return connection_index_; }

  // Half-closes the stream and returns the server's final status. Further
  // Verify calls fail with FAILED_PRECONDITION. Idempotent.
  absl::Status Close();

 private:
  friend class VerifyClient;
  VerifyStreamSession() = default;

  // Ends the stream after a write or read failed and remembers why: the
  // server's final status, or `why` when the server's says OK.
  absl::Status Break(absl::Status why);
  // Cancels the stream from this side and remembers `why` as its status.
  absl::Status Abandon(absl::Status why);

  absl::StatusOr<std::vector<VerifyItemResult>> VerifyOnStream(
      int layer, absl::Span<const VerifyItemInput> items, float softmax_scale);

  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::VerifyRequest, v1::VerifyResponse>> stream_;
  Connection* connection_ = nullptr;  // the client's; outlives the session
  int connection_index_ = 0;
  uint64_t next_request_id_ = 1;
  // Set once the stream has ended (closed or broken): its final status.
  std::optional<absl::Status> final_status_;
};

class VerifyClient;

// A sequence that is released when its handle goes (VerifyClient::
// OpenSequence): a scheduler that returns early or throws between create and
// release does not hold the sequence's pages until the server's idle
// timeout. Move-only; the client must outlive it.
class SequenceHandle {
 public:
  SequenceHandle() = default;
  ~SequenceHandle() { (void)Release(); }
  SequenceHandle(SequenceHandle&& other) noexcept { *this = std::move(other); }
  SequenceHandle& operator=(SequenceHandle&& other) noexcept;
  SequenceHandle(const SequenceHandle&) = delete;
  SequenceHandle& operator=(const SequenceHandle&) = delete;

  uint64_t id() const { return id_; }
  // Releases the sequence now (the handle then holds none): the pages freed,
  // or the server's status (NOT_FOUND: released or expired meanwhile). An
  // empty handle answers 0.
  absl::StatusOr<int64_t> Release();
  // Keeps the sequence alive past the handle (nothing released); its id.
  uint64_t Detach();

 private:
  friend class VerifyClient;
  SequenceHandle(VerifyClient* client, uint64_t id) : client_(client), id_(id) {}
  VerifyClient* client_ = nullptr;
  uint64_t id_ = 0;
};

// Thread-safe: one VerifyClient may be shared by any number of threads (the
// gRPC stubs are; the cached ServerInfo is guarded).
class VerifyClient {
 public:
  // Builds the channel; reads the TLS files. INVALID_ARGUMENT for an
  // inconsistent TLS setup, NOT_FOUND for a file that cannot be read. Does
  // not connect: the first call does.
  // INVALID_ARGUMENT also for connections outside 1..kMaxConnections or a
  // keepalive time or timeout under 1 ms.
  static absl::StatusOr<std::unique_ptr<VerifyClient>> Create(std::string target,
                                                              ClientOptions options);
  ~VerifyClient();

  const std::string& target() const { return target_; }
  const ClientOptions& options() const { return options_; }

  // Which connection carries the calls of a sequence: always the same one
  // (sequence_id mod connections), so that one sequence's calls keep their
  // order. A Verify with items of several sequences goes on its first
  // item's. Calls of no sequence (info, health, CreateSequence, shared
  // memory) and new VerifyStreams take the connections in turn.
  int ConnectionOf(uint64_t sequence_id) const {
    return static_cast<int>(sequence_id % connections_.size());
  }
  int connections() const { return static_cast<int>(connections_.size()); }
  // Per connection, in index order; counts since Create.
  std::vector<ConnectionStats> GetConnectionStats() const;

  // Geometry, limits and page accounting, fresh from the server (the copy
  // AppendKv's chunking uses is refreshed too).
  absl::StatusOr<v1::ServerInfo> GetServerInfo();

  // grpc.health.v1 Check of `service` ("" is the whole server), on the
  // next connection in turn.
  absl::StatusOr<ServingStatus> Health(const std::string& service = "");
  // The same check on one chosen connection (0 <= connection < connections()):
  // probes that must reach distinct connections pick them themselves, since
  // other threads move the turn between two calls of Health.
  absl::StatusOr<ServingStatus> HealthOn(int connection, const std::string& service = "");
  // The connection the next call of no sequence would take (moves the turn).
  int TakeNextConnection() { return static_cast<int>(NextConnectionIndex()); }

  // Returns the new sequence's id. `label` appears in the server's logs.
  absl::StatusOr<uint64_t> CreateSequence(absl::string_view label);
  // CreateSequence, the sequence released when the returned handle goes.
  absl::StatusOr<SequenceHandle> OpenSequence(absl::string_view label);

  // Appends `tokens` prompt tokens at start_position (the sequence's current
  // length), kv [num_layers, tokens, 576] bf16. Split into as many AppendKv
  // messages as the server's max_message_bytes requires (each under 90% of
  // it), sent in order. If a chunk fails, the chunks before it stay appended
  // and the error says how many tokens made it.
  //
  // With `staging` (a registered shared-memory range) the chunks go through
  // it instead of inline: as many whole tokens of every layer as it holds per
  // AppendKv, each copied in and referenced. A prompt that already lies in
  // the staging range whole is referenced where it is, without a copy.
  //
  // `on_chunk`, when set, is called after each chunk the server accepted with
  // the tokens that chunk carried: the progress of a long prompt.
  absl::StatusOr<AppendKvResult> AppendKv(
      uint64_t sequence_id, int64_t start_position, int num_layers, int64_t tokens,
      absl::Span<const Bf16> kv, const ShmStaging* staging = nullptr,
      const std::function<void(int64_t tokens)>& on_chunk = nullptr);

  // Verify attention of one layer for one or more sequences (one item each).
  // softmax_scale <= 0 uses the server's default. Results come in item order.
  // `call`: this call's own deadline and metadata.
  absl::StatusOr<std::vector<VerifyItemResult>> Verify(int layer,
                                                       absl::Span<const VerifyItemInput> items,
                                                       float softmax_scale = 0.0f,
                                                       const CallOptions& call = {});

  // Ends the pending step with the accepted root-to-node path (may be empty).
  absl::StatusOr<CommitResult> Commit(uint64_t sequence_id, absl::Span<const int32_t> accepted);

  // Frees the sequence; returns the pages freed.
  absl::StatusOr<int64_t> ReleaseSequence(uint64_t sequence_id);

  // System shared memory (servers started with --allow-client-shm): makes
  // [offset, offset + byte_size) of the POSIX object `key` known as `name`.
  absl::Status RegisterSystemSharedMemory(const std::string& name, const std::string& key,
                                          uint64_t offset, uint64_t byte_size);
  // CUDA shared memory: a device allocation exported by cudaIpcGetMemHandle
  // (`handle`, e.g. CudaSharedMemoryBuffer::ipc_handle()) on `device_id`.
  absl::Status RegisterCudaSharedMemory(const std::string& name, const std::string& handle,
                                        int device_id, uint64_t byte_size);
  // Removes `name` ("" : every region, either kind); returns the names removed.
  absl::StatusOr<std::vector<std::string>> UnregisterSystemSharedMemory(const std::string& name);
  // `name` ("" : every region, either kind) with its use.
  absl::StatusOr<std::vector<v1::SystemSharedMemoryRegion>> SystemSharedMemoryStatus(
      const std::string& name = "");
  // The same for CUDA regions only (a system region's name is NOT_FOUND).
  absl::StatusOr<std::vector<std::string>> UnregisterCudaSharedMemory(const std::string& name);
  absl::StatusOr<std::vector<v1::CudaSharedMemoryRegion>> CudaSharedMemoryStatus(
      const std::string& name = "");

  // Device-driven verify steps (client/steps.h, docs/steps.md): one call
  // opens a step, whose layers are then rung without a call each. GPU
  // doorbells open the server device's doorbell arena in this process once
  // (kept until the client goes). The step must not outlive the client.
  absl::StatusOr<std::unique_ptr<DeviceStep>> OpenStep(const StepSpec& spec);
  // AbortStep: returns once the step ended (nothing of it runs any more).
  absl::StatusOr<v1::StepStatus> AbortStep(uint64_t step_id);
  absl::StatusOr<v1::StepStatus> GetStep(uint64_t step_id);

  // Opens a VerifyStream on the next connection in turn. `lifetime` bounds
  // the whole stream (not each call): a stream that outlives it ends with
  // DEADLINE_EXCEEDED. `call`'s metadata goes with the stream's opening (its
  // timeout is not used: `lifetime` is the stream's). The session must not
  // outlive this client.
  absl::StatusOr<std::unique_ptr<VerifyStreamSession>> OpenVerifyStream(
      absl::Duration lifetime = absl::InfiniteDuration(), const CallOptions& call = {});

 private:
  VerifyClient(std::string target, ClientOptions options,
               std::vector<std::unique_ptr<Connection>> connections);

  // The next connection in turn (its index, or itself), for calls that
  // belong to no sequence and for streams.
  size_t NextConnectionIndex();
  Connection& NextConnection();
  Connection& SequenceConnection(uint64_t sequence_id) {
    return *connections_[ConnectionOf(sequence_id)];
  }

  // Applies the call deadline (`call`'s, else the client's), wait-for-ready
  // and the metadata (`call`'s keys replacing the client's) to a fresh
  // context.
  void PrepareContext(grpc::ClientContext* context, const CallOptions* call = nullptr) const;
  // The client's and `call`'s metadata, merged as CallOptions says.
  void AddMetadata(grpc::ClientContext* context, const CallOptions* call) const;

  // One unary call of the stub with a prepared context.
  template <typename Request, typename Response>
  absl::StatusOr<Response> Unary(Connection& connection,
                                 grpc::Status (v1::VerifyService::Stub::*rpc)(grpc::ClientContext*,
                                                                              const Request&,
                                                                              Response*),
                                 const Request& request, const CallOptions* call = nullptr) {
    grpc::ClientContext context;
    PrepareContext(&context, call);
    Response response;
    const grpc::Status status = (StubOf(connection)->*rpc)(&context, request, &response);
    CountCall(connection, status.ok());
    if (!status.ok()) return FromGrpcStatus(status);
    return response;
  }
  static v1::VerifyService::Stub* StubOf(Connection& connection);
  static void CountCall(Connection& connection, bool ok);

  absl::StatusOr<AppendKvResult> AppendKvThroughStaging(
      uint64_t sequence_id, int64_t start_position, int num_layers, int64_t tokens,
      absl::Span<const Bf16> kv, const ShmStaging& staging,
      const std::function<void(int64_t tokens)>& on_chunk);

  // Sends `chunks` of a prompt in order, each request made by `build`;
  // stops at the first failure, saying how far the prompt got.
  absl::StatusOr<AppendKvResult> SendAppendChunks(
      int64_t start_position, int64_t tokens, const std::vector<TokenRange>& chunks,
      absl::FunctionRef<v1::AppendKvRequest(const TokenRange&)> build,
      const std::function<void(int64_t tokens)>& on_chunk);

  // The server's message limit as AppendKv sees it, from the cached
  // ServerInfo (fetched on first use).
  absl::StatusOr<int64_t> ServerMessageLimit();

  // A server device's doorbell arena in this process (opened on first use).
  absl::StatusOr<uint64_t> DoorbellArena(const std::string& handle, int device);
  void CloseDoorbellArenas();
  // One per server instance and device; a client that outlives many server
  // restarts is told to start again rather than keep mappings forever.
  static constexpr size_t kMaxDoorbellArenas = 64;

  const std::string target_;
  const ClientOptions options_;
  // Never empty; fixed after Create.
  const std::vector<std::unique_ptr<Connection>> connections_;
  std::atomic<uint64_t> next_connection_{0};

  absl::Mutex mu_;
  // max_message_bytes of the last ServerInfo seen; nullopt before the first.
  std::optional<int64_t> server_message_limit_ ABSL_GUARDED_BY(mu_);

  absl::Mutex arenas_mu_;
  // (IPC handle, CUDA device) -> the arena's address in this process.
  std::map<std::pair<std::string, int>, uint64_t> arenas_ ABSL_GUARDED_BY(arenas_mu_);
};

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_CLIENT_H_
