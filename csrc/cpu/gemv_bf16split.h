// bf16 dot path for CPUs with AVX-512F but without AVX-512 BF16 (Skylake-X, Cascade Lake,
// Ice Lake), chosen at run time; the library itself is built for x86-64-v3.
//
// Without vdpbf16ps, a bf16 weight must become fp32 before its FMA. The AVX2 path
// (gemm_kernels.h dot_block) widens the weights into 8 lanes (two unpacks per 16) and runs
// 3 A rows a pass in 16 ymm registers: at 16 A rows (a decode step
// of 16 streams) it is bound by the arithmetic at half the zmm rate, with the weights
// widened again in each of the 6 passes. Here a 64-byte load of 32 bf16 weights gives
// two fp32 vectors with one instruction each: the even-indexed weights (w << 16 in each
// 32-bit lane) and the odd-indexed ones (w & 0xffff0000). The A rows are split the same
// way once per call (split_a_rows: per 32 values, the 16 even ones then the 16 odd ones, in
// fp32), so an A vector is an FMA's memory operand. Per 32 values of K, a (weight row, A
// row) pair takes two FMAs into one 16-lane accumulator: lane l holds the products of
// k = 32 s + 2 l and 32 s + 2 l + 1, s in order. The last partial 32 are masked (zero
// weights against the split rows' zero padding). The lanes are summed in gemv_bf16dp.h's
// tree (reduce16), so a pair's sum takes the same operations in every tile shape: a row's
// result does not depend on the rows beside it, nor on M (the engine's exactness tests
// rely on that: a verify step of k + 1 rows gives the one-row step's logits).
//
// Tiles: 4 weight rows x up to 4 A rows (16 accumulators, the 8 split weight vectors, the
// A vectors from L1 as memory operands): 32 FMAs and 8 integer ops per 4 x 32 weights.
// The first A pass over a group prefetches 32 KiB of rows ahead (4-8 rows, T0).
// TOPG_DISABLE_AVX512=1 turns it off (the AVX2 path); CPUs with AVX-512 BF16 take
// gemv_bf16dp.h's form unless TOPG_DISABLE_AVX512_BF16=1 (how they test this one).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

#include "gemv_avx512.h"
#include "gemv_bf16dp.h"
#include "vec.h"

namespace topg::gemm {

// use_avx512() and not use_bf16dp() (no AVX-512 BF16, or TOPG_DISABLE_AVX512_BF16=1).
inline bool use_bf16split() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool on = use_avx512() && !use_bf16dp();
  return on;
#else
  return false;
#endif
}

#if TOPG_F32X16
// The length of a split A row: K rounded up to 32.
inline int64_t split_k(int64_t K) { return (K + 31) / 32 * 32; }

// The split copy of M fp32 A rows (exact bf16 values): row m at as + m * split_k(K), per
// 32 values the 16 even-indexed ones, then the 16 odd-indexed ones, the last partial 32
// zero-padded. The rows come in the dot path's layout (gemm_kernels.h dot_a_row<bf16>,
// positions permuted within 16s): value k of a row is at pos(k); in a whole block of 32,
// value k0 + j at k0 + perm[j] (the same for every whole block).

template <typename Pos>
TOPG_TARGET_F32X16 inline void split_a_rows(const float* const* a, int64_t M, int64_t K,
                                            const int32_t* perm, Pos&& pos, float* as) {
  alignas(64) int32_t ie[16], io[16];
  for (int l = 0; l < 16; ++l) ie[l] = perm[2 * l], io[l] = perm[2 * l + 1];
  const __m512i even = _mm512_load_si512(ie), odd = _mm512_load_si512(io);
  const int64_t kp = split_k(K), kw = K / 32 * 32;
  for (int64_t m = 0; m < M; ++m) {
    float* o = as + m * kp;
    for (int64_t k = 0; k < kw; k += 32) {
      const __m512 lo = _mm512_loadu_ps(a[m] + k), hi = _mm512_loadu_ps(a[m] + k + 16);
      _mm512_storeu_ps(o + k, _mm512_permutex2var_ps(lo, even, hi));
      _mm512_storeu_ps(o + k + 16, _mm512_permutex2var_ps(lo, odd, hi));
    }
    if (kw == kp) continue;
    std::fill(o + kw, o + kp, 0.f);
    for (int64_t k = kw; k < K; ++k) o[kw + (k - kw) / 2 + 16 * ((k - kw) % 2)] = a[m][pos(k)];
  }
}

// Of 32 bf16 in v (two to a 32-bit lane), the even-indexed ones as fp32 (v << 16) and the
// odd-indexed ones (v & 0xffff0000). (Returned by value: with a helper writing through
// references, or a load masked with all ones in the loop, GCC stored the tile's 16
// accumulators to the stack in every step, at half the rate.)
TOPG_TARGET_F32X16 __attribute__((always_inline)) inline __m512 bf16_even(__m512i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
TOPG_TARGET_F32X16 __attribute__((always_inline)) inline __m512 bf16_odd(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u))));
}

// acc[r * 4 + i] += the products of the split A row i at a (rows kp apart) and the split
// weight vectors (we[r], wo[r]) of one step of 32 values: the even half, then the odd.
template <int G, int RA>
TOPG_TARGET_F32X16 __attribute__((always_inline)) inline void split_fmas(const float* a, int64_t kp,
                                                                         const __m512 (&we)[G],
                                                                         const __m512 (&wo)[G],
                                                                         __m512 (&acc)[16]) {
  for (int i = 0; i < RA; ++i) {
    const __m512 ae = _mm512_loadu_ps(a + i * kp), ao = _mm512_loadu_ps(a + i * kp + 16);
    for (int r = 0; r < G; ++r) {
      acc[r * 4 + i] = _mm512_fmadd_ps(ae, we[r], acc[r * 4 + i]);
      acc[r * 4 + i] = _mm512_fmadd_ps(ao, wo[r], acc[r * 4 + i]);
    }
  }
}

// s[r * 4 + i] = a_i . w_r for G <= 4 weight rows w_r = w + r * ldw and RA <= 4 split A
// rows (as + i * kp), each sum in the order above. pf: G rows to prefetch (T0) meanwhile,
// one line per 32 weights of each, or nullptr.
template <int G, int RA>
TOPG_TARGET_F32X16 inline void split_tile(const float* as, int64_t kp, const bf16* w, int64_t ldw,
                                          const bf16* pf, int64_t K, float* s) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  // The loop and the tail apart, as in dp_tile (one masked body kept acc in memory).
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512 we[G], wo[G];
    for (int r = 0; r < G; ++r) {
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + r * ldw + k), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(w + r * ldw + k);
      we[r] = bf16_even(v), wo[r] = bf16_odd(v);
    }
    split_fmas<G, RA>(as + k, kp, we, wo, acc);
  }
  if (k < K) {
    const __mmask32 mask = __mmask32((1u << (K - k)) - 1);
    __m512 we[G], wo[G];
    for (int r = 0; r < G; ++r) {
      const __m512i v = _mm512_maskz_loadu_epi16(mask, w + r * ldw + k);
      we[r] = bf16_even(v), wo[r] = bf16_odd(v);
    }
    split_fmas<G, RA>(as + k, kp, we, wo, acc);
  }
  _mm512_storeu_ps(s, reduce16(acc));
}

// The rows ahead that the first pass prefetches: 32 KiB of rows, 4 to 8 of them. A fixed 8
// (128 KiB ahead at K = 8,192, into L1) read the 1B BF16 file's [2048, 8192] down projection
// at one row 8% slower than the AVX2 form; the 1B BF16 decode step, alternated processes
// (Ice Lake-class Xeon, 2026-12-07): AVX2 form 92.4-96.0 ms, this 93.4-95.3 (8 rows ahead:
// 96.5-97.4; T1 hints or 8 weight rows side by side for one A row: slower still).
constexpr int64_t kBf16SplitPrefetchRows = 8;
constexpr int64_t kBf16SplitAheadBytes = 32 << 10;

// For weight rows [n0, n1) of W ([N, K] bf16, row stride ldw) and M A rows split at as
// (split_a_rows): emit(m, n, sum) for every pair; groups of 4 weight rows against up to 4
// A rows a pass, the first pass prefetching the rows 4-8 ahead (kBf16SplitAheadBytes).
// (K in chunks whose A rows stay in L1, the tiles' sums parked in memory between chunks,
// was slower at 16 rows: 50 against 66 GFLOP/s, one thread, [256, 2048]: the parked
// tiles kept their accumulators on the stack.)
template <typename Emit>
TOPG_TARGET_F32X16 void dot_rows_bf16split(const float* as, int64_t M, const bf16* w, int64_t ldw,
                                           int64_t K, int64_t n0, int64_t n1, Emit&& emit) {
  const int64_t kp = split_k(K);
  const int64_t ahead =
      std::clamp<int64_t>(kBf16SplitAheadBytes / (K * 2), 4, kBf16SplitPrefetchRows);
  float s[16];
  for (int64_t n = n0; n < n1; n += 4) {
    const int g = int(std::min<int64_t>(4, n1 - n));
    const bf16* rows = w + n * ldw;
    const bf16* pf = n + ahead + 4 <= n1 ? rows + ahead * ldw : nullptr;
    for (int64_t m = 0; m < M; m += 4) {
      const int ra = int(std::min<int64_t>(4, M - m));
      with_rows<4>(g, [&]<int G>() {
        with_rows<4>(ra, [&]<int RA>() {
          split_tile<G, RA>(as + m * kp, kp, rows, ldw, m == 0 ? pf : nullptr, K, s);
          for (int r = 0; r < G; ++r)
            for (int i = 0; i < RA; ++i) emit(m + i, n + r, s[r * 4 + i]);
        });
      });
    }
  }
}
#endif

}  // namespace topg::gemm
