// Rotary position embedding (no torch), applied in place to one token's heads.
//
// cos_sin_cache row for a position: [cos_0 .. cos_{h-1}, sin_0 .. sin_{h-1}], h = rot_dim/2.
// neox style rotates pairs (i, i + h); gpt-j style rotates pairs (2i, 2i + 1). Elements
// at rot_dim and beyond (partial rotary) are left untouched.
#pragma once

#include <cstdint>

#include "vec.h"

namespace topg::rotary {

// Per-token cos/sin in fp32, laid out for the style: neox keeps [h] cos and [h] sin;
// gpt-j duplicates each into pairs and negates the even sin lanes, so that
// x' = x * cos2 + swap_pairs(x) * sin2 (x'_{2i} = x_{2i} c - x_{2i+1} s, x'_{2i+1} = x_{2i+1} c +
// x_{2i} s).
template <typename C>
void load_cos_sin(const C* row, int64_t rot_dim, bool is_neox, float* cos, float* sin) {
  const int64_t h = rot_dim / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float c = to_float(row[i]), s = to_float(row[h + i]);
    if (is_neox) {
      cos[i] = c;
      sin[i] = s;
    } else {
      cos[2 * i] = cos[2 * i + 1] = c;
      sin[2 * i] = -s;
      sin[2 * i + 1] = s;
    }
  }
}

template <typename T>
void rotate_neox(T* x, const float* cos, const float* sin, int64_t h) {
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) {
    const Vec8 x1 = Vec8::load(x + i), x2 = Vec8::load(x + h + i);
    const Vec8 c = Vec8::load(cos + i), s = Vec8::load(sin + i);
    (x1 * c - x2 * s).store(x + i);
    Vec8::fma(x1, s, x2 * c).store(x + h + i);
  }
  for (; i < h; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[h + i]);
    x[i] = from_float<T>(x1 * cos[i] - x2 * sin[i]);
    x[h + i] = from_float<T>(x2 * cos[i] + x1 * sin[i]);
  }
}

template <typename T>
void rotate_gptj(T* x, const float* cos2, const float* sin2, int64_t rot_dim) {
  int64_t i = 0;
  for (; i + 8 <= rot_dim; i += 8) {
    const Vec8 v = Vec8::load(x + i);
    Vec8::fma(v.swap_pairs(), Vec8::load(sin2 + i), v * Vec8::load(cos2 + i)).store(x + i);
  }
  for (; i < rot_dim; i += 2) {
    const float a = to_float(x[i]), b = to_float(x[i + 1]);
    x[i] = from_float<T>(a * cos2[i] + b * sin2[i]);
    x[i + 1] = from_float<T>(b * cos2[i + 1] + a * sin2[i + 1]);
  }
}

// Rotates `heads` heads of one token: head j starts at x + j * head_stride.
template <typename T>
void rotate_heads(T* x, int64_t heads, int64_t head_stride, const float* cos, const float* sin,
                  int64_t rot_dim, bool is_neox) {
  for (int64_t j = 0; j < heads; ++j) {
    if (is_neox)
      rotate_neox(x + j * head_stride, cos, sin, rot_dim / 2);
    else
      rotate_gptj(x + j * head_stride, cos, sin, rot_dim);
  }
}

}  // namespace topg::rotary
