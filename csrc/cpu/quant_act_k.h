// int8 activations against the K-quants (q4_k, q5_k, q6_k): integer dot products per block of
// 32 activations, as quant_act.h computes them for the 32-blocks formats. A K-quant's
// super-block of 256 weights splits into 32-runs that line up with the activation blocks:
//   q4_k   run j (of 8): 32 nibbles (the low or high halves of 32 bytes), w = d sc_j u -
//          dmin m_j, so the run's sum is xd (d sc_j sum(u q) - dmin m_j sum(q));
//   q5_k   as q4_k, u with a 5th bit (0..31);
//   q6_k   run j (of 8): 32 six-bit codes u (4 bits in ql, 2 in qh), w = d sc (u - 32), with
//          one sc per 16 weights: the run's sum is xd d (sc_lo sum_lo + sc_hi sum_hi) of
//          (u - 32) q, sum_lo over the first 16 weights.
// Two forms (the same integer products, different fp32 summation orders):
//   AVX2          maddubs / madd per run, one FMA with the run's scale;
//   AVX-512 VNNI  one vpdpbusd per run (q6_k: two, the second sums 32 q per 4 bytes for
//                 the -32 offset), the run's scales from a super-block's scale vector.
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

// The AVX2 form: out[r * ldo] = the row's sum over its nb super-blocks against activation
// row r < MR. u unsigned (maddubs's first operand).
template <int MR>
inline void dot_row_q8_k_avx2(Fmt fmt, const uint8_t* row, int64_t nb, const Q8Acts& x, float* out,
                              int64_t ldo) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  float extra[MR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps(), extra[r] = 0.f;
  for (int64_t s = 0; s < nb; ++s) {
    if (fmt != Fmt::q6_k) {  // q4_k, q5_k
      const int64_t bb = fmt == Fmt::q5_k ? 176 : 144;
      const uint8_t* p = row + bb * s;
      stream_ahead(p, bb);
      const float d = half_at(p), dmin = half_at(p + 2);
      uint8_t sc[8], mn[8];
      k_scales(p + 4, sc, mn);
      for (int c = 0; c < 4; ++c) {
        __m256i lo, hi;
        if (fmt == Fmt::q5_k)
          k45_runs<Fmt::q5_k>(p, c, lo, hi);
        else
          k45_runs<Fmt::q4_k>(p, c, lo, hi);
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * c + h;
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const float* d8 = x.d[r] + 8 * s;
            const __m256i p16 =
                _mm256_maddubs_epi16(h ? hi : lo, load32(x.q[r] + 256 * s + 32 * j));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * float(sc[j]) * d8[j]),
                                     _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones)), acc[r]);
            extra[r] = std::fma(-(dmin * float(mn[j]) * d8[j]), x.s[r][8 * s + j], extra[r]);
          }
        }
      }
    } else {  // q6_k
      const uint8_t* p = row + 210 * s;
      stream_ahead(p, 210);
      const float d = half_at(p + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
      const __m256i k32 = _mm256_set1_epi8(32);
      for (int h = 0; h < 2; ++h) {
        __m256i u[4];
        q6k_runs(p + 64 * h, p + 128 + 32 * h, u);
        for (int q = 0; q < 4; ++q) {
          const int j = 4 * h + q;  // run j: weights 32 j.., scales sc[2 j], sc[2 j + 1]
          const __m256i s16 =
              _mm256_set_m128i(_mm_set1_epi16(sc[2 * j + 1]), _mm_set1_epi16(sc[2 * j]));
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const __m256i xv = load32(x.q[r] + 256 * s + 32 * j);
            // (u - 32) * x per pair: |.| <= 63 * 127 * 2 + 32 * 127 * 2 < 2^15
            const __m256i p16 =
                _mm256_sub_epi16(_mm256_maddubs_epi16(u[q], xv), _mm256_maddubs_epi16(k32, xv));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d[r][8 * s + j]),
                                     _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, s16)), acc[r]);
          }
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) out[r * ldo] = hsum(acc[r]) + extra[r];
}
#endif

#if TOPG_VNNI_BUILT
// The VNNI form, R = q4_k, q5_k or q6_k: out[r * ldo] for activation rows r < MR.
template <Fmt R, int MR>
TOPG_TARGET_VNNI __attribute__((always_inline)) inline void dot_row_q8_k_vnni(
    const uint8_t* row, int64_t nb, const Q8Acts& x, float* out, int64_t ldo) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 a0[MR], a1[MR], cterm[MR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) a0[r] = zero, a1[r] = zero, cterm[r] = zero;
  for (int64_t s = 0; s < nb; ++s) {
    if constexpr (R != Fmt::q6_k) {  // q4_k, q5_k
      constexpr int64_t bb = R == Fmt::q5_k ? 176 : 144;
      const uint8_t* p = row + bb * s;
      stream_ahead(p, bb);  // L1: L2 measured no faster for q4_k (quant_kernels.h)
      // scales and minimums of the 8 runs, 6 bits each, as 8 lanes
      uint8_t sc[8], mn[8];
      k_scales(p + 4, sc, mn);
      uint64_t sc8, mn8;
      std::memcpy(&sc8, sc, 8), std::memcpy(&mn8, mn, 8);
      const __m256 scv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(sc8))));
      const __m256 mnv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mn8))));
      const __m256 dsc = _mm256_mul_ps(_mm256_set1_ps(half_at(p)), scv);
      const __m256 dmn = _mm256_mul_ps(_mm256_set1_ps(half_at(p + 2)), mnv);
      // the 8 runs' scales of each activation row, in memory: each run's FMA takes its
      // scale as a broadcast load (not a lane permute, a port-5 uop)
      alignas(32) float sv[MR][8];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const __m256 xdv = _mm256_loadu_ps(x.d[r] + 8 * s);  // the runs' activation scales
        _mm256_store_ps(sv[r], _mm256_mul_ps(dsc, xdv));
        cterm[r] =
            _mm256_fnmadd_ps(dmn, _mm256_mul_ps(xdv, _mm256_loadu_ps(x.s[r] + 8 * s)), cterm[r]);
      }
      asm("" : "+m"(sv));  // keep the broadcasts loads (GCC forwards the stores otherwise)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        __m256i lo, hi;
        k45_runs<R>(p, c, lo, hi);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const int8_t* xr = x.q[r] + 256 * s + 64 * c;
          const __m256i dl = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, load32(xr));
          const __m256i dh = _mm256_dpbusd_epi32(_mm256_setzero_si256(), hi, load32(xr + 32));
          a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dl), _mm256_set1_ps(sv[r][2 * c]), a0[r]);
          a1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dh), _mm256_set1_ps(sv[r][2 * c + 1]), a1[r]);
        }
      }
    } else {  // q6_k
      const uint8_t* p = row + 210 * s;
      stream_ahead<Ahead::l2>(p, 210);
      const __m256 d = _mm256_set1_ps(half_at(p + 208));
      const __m256i k32 = _mm256_set1_epi8(32);
      for (int h = 0; h < 2; ++h) {
        // the 8 scales of this half (16 weights each) as 8 lanes, times d
        int64_t sc8;
        std::memcpy(&sc8, p + 192 + 8 * h, 8);
        const __m256 scv =
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(sc8))), d);
        __m256i u[4];
        q6k_runs(p + 64 * h, p + 128 + 32 * h, u);
        for (int q = 0; q < 4; ++q) {
          const int j = 4 * h + q;
          // lanes 0-3: the run's first 16 weights, 4-7 the next 16
          const __m256i lanes = _mm256_setr_epi32(2 * q, 2 * q, 2 * q, 2 * q, 2 * q + 1, 2 * q + 1,
                                                  2 * q + 1, 2 * q + 1);
          const __m256 scq = _mm256_permutexvar_ps(lanes, scv);
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const __m256i xv = load32(x.q[r] + 256 * s + 32 * j);
            const __m256i dot =
                _mm256_sub_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u[q], xv),
                                 _mm256_dpbusd_epi32(_mm256_setzero_si256(), k32, xv));
            const __m256 sv = _mm256_mul_ps(scq, _mm256_set1_ps(x.d[r][8 * s + j]));
            if (q & 1)
              a1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sv, a1[r]);
            else
              a0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sv, a0[r]);
          }
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
    out[r * ldo] = hsum(_mm256_add_ps(_mm256_add_ps(a0[r], a1[r]), cterm[r]));
}

// out[r * ldo + i] = dot_row_q8_k_vnni(w + i * rb) for weight rows i < n.
template <Fmt R, int MR>
TOPG_TARGET_VNNI void dot_rows_q8_k_vnni(const uint8_t* w, int64_t rb, int64_t n, int64_t nb,
                                         const Q8Acts& x, float* out, int64_t ldo) {
  for (int64_t i = 0; i < n; ++i) dot_row_q8_k_vnni<R, MR>(w + i * rb, nb, x, out + i, ldo);
}
#endif

}  // namespace topg::quant
