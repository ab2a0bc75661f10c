// Abseil's Mutex deadlock detector, off for a whole program. Debian's Abseil
// is built without NDEBUG, which turns the detector on: every lock and every
// Mutex destroyed then takes one process-wide spin lock, and a lock taken
// while another is held records a stack trace. The server and the client tool
// take several locks per call on every thread; their mains, and the native
// library of the Python package when it makes its client, call this. The
// setting is process-wide (every user of the same Abseil in the process, gRPC
// among them, sheds the detector); the tests, which run no main, keep it.
#ifndef MLAVERIFY_COMMON_MUTEX_TUNING_H_
#define MLAVERIFY_COMMON_MUTEX_TUNING_H_

namespace mlaverify {

void TurnOffMutexDeadlockDetection();

}  // namespace mlaverify

#endif  // MLAVERIFY_COMMON_MUTEX_TUNING_H_
