// The paged attention kernel's two dot products on bf16 caches with AVX-512 BF16
// (vdpbf16ps), chosen at run time like the bf16 GEMV (gemv_bf16dp.h; TOPG_DISABLE_AVX512=1
// turns both off), for head dims that are a multiple of 32.
//
// The AVX2 path (paged_kernels.h) widens every bf16 K / V element to fp32 before its FMA:
// at batch 8 (SmolLM2, 320 keys, 30 layers) it read a bf16 cache at 17 GB/s, an fp32 one at
// 28: the widening, not the reads, set the pace. vdpbf16ps multiplies 32 bf16 pairs and
// adds them to 16 fp32 sums in one instruction.
//   - Q . K: the query stays in bf16 (it is stored so), unscaled; the scale multiplies the
//     finished dot. 16 keys of one head at a time, one accumulator each, reduced to their
//     16 scores together (reduce16).
//   - P . V: pairs of keys. The two V rows are interleaved word by word (unpacklo / hi),
//     so one vdpbf16ps adds p_t v_t[e] + p_t+1 v_t+1[e] to lane e; the weights are rounded
//     to bf16, as the bf16 matmul after a softmax does (PyTorch's SDPA math path casts the
//     fp32 softmax to bf16). The interleaving permutes the lanes within each 32 dims; the
//     accumulators stay permuted until the partition ends (unpermute_pairs).
// Prefetch: a tile's rows are prefetched as the tile starts, one tile (16 keys) ahead.
// Measured 2026-12-02 (SmolLM2 heads 9 / 3, d 64, 8 sequences x 320 keys, 30 layers'
// caches, 2 threads, ms for the 30 calls): the AVX2 path 3.2-5.3 (15-17 GB/s, noisy VM);
// this path with the AVX2 path's 12 KiB prefetch distance 2.6-3.1, with 1.5-4.5 KiB
// 3.8-5.1, 6 KiB (one tile) 2.1-2.5 (24-28 GB/s), 7.5-9 KiB 2.7-3.2, 48 KiB 3.9-4.1.
// Caches warm (2 layers): AVX2 0.22-0.25 ms, this path 0.10-0.12.
// A row's scores and sums still depend only on its own keys and the partition's start:
// the batch invariance of paged_kernels.h holds (pairs start at the partition start; a
// key a row does not see weighs 0, and a missing partner row reads as zeros).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gemv_bf16dp.h"
#include "vec.h"

namespace topg::paged {

// The bf16 dot path for a cache of head dim d, both query and cache bf16.
inline bool use_attention_bf16dp(int64_t d) {
  return gemm::use_bf16dp() && d % 32 == 0 && d <= 256;
}

#if TOPG_BF16DP

// s[j] = scale * (q . k_j) for the n <= 16 keys at kc + rows[j] (DC * 32 bf16 each).
// pf: per key, a row start to prefetch (DC * 64 bytes from pf_off), or null.
template <int DC>
TOPG_TARGET_BF16DP inline void qk16_bf16dp(const bf16* q, const bf16* kc, const int64_t* rows,
                                           int64_t n, float scale, float* s, const char* const* pf,
                                           int64_t pf_off) {
  if (pf)
    for (int64_t j = 0; j < n; ++j)
      if (pf[j])
        for (int c = 0; c < DC; ++c) _mm_prefetch(pf[j] + pf_off + 64 * c, _MM_HINT_T0);
  __m512bh qv[DC];
  for (int c = 0; c < DC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {  // keys past n repeat the last one (their lanes are not stored)
    const bf16* k = kc + rows[j < n ? j : n - 1];
    acc[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(k));
    for (int c = 1; c < DC; ++c)
      acc[j] = _mm512_dpbf16_ps(acc[j], qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
  }
  const __m512 r = _mm512_mul_ps(gemm::reduce16(acc), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(s, __mmask16((1u << n) - 1), r);
}

// qk16_bf16dp for a head dim d (a multiple of 32, at most 256).
inline void qk16_bf16dp(const bf16* q, const bf16* kc, const int64_t* rows, int64_t n, int64_t d,
                        float scale, float* s, const char* const* pf, int64_t pf_off) {
  gemm::with_rows<8>(int(d / 32),
                     [&]<int DC>() { qk16_bf16dp<DC>(q, kc, rows, n, scale, s, pf, pf_off); });
}

// acc[g][..] += sum_t p[g, t] v_t for HG heads over n <= TOKEN_TILE keys at vc + rows[t]:
// w[g * 8 + i] holds head g's weights of keys 2i and 2i + 1 as a bf16 pair (low, high).
// acc rows (stride as) hold each 32 dims in pair order (see unpermute_pairs). NC: 32-dim
// chunks per strip (HG * NC * 2 accumulators).
template <int HG, int NC>
TOPG_TARGET_BF16DP inline void pv_strip_bf16dp(const uint32_t* w, const bf16* vc,
                                               const int64_t* rows, int64_t n, int64_t e,
                                               float* acc, int64_t as) {
  __m512 a[HG][NC][2];
  for (int g = 0; g < HG; ++g)
    for (int c = 0; c < NC; ++c)
      for (int h = 0; h < 2; ++h) a[g][c][h] = _mm512_loadu_ps(acc + g * as + e + 32 * c + 16 * h);
  for (int64_t t = 0; t < n; t += 2) {
    const bf16* v0 = vc + rows[t] + e;
    const bf16* v1 = t + 1 < n ? vc + rows[t + 1] + e : nullptr;
    __m512i lo[NC], hi[NC];
    for (int c = 0; c < NC; ++c) {
      const __m512i x = _mm512_loadu_si512(v0 + 32 * c);
      const __m512i y = v1 ? _mm512_loadu_si512(v1 + 32 * c) : _mm512_setzero_si512();
      lo[c] = _mm512_unpacklo_epi16(x, y);
      hi[c] = _mm512_unpackhi_epi16(x, y);
    }
    for (int g = 0; g < HG; ++g) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(int(w[g * 8 + t / 2]));
      for (int c = 0; c < NC; ++c) {
        a[g][c][0] = _mm512_dpbf16_ps(a[g][c][0], p, (__m512bh)lo[c]);
        a[g][c][1] = _mm512_dpbf16_ps(a[g][c][1], p, (__m512bh)hi[c]);
      }
    }
  }
  for (int g = 0; g < HG; ++g)
    for (int c = 0; c < NC; ++c)
      for (int h = 0; h < 2; ++h) _mm512_storeu_ps(acc + g * as + e + 32 * c + 16 * h, a[g][c][h]);
}

// All d dims (a multiple of 32) in strips of 64 (32 for the last odd chunk). pf: per key,
// a V row start to prefetch (d * 2 bytes from pf_off), or null.
template <int HG>
TOPG_TARGET_BF16DP inline void pv_bf16dp(const uint32_t* w, const bf16* vc, const int64_t* rows,
                                         int64_t n, int64_t d, float* acc, int64_t as,
                                         const char* const* pf, int64_t pf_off) {
  if (pf)
    for (int64_t t = 0; t < n; ++t)
      if (pf[t])
        for (int64_t o = 0; o < d * 2; o += 64) _mm_prefetch(pf[t] + pf_off + o, _MM_HINT_T0);
  constexpr int NC = HG == 4 ? 1 : 2;  // at most 16 accumulators
  int64_t e = 0;
  for (; e + 32 * NC <= d; e += 32 * NC) pv_strip_bf16dp<HG, NC>(w, vc, rows, n, e, acc, as);
  for (; e < d; e += 32) pv_strip_bf16dp<HG, 1>(w, vc, rows, n, e, acc, as);
}

// Rows of d dims (a multiple of 32) accumulated in pair order -> dims in order, in place.
// In pair order, 32 dims are two vectors: lo holds dims {0-3, 8-11, 16-19, 24-27} by
// 128-bit lane, hi {4-7, 12-15, 20-23, 28-31} (unpacklo / unpackhi of words).
TOPG_TARGET_BF16DP inline void unpermute_pairs(float* acc, int64_t d) {
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t e = 0; e < d; e += 32) {
    const __m512 lo = _mm512_loadu_ps(acc + e), hi = _mm512_loadu_ps(acc + e + 16);
    _mm512_storeu_ps(acc + e, _mm512_permutex2var_ps(lo, i0, hi));
    _mm512_storeu_ps(acc + e + 16, _mm512_permutex2var_ps(lo, i1, hi));
  }
}

// w[g * 8 + i] = (bf16(s_g[2i]), bf16(s_g[2i + 1])) for keys [0, n) of HG score rows
// s_g = s + g * ps, n <= 16 (a key past n weighs 0); rounded to nearest even.
template <int HG>
TOPG_TARGET_BF16DP inline void pair_weights(const float* s, int64_t ps, int64_t n, uint32_t* w) {
  const __mmask16 m = __mmask16((1u << n) - 1);
  for (int g = 0; g < HG; ++g)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + g * 8),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, s + g * ps)));
}

#endif  // TOPG_BF16DP

}  // namespace topg::paged
