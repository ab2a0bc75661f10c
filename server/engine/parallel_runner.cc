#include "server/engine/parallel_runner.h"

namespace mlaverify::engine {

ParallelRunner::ParallelRunner(int threads) {
  for (int t = 1; t < threads; ++t) helpers_.emplace_back([this] { HelperLoop(); });
}

ParallelRunner::~ParallelRunner() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : helpers_) t.join();
}

void ParallelRunner::Run(int n, absl::FunctionRef<void(int)> fn) {
  if (n <= 0) return;
  if (helpers_.empty() || n == 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  absl::MutexLock lock(&mu_);
  job_ = &fn;
  next_ = 0;
  total_ = n;
  while (next_ < total_) {
    const int i = next_++;
    ++running_;
    mu_.Unlock();
    fn(i);
    mu_.Lock();
    --running_;
  }
  mu_.Await(absl::Condition(
      +[](ParallelRunner* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) { return r->running_ == 0; },
      this));
  job_ = nullptr;
}

void ParallelRunner::HelperLoop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(absl::Condition(
        +[](ParallelRunner* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) {
          return r->stopping_ || (r->job_ != nullptr && r->next_ < r->total_);
        },
        this));
    if (stopping_) return;
    const int i = next_++;
    ++running_;
    const absl::FunctionRef<void(int)> fn = *job_;
    mu_.Unlock();
    fn(i);
    mu_.Lock();
    --running_;
  }
}

}  // namespace mlaverify::engine
