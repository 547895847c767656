// CPU kernels: topg::silu_and_mul, topg::gelu_and_mul.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <string_view>

#include "activation_kernels.h"
#include "common/op_checks.h"
#include "dispatch.h"

namespace topg {
namespace {

template <typename Act>
at::Tensor gated_cpu(const char* op, const at::Tensor& input_) {
  const auto [rows, d] = checks::gated(op, input_, at::kCPU);
  // Rows only need a unit stride in the last dim and one row stride: avoid copies
  // for the common 2-D slice of a larger buffer.
  const at::Tensor input =
      (input_.dim() == 2 && input_.stride(-1) == 1) ? input_ : input_.contiguous();
  auto out_sizes = input.sizes().vec();
  out_sizes.back() = d;
  at::Tensor out = at::empty(out_sizes, input.options());
  const int64_t in_stride = input.dim() == 2 ? input.stride(0) : 2 * d;
  TOPG_DISPATCH_FLOAT(input.scalar_type(), op, T, [&] {
    const T* in = cptr<T>(input);
    T* o = ptr<T>(out);
    // Work items are (row, column chunk), each >= 16k elements (~20 us of exp/rcp math
    // on one core): a shorter task does not pay for waking a pool thread, and on a
    // loaded machine the woken thread may wait a whole scheduler tick (~4-8 ms).
    const int64_t pieces = std::clamp<int64_t>(d / 16384, 1, at::get_num_threads());
    const int64_t chunk = ((d + pieces - 1) / pieces + 7) / 8 * 8;
    const int64_t chunks = (d + chunk - 1) / chunk;
    const int64_t grain = std::max<int64_t>(1, 16384 / chunk);
    at::parallel_for(0, rows * chunks, grain, [&](int64_t b, int64_t e) {
      for (int64_t w = b; w < e; ++w) {
        const int64_t c0 = (w % chunks) * chunk;
        act::gated_span<Act>(in, in_stride, o, d, w / chunks, c0, std::min(d, c0 + chunk));
      }
    });
  });
  return out;
}

at::Tensor silu_and_mul_cpu(const at::Tensor& input) {
  return gated_cpu<act::Silu>("silu_and_mul", input);
}

at::Tensor gelu_and_mul_cpu(const at::Tensor& input, c10::string_view approximate) {
  return checks::gelu_tanh(approximate) ? gated_cpu<act::GeluTanh>("gelu_and_mul", input)
                                        : gated_cpu<act::GeluErf>("gelu_and_mul", input);
}

}  // namespace
}  // namespace topg

TORCH_LIBRARY_IMPL(topg, CPU, m) {
  m.impl("silu_and_mul", &topg::silu_and_mul_cpu);
  m.impl("gelu_and_mul", &topg::gelu_and_mul_cpu);
}
