// The hardware seam of the engine (in the spirit of LevelDB's Env): one
// Device is one KV pool replica and the place its verify batches run. The
// device worker (device_worker.h) owns a Device and is its only caller for
// launches; the engine reaches its memory functions (mapping client memory)
// through the worker. Implementations: CudaDevice (a GPU: buffers in device
// memory, slots in page-locked host memory, one CUDA graph per bucket),
// HostDevice (everything in host memory, the math of kernels/cpu_reference:
// the CPU backend), and HostDevice with FakeDeviceOptions (graph bookkeeping,
// latency and fault injection for tests without a GPU).
//
// How a launch gets its bytes: the worker writes a slot (one of a ring of
// `slots` regions of host memory the device reads in place, laid out by
// SlotLayout) with a copy list (kernels/copy_list.h) naming every byte the
// launch needs: page-table entries into the device's table arena, the
// request arrays and visibility words into the device's, each request's
// queries into the batch's query buffer and its draft rows straight into
// the pool, and the output list, which the launch runs after the attention
// to move each output row to its caller's memory. Every address in the
// lists is a device address (DeviceBuffers, AddressOfHost, OpenIpcMemory):
// inline bytes (through the engine's host staging), system shared memory and
// CUDA shared memory differ only in the addresses. Launches consume slots in ring order (the
// device keeps a cursor), and a slot is rewritten only once the launch that
// used it finished.
//
// Threading: Init, CaptureGraphs and every Launch* / ReadRows / UploadTable
// are called by one launcher at a time (the worker's launch lock); Wait from
// the completion thread; the memory functions from any thread. Work runs in
// the order it was launched.
#ifndef MLAVERIFY_SERVER_ENGINE_DEVICE_H_
#define MLAVERIFY_SERVER_ENGINE_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/bf16.h"
#include "common/kv_dtype.h"
#include "kernels/copy_list.h"

namespace mlaverify::engine {

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

// The per-request arrays the attention reads, one block of `max_batch`
// entries each (a slot holds one, copied whole into the device's): byte
// offsets inside the block.
struct RequestArraysLayout {
  size_t prefix_len = 0;    // int32 [max_batch]
  size_t draft_len = 0;     // int32 [max_batch]; 0: padding
  size_t layer = 0;         // int32 [max_batch]
  size_t scale = 0;         // float [max_batch]
  size_t table_offset = 0;  // int64 [max_batch]: where the request's page ids start in the arena
  size_t bytes = 0;
  static RequestArraysLayout For(int max_batch);
};

// Byte offsets inside one slot.
struct SlotLayout {
  int list_capacity = 0;       // descriptors of the gather list
  int output_capacity = 0;     // descriptors of the output list
  int64_t value_capacity = 0;  // page-table entries staged per launch
  RequestArraysLayout requests;
  size_t list = 0;           // CopyListHeader + [list_capacity]
  size_t request_block = 0;  // the request arrays
  size_t visibility = 0;     // uint64 [max_batch * max_draft_len]
  size_t outputs = 0;        // CopyListHeader + [output_capacity]
  size_t op = 0;             // int32 [2 + kMaxDraftLen]: a compaction's prefix, path length, path
  size_t values = 0;         // int32 [value_capacity]
  size_t bytes = 0;
  static SlotLayout For(int max_batch, int max_draft_len, int page_size,
                        int64_t max_pages_per_sequence);
};

// Page-table writes one launch carries at most (two per request of the
// largest batch); more changes than that go up as a whole-arena upload.
inline int MaxTableWrites(int max_batch) { return 2 * max_batch; }
// Descriptors the gather list of a launch of `shape` may hold: per request
// its queries and its draft rows (one descriptor per run of rows within a
// page), plus MaxTableWrites page-table writes, the request arrays, the
// visibility words and the output list.
int GatherCapacity(BatchShape shape, int page_size, int max_batch);
// Descriptors of the output list: out and lse per request.
inline int ScatterCapacity(BatchShape shape) { return 2 * shape.batch; }
// Blocks per descriptor of the copy kernels: about four rows each.
inline int CopyRowBlocks(int draft_len) { return draft_len < 4 ? 1 : draft_len / 4; }

// Device-driven verify steps (docs/steps.md): a lane runs the layers of one
// step at a time, each gated by a doorbell, beside the launches above and
// concurrently with them. It has its own batch buffers, one slot per layer,
// a page table of its own (the step's items' page lists, so the shared
// arena may change under it) and, on a GPU, its own stream and graphs. The
// engine writes every layer's slot and the table before LaunchStep; the
// lane then runs layer l once the doorbell holds base + l + 1 or more and
// stores base + l + 1 into the completion slot once the layer's outputs are
// written. A value past base + layers in either slot ends the step: every
// wait passes (see EndLane).
struct LaneGeometry {
  int lanes = 0;              // lanes of the device (0: no device-driven steps)
  SlotLayout slot;            // each layer's slot (no page-table values)
  int64_t table_entries = 0;  // int32 page ids: max_batch * max_pages_per_sequence
};

struct DeviceGeometry {
  int num_layers = 0;
  int64_t num_pages = 0;
  int page_size = 0;
  KvDtype kv_dtype = KvDtype::kBf16;  // how the pool stores a row
  int num_heads = 0;                  // heads this device computes
  int max_batch = 0;                  // the largest batch bucket
  int max_draft_len = 0;
  int slots = 2;  // launches in flight at most
  // Wait(slot) sleeps in the OS until the launch ends (CUDA: its events are
  // created with cudaEventBlockingSync) instead of spinning on it: the
  // device thread then costs no core while launches run
  // (EngineConfig::poll_launches false).
  bool blocking_wait = false;
  int64_t table_entries = 0;
  SlotLayout slot;
  LaneGeometry lanes;
};

// Device addresses of the buffers a launch uses, fixed from Init on.
struct DeviceBuffers {
  uint64_t pool = 0;        // [num_layers, num_pages, page_size, KvRowBytes(kv_dtype) bytes]
  uint64_t table = 0;       // int32 [table_entries]: the page-table arena
  uint64_t q = 0;           // bf16 [max rows, heads, 576]: the batch's queries
  uint64_t out = 0;         // bf16 [max rows, heads, 512]
  uint64_t lse = 0;         // fp32 [max rows, heads]
  uint64_t requests = 0;    // the request arrays
  uint64_t visibility = 0;  // uint64 [max rows]
  uint64_t outputs = 0;     // the output list
  uint64_t slots = 0;       // slot 0; slot k at + k * SlotLayout::bytes
  // bf16 [max rows, 576]: a batch's draft rows, packed like q, which the
  // launch quantizes into an fp8 pool before the attention (0 for a bf16
  // pool: its draft rows are copied straight into the pool).
  uint64_t draft_kv = 0;
};

// Where a step's doorbell and completion slots are.
enum class DoorbellKind {
  kHost,    // 16-byte host slots (common/host_doorbell.h) in a mapped region
  kDevice,  // 64-bit words in the device's doorbell arena (GPU doorbells)
};

// The device's doorbell arena: 64-bit words in device memory that the
// scheduler's process maps (CUDA IPC) to ring with stream writes and wait
// with stream waits. Allocated at Init and never freed while the device
// lives (a freed and reallocated block can come back under the same IPC
// handle, which a client may still have open).
struct DoorbellArena {
  uint64_t address = 0;     // the first word as the device addresses it
  uint8_t* host = nullptr;  // the same words in this process (host devices), else null
  size_t bytes = 0;
  std::string ipc_handle;  // cudaIpcMemHandle_t bytes (GPUs), else empty
};

// The arena holds, per lane, this many pairs of slots (doorbell, then
// completion), which the engine rotates over, so that a late ring from an
// ended step lands on words no current step uses. A slot is 16 bytes with
// the 64-bit value first, as a host slot (common/host_doorbell.h) is, so
// host devices run the same protocol in host memory.
inline constexpr int kDoorbellPairsPerLane = 64;
inline constexpr uint64_t kDoorbellPairBytes = 32;
inline size_t DoorbellArenaBytes(int lanes) {
  return static_cast<size_t>(lanes) * kDoorbellPairsPerLane * kDoorbellPairBytes;
}

// One step on one lane (LaunchStep).
struct StepLaunch {
  int lane = 0;
  int layers = 0;
  BatchShape shape;  // a graph bucket, or the exact shape (eager)
  bool graph = false;
  int64_t table_entries = 0;  // lane table entries the engine wrote
  DoorbellKind kind = DoorbellKind::kHost;
  // kHost: this process's pointers to the two 16-byte slots, and the
  // completion slot as the device addresses it (a GPU stores into it).
  // kDevice: the words' byte offsets in the doorbell arena.
  uint64_t doorbell = 0, completion = 0, completion_device = 0;
  uint64_t base = 0;
};

// How far a lane's step got (any thread, never blocks).
struct LaneProgress {
  int layers_done = 0;   // layers whose completion was stored
  bool drained = false;  // nothing of its step is left to run: the lane is free
};

// One layer of a finished lane step, measured on the device where it can be.
struct LayerTiming {
  // The layer's run (on a GPU from the gather's start to the scatter's).
  double device_seconds = 0;
  // From the previous layer's end as measured above to this layer's start:
  // the wait for the scheduler's ring (0 for layer 0).
  double doorbell_wait_seconds = 0;
};

struct DeviceDescription {
  std::string name;  // e.g. "NVIDIA H200 (cuda:0, sm_90)"
  uint64_t memory_bytes = 0;
};

struct LaunchOptions {
  int slot = 0;
  BatchShape shape;
  // Replay the graph captured for `shape` rather than launching eagerly.
  bool graph = false;
  // The attention reads the plan the previous launch left in the workspace
  // (kernels::VerifyLaunchConfig::reuse_plan). The worker sets it only when
  // its fingerprint of that launch (shape and lengths) equals this one's.
  bool reuse_plan = false;
};

class Device {
 public:
  virtual ~Device() = default;

  // Short name for logs, metrics and errors: "cuda:0", "cpu", "fake:1".
  virtual std::string name() const = 0;
  virtual DeviceDescription Describe() const = 0;

  // Allocates the pool, the buffers and the slots. Called once, first.
  virtual absl::Status Init(const DeviceGeometry& geometry) = 0;
  // Makes the device current on the calling thread.
  virtual absl::Status BindThread() { return absl::OkStatus(); }
  virtual const DeviceBuffers& buffers() const = 0;
  // Slot `k` as the host writes it.
  virtual uint8_t* slot(int k) = 0;

  // Launch returns before the work ran (a GPU), or after (host devices).
  virtual bool asynchronous() const = 0;
  // Every host pointer is a device address (host devices): no staging.
  virtual bool addresses_host_memory() const = 0;

  // Whether CaptureGraphs and LaunchOptions::graph are supported.
  virtual bool SupportsGraphs() const = 0;
  // Records the launch sequence of `shape` (both plan variants), for the
  // device's batches and for every step lane. Returns the device memory the
  // recorded graphs hold, in bytes (0 when unknown).
  virtual absl::StatusOr<int64_t> CaptureGraphs(BatchShape shape) = 0;

  // A verify batch: the slot's gather, the attention, the output list.
  virtual absl::Status Launch(const LaunchOptions& options) = 0;
  // Pool operations, each running the slot's gather (page-table writes)
  // first, ordered after every launch before them; complete at Wait(slot).
  // `rows` is bf16 [num_layers, count, 576] at a device address, stored as
  // the pool's dtype stores rows; the sequence's page ids start at arena
  // entry `table_offset`.
  virtual absl::Status LaunchWriteRows(int slot, int gather_count, int64_t table_offset,
                                       int64_t start, int64_t count, uint64_t rows) = 0;
  // Moves the accepted drafts (the slot's op area: P, k, the path) from
  // P+path[t] to P+t in every layer.
  virtual absl::Status LaunchCompact(int slot, int gather_count, int64_t table_offset) = 0;
  // Table writes alone (a launch that has nothing else to do).
  virtual absl::Status LaunchGather(int slot, int gather_count) = 0;
  // Blocks until the launch on `slot` finished. Returns its device time in
  // seconds (measured on the device where it can be).
  virtual absl::StatusOr<double> Wait(int slot) = 0;
  // Whether Wait(slot) would return at once (true also on an error, which
  // Wait then reports). Never blocks.
  virtual bool Finished(int slot) { return true; }

  // Synchronous (tests and rare repairs): reads positions
  // start..start+count-1 of every layer into `rows` as stored ([num_layers,
  // count, KvRowBytes(kv_dtype) bytes], host memory); writes the whole
  // page-table arena.
  virtual absl::Status ReadRows(int64_t table_offset, int64_t start, int64_t count, Bf16* rows) = 0;
  virtual absl::Status UploadTable(absl::Span<const int32_t> entries) = 0;

  // ---- memory the calls reference (any thread) ----
  // Page-locks host memory for every device of the process, so that the
  // devices read and write it in place (a GPU; host devices need nothing:
  // OK). UnpinHost before the memory is unmapped.
  virtual absl::Status PinHost(void* data, size_t bytes) { return absl::OkStatus(); }
  virtual void UnpinHost(void* data) {}
  // Page-locked (or, on a host device, any) host memory as this device
  // addresses it.
  virtual absl::StatusOr<uint64_t> AddressOfHost(const void* data) {
    return reinterpret_cast<uint64_t>(data);
  }
  // Device memory another process exported (cudaIpcMemHandle bytes), opened
  // for this device. UNIMPLEMENTED where the device has none (host devices).
  virtual absl::StatusOr<uint64_t> OpenIpcMemory(absl::string_view handle) {
    return absl::UnimplementedError(absl::StrCat(name(), ": no device memory to share"));
  }
  virtual void CloseIpcMemory(uint64_t address) {}
  // `address` of this process's device memory on CUDA device `device_id`,
  // as this device addresses it (itself, or by peer access).
  virtual absl::StatusOr<uint64_t> AddressOfDeviceMemory(uint64_t address, int device_id) {
    return absl::UnimplementedError(absl::StrCat(name(), ": no device memory"));
  }
  // Page-locked host memory every device of the process addresses in place
  // (the staging of host-resident tensors; AddressOfHost gives each device's
  // address); Free gives it back. Host devices need none (UNIMPLEMENTED).
  virtual absl::StatusOr<uint8_t*> AllocateHostStaging(size_t bytes) {
    return absl::UnimplementedError(absl::StrCat(name(), ": needs no staging"));
  }
  virtual void FreeHostStaging(uint8_t* data) {}
  // The CUDA device ordinal, or -1 for devices that are not CUDA devices.
  virtual int cuda_ordinal() const { return -1; }

  // ---- device-driven steps (LaneGeometry) ----
  // Why doorbells of `kind` cannot be used here (OK: they can). Decided at
  // Init, by a real operation where that is the only way to know.
  virtual absl::Status DoorbellSupport(DoorbellKind kind) const {
    return absl::UnimplementedError(absl::StrCat(name(), " runs no device-driven steps"));
  }
  // The GPU doorbell arena (DoorbellSupport(kDevice) must be OK).
  virtual DoorbellArena doorbell_arena() const { return {}; }
  // Lane `lane`'s slot of layer `layer` as the host writes it (the lane's
  // gather reads it at lane_buffers(lane).slots + layer * the slot's bytes).
  virtual uint8_t* lane_slot(int lane, int layer) { return nullptr; }
  // The lane's buffers (pool as the device's; table: the lane's page table;
  // slots: layer 0's slot as the lane's gather reads it).
  virtual const DeviceBuffers& lane_buffers(int lane) const { return buffers(); }
  // The lane's page table as the host writes it (LaneGeometry::table_entries).
  virtual int32_t* lane_table(int lane) { return nullptr; }
  // Starts a step on a free lane, after every launch before it (launcher
  // only). Returns before any layer ran; never waits for the doorbell.
  virtual absl::Status LaunchStep(const StepLaunch& launch) {
    return absl::UnimplementedError(absl::StrCat(name(), " runs no device-driven steps"));
  }
  // Ends the lane's step early: stores `end_value` (past base + layers) into
  // its doorbell, so every layer still waiting runs at once (into pages the
  // engine drops), then into its completion once nothing is left to run, so
  // every wait of the scheduler passes. Any thread; never blocks; may be
  // called again (a late ring that lowered the doorbell is overwritten).
  virtual void EndLane(int lane, uint64_t end_value) {}
  virtual LaneProgress lane_progress(int lane) { return {}; }
  // Per layer, once the lane drained (empty where the device cannot say).
  virtual std::vector<LayerTiming> lane_timings(int lane) { return {}; }
};

// Test hooks of HostDevice: what a GPU would do that tests must see without one.
struct FakeDeviceOptions {
  // Device doorbells of steps in an arena of host memory, rung by the tests
  // directly (the CPU backend has host doorbells only).
  bool device_doorbells = true;
  // Claim graph support: CaptureGraphs records the shapes, and a graph launch
  // of a shape never captured fails with INTERNAL (a worker bug).
  bool graphs = true;
  // Every launch sleeps this long (a device that is slow enough for queues
  // to form).
  absl::Duration latency = absl::ZeroDuration();
  // The verify launch with this 1-based count fails with INTERNAL "injected
  // fault" (0: never), as a sticky device error would: every later call
  // fails too.
  int fail_launch = 0;
  // Launch returns at once and the work runs at Wait, as on a GPU (the
  // worker's asynchronous paths: the submitting thread launches).
  bool asynchronous = false;
  // False: like a GPU, the device addresses only its own buffers, host
  // memory it page-locked (PinHost) and the host staging it allocated; the
  // engine must stage everything else, and a copy descriptor that touches
  // any other byte fails the launch with INTERNAL.
  bool addresses_host_memory = true;
  // A device that takes time and computes nothing, for measuring the host
  // side on a machine without a GPU (mlaverify-engine-bench --backend
  // fake): asynchronous as a GPU is (`asynchronous` is implied), every
  // launch does none of its work (no copies, no attention: outputs and the
  // pool are left as they were) and finishes `launch_time + request_time x
  // its real requests` after the later of its launch and the previous
  // launch's end (one stream), which Finished and Wait observe; Wait sleeps
  // to that moment rather than spinning.
  bool timed_only = false;
  absl::Duration launch_time = absl::ZeroDuration();
  absl::Duration request_time = absl::ZeroDuration();
};

// What a fake device did, for assertions (read under `mu`).
struct FakeDeviceRecord {
  absl::Mutex mu;
  std::vector<BatchShape> captured ABSL_GUARDED_BY(mu);     // CaptureGraphs calls
  std::vector<LaunchOptions> launches ABSL_GUARDED_BY(mu);  // verify launches, in order
  std::vector<int> launch_requests ABSL_GUARDED_BY(mu);  // real (non-padding) requests per launch
  std::vector<int> gather_descriptors ABSL_GUARDED_BY(mu);          // per verify launch
  std::vector<std::thread::id> launch_threads ABSL_GUARDED_BY(mu);  // who called Launch
  int64_t table_entries_written ABSL_GUARDED_BY(mu) = 0;            // by gathers (moves included)
  int write_rows ABSL_GUARDED_BY(mu) = 0;
  int compacts ABSL_GUARDED_BY(mu) = 0;
  int table_uploads ABSL_GUARDED_BY(mu) = 0;
};

// The pool in host memory and the CPU reference math, on `threads` threads
// per batch (<= 0: all hardware threads). No graphs: every launch is eager.
std::unique_ptr<Device> MakeCpuDevice(int threads);

// A HostDevice with the test hooks above; `record` (may be null) is written
// as the device is used and must outlive it.
std::unique_ptr<Device> MakeFakeDevice(int index, const FakeDeviceOptions& options,
                                       FakeDeviceRecord* record, int threads = 1);

struct CudaDeviceOptions {
  // > 0: that verify launch runs a trapping kernel first (a real, sticky
  // device fault, for testing the fault path on a GPU).
  int fail_after_launches = 0;
};

// CUDA device `ordinal`: pool in device memory, slots in page-locked host
// memory, the kernels of kernels/verify_attention_cuda.h, a CUDA graph per
// bucket. UNAVAILABLE when the device cannot be used; UNIMPLEMENTED in a
// build without CUDA.
absl::StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int ordinal,
                                                       const CudaDeviceOptions& options = {});

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_DEVICE_H_
