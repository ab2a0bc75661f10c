// The hardware seam of the engine (in the spirit of LevelDB's Env): one
// Device is one KV pool replica and the place its verify batches run. The
// device worker (device_worker.h) owns a Device and is its only caller; the
// engine never touches one directly. Implementations: CudaDevice (a GPU:
// pinned staging, device buffers, one CUDA graph per bucket), HostDevice (the
// pool in host memory, the math of kernels/cpu_reference: the CPU backend), and
// HostDevice with FakeDeviceOptions (graph bookkeeping, latency and fault
// injection for tests without a GPU).
//
// A verify batch travels through a staging set: the worker packs the batch's
// inputs into the set's input region (laid out by StagingLayout for the
// batch's shape), Launch() runs it, Wait() returns when the outputs sit in the
// set's output region. A device has a fixed number of staging sets, so the
// worker can pack the next batch while the previous one runs.
//
// Threading: Init, CaptureGraphs, Launch, WriteRows, ReadRows and Compact are
// called from the worker's launch thread; Wait from its completion thread;
// Staging from both; PinHostMemory and UnpinHostMemory from any thread (they
// touch no stream or buffer of the device). Work is executed in the order it
// was issued.
#ifndef MLAVERIFY_SERVER_ENGINE_DEVICE_H_
#define MLAVERIFY_SERVER_ENGINE_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/bf16.h"

namespace mlaverify::engine {

struct DeviceGeometry {
  int num_layers = 0;
  int64_t num_pages = 0;
  int page_size = 0;
  int num_heads = 0;  // heads this device computes
  // The largest batch shape a staging set holds (the largest buckets).
  int max_batch = 0;
  int max_draft_len = 0;
  int64_t max_pages_per_sequence = 0;  // page-table row length in staging
  int staging_sets = 2;
};

struct DeviceDescription {
  std::string name;  // e.g. "NVIDIA H200 (cuda:0, sm_90)"
  uint64_t memory_bytes = 0;
};

// The shape a batch runs with: `batch` requests of at most `draft_len` drafts
// each (a graph bucket, or the exact shape of an eager launch).
struct BatchShape {
  int batch = 0;
  int draft_len = 0;
  int rows() const { return batch * draft_len; }
  bool operator==(const BatchShape& o) const {
    return batch == o.batch && draft_len == o.draft_len;
  }
};

// Byte offsets of a batch's arrays inside a staging set, for one shape. The
// inputs are contiguous so that one copy moves them to the device, and so are
// the outputs; every array starts on a 256-byte boundary. The same offsets hold
// in host staging and in the device buffers it is copied to.
struct StagingLayout {
  BatchShape shape;
  int heads = 0;
  int64_t page_table_stride = 0;  // int32 page ids per request row
  // Input region.
  size_t prefix_len = 0;   // int32 [batch]
  size_t draft_len = 0;    // int32 [batch]
  size_t layer = 0;        // int32 [batch]
  size_t scale = 0;        // float [batch]
  size_t page_tables = 0;  // int32 [batch, page_table_stride]
  size_t visibility = 0;   // uint64 [rows]
  size_t q = 0;            // bf16 [rows, heads, 576]
  size_t draft_kv = 0;     // bf16 [rows, 576]
  size_t input_bytes = 0;
  // Output region.
  size_t out = 0;  // bf16 [rows, heads, 512]
  size_t lse = 0;  // fp32 [rows, heads]
  size_t output_bytes = 0;

  static StagingLayout For(BatchShape shape, int heads, int64_t page_table_stride);
};

// Typed host views of one staging set laid out for one shape. Request b's
// drafts occupy token rows [row_of(b), row_of(b) + draft_len[b]) (packed, no
// gaps); a request with draft_len 0 is padding.
struct StagingView {
  StagingLayout layout;
  uint8_t* input = nullptr;
  uint8_t* output = nullptr;

  int32_t* prefix_len() const { return At<int32_t>(input, layout.prefix_len); }
  int32_t* draft_len() const { return At<int32_t>(input, layout.draft_len); }
  int32_t* layer() const { return At<int32_t>(input, layout.layer); }
  float* scale() const { return At<float>(input, layout.scale); }
  int32_t* page_table(int b) const {
    return At<int32_t>(input, layout.page_tables) + b * layout.page_table_stride;
  }
  uint64_t* visibility() const { return At<uint64_t>(input, layout.visibility); }
  Bf16* q() const { return At<Bf16>(input, layout.q); }
  Bf16* draft_kv() const { return At<Bf16>(input, layout.draft_kv); }
  Bf16* out() const { return At<Bf16>(output, layout.out); }
  float* lse() const { return At<float>(output, layout.lse); }

 private:
  template <typename T>
  static T* At(uint8_t* base, size_t offset) {
    return reinterpret_cast<T*>(base + offset);
  }
};

// A strided copy between a staging set's device buffers and device memory
// elsewhere (a client's CUDA shared memory): `rows` rows of `width` bytes.
struct DeviceCopy {
  size_t staging_offset = 0;  // into the set's device input (or output) region
  size_t staging_pitch = 0;   // bytes between rows there
  void* other = nullptr;      // the client's device memory (as this device addresses it)
  size_t other_pitch = 0;     // bytes between rows there
  size_t width = 0;
  size_t rows = 0;
};

struct LaunchOptions {
  int set = 0;
  BatchShape shape;
  // Replay the graph captured for (set, shape) rather than launching eagerly.
  bool graph = false;
  // The attention reads the plan the previous launch left in the workspace
  // (kernels::VerifyLaunchConfig::reuse_plan). The worker sets it only when
  // its fingerprint of that launch (shape and lengths) equals this one's.
  bool reuse_plan = false;
  // The previous batch is still running: copy this one's inputs on a copy
  // stream, overlapped with it, then run the kernels after it (devices that
  // cannot ignore it).
  bool overlap_input = false;
  // Shards whose tensors are in device memory: after the staged inputs are
  // on the device these copies overwrite their q/draft_kv rows, and after
  // the attention these copy their out/lse rows to the client's memory,
  // all before Wait returns. Valid until Launch returns. Devices without
  // device memory refuse them.
  absl::Span<const DeviceCopy> inputs_from_device;
  absl::Span<const DeviceCopy> outputs_to_device;
};

class Device {
 public:
  virtual ~Device() = default;

  // Short name for logs, metrics and errors: "cuda:0", "cpu", "fake:1".
  virtual std::string name() const = 0;
  virtual DeviceDescription Describe() const = 0;

  // Allocates the pool and the staging sets. Called once, first.
  virtual absl::Status Init(const DeviceGeometry& geometry) = 0;
  // Makes the device current on the calling thread (each worker thread calls
  // it once before using the device).
  virtual absl::Status BindThread() { return absl::OkStatus(); }

  // Whether CaptureGraph and LaunchOptions::graph are supported.
  virtual bool SupportsGraphs() const = 0;
  // Records the launch sequence of `shape` on staging set `set` (both plan
  // variants when the device distinguishes them). Returns the device memory
  // the recorded graphs hold, in bytes (0 when unknown).
  virtual absl::StatusOr<int64_t> CaptureGraphs(int set, BatchShape shape) = 0;

  // Host views of staging set `set` for a batch of `shape`.
  virtual StagingView Staging(int set, BatchShape shape) = 0;

  // Starts the verify batch packed in `options.set` (asynchronous where the
  // device is). Draft rows are written into the pool before the attention.
  virtual absl::Status Launch(const LaunchOptions& options) = 0;
  // Blocks until the launch on `set` finished. Returns the device time of the
  // batch in seconds (measured on the device where it can be).
  virtual absl::StatusOr<double> Wait(int set) = 0;

  // Pool maintenance, each complete when it returns (and ordered after every
  // batch launched before it). `rows` is [num_layers, count, 576].
  virtual absl::Status WriteRows(absl::Span<const int32_t> page_table, int64_t start, int64_t count,
                                 const Bf16* rows) = 0;
  virtual absl::Status ReadRows(absl::Span<const int32_t> page_table, int64_t start, int64_t count,
                                Bf16* rows) = 0;
  // Moves the accepted drafts (a root-to-node path, increasing indices) from
  // P+accepted[t] to P+t in every layer.
  virtual absl::Status Compact(absl::Span<const int32_t> page_table, int64_t prefix_len,
                               absl::Span<const int32_t> accepted) = 0;

  // Page-locks [data, data + bytes) of host memory for every device of the
  // process, so that copies between it and a device run as DMA straight from
  // it (WriteRows then skips its staging copy for rows there). May take a
  // while for large ranges. UNIMPLEMENTED where the device has no use for it
  // (host devices); the device's error otherwise (e.g. the locked-memory
  // limit). UnpinHostMemory(data) before the memory is unmapped.
  virtual absl::Status PinHostMemory(void* data, size_t bytes) {
    return absl::UnimplementedError(absl::StrCat(name(), ": no use for pinned host memory"));
  }
  virtual void UnpinHostMemory(void* data) {}

  // Maps device memory another process exported (a cudaIpcMemHandle's
  // bytes) into this device's address space; CloseIpcMemory unmaps it.
  // Any thread. UNIMPLEMENTED where the device has none (host devices).
  virtual absl::StatusOr<void*> OpenIpcMemory(absl::string_view handle) {
    return absl::UnimplementedError(absl::StrCat(name(), ": no device memory to share"));
  }
  virtual void CloseIpcMemory(void* data) {}
  // The CUDA device ordinal, or -1 for devices that are not CUDA devices.
  virtual int cuda_ordinal() const { return -1; }
};

// Test hooks of HostDevice: what a GPU would do that tests must see without one.
struct FakeDeviceOptions {
  // Claim graph support: CaptureGraphs records the shapes, and a graph launch
  // of a shape never captured fails with INTERNAL (a worker bug).
  bool graphs = true;
  // Every Launch, WriteRows and Compact sleeps this long (a device that is
  // slow enough for queues to form).
  absl::Duration latency = absl::ZeroDuration();
  // The launch with this 1-based count fails with INTERNAL "injected fault"
  // (0: never), as a sticky device error would: every later call fails too.
  int fail_launch = 0;
};

// What a fake device did, for assertions (read under `mu`).
struct FakeDeviceRecord {
  absl::Mutex mu;
  std::vector<BatchShape> captured ABSL_GUARDED_BY(mu);     // CaptureGraphs calls
  std::vector<LaunchOptions> launches ABSL_GUARDED_BY(mu);  // Launch calls, in order
  std::vector<int> launch_requests ABSL_GUARDED_BY(mu);  // real (non-padding) requests per launch
  int write_rows ABSL_GUARDED_BY(mu) = 0;
  int compacts ABSL_GUARDED_BY(mu) = 0;
};

// The pool in host memory and the CPU reference math, on `threads` threads
// per batch (<= 0: all hardware threads). No graphs: every launch is eager.
std::unique_ptr<Device> MakeCpuDevice(int threads);

// A HostDevice with the test hooks above; `record` (may be null) is written
// as the device is used and must outlive it.
std::unique_ptr<Device> MakeFakeDevice(int index, const FakeDeviceOptions& options,
                                       FakeDeviceRecord* record, int threads = 1);

struct CudaDeviceOptions {
  // The attention writes out and lse straight into the pinned host staging
  // (mapped memory) instead of a device buffer and a device-to-host copy.
  // Off by default: on the H200 it saved 7.5 us per one-item batch at
  // L=16K but cost 50 us of device time at L=1K (bench/NOTES.md, e3).
  bool direct_output = false;
  // > 0: that verify launch runs a trapping kernel first (a real, sticky
  // device fault, for testing the fault path on a GPU).
  int fail_after_launches = 0;
};

// CUDA device `ordinal`: pool in device memory, pinned staging, the kernels of
// kernels/verify_attention_cuda.h, CUDA graphs per bucket. UNAVAILABLE when
// the device cannot be used; UNIMPLEMENTED in a build without CUDA.
absl::StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int ordinal,
                                                       const CudaDeviceOptions& options = {});

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_DEVICE_H_
