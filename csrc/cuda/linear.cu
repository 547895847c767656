// CUDA kernel: topg::linear (F.linear semantics, fp32 accumulation, one rounding).
//   M <= kGemvRows: GEMV, one warp per output feature for all M rows: the weight is
//                   streamed once with 16-byte loads (memory-bound decode).
//   otherwise:      64 x 64 tiles (gemm.cuh): tensor cores for bf16 / fp16.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>

#include "gemm.cuh"

namespace topg::cuda {
namespace {

constexpr int kGemvRows = 4, kGemvWarps = 8;

template <typename T, bool VEC>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_kernel(const T* __restrict__ x, int M, int64_t K, const T* __restrict__ w, int64_t N,
                const T* __restrict__ bias, T* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t n = int64_t(blockIdx.x) * kGemvWarps + (threadIdx.x >> 5);
  if (n >= N) return;  // whole warp; no block barriers in this kernel
  const T* wr = w + n * K;
  float acc[kGemvRows] = {};
  if constexpr (VEC) {
#pragma unroll 4
    for (int64_t k = int64_t(lane) * kVec; k < K; k += 32 * kVec) {
      float wv[kVec];
      load8(wr + k, wv);
#pragma unroll
      for (int m = 0; m < kGemvRows; ++m) {
        if (m < M) {
          float xv[kVec];
          load8(x + m * K + k, xv);
#pragma unroll
          for (int j = 0; j < kVec; ++j) acc[m] += wv[j] * xv[j];
        }
      }
    }
  } else {
    for (int64_t k = lane; k < K; k += 32) {
      const float wv = to_float(wr[k]);
#pragma unroll
      for (int m = 0; m < kGemvRows; ++m)
        if (m < M) acc[m] += wv * to_float(x[m * K + k]);
    }
  }
  const float b = bias ? to_float(bias[n]) : 0.f;
#pragma unroll
  for (int m = 0; m < kGemvRows; ++m) {
    const float s = warp_sum(acc[m]);
    if (m < M && lane == 0) out[m * N + n] = from_float<T>(s + b);
  }
}

template <typename T>
__global__ void __launch_bounds__(gemm::kThreads)
    linear_tile_kernel(const T* __restrict__ x, int64_t M, int64_t K, const T* __restrict__ w,
                       int64_t N, const T* __restrict__ bias, T* __restrict__ out, bool vec) {
  __shared__ gemm::Smem<T> s;
  const int64_t m0 = int64_t(blockIdx.y) * gemm::BM, n0 = int64_t(blockIdx.x) * gemm::BN;
  for (int i = threadIdx.x; i < gemm::BM; i += blockDim.x) {
    s.arow[i] = m0 + i < M ? x + (m0 + i) * K : nullptr;
    s.brow[i] = n0 + i < N ? w + (n0 + i) * K : nullptr;
  }
  __syncthreads();
  gemm::tile_gemm<T>(s, K, vec);
  for (int i = threadIdx.x; i < gemm::BM * gemm::BN; i += blockDim.x) {
    const int r = i / gemm::BN, c = i % gemm::BN;
    const int64_t m = m0 + r, n = n0 + c;
    if (m < M && n < N)
      out[m * N + n] = from_float<T>(s.c[r][c] + (bias ? to_float(bias[n]) : 0.f));
  }
}

at::Tensor linear_cuda(const at::Tensor& input_, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias_) {
  const char* op = "linear";
  const checks::LinearSizes sz = checks::linear(input_, weight, bias_, at::kCUDA);
  const int64_t M = sz.M, K = sz.K, N = sz.N;
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = input_.contiguous();
  const at::Tensor bias = bias_.has_value() ? bias_->contiguous() : at::Tensor();
  at::Tensor out = at::empty(sz.out_shape, input.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) {  // empty sum: the bias (or zeros)
    if (bias.defined())
      out.copy_(bias.expand(out.sizes()));
    else
      out.zero_();
    return out;
  }
  TOPG_CUDA_DISPATCH_FLOAT(input.scalar_type(), op, T, [&] {
    const T* b = bias.defined() ? cdptr<T>(bias) : nullptr;
    const bool vec =
        K % kVec == 0 && aligned16(input.const_data_ptr()) && aligned16(weight.const_data_ptr());
    if (M <= kGemvRows) {
      const int64_t blocks = ceil_div(N, kGemvWarps);
      TOPG_CHECK(blocks <= INT32_MAX, op, "too many output features");
      auto kernel = vec ? gemv_kernel<T, true> : gemv_kernel<T, false>;
      kernel<<<unsigned(blocks), kGemvWarps * 32, 0, current_stream()>>>(
          cdptr<T>(input), int(M), K, cdptr<T>(weight), N, b, dptr<T>(out));
    } else {
      const int64_t mt = ceil_div(M, gemm::BM), nt = ceil_div(N, gemm::BN);
      TOPG_CHECK(mt <= 65535 && nt <= INT32_MAX, op, "input has too many rows for one call (", M,
                 ")");
      linear_tile_kernel<T>
          <<<dim3(unsigned(nt), unsigned(mt)), gemm::kThreads, 0, current_stream()>>>(
              cdptr<T>(input), M, K, cdptr<T>(weight), N, b, dptr<T>(out), vec);
    }
    TOPG_CUDA_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace
}  // namespace topg::cuda

TORCH_LIBRARY_IMPL(topg, CUDA, m) { m.impl("_cuda_linear", &topg::cuda::linear_cuda); }
