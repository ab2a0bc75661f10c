#include "common/mutex_tuning.h"

#include "absl/synchronization/mutex.h"

namespace mlaverify {

void TurnOffMutexDeadlockDetection() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}

}  // namespace mlaverify
