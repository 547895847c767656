// A team of threads that runs a whole multi-op program (the decode plan) in one
// parallel region: every member runs the same sequence of phases, takes work items of
// a phase from a shared counter, and meets the others at a spin barrier before the next
// phase. One region per call instead of one per op: no thread-pool wake-up per small
// GEMV, no dispatcher or Python between ops.
//
// The team is formed from torch's own intra-op pool (at::parallel_for, so its threads,
// thread count and fork handling are torch's; no second pool competes for the cores).
// A member joins by a compare-and-swap on a shared state; if all `want` members have not
// joined within kFormTimeout (a pool that gives fewer threads than asked, a nested
// region, a member descheduled for long on a busy machine), the first member to have
// joined takes the whole program alone (members = 1) and the others leave without
// running anything. Nothing can wait forever: once formed, every member runs the same
// phases, so every barrier is reached by all. In a forked child the program runs on the
// calling thread (forked_child below). The program must not throw (validate
// before calling run_team): a member leaving early would hold the others at a barrier.
#pragma once

#include <ATen/Parallel.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TOPG_SPIN_PAUSE() _mm_pause()
#else
#define TOPG_SPIN_PAUSE() ((void)0)
#endif

namespace topg::team {

constexpr auto kFormTimeout = std::chrono::milliseconds(50);
// Busy-wait iterations before a waiter starts yielding its core (a shared or
// oversubscribed machine: the member it waits for may need that core).
constexpr int kSpinsBeforeYield = 2048;

inline void spin_wait(int& spins) {
  if (++spins < kSpinsBeforeYield)
    TOPG_SPIN_PAUSE();
  else
    std::this_thread::yield();
}

// Sense-reversing barrier for a fixed number of members.
class Barrier {
 public:
  explicit Barrier(int members) : members_(members) {}
  void wait() {
    if (members_ <= 1) return;
    const int gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == members_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      gen_.store(gen + 1, std::memory_order_release);
      return;
    }
    int spins = 0;
    while (gen_.load(std::memory_order_acquire) == gen) spin_wait(spins);
  }

 private:
  const int members_;
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<int> gen_{0};
};

// A shared work-item counter on its own cache line.
struct alignas(64) Counter {
  std::atomic<int64_t> next{0};
  int64_t take() { return next.fetch_add(1, std::memory_order_relaxed); }
};

// True in a process forked from this one after the library was loaded. GNU OpenMP's pool
// does not survive fork (a parallel region in the child waits forever for the parent's
// threads; torch's own ops hang there too unless torch.set_num_threads(1)), so a forked
// child runs the team's programs on its calling thread alone.
inline std::atomic<bool>& forked_child() {
  static std::atomic<bool> flag{false};
  return flag;
}
inline bool register_fork_handler() {
  static const bool done = [] {
    pthread_atfork(nullptr, nullptr, [] { forked_child().store(true); });
    return true;
  }();
  return done;
}

// Calls body(member, members, barrier) on `want` threads at once, or body(0, 1, barrier)
// on one thread when the team cannot form. Returns the number of members that ran.
template <typename Body>
int run_team(int want, Body&& body) {
  if (want <= 1 || at::in_parallel_region() || forked_child().load()) {
    Barrier solo(1);
    body(0, 1, solo);
    return 1;
  }
  std::atomic<int> state{0};  // members joined so far, or -1: the team did not form
  std::atomic<int> ran{0};
  Barrier barrier(want);
  at::parallel_for(0, want, 1, [&](int64_t, int64_t) {
    int s = state.load(std::memory_order_acquire), me = -1;
    while (s >= 0 && s < want) {
      if (state.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
        me = s;
        break;
      }
    }
    if (me < 0) return;  // the team formed without us, or gave up
    const auto t0 = std::chrono::steady_clock::now();
    int spins = 0;
    for (;;) {
      s = state.load(std::memory_order_acquire);
      if (s == want) break;
      if (s < 0) return;
      if (me == 0 && std::chrono::steady_clock::now() - t0 > kFormTimeout) {
        if (state.compare_exchange_strong(s, -1, std::memory_order_acq_rel)) {
          Barrier solo(1);
          body(0, 1, solo);
          ran.store(1, std::memory_order_relaxed);
          return;
        }
        continue;  // someone joined meanwhile: look again
      }
      spin_wait(spins);
    }
    body(me, want, barrier);
    if (me == 0) ran.store(want, std::memory_order_relaxed);
  });
  return ran.load(std::memory_order_relaxed);
}

}  // namespace topg::team
