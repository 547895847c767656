// The AVX-512 VNNI form of the int8-activation GEMV (quant_act.h) for q8_0, q4_0, q4_1
// (and int4 with groups of 32), q5_0, q5_1 and int8: per block one vpdpbusd, the scales
// and constant terms of 8 blocks at a time in vector registers, a range of weight rows per
// call. Multi-row: a block's codes are unpacked and 8 blocks' scales converted once for
// MR activation rows (Q8Acts), each row with its own accumulators, summed as a one-row
// call sums them (MR = 1 is the same code).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "quant_act_blocks.h"
#include "quant_act_k.h"
#include "quant_kernels.h"

namespace topg::quant {

#if TOPG_VNNI_BUILT

// Blocks [b0, b0 + 8) of the row's blocks p: their weight scales d and minimums m as 8
// lanes (int8: none). The 8 fp16 headers are read with scalar loads into one vector (a
// vpgatherdd was slower: 3.4 against 2.2 cycles a block on q4_1 [1536, 1536]).
template <Row32 R>
TOPG_TARGET_VNNI inline void vnni_head(const uint8_t* p, int64_t b0, __m256& d, __m256& m) {
  if constexpr (R != Row32::int8) {
    constexpr int64_t bb = Row32Layout<R>::bb;
    alignas(32) uint32_t hs[8];
    for (int j = 0; j < 8; ++j) std::memcpy(hs + j, p + bb * (b0 + j), 4);
    const __m256i h = _mm256_load_si256(reinterpret_cast<const __m256i*>(hs));
    d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(h));
    if constexpr (Row32Layout<R>::has_min)
      m = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(h, 16)));
  }
}

// Block b of the row's blocks p as vpdpbusd's unsigned operand u. The 4- and 5-bit formats:
// u the codes. The signed ones (q8_0, int8): u = |w| and sw = w, whose sign the
// activations take (exact as the AVX2 form's maddubs; codes + 128 would need a -128 xd
// sum(q) term that cancels in fp32). k: the int8 format's row length (its last block may
// be short; no read past it).
template <Row32 R>
TOPG_TARGET_VNNI inline __m256i vnni_codes(const uint8_t* p, int64_t b, int64_t k, __m256i& sw) {
  const uint8_t* q = p + Row32Layout<R>::bb * b + Row32Layout<R>::codes_at;
  if constexpr (Row32Layout<R>::is_signed) {
    if constexpr (R == Row32::q8_0) {
      sw = load32(q);
    } else {  // the row's last block may be short: no read past it
      const int64_t left = k - 32 * b;
      sw = _mm256_maskz_loadu_epi8(left >= 32 ? ~__mmask32(0) : __mmask32((1u << left) - 1), q);
    }
    return _mm256_abs_epi8(sw);
  } else if constexpr (R == Row32::q5_0 || R == Row32::q5_1) {  // 5th bits from qh's mask
    uint32_t hb;
    std::memcpy(&hb, q, 4);
    const __m256i two =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 4)));
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi64(two, _mm256_setr_epi64x(0, 0, 4, 4)),
                                        _mm256_set1_epi8(0x0F));
    return _mm256_mask_blend_epi8(__mmask32(hb), lo, _mm256_or_si256(lo, _mm256_set1_epi8(16)));
  } else {  // 16 bytes of nibbles: the low ones are codes 0..15, the high ones 16..31
    const __m256i two =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    return _mm256_and_si256(_mm256_srlv_epi64(two, _mm256_setr_epi64x(0, 0, 4, 4)),
                            _mm256_set1_epi8(0x0F));
  }
}

// a += sum(u * q') * sb for block b of one activation row's codes xq: sum(u * q') as 8
// int32 lanes of 4 products each (one vpdpbusd: unsigned u times signed q'; q' = q, or q
// with w's sign for the signed formats).
template <Row32 R>
TOPG_TARGET_VNNI inline void vnni_dot(__m256i u, __m256i sw, const int8_t* xq, int64_t b, __m256 sb,
                                      __m256& a) {
  __m256i x = load32(xq + 32 * b);
  if constexpr (Row32Layout<R>::is_signed) x = _mm256_sign_epi8(x, sw);
  const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
  a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sb, a);
}

// q8_0 blocks [b0, b0 + 8) two at a time in a zmm (their codes are 34 bytes apart: two
// loads and an insert), z[j / 2][r] += sum(u * q') * sb per lane: lanes 0-7 block j,
// 8-15 block j + 1. w's sign goes to the activations with a masked negation (AVX-512 has
// no vpsignb for a zmm; the same as vpsignb for every code the activations hold). Half
// the vector uops a block of the ymm form (vnni_dot): [11008, 2048] GEMVs, 2 threads,
// weights in huge pages, 1.235 -> 1.159 ms (2026-12-06, Intel Xeon VM; the reads, not the
// arithmetic, bound it: see stream_ahead).
template <int MR>
TOPG_TARGET_VNNI __attribute__((always_inline)) inline void vnni_pairs_q8_0(
    const uint8_t* p, int64_t b0, const Q8Acts& x, const float (*sa)[8], __m512 (*z)[MR]) {
#pragma GCC unroll 4
  for (int j = 0; j < 8; j += 2) {
    const uint8_t* q0 = p + 34 * (b0 + j) + 2;
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(load32(q0)), load32(q0 + 34), 1);
    const __m512i u = _mm512_abs_epi8(w);
    const __mmask64 neg = _mm512_movepi8_mask(w);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      __m512i xv = _mm512_loadu_si512(x.q[r] + 32 * (b0 + j));
      xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xv);
      const __m512 sb = _mm512_mask_broadcastss_ps(_mm512_set1_ps(sa[r][j]), __mmask16(0xFF00),
                                                   _mm_load_ss(&sa[r][j + 1]));
      z[j / 2][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sb, z[j / 2][r]);
    }
  }
}

// out[r * ldo] = sum over the row's blocks of w * x_r, activation rows r < MR. Per block
// w = d * u + c (q4_0: u the nibble, c = -8 d; q4_1: c = m; q8_0, int8: c = 0) and
// x = xd * q, so the block's sum is d * xd * sum(u * q) + c * xd * sum(q). The scales
// d * xd and the constant terms are computed 8 blocks at a time; the last nb % 8 blocks
// one at a time. Four accumulators per activation row (block j of a group of 8 adds to
// j % 4). The int8 format's row scale multiplies the total.
template <Row32 R, int MR>
TOPG_TARGET_VNNI __attribute__((always_inline)) inline void dot_row_q8_vnni(
    const uint8_t* row, int64_t k, int64_t nb, const Q8Acts& x, float* out, int64_t ldo) {
  const uint8_t* p = R == Row32::int8 ? row + 4 : row;
  const __m256 zero = _mm256_setzero_ps();
  __m256 a[4][MR], cterm[MR];
  __m512 z[4][MR];  // q8_0: two blocks a zmm (vnni_pairs_q8_0)
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    a[0][r] = a[1][r] = a[2][r] = a[3][r] = cterm[r] = zero;
    z[0][r] = z[1][r] = z[2][r] = z[3][r] = _mm512_setzero_ps();
  }
  int64_t b0 = 0;
  for (; b0 + 8 <= nb; b0 += 8) {
    stream_ahead<Ahead::l2>(p + Row32Layout<R>::bb * b0,
                            8 * Row32Layout<R>::bb);  // quant_kernels.h
    // the 8 blocks' scales of each activation row, kept in memory: each block's FMA takes
    // its scale as a broadcast load (a lane permute per block and row is a port-5 uop)
    alignas(32) float sa[MR][8];
    __m256 d = zero, m = zero;
    vnni_head<R>(p, b0, d, m);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
      _mm256_store_ps(sa[r], block8_scales<R>(d, m, b0, x.d[r], x.s[r], cterm[r]));
    // GCC otherwise forwards the stores and broadcasts from registers (port-5 shuffles)
    asm("" : "+m"(sa));
    if constexpr (R == Row32::q8_0) {
      vnni_pairs_q8_0<MR>(p, b0, x, sa, z);
    } else {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m256i sw = _mm256_setzero_si256();
        const __m256i u = vnni_codes<R>(p, b0 + j, k, sw);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
          vnni_dot<R>(u, sw, x.q[r], b0 + j, _mm256_set1_ps(sa[r][j]), a[j % 4][r]);
      }
    }
  }
  float tail[MR];  // the last nb % 8 blocks: their scales one at a time
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) tail[r] = 0.f;
  for (; b0 < nb; ++b0) {
    const uint8_t* h = p + Row32Layout<R>::bb * b0;
    stream_ahead<Ahead::l2>(h, Row32Layout<R>::bb);
    const float d = R == Row32::int8 ? 1.f : half_at(h);
    const float m = Row32Layout<R>::has_min ? half_at(h + 2) : 0.f;
    __m256i sw = _mm256_setzero_si256();
    const __m256i u = vnni_codes<R>(p, b0, k, sw);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const float xd = x.d[r][b0], xs = x.s[r][b0], s = d * xd;
      // explicit fma: the same rounding however GCC vectorises the rows (quant_act_avx2.h)
      if constexpr (Row32Layout<R>::has_min) tail[r] = std::fma(m * xd, xs, tail[r]);
      if constexpr (Row32Layout<R>::off != 0.f)  // q4_0, q5_0
        tail[r] = std::fma(-Row32Layout<R>::off * s, xs, tail[r]);
      vnni_dot<R>(u, sw, x.q[r], b0, _mm256_set1_ps(s), a[0][r]);
    }
  }
  float rs = 1.f;
  if constexpr (R == Row32::int8) std::memcpy(&rs, row, 4);
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    __m256 sum = _mm256_add_ps(_mm256_add_ps(a[0][r], a[1][r]), _mm256_add_ps(a[2][r], a[3][r]));
    if constexpr (R == Row32::q8_0) {
      const __m512 zz =
          _mm512_add_ps(_mm512_add_ps(z[0][r], z[1][r]), _mm512_add_ps(z[2][r], z[3][r]));
      sum = _mm256_add_ps(sum,
                          _mm256_add_ps(_mm512_castps512_ps256(zz), _mm512_extractf32x8_ps(zz, 1)));
    }
    const float total = hsum(_mm256_add_ps(sum, cterm[r])) + tail[r];
    out[r * ldo] = R == Row32::int8 ? total * rs : total;
  }
}

// out[r * ldo + i] = dot_row_q8_vnni(w + i * rb) for weight rows i < n: one call for a
// range of rows (a call per row cost about 20 cycles, a fifth of a 576-long q4_1 row).
template <Row32 R, int MR>
TOPG_TARGET_VNNI void dot_rows_q8_vnni(const uint8_t* w, int64_t rb, int64_t n, int64_t k,
                                       int64_t nb, const Q8Acts& x, float* out, int64_t ldo) {
  for (int64_t i = 0; i < n; ++i) dot_row_q8_vnni<R, MR>(w + i * rb, k, nb, x, out + i, ldo);
}
#endif

}  // namespace topg::quant
