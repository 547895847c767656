// CUDA kernels: topg::linear_q and topg::embedding_q over packed weight-only quantised
// weights (quant.cuh; formats in torch_topg/quant/formats.py).
//
// linear_q: the activations become fp32 rows padded to the format's blocks (rounded to
// int8 with int8_activations, one scale per act_group: rows_kernel), then
//   M <= kRows  GEMV: one warp per output feature for all M rows; each lane de-quantises
//               runs of 32 weights in registers (load_run) and dots them with every row,
//               so the packed row is read once (memory-bound decode);
//   larger M    the weight is de-quantised to fp32 in chunks (dequant_rows_kernel) and
//               multiplied with at::mm (cuBLAS, fp32: TF32 stays off unless the user
//               turns it on), the de-quantisation amortised over M.
// Accumulation is fp32 and the output is rounded once, as the reference.
#include <ATen/ops/aminmax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "common/quant_checks.h"
#include "quant.cuh"

namespace topg::cuda {
namespace {

constexpr int kRows = 8, kWarps = 8;

template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_q_kernel(const float* __restrict__ x, int M, int64_t kp, const uint8_t* __restrict__ w,
                  int64_t rb, q::Format f, int64_t k, int64_t N, const T* __restrict__ bias,
                  T* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t n = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (n >= N) return;  // whole warp
  const uint8_t* row = w + n * rb;
  float acc[kRows] = {};
  for (int64_t su = lane; su < kp / 32; su += 32) {
    float v[32];
    q::load_run(f, row, k, su, v);
#pragma unroll
    for (int m = 0; m < kRows; ++m)
      if (m < M) acc[m] += q::dot32(v, x + m * kp + 32 * su);
  }
  const float b = bias ? to_float(bias[n]) : 0.f;
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    const float s = warp_sum(acc[m]);
    if (m < M && lane == 0) out[m * N + n] = from_float<T>(s + b);
  }
}

at::Tensor linear_q_cuda(const at::Tensor& input_, const at::Tensor& weight,
                         c10::string_view format, const std::optional<at::Tensor>& bias_,
                         bool int8_activations) {
  const char* op = "linear_q";
  const quant::LinearQSizes sz = quant::linear_q(input_, weight, format, bias_, at::kCUDA);
  const int64_t M = sz.M, K = sz.K, N = sz.N;
  const c10::cuda::CUDAGuard guard(input_.device());
  at::Tensor out = at::empty(sz.out_shape, input_.options());
  if (M == 0 || N == 0) return out;
  const at::Tensor input = input_.contiguous();
  const at::Tensor bias = bias_.has_value() ? bias_->contiguous() : at::Tensor();
  if (K == 0) {  // empty sum: the bias (or zeros)
    if (bias.defined())
      out.copy_(bias.expand(out.sizes()));
    else
      out.zero_();
    return out;
  }
  const int64_t kp = sz.f.padded(K), rb = sz.f.row_bytes(K);
  TOPG_CUDA_DISPATCH_FLOAT(input.scalar_type(), op, T, [&] {
    const at::Tensor x32 =
        q::prepare_rows(cdptr<T>(input), M, K, kp,
                        int8_activations ? quant::act_group(sz.f.fmt) : 0, input.options());
    const uint8_t* w = cdptr<uint8_t>(weight);
    if (M <= kRows) {
      const int64_t blocks = ceil_div(N, kWarps);
      TOPG_CHECK(blocks <= INT32_MAX, op, "too many output features");
      gemv_q_kernel<T><<<unsigned(blocks), kWarps * 32, 0, current_stream()>>>(
          x32.data_ptr<float>(), int(M), kp, w, rb, sz.f, K, N,
          bias.defined() ? cdptr<T>(bias) : nullptr, dptr<T>(out));
      TOPG_CUDA_LAUNCH_CHECK();
      return;
    }
    // ~256 MiB of fp32 weights per chunk
    const int64_t chunk = std::max<int64_t>(256, (int64_t(1) << 26) / kp);
    at::Tensor wf = at::empty({std::min(chunk, N), kp}, x32.options());
    at::Tensor out2d = out.view({M, N});
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
      const int64_t nc = std::min(chunk, N - n0), threads = nc * (kp / 32);
      q::dequant_rows_kernel<><<<unsigned(ceil_div(threads, 256)), 256, 0, current_stream()>>>(
          w, rb, sz.f, K, kp, n0, nc, wf.data_ptr<float>());
      TOPG_CUDA_LAUNCH_CHECK();
      at::Tensor y = at::mm(x32, wf.narrow(0, 0, nc).t());
      if (bias.defined()) y.add_(bias.narrow(0, n0, nc).to(at::kFloat));
      out2d.narrow(1, n0, nc).copy_(y);
    }
  });
  return out;
}

// out[t] = row ids[t] of the packed weight, rounded once to T; a bad id (checks off)
// gives zeros. One thread per run of 32 of a row.
template <typename T, typename Id>
__global__ void embedding_q_kernel(const Id* __restrict__ ids, int64_t n_ids,
                                   const uint8_t* __restrict__ w, int64_t rows, int64_t rb,
                                   q::Format f, int64_t d, int64_t dp, T* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, runs = dp / 32;
  if (i >= n_ids * runs) return;
  const int64_t t = i / runs, su = i % runs, id = int64_t(ids[t]);
  float v[32];
  if (id >= 0 && id < rows) {
    q::load_run(f, w + id * rb, d, su, v);
  } else {
#pragma unroll
    for (int j = 0; j < 32; ++j) v[j] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int64_t e = 32 * su + j;
    if (e < d) out[t * d + e] = from_float<T>(v[j]);
  }
}

at::Tensor embedding_q_cuda(const at::Tensor& input_, const at::Tensor& weight,
                            c10::string_view format, int64_t embedding_dim, at::ScalarType dtype) {
  const char* op = "embedding_q";
  const q::Format f = quant::embedding_q(input_, weight, format, embedding_dim, dtype, at::kCUDA);
  const c10::cuda::CUDAGuard guard(input_.device());
  std::vector<int64_t> out_shape(input_.sizes().begin(), input_.sizes().end());
  out_shape.push_back(embedding_dim);
  at::Tensor out = at::empty(out_shape, input_.options().dtype(dtype));
  const at::Tensor ids = input_.contiguous();
  const int64_t n = ids.numel(), rows = weight.size(0), D = embedding_dim;
  if (n == 0 || D == 0) return out;
  if (index_checks_enabled()) {  // one device sync, only when asked (common.cuh)
    const auto [lo, hi] = at::aminmax(ids);
    const int64_t a = lo.item<int64_t>(), b = hi.item<int64_t>();
    TOPG_CHECK(a >= 0 && b < rows, op, "argument 'input' holds an id outside [0, ", rows,
               ") (the rows of 'weight')");
  }
  const int64_t dp = f.padded(D), threads = n * (dp / 32);
  TOPG_CHECK(ceil_div(threads, 256) <= INT32_MAX, op, "too many ids");
  TOPG_CUDA_DISPATCH_FLOAT(dtype, op, T, [&] {
    auto launch = [&](auto* id) {
      using Id = std::remove_const_t<std::remove_pointer_t<decltype(id)>>;
      embedding_q_kernel<T, Id><<<unsigned(ceil_div(threads, 256)), 256, 0, current_stream()>>>(
          id, n, cdptr<uint8_t>(weight), rows, f.row_bytes(D), f, D, dp, dptr<T>(out));
    };
    switch (ids.scalar_type()) {
      case at::kLong:
        launch(cdptr<int64_t>(ids));
        break;
      case at::kInt:
        launch(cdptr<int32_t>(ids));
        break;
      default:
        launch(cdptr<int64_t>(ids.to(at::kLong)));  // other integer dtypes: widened once
    }
    TOPG_CUDA_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace
}  // namespace topg::cuda

TORCH_LIBRARY_IMPL(topg, CUDA, m) {
  m.impl("linear_q", &topg::cuda::linear_q_cuda);
  m.impl("embedding_q", &topg::cuda::embedding_q_cuda);
}
