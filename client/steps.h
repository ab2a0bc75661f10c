// Device-driven verify steps from the scheduler's side (docs/steps.md):
// VerifyClient::OpenStep sends one step (its items, where every layer's
// tensors live in registered regions, the doorbell kind); the DeviceStep it
// returns rings each rank's doorbell once a layer's inputs are in place and
// waits on the rank's completion slot, on the host (host doorbells) or on
// the caller's own CUDA stream (GPU doorbells: no host thread per layer,
// and the operations can be captured into the caller's CUDA graphs). Every
// item is then committed with VerifyClient::Commit, as after Verify calls.
//
//   StepSpec spec;  // items, one rank per device, DOORBELL_GPU
//   ASSIGN_OR_RETURN(std::unique_ptr<DeviceStep> step, client->OpenStep(spec));
//   for (int l = 0; l < step->num_layers(); ++l) {
//     ...the layer's q and draft_kv written by kernels on `stream`...
//     RETURN_IF_ERROR(step->RingOnStream(rank, l + 1, stream));
//     RETURN_IF_ERROR(step->WaitOnStream(rank, l + 1, stream));
//     ...kernels on `stream` read the layer's out and lse...
//   }
//   // once the stream passed the last wait:
//   client->Commit(sequence, accepted_path);
//
// A step that ends early (AbortStep, a timeout, a release, the server
// stopping) puts every completion past the last layer, so no wait of the
// caller hangs; Completed() and Commit (ABORTED) say so.
#ifndef MLAVERIFY_CLIENT_STEPS_H_
#define MLAVERIFY_CLIENT_STEPS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/shared_memory.h"
#include "mlaverify/v1/verify.pb.h"

namespace mlaverify::client {

class VerifyClient;

// Layer l's tensor starts at offset + l * layer_stride of `region` (0: one
// place for every layer).
struct StepTensorPlace {
  std::string region;
  uint64_t offset = 0;
  uint64_t layer_stride = 0;
};

// One item's tensors as one rank sees them (H_r = heads_per_device).
struct StepItemPlace {
  StepTensorPlace q;         // bf16 [N, H_r, 576]
  StepTensorPlace draft_kv;  // bf16 [N, 576]
  StepTensorPlace out;       // bf16 [N, H_r, 512]
  StepTensorPlace lse;       // fp32 [N, H_r]

  // The places of an item laid out by PlaceVerifyItem (shared_memory.h),
  // every layer's `layer_stride` bytes after the one before (0: all layers
  // in one place).
  static StepItemPlace Of(const ShmItemPlacement& p, uint64_t layer_stride = 0) {
    return {{p.region, p.q_offset, layer_stride},
            {p.region, p.draft_kv_offset, layer_stride},
            {p.region, p.out_offset, layer_stride},
            {p.region, p.lse_offset, layer_stride}};
  }
};

enum class Doorbells { kHost, kGpu };

// One rank: TP mode, one per server device in its order; DP mode, one.
struct StepRankSpec {
  std::vector<StepItemPlace> items;  // in item order
  // Host doorbells: two 16-byte slots (16-byte aligned) in a registered
  // system region, and that region's first byte in this process.
  std::string doorbell_region;
  uint64_t doorbell_offset = 0;
  uint64_t completion_offset = 0;
  uint8_t* doorbell_region_data = nullptr;
};

struct StepItemSpec {
  uint64_t sequence_id = 0;
  std::vector<int32_t> parents;
};

struct StepSpec {
  std::vector<StepItemSpec> items;
  std::vector<StepRankSpec> ranks;
  Doorbells doorbells = Doorbells::kHost;
  float softmax_scale = 0;  // <= 0: the server's
  // Zero: the server's defaults (ServerInfo step_layer_timeout_ms, ...).
  absl::Duration layer_timeout = absl::ZeroDuration();
  absl::Duration max_duration = absl::ZeroDuration();
};

// The OpenStep request for `spec`.
v1::OpenStepRequest ToOpenStepRequest(const StepSpec& spec);

// An open step. Ring and Wait of one rank from one thread at a time; ranks
// are independent. Must not outlive the VerifyClient that opened it.
class DeviceStep {
 public:
  ~DeviceStep();
  DeviceStep(const DeviceStep&) = delete;
  DeviceStep& operator=(const DeviceStep&) = delete;

  uint64_t id() const { return id_; }
  int num_layers() const { return num_layers_; }
  int ranks() const { return static_cast<int>(ranks_.size()); }
  Doorbells doorbells() const { return doorbells_; }
  // Per item: the committed length its drafts attend to.
  const std::vector<int64_t>& prefix_len() const { return prefix_len_; }
  const v1::OpenStepResponse& response() const { return response_; }

  // Host doorbells. Ring: layers [0, layers) of `rank` have their inputs in
  // place. Wait: until they ran (their outputs written), spinning for `spin`
  // first, then sleeping; ABORTED when the step ended early (the outputs
  // are not to be used), DEADLINE_EXCEEDED after `timeout`.
  absl::Status Ring(int rank, int layers);
  absl::Status Wait(int rank, int layers, absl::Duration timeout = absl::Seconds(30),
                    absl::Duration spin = absl::Milliseconds(20));

  // GPU doorbells, on the caller's CUDA stream (a cudaStream_t, as void*),
  // on the rank's device: a stream write of the doorbell, a stream wait on
  // the completion. No host involvement; capturable into CUDA graphs.
  // UNIMPLEMENTED in a build without CUDA.
  absl::Status RingOnStream(int rank, int layers, void* cuda_stream);
  absl::Status WaitOnStream(int rank, int layers, void* cuda_stream);

  // How many layers of `rank` ran (a read of its completion slot; GPU
  // doorbells: a small synchronous copy). ABORTED when the step ended early.
  absl::StatusOr<int> Completed(int rank) const;

  // AbortStep: ends the step early and returns once nothing of it runs any
  // more, with its final status.
  absl::StatusOr<v1::StepStatus> Abort();
  // GetStep.
  absl::StatusOr<v1::StepStatus> Status();

 private:
  friend class VerifyClient;
  struct Rank {
    uint64_t base = 0;
    int device = -1;
    uint8_t* doorbell = nullptr;  // host doorbells: this process's slots
    uint8_t* completion = nullptr;
    uint64_t doorbell_address = 0;  // GPU doorbells: as the device addresses them
    uint64_t completion_address = 0;
  };
  DeviceStep() = default;
  absl::Status CheckRank(int rank, int layers, Doorbells kind) const;
  // The step ended early: `completion` is past the last layer.
  absl::Status Ended(int rank, uint64_t completion) const;

  VerifyClient* client_ = nullptr;
  uint64_t id_ = 0;
  int num_layers_ = 0;
  Doorbells doorbells_ = Doorbells::kHost;
  std::vector<int64_t> prefix_len_;
  std::vector<Rank> ranks_;
  v1::OpenStepResponse response_;
};

}  // namespace mlaverify::client

#endif  // MLAVERIFY_CLIENT_STEPS_H_
