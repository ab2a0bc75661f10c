// A small fixed pool of threads for splitting one job into independent
// pieces (the host copies of a large batch between callers' buffers and
// pinned staging). Run() blocks until every piece is done; the calling thread
// takes pieces too, so a runner of one thread is a plain loop.
#ifndef MLAVERIFY_SERVER_ENGINE_PARALLEL_RUNNER_H_
#define MLAVERIFY_SERVER_ENGINE_PARALLEL_RUNNER_H_

#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace mlaverify::engine {

class ParallelRunner {
 public:
  // `threads` >= 1 includes the caller: threads - 1 helpers are started.
  explicit ParallelRunner(int threads);
  ~ParallelRunner();
  ParallelRunner(const ParallelRunner&) = delete;
  ParallelRunner& operator=(const ParallelRunner&) = delete;

  int threads() const { return static_cast<int>(helpers_.size()) + 1; }

  // Calls fn(i) for every i in [0, n), spread over the threads; returns when
  // all have returned. One Run at a time (not reentrant).
  void Run(int n, absl::FunctionRef<void(int)> fn);

 private:
  void HelperLoop();

  absl::Mutex mu_;
  const absl::FunctionRef<void(int)>* job_ ABSL_GUARDED_BY(mu_) = nullptr;
  int next_ ABSL_GUARDED_BY(mu_) = 0;
  int total_ ABSL_GUARDED_BY(mu_) = 0;
  int running_ ABSL_GUARDED_BY(mu_) = 0;  // pieces taken and not finished
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> helpers_;
};

}  // namespace mlaverify::engine

#endif  // MLAVERIFY_SERVER_ENGINE_PARALLEL_RUNNER_H_
