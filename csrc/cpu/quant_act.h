// int8 activations (linear_q's int8_activations, llama.cpp's approach): the activation
// rounding (quantize_act) and the GEMV of a packed row against one rounded activation row
// (dot_row_q8). Split from quant_kernels.h, whose fp32-activation dot products it builds on;
// gemm_q8_vnni.h holds the GEMM (M > 16) over the same rounded activations.
//
// dot_rows_q8 (dot_row_q8: one row) has two forms, the same integer products and
// different fp32 summation orders:
//   AVX2           per block maddubs / madd into 8 int32 lanes, one FMA with the block's
//                  scale, the constant term (minimum, -8 offset) summed in scalar code;
//   AVX-512 VNNI   (use_vnni(): q8_0, q4_0, q4_1, int4 with groups of 32, int8) per block
//                  one vpdpbusd, the scales and constant terms of 8 blocks at a time in
//                  vector registers, a range of rows per call.
// The K-quants (q4_k, q5_k, q6_k) have both forms in quant_act_k.h.
// Measured (one thread, weights in L2, [1536, K] rows, cycles a block at 2.6 GHz, AVX2 /
// VNNI): q4_1 3.49 / 2.39 (K = 576), 3.40 / 2.16 (K = 1536); q4_0 3.09 / 2.26, 3.00 / 2.06;
// q8_0 2.66 / 2.31, 2.54 / 2.16. SmolLM2 Q4_1 decode with int8 activations (engine, plan
// phases per step, 2 threads): gate/up 2.2-2.5 -> 1.4-1.6 ms, down 1.0 -> 0.6 ms.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gemv_avx512.h"
#include "quant_act_k.h"
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

// The activations of a row, padded with zeros to a multiple of 32, are quantised per block
// of 32: d = amax / 127, q = round-to-nearest-even(x * (1 / d)) (0 when d = 0), and the
// block's code sum. A block holding NaN or inf gets d = NaN, so its row's results are
// NaN. Model in Python: torch_topg.formats.quantize_activations.

// The formats of the integer GEMM for many rows (gemm_q8_vnni.h: blocks of 32).
inline bool int8_gemm(Fmt f) { return f != Fmt::q4_k && f != Fmt::q5_k && f != Fmt::q6_k; }

// One block of 32, scalar: the definition (and the path of a block holding NaN or inf).
inline void quantize_act_block(const float* xb, int8_t* q, float* d, float* qsum) {
  float amax = 0.f;
  bool finite = true;
  for (int i = 0; i < 32; ++i) {
    finite = finite && std::isfinite(xb[i]);
    amax = std::max(amax, std::fabs(xb[i]));
  }
  const float db = amax / 127.f, id = db != 0.f ? 1.f / db : 0.f;
  int sum = 0;
  for (int i = 0; i < 32; ++i) {
    const int v = finite ? int(std::nearbyint(std::min(127.f, std::max(-127.f, xb[i] * id)))) : 0;
    q[i] = int8_t(v);
    sum += v;
  }
  *d = finite ? db : std::nanf("");
  *qsum = float(sum);
}

// quantize_act_block over kp / 32 blocks. The AVX2 form computes the same floats (the
// same amax, d and 1 / d; x * id clamped, then rounded to nearest even as nearbyint does
// in the default rounding mode), 8 lanes at a time.
inline void quantize_act(const float* x, int64_t kp, int8_t* q, float* d, float* qsum) {
  for (int64_t b = 0; b < kp / 32; ++b) {
    const float* xb = x + 32 * b;
#if TOPG_AVX2
    const __m256 sign = _mm256_set1_ps(-0.f), zero = _mm256_setzero_ps();
    __m256 v[4], amax = zero, bad = zero;
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_mul_ps(v[j], zero), zero, _CMP_NEQ_UQ));
    }
    if (!_mm256_testz_ps(bad, bad)) {  // NaN or inf: the scalar definition
      quantize_act_block(xb, q + 32 * b, d + b, qsum + b);
      continue;
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float db = _mm_cvtss_f32(m4) / 127.f, id = db != 0.f ? 1.f / db : 0.f;
    const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
    __m256i c[4];
    for (int j = 0; j < 4; ++j)
      c[j] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(v[j], vid))));
    // int32 -> int8 in order: packs interleave 128-bit lanes, the permute restores them
    const __m256i p16a = _mm256_packs_epi32(c[0], c[1]), p16b = _mm256_packs_epi32(c[2], c[3]);
    const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b), p8);
    const __m256i s32 =
        _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    d[b] = db;
    qsum[b] = float(_mm_cvtsi128_si32(s4));
#else
    quantize_act_block(xb, q + 32 * b, d + b, qsum + b);
#endif
  }
}

#if TOPG_AVX2
// sum over 32 of w[i] * x[i] as float, w unsigned 0..127 or 0..15 (maddubs takes the
// first operand unsigned), x int8.
inline __m256 udot(__m256i uw, __m256i sx) {
  const __m256i p16 = _mm256_maddubs_epi16(uw, sx);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}
// signed w x signed x: |w| times x with w's sign.
inline __m256 sdot(__m256i w, __m256i x) {
  return udot(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
#endif

#if TOPG_VNNI_BUILT

// The formats of dot_row_q8's VNNI form, by where a block keeps its scale and codes:
enum class VnniRow {
  q8_0,  // 34-byte blocks: fp16 d, 32 signed codes
  q4_0,  // 18-byte blocks: fp16 d, 16 bytes of nibbles (codes - 8)
  q4_1,  // 20-byte blocks: fp16 d, fp16 m, 16 bytes of nibbles (q4_1, int4 with groups of 32)
  q5_0,  // 22-byte blocks: fp16 d, 4 bytes qh (5th bits), 16 bytes of nibbles (codes - 16)
  q5_1,  // 24-byte blocks: fp16 d, fp16 m, qh, 16 bytes of nibbles
  int8,  // the row's fp32 scale, then k signed codes (the last block may be short)
};

template <VnniRow R>
struct VnniLayout {
  static constexpr int64_t bb = R == VnniRow::q8_0   ? 34  // bytes per block
                                : R == VnniRow::q4_0 ? 18
                                : R == VnniRow::q4_1 ? 20
                                : R == VnniRow::q5_0 ? 22
                                : R == VnniRow::q5_1 ? 24
                                                     : 32;
  // where the codes start (q5_0 / q5_1: qh, the nibbles 4 bytes on)
  static constexpr int64_t codes_at = R == VnniRow::q4_1 || R == VnniRow::q5_1 ? 4
                                      : R == VnniRow::int8                     ? 0
                                                                               : 2;
  // d and m in the header (the 4 bytes vnni_scales reads per block)
  static constexpr bool has_min = R == VnniRow::q4_1 || R == VnniRow::q5_1;
};

// Blocks [b0, b0 + 8) of the row's blocks p: their scales d * xd (int8: xd) as 8 lanes, and
// their constant terms c * xd * sum(q) (q4_0, q4_1) added to cterm. The 8 fp16 headers are
// read with scalar loads into one vector (a vpgatherdd was slower: 3.4 against 2.2 cycles
// a block on q4_1 [1536, 1536]).
template <VnniRow R>
TOPG_TARGET_VNNI inline __m256 vnni_scales(const uint8_t* p, int64_t b0, const float* xd,
                                           const float* xsum, __m256& cterm) {
  constexpr int64_t bb = VnniLayout<R>::bb;
  const __m256 xdv = _mm256_loadu_ps(xd + b0);
  if constexpr (R == VnniRow::int8) {
    return xdv;
  } else {
    const __m256 xs = _mm256_loadu_ps(xsum + b0);
    alignas(32) uint32_t hs[8];
    for (int j = 0; j < 8; ++j) std::memcpy(hs + j, p + bb * (b0 + j), 4);
    const __m256i h = _mm256_load_si256(reinterpret_cast<const __m256i*>(hs));
    const __m256 s = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_cvtepi32_epi16(h)), xdv);
    if constexpr (VnniLayout<R>::has_min) {
      const __m256 m = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32(h, 16)));
      cterm = _mm256_fmadd_ps(m, _mm256_mul_ps(xdv, xs), cterm);
    } else if constexpr (R == VnniRow::q4_0 || R == VnniRow::q5_0) {
      const float off = R == VnniRow::q4_0 ? -8.f : -16.f;
      cterm = _mm256_fmadd_ps(s, _mm256_mul_ps(xs, _mm256_set1_ps(off)), cterm);
    } else {
      (void)xs;
    }
    return s;
  }
}

// Block b of the row's blocks p: a += sum(u * q') * sb, sum(u * q') as 8 int32 lanes of 4
// products each (one vpdpbusd: unsigned u times signed q'). The 4-bit formats: u the
// nibbles, q' = q. The signed ones (q8_0, int8): u = |w|, q' = q with w's sign, exact as
// the AVX2 form's maddubs (codes + 128 would need a -128 xd sum(q) term that cancels in
// fp32). k: the int8 format's row length (its last block may be short; no read past it).
template <VnniRow R>
TOPG_TARGET_VNNI inline void vnni_block_dot(const uint8_t* p, int64_t b, int64_t k,
                                            const int8_t* xq, __m256 sb, __m256& a) {
  const uint8_t* q = p + VnniLayout<R>::bb * b + VnniLayout<R>::codes_at;
  __m256i u, x = load32(xq + 32 * b);
  if constexpr (R == VnniRow::q8_0 || R == VnniRow::int8) {
    __m256i sw;
    if constexpr (R == VnniRow::q8_0) {
      sw = load32(q);
    } else {  // the row's last block may be short: no read past it
      const int64_t left = k - 32 * b;
      sw = _mm256_maskz_loadu_epi8(left >= 32 ? ~__mmask32(0) : __mmask32((1u << left) - 1), q);
    }
    u = _mm256_abs_epi8(sw), x = _mm256_sign_epi8(x, sw);
  } else if constexpr (R == VnniRow::q5_0 || R == VnniRow::q5_1) {  // 5th bits from qh's mask
    uint32_t hb;
    std::memcpy(&hb, q, 4);
    const __m256i two =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 4)));
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi64(two, _mm256_setr_epi64x(0, 0, 4, 4)),
                                        _mm256_set1_epi8(0x0F));
    u = _mm256_mask_blend_epi8(__mmask32(hb), lo, _mm256_or_si256(lo, _mm256_set1_epi8(16)));
  } else {  // 16 bytes of nibbles: the low ones are codes 0..15, the high ones 16..31
    const __m256i two =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    u = _mm256_and_si256(_mm256_srlv_epi64(two, _mm256_setr_epi64x(0, 0, 4, 4)),
                         _mm256_set1_epi8(0x0F));
  }
  const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
  a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sb, a);
}

TOPG_TARGET_VNNI inline __m256 vnni_lane(__m256 s, int j) {
  return _mm256_permutexvar_ps(_mm256_set1_epi32(j), s);
}

// sum over the row's blocks of w * x. Per block w = d * u + c (q4_0: u the nibble, c = -8 d;
// q4_1: c = m; q8_0, int8: c = 0) and x = xd * q, so the block's sum is
// d * xd * sum(u * q) + c * xd * sum(q). The scales d * xd and the constant terms are
// computed 8 blocks at a time; the last nb % 8 blocks one at a time. Four accumulators
// (block j of a group of 8 adds to j % 4). The int8 format's row scale multiplies the total.
template <VnniRow R>
TOPG_TARGET_VNNI __attribute__((always_inline)) inline float dot_row_q8_vnni(const uint8_t* row,
                                                                             int64_t k, int64_t nb,
                                                                             const int8_t* xq,
                                                                             const float* xd,
                                                                             const float* xsum) {
  const uint8_t* p = R == VnniRow::int8 ? row + 4 : row;
  const __m256 zero = _mm256_setzero_ps();
  __m256 a0 = zero, a1 = zero, a2 = zero, a3 = zero, cterm = zero;
  int64_t b0 = 0;
  for (; b0 + 8 <= nb; b0 += 8) {
    stream_ahead(p + VnniLayout<R>::bb * b0, 8 * VnniLayout<R>::bb);  // quant_kernels.h
    const __m256 s = vnni_scales<R>(p, b0, xd, xsum, cterm);
    vnni_block_dot<R>(p, b0 + 0, k, xq, vnni_lane(s, 0), a0);
    vnni_block_dot<R>(p, b0 + 1, k, xq, vnni_lane(s, 1), a1);
    vnni_block_dot<R>(p, b0 + 2, k, xq, vnni_lane(s, 2), a2);
    vnni_block_dot<R>(p, b0 + 3, k, xq, vnni_lane(s, 3), a3);
    vnni_block_dot<R>(p, b0 + 4, k, xq, vnni_lane(s, 4), a0);
    vnni_block_dot<R>(p, b0 + 5, k, xq, vnni_lane(s, 5), a1);
    vnni_block_dot<R>(p, b0 + 6, k, xq, vnni_lane(s, 6), a2);
    vnni_block_dot<R>(p, b0 + 7, k, xq, vnni_lane(s, 7), a3);
  }
  float tail = 0.f;  // the last nb % 8 blocks: their scales one at a time
  for (; b0 < nb; ++b0) {
    const uint8_t* h = p + VnniLayout<R>::bb * b0;
    stream_ahead(h, VnniLayout<R>::bb);
    const float d = R == VnniRow::int8 ? 1.f : half_at(h), s = d * xd[b0];
    if constexpr (VnniLayout<R>::has_min) tail += half_at(h + 2) * xd[b0] * xsum[b0];
    if constexpr (R == VnniRow::q4_0) tail += -8.f * s * xsum[b0];
    if constexpr (R == VnniRow::q5_0) tail += -16.f * s * xsum[b0];
    vnni_block_dot<R>(p, b0, k, xq, _mm256_set1_ps(s), a0);
  }
  const float total =
      hsum(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)), cterm)) +
      tail;
  if constexpr (R == VnniRow::int8) {
    float rs;
    std::memcpy(&rs, row, 4);
    return total * rs;
  }
  return total;
}

// out[i] = dot_row_q8_vnni(w + i * rb) for i < n: one call for a range of rows (a call per
// row cost about 20 cycles, a fifth of a 576-long q4_1 row).
template <VnniRow R>
TOPG_TARGET_VNNI void dot_rows_q8_vnni(const uint8_t* w, int64_t rb, int64_t n, int64_t k,
                                       int64_t nb, const int8_t* xq, const float* xd,
                                       const float* xsum, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = dot_row_q8_vnni<R>(w + i * rb, k, nb, xq, xd, xsum);
  }
}
#endif

// The AVX2 form (and the scalar one without AVX2).
inline float dot_row_q8_avx2(const Format& f, const uint8_t* row, int64_t k, const int8_t* xq,
                             const float* xd, const float* xsum) {
  const int64_t nb = f.blocks(k);
#if TOPG_AVX2
  __m256 acc = _mm256_setzero_ps();
  float extra = 0.f;  // the minimum's (or the -8 offset's) share, per block
  switch (f.fmt) {
    case Fmt::q8_0:
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 34 * b;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(half_at(p) * xd[b]),
                              sdot(load32(p + 2), load32(xq + 32 * b)), acc);
      }
      return hsum(acc);
    case Fmt::q4_0:
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 18 * b;
        const float dd = half_at(p) * xd[b];
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dd), udot(unpack16(p + 2), load32(xq + 32 * b)), acc);
        extra -= 8.f * dd * xsum[b];
      }
      return hsum(acc) + extra;
    case Fmt::q4_1:  // int4 with groups of 32 computes the same (the general loop below)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 20 * b;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(half_at(p) * xd[b]),
                              udot(unpack16(p + 4), load32(xq + 32 * b)), acc);
        extra += half_at(p + 2) * xd[b] * xsum[b];
      }
      return hsum(acc) + extra;
    case Fmt::q5_0:
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 22 * b;
        const float dd = half_at(p) * xd[b];
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dd),
                              udot(unpack_q5(p + 2, p + 6), load32(xq + 32 * b)), acc);
        extra -= 16.f * dd * xsum[b];
      }
      return hsum(acc) + extra;
    case Fmt::q5_1:
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 24 * b;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(half_at(p) * xd[b]),
                              udot(unpack_q5(p + 4, p + 8), load32(xq + 32 * b)), acc);
        extra += half_at(p + 2) * xd[b] * xsum[b];
      }
      return hsum(acc) + extra;
    case Fmt::int4: {
      const int64_t g = f.block, bb = f.block_bytes, sub = g / 32;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + bb * b;
        const float dw = half_at(p), mw = half_at(p + 2);
        const int64_t x0 = b * sub;  // first activation block of the group
        if (g == 32) {
          acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[x0]),
                                udot(unpack16(p + 4), load32(xq + 32 * x0)), acc);
          extra += mw * xd[x0] * xsum[x0];
          continue;
        }
        const int64_t half = sub / 2;  // runs of 32 bytes: low nibbles block c, high c + half
        for (int64_t c = 0; c < half; ++c) {
          __m256i lo, hi;
          unpack32(p + 4 + 32 * c, lo, hi);
          const int64_t bl = x0 + c, bh = x0 + half + c;
          acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[bl]), udot(lo, load32(xq + 32 * bl)), acc);
          acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[bh]), udot(hi, load32(xq + 32 * bh)), acc);
        }
        for (int64_t c = 0; c < sub; ++c) extra += mw * xd[x0 + c] * xsum[x0 + c];
      }
      return hsum(acc) + extra;
    }
    case Fmt::int8: {
      float s;
      std::memcpy(&s, row, 4);
      const uint8_t* q = row + 4;
      const int64_t full = k / 32;
      for (int64_t b = 0; b < full; ++b)
        acc = _mm256_fmadd_ps(_mm256_set1_ps(xd[b]), sdot(load32(q + 32 * b), load32(xq + 32 * b)),
                              acc);
      if (k % 32) {  // the row ends inside this block: no read past it
        alignas(32) uint8_t tail[32] = {};
        std::memcpy(tail, q + 32 * full, size_t(k % 32));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(xd[full]), sdot(load32(tail), load32(xq + 32 * full)),
                              acc);
      }
      return hsum(acc) * s;
    }
    case Fmt::q4_k:
    case Fmt::q5_k:
    case Fmt::q6_k:
      return dot_row_q8_k_avx2(f.fmt, row, nb, xq, xd, xsum);
    default:
      break;
  }
#endif
  // Without AVX2: de-quantise the activations.
  (void)nb;
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
    (void)xsum;
    for (int64_t i = 0; i < f.block; ++i) total += w[i] * x[i];
  }
  return total;
}

// Weight rows per dot_rows_q8 call in the GEMVs (linear_q, the decode plan): their bytes
// (16 x 360 for a 576-long q4_1 row) stay in L1 while each activation row passes.
inline constexpr int64_t kQ8Rows = 16;

// out[i] = sum over row i's k weights of w * x for the n packed rows at w (rb bytes
// apart), x given as int8 blocks (q, d, qsum per 32).
inline void dot_rows_q8(const Format& f, const uint8_t* w, int64_t rb, int64_t n, int64_t k,
                        const int8_t* xq, const float* xd, const float* xsum, float* out) {
#if TOPG_VNNI_BUILT
  if (use_vnni()) {
    const int64_t nb = f.blocks(k);
    switch (f.fmt) {
      case Fmt::q8_0:
        return dot_rows_q8_vnni<VnniRow::q8_0>(w, rb, n, k, nb, xq, xd, xsum, out);
      case Fmt::q4_0:
        return dot_rows_q8_vnni<VnniRow::q4_0>(w, rb, n, k, nb, xq, xd, xsum, out);
      case Fmt::q4_1:
        return dot_rows_q8_vnni<VnniRow::q4_1>(w, rb, n, k, nb, xq, xd, xsum, out);
      case Fmt::q5_0:
        return dot_rows_q8_vnni<VnniRow::q5_0>(w, rb, n, k, nb, xq, xd, xsum, out);
      case Fmt::q5_1:
        return dot_rows_q8_vnni<VnniRow::q5_1>(w, rb, n, k, nb, xq, xd, xsum, out);
      case Fmt::int4:
        if (f.block == 32)
          return dot_rows_q8_vnni<VnniRow::q4_1>(w, rb, n, k, nb, xq, xd, xsum, out);
        break;  // larger groups: the AVX2 form
      case Fmt::int8:
        return dot_rows_q8_vnni<VnniRow::int8>(w, rb, n, k, (k + 31) / 32, xq, xd, xsum, out);
      case Fmt::q4_k:
        return dot_rows_q8_k_vnni<Fmt::q4_k>(w, rb, n, nb, xq, xd, xsum, out);
      case Fmt::q5_k:
        return dot_rows_q8_k_vnni<Fmt::q5_k>(w, rb, n, nb, xq, xd, xsum, out);
      case Fmt::q6_k:
        return dot_rows_q8_k_vnni<Fmt::q6_k>(w, rb, n, nb, xq, xd, xsum, out);
      default:
        break;
    }
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    prefetch_ahead(w + i * rb, rb);
    out[i] = dot_row_q8_avx2(f, w + i * rb, k, xq, xd, xsum);
  }
}

// The int8-activation GEMV of linear_q and the decode plan: emit(m, n, sum) for weight rows
// [n0, n1) of w against activation rows m < M (row m's blocks at xq + m * kp, its scales
// and code sums at xd / xsum + m * kp / 32), kQ8Rows weight rows at a time.
template <typename Emit>
inline void gemv_q8(const Format& f, const uint8_t* w, int64_t rb, int64_t n0, int64_t n1,
                    int64_t k, const int8_t* xq, const float* xd, const float* xsum, int64_t kp,
                    int64_t M, Emit&& emit) {
  float sums[kQ8Rows];
  for (int64_t n = n0; n < n1; n += kQ8Rows) {
    const int64_t c = std::min(kQ8Rows, n1 - n);
    for (int64_t m = 0; m < M; ++m) {
      dot_rows_q8(f, w + n * rb, rb, c, k, xq + m * kp, xd + m * kp / 32, xsum + m * kp / 32, sums);
      for (int64_t i = 0; i < c; ++i) emit(m, n + i, sums[i]);
    }
  }
}

// One row: dot_rows_q8 with n = 1.
inline float dot_row_q8(const Format& f, const uint8_t* row, int64_t k, const int8_t* xq,
                        const float* xd, const float* xsum) {
  float out;
  dot_rows_q8(f, row, f.row_bytes(k), 1, k, xq, xd, xsum, &out);
  return out;
}

}  // namespace topg::quant
