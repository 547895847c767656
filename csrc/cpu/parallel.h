// Dynamic work distribution on top of at::parallel_for.
//
// at::parallel_for splits a range statically; attention work items have very
// different costs (causal query blocks near the end see more keys, ragged sequences
// differ in length), so items are handed out one by one from an atomic counter to
// one task per thread. Callers order items by decreasing cost (longest first).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace topg {

// Calls f(item, ws) for every item in [0, n), with ws a per-thread Workspace.
template <typename Workspace, typename F>
void parallel_dynamic(int64_t n, F&& f) {
  if (n <= 0) return;
  const int64_t tasks = std::min<int64_t>(at::get_num_threads(), n);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    Workspace ws;
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) f(i, ws);
  });
}

}  // namespace topg
