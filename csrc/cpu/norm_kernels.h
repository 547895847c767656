// RMSNorm kernel math (no torch). One row of `hidden` elements at a time.
#pragma once

#include <cmath>
#include <cstdint>

#include "vec.h"

namespace topg::norm {

// Sum of squares of one row, in fp32 with two accumulators.
template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  Vec8 a0 = Vec8::zero(), a1 = Vec8::zero();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const Vec8 v0 = Vec8::load(x + i), v1 = Vec8::load(x + i + 8);
    a0 = Vec8::fma(v0, v0, a0);
    a1 = Vec8::fma(v1, v1, a1);
  }
  for (; i + 8 <= n; i += 8) {
    const Vec8 v = Vec8::load(x + i);
    a0 = Vec8::fma(v, v, a0);
  }
  float s = (a0 + a1).sum();
  for (; i < n; ++i) {
    const float v = to_float(x[i]);
    s += v * v;
  }
  return s;
}

// out[i] = x[i] * scale * w[i], rounded once to T.
template <typename T, typename W>
inline void scale_row(const T* x, const W* w, T* out, float scale, int64_t n) {
  const Vec8 s(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) (Vec8::load(x + i) * s * Vec8::load(w + i)).store(out + i);
  for (; i < n; ++i) out[i] = from_float<T>(to_float(x[i]) * scale * to_float(w[i]));
}

// y = x / sqrt(mean(x^2) + eps) * w for rows [begin, end) of a [rows, n] matrix.
template <typename T, typename W>
void rms_norm_rows(const T* x, int64_t x_stride, const W* w, T* out, int64_t out_stride, int64_t n,
                   float eps, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * x_stride;
    const float scale = 1.f / std::sqrt(sum_squares(xr, n) / float(n) + eps);
    scale_row(xr, w, out + r * out_stride, scale, n);
  }
}

// residual += x, rounded to T (aten's add of two tensors of T). One row of n.
template <typename T>
inline void add_row(const T* x, T* residual, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) (Vec8::load(x + i) + Vec8::load(residual + i)).store(residual + i);
  for (; i < n; ++i) residual[i] = from_float<T>(to_float(x[i]) + to_float(residual[i]));
}

// residual += x (rounded to T); x = rms_norm(residual) * w. Rows [begin, end).
template <typename T, typename W>
void fused_add_rms_norm_rows(T* x, T* residual, const W* w, int64_t n, float eps, int64_t begin,
                             int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    T* xr = x + r * n;
    T* rr = residual + r * n;
    add_row(xr, rr, n);
    // The norm reads the rounded residual, so fused == residual.add_(x); rms_norm(residual).
    const float scale = 1.f / std::sqrt(sum_squares(rr, n) / float(n) + eps);
    scale_row(rr, w, xr, scale, n);
  }
}

}  // namespace topg::norm
