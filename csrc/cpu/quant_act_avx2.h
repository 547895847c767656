// The AVX2 form of the int8-activation GEMV (quant_act.h) for the formats with blocks of
// 32 (q8_0, q4_0, q4_1, q5_0, q5_1, int4, int8; the K-quants in quant_act_k.h), and the
// scalar form without AVX2. Per block: maddubs / madd into 8 int32 lanes, one FMA with the
// block's scale; the 4- and 5-bit formats take eight blocks' scales and constant terms
// (minimum, -8 / -16 offset) at a time in 8 lanes (block8_scales, shared with the VNNI
// form), q8_0 / int8 / int4 with larger groups a block at a time.
// (Two FMA chains, with signed codes or not, measured slower: docs/cpu-kernels.md.)
// Multi-row: a block's codes are unpacked once for MR activation rows (Q8Acts), each row
// with its own accumulator and constant term, summed as a one-row call sums them. The
// scalar sums are explicit std::fma: left to contraction, GCC vectorised two rows' terms
// as a 2-lane multiply and add (no FMA), so rows 0-1 of a 2- or 3-row call differed
// from the row alone (int4 with groups of 128).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "quant_act_blocks.h"
#include "quant_act_k.h"
#include "quant_kernels.h"

namespace topg::quant {

#if TOPG_AVX2
// sum over 32 of w[i] * x[i] as float, w unsigned 0..127 or 0..15 (maddubs takes the
// first operand unsigned), x int8.
inline __m256 udot(__m256i uw, __m256i sx) {
  const __m256i p16 = _mm256_maddubs_epi16(uw, sx);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}
#endif

// One row, one activation row, without SIMD: the activations de-quantised.
inline float dot_row_q8_scalar(const Format& f, const uint8_t* row, int64_t k, const int8_t* xq,
                               const float* xd) {
  float x[256], total = 0.f;
  if (f.block == 0) {
    float s;
    std::memcpy(&s, row, 4);
    for (int64_t i = 0; i < k; ++i)
      total += float(int8_t(row[4 + i])) * (float(xq[i]) * xd[i / 32]);
    return total * s;
  }
  float w[256];
  for (int64_t b = 0; b < f.blocks(k); ++b) {
    dequant_block(f, row + b * f.block_bytes, f.block, w);
    for (int64_t i = 0; i < f.block; ++i)
      x[i] = float(xq[b * f.block + i]) * xd[(b * f.block + i) / 32];
    for (int64_t i = 0; i < f.block; ++i) total += w[i] * x[i];
  }
  return total;
}

// out[r * ldo] = sum over the row's k weights of w * x_r for activation rows r < MR.
template <int MR>
inline void dot_row_q8_avx2(const Format& f, const uint8_t* row, int64_t k, const Q8Acts& x,
                            float* out, int64_t ldo) {
  const int64_t nb = f.blocks(k);
#if TOPG_AVX2
  __m256 acc[MR];
  float extra[MR];  // the minimum's (or the -8 / -16 offset's) share, per block
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps(), extra[r] = 0.f;
  // block b of a 4- or 5-bit format: u the codes, d and m the scale and minimum (has_min)
  // or d the scale and off the offset (m unused)
  auto block45 = [&](int64_t b, __m256i u, float d, float m, bool has_min, float off) {
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const float xd = x.d[r][b], dd = d * xd;
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dd), udot(u, load32(x.q[r] + 32 * b)), acc[r]);
      extra[r] = has_min ? std::fma(m * xd, x.s[r][b], extra[r])
                         : std::fma(-(off * dd), x.s[r][b], extra[r]);
    }
  };
  auto finish = [&] {
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) out[r * ldo] = hsum(acc[r]) + extra[r];
  };
  // The 4- and 5-bit formats (and int4 with groups of 32, laid out as q4_1), eight blocks
  // at a time: their fp16 scales (and minimums) converted as one vector, times the eight
  // activation scales, the constant terms as one 8-lane FMA (block8_scales, the VNNI
  // form's code); per block only the codes' dot and its FMA remain (the loop is bound by
  // its work: docs/real-size.md, "Figures on a Zen 3"). The last nb % 8 blocks one at a
  // time (block45).
  auto blocks8 = [&]<Row32 R>(std::integral_constant<Row32, R>) __attribute__((always_inline)) {
    using L = Row32Layout<R>;
    const auto codes = [](const uint8_t* q) {
      if constexpr (R == Row32::q5_0 || R == Row32::q5_1)
        return unpack_q5(q, q + 4);
      else
        return unpack16(q);
    };
    __m256 cterm[MR];
    alignas(32) float sa[MR][8];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) cterm[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
      const uint8_t* p = row + L::bb * b;
      const auto half = [p](int i, int at) {
        uint16_t v;
        std::memcpy(&v, p + L::bb * i + at, 2);
        return short(v);
      };
      const __m256 d =
          _mm256_cvtph_ps(_mm_setr_epi16(half(0, 0), half(1, 0), half(2, 0), half(3, 0), half(4, 0),
                                         half(5, 0), half(6, 0), half(7, 0)));
      __m256 m = _mm256_setzero_ps();
      if constexpr (L::has_min)
        m = _mm256_cvtph_ps(_mm_setr_epi16(half(0, 2), half(1, 2), half(2, 2), half(3, 2),
                                           half(4, 2), half(5, 2), half(6, 2), half(7, 2)));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
        _mm256_store_ps(sa[r], block8_scales<R>(d, m, b, x.d[r], x.s[r], cterm[r]));
      asm("" : "+m"(sa));  // keep the broadcasts loads (GCC forwards the stores otherwise)
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m256i u = codes(p + L::bb * i + L::codes_at);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(sa[r][i]), udot(u, load32(x.q[r] + 32 * (b + i))),
                                   acc[r]);
      }
    }
    for (; b < nb; ++b) {
      const uint8_t* p = row + L::bb * b;
      block45(b, codes(p + L::codes_at), half_at(p), L::has_min ? half_at(p + 2) : 0.f, L::has_min,
              L::off);
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) extra[r] += hsum(cterm[r]);
    return finish();
  };
  switch (f.fmt) {
    case Fmt::q8_0:
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 34 * b;
        const float d = half_at(p);
        const __m256i w = load32(p + 2), uw = _mm256_sign_epi8(w, w);  // |w|
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d[r][b]),
                                   udot(uw, _mm256_sign_epi8(load32(x.q[r] + 32 * b), w)), acc[r]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) out[r * ldo] = hsum(acc[r]);
      return;
    case Fmt::q4_0:
      return blocks8(std::integral_constant<Row32, Row32::q4_0>{});
    case Fmt::q4_1:
      return blocks8(std::integral_constant<Row32, Row32::q4_1>{});
    case Fmt::q5_0:
      return blocks8(std::integral_constant<Row32, Row32::q5_0>{});
    case Fmt::q5_1:
      return blocks8(std::integral_constant<Row32, Row32::q5_1>{});
    case Fmt::int4: {
      if (f.block == 32) return blocks8(std::integral_constant<Row32, Row32::q4_1>{});
      const int64_t g = f.block, bb = f.block_bytes, sub = g / 32;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + bb * b;
        const float dw = half_at(p), mw = half_at(p + 2);
        const int64_t x0 = b * sub;    // first activation block of the group
        const int64_t half = sub / 2;  // runs of 32 bytes: low nibbles block c, high c + half
        for (int64_t c = 0; c < half; ++c) {
          __m256i lo, hi;
          unpack32(p + 4 + 32 * c, lo, hi);
          const int64_t bl = x0 + c, bh = x0 + half + c;
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d[r][bl]),
                                     udot(lo, load32(x.q[r] + 32 * bl)), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d[r][bh]),
                                     udot(hi, load32(x.q[r] + 32 * bh)), acc[r]);
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
          for (int64_t c = 0; c < sub; ++c)
            extra[r] = std::fma(mw * x.d[r][x0 + c], x.s[r][x0 + c], extra[r]);
      }
      return finish();
    }
    case Fmt::int8: {
      float s;
      std::memcpy(&s, row, 4);
      const uint8_t* q = row + 4;
      const int64_t full = k / 32;
      alignas(32) uint8_t tail[32] = {};  // a row ending inside a block: no read past it
      if (k % 32) std::memcpy(tail, q + 32 * full, size_t(k % 32));
      for (int64_t b = 0; b < (k + 31) / 32; ++b) {
        const __m256i w = load32(b < full ? q + 32 * b : tail), uw = _mm256_sign_epi8(w, w);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x.d[r][b]),
                                   udot(uw, _mm256_sign_epi8(load32(x.q[r] + 32 * b), w)), acc[r]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) out[r * ldo] = hsum(acc[r]) * s;
      return;
    }
    case Fmt::q4_k:
    case Fmt::q5_k:
    case Fmt::q6_k:
      return dot_row_q8_k_avx2<MR>(f.fmt, row, nb, x, out, ldo);
    default:
      break;
  }
#endif
  (void)nb;
  for (int r = 0; r < MR; ++r) out[r * ldo] = dot_row_q8_scalar(f, row, k, x.q[r], x.d[r]);
}

}  // namespace topg::quant
