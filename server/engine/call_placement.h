// The first room of a call's life: everything about a Verify or an AppendKv
// that needs no sequence state and no device is checked here (layer, scale,
// item and draft counts, trees, every tensor's dtype, shape, size and region
// range, output overlap), and each tensor is placed: addressed in place in a
// region, copied through the call's host staging block, or caller memory
// the devices address as it is. The region leases the call needs are taken
// here too and travel with the result.
//
// Pure: nothing is reserved, locked or written, so a rejection changes
// nothing, and the step runs (and is tested) with no engine and no device:
// a PlacementGeometry and a RegionRegistry are all it reads.
//
// What follows in the engine (engine.cc): a CallReservation (admission,
// staging block, pages) is taken, the staged inputs are copied in and fp8
// rows checked on that copy (FillStagedInputs) with no sequence lock held,
// then the sequences are locked for their state checks and state change
// only.
#ifndef MLAVERIFY_SERVER_ENGINE_CALL_PLACEMENT_H_
#define MLAVERIFY_SERVER_ENGINE_CALL_PLACEMENT_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/kv_dtype.h"
#include "server/engine/calls.h"
#include "server/engine/engine_config.h"
#include "server/engine/regions.h"
#include "server/engine/tensor_ref.h"

namespace mlaverify::engine {

// What placement reads of the engine: the model's geometry and how host
// memory reaches its devices.
struct PlacementGeometry {
  int num_layers = 0;
  int num_heads = 0;
  int max_batch = 0;      // items per Verify
  int max_draft_len = 0;  // drafts per item
  float default_softmax_scale = 0;
  KvDtype kv_dtype = KvDtype::kBf16;
  // Host-resident tensors go through a page-locked staging block (GPU
  // devices); false where the devices address host memory as it is.
  bool staged = false;
  size_t staging_capacity = 0;  // the whole staging arena (staged only)

  static PlacementGeometry Of(const EngineConfig& config, bool staged, size_t staging_capacity);
};

// Where one tensor of a call is, once checked.
struct PlacedTensor {
  enum class Where {
    kHost,    // memory the devices address as it is (host devices)
    kStaged,  // copied through the call's staging block
    kRegion,  // a region the devices address in place
  };
  Where where = Where::kHost;
  uint8_t* host = nullptr;         // the bytes in this process (null: device memory)
  const Region* region = nullptr;  // kRegion
  uint64_t offset = 0;             // kRegion: from the region's start
  size_t bytes = 0;
  size_t staging_offset = 0;    // kStaged: in the call's block
  std::string* grow = nullptr;  // an output string filled once the call passed its checks
  bool from_region = false;     // named a region (in place or not)
  // An fp8 pool's rows: checked for NaN/Inf in memory the client can no
  // longer change (the staging copy, or `private_copy` where nothing is
  // staged), never in a region it may write during the call.
  bool rows_to_check = false;
  bool copy_privately = false;  // host devices: rows from a region, copied before the check
  TensorName name;              // in errors
};

// Host memory a call holds: tensor bytes the devices read from caller or
// region memory (device memory counts nothing), the admission's measure.
int64_t HostBytesOf(const PlacedTensor& t);

struct PlacedVerifyItem {
  PlacedTensor q, draft_kv, out, lse;
  std::shared_ptr<const std::vector<uint64_t>> visibility;  // one word per draft row
};

struct PlacedVerify {
  int layer = 0;
  float scale = 0;  // the softmax scale the call runs with
  std::vector<PlacedVerifyItem> items;
  RegionLeases leases;
  int64_t admitted_bytes = 0;  // host memory held while the call is queued
  size_t staging_bytes = 0;    // the staging block it needs (0: none)
};

struct PlacedAppend {
  int64_t tokens = 0;
  PlacedTensor rows;  // bf16 [num_layers, tokens, 576]
  RegionLeases leases;
  int64_t admitted_bytes = 0;
  size_t staging_bytes = 0;
};

// INVALID_ARGUMENT (a malformed call or tensor), or the region lease errors
// of RegionLeases::Resolve (FAILED_PRECONDITION, NOT_FOUND, OUT_OF_RANGE).
absl::StatusOr<PlacedVerify> PlaceVerify(const PlacementGeometry& geometry, RegionRegistry& regions,
                                         const VerifyCall& call);
absl::StatusOr<PlacedAppend> PlaceAppend(const PlacementGeometry& geometry, RegionRegistry& regions,
                                         const AppendCall& call);

// Copies every staged input of `tensors` into the staging block at `block`
// (its offsets set by placement), makes the private copies `copy_privately`
// asks for (kept alive in `private_copies`, `host` pointed at them), then
// checks the rows an fp8 pool will quantize on the copy the devices read.
// Runs before any sequence lock is taken. INVALID_ARGUMENT naming the row
// that holds a NaN or an infinity.
absl::Status FillStagedInputs(const PlacementGeometry& geometry,
                              const std::vector<PlacedTensor*>& tensors, uint8_t* block,
                              std::vector<std::unique_ptr<uint8_t[]>>& private_copies);
// The inputs of a placed call, in the order FillStagedInputs takes them.
std::vector<PlacedTensor*> InputsOf(PlacedVerify& call);

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_CALL_PLACEMENT_H_
