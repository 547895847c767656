// int8 activations (linear_q's int8_activations, llama.cpp's approach): the activation
// rounding (quantize_act) and the GEMV of a packed row against one rounded activation row
// (dot_row_q8). Split from quant_kernels.h, whose fp32-activation dot products it builds on;
// gemm_q8_vnni.h holds the GEMM over the same rounded activations, which VNNI CPUs take
// from quant::kQ8GemmRows (4) rows outside batch-invariant mode (use_gemm_q8): the GEMV
// below serves fewer rows, CPUs without VNNI and batch-invariant mode at every M.
//
// dot_rows_q8 has two forms, the same integer products and different fp32 summation
// orders:
//   AVX2           (quant_act_avx2.h) per block maddubs / madd into 8 int32 lanes, one FMA
//                  with the block's scale, the constant term (minimum, -8 offset) summed
//                  in scalar code;
//   AVX-512 VNNI   (quant_act_vnni.h; use_vnni(): q8_0, q4_0, q4_1, q5_0, q5_1, int4 with
//                  groups of 32, int8) per block one vpdpbusd, the scales and constant
//                  terms of 8 blocks at a time in vector registers, a range of rows per call.
// The K-quants (q4_k, q5_k, q6_k) have both forms in quant_act_k.h.
// Multi-row (M activation rows, the decode steps of a batch where the GEMM is not taken): each form
// takes up to kActRows activation rows per pass over a weight row, unpacking a block's codes and
// converting its scales once for them; each row keeps its own accumulators and sums in
// the order of a one-row call (the one-row call is the same code with MR = 1), so a row's
// result is bitwise the same whatever M is and however the rows are grouped.
// Measured (one thread, weights in L2, [1536, K] rows, cycles a block at 2.6 GHz, AVX2 /
// VNNI): q4_1 3.49 / 2.39 (K = 576), 3.40 / 2.16 (K = 1536); q4_0 3.09 / 2.26, 3.00 / 2.06;
// q8_0 2.66 / 2.31, 2.54 / 2.16. SmolLM2 Q4_1 decode with int8 activations (engine, plan
// phases per step, 2 threads): gate/up 2.2-2.5 -> 1.4-1.6 ms, down 1.0 -> 0.6 ms.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gemv_avx512.h"
#include "quant_act_avx2.h"
#include "quant_act_k.h"
#include "quant_act_vnni.h"
#include "quant_kernels.h"

namespace topg::quant {

// The CPU has AVX-512 VNNI (and use_avx512(): F / BW / VL / DQ, TOPG_DISABLE_AVX512 unset).
inline bool use_vnni() {
#if defined(__x86_64__) && defined(__GNUC__) && TOPG_AVX2
  static const bool on = gemm::use_avx512() && __builtin_cpu_supports("avx512vnni");
  return on;
#else
  return false;
#endif
}

// The activations of a row, padded with zeros to a multiple of the group, are quantised
// with one scale per group of 32 (or 256 for the K-quants' weights: act_group in
// common/quant_formats.h; the K forms sum a super-block in int32) and stored
// per block of 32: d = amax / 127 over the group (each of its blocks stores it),
// q = round-to-nearest-even(x * (1 / d)) (0 when d = 0), and each block's code sum. A group
// holding NaN or inf gets d = NaN, so its row's results are NaN. Model in Python:
// torch_topg.formats.quantize_activations.

// The formats of the integer GEMM (gemm_q8_vnni.h, gemm_q8_pack.h): all of them; a format
// added without a GEMM form takes the GEMV and the de-quantising GEMM instead.
inline bool int8_gemm(Fmt f) {
  switch (f) {
    case Fmt::q8_0:
    case Fmt::q4_0:
    case Fmt::q4_1:
    case Fmt::q5_0:
    case Fmt::q5_1:
    case Fmt::q4_k:
    case Fmt::q5_k:
    case Fmt::q6_k:
    case Fmt::int8:
    case Fmt::int4:
      return true;
  }
  return false;
}

// One group of n (32 or 256) values, scalar: the definition (and the path of a group
// holding NaN or inf).
inline void quantize_act_group(const float* xg, int64_t n, int8_t* q, float* d, float* qsum) {
  float amax = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    finite = finite && std::isfinite(xg[i]);
    amax = std::max(amax, std::fabs(xg[i]));
  }
  const float db = amax / 127.f, id = db != 0.f ? 1.f / db : 0.f;
  for (int64_t b = 0; b < n / 32; ++b) {
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const float v = xg[32 * b + i] * id;
      const int c = finite ? int(std::nearbyint(std::min(127.f, std::max(-127.f, v)))) : 0;
      q[32 * b + i] = int8_t(c);
      sum += c;
    }
    d[b] = finite ? db : std::nanf("");
    qsum[b] = float(sum);
  }
}

// quantize_act_group over kp / group groups (kp: a multiple of the group, as every packed
// format's padded K is of its act_group). The AVX2 form computes the same floats (the
// same amax, d and 1 / d; x * id clamped, then rounded to nearest even as nearbyint does
// in the default rounding mode), 8 lanes at a time.
inline void quantize_act(const float* x, int64_t kp, int8_t* q, float* d, float* qsum,
                         int64_t group) {
  TORCH_CHECK(group == 32 || group == 256, "quantize_act: group ", group, " (32 or 256)");
  TORCH_CHECK(kp % group == 0, "quantize_act: ", kp, " activations are not whole groups of ",
              group);
  for (int64_t g = 0; g < kp / group; ++g) {
    const float* xg = x + group * g;
    int8_t* qg = q + group * g;
    float *dg = d + group / 32 * g, *sg = qsum + group / 32 * g;
#if TOPG_AVX2
    const __m256 sign = _mm256_set1_ps(-0.f), zero = _mm256_setzero_ps();
    __m256 amax = zero, bad = zero;
    for (int64_t i = 0; i < group; i += 8) {
      const __m256 v = _mm256_loadu_ps(xg + i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_mul_ps(v, zero), zero, _CMP_NEQ_UQ));
    }
    if (!_mm256_testz_ps(bad, bad)) {  // NaN or inf: the scalar definition
      quantize_act_group(xg, group, qg, dg, sg);
      continue;
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float db = _mm_cvtss_f32(m4) / 127.f, id = db != 0.f ? 1.f / db : 0.f;
    const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
    for (int64_t b = 0; b < group / 32; ++b) {
      const float* xb = xg + 32 * b;
      __m256i c[4];
      for (int j = 0; j < 4; ++j) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xb + 8 * j), vid);
        c[j] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, v)));
      }
      // int32 -> int8 in order: packs interleave 128-bit lanes, the permute restores them
      const __m256i p16a = _mm256_packs_epi32(c[0], c[1]), p16b = _mm256_packs_epi32(c[2], c[3]);
      const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg + 32 * b), p8);
      const __m256i s32 =
          _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      dg[b] = db;
      sg[b] = float(_mm_cvtsi128_si32(s4));
    }
#else
    quantize_act_group(xg, group, qg, dg, sg);
#endif
  }
}

// Weight rows per dot_rows_q8 call in the GEMVs (linear_q, the decode plan): their bytes
// (16 x 360 for a 576-long q4_1 row) stay in L1 while each group of activation rows passes.
inline constexpr int64_t kQ8Rows = 16;

// out[r * ldo + i] = sum over weight row i's k weights of w * x_r for the n packed rows at
// w (rb bytes apart) and the activation rows r < MR of x.
template <int MR>
inline void dot_rows_q8_m(const Format& f, const uint8_t* w, int64_t rb, int64_t n, int64_t k,
                          const Q8Acts& x, float* out, int64_t ldo) {
#if TOPG_VNNI_BUILT
  if (use_vnni()) {
    const int64_t nb = f.blocks(k);
    switch (f.fmt) {
      case Fmt::q8_0:
        return dot_rows_q8_vnni<Row32::q8_0, MR>(w, rb, n, k, nb, x, out, ldo);
      case Fmt::q4_0:
        return dot_rows_q8_vnni<Row32::q4_0, MR>(w, rb, n, k, nb, x, out, ldo);
      case Fmt::q4_1:
        return dot_rows_q8_vnni<Row32::q4_1, MR>(w, rb, n, k, nb, x, out, ldo);
      case Fmt::q5_0:
        return dot_rows_q8_vnni<Row32::q5_0, MR>(w, rb, n, k, nb, x, out, ldo);
      case Fmt::q5_1:
        return dot_rows_q8_vnni<Row32::q5_1, MR>(w, rb, n, k, nb, x, out, ldo);
      case Fmt::int4:
        if (f.block == 32) return dot_rows_q8_vnni<Row32::q4_1, MR>(w, rb, n, k, nb, x, out, ldo);
        break;  // larger groups: the AVX2 form
      case Fmt::int8:
        return dot_rows_q8_vnni<Row32::int8, MR>(w, rb, n, k, (k + 31) / 32, x, out, ldo);
      case Fmt::q4_k:
        return dot_rows_q8_k_vnni<Fmt::q4_k, MR>(w, rb, n, nb, x, out, ldo);
      case Fmt::q5_k:
        return dot_rows_q8_k_vnni<Fmt::q5_k, MR>(w, rb, n, nb, x, out, ldo);
      case Fmt::q6_k:
        return dot_rows_q8_k_vnni<Fmt::q6_k, MR>(w, rb, n, nb, x, out, ldo);
      default:
        break;
    }
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    prefetch_ahead(w + i * rb, rb);
    dot_row_q8_avx2<MR>(f, w + i * rb, k, x, out + i, ldo);
  }
}

// out[m * ldo + i] = sum over weight row i's k weights of w * x_m for the n packed rows
// at w (rb bytes apart) and M activation rows: row m's int8 blocks at act(m) = {codes,
// block scales, code sums}. The rows go kActRows at a time, the last 1..3 in one call.
template <typename ActAt>
inline void dot_rows_q8(const Format& f, const uint8_t* w, int64_t rb, int64_t n, int64_t k,
                        int64_t M, ActAt&& act, float* out, int64_t ldo) {
  for (int64_t m0 = 0; m0 < M; m0 += kActRows) {
    const int64_t mr = std::min<int64_t>(kActRows, M - m0);
    Q8Acts x{};
    for (int64_t r = 0; r < mr; ++r) act(m0 + r, x.q[r], x.d[r], x.s[r]);
    float* o = out + m0 * ldo;
    switch (mr) {
      case 4:
        dot_rows_q8_m<4>(f, w, rb, n, k, x, o, ldo);
        break;
      case 3:
        dot_rows_q8_m<3>(f, w, rb, n, k, x, o, ldo);
        break;
      case 2:
        dot_rows_q8_m<2>(f, w, rb, n, k, x, o, ldo);
        break;
      default:
        dot_rows_q8_m<1>(f, w, rb, n, k, x, o, ldo);
        break;
    }
  }
}

// The int8-activation GEMV of linear_q and the decode plan: emit(m, n, sum) for weight rows
// [n0, n1) of w against activation rows m < M (row m's blocks at xq + m * kp, its scales
// and code sums at xd / xsum + m * kp / 32), kQ8Rows weight rows at a time.
template <typename Emit>
inline void gemv_q8(const Format& f, const uint8_t* w, int64_t rb, int64_t n0, int64_t n1,
                    int64_t k, const int8_t* xq, const float* xd, const float* xsum, int64_t kp,
                    int64_t M, Emit&& emit) {
  auto act = [&](int64_t m, const int8_t*& q, const float*& d, const float*& s) {
    q = xq + m * kp, d = xd + m * kp / 32, s = xsum + m * kp / 32;
  };
  float sums[kActRows * kQ8Rows];
  for (int64_t n = n0; n < n1; n += kQ8Rows) {
    const int64_t c = std::min(kQ8Rows, n1 - n);
    for (int64_t m0 = 0; m0 < M; m0 += kActRows) {  // sums: kActRows rows of c
      const int64_t mr = std::min<int64_t>(kActRows, M - m0);
      auto act_m0 = [&](int64_t m, const int8_t*& q, const float*& d, const float*& s) {
        act(m0 + m, q, d, s);
      };
      dot_rows_q8(f, w + n * rb, rb, c, k, mr, act_m0, sums, kQ8Rows);
      for (int64_t r = 0; r < mr; ++r)
        for (int64_t i = 0; i < c; ++i) emit(m0 + r, n + i, sums[r * kQ8Rows + i]);
    }
  }
}

}  // namespace topg::quant
