// topg::_set_batch_invariant: the process-wide batch-invariant mode (modes.h).
#include "modes.h"

#include <torch/library.h>

#include <atomic>

namespace topg {
namespace {

std::atomic<bool> g_batch_invariant{false};

bool set_batch_invariant(bool enabled) { return g_batch_invariant.exchange(enabled); }

}  // namespace

bool batch_invariant() { return g_batch_invariant.load(std::memory_order_relaxed); }

}  // namespace topg

// No tensor arguments: only a CompositeImplicitAutograd (catch-all) kernel is reached.
TORCH_LIBRARY_IMPL(topg, CompositeImplicitAutograd, m) {
  m.impl("_set_batch_invariant", &topg::set_batch_invariant);
}
