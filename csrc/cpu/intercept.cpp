// Eager interception: topg kernels as the implementations of aten ops, switched on and
// off at run time (torch_topg.enable() / disable()).
//
// topg::_enable_interception(ops) creates heap-allocated torch::Library objects of kind
// IMPL for the "aten" namespace, one per dispatch key, and registers an adapter kernel
// per requested op. topg::_disable_interception() destroys them; destroying a Library
// deregisters its kernels, so the dispatch table is exactly what it was before.
//
// Why a backend key works for these ops: aten::scaled_dot_product_attention, aten::rms_norm
// and aten::linear have no CPU/CUDA kernel, only a CompositeImplicitAutograd one (linear
// also an Autograd one). A kernel registered directly at CPU (or CUDA) wins over the
// composite for that key. The composite is also what autograd relied on (it decomposes
// into differentiable ops), so the adapter is registered at Autograd<Backend> too: with
// grad mode on and an input that requires grad it calls the original composite (same
// values and gradients as without topg), otherwise it runs topg.
//
// The adapters know topg only through its schemas (typed dispatcher handles), so the
// same adapter serves every device that has topg kernels: the enabling op registers at
// a backend key only where topg::<op> has a kernel at that key. Adding CUDA is the one
// entry in kBackends below.
//
// Whenever topg's semantics differ from aten's, the adapter calls the original kernel:
// see the `*_supported` predicates.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/linear_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/rms_norm_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/scaled_dot_product_attention_compositeimplicitautograd_dispatch.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace topg {
namespace {

// (backend key, its autograd key). A key is used only where topg::<op> has a kernel at
// it (the check below skips the others, e.g. CUDA in a build without csrc/cuda).
struct BackendKeys {
  c10::DispatchKey backend, autograd;
};
constexpr BackendKeys kBackends[] = {
    {c10::DispatchKey::CPU, c10::DispatchKey::AutogradCPU},
    {c10::DispatchKey::CUDA, c10::DispatchKey::AutogradCUDA},
};

bool wants_grad(std::initializer_list<const at::Tensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : ts)
    if (t && t->defined() && t->requires_grad()) return true;
  return false;
}

bool float_dtype(at::ScalarType s) {
  return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf;
}

// --- aten::scaled_dot_product_attention -> topg::attention --------------------------

using AttentionFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                               bool, std::optional<double>, int64_t, double,
                               const std::optional<at::Tensor>&, std::optional<int64_t>,
                               std::optional<int64_t>, const std::optional<at::Tensor>&);

const c10::TypedOperatorHandle<AttentionFn>& topg_attention() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("topg::attention", "").typed<AttentionFn>();
  return op;
}

// Cases where topg::attention computes exactly what SDPA computes. Everything else
// (dropout, top-left causal with Sq != Sk, broadcast batches, odd ranks or dtypes,
// masks that may blank a whole row: SDPA returns NaN there, topg zeros) runs the
// original kernel.
bool sdpa_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                    bool enable_gqa) {
  if (dropout_p > 0.0) return false;
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return false;
  if (!float_dtype(q.scalar_type()) || k.scalar_type() != q.scalar_type() ||
      v.scalar_type() != q.scalar_type())
    return false;
  if (q.device() != k.device() || q.device() != v.device()) return false;
  const int64_t b = q.size(0), hq = q.size(1), sq = q.size(2), d = q.size(3);
  const int64_t hkv = k.size(1), sk = k.size(2);
  if (k.size(0) != b || v.size(0) != b || v.size(1) != hkv || v.size(2) != sk) return false;
  if (k.size(3) != d || v.size(3) != d) return false;
  if (b == 0 || hq == 0 || sq == 0 || sk == 0 || d == 0) return false;
  if (hkv != hq && !(enable_gqa && hkv > 0 && hq % hkv == 0)) return false;
  if (q.stride(3) != 1 || k.stride(3) != 1 || v.stride(3) != 1) return false;
  if (is_causal && (mask.has_value() || sq != sk)) return false;
  if (mask.has_value()) {
    const at::Tensor& m = *mask;
    if (m.device() != q.device() || m.dim() > 4) return false;
    const int64_t full[4] = {b, hq, sq, sk};
    for (int64_t i = 1; i <= m.dim(); ++i)
      if (m.size(-i) != 1 && m.size(-i) != full[4 - i]) return false;  // aten raises
    // A row that sees no key: SDPA gives NaN, topg zeros. Bool masks: an all-False row;
    // additive masks: an all -inf row (HF's finfo.min masks are finite: both agree).
    if (m.scalar_type() == at::kBool) {
      if (!m.any(-1).all().item<bool>()) return false;
    } else if (m.scalar_type() != q.scalar_type()) {
      return false;
    } else if (m.isneginf().all(-1).any().item<bool>()) {
      return false;
    }
  }
  return true;
}

at::Tensor sdpa_adapter(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        const std::optional<at::Tensor>& attn_mask, double dropout_p,
                        bool is_causal, std::optional<double> scale, bool enable_gqa) {
  if (wants_grad({&query, &key, &value, attn_mask ? &*attn_mask : nullptr}) ||
      !sdpa_supported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa))
    return at::compositeimplicitautograd::scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  // [B, H, S, D] -> [B, S, H, D] views (topg needs only the last dim contiguous); the
  // [B, S, H, D] result is returned as a [B, H, S, D] view, the layout CPU flash
  // attention returns too.
  const at::Tensor out = topg_attention().call(
      query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), std::nullopt, std::nullopt,
      is_causal, scale, -1, 0.0, attn_mask, std::nullopt, std::nullopt, std::nullopt);
  return out.transpose(1, 2);
}

// --- aten::rms_norm -> topg::rms_norm -----------------------------------------------

using RmsNormFn = at::Tensor(const at::Tensor&, const at::Tensor&, double);

const c10::TypedOperatorHandle<RmsNormFn>& topg_rms_norm() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("topg::rms_norm", "").typed<RmsNormFn>();
  return op;
}

at::Tensor rms_norm_adapter(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                            const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  // topg normalises over the last dim with a weight of the input's dtype (or fp32 for
  // half inputs, where aten's result dtype is the input's too) and an explicit eps.
  const bool ok =
      !wants_grad({&input, weight ? &*weight : nullptr}) && normalized_shape.size() == 1 &&
      weight.has_value() && weight->defined() && eps.has_value() && input.dim() >= 1 &&
      input.numel() > 0 && float_dtype(input.scalar_type()) && weight->dim() == 1 &&
      weight->device() == input.device() && (weight->scalar_type() == input.scalar_type()) &&
      normalized_shape[0] == input.size(-1);
  if (!ok)
    return at::compositeimplicitautograd::rms_norm_symint(input, normalized_shape, weight, eps);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return topg_rms_norm().call(input, *weight, *eps);
}

// --- aten::linear -> topg::linear -----------------------------------------------------

using LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&);

const c10::TypedOperatorHandle<LinearFn>& topg_linear() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("topg::linear", "").typed<LinearFn>();
  return op;
}

// Where topg::linear beats aten's fp32 GEMM (MKL / oneDNN) on CPU, measured with
// python/benchmarks/eager_enable.py and the linear family benchmark:
//   * up to 16 rows (decode, small batches): topg's GEMV streams the weight once and
//     uses every thread, MKL's small-M path mostly one;
//   * from 128 rows with N >= 512 outputs (prefill): topg's packed GEMM is at parity or
//     faster (1.1-1.7x on one thread, 1.0-1.2x on two; the vocabulary projection most);
//   * in between, and for narrow outputs (k/v projections, N = 192), MKL is faster.
// Half-precision inputs go to topg at every size (aten has no fast bf16/fp16 GEMM
// without AVX-512 BF16 / AMX).
constexpr int64_t kFp32SmallRows = 16, kFp32LargeRows = 128, kFp32LargeMinN = 512;

bool fp32_topg_faster(int64_t rows, int64_t n) {
  return rows <= kFp32SmallRows || (rows >= kFp32LargeRows && n >= kFp32LargeMinN);
}

at::Tensor linear_adapter(const at::Tensor& input, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
  const bool has_bias = bias.has_value() && bias->defined();
  bool ok = !wants_grad({&input, &weight, has_bias ? &*bias : nullptr}) && input.dim() >= 1 &&
            input.numel() > 0 && float_dtype(input.scalar_type()) && weight.dim() == 2 &&
            weight.scalar_type() == input.scalar_type() && weight.is_contiguous() &&
            weight.size(1) == input.size(-1) && weight.size(0) > 0 &&
            weight.device() == input.device() &&
            (!has_bias || (bias->dim() == 1 && bias->scalar_type() == input.scalar_type() &&
                           bias->size(0) == weight.size(0) && bias->device() == input.device()));
  if (ok && input.scalar_type() == at::kFloat)
    ok = fp32_topg_faster(input.numel() / input.size(-1), weight.size(0));
  if (!ok) return at::compositeimplicitautograd::linear(input, weight, bias);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return topg_linear().call(input, weight, bias);
}

// --- the switch -----------------------------------------------------------------------

struct Adapter {
  const char* aten_op;  // what is intercepted
  const char* topg_op;  // the topg op that must have a kernel at the key
  void (*add)(torch::Library&);
};

const Adapter kAdapters[] = {
    {"scaled_dot_product_attention", "attention",
     [](torch::Library& m) { m.impl("scaled_dot_product_attention", &sdpa_adapter); }},
    {"rms_norm", "rms_norm",
     [](torch::Library& m) { m.impl("rms_norm", TORCH_FN(rms_norm_adapter)); }},
    {"linear", "linear", [](torch::Library& m) { m.impl("linear", &linear_adapter); }},
};

std::mutex g_mutex;
std::vector<std::unique_ptr<torch::Library>> g_libs;
std::vector<std::string> g_active;

void disable_interception() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_libs.clear();  // ~Library deregisters every kernel it registered
  g_active.clear();
}

// Registers the adapters for `ops` (aten op names) at every backend key where the
// matching topg op has a kernel; returns "<aten op>.<Backend>" for each registration.
// Replaces whatever an earlier call registered. Unknown names are an error.
std::vector<std::string> enable_interception(const std::vector<std::string>& ops) {
  for (const auto& name : ops) {
    bool known = false;
    for (const auto& a : kAdapters) known = known || name == a.aten_op;
    TORCH_CHECK(known, "topg::_enable_interception: no adapter for aten::", name);
  }
  disable_interception();
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& keys : kBackends) {
    std::unique_ptr<torch::Library> backend_lib, autograd_lib;
    for (const auto& a : kAdapters) {
      if (std::find(ops.begin(), ops.end(), a.aten_op) == ops.end()) continue;
      const auto topg =
          dispatcher.findSchemaOrThrow((std::string("topg::") + a.topg_op).c_str(), "");
      if (!topg.hasKernelForDispatchKey(keys.backend)) continue;
      if (!backend_lib) {
        backend_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", keys.backend,
                                                       __FILE__, __LINE__);
        autograd_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", keys.autograd,
                                                        __FILE__, __LINE__);
      }
      a.add(*backend_lib);
      a.add(*autograd_lib);
      g_active.push_back(std::string(a.aten_op) + "." + c10::toString(keys.backend));
    }
    if (backend_lib) {
      g_libs.push_back(std::move(backend_lib));
      g_libs.push_back(std::move(autograd_lib));
    }
  }
  return g_active;
}

}  // namespace
}  // namespace topg

// No tensor arguments: such ops dispatch through the Undefined key, which only a
// CompositeImplicitAutograd (catch-all) kernel covers.
TORCH_LIBRARY_IMPL(topg, CompositeImplicitAutograd, m) {
  m.impl("_enable_interception", &topg::enable_interception);
  m.impl("_disable_interception", &topg::disable_interception);
}
