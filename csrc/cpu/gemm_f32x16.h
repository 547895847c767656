// The packed GEMM's micro-kernel with AVX-512F (gemm_tiles, gemm_kernels.h): two A tiles
// of MR = 6 rows against two adjacent weight panels (32 columns) at once, 24 zmm
// accumulators (one A tile where the tiles are odd).
//
// Why: the 6x16 kernel is written with 8-lane vectors (Vec8, the library's x86-64-v3
// baseline), so on AVX-512 CPUs a prefill GEMM ran at half the vector width. Measured on
// a 2-core Ice Lake-class Xeon (2026-12-07, a register-only FMA loop, one core): 8 lanes
// 108 GFLOP/s, 16 lanes 187 (two 512-bit FMA units, at a lower clock). That CPU has no
// AVX-512 BF16, so its bf16 prefill runs this packed fp32 GEMM (linear.cpp).
//
// Every output lane is the same chain of fused multiply-adds over k as in micro_6x16 (the
// panels' packed layout is unchanged, only two are read side by side), so the sums are
// bitwise those of the 8-lane kernel: batch-invariant mode and the tests that compare a
// row's sums across row counts do not see which kernel ran.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cstdint>

#include "gemv_avx512.h"

namespace topg::gemm {

#if TOPG_F32X16
// Rows i of A tile `a` ([kc][6]) against the panels b0 / b1 ([kc][16] each) into acc[i]
// (b0) and acc[6 + i] (b1): one k step.
TOPG_TARGET_F32X16 __attribute__((always_inline)) inline void fmas_6x32(const float* ak, __m512 w0,
                                                                        __m512 w1, __m512* acc) {
#pragma GCC unroll 6
  for (int i = 0; i < 6; ++i) {
    const __m512 av = _mm512_set1_ps(ak[i]);
    acc[i] = _mm512_fmadd_ps(av, w0, acc[i]);
    acc[6 + i] = _mm512_fmadd_ps(av, w1, acc[6 + i]);
  }
}

// c[0..T) x 2 tiles of 6 x 16: c[2 u + j] = sum over kc of A tile a[u] (outer) panel b_j,
// for T = 1 or 2 A tiles (as packed by pack_a_tile, [kc][6]) and two weight panels b0 / b1
// (as packed by pack_b_panel, [kc][16]). T = 2 keeps 24 accumulators: 2 loads and 12
// broadcasts per 24 FMAs. Measured in L1 / L2 on the Ice Lake-class Xeon, one core: T = 2
// 131-150 GFLOP/s, T = 1 110-121, the 8-lane 6 x 16 kernel 97-105.
template <int T>
TOPG_TARGET_F32X16 inline void micro_x16(int64_t kc, const float* const* a, const float* b0,
                                         const float* b1, float* const* c) {
  __m512 acc[12 * T];
#pragma GCC unroll 24
  for (int i = 0; i < 12 * T; ++i) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 w0 = _mm512_loadu_ps(b0 + k * 16), w1 = _mm512_loadu_ps(b1 + k * 16);
#pragma GCC unroll 2
    for (int u = 0; u < T; ++u) fmas_6x32(a[u] + k * 6, w0, w1, acc + 12 * u);
  }
#pragma GCC unroll 2
  for (int u = 0; u < T; ++u)
#pragma GCC unroll 6
    for (int i = 0; i < 6; ++i) {
      _mm512_storeu_ps(c[2 * u] + 16 * i, acc[12 * u + i]);
      _mm512_storeu_ps(c[2 * u + 1] + 16 * i, acc[12 * u + 6 + i]);
    }
}
#endif

}  // namespace topg::gemm
