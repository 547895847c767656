// fused_moe pieces that are not GEMM (no torch): gate activations and the routing sort.
#pragma once

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
};

template <typename Id, typename W>
Routing sort_by_expert(const Id* ids, const W* weights, int64_t tokens, int64_t k, int64_t E) {
  Routing r;
  r.offset.assign(size_t(E + 1), 0);
  const int64_t n = tokens * k;
  for (int64_t i = 0; i < n; ++i) ++r.offset[size_t(ids[i]) + 1];
  for (int64_t e = 0; e < E; ++e) r.offset[e + 1] += r.offset[e];
  std::vector<int64_t> fill(r.offset.begin(), r.offset.end() - 1);
  r.tok.resize(size_t(n));
  r.weight.resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = fill[size_t(ids[i])]++;
    r.tok[pos] = i / k;
    r.weight[pos] = to_float(weights[i]);
  }
  return r;
}

}  // namespace topg::moe
