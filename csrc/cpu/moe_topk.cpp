// CPU kernel: topg::moe_topk (router scores -> top-k experts and their weights).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <vector>

#include "common/op_checks.h"
#include "dispatch.h"
#include "moe_kernels.h"

namespace topg {
namespace {

constexpr const char* kOp = "moe_topk";

std::tuple<at::Tensor, at::Tensor> moe_topk_cpu(const at::Tensor& logits_, int64_t top_k,
                                                c10::string_view scoring, bool renormalize,
                                                const std::optional<at::Tensor>& bias_) {
  const auto [tokens, experts, softmax] =
      checks::moe_topk(logits_, top_k, scoring, bias_, at::kCPU);
  const at::Tensor bias = bias_.has_value() ? bias_->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor logits = logits_.contiguous();
  at::Tensor weights = at::empty({tokens, top_k}, logits.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({tokens, top_k}, logits.options().dtype(at::kInt));
  const float* b = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
  TOPG_DISPATCH_FLOAT(logits.scalar_type(), kOp, T, [&] {
    const T* l = cptr<T>(logits);
    float* w = weights.data_ptr<float>();
    int32_t* id = ids.data_ptr<int32_t>();
    const int64_t grain = std::max<int64_t>(1, 8192 / experts);
    at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(experts);
      for (int64_t t = begin; t < end; ++t)
        moe::route_token(l + t * experts, b, experts, top_k, softmax, renormalize, scores.data(),
                         w + t * top_k, id + t * top_k);
    });
  });
  return {weights, ids};
}

}  // namespace
}  // namespace topg

TORCH_LIBRARY_IMPL(topg, CPU, m) { m.impl("moe_topk", &topg::moe_topk_cpu); }
