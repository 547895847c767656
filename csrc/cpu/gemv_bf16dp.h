// bf16 dot path with AVX-512 BF16 (vdpbf16ps), for CPUs that have it (Zen 4, Sapphire
// Rapids and later), chosen at run time; the library itself is built for x86-64-v3.
//
// The AVX2 dot path (gemm_kernels.h) widens each bf16 weight to fp32 before its FMA:
// two shuffles and two FMAs per 16 weights, which on Zen 4 reads bf16 weights at
// ~19 GB/s on 2 cores against ~27 GB/s for fp32 (the same kernel; SmolLM2 shapes,
// weights cold). vdpbf16ps takes 32 bf16 weights and 32 bf16 activations per
// instruction and adds their pairwise products to 16 fp32 sums: one load and one
// instruction per 64 bytes of weights. Used only when the activations are bf16 (the
// products are then exact in fp32, as in the AVX2 path); the sums run in another order
// and the instruction flushes denormals, so results differ from the AVX2 path within
// bf16 rounding. Every caller of a given shape takes the same path, so topg::linear and
// the decode plan stay bitwise equal to each other. TOPG_DISABLE_AVX512=1 turns it off.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

#include "gemv_avx512.h"
#include "vec.h"

namespace topg::gemm {

// use_avx512() (gemv_avx512.h: the CPU check and TOPG_DISABLE_AVX512) and AVX-512 BF16.
inline bool use_bf16dp() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool on = use_avx512() && __builtin_cpu_supports("avx512bf16");
  return on;
#else
  return false;
#endif
}

#if defined(__x86_64__) && defined(__GNUC__)
#define TOPG_BF16DP 1
#define TOPG_TARGET_BF16DP __attribute__((target("avx512f,avx512bw,avx512bf16")))

// sums[i] = a[i] . w for MB bf16 rows a and one weight row w, read front to back with
// four independent sums per A row. Lanes past K are loaded as zeros (masked).
template <int MB>
TOPG_TARGET_BF16DP inline void dp_row(const bf16* const* a, const bf16* w, int64_t K, float* sums) {
  __m512 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
    for (int j = 0; j < 4; ++j) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + 32 * j);
      for (int i = 0; i < MB; ++i)
        acc[i][j] =
            _mm512_dpbf16_ps(acc[i][j], (__m512bh)_mm512_loadu_si512(a[i] + k + 32 * j), wv);
    }
  }
  for (int j = 0; k < K; k += 32, j = (j + 1) & 3) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : __mmask32((1u << (K - k)) - 1);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
    for (int i = 0; i < MB; ++i)
      acc[i][j] =
          _mm512_dpbf16_ps(acc[i][j], (__m512bh)_mm512_maskz_loadu_epi16(mask, a[i] + k), wv);
  }
  for (int i = 0; i < MB; ++i)
    sums[i] = _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]), _mm512_add_ps(acc[i][2], acc[i][3])));
}

// For weight rows [n0, n1) of W ([N, K] bf16, row stride ldw) and M bf16 rows a[0..M):
// emit(m, n, sum) for every pair, one weight row at a time, front to back: a range of
// rows streams through memory in order. Measured on Zen 4 (2 threads, weights cold, 3
// alternating runs, GB/s of weights): [3072, 576] 27-28 row by row, 16-18 with 8 rows
// read side by side (the next 8 prefetched), 17 on the AVX2 path; software prefetch
// 4 KiB ahead of the row lost 10-20% (the hardware prefetcher follows one stream).
template <typename Emit>
TOPG_TARGET_BF16DP void dot_rows_bf16dp(const bf16* const* a, int64_t M, const bf16* w, int64_t ldw,
                                        int64_t K, int64_t n0, int64_t n1, Emit&& emit) {
  float sums[3];
  for (int64_t n = n0; n < n1; ++n) {
    const bf16* row = w + n * ldw;
    for (int64_t m = 0; m < M; m += 3) {
      const int mb = int(std::min<int64_t>(3, M - m));
      with_rows<3>(mb, [&]<int MB>() { dp_row<MB>(a + m, row, K, sums); });
      for (int i = 0; i < mb; ++i) emit(m + i, n, sums[i]);
    }
  }
}
#else
#define TOPG_BF16DP 0
#endif

}  // namespace topg::gemm
