// fused_moe pieces that are not GEMM (no torch): gate activations and the routing sort.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace topg::moe {

enum class Act { silu, gelu, gelu_tanh };

// Exact GELU: 0.5 x (1 + erf(x / sqrt(2))), erf from vec.h (|error| < 1.5e-7).
inline Vec8 gelu_erf(Vec8 x) {
  return Vec8(0.5f) * x * (Vec8(1.f) + erf(x * Vec8(0.70710678118654752f)));
}

// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
inline Vec8 gelu_tanh(Vec8 x) {
  const Vec8 inner = Vec8(0.7978845608028654f) * (x + Vec8(0.044715f) * x * x * x);
  return Vec8(0.5f) * x * (Vec8(1.f) + tanh(inner));
}

inline Vec8 act(Act a, Vec8 x) {
  switch (a) {
    case Act::silu:
      return silu(x);
    case Act::gelu:
      return gelu_erf(x);
    default:
      return gelu_tanh(x);
  }
}

inline float act(Act a, float x) {
  switch (a) {
    case Act::silu:
      return x / (1.f + std::exp(-x));
    case Act::gelu:
      return 0.5f * x * (1.f + std::erf(x * 0.70710678118654752f));
    default:
      return 0.5f * x * (1.f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
  }
}

// The T * k (token, slot) assignments grouped by expert (counting sort, stable):
// rows offset[e] .. offset[e + 1] belong to expert e; row r is token tok[r] with routing
// weight weight[r]. Ids must already be validated to lie in [0, E).
struct Routing {
  std::vector<int64_t> offset;  // E + 1
  std::vector<int64_t> tok;     // T * k
  std::vector<float> weight;    // T * k
  std::vector<int64_t> fill;    // scratch of the sort
};

// sort_by_expert into r, reusing its storage (the decode plan sorts every MoE layer).
template <typename Id, typename W>
void sort_into(Routing& r, const Id* ids, const W* weights, int64_t tokens, int64_t k, int64_t E) {
  r.offset.assign(size_t(E + 1), 0);
  const int64_t n = tokens * k;
  for (int64_t i = 0; i < n; ++i) ++r.offset[size_t(ids[i]) + 1];
  for (int64_t e = 0; e < E; ++e) r.offset[e + 1] += r.offset[e];
  r.fill.assign(r.offset.begin(), r.offset.end() - 1);
  r.tok.resize(size_t(n));
  r.weight.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = r.fill[size_t(ids[i])]++;
    r.tok[pos] = i / k;
    r.weight[pos] = to_float(weights[i]);
  }
}

template <typename Id, typename W>
Routing sort_by_expert(const Id* ids, const W* weights, int64_t tokens, int64_t k, int64_t E) {
  Routing r;
  sort_into(r, ids, weights, tokens, k, E);
  return r;
}

// One token (topg::moe_topk, and the decode plan's MoE layers): scores (softmax or sigmoid of the
// logits), selection on score + bias, weights = the unbiased scores of the selected experts,
// optionally renormalised. Ties go to the lower expert index (matches a stable descending sort).
template <typename T>
inline void route_token(const T* logits, const float* bias, int64_t num_experts, int64_t k,
                        bool softmax, bool renormalize, float* scores, float* w_out,
                        int32_t* id_out) {
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

}  // namespace topg::moe
