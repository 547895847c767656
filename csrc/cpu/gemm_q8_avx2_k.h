// The AVX2 integer GEMM's form for the K-quants (q4_k, q5_k, q6_k), whose int8 activations
// hold one scale xd per super-block of 256 (act_group; llama.cpp's Q8_K): a super-block's
// products are summed in int32 with each scale block's integer scale as the madd
// multiplier (the GEMV's K form, quant_act_k_form.h, on the GEMM's lanes), so one
// conversion and one FMA per super-block and (weight row, activation row) take the place
// of one conversion, a multiply and two FMAs per scale block (gemm_q8_avx2.h's avx2_tile).
//
// Per super-block s and weight row (an int32 lane of a ymm, 8 rows a group):
//   q4_k, q5_k  sum = d xd sum_j sc_j sum_j(u q) - dmin xd sum_j mn_j xsum_j, j < 8 runs
//               of 32; the minimums' sum in int32 too (madd of (mn_2i, mn_2i+1) against the
//               activations' code sums (xsum_2i, xsum_2i+1), |xsum| <= 32 * 127 < 2^15);
//   q6_k        sum = d xd (sum_i sc_i sum_i(u q) - 32 sum_i sc_i xs16_i), i < 16 blocks of
//               16, all of it in int32.
// Bounds: |sum(u q)| over a super-block <= 256 * 63 * 127, times |sc| <= 128: < 2^29.
//
// The packed scales of a group, per super-block, kKVecs vectors of 8 int32 lanes (one a
// row): [0, 16) the scale blocks' scales as int16 pairs (sc, sc) (q4_k / q5_k: 8 used),
// kKD: d (fp32 bits), kKDmin: dmin (fp32 bits), [kKPairs, kKPairs + 8) the pairs (mn_2i,
// mn_2i+1) (q4_k / q5_k: 4) or (sc_2i, sc_2i+1) (q6_k: 8). The codes as gemm_q8_avx2.h's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gemm_q8_avx2.h"
#include "gemm_q8_pack.h"

namespace topg::quant {

#if defined(__x86_64__) && defined(__GNUC__) && TOPG_AVX2
inline constexpr int64_t kKVecs = 26, kKD = 16, kKDmin = 17, kKPairs = 18;

inline int32_t k_pair16(int a, int b) {
  return int32_t(uint32_t(uint16_t(int16_t(a))) | (uint32_t(uint16_t(int16_t(b))) << 16));
}

// Super-block s of the K-quant row at `row` (null: a row past the strip, zeros): its 256
// codes into u and its scales into lane r of ks (that super-block's kKVecs x 8 int32),
// the 6-bit scales decoded once.
inline void gemm_k_row(Fmt fmt, const uint8_t* row, int64_t s, uint8_t* u, int32_t* ks, int r) {
  if (!row) {
    std::memset(u, 0, 256);
    for (int64_t v = 0; v < kKVecs; ++v) ks[8 * v + r] = 0;
    return;
  }
  float d, dmin = 0.f;
  const uint8_t* p;
  if (fmt == Fmt::q6_k) {
    p = row + 210 * s;
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    d = half_at(p + 208);
    for (int i = 0; i < 16; ++i) ks[8 * i + r] = k_pair16(sc[i], sc[i]);
    for (int i = 0; i < 8; ++i) ks[8 * (kKPairs + i) + r] = k_pair16(sc[2 * i], sc[2 * i + 1]);
  } else {
    p = row + (fmt == Fmt::q5_k ? 176 : 144) * s;
    uint8_t sc[8], mn[8];
    k_scales(p + 4, sc, mn);
    d = half_at(p), dmin = half_at(p + 2);
    for (int j = 0; j < 8; ++j) ks[8 * j + r] = k_pair16(sc[j], sc[j]);
    for (int i = 0; i < 4; ++i) ks[8 * (kKPairs + i) + r] = k_pair16(mn[2 * i], mn[2 * i + 1]);
  }
  gemm_super_block_codes(fmt, p, u);
  std::memcpy(ks + 8 * kKD + r, &d, 4);
  std::memcpy(ks + 8 * kKDmin + r, &dmin, 4);
}

// Rows [0, rows) of the 8 K-quant rows at w into codes [kw / 4][8] (gemm_pack_group8's
// layout) and ks [kw / 256][kKVecs][8].
inline void gemm_pack_group8_k(Fmt fmt, const uint8_t* w, int64_t rb, int64_t rows, int64_t kw,
                               uint32_t* codes, int32_t* ks) {
  alignas(32) uint8_t u[8 * 256];
  for (int64_t s = 0; s < kw / 256; ++s) {
    int32_t* kss = ks + s * kKVecs * 8;
    for (int r = 0; r < 8; ++r)
      gemm_k_row(fmt, r < rows ? w + r * rb : nullptr, s, u + r * 256, kss, r);
    transpose8_dwords(u, 256, 256, codes + s * 64 * 8);
  }
}

// The activations' code sums of super-block s as int16 pairs, pair i broadcast to every
// lane of p[i]: q4_k / q5_k the 8 sums per 32 (4 pairs), q6_k the 16 per 16 (8 pairs).
template <int NP>
inline void k_sum_pairs(const float* xs, __m256i* p) {
  for (int h = 0; h < NP / 4; ++h) {
    const __m256i v = _mm256_cvtps_epi32(_mm256_loadu_ps(xs + 8 * h));  // exact: integers
    const __m256i pk = _mm256_packs_epi32(v, v);  // int32 lanes 0, 1, 4, 5: the 4 pairs
    for (int i = 0; i < 4; ++i)
      p[4 * h + i] = _mm256_permutevar8x32_epi32(pk, _mm256_set1_epi32(i < 2 ? i : i + 2));
  }
}

// avx2_tile's K form: out[(m0 + c) * ldo + 8 r + j] for c < C activation rows, r < R
// groups of 8 weight rows (columns from 8 r + j >= cols not written).
template <int R, int C, bool Q6>
inline void avx2_tile_k(const uint32_t* codes, const int32_t* ks, int64_t gcodes, int64_t gks,
                        int64_t nsup, const VnniActs& x, int64_t m0, float* out, int64_t ldo,
                        int64_t cols) {
  constexpr int NB = Q6 ? 16 : 8;  // scale blocks a super-block
  constexpr int NP = Q6 ? 8 : 4;   // pairs of code sums
  constexpr int SPB = 32 / NB;     // steps of 8 codes a scale block
  __m256 acc[R][C];
  const int8_t* xq[C];
  const float *xd[C], *xs[C];
  for (int c = 0; c < C; ++c) {
    const int64_t row = x.row(m0 + c);
    xq[c] = x.q + row * x.kp, xd[c] = x.xd + row * x.nb;
    xs[c] = Q6 ? x.xs16 + (m0 + c) * nsup * 16 : x.xsum + row * x.nb;
    for (int r = 0; r < R; ++r) acc[r][c] = _mm256_setzero_ps();
  }
  auto code = [&](int r, int64_t s) {
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(codes + r * gcodes + 8 * s));
  };
  auto act = [&](int c, int64_t s) {
    int32_t q4;
    std::memcpy(&q4, xq[c] + 4 * s, 4);
    return _mm256_set1_epi32(q4);
  };
  auto vec = [&](const int32_t* p, int64_t v) {
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 8 * v));
  };
  for (int64_t sb = 0; sb < nsup; ++sb) {
    __m256i ia[R][C];
    const int32_t* kr[R];
    for (int r = 0; r < R; ++r) {
      kr[r] = ks + r * gks + sb * kKVecs * 8;
      for (int c = 0; c < C; ++c) ia[r][c] = _mm256_setzero_si256();
    }
    for (int j = 0; j < NB; ++j) {
      __m256i sv[R];
      for (int r = 0; r < R; ++r) sv[r] = vec(kr[r], j);
      for (int t = 0; t < SPB; ++t) {
        const int64_t s = 64 * sb + 2 * (SPB * j + t);  // steps of 4 codes
        __m256i w0[R], w1[R];
        for (int r = 0; r < R; ++r) w0[r] = code(r, s), w1[r] = code(r, s + 1);
        for (int c = 0; c < C; ++c) {
          const __m256i x0 = act(c, s), x1 = act(c, s + 1);
          for (int r = 0; r < R; ++r) {
            const __m256i p =
                _mm256_add_epi16(_mm256_maddubs_epi16(w0[r], x0), _mm256_maddubs_epi16(w1[r], x1));
            ia[r][c] = _mm256_add_epi32(ia[r][c], _mm256_madd_epi16(p, sv[r]));
          }
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      __m256i xp[NP];
      k_sum_pairs<NP>(xs[c] + NB * sb, xp);
      const __m256 xdb = _mm256_set1_ps(xd[c][8 * sb]);
      for (int r = 0; r < R; ++r) {
        __m256i im = _mm256_setzero_si256();
        for (int i = 0; i < NP; ++i)
          im = _mm256_add_epi32(im, _mm256_madd_epi16(vec(kr[r], kKPairs + i), xp[i]));
        const __m256 d = _mm256_castsi256_ps(vec(kr[r], kKD));
        if constexpr (Q6) {
          const __m256i all = _mm256_sub_epi32(ia[r][c], _mm256_slli_epi32(im, 5));
          acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(all), _mm256_mul_ps(d, xdb), acc[r][c]);
        } else {
          const __m256 dmin = _mm256_castsi256_ps(vec(kr[r], kKDmin));
          acc[r][c] =
              _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][c]), _mm256_mul_ps(d, xdb), acc[r][c]);
          acc[r][c] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(im), _mm256_mul_ps(dmin, xdb), acc[r][c]);
        }
      }
    }
  }
  avx2_store_tile<R, C>(acc, out + m0 * ldo, ldo, cols);
}

template <int R, bool Q6>
inline void avx2_strip_k(const uint32_t* codes, const int32_t* ks, int64_t gcodes, int64_t gks,
                         int64_t nsup, const VnniActs& x, int64_t M, float* out, int64_t ldo,
                         int64_t cols) {
  constexpr int C = 3;
  int64_t m = 0;
  for (; m + C <= M; m += C)
    avx2_tile_k<R, C, Q6>(codes, ks, gcodes, gks, nsup, x, m, out, ldo, cols);
  if (M - m == 2) avx2_tile_k<R, 2, Q6>(codes, ks, gcodes, gks, nsup, x, m, out, ldo, cols);
  if (M - m == 1) avx2_tile_k<R, 1, Q6>(codes, ks, gcodes, gks, nsup, x, m, out, ldo, cols);
}

// gemm_q8_strip_avx2 for q4_k, q5_k and q6_k (x.xs16 set for q6_k).
inline void gemm_q8_strip_avx2_k(const Format& f, const uint8_t* w, int64_t rb, int64_t k,
                                 int64_t cols, const VnniActs& x, int64_t M, GemmQ8Scratch& sc,
                                 float* out, int64_t ldo) {
  const int64_t kw = f.padded(k), nsup = kw / 256;
  const int64_t gcodes = kw / 4 * 8, gks = nsup * kKVecs * 8;  // per group of 8
  const int64_t groups = (cols + 7) / 8;
  uint32_t* codes = sc.codes.fit<uint32_t>(4 * gcodes);
  int32_t* ks = sc.scales.fit<int32_t>(4 * gks);
  for (int64_t g = 0; g < groups; ++g)
    gemm_pack_group8_k(f.fmt, w + 8 * g * rb, rb, std::min<int64_t>(8, cols - 8 * g), kw,
                       codes + g * gcodes, ks + g * gks);
  const bool q6 = f.fmt == Fmt::q6_k;
  for (int64_t g = 0; 8 * g < cols; g += 2) {  // two groups (16 rows) a pass
    const int64_t left = cols - 8 * g;
    const uint32_t* cg = codes + g * gcodes;
    const int32_t* kg = ks + g * gks;
    float* o = out + 8 * g;
    if (left > 8 && q6)
      avx2_strip_k<2, true>(cg, kg, gcodes, gks, nsup, x, M, o, ldo, left);
    else if (left > 8)
      avx2_strip_k<2, false>(cg, kg, gcodes, gks, nsup, x, M, o, ldo, left);
    else if (q6)
      avx2_strip_k<1, true>(cg, kg, gcodes, gks, nsup, x, M, o, ldo, left);
    else
      avx2_strip_k<1, false>(cg, kg, gcodes, gks, nsup, x, M, o, ldo, left);
  }
}
#endif

}  // namespace topg::quant
