// Dynamic work distribution for the CPU kernels, on top of at::parallel_for.
//
// at::parallel_for splits a range into one static chunk per thread. Kernel work items
// often differ in cost (causal query blocks near the end see more keys, ragged
// sequences differ in length, experts get different token counts), and a thread the
// OS deschedules on a busy machine would hold up its whole chunk. Here items are handed
// out one at a time from a shared counter, so idle threads take the remaining ones.
// Use items of roughly 0.05-1 ms and order them by decreasing cost when costs differ.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace topg {

// Calls fn(i, ws) for every i in [0, n); ws is a Workspace constructed once per task
// (scratch buffers reused across that task's items).
template <typename Workspace, typename F>
void parallel_items_with(int64_t n, F&& fn) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    Workspace ws;
    for (int64_t i = 0; i < n; ++i) fn(i, ws);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Workspace ws;
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
         i = next.fetch_add(1, std::memory_order_relaxed))
      fn(i, ws);
  });
}

// Calls fn(i) for every i in [0, n).
template <typename F>
void parallel_items(int64_t n, F&& fn) {
  struct None {};
  parallel_items_with<None>(n, [&](int64_t i, None&) { fn(i); });
}

}  // namespace topg
