// Weight-only quantised formats (torch_topg/formats.py): the dot product of a float
// activation row with one packed weight row (block de-quantisation: quant_dequant.h).
//
// Torch-free: raw pointers and the types of vec.h. Two dot products of a packed row:
//   dot_row     fp32 activations, weights de-quantised in registers: per block
//               d * sum(q * x) (+ m * sum(x) for the formats with a minimum), one FMA
//               per weight (the default: results within fp32 rounding of the reference);
//   dot_rows    the same for several activation rows, each packed row made fp32 once.
// The int8-activation GEMV (dot_row_q8, linear_q's int8_activations) is in quant_act.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/quant_formats.h"
#include "gemv_avx512.h"
#include "quant_dequant.h"
#include "vec.h"

namespace topg::quant {

// --- dot products: fp32 activations x [padded(k)] ------------------------------------
#if TOPG_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// 16 bytes of nibbles -> 32 codes (low nibbles first), as int8 in a __m256i.
inline __m256i unpack16(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}
// q5_0 / q5_1's codes: 4 bytes qh (bit i of the word: code i's bit 4) and 16 bytes of
// nibbles (unpack16), codes 0..31 as bytes. Byte i of the broadcast word's lane picks qh's
// byte i / 8 (shuffle), keeps bit i % 8 (and) and turns it into 16 (compare, and).
inline __m256i unpack_q5(const uint8_t* qh, const uint8_t* qs) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  const __m256i pick =
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
  const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(int(h)), pick), bit);
  const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(16));
  return _mm256_or_si256(unpack16(qs), high);
}
// 32 bytes of nibbles -> (low nibbles, high nibbles), 32 codes each.
inline void unpack32(const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i m = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(b, m);
  hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
}
// q6_k's 32-runs of one half (128 weights): run r's codes from ql (64 bytes), qh (32).
__attribute__((always_inline)) inline void q6k_runs(const uint8_t* ql, const uint8_t* qh,
                                                    __m256i u[4]) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
  // bits 4-5 of each code: qh's bit pairs 0-1, 2-3, 4-5, 6-7 moved there (16-bit shifts
  // carry bits across bytes only into positions the mask clears)
  u[0] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m2));
  u[1] = _mm256_or_si256(_mm256_and_si256(b, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m2));
  u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(h, m2));
  u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4),
                         _mm256_and_si256(_mm256_srli_epi16(h, 2), m2));
}

// q4_k's 32-runs of the super-block p: runs 2c and 2c + 1 are the low and high nibbles
// of qs[32c, 32c + 32) (qs at p + 16). q5_k (qs at p + 48): bit j of qh[i] (qh at p + 16)
// is bit 4 of run j's code i.
template <Fmt F>
__attribute__((always_inline)) inline void k45_runs(const uint8_t* p, int c, __m256i& lo,
                                                    __m256i& hi) {
  const uint8_t* qs = p + (F == Fmt::q5_k ? 48 : 16);
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(b, m4);
  hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
  if constexpr (F == Fmt::q5_k) {
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const __m256i b0 = _mm256_set1_epi8(char(1 << (2 * c))),
                  b1 = _mm256_set1_epi8(char(2 << (2 * c)));
    const __m256i sixteen = _mm256_set1_epi8(0x10);
    lo = _mm256_or_si256(
        lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), sixteen));
    hi = _mm256_or_si256(
        hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), sixteen));
  }
}
#endif

#if TOPG_AVX2
// acc[j] += (q[8j..8j+7] * d + m) * x[8j..8j+7] for j < 4: the weights of a 32-run made
// fp32 in registers. Four independent accumulators: the FMA chains overlap (one chain
// of dependent FMAs per block was latency-bound at ~1.5 weights per cycle).
inline void fma32(__m256i q, __m256 d, __m256 m, const float* x, __m256 acc[4]) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int j = 0; j < 4; ++j) {
    const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[j])), d, m);
    acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * j), acc[j]);
  }
}
// fma32 without a minimum, the scale d_lo for codes 0..15 and d_hi for 16..31 (q6_k: a scale per
// 16).
inline void fma32_16(__m256i q, __m256 d_lo, __m256 d_hi, const float* x, __m256 acc[4]) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  const __m256 zero = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[j])),
                                     j < 2 ? d_lo : d_hi, zero);
    acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * j), acc[j]);
  }
}
inline float hsum4(const __m256 acc[4]) {
  return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}
#endif

// The GEMVs read a weight's packed rows in order (rows are contiguous), one thread a
// range of rows, and stream their prefetches: as the block at p is read, the line
// kStreamAhead bytes on is prefetched (T0; stream_ahead, per block, here and in
// quant_act.h), running on into the next rows (past the weight's end it does not fault).
// The first form prefetched a whole row 4 rows ahead at the row's start (prefetch_ahead,
// kept for the int8-activation GEMV's AVX2 form, which only CPUs without VNNI run): a
// burst of 68 prefetches per 4096-long q8_0 row filled the miss queue, then the bus idled.
// Standalone harness, 2 threads, weights cold, 30 alternations (2026-12-02, a 2-core
// Intel Xeon VM with AVX-512 VNNI / BF16 and AMX, read rate 13-20 GB/s). Share of a plain
// read loop's rate, row-ahead / streaming, int8 activations (VNNI): [4096, 4096] q8_0 83-87% /
// 97-103%, int8 66-83% / 93-102%, q4_1 62-74% / 81%; [1536, 576] q8_0 94% / 101%; distance 1 KiB
// 80-90%, 2 KiB 86-92%, 8 KiB as 4 KiB. fp32 activations, us: q8_0 [4096, 4096] 1600 / 968, [1536,
// 576] 59 / 53, q4_1 [4096, 4096] 1331 / 1059. (The row-ahead form against none, SmolLM2 decode, 12
// interleaved process pairs: q8_0 int8 activations 7.36 / 6.05, 5.53 / 5.19, 7.40 / 6.22
// ms, none / row-ahead.) always_inline: GCC 12 took a non-inlined helper holding only
// prefetches as free of side effects and dropped its calls. The VNNI int8 forms prefetch
// into L2 (T1), not L1: on the same machine type with a faster memory (2026-12-06, fp32
// read probe 34 GB/s) a thread streamed q8_0 at 11 GB/s with T0 prefetches (L1's fill
// buffers cap its misses in flight), 13.5 with T1; 2 threads, weights in huge pages,
// 30-40 [N, 2048] weights in turn: q8_0 +14%, q4_0 +4-13%, q6_k +9-11%, q4_k within the
// noise (+-5%); 8 KiB ahead as 4.
inline constexpr int64_t kStreamAhead = 4096;
// Where stream_ahead's lines go: L1 (T0) for the fp32-activation forms here, the AVX2
// int8 forms and VNNI q4_k / q5_k; L2 (T1) for the other VNNI int8 forms (measured above;
// with T1 the 3B Q4_K_M step went 102.6 -> 106.0 ms, and the fp32-activation q8_0 form
// 169.6 -> 180.6 ms a 3B step).
enum class Ahead { l1, l2 };
template <Ahead A = Ahead::l1>
__attribute__((always_inline)) inline void stream_ahead(const uint8_t* p, int64_t n = 1) {
#if defined(__x86_64__) || defined(__i386__)
  const char* q = reinterpret_cast<const char*>(p) + kStreamAhead;
  for (int64_t l = 0; l < n; l += 64) {
    if constexpr (A == Ahead::l1) {
      _mm_prefetch(q + l, _MM_HINT_T0);
    } else {
      _mm_prefetch(q + l, _MM_HINT_T1);
    }
  }
#else
  (void)p, (void)n;
#endif
}
inline constexpr int64_t kPrefetchRows = 4;
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* row, int64_t rb) {
#if defined(__x86_64__) || defined(__i386__)
  const uintptr_t p = reinterpret_cast<uintptr_t>(row) + uintptr_t(kPrefetchRows * rb);
  for (int64_t i = 0; i < rb; i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + uintptr_t(i)), _MM_HINT_T0);
#else
  (void)row, (void)rb;
#endif
}

#if TOPG_AVX2
// The K-quants' 32-runs as fp32 weights are made from them: run(q, d, m, x0) for each run
// of nb super-blocks (its codes q, weights q * d + m, its activations at x0), in order.
// dot_row (fma32) and runs_fp32 (store32) consume the same runs, so they agree bitwise.
template <Fmt F, typename Run>
__attribute__((always_inline)) inline void k45_each(const uint8_t* row, int64_t nb, Run&& run) {
  constexpr int64_t bb = F == Fmt::q5_k ? 176 : 144;  // q4_k / q5_k: u d sc_j - dmin m_j
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + bb * b;
    stream_ahead(p, bb);
    const float d = half_at(p), dmin = half_at(p + 2);
    uint8_t sc[8], mn[8];
    k_scales(p + 4, sc, mn);
    for (int c = 0; c < 4; ++c) {
      __m256i lo, hi;
      k45_runs<F>(p, c, lo, hi);
      run(lo, _mm256_set1_ps(d * float(sc[2 * c])), _mm256_set1_ps(-dmin * float(mn[2 * c])),
          256 * b + 64 * c);
      run(hi, _mm256_set1_ps(d * float(sc[2 * c + 1])),
          _mm256_set1_ps(-dmin * float(mn[2 * c + 1])), 256 * b + 64 * c + 32);
    }
  }
}
// q6_k: run(q - 32, d sc for codes 0..15, for 16..31, x0).
template <typename Run>
__attribute__((always_inline)) inline void q6k_each(const uint8_t* row, int64_t nb, Run&& run) {
  const __m256i k32 = _mm256_set1_epi8(32);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + 210 * b;
    stream_ahead(p, 210);
    const float d = half_at(p + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    for (int h = 0; h < 2; ++h) {
      __m256i u[4];
      q6k_runs(p + 64 * h, p + 128 + 32 * h, u);
      for (int r = 0; r < 4; ++r) {
        const int j = 4 * h + r;
        run(_mm256_sub_epi8(u[r], k32), _mm256_set1_ps(d * float(sc[2 * j])),
            _mm256_set1_ps(d * float(sc[2 * j + 1])), 256 * b + 32 * j);
      }
    }
  }
}
#endif

// sum over the row's k weights of w * x (x: fp32, zero-padded to padded(k)).
inline float dot_row(const Format& f, const uint8_t* row, int64_t k, const float* x) {
  const int64_t nb = f.blocks(k);
#if TOPG_AVX2
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  const __m256 zero = _mm256_setzero_ps();
  switch (f.fmt) {
    case Fmt::q8_0:
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 34 * b;
        stream_ahead(p);
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
        fma32(q, _mm256_set1_ps(half_at(p)), zero, x + 32 * b, acc);
      }
      return hsum4(acc);
    case Fmt::q4_0: {
      const __m256i eight = _mm256_set1_epi8(8);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 18 * b;
        stream_ahead(p);
        fma32(_mm256_sub_epi8(unpack16(p + 2), eight), _mm256_set1_ps(half_at(p)), zero, x + 32 * b,
              acc);
      }
      return hsum4(acc);
    }
    case Fmt::q4_1:  // int4 with groups of 32 computes the same (the general loop below)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 20 * b;
        stream_ahead(p);
        fma32(unpack16(p + 4), _mm256_set1_ps(half_at(p)), _mm256_set1_ps(half_at(p + 2)),
              x + 32 * b, acc);
      }
      return hsum4(acc);
    case Fmt::q5_0: {
      const __m256i sixteen = _mm256_set1_epi8(16);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 22 * b;
        stream_ahead(p);
        fma32(_mm256_sub_epi8(unpack_q5(p + 2, p + 6), sixteen), _mm256_set1_ps(half_at(p)), zero,
              x + 32 * b, acc);
      }
      return hsum4(acc);
    }
    case Fmt::q5_1:
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 24 * b;
        stream_ahead(p);
        fma32(unpack_q5(p + 4, p + 8), _mm256_set1_ps(half_at(p)), _mm256_set1_ps(half_at(p + 2)),
              x + 32 * b, acc);
      }
      return hsum4(acc);
    case Fmt::int4: {
      const int64_t g = f.block, bb = f.block_bytes, half = g / 2;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + bb * b;
        stream_ahead(p, bb);
        const float* xb = x + g * b;
        const __m256 d = _mm256_set1_ps(half_at(p)), m = _mm256_set1_ps(half_at(p + 2));
        if (g == 32) {
          fma32(unpack16(p + 4), d, m, xb, acc);
          continue;
        }
        for (int64_t c = 0; c < half / 32; ++c) {  // low nibbles 32 c.., high half + 32 c..
          __m256i lo, hi;
          unpack32(p + 4 + 32 * c, lo, hi);
          fma32(lo, d, m, xb + 32 * c, acc);
          fma32(hi, d, m, xb + half + 32 * c, acc);
        }
      }
      return hsum4(acc);
    }
    case Fmt::int8: {
      float s;
      std::memcpy(&s, row, 4);
      const uint8_t* q = row + 4;
      const __m256 one = _mm256_set1_ps(1.f);
      int64_t i = 0;
      for (; i + 32 <= k; i += 32) {
        stream_ahead(q + i);
        fma32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i)), one, zero, x + i, acc);
      }
      float tail = 0.f;
      for (; i < k; ++i) tail += float(int8_t(q[i])) * x[i];
      return (hsum4(acc) + tail) * s;
    }
    case Fmt::q4_k:
      k45_each<Fmt::q4_k>(
          row, nb, [&](__m256i q, __m256 d, __m256 m, int64_t x0) { fma32(q, d, m, x + x0, acc); });
      return hsum4(acc);
    case Fmt::q5_k:
      k45_each<Fmt::q5_k>(
          row, nb, [&](__m256i q, __m256 d, __m256 m, int64_t x0) { fma32(q, d, m, x + x0, acc); });
      return hsum4(acc);
    case Fmt::q6_k:
      q6k_each(row, nb, [&](__m256i q, __m256 lo, __m256 hi, int64_t x0) {
        fma32_16(q, lo, hi, x + x0, acc);
      });
      return hsum4(acc);
    default:
      break;
  }
#endif
  float w[256];
  float total = 0.f;
  if (f.block == 0) {  // int8 without AVX2
    float s;
    std::memcpy(&s, row, 4);
    for (int64_t i = 0; i < k; ++i) total += float(int8_t(row[4 + i])) * x[i];
    return total * s;
  }
  for (int64_t b = 0; b < nb; ++b) {
    stream_ahead(row + b * f.block_bytes, f.block_bytes);
    dequant_block(f, row + b * f.block_bytes, f.block, w);
    const float* xb = x + b * f.block;
#if TOPG_AVX2
    __m256 a = _mm256_setzero_ps();
    for (int64_t i = 0; i < f.block; i += 8)
      a = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(xb + i), a);
    total += hsum(a);
#else
    for (int64_t i = 0; i < f.block; ++i) total += w[i] * xb[i];
#endif
  }
  return total;
}

// --- several activation rows against one packed row ----------------------------------
// dot_rows(f, row, k, x, M, out, wbuf): out[m] = dot_row(f, row, k, x[m]) for m < M,
// bitwise (each m's sum runs the same FMAs in the same order), with the row's weights
// made fp32 once into wbuf (padded(k) floats) instead of once per m. So linear_q's GEMV
// is invariant to M, and the decode plan, calling it per weight row, agrees with the op.
#if TOPG_AVX2
// The weights of the AVX2 formats in the order dot_row's fma32 consumes them: 32-runs,
// each stored at wbuf + 32 * r with its activations at x + xoff[r]. Returns the runs.
// 32 codes made fp32 as fma32 makes them: q * d + m.
// With a scale per 16 codes (as fma32_16 makes them).
__attribute__((always_inline)) inline void store32_16(__m256i q, __m256 d_lo, __m256 d_hi,
                                                      float* dst) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int j = 0; j < 4; ++j)
    _mm256_storeu_ps(dst + 8 * j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[j])),
                                                  j < 2 ? d_lo : d_hi, _mm256_setzero_ps()));
}
__attribute__((always_inline)) inline void store32(__m256i q, __m256 d, __m256 m, float* dst) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int j = 0; j < 4; ++j)
    _mm256_storeu_ps(dst + 8 * j,
                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[j])), d, m));
}

inline int64_t runs_fp32(const Format& f, const uint8_t* row, int64_t k, float* wbuf,
                         int64_t* xoff) {
  int64_t n = 0;
#define put(q, d, m, x0) (store32((q), (d), (m), wbuf + 32 * n), xoff[n++] = (x0))
  const __m256 zero = _mm256_setzero_ps();
  const int64_t nb = f.blocks(k);
  switch (f.fmt) {
    case Fmt::q8_0:
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 34 * b;
        stream_ahead(p);
        put(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2)), _mm256_set1_ps(half_at(p)),
            zero, 32 * b);
      }
      return n;
    case Fmt::q4_0: {
      const __m256i eight = _mm256_set1_epi8(8);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 18 * b;
        stream_ahead(p);
        put(_mm256_sub_epi8(unpack16(p + 2), eight), _mm256_set1_ps(half_at(p)), zero, 32 * b);
      }
      return n;
    }
    case Fmt::q4_1:
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 20 * b;
        stream_ahead(p);
        put(unpack16(p + 4), _mm256_set1_ps(half_at(p)), _mm256_set1_ps(half_at(p + 2)), 32 * b);
      }
      return n;
    case Fmt::q5_0: {
      const __m256i sixteen = _mm256_set1_epi8(16);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 22 * b;
        stream_ahead(p);
        put(_mm256_sub_epi8(unpack_q5(p + 2, p + 6), sixteen), _mm256_set1_ps(half_at(p)), zero,
            32 * b);
      }
      return n;
    }
    case Fmt::q5_1:
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + 24 * b;
        stream_ahead(p);
        put(unpack_q5(p + 4, p + 8), _mm256_set1_ps(half_at(p)), _mm256_set1_ps(half_at(p + 2)),
            32 * b);
      }
      return n;
    case Fmt::int4: {
      const int64_t g = f.block, bb = f.block_bytes, half = g / 2;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = row + bb * b;
        stream_ahead(p, bb);
        const __m256 d = _mm256_set1_ps(half_at(p)), m = _mm256_set1_ps(half_at(p + 2));
        if (g == 32) {
          put(unpack16(p + 4), d, m, g * b);
          continue;
        }
        for (int64_t c = 0; c < half / 32; ++c) {
          __m256i lo, hi;
          unpack32(p + 4 + 32 * c, lo, hi);
          put(lo, d, m, g * b + 32 * c);
          put(hi, d, m, g * b + half + 32 * c);
        }
      }
      return n;
    }
    case Fmt::int8: {  // whole 32-runs only; dot_rows sums the tail as dot_row does
      const __m256 one = _mm256_set1_ps(1.f);
      for (int64_t i = 0; i + 32 <= k; i += 32) {
        stream_ahead(row + 4 + i);
        put(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 4 + i)), one, zero, i);
      }
      return n;
    }
    case Fmt::q4_k:
      k45_each<Fmt::q4_k>(row, nb,
                          [&](__m256i q, __m256 d, __m256 m, int64_t x0) { put(q, d, m, x0); });
      return n;
    case Fmt::q5_k:
      k45_each<Fmt::q5_k>(row, nb,
                          [&](__m256i q, __m256 d, __m256 m, int64_t x0) { put(q, d, m, x0); });
      return n;
    case Fmt::q6_k:
      q6k_each(row, nb, [&](__m256i q, __m256 lo, __m256 hi, int64_t x0) {
        store32_16(q, lo, hi, wbuf + 32 * n);
        xoff[n++] = x0;
      });
      return n;
    default:
      return -1;
  }
#undef put
}

// R rows at once (R <= 3: 12 accumulators and a weight register of the 16 ymm).
template <int R>
inline void runs_dot(const float* wbuf, const int64_t* xoff, int64_t runs, const float* const* x,
                     __m256 (*acc)[4]) {
  __m256 a[R][4];  // locals: kept in registers (acc itself may alias the inputs)
  const float* xr[R];
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r) {
    xr[r] = x[r];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) a[r][j] = _mm256_setzero_ps();
  }
  for (int64_t n = 0; n < runs; ++n) {
    const float* w = wbuf + 32 * n;
    const int64_t o = xoff[n];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + 8 * j);
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r)
        a[r][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr[r] + o + 8 * j), a[r][j]);
    }
  }
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = a[r][j];
}
#endif

#if TOPG_AVX2 && TOPG_F32X16
// runs_dot for R <= 8 rows with AVX-512F (3+ rows, gemm::use_avx512()): one 16-lane
// register holds runs_dot's accumulators 0 and 1 of a row, another 2 and 3, so every lane
// runs the same FMAs in the same order and acc comes out bitwise equal (the reasoning of
// gemv_avx512.h). linear_q, [3072, 576] x 8 rows, weights cold: q4_1 470 -> 372 us,
// q8_0 411 -> 367 us (docs/decode-step.md).
template <int R>
TOPG_TARGET_F32X16 inline void runs_dot_x16(const float* wbuf, const int64_t* xoff, int64_t runs,
                                            const float* const* x, __m256 (*acc)[4]) {
  __m512 a[R][2];  // locals: kept in registers (acc may alias the inputs)
  const float* xr[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) xr[r] = x[r], a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t n = 0; n < runs; ++n) {
    const float* w = wbuf + 32 * n;
    const int64_t o = xoff[n];
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      a[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr[r] + o), a[r][0]);
      a[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr[r] + o + 16), a[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm512_castps512_ps256(a[r][0]), acc[r][1] = _mm512_extractf32x8_ps(a[r][0], 1);
    acc[r][2] = _mm512_castps512_ps256(a[r][1]), acc[r][3] = _mm512_extractf32x8_ps(a[r][1], 1);
  }
}
#endif

#if TOPG_AVX2
// runs_dot for r rows: r <= 8 with the AVX-512F form (wide), else r <= 3.
inline void runs_dot_n(int r, bool wide, const float* wbuf, const int64_t* xoff, int64_t runs,
                       const float* const* x, __m256 (*acc)[4]) {
#if TOPG_F32X16
  if (wide)
    return gemm::with_rows<8>(r, [&]<int R>() { runs_dot_x16<R>(wbuf, xoff, runs, x, acc); });
#endif
  (void)wide;
  gemm::with_rows<3>(r, [&]<int R>() { runs_dot<R>(wbuf, xoff, runs, x, acc); });
}
#endif

// Scratch for dot_rows: wbuf padded(k) floats, xoff padded(k) / 32 entries.
struct RowsScratch {
  std::vector<float> w;
  std::vector<int64_t> xoff;
  void fit(const Format& f, int64_t k) {
    if (int64_t(w.size()) < f.padded(k)) w.resize(size_t(f.padded(k)));
    if (int64_t(xoff.size()) < f.padded(k) / 32) xoff.resize(size_t(f.padded(k) / 32));
  }
};

inline void dot_rows(const Format& f, const uint8_t* row, int64_t k, const float* const* x,
                     int64_t M, float* out, RowsScratch& s) {
  if (M == 1) {
    out[0] = dot_row(f, row, k, x[0]);
    return;
  }
  s.fit(f, k);
#if TOPG_AVX2
  const int64_t runs = runs_fp32(f, row, k, s.w.data(), s.xoff.data());
  if (runs >= 0) {
    float scale = 1.f;
    int64_t tail0 = k;  // int8: weights past the last whole 32-run, summed one by one
    if (f.fmt == Fmt::int8) std::memcpy(&scale, row, 4), tail0 = k / 32 * 32;
    __m256 acc[8][4];
    const bool wide = TOPG_F32X16 && M >= gemm::kF32x16MinRows && gemm::use_avx512();
    const int64_t pass = wide ? 8 : 3;
    for (int64_t m0 = 0; m0 < M; m0 += pass) {
      const int64_t r = std::min<int64_t>(pass, M - m0);
      runs_dot_n(int(r), wide, s.w.data(), s.xoff.data(), runs, x + m0, acc);
      for (int64_t i = 0; i < r; ++i) {
        if (f.fmt != Fmt::int8) {
          out[m0 + i] = hsum4(acc[i]);
          continue;
        }
        float tail = 0.f;
        for (int64_t j = tail0; j < k; ++j) tail += float(int8_t(row[4 + j])) * x[m0 + i][j];
        out[m0 + i] = (hsum4(acc[i]) + tail) * scale;
      }
    }
    return;
  }
#endif
  for (int64_t m = 0; m < M; ++m) out[m] = dot_row(f, row, k, x[m]);
}

}  // namespace topg::quant
