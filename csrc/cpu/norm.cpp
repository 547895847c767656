// CPU kernels: topg::rms_norm, topg::fused_add_rms_norm.
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "common/op_checks.h"
#include "dispatch.h"
#include "norm_kernels.h"

namespace topg {
namespace {

// Rows per task: keep tiny (decode) calls on one thread, split large ones.
int64_t grain_rows(int64_t hidden) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(hidden, 1));
}

// Calls body.template operator()<T, W>() with W = T or float (the two weight
// dtypes models use); other weight dtypes are converted to float first.
template <typename F>
void dispatch_norm(const char* op, const at::Tensor& input, at::Tensor& weight, F&& body) {
  if (weight.scalar_type() != input.scalar_type() && weight.scalar_type() != at::kFloat)
    weight = weight.to(at::kFloat);
  TOPG_DISPATCH_FLOAT(input.scalar_type(), op, T, [&] {
    if (weight.scalar_type() == at::kFloat)
      body.template operator()<T, float>();
    else
      body.template operator()<T, T>();
  });
}

at::Tensor rms_norm_cpu(const at::Tensor& input_, const at::Tensor& weight_, double epsilon) {
  const auto [rows, n] = checks::rms_norm("rms_norm", input_, weight_, at::kCPU);
  const at::Tensor input = input_.contiguous();
  at::Tensor weight = weight_;
  at::Tensor out = at::empty_like(input);
  dispatch_norm("rms_norm", input, weight, [&]<typename T, typename W>() {
    const T* x = cptr<T>(input);
    const W* w = cptr<W>(weight);
    T* o = ptr<T>(out);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t e) {
      norm::rms_norm_rows(x, n, w, o, n, n, float(epsilon), b, e);
    });
  });
  return out;
}

void fused_add_rms_norm_cpu(at::Tensor& input, at::Tensor& residual, const at::Tensor& weight_,
                            double epsilon) {
  const char* op = "fused_add_rms_norm";
  const auto [rows, n] = checks::fused_add_rms_norm(input, residual, weight_, at::kCPU);
  at::Tensor weight = weight_;
  dispatch_norm(op, input, weight, [&]<typename T, typename W>() {
    T* x = ptr<T>(input);
    T* r = ptr<T>(residual);
    const W* w = cptr<W>(weight);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t b, int64_t e) {
      norm::fused_add_rms_norm_rows(x, r, w, n, float(epsilon), b, e);
    });
  });
}

}  // namespace
}  // namespace topg

TORCH_LIBRARY_IMPL(topg, CPU, m) {
  m.impl("rms_norm", &topg::rms_norm_cpu);
  m.impl("fused_add_rms_norm", &topg::fused_add_rms_norm_cpu);
}
