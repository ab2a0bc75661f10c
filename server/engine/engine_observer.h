// What the engine reports as it runs, for metrics: an interface so that the
// engine needs no metrics library (server/main.cc adapts it to Prometheus).
// Implementations must be thread-safe and cheap: they are called on worker
// threads, once per batch and once per call.
#ifndef MLAVERIFY_SERVER_ENGINE_ENGINE_OBSERVER_H_
#define MLAVERIFY_SERVER_ENGINE_ENGINE_OBSERVER_H_

#include <string>

#include "absl/status/status.h"
#include "server/engine/device.h"
#include "server/engine/steps.h"

namespace mlaverify::engine {

// One verify batch a device ran.
struct BatchReport {
  int device = 0;             // index in the engine's device list
  int requests = 0;           // real (non-padding) requests
  int rows = 0;               // their draft tokens
  BatchShape shape;           // launch shape: the graph bucket, or the exact shape
  bool graph = false;         // replayed a captured graph (else eager launches)
  bool reused_plan = false;   // read the previous launch's plan
  double device_seconds = 0;  // device time of the batch
  // Host time of the worker's steps: writing the batch's slot (from taking
  // the batch to the launch call), the launch call, and completing its calls
  // (staged outputs copied out, callbacks run); handoff: from the device
  // thread seeing the batch finished to its completion starting (waiting
  // for the completion thread and for the batches before it).
  double pack_seconds = 0;
  double launch_seconds = 0;
  double unpack_seconds = 0;
  double handoff_seconds = 0;
  int copy_descriptors = 0;  // the batch's gather and output lists together
};

// One finished Verify call, its server-side time split: waiting in a device
// queue, the device time of its batch(es), and the rest (validation, host
// copies, completion).
struct VerifyTiming {
  int items = 0;
  double queue_seconds = 0;
  double device_seconds = 0;
  double total_seconds = 0;
};

class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  virtual void OnBatch(const BatchReport& report) = 0;
  virtual void OnVerifyDone(const VerifyTiming& timing) = 0;
  // A device faulted (once per device).
  virtual void OnDeviceFault(const std::string& device, const absl::Status& status) = 0;
  // A device-driven step ended (committed or aborted), on the step runner's
  // thread.
  virtual void OnStepEnded(const StepReport& report) {}
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_ENGINE_OBSERVER_H_
