// int8 activations against the K-quants (q4_k, q5_k, q6_k): the activations hold one scale
// xd per super-block of 256 (act_group; llama.cpp's Q8_K), stored per block of 32 as for the
// other formats (quant_act.h). A super-block of 256 weights splits into 32-runs that line
// up with the activation blocks:
//   q4_k   run j (of 8): 32 nibbles (the low or high halves of 32 bytes), w = d sc_j u -
//          dmin m_j, so the super-block's sum is d xd sum_j sc_j sum(u q) - dmin xd sum_j
//          m_j sum(q);
//   q5_k   as q4_k, u with a 5th bit (0..31);
//   q6_k   run j (of 8): 32 six-bit codes u (4 bits in ql, 2 in qh), w = d sc (u - 32), with
//          one sc per 16 weights: the super-block's sum is d xd sum_j (sc_lo sum_lo + sc_hi
//          sum_hi) of (u - 32) q, sum_lo over a run's first 16 weights.
// The integer sums over a super-block stay in int32 (|sum| < 2^26), one conversion and one
// FMA per super-block. Two forms of one text (quant_act_k_form.h), the same integers and
// the same fp32 summation order (bitwise the same sums):
//   AVX2          per run maddubs (q6_k: two, the second for the -32 offset), then madd
//                 against the run's scales as int16 lanes and an int32 add;
//   AVX-512 VNNI  the same with one vpdpwssd for the madd and the add (the same lanes).
// (Scales per 32-run, the semantics before 2026-12-07, cost a conversion and an FMA per
// run: the AVX2 GEMV is 10-27% faster per super-block: docs/cpu-kernels.md.)
// Without AVX2: dot_row_q8_avx2's scalar loop (de-quantised weights, rounded activations).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "quant_kernels.h"

namespace topg::quant {

#if defined(__x86_64__) && defined(__GNUC__) && TOPG_AVX2
#define TOPG_VNNI_BUILT 1
#define TOPG_TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#else
#define TOPG_VNNI_BUILT 0
#endif

// The activation rows of one multi-row call (quant_act.h's dot_rows_q8): row r < MR's
// int8 codes q[r] (blocks of 32), block scales d[r] and code sums s[r]. A call takes up to
// kActRows rows: the weight block's codes are unpacked and its scales converted once,
// then each row takes its own integer dot products and fp32 sums, in the order of a
// one-row call (MR = 1 is the same code), so a row's result does not depend on MR.
inline constexpr int kActRows = 4;
struct Q8Acts {
  const int8_t* q[kActRows];
  const float* d[kActRows];
  const float* s[kActRows];
};

#if TOPG_AVX2
inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// The per-super-block work both forms share (AVX2 instructions only, so the VNNI form
// inlines them too). q4_k / q5_k super-block s at p: the minimums' term -dmin mn_j xd_r,j
// xs_r,j added to cterm[r] (8 lanes, one per run); returns the 8 run scales (6 bits each)
// in the low 8 bytes.
template <int MR>
__attribute__((always_inline)) inline __m128i k45_mins(const uint8_t* p, int64_t s, const Q8Acts& x,
                                                       __m256* cterm) {
  uint8_t sc[8], mn[8];
  k_scales(p + 4, sc, mn);
  uint64_t sc8, mn8;
  std::memcpy(&sc8, sc, 8), std::memcpy(&mn8, mn, 8);
  const __m256 mnv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mn8))));
  const __m256 dmn = _mm256_mul_ps(_mm256_set1_ps(half_at(p + 2)), mnv);
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    const __m256 xdv = _mm256_loadu_ps(x.d[r] + 8 * s);  // the runs' activation scales
    cterm[r] = _mm256_fnmadd_ps(dmn, _mm256_mul_ps(xdv, _mm256_loadu_ps(x.s[r] + 8 * s)), cterm[r]);
  }
  return _mm_cvtsi64_si128(int64_t(sc8));
}

// A run's products as int16 pairs: maddubs (unsigned u x signed q, adjacent pairs summed)
// does not saturate for the K-quants' codes (|u x + u' x'| <= 2 * 63 * 127 < 2^15); q6_k's
// (u - 32) x pairs as the difference of two maddubs (|.| <= 2 * 32 * 127 + 2 * 63 * 127).
__attribute__((always_inline)) inline __m256i k_pairs6(__m256i u, __m256i x) {
  return _mm256_sub_epi16(_mm256_maddubs_epi16(u, x),
                          _mm256_maddubs_epi16(_mm256_set1_epi8(32), x));
}
// 8 int8 scales as int16 lanes, the same 8 in both 128-bit halves; a run's pair picked by
// one byte shuffle (int16 a in the low half's lanes, b in the high half's): the pairs'
// multiplier (madd / vpdpwssd), so int32 lane i = scale * (sum over bytes 4i..4i+3).
__attribute__((always_inline)) inline __m256i k_scales_i16(__m128i b8) {
  return _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(b8));
}
__attribute__((always_inline)) inline __m256i k_pick_i16(__m256i v, int a, int b) {
  const char a0 = char(2 * a), a1 = char(2 * a + 1), b0 = char(2 * b), b1 = char(2 * b + 1);
  return _mm256_shuffle_epi8(
      v, _mm256_setr_epi8(a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, a0, a1, b0, b1,
                          b0, b1, b0, b1, b0, b1, b0, b1, b0, b1, b0, b1, b0, b1));
}

// The AVX2 form: dot_row_q8_k_avx2_fmt<R, MR> (quant_act_k_form.h).
#define TOPG_K_FORM dot_row_q8_k_avx2_fmt
#define TOPG_K_TARGET
#define TOPG_K_MADD(acc, p, sc) _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc))
#include "quant_act_k_form.h"
#undef TOPG_K_FORM
#undef TOPG_K_TARGET
#undef TOPG_K_MADD

// The AVX2 form by the row's format.
template <int MR>
inline void dot_row_q8_k_avx2(Fmt fmt, const uint8_t* row, int64_t nb, const Q8Acts& x, float* out,
                              int64_t ldo) {
  if (fmt == Fmt::q4_k) return dot_row_q8_k_avx2_fmt<Fmt::q4_k, MR>(row, nb, x, out, ldo);
  if (fmt == Fmt::q5_k) return dot_row_q8_k_avx2_fmt<Fmt::q5_k, MR>(row, nb, x, out, ldo);
  return dot_row_q8_k_avx2_fmt<Fmt::q6_k, MR>(row, nb, x, out, ldo);
}
#endif

#if TOPG_VNNI_BUILT
// The VNNI form: dot_row_q8_k_vnni<R, MR>, the AVX2 form's text with one vpdpwssd for each
// madd and add (the same int32 lanes).
#define TOPG_K_FORM dot_row_q8_k_vnni
#define TOPG_K_TARGET TOPG_TARGET_VNNI
#define TOPG_K_MADD(acc, p, sc) _mm256_dpwssd_epi32(acc, p, sc)
#include "quant_act_k_form.h"
#undef TOPG_K_FORM
#undef TOPG_K_TARGET
#undef TOPG_K_MADD

// out[r * ldo + i] = dot_row_q8_k_vnni(w + i * rb) for weight rows i < n.
template <Fmt R, int MR>
TOPG_TARGET_VNNI void dot_rows_q8_k_vnni(const uint8_t* w, int64_t rb, int64_t n, int64_t nb,
                                         const Q8Acts& x, float* out, int64_t ldo) {
  for (int64_t i = 0; i < n; ++i) dot_row_q8_k_vnni<R, MR>(w + i * rb, nb, x, out + i, ldo);
}
#endif

}  // namespace topg::quant
