// fp32 dot path for 3..16 A rows with AVX-512F, for CPUs that have it (Zen 4, Skylake-X
// and later), chosen at run time; the library itself is built for x86-64-v3.
//
// Bitwise the sums of dot_row_seq (gemm_kernels.h): that kernel keeps four 8-lane partial
// sums per A row, partial j taking the vectors k = 32 s + 8 j; here one 16-lane register
// holds partials 0 and 1 and another partials 2 and 3, so every lane sees the same fused
// multiply-adds in the same order, and the reduction adds the halves as dot_row_seq adds
// its partials. A row's sum therefore does not depend on how many rows run beside it (nor
// on this path being taken), which the engine's exactness tests rely on (a speculative
// verify step of k + 1 rows must give the one-row step's logits).
//
// Why: with more than two A rows the AVX2 path is compute-bound (3 A rows a pass, the
// 16 ymm registers) and its weight reads do not overlap the arithmetic: a cold [3072, 576]
// weight against 8 rows took the one-row time plus the warm eight-row time. Here a pass
// takes up to 8 rows (16 accumulators of the 32 zmm registers) and the rows 4 ahead are
// prefetched into L2 during the first pass (see dot_group for long rows). Measured (2 threads,
// weights cold, EPYC Zen 4 VM; standalone kernel, medians of 200 calls): [3072, 576] x 8 rows 472
// -> 289-306 us, x 4 rows 233 -> 188-191 us, x 16 rows 917 -> 778-796 us; [49152, 576] x 8 rows 7.3
// -> 4.3 ms; [576, 1536] x 8 rows 297 -> 241 us. At 1 and 2 rows the hardware prefetcher alone is
// as fast or faster there (209 vs 221 us, 211 vs 225 us), so on AMD those keep the AVX2 path.
// On Intel (a 2-core Xeon VM with AVX-512 and AMX, 2026-12-04) the same one-row AVX2 path
// streamed at 24-26 GB/s where torch's own readers reached 33-36: the L2 prefetch of the rows
// ahead is what it lacked, and this path from one row up took the plan's fp32 batch-1 step
// from 21.3-22.0 to 19.6-20.1 ms (three processes each, alternating; bitwise the same).
// So f32x16_min_rows() is 1 on Intel CPUs and 3 elsewhere; one row reads four weight rows
// side by side (dot_side1, 2026-12-05: another 7% off that step).
// TOPG_DISABLE_AVX512=1 turns it off (with the AVX-512 BF16 path).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "vec.h"

namespace topg::gemm {

// The CPU has AVX-512 F / BW / VL / DQ and TOPG_DISABLE_AVX512 is not set.
inline bool use_avx512() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool on = [] {
    const char* off = std::getenv("TOPG_DISABLE_AVX512");
    if (off && off[0] && off[0] != '0') return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return on;
#else
  return false;
#endif
}

// Calls f.template operator()<R>() with R = r for a run-time r in [1, N] (r > N: N): a
// kernel templated on its row count, instantiated once per count.
template <int N, typename F>
inline void with_rows(int r, F&& f) {
  if constexpr (N > 1) {
    if (r < N) return with_rows<N - 1>(r, f);
  }
  f.template operator()<N>();
}

// Rows of A from which the AVX-512 fp32 path is taken by linear_q's fp32-activation GEMV
// (the dense fp32 GEMV takes f32x16_min_rows()).
constexpr int64_t kF32x16MinRows = 3;

// Rows of A from which the dense fp32 GEMV takes the AVX-512 path: 1 on Intel CPUs, where
// its prefetch of the rows ahead makes even one row stream faster, else kF32x16MinRows (see
// the top of this file).
inline int64_t f32x16_min_rows() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const int64_t rows = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") ? int64_t(1) : kF32x16MinRows;
  }();
  return rows;
#else
  return kF32x16MinRows;
#endif
}

// Rows per pass.
constexpr int kF32x16Rows = 8;

// Weight rows taken together: the first pass over a group prefetches the next group.
constexpr int kF32x16Group = 4;
// A pass whose A rows (rows x K fp32) exceed this no longer sits in L1 beside the weight
// row: the group's rows then run in K chunks of kF32x16Chunk, the sums parked in memory
// between chunks. Measured (2 threads, cold, standalone kernel): [576, 1536] x 8 rows
// 255-277 -> 154-232 us chunked; x 4 rows (24 KiB of A) 105 whole against 132 chunked.
constexpr int64_t kF32x16L1Bytes = 24 << 10;
constexpr int64_t kF32x16Chunk = 384;  // a multiple of 32: the lanes' k order is kept
// One A row (dot_side1): weight rows read kF32x16Group side by side, each row's lines this
// far ahead prefetched into L2. Measured on the Intel VM (the decode plan's fp32 batch-1
// step, one process, 10 alternating rounds each, bitwise the same output), against
// dot_group<1> (one row after another, the next group prefetched): 8 / 16 / 32 KiB ahead
// 0.95 / 0.94 / 0.96x the time; in a second process 12 / 16 / 24 KiB 0.94 / 0.93 / 0.93x
// (23.4 -> 21.7 ms at 16 KiB) and 2 / 8 rows side by side 0.93 / 0.94x. Two and three A
// rows side by side were slower or even (1.12x / 0.98x at batch 2 / 3): they keep
// dot_group. A standalone stream over 2 GiB ([N, 576], 2 threads): 25.6-25.8 GB/s one row
// after another, 27.1-27.7 side by side 16-32 KiB ahead, torch.dot's 26.7-26.9.
constexpr int64_t kF32x16Ahead = 16 << 10;

// A 64-byte aligned float buffer that keeps its storage between uses.
class AlignedFloats {
 public:
  // n floats (contents undefined).
  float* fit(int64_t n) {
    buf_.resize(size_t(n + 16));
    const auto p = reinterpret_cast<uintptr_t>(buf_.data());
    return buf_.data() + ((64 - p % 64) % 64) / sizeof(float);
  }

 private:
  std::vector<float> buf_;
};

// The interleaved copy of M fp32 A rows that a GEMV reading them `pass` rows at a time
// loads its A vectors from (gemm_kernels.h interleave_a_rows): for each pass of up to
// `pass` rows from m0, its rows' values k < K rounded down to 32, 32 at a time row after
// row: il[m0 * kv + k * mb + 32 i + k % 32] = a[m0 + i][k] (kv = K / 32 * 32, mb the
// pass's rows). il: M x kv floats, 64-byte aligned. The sums are the same fused
// multiply-adds in the same order as with the row pointers: only where each A vector is
// loaded from changes.
inline void pack_passes(const float* const* a, int64_t M, int64_t K, int64_t pass, float* il) {
  const int64_t kv = K / 32 * 32;
  for (int64_t m0 = 0; m0 < M; m0 += pass) {
    const int64_t mb = std::min<int64_t>(pass, M - m0);
    float* dst = il + m0 * kv;
    for (int64_t k = 0; k < kv; k += 32)
      for (int64_t i = 0; i < mb; ++i, dst += 32) std::copy(a[m0 + i] + k, a[m0 + i] + k + 32, dst);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define TOPG_F32X16 1
#define TOPG_TARGET_F32X16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

// r[j] = the sum of v[j]'s 16 lanes, for j < 16: per 128-bit lane L, S_L = (l0 + l2) +
// (l1 + l3), then (S_0 + S_1) + (S_2 + S_3) (a fixed tree: the same order every call).
TOPG_TARGET_F32X16 __attribute__((always_inline)) inline __m512 reduce16(const __m512* v) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: that lane's sums of 4 vectors
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)  // lanes 0+1 and 2+3 of two of them
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// s[j] = the sum of v[j]'s 16 lanes for j < 8, in reduce16's order (its first three steps
// on 8 vectors).
TOPG_TARGET_F32X16 __attribute__((always_inline)) inline void reduce8(const __m512* v, float* s) {
  __m512 b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 e = _mm512_add_ps(d, _mm512_shuffle_f32x4(d, d, _MM_SHUFFLE(2, 3, 0, 1)));
  // e's 128-bit lanes: [v0..v3 sums, same, v4..v7 sums, same]
  _mm256_storeu_ps(s, _mm512_castps512_ps256(_mm512_shuffle_f32x4(e, e, _MM_SHUFFLE(2, 0, 2, 0))));
}

// acc[i][0] lanes 0-7 / 8-15: dot_row_seq's partials 0 / 1 of A row i, acc[i][1]: 2 / 3.
template <int MB>
using Acc16 = __m512[MB][2];

// A pass of MB rows reads them from the caller's interleaved copy (pack_passes, kF32x16Rows
// a pass) when there is one. Measured (standalone, [N, 576] fp32 x 400 MiB, 2 threads,
// weights cold, 15 alternating rounds, GB/s, row pointers / interleaved): 3 rows 24.6 /
// 26.5, 4 rows 27.4-32.4 / 25.7-28.1, 5 rows 27.0-27.1 / 29.5-30.6, 6 rows 22.9 / 25.0, 7
// rows 24.0 / 26.3, 8 rows 22.3 / 24.9, 2 rows 28.3 / 28.3: 4 rows keep their pointers. In
// the decode plan (SmolLM2 fp32, one sequence of T tokens against one token, 3 alternating
// processes, 2026-12-05): T = 3 / 5 / 6 / 8 / 9 1.08-1.10 / 1.17-1.18 / 1.23-1.26 /
// 1.34-1.39 / 1.45-1.52 -> 1.03-1.05 / 1.08-1.10 / 1.13-1.14 / 1.23-1.24 / 1.34-1.35.
template <int MB>
constexpr bool kF32x16Interleaved = MB == 3 || MB >= 5;

// acc += the products of k in [k0, k1) (multiples of 32); pf: a row to prefetch into L2
// over the same k (nullptr: none), two cache lines per 32 k. IL: the A vectors from il
// (this pass's rows of pack_passes), else from the row pointers a.
template <int MB, bool IL>
TOPG_TARGET_F32X16 inline void fma_span(Acc16<MB>& acc, const float* const* a, const float* il,
                                        const float* w, int64_t k0, int64_t k1, const float* pf) {
  for (int64_t k = k0; k < k1; k += 32) {
    if (pf) {
      _mm_prefetch(reinterpret_cast<const char*>(pf + k), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(pf + k + 16), _MM_HINT_T1);
    }
    const __m512 w0 = _mm512_loadu_ps(w + k), w1 = _mm512_loadu_ps(w + k + 16);
    if constexpr (IL) {
      const float* ak = il + k * MB;
      for (int i = 0; i < MB; ++i) {
        acc[i][0] = _mm512_fmadd_ps(_mm512_load_ps(ak + 32 * i), w0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(_mm512_load_ps(ak + 32 * i + 16), w1, acc[i][1]);
      }
    } else {
      for (int i = 0; i < MB; ++i) {
        acc[i][0] = _mm512_fmadd_ps(_mm512_loadu_ps(a[i] + k), w0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(_mm512_loadu_ps(a[i] + k + 16), w1, acc[i][1]);
      }
    }
  }
}

// The rest of k from k (K rounded down to 32) and the reduction: out[i], bitwise
// dot_row_seq<MB>'s sums.
template <int MB>
TOPG_TARGET_F32X16 inline void finish(Acc16<MB>& acc, const float* const* a, const float* w,
                                      int64_t k, int64_t K, float* out) {
  // dot_row_seq's tail of 1..3 vectors of 8 goes to partials 0, 1, 2 in turn: masked
  // lanes keep their accumulator untouched (not even a + 0, which would turn -0 into +0).
  if (const int64_t vecs = (K - k) / 8; vecs > 0) {
    const __mmask16 m0 = vecs >= 2 ? 0xffff : 0x00ff, m1 = vecs == 3 ? 0x00ff : 0;
    const __m512 w0 = _mm512_maskz_loadu_ps(m0, w + k), w1 = _mm512_maskz_loadu_ps(m1, w + k + 16);
    for (int i = 0; i < MB; ++i) {
      acc[i][0] = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(m0, a[i] + k), w0, acc[i][0], m0);
      acc[i][1] =
          _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(m1, a[i] + k + 16), w1, acc[i][1], m1);
    }
    k += 8 * vecs;
  }
  for (int i = 0; i < MB; ++i) {
    const __m256 p01 =
        _mm256_add_ps(_mm512_castps512_ps256(acc[i][0]), _mm512_extractf32x8_ps(acc[i][0], 1));
    const __m256 p23 =
        _mm256_add_ps(_mm512_castps512_ps256(acc[i][1]), _mm512_extractf32x8_ps(acc[i][1], 1));
    float s = Vec8(_mm256_add_ps(p01, p23)).sum();
    for (int64_t kk = k; kk < K; ++kk) s = std::fma(a[i][kk], w[kk], s);  // as dot_row_seq
    out[i] = s;
  }
}

// out[r * MB + i] = a[i] . w[r] for g <= kF32x16Group weight rows w + r * ldw. The first
// npf rows prefetch the row kF32x16Group below them. IL: A read from il (fma_span).
template <int MB, bool IL>
TOPG_TARGET_F32X16 void dot_group(const float* const* a, const float* il, const float* w,
                                  int64_t ldw, int64_t K, int g, int npf, float* out) {
  const int64_t kv = K / 32 * 32;
  const auto ahead = [&](int r) { return r < npf ? w + (r + kF32x16Group) * ldw : nullptr; };
  if (MB * K * int64_t(sizeof(float)) <= kF32x16L1Bytes) {
    for (int r = 0; r < g; ++r) {
      Acc16<MB> acc;
      for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
      fma_span<MB, IL>(acc, a, il, w + r * ldw, 0, kv, ahead(r));
      finish<MB>(acc, a, w + r * ldw, kv, K, out + r * MB);
    }
    return;
  }
  __m512 park[kF32x16Group][MB][2];
  for (int r = 0; r < g; ++r)
    for (int i = 0; i < MB; ++i) park[r][i][0] = park[r][i][1] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < kv; k0 += kF32x16Chunk) {
    const int64_t k1 = std::min(kv, k0 + kF32x16Chunk);
    for (int r = 0; r < g; ++r) {
      Acc16<MB> acc;
      for (int i = 0; i < MB; ++i) acc[i][0] = park[r][i][0], acc[i][1] = park[r][i][1];
      fma_span<MB, IL>(acc, a, il, w + r * ldw, k0, k1, ahead(r));
      for (int i = 0; i < MB; ++i) park[r][i][0] = acc[i][0], park[r][i][1] = acc[i][1];
    }
  }
  for (int r = 0; r < g; ++r) {
    Acc16<MB> acc;
    for (int i = 0; i < MB; ++i) acc[i][0] = park[r][i][0], acc[i][1] = park[r][i][1];
    finish<MB>(acc, a, w + r * ldw, kv, K, out + r * MB);
  }
}

// One A row: G weight rows read side by side (out[r] = a . w[r]), each row's lines
// kF32x16Ahead bytes ahead prefetched into L2 while they stay below pf_end. Each row's
// sum takes the same fused multiply-adds in the same order as dot_group<1>'s.
template <int G>
TOPG_TARGET_F32X16 void dot_side1(const float* a, const float* w, int64_t ldw, int64_t K,
                                  const char* pf_end, float* out) {
  const int64_t kv = K / 32 * 32;
  Acc16<1> acc[G];
  for (int r = 0; r < G; ++r) acc[r][0][0] = acc[r][0][1] = _mm512_setzero_ps();
  const char* pf[G];
  for (int r = 0; r < G; ++r) pf[r] = reinterpret_cast<const char*>(w + r * ldw) + kF32x16Ahead;
  const bool ahead = pf[G - 1] + K * int64_t(sizeof(float)) <= pf_end;
  for (int64_t k = 0; k < kv; k += 32) {
    const __m512 x0 = _mm512_loadu_ps(a + k), x1 = _mm512_loadu_ps(a + k + 16);
    for (int r = 0; r < G; ++r) {
      const float* row = w + r * ldw;
      acc[r][0][0] = _mm512_fmadd_ps(x0, _mm512_loadu_ps(row + k), acc[r][0][0]);
      acc[r][0][1] = _mm512_fmadd_ps(x1, _mm512_loadu_ps(row + k + 16), acc[r][0][1]);
    }
    if (ahead)
      for (int r = 0; r < G; ++r) {
        _mm_prefetch(pf[r] + k * 4, _MM_HINT_T1);
        _mm_prefetch(pf[r] + k * 4 + 64, _MM_HINT_T1);
      }
  }
  for (int r = 0; r < G; ++r) finish<1>(acc[r], &a, w + r * ldw, kv, K, out + r);
}

// For weight rows [n0, n1) of W (fp32 [N, K], row stride ldw) and M fp32 rows a[0..M):
// emit(m, n, sum) for every pair; groups of 4 weight rows against up to 8 A rows a pass.
// il: the rows' pack_passes copy (kF32x16Rows a pass), or nullptr (the row pointers only;
// the same sums).
template <typename Emit>
TOPG_TARGET_F32X16 void dot_rows_f32x16(const float* const* a, int64_t M, const float* w,
                                        int64_t ldw, int64_t K, int64_t n0, int64_t n1, Emit&& emit,
                                        const float* il = nullptr) {
  constexpr int G = kF32x16Group;
  float sums[G * kF32x16Rows];
  if (M == 1) {
    const char* end = reinterpret_cast<const char*>(w + (n1 - 1) * ldw + K);
    for (int64_t n = n0; n < n1; n += G) {
      const int g = int(std::min<int64_t>(G, n1 - n));
      with_rows<G>(g, [&]<int R>() { dot_side1<R>(a[0], w + n * ldw, ldw, K, end, sums); });
      for (int r = 0; r < g; ++r) emit(0, n + r, sums[r]);
    }
    return;
  }
  for (int64_t n = n0; n < n1; n += G) {
    const int g = int(std::min<int64_t>(G, n1 - n));
    const int npf = int(std::clamp<int64_t>(n1 - n - G, 0, g));
    const float* rows = w + n * ldw;
    for (int64_t m = 0; m < M; m += kF32x16Rows) {
      const int mb = int(std::min<int64_t>(kF32x16Rows, M - m));
      const int pf = m == 0 ? npf : 0;
      with_rows<kF32x16Rows>(mb, [&]<int MB>() {
        if constexpr (kF32x16Interleaved<MB>) {
          if (il)
            return dot_group<MB, true>(a + m, il + m * (K / 32 * 32), rows, ldw, K, g, pf, sums);
        }
        dot_group<MB, false>(a + m, nullptr, rows, ldw, K, g, pf, sums);
      });
      for (int i = 0; i < mb; ++i)
        for (int r = 0; r < g; ++r) emit(m + i, n + r, sums[r * mb + i]);
    }
  }
}
#else
#define TOPG_F32X16 0
#endif

}  // namespace topg::gemm
