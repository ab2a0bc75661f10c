// A fixed pool of threads that runs the engine calls of RPCs, so that gRPC's
// callback threads never block on compute (the CPU backend takes
// milliseconds per verify).
#ifndef MLAVERIFY_SERVER_TRANSPORT_WORK_QUEUE_H_
#define MLAVERIFY_SERVER_TRANSPORT_WORK_QUEUE_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace mlaverify::transport {

class WorkQueue {
 public:
  explicit WorkQueue(int threads);
  // Runs what is queued, then joins the threads.
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  void Submit(std::function<void()> task);

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace mlaverify::transport

#endif  // MLAVERIFY_SERVER_TRANSPORT_WORK_QUEUE_H_
