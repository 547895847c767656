// Gated activations (no torch): out[r, i] = act(in[r, i]) * in[r, d + i].
#pragma once

#include <cstdint>

#include "vec.h"

namespace topg::act {

struct Silu {
  static Vec8 apply(Vec8 x) { return silu(x); }
};
// Exact GELU: x * (1 + erf(x / sqrt(2))) / 2.
struct GeluErf {
  static Vec8 apply(Vec8 x) {
    return Vec8(0.5f) * x * (Vec8(1.f) + erf(x * Vec8(0.70710678118654752f)));
  }
};
// Tanh GELU: x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))) / 2.
struct GeluTanh {
  static Vec8 apply(Vec8 x) {
    const Vec8 inner = Vec8(0.7978845608028654f) * Vec8::fma(Vec8(0.044715f) * x * x, x, x);
    return Vec8(0.5f) * x * (Vec8(1.f) + tanh(inner));
  }
};

// Columns [c0, c1) of row r: input [rows, 2d] (row stride in_stride) into out [rows, d].
template <typename Act, typename T>
void gated_span(const T* in, int64_t in_stride, T* out, int64_t d, int64_t r, int64_t c0,
                int64_t c1) {
  const T* g = in + r * in_stride;
  const T* u = g + d;
  T* o = out + r * d;
  int64_t i = c0;
  for (; i + 8 <= c1; i += 8) (Act::apply(Vec8::load(g + i)) * Vec8::load(u + i)).store(o + i);
  if (i < c1) {
    const int n = int(c1 - i);
    store_partial(o + i, Act::apply(load_partial(g + i, n)) * load_partial(u + i, n), n);
  }
}

}  // namespace topg::act
