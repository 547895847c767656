// int8 activations against the K-quants (q4_k, q5_k, q6_k): integer dot products per block of
// 32 activations, as quant_act.h computes them for the 32-blocks formats. A K-quant's
// super-block of 256 weights splits into 32-runs that line up with the activation blocks:
//   q4_k   run j (of 8): 32 nibbles (the low or high halves of 32 bytes), w = d sc_j u -
//          dmin m_j, so the run's sum is xd (d sc_j sum(u q) - dmin m_j sum(q));
//   q5_k   as q4_k, u with a 5th bit (0..31);
//   q6_k   run j (of 8): 32 six-bit codes u (4 bits in ql, 2 in qh), w = d sc (u - 32), with
//          one sc per 16 weights: the run's sum is xd d (sc_lo sum_lo + sc_hi sum_hi) of
//          (u - 32) q, sum_lo over the first 16 weights.
// Two forms of one text (quant_act_k_form.h), the same integers and the same fp32
// summation order (bitwise the same sums):
//   AVX-512 VNNI  one vpdpbusd per run (q6_k: two, the second sums 32 q per 4 bytes for
//                 the -32 offset), the run's scales from a super-block's scale vector;
//   AVX2          the same with maddubs / madd for each vpdpbusd (a form with one FMA
//                 chain and a scalar scale and minimum per run was 1.36x slower at 1B
//                 Q4_K_M on a Zen 3: docs/real-size.md, "Figures on a Zen 3").
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
// inlines them too). q4_k / q5_k super-block s at p: sv[r][j] = d sc_j xd_r,j, run j's
// scale for activation row r (in memory: each run's FMA takes it as a broadcast load, not
// a lane permute, a port-5 uop), and the minimums' term -dmin mn_j xd_r,j xs_r,j added to
// cterm[r].
template <int MR>
__attribute__((always_inline)) inline void k45_scales(const uint8_t* p, int64_t s, const Q8Acts& x,
                                                      float (*sv)[8], __m256* cterm) {
  uint8_t sc[8], mn[8];
  k_scales(p + 4, sc, mn);
  uint64_t sc8, mn8;
  std::memcpy(&sc8, sc, 8), std::memcpy(&mn8, mn, 8);
  const __m256 scv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(sc8))));
  const __m256 mnv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mn8))));
  const __m256 dsc = _mm256_mul_ps(_mm256_set1_ps(half_at(p)), scv);
  const __m256 dmn = _mm256_mul_ps(_mm256_set1_ps(half_at(p + 2)), mnv);
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    const __m256 xdv = _mm256_loadu_ps(x.d[r] + 8 * s);  // the runs' activation scales
    _mm256_store_ps(sv[r], _mm256_mul_ps(dsc, xdv));
    cterm[r] = _mm256_fnmadd_ps(dmn, _mm256_mul_ps(xdv, _mm256_loadu_ps(x.s[r] + 8 * s)), cterm[r]);
  }
}

// q6_k half h of the super-block at p: its 8 scales (16 weights each) as 8 lanes, times d.
__attribute__((always_inline)) inline __m256 q6k_scales(const uint8_t* p, int h, __m256 d) {
  int64_t sc8;
  std::memcpy(&sc8, p + 192 + 8 * h, 8);
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(sc8))), d);
}

// Run q of a q6_k half: lanes 0-3 the scale of its first 16 weights, 4-7 of the next 16.
__attribute__((always_inline)) inline __m256 q6k_run_scale(__m256 scv, int q) {
  return _mm256_permutevar8x32_ps(scv, _mm256_setr_epi32(2 * q, 2 * q, 2 * q, 2 * q, 2 * q + 1,
                                                         2 * q + 1, 2 * q + 1, 2 * q + 1));
}

// dpbusd's int32 lanes from AVX2: lane i = sum over bytes 4i..4i+3 of u * x, u unsigned.
// Exact for the K-quants' codes (|u x + u' x'| <= 63 * 127 * 2 < 2^15: maddubs does not
// saturate), so both forms get the same integers and, summed in one order, the same floats.
inline __m256i udot4(__m256i u, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

// The AVX2 form: dot_row_q8_k_avx2_fmt<R, MR> (quant_act_k_form.h).
#define TOPG_K_FORM dot_row_q8_k_avx2_fmt
#define TOPG_K_TARGET
#define TOPG_K_DOT(u, x) udot4(u, x)
#include "quant_act_k_form.h"
#undef TOPG_K_FORM
#undef TOPG_K_TARGET
#undef TOPG_K_DOT

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
// The VNNI form: dot_row_q8_k_vnni<R, MR>, the AVX2 form's text with vpdpbusd.
#define TOPG_K_FORM dot_row_q8_k_vnni
#define TOPG_K_TARGET TOPG_TARGET_VNNI
#define TOPG_K_DOT(u, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x)
#include "quant_act_k_form.h"
#undef TOPG_K_FORM
#undef TOPG_K_TARGET
#undef TOPG_K_DOT

// out[r * ldo + i] = dot_row_q8_k_vnni(w + i * rb) for weight rows i < n.
template <Fmt R, int MR>
TOPG_TARGET_VNNI void dot_rows_q8_k_vnni(const uint8_t* w, int64_t rb, int64_t n, int64_t nb,
                                         const Q8Acts& x, float* out, int64_t ldo) {
  for (int64_t i = 0; i < n; ++i) dot_row_q8_k_vnni<R, MR>(w + i * rb, nb, x, out + i, ldo);
}
#endif

}  // namespace topg::quant
