// A minimal fork-join helper for the CPU paths: runs fn(begin, end) over
// contiguous slices of [0, n) on up to `num_threads` threads (the caller's
// thread takes the first slice). No pool: the CPU backend's calls are long
// compared with a thread start, and this keeps kernels/ free of state.
#ifndef MLAVERIFY_KERNELS_PARALLEL_FOR_H_
#define MLAVERIFY_KERNELS_PARALLEL_FOR_H_

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace mlaverify::kernels {

inline int ResolveThreadCount(int requested) {
  if (requested > 0) return requested;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

template <typename Fn>
void ParallelFor(int64_t n, int num_threads, Fn&& fn) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(ResolveThreadCount(num_threads), n);
  if (threads <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t per = (n + threads - 1) / threads;
  std::vector<std::thread> workers;
  workers.reserve(threads - 1);
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t begin = t * per;
    const int64_t end = std::min(n, begin + per);
    if (begin >= end) break;
    workers.emplace_back([&fn, begin, end] { fn(begin, end); });
  }
  fn(int64_t{0}, std::min(n, per));
  for (auto& w : workers) w.join();
}

}  // namespace mlaverify::kernels

#endif  // MLAVERIFY_KERNELS_PARALLEL_FOR_H_
