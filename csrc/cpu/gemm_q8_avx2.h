// The AVX2 form of the int8-activation GEMM (gemm_q8_vnni.h), for CPUs without AVX-512
// VNNI (Zen 3, TOPG_DISABLE_AVX512=1): the same math and the same per-item packing, with
// 8 weight rows across the 8 int32 lanes of a ymm. This file: the 32-block formats; the
// K-quants (one activation scale per super-block) in gemm_q8_avx2_k.h.
//
// Layout: per group of 8 rows, for every 4 codes along K, 32 bytes holding those 4 codes
// of each of the 8 rows; the scales [K / 32][8]. Packing unpacks the 8 rows of a chunk of
// 256 codes with gemm_block / gemm_super_block (gemm_q8_pack.h) into a 2 KiB buffer, then
// transposes each 8 x 8 dwords in registers.
//
// Products: maddubs (unsigned u x signed q, pairs summed into int16) then madd with ones
// into int32. The 4- to 6-bit codes (u <= 63) of two steps of 4 codes are added in int16
// before the madd: |pair| <= 2 * 63 * 127, two pairs 32004 < 2^15. The signed formats
// (q8_0, int8; packed as code + 128) would saturate maddubs's pairs; they have no AVX2
// GEMM (use_gemm_q8): a form with the AVX2 GEMV's sign trick (u = |w|, q with w's sign,
// one madd per step) measured no faster than their GEMV to 16 rows and slower than
// de-quantise + at::mm above (docs/cpu-kernels.md).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gemm_q8_pack.h"

namespace topg::quant {

// The formats without an AVX2 GEMM (their codes fill a byte: maddubs would saturate).
inline bool avx2_signed(Fmt f) { return f == Fmt::q8_0 || f == Fmt::int8; }

#if defined(__x86_64__) && defined(__GNUC__) && TOPG_AVX2
// Codes [0, len) of 8 rows of bytes (row r at u + r * ld) into the layout: for every 4
// codes, 8 dwords (one a row) at codes[8 * (c / 4) + r]; 8 x 8 dwords transposed in registers.
inline void transpose8_dwords(const uint8_t* u, int64_t ld, int64_t len, uint32_t* codes) {
  for (int64_t c0 = 0; c0 < len; c0 += 32) {
    __m256i z[8], t[8];
    for (int r = 0; r < 8; ++r) z[r] = load32(u + r * ld + c0);
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    for (int h = 0; h < 2; ++h) {  // z[4 h + i]: lane L holds dword 4 L + i of rows 4h..4h+3
      z[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
      z[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
      z[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
      z[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    uint32_t* o = codes + c0 / 4 * 8;
    for (int i = 0; i < 4; ++i) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(o + 8 * i),
                         _mm256_permute2x128_si256(z[i], z[4 + i], 0x20));
      _mm256_store_si256(reinterpret_cast<__m256i*>(o + 8 * (4 + i)),
                         _mm256_permute2x128_si256(z[i], z[4 + i], 0x31));
    }
  }
}

// acc[r][c] to out[c * ldo + 8 r + j], columns from 8 r + j >= cols not written.
template <int R, int C>
inline void avx2_store_tile(const __m256 (&acc)[R][C], float* out, int64_t ldo, int64_t cols) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int r = 0; r < R; ++r) {
    const int64_t left = cols - 8 * r;
    if (left <= 0) break;
    const __m256i keep =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(left, 8))), lane);
    for (int c = 0; c < C; ++c) _mm256_maskstore_ps(out + c * ldo + 8 * r, keep, acc[r][c]);
  }
}

// Rows [0, rows) of the 8 packed rows at w into codes [kw / 4][8] and dw, cw [kw / 32][8]
// (the 32-block formats; the K-quants pack in gemm_q8_avx2_k.h).
inline void gemm_pack_group8(const Format& f, const uint8_t* w, int64_t rb, int64_t rows, int64_t k,
                             uint32_t* codes, float* dw, float* cw) {
  constexpr int64_t kChunk = 256;
  alignas(32) uint8_t u[8 * kChunk];
  const int64_t kw = f.padded(k);
  for (int64_t k0 = 0; k0 < kw; k0 += kChunk) {
    const int64_t len = std::min(kChunk, kw - k0), nsb = len / 32;
    for (int64_t r = 0; r < 8; ++r) {
      uint8_t* ur = u + r * kChunk;
      float *d = dw + (k0 / 32) * 8 + r, *c = cw + (k0 / 32) * 8 + r;
      if (r >= rows) {
        std::memset(ur, 0, size_t(len));
        for (int64_t j = 0; j < nsb; ++j) d[8 * j] = 0.f, c[8 * j] = 0.f;
      } else {
        for (int64_t b = 0; b < len / 32; ++b)
          gemm_block(f, w + r * rb, k, k0 / 32 + b, ur + 32 * b, d[8 * b], c[8 * b]);
      }
    }
    transpose8_dwords(u, kChunk, len, codes + k0 / 4 * 8);
  }
}

// out[(m0 + c) * ldo + 8 r + j] (c < C activation rows, r < R groups of 8 rows; columns
// from 8 r + j >= cols not written) = the rows' sums. OFF: as vnni_tile's.
template <int R, int C, int OFF>
inline void avx2_tile(const uint32_t* codes, const float* dw, const float* cw, int64_t gcodes,
                      int64_t gscales, int64_t nsb, const VnniActs& x, int64_t m0, float* out,
                      int64_t ldo, int64_t cols) {
  __m256 acc[R][C];
  const int8_t* xq[C];
  const float *xd[C], *xs[C];
  for (int c = 0; c < C; ++c) {
    const int64_t row = x.row(m0 + c);
    xq[c] = x.q + row * x.kp, xd[c] = x.xd + row * x.nb;
    xs[c] = x.xsum + row * x.nb;
    for (int r = 0; r < R; ++r) acc[r][c] = _mm256_setzero_ps();
  }
  const __m256i ones = _mm256_set1_epi16(1);
  auto code = [&](int r, int64_t s) {
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(codes + r * gcodes + 8 * s));
  };
  auto act = [&](int c, int64_t s) {
    int32_t q4;
    std::memcpy(&q4, xq[c] + 4 * s, 4);
    return _mm256_set1_epi32(q4);
  };
  for (int64_t b = 0; b < nsb; ++b) {
    __m256i ia[R][C];
    for (int c = 0; c < C; ++c) {
      const __m256i init = _mm256_set1_epi32(OFF * int(xs[c][b]));
      for (int r = 0; r < R; ++r) ia[r][c] = init;
    }
    for (int64_t s = 8 * b; s < 8 * (b + 1); s += 2) {
      __m256i w0[R], w1[R];
      for (int r = 0; r < R; ++r) w0[r] = code(r, s), w1[r] = code(r, s + 1);
      for (int c = 0; c < C; ++c) {
        const __m256i x0 = act(c, s), x1 = act(c, s + 1);
        for (int r = 0; r < R; ++r) {
          const __m256i p =
              _mm256_add_epi16(_mm256_maddubs_epi16(w0[r], x0), _mm256_maddubs_epi16(w1[r], x1));
          ia[r][c] = _mm256_add_epi32(ia[r][c], _mm256_madd_epi16(p, ones));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_load_ps(dw + r * gscales + 8 * b);
      const __m256 m = _mm256_load_ps(cw + r * gscales + 8 * b);
      for (int c = 0; c < C; ++c) {
        const float xdb = xd[c][b];
        const __m256 sv = _mm256_mul_ps(d, _mm256_set1_ps(xdb));
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][c]), sv, acc[r][c]);
        if constexpr (OFF == 0)
          acc[r][c] = _mm256_fmadd_ps(m, _mm256_set1_ps(xdb * xs[c][b]), acc[r][c]);
      }
    }
  }
  avx2_store_tile<R, C>(acc, out + m0 * ldo, ldo, cols);
}

// All M activation rows against groups [0, R) of 8 rows, 3 activation rows at a time.
template <int R, int OFF>
inline void avx2_strip(const uint32_t* codes, const float* dw, const float* cw, int64_t gcodes,
                       int64_t gscales, int64_t nsb, const VnniActs& x, int64_t M, float* out,
                       int64_t ldo, int64_t cols) {
  constexpr int C = 3;
  int64_t m = 0;
  for (; m + C <= M; m += C)
    avx2_tile<R, C, OFF>(codes, dw, cw, gcodes, gscales, nsb, x, m, out, ldo, cols);
  if (M - m == 2) avx2_tile<R, 2, OFF>(codes, dw, cw, gcodes, gscales, nsb, x, m, out, ldo, cols);
  if (M - m == 1) avx2_tile<R, 1, OFF>(codes, dw, cw, gcodes, gscales, nsb, x, m, out, ldo, cols);
}

template <int OFF>
inline void avx2_groups(const uint32_t* codes, const float* dw, const float* cw, int64_t gcodes,
                        int64_t gscales, int64_t nsb, const VnniActs& x, int64_t M, float* out,
                        int64_t ldo, int64_t cols) {
  for (int64_t g = 0; 8 * g < cols; g += 2) {  // two groups (16 rows) a pass
    const int64_t left = cols - 8 * g;
    const uint32_t* cg = codes + g * gcodes;
    const float *dg = dw + g * gscales, *mg = cw + g * gscales;
    if (left > 8)
      avx2_strip<2, OFF>(cg, dg, mg, gcodes, gscales, nsb, x, M, out + 8 * g, ldo, left);
    else
      avx2_strip<1, OFF>(cg, dg, mg, gcodes, gscales, nsb, x, M, out + 8 * g, ldo, left);
  }
}

// gemm_q8_strip's AVX2 form: rows j < cols <= 32 of the packed rows at w.
inline void gemm_q8_strip_avx2(const Format& f, const uint8_t* w, int64_t rb, int64_t k,
                               int64_t cols, const VnniActs& x, int64_t M, GemmQ8Scratch& sc,
                               float* out, int64_t ldo) {
  TORCH_CHECK(!avx2_signed(f.fmt), "linear_q: no AVX2 integer GEMM for q8_0 / int8");
  TORCH_CHECK(gemm_scale_block(f.fmt) == 32 && f.fmt != Fmt::q4_k && f.fmt != Fmt::q5_k,
              "linear_q: the K-quants' AVX2 GEMM is gemm_q8_strip_avx2_k");
  const int64_t kw = f.padded(k), nsb = kw / 32;
  const int64_t gcodes = kw / 4 * 8, gscales = nsb * 8;  // per group of 8
  const int64_t groups = (cols + 7) / 8;
  uint32_t* codes = sc.codes.fit<uint32_t>(4 * gcodes);
  float* dw = sc.scales.fit<float>(8 * gscales);
  float* cw = dw + 4 * gscales;
  for (int64_t g = 0; g < groups; ++g)
    gemm_pack_group8(f, w + 8 * g * rb, rb, std::min<int64_t>(8, cols - 8 * g), k,
                     codes + g * gcodes, dw + g * gscales, cw + g * gscales);
  switch (gemm_offset(f.fmt)) {
    case -8:
      return avx2_groups<-8>(codes, dw, cw, gcodes, gscales, nsb, x, M, out, ldo, cols);
    case -16:
      return avx2_groups<-16>(codes, dw, cw, gcodes, gscales, nsb, x, M, out, ldo, cols);
    default:
      return avx2_groups<0>(codes, dw, cw, gcodes, gscales, nsb, x, M, out, ldo, cols);
  }
}
#endif

}  // namespace topg::quant
