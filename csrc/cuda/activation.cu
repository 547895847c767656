// CUDA kernels: topg::silu_and_mul, topg::gelu_and_mul. out[r, i] = act(in[r, i]) * in[r, d + i].
// grid.x = rows, grid.y strides over column chunks (capped at 65535, the loop covers the rest).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <string_view>

#include "common.cuh"

namespace topg::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T, bool VEC>
__global__ void gated_kernel(const T* __restrict__ in, int64_t in_stride, T* __restrict__ out,
                             int64_t d, Act act) {
  const T* g = in + int64_t(blockIdx.x) * in_stride;
  const T* u = g + d;
  T* o = out + int64_t(blockIdx.x) * d;
  constexpr int per = VEC ? kVec : 1;
  const int64_t step = int64_t(gridDim.y) * blockDim.x * per;
  for (int64_t c = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * per; c < d; c += step) {
    if constexpr (VEC) {  // d % 8 == 0, so c + 8 <= d
      float gv[kVec], uv[kVec];
      load8(g + c, gv);
      load8(u + c, uv);
#pragma unroll
      for (int j = 0; j < kVec; ++j) gv[j] = act_apply(act, gv[j]) * uv[j];
      store8(o + c, gv);
    } else {
      o[c] = from_float<T>(act_apply(act, to_float(g[c])) * to_float(u[c]));
    }
  }
}

at::Tensor gated_cuda(const char* op, const at::Tensor& input_, Act act) {
  const checks::RowSizes sz = checks::gated(op, input_, at::kCUDA);
  const int64_t rows = sz.rows, d = sz.hidden;
  const c10::cuda::CUDAGuard guard(input_.device());
  // A 2-D slice with unit column stride (e.g. a view of a larger buffer) is used as is.
  const at::Tensor input =
      (input_.dim() == 2 && input_.stride(-1) == 1) ? input_ : input_.contiguous();
  auto out_sizes = input.sizes().vec();
  out_sizes.back() = d;
  at::Tensor out = at::empty(out_sizes, input.options());
  if (rows == 0) return out;
  TOPG_CHECK(rows <= INT32_MAX, op, "more than 2^31 - 1 rows is not supported");
  const int64_t in_stride = input.dim() == 2 ? input.stride(0) : 2 * d;
  TOPG_CUDA_DISPATCH_FLOAT(input.scalar_type(), op, T, [&] {
    const bool vec = d % kVec == 0 && in_stride % kVec == 0 && aligned16(input.const_data_ptr()) &&
                     aligned16(out.data_ptr());
    const int64_t per_block = int64_t(kThreads) * (vec ? kVec : 1);
    const dim3 grid(unsigned(rows), unsigned(std::min<int64_t>(ceil_div(d, per_block), 65535)));
    auto kernel = vec ? gated_kernel<T, true> : gated_kernel<T, false>;
    kernel<<<grid, kThreads, 0, current_stream()>>>(cdptr<T>(input), in_stride, dptr<T>(out), d,
                                                    act);
    TOPG_CUDA_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor silu_and_mul_cuda(const at::Tensor& input) {
  return gated_cuda("silu_and_mul", input, Act::silu);
}

at::Tensor gelu_and_mul_cuda(const at::Tensor& input, c10::string_view approximate) {
  return gated_cuda("gelu_and_mul", input,
                    checks::gelu_tanh(approximate) ? Act::gelu_tanh : Act::gelu);
}

}  // namespace
}  // namespace topg::cuda

TORCH_LIBRARY_IMPL(topg, CUDA, m) {
  m.impl("silu_and_mul", &topg::cuda::silu_and_mul_cuda);
  m.impl("gelu_and_mul", &topg::cuda::gelu_and_mul_cuda);
}
