// CUDA kernel: topg::fused_moe_q, fused_moe over packed quantised experts (quant.cuh).
//
// Decode-sized calls (T * k <= kGemvAssignments) or int8 activations: per assignment
// (token, slot) GEMVs, no sort and no device sync:
//   1. the token rows as fp32 padded to the gate/up format (rows_kernel, int8-rounded
//      with int8_activations);
//   2. gate/up, grid (I / 8, T * k): a warp per intermediate feature dots the gate and the
//      up row of the assignment's expert with its token, h = act(gate) * up (fp32, rows
//      padded with zeros to the down format; then int8-rounded with int8_activations);
//   3. down, grid (H / 8, T * k): y[assignment] = h . Wd^T (fp32);
//   4. combine, grid T: out[t] = sum_j topk_weights[t, j] * y[t * k + j], rounded once.
// Each assignment reads its expert's packed rows once; experts not hit are never read.
// Larger calls with fp32 activations de-quantise the experts to fp32 and run
// topg::fused_moe's grouped GEMM in fp32 (the reference's math), the input converted to
// fp32 and the output rounded once: memory for one layer's experts in fp32 for the call.
// A grouped kernel that de-quantises tiles into shared memory is left (docs/quantization.md).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <type_traits>

#include "common/quant_checks.h"
#include "quant.cuh"

namespace topg::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int64_t kGemvAssignments = 128;

template <typename Id>
__device__ __forceinline__ int64_t expert_of(const Id* ids, int64_t a, int64_t E) {
  const int64_t e = int64_t(ids[a]);
  return e >= 0 && e < E ? e : -1;  // a bad id (checks off) contributes nothing
}

template <typename Id>
__global__ void __launch_bounds__(kWarps * 32)
    gate_up_kernel(const float* __restrict__ x, int64_t xp, const Id* __restrict__ ids, int k,
                   const uint8_t* __restrict__ wgu, q::Format f, int64_t H, int64_t I, int64_t E,
                   Act act, float* __restrict__ h, int64_t hp) {
  const int lane = threadIdx.x & 31;
  const int64_t n = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5), a = blockIdx.y;
  if (n >= I) return;  // whole warp
  const int64_t e = expert_of(ids, a, E);
  if (e < 0) {
    if (lane == 0) h[a * hp + n] = 0.f;
    return;
  }
  const int64_t rb = f.row_bytes(H);
  const uint8_t* g = wgu + (e * 2 * I + n) * rb;
  const uint8_t* u = wgu + (e * 2 * I + I + n) * rb;
  const float* xr = x + (a / k) * xp;
  float sg = 0.f, su_ = 0.f;
  for (int64_t su = lane; su < xp / 32; su += 32) {
    float v[32];
    q::load_run(f, g, H, su, v);
    sg += q::dot32(v, xr + 32 * su);
    q::load_run(f, u, H, su, v);
    su_ += q::dot32(v, xr + 32 * su);
  }
  sg = warp_sum(sg), su_ = warp_sum(su_);
  if (lane == 0) h[a * hp + n] = act_apply(act, sg) * su_;
}

template <typename Id>
__global__ void __launch_bounds__(kWarps * 32)
    down_kernel(const float* __restrict__ h, int64_t hp, const Id* __restrict__ ids,
                const uint8_t* __restrict__ wd, q::Format f, int64_t H, int64_t I, int64_t E,
                float* __restrict__ y) {
  const int lane = threadIdx.x & 31;
  const int64_t n = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5), a = blockIdx.y;
  if (n >= H) return;  // whole warp
  const int64_t e = expert_of(ids, a, E);
  float s = 0.f;
  if (e >= 0) {
    const uint8_t* row = wd + (e * H + n) * f.row_bytes(I);
    for (int64_t su = lane; su < hp / 32; su += 32) {
      float v[32];
      q::load_run(f, row, I, su, v);
      s += q::dot32(v, h + a * hp + 32 * su);
    }
    s = warp_sum(s);
  }
  if (lane == 0) y[a * H + n] = s;
}

template <typename T, typename W, typename Id>
__global__ void combine_kernel(const float* __restrict__ y, const W* __restrict__ tw,
                               const Id* __restrict__ ids, int k, int64_t H, int64_t E,
                               T* __restrict__ out) {
  const int64_t t = blockIdx.x;
  for (int64_t n = threadIdx.x; n < H; n += blockDim.x) {
    float s = 0.f;
    for (int j = 0; j < k; ++j)
      if (expert_of(ids, t * k + j, E) >= 0) s += to_float(tw[t * k + j]) * y[(t * k + j) * H + n];
    out[t * H + n] = from_float<T>(s);
  }
}

at::Tensor fused_moe_q_cuda(const at::Tensor& hidden, const at::Tensor& w_gate_up,
                            const at::Tensor& w_down, const at::Tensor& topk_weights_,
                            const at::Tensor& topk_ids_, c10::string_view format,
                            const std::optional<c10::string_view>& down_format,
                            c10::string_view activation, bool int8_activations) {
  const char* op = "fused_moe_q";
  const quant::MoeQSizes sz =
      quant::fused_moe_q(hidden, w_gate_up, w_down, topk_weights_, topk_ids_, format, down_format,
                         activation, at::kCUDA);
  const int64_t T_ = sz.tokens, H = sz.hidden, E = sz.experts, I = sz.inter, k = sz.top_k;
  const c10::cuda::CUDAGuard guard(hidden.device());
  const at::Tensor x = hidden.contiguous(), ids = topk_ids_.contiguous();
  const at::Tensor tw = topk_weights_.contiguous();
  if (T_ == 0 || H == 0) return at::empty({T_, H}, x.options());
  if (I == 0) return at::zeros({T_, H}, x.options());
  if (index_checks_enabled()) {  // one device sync, only when asked (common.cuh)
    const auto [mn, mx] = at::aminmax(ids);
    if (mn.item<int64_t>() < 0 || mx.item<int64_t>() >= E) {
      const at::Tensor bad =
          at::nonzero(ids.reshape({-1}).lt(0).logical_or(ids.reshape({-1}).ge(E)));
      const int64_t i = bad[0][0].item<int64_t>();
      checks::bad_expert_id(ids.reshape({-1})[i].item<int64_t>(), i, E, op);
    }
  }
  const int64_t n_assign = T_ * k;
  if (n_assign > kGemvAssignments && !int8_activations) {
    // prefill-sized: the experts de-quantised to fp32, then fused_moe in fp32
    const int64_t hp = sz.fgu.padded(H), ip = sz.fd.padded(I);
    at::Tensor gu = at::empty({E * 2 * I, hp}, x.options().dtype(at::kFloat));
    at::Tensor dn = at::empty({E * H, ip}, x.options().dtype(at::kFloat));
    auto dequant = [&](const at::Tensor& w, const q::Format& f, int64_t rows, int64_t kk,
                       int64_t kp, at::Tensor& dst) {
      const int64_t threads = rows * (kp / 32);
      q::dequant_rows_kernel<><<<unsigned(ceil_div(threads, 256)), 256, 0, current_stream()>>>(
          cdptr<uint8_t>(w), f.row_bytes(kk), f, kk, kp, 0, rows, dst.data_ptr<float>());
      TOPG_CUDA_LAUNCH_CHECK();
    };
    dequant(w_gate_up, sz.fgu, E * 2 * I, H, hp, gu);
    dequant(w_down, sz.fd, E * H, I, ip, dn);
    const at::Tensor wgu = gu.view({E, 2 * I, hp}).narrow(2, 0, H).contiguous();
    const at::Tensor wd = dn.view({E, H, ip}).narrow(2, 0, I).contiguous();
    static const char* acts[] = {"silu", "gelu", "gelu_tanh"};
    const at::Tensor y =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("topg::fused_moe", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, c10::string_view)>()
            .call(x.to(at::kFloat), wgu, wd, tw.to(at::kFloat), ids, acts[int(sz.act)]);
    return y.to(x.scalar_type());
  }
  at::Tensor out = at::empty({T_, H}, x.options());
  const int64_t xp = sz.fgu.padded(H), hp = sz.fd.padded(I);
  const Act act = sz.act == checks::MoeAct::gelu        ? Act::gelu
                  : sz.act == checks::MoeAct::gelu_tanh ? Act::gelu_tanh
                                                        : Act::silu;
  TOPG_CHECK(n_assign <= 65535, op, "too many (token, expert) assignments for one call (", n_assign,
             ")");
  TOPG_CUDA_DISPATCH_FLOAT(x.scalar_type(), op, T, [&] {
    const at::Tensor x32 = q::prepare_rows(
        cdptr<T>(x), T_, H, xp, int8_activations ? quant::act_group(sz.fgu.fmt) : 0, x.options());
    at::Tensor h = at::zeros({n_assign, hp}, x.options().dtype(at::kFloat));
    at::Tensor y = at::empty({n_assign, H}, x.options().dtype(at::kFloat));
    auto run = [&](auto* id) {
      using Id = std::remove_const_t<std::remove_pointer_t<decltype(id)>>;
      gate_up_kernel<Id><<<dim3(unsigned(ceil_div(I, kWarps)), unsigned(n_assign)), kWarps * 32, 0,
                           current_stream()>>>(x32.data_ptr<float>(), xp, id, int(k),
                                               cdptr<uint8_t>(w_gate_up), sz.fgu, H, I, E, act,
                                               h.data_ptr<float>(), hp);
      TOPG_CUDA_LAUNCH_CHECK();
      const at::Tensor hr = int8_activations
                                ? q::prepare_rows(h.data_ptr<float>(), n_assign, hp, hp,
                                                  quant::act_group(sz.fd.fmt), x.options())
                                : h;
      down_kernel<Id><<<dim3(unsigned(ceil_div(H, kWarps)), unsigned(n_assign)), kWarps * 32, 0,
                        current_stream()>>>(hr.data_ptr<float>(), hp, id, cdptr<uint8_t>(w_down),
                                            sz.fd, H, I, E, y.data_ptr<float>());
      TOPG_CUDA_LAUNCH_CHECK();
      auto combine = [&](auto* w) {
        using W = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
        combine_kernel<T, W, Id><<<unsigned(T_), 256, 0, current_stream()>>>(
            y.data_ptr<float>(), w, id, int(k), H, E, dptr<T>(out));
      };
      if (tw.scalar_type() == at::kFloat)
        combine(cdptr<float>(tw));
      else
        combine(cdptr<T>(tw));
      TOPG_CUDA_LAUNCH_CHECK();
    };
    if (ids.scalar_type() == at::kInt)
      run(cdptr<int32_t>(ids));
    else
      run(cdptr<int64_t>(ids));
  });
  return out;
}

}  // namespace
}  // namespace topg::cuda

TORCH_LIBRARY_IMPL(topg, CUDA, m) { m.impl("fused_moe_q", &topg::cuda::fused_moe_q_cuda); }
