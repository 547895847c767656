// CPU kernel: topg::moe_topk (router scores -> top-k experts and their weights).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string_view>
#include <vector>

#include "common/op_checks.h"
#include "dispatch.h"

namespace topg {
namespace {

constexpr const char* kOp = "moe_topk";

// One token: scores (softmax or sigmoid of the logits), selection on score + bias,
// weights = the unbiased scores of the selected experts, optionally renormalised.
// Ties go to the lower expert index (matches a stable descending sort).
template <typename T>
void route_token(const T* logits, const float* bias, int64_t num_experts, int64_t k, bool softmax,
                 bool renormalize, float* scores, float* w_out, int32_t* id_out) {
  float mx = -INFINITY;
  for (int64_t e = 0; e < num_experts; ++e) {
    scores[e] = to_float(logits[e]);
    mx = std::max(mx, scores[e]);
  }
  if (softmax) {
    float sum = 0.f;
    for (int64_t e = 0; e < num_experts; ++e) sum += (scores[e] = std::exp(scores[e] - mx));
    const float inv = 1.f / sum;
    for (int64_t e = 0; e < num_experts; ++e) scores[e] *= inv;
  } else {
    for (int64_t e = 0; e < num_experts; ++e) scores[e] = 1.f / (1.f + std::exp(-scores[e]));
  }
  // Insertion into a sorted top-k list (k is small: 1..8 in every model we know). NaN
  // ranks above every number (as in torch.sort / torch.topk), NaNs among themselves by index.
  auto above = [](float a, float b) { return std::isnan(a) ? !std::isnan(b) : a > b; };
  int64_t n = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const float key = bias ? scores[e] + bias[e] : scores[e];
    if (n == k && !above(key, w_out[k - 1])) continue;  // w_out holds the selection keys here
    int64_t pos = n < k ? n++ : k - 1;
    while (pos > 0 && above(key, w_out[pos - 1])) {
      w_out[pos] = w_out[pos - 1];
      id_out[pos] = id_out[pos - 1];
      --pos;
    }
    w_out[pos] = key;
    id_out[pos] = int32_t(e);
  }
  float total = 0.f;
  for (int64_t j = 0; j < k; ++j) total += (w_out[j] = scores[id_out[j]]);
  if (renormalize && (total > 0.f || std::isnan(total)))  // NaN in, NaN out (the reference)
    for (int64_t j = 0; j < k; ++j) w_out[j] /= total;
}

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
        route_token(l + t * experts, b, experts, top_k, softmax, renormalize, scores.data(),
                    w + t * top_k, id + t * top_k);
    });
  });
  return {weights, ids};
}

}  // namespace
}  // namespace topg

TORCH_LIBRARY_IMPL(topg, CPU, m) { m.impl("moe_topk", &topg::moe_topk_cpu); }
