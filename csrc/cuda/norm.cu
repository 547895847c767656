// CUDA kernels: topg::rms_norm, topg::fused_add_rms_norm. One block per row; the row is
// read twice (sum of squares, then scale), the second read hits L1/L2.
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>

#include "common.cuh"

namespace topg::cuda {
namespace {

// Threads per row: one 8-element vector (or one element) per thread, in [32, 1024].
int row_threads(int64_t n, bool vec) {
  const int64_t per = vec ? ceil_div(n, kVec) : n;
  return int(std::clamp<int64_t>(ceil_div(per, 32) * 32, 32, 1024));
}

template <typename T, typename W, bool VEC>
__global__ void rms_norm_kernel(const T* __restrict__ x, const W* __restrict__ w,
                                T* __restrict__ out, int64_t n, float eps) {
  const T* xr = x + int64_t(blockIdx.x) * n;
  T* o = out + int64_t(blockIdx.x) * n;
  float ss = 0.f;
  if constexpr (VEC) {
    for (int64_t i = int64_t(threadIdx.x) * kVec; i < n; i += int64_t(blockDim.x) * kVec) {
      float v[kVec];
      load8(xr + i, v);
#pragma unroll
      for (int j = 0; j < kVec; ++j) ss += v[j] * v[j];
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const float v = to_float(xr[i]);
      ss += v * v;
    }
  }
  const float scale = rsqrtf(block_sum(ss) / float(n) + eps);
  if constexpr (VEC) {
    for (int64_t i = int64_t(threadIdx.x) * kVec; i < n; i += int64_t(blockDim.x) * kVec) {
      float v[kVec], wv[kVec];
      load8(xr + i, v);
      load8(w + i, wv);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = v[j] * scale * wv[j];
      store8(o + i, v);
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
      o[i] = from_float<T>(to_float(xr[i]) * scale * to_float(w[i]));
  }
}

// residual += x (rounded to T); x = rms_norm(residual) * w. The norm reads the rounded
// residual, as the reference does. Each thread re-reads only elements it wrote itself.
template <typename T, typename W, bool VEC>
__global__ void fused_add_rms_norm_kernel(T* __restrict__ x, T* __restrict__ res,
                                          const W* __restrict__ w, int64_t n, float eps) {
  T* xr = x + int64_t(blockIdx.x) * n;
  T* rr = res + int64_t(blockIdx.x) * n;
  float ss = 0.f;
  if constexpr (VEC) {
    for (int64_t i = int64_t(threadIdx.x) * kVec; i < n; i += int64_t(blockDim.x) * kVec) {
      float a[kVec], b[kVec];
      load8(xr + i, a);
      load8(rr + i, b);
      T rounded[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        rounded[j] = from_float<T>(a[j] + b[j]);
        const float r = to_float(rounded[j]);
        ss += r * r;
        b[j] = r;
      }
      store8(rr + i, b);  // b holds values exactly representable in T: no second rounding
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const T r = from_float<T>(to_float(xr[i]) + to_float(rr[i]));
      rr[i] = r;
      const float f = to_float(r);
      ss += f * f;
    }
  }
  const float scale = rsqrtf(block_sum(ss) / float(n) + eps);
  if constexpr (VEC) {
    for (int64_t i = int64_t(threadIdx.x) * kVec; i < n; i += int64_t(blockDim.x) * kVec) {
      float r[kVec], wv[kVec];
      load8(rr + i, r);
      load8(w + i, wv);
#pragma unroll
      for (int j = 0; j < kVec; ++j) r[j] = r[j] * scale * wv[j];
      store8(xr + i, r);
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
      xr[i] = from_float<T>(to_float(rr[i]) * scale * to_float(w[i]));
  }
}

// body.template operator()<T, W>() with W = T or float; other weight dtypes become float.
template <typename F>
void dispatch_norm(const char* op, const at::Tensor& input, at::Tensor& weight, F&& body) {
  if (weight.scalar_type() != input.scalar_type() && weight.scalar_type() != at::kFloat)
    weight = weight.to(at::kFloat);
  TOPG_CUDA_DISPATCH_FLOAT(input.scalar_type(), op, T, [&] {
    if (weight.scalar_type() == at::kFloat)
      body.template operator()<T, float>();
    else
      body.template operator()<T, T>();
  });
}

at::Tensor rms_norm_cuda(const at::Tensor& input_, const at::Tensor& weight_, double epsilon) {
  const checks::RowSizes sz = checks::rms_norm("rms_norm", input_, weight_, at::kCUDA);
  const int64_t n = sz.hidden, rows = sz.rows;
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = input_.contiguous();
  at::Tensor weight = weight_;
  at::Tensor out = at::empty_like(input, at::MemoryFormat::Contiguous);
  if (rows == 0) return out;
  TOPG_CHECK(rows <= INT32_MAX, "rms_norm", "more than 2^31 - 1 rows is not supported");
  dispatch_norm("rms_norm", input, weight, [&]<typename T, typename W>() {
    const bool vec = n % kVec == 0 && aligned16(input.const_data_ptr()) &&
                     aligned16(weight.const_data_ptr()) && aligned16(out.data_ptr());
    const int threads = row_threads(n, vec);
    auto kernel = vec ? rms_norm_kernel<T, W, true> : rms_norm_kernel<T, W, false>;
    kernel<<<unsigned(rows), threads, 0, current_stream()>>>(cdptr<T>(input), cdptr<W>(weight),
                                                             dptr<T>(out), n, float(epsilon));
    TOPG_CUDA_LAUNCH_CHECK();
  });
  return out;
}

void fused_add_rms_norm_cuda(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight_,
                             double epsilon) {
  const char* op = "fused_add_rms_norm";
  const checks::RowSizes sz = checks::fused_add_rms_norm(input, residual, weight_, at::kCUDA);
  const int64_t n = sz.hidden, rows = sz.rows;
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor weight = weight_;
  if (rows == 0) return;
  TOPG_CHECK(rows <= INT32_MAX, op, "more than 2^31 - 1 rows is not supported");
  dispatch_norm(op, input, weight, [&]<typename T, typename W>() {
    const bool vec = n % kVec == 0 && aligned16(input.data_ptr()) &&
                     aligned16(residual.data_ptr()) && aligned16(weight.const_data_ptr());
    const int threads = row_threads(n, vec);
    auto kernel =
        vec ? fused_add_rms_norm_kernel<T, W, true> : fused_add_rms_norm_kernel<T, W, false>;
    kernel<<<unsigned(rows), threads, 0, current_stream()>>>(dptr<T>(input), dptr<T>(residual),
                                                             cdptr<W>(weight), n, float(epsilon));
    TOPG_CUDA_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace topg::cuda

TORCH_LIBRARY_IMPL(topg, CUDA, m) {
  m.impl("rms_norm", &topg::cuda::rms_norm_cuda);
  m.impl("fused_add_rms_norm", &topg::cuda::fused_add_rms_norm_cuda);
}
