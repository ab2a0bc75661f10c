#include "server/engine/call_placement.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/bf16.h"
#include "common/byte_size_text.h"
#include "common/draft_tree.h"
#include "common/geometry.h"
#include "common/status_macros.h"

namespace mlaverify::engine {
namespace {

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBf16:
      return "DTYPE_BF16";
    case DType::kFp32:
      return "DTYPE_FP32";
    default:
      return "DTYPE_UNSPECIFIED";
  }
}

size_t DTypeBytes(DType dtype) { return dtype == DType::kFp32 ? 4 : 2; }

std::string ShapeText(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Elements of a shape, or -1 when a dimension is negative or the product
// exceeds 2^40 (no tensor of the contract is near that: the check keeps the
// arithmetic from overflowing on hostile shapes).
int64_t Elements(std::initializer_list<int64_t> shape) {
  constexpr int64_t kMaxElements = int64_t{1} << 40;
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || (d > 0 && n > kMaxElements / d)) return -1;
    n *= d;
  }
  return n;
}

// Staged tensors start at multiples of this in the call's block.
constexpr size_t kStagingAlign = 256;

size_t Aligned(size_t bytes) { return (bytes + kStagingAlign - 1) / kStagingAlign * kStagingAlign; }

// Checks and places the tensors of one call (the leases it takes are the
// call's).
class TensorPlacer {
 public:
  TensorPlacer(const PlacementGeometry& geometry, RegionRegistry& regions, RegionLeases& leases)
      : geometry_(geometry), regions_(regions), leases_(leases) {}

  absl::StatusOr<PlacedTensor> Input(const TensorRef& ref, DType dtype,
                                     std::initializer_list<int64_t> shape, const TensorName& name) {
    if (ref.dtype != dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat(name.str(), ": dtype ",
                       ref.dtype == DType::kOther ? ref.dtype_name : DTypeName(ref.dtype),
                       ", expected ", DTypeName(dtype)));
    }
    if (ref.has_shape &&
        !std::equal(ref.shape.begin(), ref.shape.end(), shape.begin(), shape.end())) {
      return absl::InvalidArgumentError(absl::StrCat(name.str(), ": shape ", ShapeText(ref.shape),
                                                     ", expected ", ShapeText(shape)));
    }
    ASSIGN_OR_RETURN(PlacedTensor p, Sized(dtype, shape, name));
    if (ref.in_region) {
      RETURN_IF_ERROR(InRegion(ref.range, dtype, /*is_output=*/false, &p));
      return p;
    }
    if (ref.bytes.size() != p.bytes) {
      return absl::InvalidArgumentError(absl::StrCat(name.str(), ": ", ref.bytes.size(),
                                                     " bytes of data, shape ", ShapeText(shape),
                                                     " needs ", p.bytes));
    }
    p.host = const_cast<uint8_t*>(ref.bytes.data());
    p.where = HostPlace();
    return p;
  }

  absl::StatusOr<PlacedTensor> Output(const OutputRef& ref, DType dtype,
                                      std::initializer_list<int64_t> shape,
                                      const TensorName& name) {
    ASSIGN_OR_RETURN(PlacedTensor p, Sized(dtype, shape, name));
    if (ref.in_region) {
      RETURN_IF_ERROR(InRegion(ref.range, dtype, /*is_output=*/true, &p));
      return p;
    }
    if (ref.grow != nullptr && ref.buffer.empty()) {
      p.grow = ref.grow;  // filled once the call passed its checks
    } else {
      if (ref.buffer.size() != p.bytes) {
        return absl::InvalidArgumentError(absl::StrCat(name.str(), ": a buffer of ",
                                                       ref.buffer.size(), " bytes, shape ",
                                                       ShapeText(shape), " needs ", p.bytes));
      }
      p.host = ref.buffer.data();
    }
    p.where = HostPlace();
    return p;
  }

  // Rows an fp8 pool quantizes: its scales come from the values, so a NaN
  // or an infinity would poison a whole 128-value group. They are checked
  // once they sit where the client cannot change them (FillStagedInputs):
  // rows from a region are staged, or copied where nothing is staged.
  absl::Status MarkRowsToCheck(PlacedTensor& p) const {
    if (geometry_.kv_dtype == KvDtype::kBf16) return absl::OkStatus();
    if (p.host == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          p.name.str(), ": rows in device memory cannot be checked for NaN/Inf before an ",
          KvDtypeName(geometry_.kv_dtype),
          " pool stores them; send them inline or in system shared memory"));
    }
    p.rows_to_check = true;
    if (p.from_region) {
      if (geometry_.staged) {
        p.where = PlacedTensor::Where::kStaged;
      } else {
        // Host devices: read from a private copy FillStagedInputs makes.
        p.copy_privately = true;
        p.where = PlacedTensor::Where::kHost;
        p.region = nullptr;
      }
    }
    return absl::OkStatus();
  }

 private:
  PlacedTensor::Where HostPlace() const {
    return geometry_.staged ? PlacedTensor::Where::kStaged : PlacedTensor::Where::kHost;
  }

  static absl::StatusOr<PlacedTensor> Sized(DType dtype, std::initializer_list<int64_t> shape,
                                            const TensorName& name) {
    const int64_t n = Elements(shape);
    if (n < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name.str(), ": shape ", ShapeText(shape), " is negative or too large"));
    }
    PlacedTensor p;
    p.bytes = static_cast<size_t>(n) * DTypeBytes(dtype);
    p.name = name;
    return p;
  }

  // A region reference resolved into `p` (its bytes set): in place where
  // the devices address the region, else through the host staging.
  absl::Status InRegion(const RegionRange& range, DType dtype, bool is_output, PlacedTensor* p) {
    ASSIGN_OR_RETURN(ResolvedRange r, leases_.Resolve(regions_, range, p->bytes, DTypeBytes(dtype),
                                                      is_output, p->name));
    p->host = r.host();
    p->from_region = true;
    if (r.region->device().empty()) {
      // A region the devices cannot address (it could not be page-locked).
      p->where = HostPlace();
      return absl::OkStatus();
    }
    p->where = PlacedTensor::Where::kRegion;
    p->region = r.region;
    p->offset = r.offset;
    return absl::OkStatus();
  }

  const PlacementGeometry& geometry_;
  RegionRegistry& regions_;
  RegionLeases& leases_;
};

absl::Status CheckRowsFinite(KvDtype dtype, const uint8_t* host, size_t bytes,
                             const TensorName& name) {
  const auto* values = reinterpret_cast<const Bf16*>(host);
  const int64_t count = static_cast<int64_t>(bytes / sizeof(Bf16));
  for (int64_t row = 0; row * kLatentDim < count; ++row) {
    if (!AllFinite(values + row * kLatentDim, kLatentDim)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name.str(), ": row ", row, " holds a NaN or an infinity, which an ",
                       KvDtypeName(dtype), " pool cannot store (its scales come from the values)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

PlacementGeometry PlacementGeometry::Of(const EngineConfig& config, bool staged,
                                        size_t staging_capacity) {
  PlacementGeometry g;
  g.num_layers = config.num_layers;
  g.num_heads = config.num_heads;
  g.max_batch = config.max_batch();
  g.max_draft_len = config.max_draft_len();
  g.default_softmax_scale = config.default_softmax_scale;
  g.kv_dtype = config.kv_dtype;
  g.staged = staged;
  g.staging_capacity = staging_capacity;
  return g;
}

int64_t HostBytesOf(const PlacedTensor& t) {
  return t.host != nullptr || t.grow != nullptr ? static_cast<int64_t>(t.bytes) : 0;
}

absl::StatusOr<PlacedVerify> PlaceVerify(const PlacementGeometry& geometry, RegionRegistry& regions,
                                         const VerifyCall& call) {
  const int heads = geometry.num_heads;
  const absl::Span<VerifyItem> items = call.items;
  if (items.empty()) return absl::InvalidArgumentError("verify request has no items");
  if (static_cast<int>(items.size()) > geometry.max_batch) {
    return absl::InvalidArgumentError(absl::StrCat("verify request has ", items.size(),
                                                   " items; max_batch is ", geometry.max_batch));
  }
  if (call.layer < 0 || call.layer >= geometry.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", call.layer, " is outside 0..", geometry.num_layers - 1));
  }
  if (std::isnan(call.softmax_scale) || std::isinf(call.softmax_scale)) {
    return absl::InvalidArgumentError("softmax_scale must be finite");
  }
  PlacedVerify placed;
  placed.layer = call.layer;
  placed.scale = call.softmax_scale > 0.0f ? call.softmax_scale : geometry.default_softmax_scale;
  placed.items.resize(items.size());
  TensorPlacer placer(geometry, regions, placed.leases);
  for (size_t k = 0; k < items.size(); ++k) {
    const VerifyItem& it = items[k];
    const int64_t n = static_cast<int64_t>(it.parents.size());
    const auto where = [&] {
      return absl::StrCat("items[", k, "] (sequence ", it.sequence_id, ")");
    };
    if (n < 1 || n > geometry.max_draft_len) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ": ", n, " drafts (parents); need 1..", geometry.max_draft_len));
    }
    for (size_t j = 0; j < k; ++j) {
      if (items[j].sequence_id == it.sequence_id) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence ", it.sequence_id, " appears twice (items ", j, " and ", k, ")"));
      }
    }
    absl::StatusOr<std::vector<uint64_t>> words = BuildVisibility(it.parents);
    if (!words.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(where(), ": ", words.status().message()));
    }
    PlacedVerifyItem& p = placed.items[k];
    p.visibility = std::make_shared<const std::vector<uint64_t>>(*std::move(words));
    const int item = static_cast<int>(k);
    ASSIGN_OR_RETURN(
        p.q, placer.Input(it.q, DType::kBf16, {n, heads, kLatentDim}, {item, it.sequence_id, "q"}));
    ASSIGN_OR_RETURN(p.draft_kv, placer.Input(it.draft_kv, DType::kBf16, {n, kLatentDim},
                                              {item, it.sequence_id, "draft_kv"}));
    RETURN_IF_ERROR(placer.MarkRowsToCheck(p.draft_kv));
    if (it.out.in_region != it.lse.in_region) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), ": out_shared_memory and lse_shared_memory go together (both or neither)"));
    }
    ASSIGN_OR_RETURN(p.out, placer.Output(it.out, DType::kBf16, {n, heads, kValueDim},
                                          {item, it.sequence_id, "out"}));
    ASSIGN_OR_RETURN(
        p.lse, placer.Output(it.lse, DType::kFp32, {n, heads}, {item, it.sequence_id, "lse"}));
    for (PlacedTensor* t : {&p.q, &p.draft_kv, &p.out, &p.lse}) {
      // Tensors in device memory hold no host memory: they count as nothing queued.
      placed.admitted_bytes += HostBytesOf(*t);
      if (t->where == PlacedTensor::Where::kStaged) {
        t->staging_offset = placed.staging_bytes;
        placed.staging_bytes += Aligned(t->bytes);
      }
    }
  }
  if (!placed.leases.empty()) RETURN_IF_ERROR(placed.leases.CheckOutputsDoNotOverlap());
  return placed;
}

absl::StatusOr<PlacedAppend> PlaceAppend(const PlacementGeometry& geometry, RegionRegistry& regions,
                                         const AppendCall& call) {
  const int64_t layers = geometry.num_layers;
  int64_t tokens = call.tokens;
  if (call.kv.has_shape) {
    // T comes from the tensor itself; everything else must match the geometry.
    tokens = call.kv.shape.size() == 3 ? call.kv.shape[1] : -1;
    if (tokens < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv: shape ", ShapeText(call.kv.shape), ", expected [", layers, ", T, 576] with T >= 1"));
    }
  }
  if (tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("append of ", tokens, " tokens: need >= 1"));
  }
  PlacedAppend placed;
  placed.tokens = tokens;
  TensorPlacer placer(geometry, regions, placed.leases);
  ASSIGN_OR_RETURN(placed.rows, placer.Input(call.kv, DType::kBf16, {layers, tokens, kLatentDim},
                                             {-1, 0, "kv"}));
  PlacedTensor& rows = placed.rows;
  RETURN_IF_ERROR(placer.MarkRowsToCheck(rows));
  // The row-copy kernel reads 16-byte vectors: rows in a region at another
  // alignment go through the staging (system regions) or are refused.
  if (rows.where == PlacedTensor::Where::kRegion && geometry.staged &&
      (rows.region->device()[0] + rows.offset) % 16 != 0) {
    if (rows.host == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv: a CUDA shared-memory prompt must start at a multiple of 16 bytes (offset ",
          rows.offset, ")"));
    }
    rows.where = PlacedTensor::Where::kStaged;
  }
  if (rows.where == PlacedTensor::Where::kStaged) {
    if (rows.bytes > geometry.staging_capacity) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv: ", ByteSizeText(static_cast<int64_t>(rows.bytes)),
          " from host memory is more than the page-locked staging holds (--pinned-staging-bytes ",
          ByteSizeText(static_cast<int64_t>(geometry.staging_capacity)),
          "): append the prompt in smaller chunks"));
    }
    rows.staging_offset = 0;
    placed.staging_bytes = rows.bytes;
  }
  placed.admitted_bytes = HostBytesOf(rows);
  return placed;
}

std::vector<PlacedTensor*> InputsOf(PlacedVerify& call) {
  std::vector<PlacedTensor*> inputs;
  inputs.reserve(call.items.size() * 2);
  for (PlacedVerifyItem& item : call.items) {
    inputs.push_back(&item.q);
    inputs.push_back(&item.draft_kv);
  }
  return inputs;
}

absl::Status FillStagedInputs(const PlacementGeometry& geometry,
                              const std::vector<PlacedTensor*>& tensors, uint8_t* block,
                              std::vector<std::unique_ptr<uint8_t[]>>& private_copies) {
  for (PlacedTensor* t : tensors) {
    const uint8_t* read_by_devices = t->host;
    if (t->where == PlacedTensor::Where::kStaged) {
      std::memcpy(block + t->staging_offset, t->host, t->bytes);
      read_by_devices = block + t->staging_offset;
    } else if (t->copy_privately) {
      auto copy = std::make_unique<uint8_t[]>(t->bytes);
      std::memcpy(copy.get(), t->host, t->bytes);
      t->host = copy.get();
      read_by_devices = t->host;
      private_copies.push_back(std::move(copy));
    }
    if (t->rows_to_check) {
      RETURN_IF_ERROR(CheckRowsFinite(geometry.kv_dtype, read_by_devices, t->bytes, t->name));
    }
  }
  return absl::OkStatus();
}

}  // namespace mlaverify::engine
