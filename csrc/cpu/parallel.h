// Work distribution for the CPU kernels on top of at::parallel_for.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace topg {

// Runs fn(i) for every i in [0, n) on the intra-op threads, handing items out one at a
// time from a shared counter. at::parallel_for splits a range into one static chunk per
// thread, so a thread the OS deschedules (a busy machine) holds up its whole half; here
// the other threads take its remaining items instead. Use items of ~0.1-1 ms.
template <typename F>
void parallel_items(int64_t n, F&& fn) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      fn(i);
  });
}

}  // namespace topg
