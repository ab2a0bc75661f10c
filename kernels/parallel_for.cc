#include "kernels/parallel_for.h"

namespace mlaverify::kernels {

WorkerPool& WorkerPool::Shared() {
  // Never destroyed: a static's destructor would join threads that the
  // process's other statics may still be using at exit.
  static WorkerPool* pool = new WorkerPool();
  return *pool;
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_.notify_all();
  for (std::thread& t : threads_) t.join();
}

int WorkerPool::threads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(threads_.size());
}

void WorkerPool::Grow(int helpers) {
  const int want = std::min(helpers, kMaxHelpers);
  while (static_cast<int>(threads_.size()) < want) {
    threads_.emplace_back([this] { WorkerLoop(); });
  }
}

bool WorkerPool::RunOne(const std::shared_ptr<Job>& job, std::unique_lock<std::mutex>& lock) {
  if (job->next >= job->tasks) return false;
  const int64_t index = job->next++;
  if (job->next == job->tasks) {
    // Every task is taken: no other thread needs to find this job.
    jobs_.erase(std::find(jobs_.begin(), jobs_.end(), job));
  }
  lock.unlock();
  (*job->task)(index);
  lock.lock();
  ++job->finished;
  if (job->finished == job->tasks) done_.notify_all();
  return true;
}

void WorkerPool::RunTasks(int64_t tasks, int helpers, const std::function<void(int64_t)>& task) {
  if (tasks <= 0) return;
  auto job = std::make_shared<Job>();
  job->tasks = tasks;
  job->task = &task;
  std::unique_lock<std::mutex> lock(mu_);
  if (tasks > 1 && helpers > 0) {
    Grow(helpers);
    jobs_.push_back(job);
    // As many helpers as there are tasks besides the caller's first.
    const int64_t wake = std::min<int64_t>(tasks - 1, helpers);
    for (int64_t k = 0; k < wake; ++k) work_.notify_one();
  } else {
    jobs_.push_back(job);
  }
  while (RunOne(job, lock)) {
  }
  // Tasks taken by helpers may still be running; `task` lives on the
  // caller's stack, so wait for every one of them.
  done_.wait(lock, [&job] { return job->finished == job->tasks; });
}

void WorkerPool::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    work_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
    if (stopping_) return;
    // The oldest job first: its caller has waited longest.
    const std::shared_ptr<Job> job = jobs_.front();
    RunOne(job, lock);
  }
}

}  // namespace mlaverify::kernels
