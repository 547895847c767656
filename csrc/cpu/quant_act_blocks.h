// What the AVX2 (quant_act_avx2.h) and AVX-512 VNNI (quant_act_vnni.h) forms of the
// int8-activation GEMV share for the formats with blocks of 32: where a block keeps its
// scale and codes, and eight blocks' scales and constant terms for one activation row, in
// AVX2 instructions only (no target attribute), so both forms inline the same code.
#pragma once

#include <cstdint>

#include "quant_kernels.h"

namespace topg::quant {

#if TOPG_AVX2

// The formats, by where a block keeps its scale and codes:
enum class Row32 {
  q8_0,  // 34-byte blocks: fp16 d, 32 signed codes
  q4_0,  // 18-byte blocks: fp16 d, 16 bytes of nibbles (codes - 8)
  q4_1,  // 20-byte blocks: fp16 d, fp16 m, 16 bytes of nibbles (q4_1, int4 with groups of 32)
  q5_0,  // 22-byte blocks: fp16 d, 4 bytes qh (5th bits), 16 bytes of nibbles (codes - 16)
  q5_1,  // 24-byte blocks: fp16 d, fp16 m, qh, 16 bytes of nibbles
  int8,  // the row's fp32 scale, then k signed codes (the last block may be short)
};

template <Row32 R>
struct Row32Layout {
  static constexpr int64_t bb = R == Row32::q8_0   ? 34  // bytes per block
                                : R == Row32::q4_0 ? 18
                                : R == Row32::q4_1 ? 20
                                : R == Row32::q5_0 ? 22
                                : R == Row32::q5_1 ? 24
                                                   : 32;
  // where the codes start (q5_0 / q5_1: qh, the nibbles 4 bytes on)
  static constexpr int64_t codes_at = R == Row32::q4_1 || R == Row32::q5_1 ? 4
                                      : R == Row32::int8                   ? 0
                                                                           : 2;
  // d and m in the header
  static constexpr bool has_min = R == Row32::q4_1 || R == Row32::q5_1;
  // the codes are signed (u = |w|, the activations take w's sign)
  static constexpr bool is_signed = R == Row32::q8_0 || R == Row32::int8;
  // the constant offset of the codes (w = d (u - off)): q4_0 8, q5_0 16
  static constexpr float off = R == Row32::q4_0 ? 8.f : R == Row32::q5_0 ? 16.f : 0.f;
};

// One activation row's scales d * xd of blocks [b0, b0 + 8) (int8: xd), given the blocks'
// weight scales d and minimums m as 8 lanes, and their constant terms c * xd * sum(q)
// (q4_1, q5_1: c = m; q4_0: -8 d; q5_0: -16 d) added to cterm.
template <Row32 R>
__attribute__((always_inline)) inline __m256 block8_scales(__m256 d, __m256 m, int64_t b0,
                                                           const float* xd, const float* xsum,
                                                           __m256& cterm) {
  const __m256 xdv = _mm256_loadu_ps(xd + b0);
  if constexpr (R == Row32::int8) {
    return xdv;
  } else {
    const __m256 s = _mm256_mul_ps(d, xdv);
    if constexpr (Row32Layout<R>::has_min) {
      cterm = _mm256_fmadd_ps(m, _mm256_mul_ps(xdv, _mm256_loadu_ps(xsum + b0)), cterm);
    } else if constexpr (Row32Layout<R>::off != 0.f) {
      const __m256 off = _mm256_set1_ps(-Row32Layout<R>::off);
      cterm = _mm256_fmadd_ps(s, _mm256_mul_ps(_mm256_loadu_ps(xsum + b0), off), cterm);
    }
    return s;
  }
}

#endif

}  // namespace topg::quant
