// fused_moe pieces that are not GEMM (no torch): gate activations and the routing sort.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace topg::moe {

enum class Act { silu, gelu, gelu_tanh };

// Exact GELU x * Phi(x) via erf (Abramowitz-Stegun 7.1.26, |error| < 1.5e-7).
inline Vec8 gelu_erf(Vec8 x) {
#if TOPG_AVX2
  const __m256 z = _mm256_mul_ps(x.v, _mm256_set1_ps(0.70710678118654752f));
  const __m256 az = _mm256_andnot_ps(_mm256_set1_ps(-0.f), z);
  const __m256 t = _mm256_div_ps(
      _mm256_set1_ps(1.f), _mm256_fmadd_ps(az, _mm256_set1_ps(0.3275911f), _mm256_set1_ps(1.f)));
  __m256 p = _mm256_set1_ps(1.061405429f);
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-1.453152027f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.421413741f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(-0.284496736f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.254829592f));
  p = _mm256_mul_ps(p, t);
  // q = erfc(|z|); 1 + erf(z) = 2 - q for z >= 0, q for z < 0.
  const __m256 q =
      _mm256_mul_ps(p, exp(Vec8(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), az), az))).v);
  const __m256 neg = _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 one_plus_erf = _mm256_blendv_ps(_mm256_sub_ps(_mm256_set1_ps(2.f), q), q, neg);
  return Vec8(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x.v), one_plus_erf));
#else
  for (float& f : x.v) f = 0.5f * f * (1.f + std::erf(f * 0.70710678118654752f));
  return x;
#endif
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
