// topg::_set_batch_invariant, topg::_set_index_checks: process-wide modes (modes.h).
#include "modes.h"

#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <string>

namespace topg {
namespace {

std::atomic<bool> g_batch_invariant{false};

bool set_batch_invariant(bool enabled) { return g_batch_invariant.exchange(enabled); }

std::atomic<bool> g_index_checks{[] {
  const char* v = std::getenv("TOPG_CUDA_INDEX_CHECKS");
  return v != nullptr && std::string(v) == "1";
}()};

bool set_index_checks(bool enabled) { return g_index_checks.exchange(enabled); }

}  // namespace

bool batch_invariant() { return g_batch_invariant.load(std::memory_order_relaxed); }

bool index_checks() { return g_index_checks.load(std::memory_order_relaxed); }

}  // namespace topg

// No tensor arguments: only a CompositeImplicitAutograd (catch-all) kernel is reached.
TORCH_LIBRARY_IMPL(topg, CompositeImplicitAutograd, m) {
  m.impl("_set_batch_invariant", &topg::set_batch_invariant);
  m.impl("_set_index_checks", &topg::set_index_checks);
}
