// mlaverify-parallel-for-bench: what one ParallelFor call costs the CPU
// paths (kernels/parallel_for.h, the shared WorkerPool) against starting and
// joining a thread per slice, the way it was done before the pool, side by
// side in one process. The work per call is small (4,096 additions), so the
// figures are the fork-join's own cost.
//   mlaverify-parallel-for-bench [--calls 20000] [--threads 2,8,16]
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "kernels/parallel_for.h"

namespace {

// The baseline: one thread started and joined per slice but the first.
template <typename Fn>
void ThreadPerSlice(int64_t n, int threads, Fn&& fn) {
  const int64_t per = (n + threads - 1) / threads;
  std::vector<std::thread> workers;
  for (int64_t begin = per; begin < n; begin += per) {
    workers.emplace_back([&fn, begin, end = std::min(n, begin + per)] { fn(begin, end); });
  }
  fn(0, std::min(n, per));
  for (std::thread& w : workers) w.join();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "mlaverify-parallel-for-bench: the shared pool's fork-join against a thread per slice"};
  int calls = 20000;
  std::vector<int> thread_counts = {2, 8, 16};
  app.add_option("--calls", calls, "ParallelFor calls per figure")->capture_default_str();
  app.add_option("--threads", thread_counts, "thread counts, comma-separated")->delimiter(',');
  CLI11_PARSE(app, argc, argv);
  std::atomic<int64_t> sink{0};
  const auto work = [&sink](int64_t begin, int64_t end) {
    int64_t s = 0;
    for (int64_t i = begin; i < end; ++i) s += i;
    sink.fetch_add(s, std::memory_order_relaxed);
  };
  std::printf("%u hardware threads; %d calls of 4096 elements per figure\n",
              std::thread::hardware_concurrency(), calls);
  for (const int threads : thread_counts) {
    for (int pass = 0; pass < 2; ++pass) {  // alternated: the second pass is warm
      const auto t0 = std::chrono::steady_clock::now();
      for (int c = 0; c < calls; ++c) ThreadPerSlice(4096, threads, work);
      const auto t1 = std::chrono::steady_clock::now();
      for (int c = 0; c < calls; ++c) mlaverify::kernels::ParallelFor(4096, threads, work);
      const auto t2 = std::chrono::steady_clock::now();
      std::printf(
          "threads %2d pass %d: thread per slice %8.1f us/call, shared pool %6.1f us/call\n",
          threads, pass, std::chrono::duration<double, std::micro>(t1 - t0).count() / calls,
          std::chrono::duration<double, std::micro>(t2 - t1).count() / calls);
    }
  }
  return sink.load() == 0 ? 1 : 0;
}
