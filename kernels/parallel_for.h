// Fork-join for the CPU paths: ParallelFor runs fn(begin, end) over
// contiguous slices of [0, n) on up to `num_threads` threads, the caller's
// thread among them, and returns when every slice is done.
//
// The helpers come from one process-wide pool (WorkerPool::Shared) that
// grows to the most threads a call has asked for, instead of a thread
// started and joined per call: the CPU backend runs ParallelFor per Verify
// item (its keys, its rows), and starting and joining the threads cost 67 us
// at 2 threads and 2.1 ms at 16 on a 2-core host, against 5-38 us from the
// pool (bench/NOTES.md, "The CPU paths fork from one pool"). The caller
// always works through the slices too, so a call finishes even when every
// helper is busy with other calls, and a ParallelFor inside a slice
// (nesting) cannot deadlock.
#ifndef MLAVERIFY_KERNELS_PARALLEL_FOR_H_
#define MLAVERIFY_KERNELS_PARALLEL_FOR_H_

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace mlaverify::kernels {

inline int ResolveThreadCount(int requested) {
  if (requested > 0) return requested;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

// Threads that take the tasks of RunTasks calls. Thread-safe.
class WorkerPool {
 public:
  // Helper threads never exceed this, whatever a call asks.
  static constexpr int kMaxHelpers = 255;

  static WorkerPool& Shared();

  // Runs task(0) .. task(tasks - 1), each once, on the calling thread and on
  // up to `helpers` pool threads (started on first need), and returns when
  // all have returned.
  void RunTasks(int64_t tasks, int helpers, const std::function<void(int64_t)>& task);

  // Threads started so far (tests: the pool does not grow per call).
  int threads() const;

  ~WorkerPool();

 private:
  struct Job {
    int64_t tasks = 0;
    const std::function<void(int64_t)>* task = nullptr;
    int64_t next = 0;      // the next task to take (under mu_)
    int64_t finished = 0;  // tasks returned (under mu_)
  };
  void Grow(int helpers);  // under mu_
  void WorkerLoop();
  // Takes the job's next task and runs it with mu_ released; false when none
  // is left.
  bool RunOne(const std::shared_ptr<Job>& job, std::unique_lock<std::mutex>& lock);

  mutable std::mutex mu_;
  std::condition_variable work_;           // a job with tasks left, or stopping
  std::condition_variable done_;           // a task finished
  std::deque<std::shared_ptr<Job>> jobs_;  // with tasks left to take
  std::vector<std::thread> threads_;
  bool stopping_ = false;
};

template <typename Fn>
void ParallelFor(int64_t n, int num_threads, Fn&& fn) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(ResolveThreadCount(num_threads), n);
  if (threads <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t per = (n + threads - 1) / threads;
  const int64_t slices = (n + per - 1) / per;
  const std::function<void(int64_t)> slice = [&fn, per, n](int64_t s) {
    fn(s * per, std::min(n, (s + 1) * per));
  };
  WorkerPool::Shared().RunTasks(slices, static_cast<int>(threads - 1), slice);
}

}  // namespace mlaverify::kernels

#endif  // MLAVERIFY_KERNELS_PARALLEL_FOR_H_
