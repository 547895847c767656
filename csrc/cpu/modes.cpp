// topg::_set_batch_invariant, topg::_set_index_checks: process-wide modes (modes.h);
// topg::_cpu_kernels: the instruction-set forms of the CPU kernels this process runs;
// topg::_set_amx: the AMX path (gemv_amx.h) on or off from the next call.
#include "modes.h"

#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

#include "gemv_amx.h"
#include "gemv_bf16dp.h"
#include "gemv_bf16split.h"
#include "quant_act.h"

namespace topg {
namespace {

std::atomic<bool> g_batch_invariant{false};

bool set_batch_invariant(bool enabled) { return g_batch_invariant.exchange(enabled); }

std::atomic<bool> g_index_checks{[] {
  const char* v = std::getenv("TOPG_CUDA_INDEX_CHECKS");
  return v != nullptr && std::string(v) == "1";
}()};

bool set_index_checks(bool enabled) { return g_index_checks.exchange(enabled); }

// What the run-time checks chose (the CPU's features and the TOPG_DISABLE_* switches):
// "avx2" always (the build's baseline), then "avx512" (gemv_avx512.h), "avx512_bf16"
// (gemv_bf16dp.h, paged_bf16dp.h) or "avx512_bf16split" (gemv_bf16split.h), "avx512_vnni"
// (quant_act.h), "amx_bf16" (gemv_amx.h).
std::vector<std::string> cpu_kernels() {
  std::vector<std::string> out{"avx2"};
  if (gemm::use_avx512()) out.push_back("avx512");
  if (gemm::use_bf16dp()) out.push_back("avx512_bf16");
  if (gemm::use_bf16split()) out.push_back("avx512_bf16split");
  if (quant::use_vnni()) out.push_back("avx512_vnni");
  if (gemm::amx::enabled()) out.push_back("amx_bf16");
  return out;
}

}  // namespace

bool batch_invariant() { return g_batch_invariant.load(std::memory_order_relaxed); }

bool index_checks() { return g_index_checks.load(std::memory_order_relaxed); }

}  // namespace topg

// No tensor arguments: only a CompositeImplicitAutograd (catch-all) kernel is reached.
TORCH_LIBRARY_IMPL(topg, CompositeImplicitAutograd, m) {
  m.impl("_set_batch_invariant", &topg::set_batch_invariant);
  m.impl("_set_index_checks", &topg::set_index_checks);
  m.impl("_cpu_kernels", &topg::cpu_kernels);
  m.impl("_set_amx", &topg::gemm::amx::set_enabled);
}
