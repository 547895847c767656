// GEMM / GEMV core shared by topg::linear and topg::fused_moe (no torch).
//
// Every product here is "A times weight-transposed": C[m][n] = sum_k A[m][k] * W[n][k], with
// W stored row-major [N, K] (the nn.Linear layout), fp32 accumulation and any storage type
// (float / bf16 / fp16) for A and W. Two paths:
//
// * dot path (few rows of A: decode, GEMV). Each task streams a block of RB weight rows
//   once, against MB rows of A at a time, keeping MB x RB Vec8 partial sums in registers
//   and reducing them horizontally at the end. Memory-bound: the weight is read once from
//   DRAM (re-reads for further MB chunks of A hit L1/L2).
// * packed path (many rows). Goto-style: K in blocks of KC; A packed once into fp32
//   MR-row tiles (k-major, so the micro-kernel broadcasts from contiguous memory); the
//   weight packed per (KC x NR) panel into fp32 k-major (16 columns per k), converting
//   bf16/fp16 on the way, so the 6x16 FMA micro-kernel runs at fp32 speed for every dtype
//   (with AVX-512F two tiles x two panels at 16 lanes, the same sums: gemm_f32x16.h).
//   Partial sums of K blocks go to an fp32 scratch; the final block hands each 6x16 tile
//   to a caller epilogue (bias + store, the MoE activation, or the routed scatter-add).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "gemm_f32x16.h"
#include "gemv_avx512.h"
#include "gemv_bf16split.h"
#include "gemv_f32_tiles.h"
#include "vec.h"

namespace topg::gemm {

constexpr int MR = 6;        // micro-tile rows (A rows per tile)
constexpr int NR = 16;       // micro-tile columns (weight rows per panel, two Vec8)
constexpr int64_t KC = 256;  // K block: a 16 KiB weight panel stays in L1
constexpr int64_t NCP = 16;  // panels per packed weight block: 256 columns, 256 KiB (L2)
constexpr int64_t MCT = 24;  // A tiles per L2 block: 144 rows x KC fp32 = 144 KiB

// Rows of A up to which the dot path is used (linear, and each expert of fused_moe).
// Measured single-threaded at 4096 x 4096: the dot path wins below ~12 rows, the two
// tie at 16 (~23 GFLOP/s per core), the packed GEMM wins from ~24 rows on (it pays a
// fixed cost for packing the whole weight, ~2.5 G elements/s per core).
constexpr int64_t kDotMaxRows = 16;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Per-thread scratch that grows and is reused across calls (no page faults per call).
inline float* scratch(int slot, int64_t n) {
  thread_local std::vector<float> buf[2];  // 0: packed weight block, 1: partial sums
  if (int64_t(buf[slot].size()) < n) buf[slot].resize(size_t(n));
  return buf[slot].data();
}

// ---------------------------------------------------------------------------------
// Dot path
// ---------------------------------------------------------------------------------

// The dot path's A layout. For bf16 weights (with AVX2) each full block of 16 A values is
// stored as [a0..a3, a8..a11, a4..a7, a12..a15]: that is the lane order in which two
// unpacks of 16 bf16 values with zero produce their fp32 values (one load and two
// shuffles per 16 weights instead of two widening loads and two shifts, which made the
// bf16 GEMV compute-bound). A sum does not care about the order, so only A is permuted.
template <typename T>
constexpr bool kDotPermuted = std::is_same_v<T, bf16> && TOPG_AVX2;

// Where A element k (of K) sits in the dot path's A row for weights of type T.
template <typename T>
inline int64_t dot_a_index(int64_t k, int64_t K) {
  if constexpr (kDotPermuted<T>) {
    if (k < K / 16 * 16) {
      const int64_t j = k & 15;
      return k - j + (j < 4 || j >= 12 ? j : j < 8 ? j + 4 : j - 4);
    }
  }
  return k;
}

// Converts an A row to fp32 in the dot path's layout for weights of type T.
template <typename T, typename S>
inline void dot_a_row(const S* src, int64_t K, float* dst) {
  int64_t k0 = 0;
#if TOPG_AVX2
  // bf16 rows in 16s, by the same two unpacks as the weights (bf16 -> fp32 is exact, so
  // the values are those of the scalar loop below). The scalar loop alone took ~4% of
  // the plan's batch-8 bf16 step: every member converts every GEMV's A rows.
  if constexpr (kDotPermuted<T> && std::is_same_v<S, bf16>) {
    const __m256i zero = _mm256_setzero_si256();
    for (; k0 + 16 <= K; k0 += 16) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + k0));
      _mm256_storeu_ps(dst + k0, _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v)));
      _mm256_storeu_ps(dst + k0 + 8, _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v)));
    }
  }
#endif
  for (int64_t k = k0; k < K; ++k) dst[dot_a_index<T>(k, K)] = to_float(src[k]);
}

// The weight rows of the next dot block, to prefetch while this one is summed: two runs
// of RB / 2 contiguous rows (nullptr: none). Hardware prefetchers lose track of many
// short row streams; with rows of <= 3 KiB this gained ~50% on one core (bf16,
// K = 1024); fp32 rows of 4 KiB lost ~5%, longer rows nothing: short rows only.
struct Prefetch {
  const char* run[2] = {nullptr, nullptr};
};

template <typename T>
inline Prefetch next_rows(const T* run0, const T* run1, int64_t K) {
  if (K * int64_t(sizeof(T)) > 3072) return {};
  return {{reinterpret_cast<const char*>(run0), reinterpret_cast<const char*>(run1)}};
}

// Prefetches `bytes` (a multiple of 64, or less than 64) of each run and advances it.
inline void prefetch_step(Prefetch& pf, int bytes) {
  for (const char*& p : pf.run) {
    for (int l = 0; l < bytes; l += 64) __builtin_prefetch(p + l, 0, 3);
    p += bytes;
  }
}

// out[m * RB + r] = sum_k a[m][k] * w[r][k] for MB fp32 rows a[m] (in the layout of
// dot_a_row<T>) and RB weight rows w[r].
template <int MB, int RB, typename T>
inline void dot_block(const float* const* a, const T* const* w, int64_t K, float* out,
                      Prefetch pf = {}) {
  // Bytes of each half-block of rows consumed per step of 8 (or 16) k.
  constexpr int kPf8 = RB / 2 * 8 * int(sizeof(T));
  const bool prefetch = RB >= 2 && pf.run[0] != nullptr;
  Vec8 acc[MB][RB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) acc[m][r] = Vec8::zero();
  int64_t k = 0;
#if TOPG_AVX2
  if constexpr (kDotPermuted<T>) {
    const __m256i zero = _mm256_setzero_si256();
    for (; k + 16 <= K; k += 16) {
      if (prefetch) prefetch_step(pf, 2 * kPf8);
      Vec8 lo[MB], hi[MB];
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) lo[m] = Vec8::load(a[m] + k), hi[m] = Vec8::load(a[m] + k + 8);
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r] + k));
        const Vec8 wl(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v)));
        const Vec8 wh(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v)));
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m)
          acc[m][r] = Vec8::fma(hi[m], wh, Vec8::fma(lo[m], wl, acc[m][r]));
      }
    }
  }
#endif
  // A rows in registers, then one weight vector at a time: MB * RB + MB + 1 <= 16 ymm, so
  // no accumulator is spilled (a spilled one puts a store-forward in the FMA chain).
  for (; k + 8 <= K; k += 8) {
    if (prefetch) prefetch_step(pf, kPf8);
    Vec8 av[MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) av[m] = Vec8::load(a[m] + k);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const Vec8 wv = Vec8::load(w[r] + k);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) acc[m][r] = Vec8::fma(av[m], wv, acc[m][r]);
    }
  }
  // Unrolled, so that acc stays in registers: as plain loops, GCC 12 kept a copy of acc on
  // the stack for them and stored every accumulator in every step of the loops above (15
  // stores a step beside 24 FMAs in dot_block<3, 4, bf16>; docs/cpu-kernels.md).
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      float s = acc[m][r].sum();
      for (int64_t kk = k; kk < K; ++kk) s += a[m][kk] * to_float(w[r][kk]);
      out[m * RB + r] = s;
    }
}

// Dot products of `m` fp32 rows a[0..m) (m <= 3 per call) against RB weight rows.
// sums[i * RB + r]. Dispatches MB at run time.
template <int RB, typename T>
inline void dot_rows_m(const float* const* a, int m, const T* const* w, int64_t K, float* sums,
                       Prefetch pf) {
  switch (m) {
    case 1:
      dot_block<1, RB>(a, w, K, sums, pf);
      break;
    case 2:
      dot_block<2, RB>(a, w, K, sums, pf);
      break;
    default:
      dot_block<3, RB>(a, w, K, sums, pf);
      break;
  }
}

// out[i] = a[i] . w for MB fp32 rows a and one fp32 weight row w, read front to back with
// four independent sums per A row (k in strides of 32). Rows of a block are contiguous,
// so a range of rows streams through memory in order, which the hardware prefetcher
// follows best (see dot_rows_range). pf: lines to prefetch meanwhile (no effect on the sums).
// il: these MB rows' part of a pack_passes copy (k < K rounded down to 32 read from it, the
// rest from a), or nullptr; the same sums either way.
template <int MB>
inline void dot_row_seq(const float* const* a, const float* w, int64_t K, float* out,
                        LinePrefetch pf = {}, const float* il = nullptr) {
  Vec8 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = Vec8::zero();
  LineSpread spread(pf, K / 32);
  int64_t k = 0;
  if (il) {
    for (; k + 32 <= K; k += 32) {
      spread.step();
      const float* ak = il + k * MB;
      for (int j = 0; j < 4; ++j) {
        const Vec8 wv = Vec8::load(w + k + 8 * j);
        for (int i = 0; i < MB; ++i)
          acc[i][j] = Vec8::fma(Vec8::load(ak + 32 * i + 8 * j), wv, acc[i][j]);
      }
    }
  }
  for (; k + 32 <= K; k += 32) {
    spread.step();
    for (int j = 0; j < 4; ++j) {
      const Vec8 wv = Vec8::load(w + k + 8 * j);
      for (int i = 0; i < MB; ++i)
        acc[i][j] = Vec8::fma(Vec8::load(a[i] + k + 8 * j), wv, acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i) out[i] = seq_finish(acc[i], a[i], w, k, K);
}

// A pass of the AVX2 fp32 GEMV (dot_row_seq) and the A rows from which its passes read an
// interleaved copy of A (interleave_a_rows) instead of the row pointers. Measured on a
// 2-core Zen 3 (AVX2 only; the decode plan's SmolLM2 fp32 step, one process, 10 rounds,
// the two forms switched in random order, medians, ms): one sequence of T = 5 / 8 / 9
// tokens 27.52 / 37.91 / 40.21 -> 24.61 / 32.50 / 34.33, batch 8 of one token 38.20 ->
// 32.66 (one pass, T = 3, in an earlier process: 20.79 / 21.05). Aligning the row
// pointers' rows to 64 bytes instead gained about half as much. From 12 rows the tiles
// stay ahead: 16 rows 65.7 ms against 75.0 on the interleaved passes, 12 rows even.
constexpr int kF32SeqRows = 3;
constexpr int64_t kF32SeqInterleavedRows = 4;

// The interleaved copy (pack_passes, gemv_avx512.h) of the M fp32 A rows that
// dot_rows_range's fp32 path reads them from, made in buf, in the pass size of the form it
// takes for M rows: kF32x16Rows with AVX-512F from 3 rows, kF32SeqRows on AVX2 for 4 to
// kF32TileMinRows - 1 rows; nullptr where that form reads the row pointers.
inline int64_t interleaved_pass(int64_t M) {
#if TOPG_F32X16
  if (M >= f32x16_min_rows() && use_avx512()) return M >= 3 ? kF32x16Rows : 0;
#endif
  return M >= kF32SeqInterleavedRows && M < kF32TileMinRows ? kF32SeqRows : 0;
}

inline const float* interleave_a_rows(const float* const* a, int64_t M, int64_t K,
                                      AlignedFloats& buf) {
  const int64_t pass = interleaved_pass(M);
  if (pass == 0) return nullptr;
  float* il = buf.fit(M * K);
  pack_passes(a, M, K, pass, il);
  return il;
}

// The copy of the M fp32 A rows that dot_rows_range reads for weights of type T, made in
// buf: fp32 weights the interleaved copy above, bf16 weights on CPUs with AVX-512F and no
// AVX-512 BF16 the split copy (gemv_bf16split.h); nullptr where it reads the row pointers.
template <typename T>
inline const float* prepare_a_rows(const float* const* a, int64_t M, int64_t K,
                                   AlignedFloats& buf) {
  if constexpr (std::is_same_v<T, float>) return interleave_a_rows(a, M, K, buf);
#if TOPG_F32X16
  if constexpr (std::is_same_v<T, bf16>) {
    if (use_bf16split()) {  // the rows in dot_a_row<bf16>'s layout
      int32_t perm[32];
      for (int k = 0; k < 32; ++k) perm[k] = int32_t(dot_a_index<bf16>(k, 32));
      float* as = buf.fit(M * split_k(K));
      split_a_rows(a, M, K, perm, [K](int64_t k) { return dot_a_index<bf16>(k, K); }, as);
      return as;
    }
  }
#endif
  return nullptr;
}

// For weight rows [n0, n1) of W ([N, K], row stride ldw) and M fp32 rows a[0..M): calls
// emit(m, n, sum) for every pair. Rows are taken RB at a time (pointer rows are clamped
// so the tail block stays in bounds); each block is read from memory once for all M.
// il: the rows' prepare_a_rows<T> copy, or nullptr (then the bf16 split form makes its own).
template <typename T, typename Emit>
void dot_rows_range(const float* const* a, int64_t M, const T* w, int64_t ldw, int64_t K,
                    int64_t n0, int64_t n1, Emit&& emit, const float* il = nullptr) {
#if TOPG_F32X16
  if constexpr (std::is_same_v<T, bf16>) {
    if (use_bf16split()) {  // AVX-512F without AVX-512 BF16 (gemv_bf16split.h)
      thread_local AlignedFloats own;
      if (!il) il = prepare_a_rows<bf16>(a, M, K, own);
      dot_rows_bf16split(il, M, w, ldw, K, n0, n1, emit);
      return;
    }
  }
#endif
  // Weight rows per block: 8 for one A row (8 accumulators), else 4 against up to 3 A
  // rows at a time (12 accumulators + 3 A vectors + 1 weight vector = 16 ymm).
  constexpr int RB = 4;
  float sums[3 * 8];
  if constexpr (std::is_same_v<T, float>) {
    // fp32: one weight row at a time, front to back (dot_row_seq). Measured against the
    // blocks below (8 rows read side by side, the next block prefetched), SmolLM2 shapes,
    // 2 threads, weights cold, 3 alternating runs: [3072, 576] 29-30 vs 21-26 GB/s,
    // [49152, 576] 29-32 vs 26-28 GB/s. bf16 keeps the blocks: its AVX2 form is bound by
    // widening the weights, not by the reads (gemv_bf16dp.h has the AVX-512 BF16 form).
    // With AVX-512F, from 3 rows (from 1 on Intel CPUs): 8 rows a pass and the rows ahead
    // prefetched (gemv_avx512.h), bitwise the same sums.
#if TOPG_F32X16
    if (M >= f32x16_min_rows() && use_avx512()) {
      dot_rows_f32x16(a, M, w, ldw, K, n0, n1, emit, il);
      return;
    }
#endif
    if (M >= kF32TileMinRows) {  // gemv_f32_tiles.h
      dot_rows_f32_tiles(a, M, w, ldw, K, n0, n1, emit);
      return;
    }
    // 4 to 11 A rows: the next weight row is prefetched through the passes over this one
    // (pass_share). Measured on a Zen 3 (AVX2, 2 threads, the decode plan's SmolLM2 step,
    // fp32, in one process against no prefetch, docs/cpu-kernels.md): batch 4 29.6 ->
    // 27.2 ms, batch 8 45.7 -> 39.2 (batch 16, before the tiles took it: 89.5 -> 83.4).
    constexpr int P = kF32SeqRows;
    const int64_t passes = ceil_div(M, P), lines = ceil_div(K * int64_t(sizeof(float)), 64);
    for (int64_t n = n0; n < n1; ++n) {
      const float* row = w + n * ldw;
      const char* next =
          passes > 1 && n + 1 < n1 ? reinterpret_cast<const char*>(w + (n + 1) * ldw) : nullptr;
      for (int64_t m = 0, p = 0; m < M; m += P, ++p) {
        const int mb = int(std::min<int64_t>(P, M - m));
        const LinePrefetch pf = pass_share(next, lines, p, passes);
        const float* ilp = il ? il + m * (K / 32 * 32) : nullptr;
        if (mb == 1)
          dot_row_seq<1>(a + m, row, K, sums, pf, ilp);
        else if (mb == 2)
          dot_row_seq<2>(a + m, row, K, sums, pf, ilp);
        else
          dot_row_seq<3>(a + m, row, K, sums, pf, ilp);
        for (int i = 0; i < mb; ++i) emit(m + i, n, sums[i]);
      }
    }
    return;
  }
  if (M == 1) {
    constexpr int RB1 = 8;
    int64_t n = n0;
    for (; n + RB1 <= n1; n += RB1) {
      const T* rows[RB1];
      for (int r = 0; r < RB1; ++r) rows[r] = w + (n + r) * ldw;
      const Prefetch pf = n + 2 * RB1 <= n1 && ldw == K
                              ? next_rows(rows[0] + RB1 * K, rows[0] + (RB1 + RB1 / 2) * K, K)
                              : Prefetch{};
      dot_block<1, RB1>(a, rows, K, sums, pf);
      for (int r = 0; r < RB1; ++r) emit(0, n + r, sums[r]);
    }
    for (; n < n1; ++n) {
      const T* row = w + n * ldw;
      dot_block<1, 1>(a, &row, K, sums);
      emit(0, n, sums[0]);
    }
    return;
  }
  for (int64_t n = n0; n < n1; n += RB) {
    const int rb = int(std::min<int64_t>(RB, n1 - n));
    const T* rows[RB];
    for (int r = 0; r < RB; ++r) rows[r] = w + (n + std::min(r, rb - 1)) * ldw;
    // the first pass over this block prefetches the next; later passes hit the cache
    // (spreading it over all passes, as the fp32 path does, measured 0.89-1.10x at
    // batch 4 and 0.94-1.06x at batch 8 on a Zen 3, bf16: not taken)
    const Prefetch pf = n + 2 * RB <= n1 && ldw == K
                            ? next_rows(rows[0] + RB * K, rows[0] + (RB + RB / 2) * K, K)
                            : Prefetch{};
    for (int64_t m = 0; m < M; m += 3) {
      const int mb = int(std::min<int64_t>(3, M - m));
      dot_rows_m<RB>(a + m, mb, rows, K, sums, m == 0 ? pf : Prefetch{});
      for (int i = 0; i < mb; ++i)
        for (int r = 0; r < rb; ++r) emit(m + i, n + r, sums[i * RB + r]);
    }
  }
}

// Gated variant for a [gate; up] weight (gate row n at wg + n * ldw, up row n at
// wu + n * ldw): emit(m, n, gate_sum, up_sum) for n in [n0, n1). Gate and up rows of
// the same n are read in the same pass, so the activation can be applied right away.
template <typename T, typename Emit>
void dot_rows_gated(const float* const* a, int64_t M, const T* wg, const T* wu, int64_t ldw,
                    int64_t K, int64_t n0, int64_t n1, Emit&& emit) {
  float sums[3 * 8];
  if (M == 1) {
    constexpr int P = 4;  // pairs per block: 8 rows, 8 accumulators
    for (int64_t n = n0; n < n1; n += P) {
      const int pv = int(std::min<int64_t>(P, n1 - n));
      const T* rows[2 * P];
      for (int r = 0; r < P; ++r) {
        const int64_t nn = n + std::min(r, pv - 1);
        rows[r] = wg + nn * ldw;
        rows[P + r] = wu + nn * ldw;
      }
      const Prefetch pf = n + 2 * P <= n1 && ldw == K
                              ? next_rows(wg + (n + P) * K, wu + (n + P) * K, K)
                              : Prefetch{};
      dot_block<1, 2 * P>(a, rows, K, sums, pf);
      for (int r = 0; r < pv; ++r) emit(0, n + r, sums[r], sums[P + r]);
    }
    return;
  }
  constexpr int P = 2;  // 4 rows x up to 3 A rows: 12 accumulators
  for (int64_t n = n0; n < n1; n += P) {
    const int pv = int(std::min<int64_t>(P, n1 - n));
    const T* rows[2 * P];
    for (int r = 0; r < P; ++r) {
      const int64_t nn = n + std::min(r, pv - 1);
      rows[r] = wg + nn * ldw;
      rows[P + r] = wu + nn * ldw;
    }
    const Prefetch pf =
        n + 2 * P <= n1 && ldw == K ? next_rows(wg + (n + P) * K, wu + (n + P) * K, K) : Prefetch{};
    for (int64_t m = 0; m < M; m += 3) {
      const int mb = int(std::min<int64_t>(3, M - m));
      dot_rows_m<2 * P>(a + m, mb, rows, K, sums, m == 0 ? pf : Prefetch{});
      for (int i = 0; i < mb; ++i)
        for (int r = 0; r < pv; ++r)
          emit(m + i, n + r, sums[i * 2 * P + r], sums[i * 2 * P + P + r]);
    }
  }
}

// ---------------------------------------------------------------------------------
// Packed path
// ---------------------------------------------------------------------------------

// Packed A layout for `m` rows padded to mp = ceil(m / MR) * MR, all of K: the K block
// starting at k0 (length kc) holds tile t at ap + k0 * mp + t * kc * MR, as [kc][MR].
inline int64_t packed_a_size(int64_t m, int64_t K) { return ceil_div(m, MR) * MR * K; }

// Packs tile t of A: MR row pointers (nullptr = padding row, zeros), K columns.
template <typename T>
void pack_a_tile(const T* const* rows, int64_t K, int64_t mp, int64_t t, float* ap) {
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    float* dst = ap + k0 * mp + t * kc * MR;
    for (int i = 0; i < MR; ++i) {
      const T* src = rows[i];
      if (src == nullptr) {
        for (int64_t k = 0; k < kc; ++k) dst[k * MR + i] = 0.f;
      } else {
        src += k0;
        for (int64_t k = 0; k < kc; ++k) dst[k * MR + i] = to_float(src[k]);
      }
    }
  }
}

// One 8-column half of a weight panel: `valid` rows starting at `row0` (stride ldw).
template <typename T>
struct RowGroup {
  const T* row0;
  int valid;  // 0..8; missing rows pack as zeros
};

// Packs K columns [k0, k0 + kc) of two row groups into dst[kc][16] (fp32, k-major).
template <typename T>
void pack_b_panel(RowGroup<T> g0, RowGroup<T> g1, int64_t ldw, int64_t k0, int64_t kc, float* dst) {
  const RowGroup<T> groups[2] = {g0, g1};
  for (int g = 0; g < 2; ++g) {
    const T* base = groups[g].row0 + k0;
    const int valid = groups[g].valid;
    int64_t k = 0;
    for (; k + 8 <= kc; k += 8) {
      Vec8 r[8];
      for (int i = 0; i < 8; ++i) r[i] = i < valid ? Vec8::load(base + i * ldw + k) : Vec8::zero();
      transpose8(r);
      for (int i = 0; i < 8; ++i) r[i].store(dst + (k + i) * NR + g * 8);
    }
    for (; k < kc; ++k)
      for (int i = 0; i < 8; ++i)
        dst[k * NR + g * 8 + i] = i < valid ? to_float(base[i * ldw + k]) : 0.f;
  }
}

// c[6][16] = sum over kc of a[k][0..6) (outer) b[k][0..16): the register-blocked core,
// 12 Vec8 accumulators, 2 loads + 6 broadcasts per 12 FMAs.
inline void micro_6x16(int64_t kc, const float* a, const float* b, float* c) {
  Vec8 c00 = Vec8::zero(), c01 = Vec8::zero(), c10 = Vec8::zero(), c11 = Vec8::zero();
  Vec8 c20 = Vec8::zero(), c21 = Vec8::zero(), c30 = Vec8::zero(), c31 = Vec8::zero();
  Vec8 c40 = Vec8::zero(), c41 = Vec8::zero(), c50 = Vec8::zero(), c51 = Vec8::zero();
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const Vec8 b0 = Vec8::load(b), b1 = Vec8::load(b + 8);
    Vec8 av(a[0]);
    c00 = Vec8::fma(av, b0, c00);
    c01 = Vec8::fma(av, b1, c01);
    av = Vec8(a[1]);
    c10 = Vec8::fma(av, b0, c10);
    c11 = Vec8::fma(av, b1, c11);
    av = Vec8(a[2]);
    c20 = Vec8::fma(av, b0, c20);
    c21 = Vec8::fma(av, b1, c21);
    av = Vec8(a[3]);
    c30 = Vec8::fma(av, b0, c30);
    c31 = Vec8::fma(av, b1, c31);
    av = Vec8(a[4]);
    c40 = Vec8::fma(av, b0, c40);
    c41 = Vec8::fma(av, b1, c41);
    av = Vec8(a[5]);
    c50 = Vec8::fma(av, b0, c50);
    c51 = Vec8::fma(av, b1, c51);
    a += MR;
    b += NR;
  }
  c00.store(c + 0 * NR), c01.store(c + 0 * NR + 8);
  c10.store(c + 1 * NR), c11.store(c + 1 * NR + 8);
  c20.store(c + 2 * NR), c21.store(c + 2 * NR + 8);
  c30.store(c + 3 * NR), c31.store(c + 3 * NR + 8);
  c40.store(c + 4 * NR), c41.store(c + 4 * NR + 8);
  c50.store(c + 5 * NR), c51.store(c + 5 * NR + 8);
}

// Computes the output tiles [t0, t1) x panels [p0, p1) of a product whose A is packed
// (`ap`, mp rows padded, all of K). panel(p) returns the two RowGroups of weight panel p
// (stride ldw). epi(t, p, tile) receives each finished 6x16 fp32 tile (row-major, ld 16).
// Uses this thread's scratch for the packed weight block and the K-block partial sums.
template <typename T, typename Panel, typename Epi>
void gemm_tiles(const float* ap, int64_t mp, int64_t K, int64_t ldw, int64_t t0, int64_t t1,
                int64_t p0, int64_t p1, Panel&& panel, Epi&& epi) {
  const int64_t ntile = t1 - t0, npan = p1 - p0;
  if (ntile <= 0 || npan <= 0) return;
  float* bp = scratch(0, std::min(KC, K) * NR * npan);
  float* cs = K > KC ? scratch(1, ntile * MR * npan * NR) : nullptr;  // partial sums
  const int64_t ldc = npan * NR;
  alignas(64) float tile[4][MR * NR];
#if TOPG_F32X16
  static_assert(MR == 6 && NR == 16, "micro_x16 computes 6 x 16 tiles");
  const bool wide = use_avx512();  // two panels (and two tiles) a micro-kernel call
#else
  const bool wide = false;
#endif
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    const bool first = k0 == 0, last = k0 + kc >= K;
    // Adds tile `tl` (tile t, panel p) to the earlier K blocks' sums; hands it to epi at
    // the last block, else keeps it as the partial sum.
    const auto finish = [&](int64_t t, int64_t p, float* tl) {
      float* c = cs ? cs + (t - t0) * MR * ldc + (p - p0) * NR : nullptr;
      if (!first)
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < NR; j += 8)
            (Vec8::load(tl + i * NR + j) + Vec8::load(c + i * ldc + j)).store(tl + i * NR + j);
      if (last) {
        epi(t, p, static_cast<const float*>(tl));
      } else {
        for (int i = 0; i < MR; ++i)
          for (int j = 0; j < NR; j += 8) Vec8::load(tl + i * NR + j).store(c + i * ldc + j);
      }
    };
    for (int64_t p = p0; p < p1; ++p) {
      const auto [g0, g1] = panel(p);
      pack_b_panel<T>(g0, g1, ldw, k0, kc, bp + (p - p0) * kc * NR);
    }
    for (int64_t tb = t0; tb < t1; tb += MCT) {
      const int64_t te = std::min(t1, tb + MCT);
      for (int64_t p = p0; p < p1;) {
        const float* b = bp + (p - p0) * kc * NR;
        const int np = wide && p + 1 < p1 ? 2 : 1;
        for (int64_t t = tb; t < te;) {
          const float* at = ap + k0 * mp + t * kc * MR;
#if TOPG_F32X16
          if (np == 2) {
            const int nt = t + 1 < te ? 2 : 1;
            const float* as[2] = {at, nt == 2 ? at + kc * MR : at};
            float* outs[4] = {tile[0], tile[1], tile[2], tile[3]};
            if (nt == 2)
              micro_x16<2>(kc, as, b, b + kc * NR, outs);
            else
              micro_x16<1>(kc, as, b, b + kc * NR, outs);
            for (int u = 0; u < nt; ++u) {
              finish(t + u, p, tile[2 * u]);
              finish(t + u, p + 1, tile[2 * u + 1]);
            }
            t += nt;
            continue;
          }
#endif
          micro_6x16(kc, at, b, tile[0]);
          finish(t, p, tile[0]);
          ++t;
        }
        p += np;
      }
    }
  }
}

// The panel map of a plain [N, K] weight: panel p holds rows 16p .. 16p+15.
template <typename T>
struct LinearPanels {
  const T* w;
  int64_t N, ldw;
  std::pair<RowGroup<T>, RowGroup<T>> operator()(int64_t p) const {
    const int64_t r0 = p * NR, r1 = r0 + 8;
    const int v0 = int(std::clamp<int64_t>(N - r0, 0, 8)),
              v1 = int(std::clamp<int64_t>(N - r1, 0, 8));
    return {RowGroup<T>{w + std::min(r0, N - 1) * ldw, v0},
            RowGroup<T>{w + std::min(r1, N - 1) * ldw, v1}};
  }
};

// Stores `n` (<= 8) fp32 values of v (+ bias) to dst, rounding once to T.
template <typename T>
inline void store_n(T* dst, Vec8 v, int n) {
  if (n == 8)
    v.store(dst);
  else
    store_partial(dst, v, n);
}

}  // namespace topg::gemm
