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
// the decode plan stay bitwise equal to each other. TOPG_DISABLE_AVX512=1 turns it off
// (the AVX2 path), TOPG_DISABLE_AVX512_BF16=1 too (gemv_bf16split.h's form).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "gemv_avx512.h"
#include "vec.h"

namespace topg::gemm {

// use_avx512() (gemv_avx512.h: the CPU check and TOPG_DISABLE_AVX512) and AVX-512 BF16,
// unless TOPG_DISABLE_AVX512_BF16 is set (then such a CPU takes gemv_bf16split.h's form:
// how its tests run on CPUs that have BF16).
inline bool use_bf16dp() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool on = [] {
    const char* off = std::getenv("TOPG_DISABLE_AVX512_BF16");
    if (off && off[0] && off[0] != '0') return false;
    return use_avx512() && __builtin_cpu_supports("avx512bf16");
  }();
  return on;
#else
  return false;
#endif
}

#if defined(__x86_64__) && defined(__GNUC__)
#define TOPG_BF16DP 1
#define TOPG_TARGET_BF16DP __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// reduce16, reduce8: gemv_avx512.h (shared with gemv_bf16split.h).

// Weight rows per tile (dp_tile) and A rows per tile pass: 24 accumulators, 6 weight
// vectors and one A vector, 31 of the 32 zmm registers.
constexpr int kTileW = 6, kTileA = 4;

// s[r * 4 + i] = a[i] . w_r for RA <= 4 bf16 rows a and W <= 6 weight rows w_r = w + r * ldw,
// each sum in one order whatever RA and W are (one accumulator fed 32 products at a time
// front to back, the last 32 masked, then one lane tree: reduce16 and reduce8 add a
// vector's lanes in the same order), so a row's result does not depend on the rows beside
// it. A tile of fewer rows (the rows left at the end of a range) leaves the other
// accumulators zero. One A vector serves 6 weight rows and one weight vector 4 A rows:
// 10 loads per 24 vdpbf16ps, against 9 / 8 with one weight row at a time and 8 A rows
// (the form of 1-2 A rows until 2026-12-08). With PF, the weight rows r of pf with bit r
// of pfm are prefetched into L2 (T1) meanwhile, one line per 32 weights of each. Measured
// (standalone kernel, 1 thread, 16 A rows, K = 2,048, a Zen 4 at 2.6 GHz whose vdpbf16ps peaks at
// 226 GFLOP/s a core, 2026-12-08): [480, 2048] in L2 4 x 4 tiles 132-136 GFLOP/s, 6 x 4 171;
// [16384, 2048] x 4 weights cold, T0 / T1 prefetch 9.1-9.4 / 8.3-8.8 ms (4 x 4), 6 x 4 with
// T1 7.9-8.3 ms. (An Intel Xeon with AMX, 4 x 4, [3072, 576] x 8 rows, had measured T0 slightly
// ahead of T1: 119 against 127 us, medians of 7; its bf16 GEMVs take the AMX tiles, gemv_amx.h.)
template <int W, int RA, bool PF>
TOPG_TARGET_BF16DP inline void dp_tile(const bf16* const* a, const bf16* w, int64_t ldw,
                                       const bf16* pf, int64_t K, float* s, unsigned pfm) {
  __m512 acc[4 * kTileW];
  for (int i = 0; i < 4 * kTileW; ++i) acc[i] = _mm512_setzero_ps();
  // The loop and the tail written out apart: in one masked loop body (or a helper taking
  // acc by pointer) GCC kept acc in memory, at half the rate (measured).
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[W];
    for (int r = 0; r < W; ++r) {
      if constexpr (PF)
        if (pfm >> r & 1)
          _mm_prefetch(reinterpret_cast<const char*>(pf + r * ldw + k), _MM_HINT_T1);
      wv[r] = (__m512bh)_mm512_loadu_si512(w + r * ldw + k);
    }
    for (int i = 0; i < RA; ++i) {
      const __m512bh av = (__m512bh)_mm512_loadu_si512(a[i] + k);
      for (int r = 0; r < W; ++r) acc[r * 4 + i] = _mm512_dpbf16_ps(acc[r * 4 + i], av, wv[r]);
    }
  }
  if (k < K) {
    const __mmask32 mask = __mmask32((1u << (K - k)) - 1);
    __m512bh wv[W];
    for (int r = 0; r < W; ++r) {
      if constexpr (PF)
        if (pfm >> r & 1)
          _mm_prefetch(reinterpret_cast<const char*>(pf + r * ldw + k), _MM_HINT_T1);
      wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * ldw + k);
    }
    for (int i = 0; i < RA; ++i) {
      const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(mask, a[i] + k);
      for (int r = 0; r < W; ++r) acc[r * 4 + i] = _mm512_dpbf16_ps(acc[r * 4 + i], av, wv[r]);
    }
  }
  static_assert(kTileW == 6, "the lane trees below cover 24 accumulators");
  _mm512_storeu_ps(s, reduce16(acc));
  reduce8(acc + 16, s + 16);
}

// Weight rows this far ahead (two tiles) are prefetched into L2 while a tile is read.
constexpr int64_t kBf16dpPrefetchRows = 2 * kTileW;

// For weight rows [n0, n1) of W ([N, K] bf16, row stride ldw) and M bf16 rows a[0..M):
// emit(m, n, sum) for every pair, in tiles of 6 weight rows x up to 4 A rows (dp_tile),
// the last tile of a range with the rows left; the tiles are read front to back and the
// rows two tiles ahead prefetched into L2. Each pass over a tile (4 A rows) prefetches its
// share of the tile two ahead (weight row r in pass r mod passes), a steady stream rather
// than all of it in the first pass. Every path sums an output in the same order: a row's
// result does not depend on the rows beside it.
// Measured (standalone kernel, 1 thread, [256, 576] in L2, 8 A rows, 2026-12-02): one
// weight row at a time 130-138 GFLOP/s, 4 x 4 tiles 332-354 (8 x 2 tiles 293-312, 8 x 1
// without the emit and prefetch 177-182). On a Zen 4 (2026-12-08): the 1B model's decode
// step of 16 rows in bf16 (python/benchmarks/decode_phases.py, 2 threads, alternated
// processes) with 4 x 4 tiles, T0, all prefetched in the first pass 179-193 ms; 6 x 4,
// T1, 159-181; the prefetch spread over the passes 162-173. One A row (batch-1 decode),
// [16384, 2048] cold, one weight row at a time (one accumulator's chain of vdpbf16ps)
// against the 6-row tile: 1 thread 23.4-24.6 against 28.2-28.6 GB/s; two processes at
// once 38-39 against 45-52 GB/s in all. Two A rows: 25.2-25.4 against 25.3-26.0 GB/s.
template <typename Emit>
TOPG_TARGET_BF16DP void dot_rows_bf16dp(const bf16* const* a, int64_t M, const bf16* w, int64_t ldw,
                                        int64_t K, int64_t n0, int64_t n1, Emit&& emit) {
  float s[4 * kTileW];
  const int64_t passes = (M + kTileA - 1) / kTileA;
  for (int64_t n = n0; n < n1; n += kTileW) {
    const bf16* row = w + n * ldw;
    const bf16* pf =
        n + kBf16dpPrefetchRows + kTileW <= n1 ? row + kBf16dpPrefetchRows * ldw : nullptr;
    with_rows<kTileW>(int(std::min<int64_t>(kTileW, n1 - n)), [&]<int W>() {
      for (int64_t m = 0; m < M; m += kTileA) {
        const int ra = int(std::min<int64_t>(kTileA, M - m));
        unsigned pfm = 0;
        for (int r = 0; r < W; ++r) pfm |= unsigned(r % passes == m / kTileA) << r;
        with_rows<kTileA>(ra, [&]<int RA>() {
          if (pf && pfm)
            dp_tile<W, RA, true>(a + m, row, ldw, pf, K, s, pfm);
          else
            dp_tile<W, RA, false>(a + m, row, ldw, nullptr, K, s, 0);
          for (int r = 0; r < W; ++r)
            for (int i = 0; i < RA; ++i) emit(m + i, n + r, s[r * 4 + i]);
        });
      }
    });
  }
}
#else
#define TOPG_BF16DP 0
#endif

}  // namespace topg::gemm
