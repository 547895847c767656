// fp32 GEMV of 12 to 16 A rows on AVX2 (decode batches of 12-16, speculative verify steps
// of that many tokens): tiles of 4 weight rows x up to 3 A rows, bitwise the sums of
// dot_row_seq (gemm_kernels.h), with the next tile prefetched through the passes over it.
//
// dot_row_seq keeps four 8-lane partial sums per A row; partial j takes the vectors
// k = 32 s + 8 j in order. A tile computes one partial at a time (pass j walks k = 8 j,
// 8 j + 32, ...), so each (weight row, A row) pair needs one register, not four: 12
// accumulators, 3 A vectors and one weight vector fill the 16 ymm registers, and a step
// loads 7 vectors for 12 FMAs (dot_row_seq<3>: 16 for 12). Every lane sees the same FMAs in
// the same order, so a row's sum does not depend on M or on this path being taken
// (tests/test_batch_invariant.py).
//
// Only the first pass over a tile misses in L1, and the hardware prefetcher, which follows
// those misses, issues nothing during the others; so every pass prefetches its share of
// the next tile's lines (pass_share, LineSpread). Measured on a 2-core Zen 3, standalone
// (2 threads, weights evicted from L3 between calls, one process, medians of 40, 8 A rows)
// against dot_row_seq with the same prefetch: [3072, 576] 670 -> 587 us, [576, 1536] 451 ->
// 347 us, [49152, 576] 7.96 -> 6.68 ms. But in the decode plan's SmolLM2 step (one process,
// the two paths switched in random order) the tiles lost below 12 rows: batch 4 / 5 / 6 /
// 8 / 9: 1.18 / 1.14 / 1.08 / 1.03 / 1.03x the time of dot_row_seq; batch 12 0.97x, batch
// 16 0.85-0.87x. Hence kF32TileMinRows. docs/cpu-kernels.md.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec.h"

namespace topg::gemm {

// Cache lines of the weight row a GEMV reads next, prefetched a few at a time through a
// pass over the current one: `lines` lines from `p`.
struct LinePrefetch {
  const char* p = nullptr;
  int64_t lines = 0;
};

// The share of `lines` lines from p0 that pass `pass` of `passes` prefetches (none if p0 is
// null). The fp32 GEMV of more than 3 A rows spreads the next row's lines over all its
// passes: only the first pass over a row misses in L1, and the hardware prefetcher, which
// follows those misses, issues nothing during the later ones (docs/cpu-kernels.md, "AVX2:
// the later passes prefetch the next row").
inline LinePrefetch pass_share(const char* p0, int64_t lines, int64_t pass, int64_t passes) {
  if (!p0) return {};
  const int64_t l0 = lines * pass / passes, l1 = lines * (pass + 1) / passes;
  return {p0 + 64 * l0, l1 - l0};
}

// Issues pf's lines evenly over a loop of `steps` steps (call step() once per step).
class LineSpread {
 public:
  LineSpread(LinePrefetch pf, int64_t steps)
      : p_(pf.p), lines_(pf.p && steps > 0 ? pf.lines : 0), steps_(steps) {}
  void step() {
    for (due_ += lines_; lines_ && due_ >= steps_; due_ -= steps_, p_ += 64)
      __builtin_prefetch(p_, 0, 3);
  }

 private:
  const char* p_;
  int64_t lines_, steps_, due_ = 0;
};

// The end of dot_row_seq's sum of a . w from k (K rounded down to 32) given its four partial
// sums p: the tail's vectors of 8 to partials 0, 1, 2, the reduction, then the scalars.
// Shared by dot_row_seq and the tiles, whose sums must stay bitwise equal.
inline float seq_finish(Vec8 (&p)[4], const float* a, const float* w, int64_t k, int64_t K) {
  for (int j = 0; k + 8 <= K; k += 8, ++j)
    p[j] = Vec8::fma(Vec8::load(a + k), Vec8::load(w + k), p[j]);
  float s = ((p[0] + p[1]) + (p[2] + p[3])).sum();
  // an explicit fma: whether `s += a * w` is contracted is the compiler's choice, and it
  // differs between this function and the AVX-512 one (gemv_avx512.h)
  for (int64_t kk = k; kk < K; ++kk) s = std::fma(a[kk], w[kk], s);
  return s;
}

// Weight rows per tile, and the A rows from which dot_rows_range takes the tiles.
constexpr int kF32TileRows = 4;
constexpr int64_t kF32TileMinRows = 12;

// out[i * RB + r] = a[i] . w[r] for MB (<= 3) A rows and RB weight rows. Pass j of this
// call is pass (pass0 + j) of `passes` for the prefetch of next's `lines` lines.
template <int MB, int RB>
inline void dot_tile_f32(const float* const* a, const float* const* w, int64_t K, float* out,
                         const char* next, int64_t lines, int64_t pass0, int64_t passes) {
  const int64_t kv = K / 32 * 32;
  Vec8 part[4][MB][RB];
  for (int j = 0; j < 4; ++j) {
    Vec8 acc[MB][RB];
    for (int i = 0; i < MB; ++i)
      for (int r = 0; r < RB; ++r) acc[i][r] = Vec8::zero();
    LineSpread spread(pass_share(next, lines, pass0 + j, passes), kv / 32);
    for (int64_t k = 8 * j; k < kv; k += 32) {
      spread.step();
      Vec8 av[MB];
      for (int i = 0; i < MB; ++i) av[i] = Vec8::load(a[i] + k);
      for (int r = 0; r < RB; ++r) {
        const Vec8 wv = Vec8::load(w[r] + k);
        for (int i = 0; i < MB; ++i) acc[i][r] = Vec8::fma(av[i], wv, acc[i][r]);
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int r = 0; r < RB; ++r) part[j][i][r] = acc[i][r];
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < RB; ++r) {
      Vec8 p[4] = {part[0][i][r], part[1][i][r], part[2][i][r], part[3][i][r]};
      out[i * RB + r] = seq_finish(p, a[i], w[r], kv, K);
    }
}

// emit(m, n, a[m] . w[n]) for weight rows [n0, n1) of W (row stride ldw) and M A rows,
// in tiles of kF32TileRows weight rows; the next tile is prefetched when rows are
// contiguous (ldw == K).
template <typename Emit>
void dot_rows_f32_tiles(const float* const* a, int64_t M, const float* w, int64_t ldw, int64_t K,
                        int64_t n0, int64_t n1, Emit&& emit) {
  constexpr int RB = kF32TileRows;
  const int64_t blocks = (M + 2) / 3, passes = 4 * blocks;
  const int64_t lines = (RB * K * int64_t(sizeof(float)) + 63) / 64;
  float sums[3 * RB];
  for (int64_t n = n0; n < n1; n += RB) {
    const int rb = int(std::min<int64_t>(RB, n1 - n));
    const float* rows[RB];
    for (int r = 0; r < RB; ++r) rows[r] = w + (n + std::min(r, rb - 1)) * ldw;
    const char* next =
        n + 2 * RB <= n1 && ldw == K ? reinterpret_cast<const char*>(w + (n + RB) * ldw) : nullptr;
    for (int64_t m = 0, b = 0; m < M; m += 3, ++b) {
      const int mb = int(std::min<int64_t>(3, M - m));
      if (mb == 3)
        dot_tile_f32<3, RB>(a + m, rows, K, sums, next, lines, 4 * b, passes);
      else if (mb == 2)
        dot_tile_f32<2, RB>(a + m, rows, K, sums, next, lines, 4 * b, passes);
      else
        dot_tile_f32<1, RB>(a + m, rows, K, sums, next, lines, 4 * b, passes);
      for (int i = 0; i < mb; ++i)
        for (int r = 0; r < rb; ++r) emit(m + i, n + r, sums[i * RB + r]);
    }
  }
}

}  // namespace topg::gemm
