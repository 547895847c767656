// linear_q's int8-activation GEMM on CPUs with AVX-512 VNNI: M >= kQ8GemmRows activation
// rows (prefill, verify steps, decode steps of a batch), outside batch-invariant mode.
// Without VNNI, the AVX2 form (gemm_q8_avx2.h) from kQ8GemmRowsAvx2 rows.
//
// The math, per scale block of SB codes along K (SB = 32; q6_k 16). The weights are
// written w = dw * u + cw with u an unsigned code (gemm_q8_pack.h lists dw, cw per
// format: q8_0 / int8 codes + 128 with cw = -128 dw, q4_0 cw = -8 dw, q4_1 / int4 cw = the
// block's minimum, q4_k / q5_k dw = d sc_j, cw = -dmin m_j, q6_k dw = d sc_i, cw = -32 dw),
// the activations x = xd * q (q int8 per block of 32, quant::quantize_act). Then
//   sum(w * x) = dw * xd * sum(u * q) + cw * xd * sum(q),
// and sum(u * q) is what vpdpbusd computes (unsigned x signed bytes, four products to an
// int32 lane, no saturation: |sum| <= 32 * 255 * 127). sum(q) is the activations' code
// sum per 32 (quantize_act's), or per 16 for q6_k (gemm_q8_sums16, once per call). The
// result equals the reference's (weights de-quantised, activations rounded per block) up
// to fp32 rounding: the products are exact in int32, the block terms are summed in fp32.
//
// The layout (gemm_q8_pack.h): 16 weight rows across the 16 int32 lanes of a zmm, for
// every 4 codes along K. One vpdpbusd with 4 codes of an activation row broadcast to the
// 16 lanes adds 4 products to each row's int32 sum (64 products), SB / 4 of them finish a
// scale block, and the block's scales cost one multiply and two FMAs for 16 rows x 1
// activation row. A tile is 2 groups (32 rows) x 6 activation rows: 12 int32 and 12 fp32
// accumulators and 2 weight registers.
//
// Work items: a strip of 32 weight rows, unpacked into the layout in a per-thread scratch
// (gemm_q8_pack.h: 32 rows x padded K codes + scales, 64 KiB at K = 2048, in L2), then
// all M activation rows run over it. Each weight byte is read once per call, and nothing
// of the size of the weight is written.
//
// Every (weight row, activation row) sum takes the same operations in whatever tile,
// strip or call it lands (a lane's own int32 products, then its fp32 FMAs in block
// order), so a row's result depends neither on M nor on how the weight rows are split:
// linear_q and the decode plan (plan_gemv.h), which split the rows differently, agree
// bitwise. What does depend on M is the choice between this GEMM and the GEMV
// (quant_act.h, a different fp32 summation order): use_gemm_q8 (the threshold), which
// batch-invariant mode turns off, so that there every M takes the GEMV.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gemm_q8_avx2.h"
#include "gemm_q8_avx2_k.h"
#include "gemm_q8_pack.h"
#include "gemv_avx512.h"
#include "modes.h"
#include "parallel.h"
#include "quant_act.h"

namespace topg::quant {

// Activation rows from which linear_q, the decode plan and fused_moe_q's experts take the
// GEMM instead of the GEMV (int8 activations, not batch-invariant): with AVX-512 VNNI, and
// in the AVX2 form (gemm_q8_avx2.h); measured in docs/cpu-kernels.md.
inline constexpr int64_t kQ8GemmRows = 4;
inline constexpr int64_t kQ8GemmRowsAvx2 = 8;

// Whether M activation rows against a weight in format f take the integer GEMM.
inline bool use_gemm_q8(Fmt f, int64_t M) {
#if defined(__x86_64__) && defined(__GNUC__) && TOPG_AVX2
  if (!int8_gemm(f) || batch_invariant()) return false;
  if (use_vnni()) return M >= kQ8GemmRows;
  return M >= kQ8GemmRowsAvx2 && !avx2_signed(f);
#else
  (void)f, (void)M;
  return false;
#endif
}

#if defined(__x86_64__) && defined(__GNUC__) && TOPG_AVX2
// out[m * kw / 16 + i] = the sum of codes [16 i, 16 i + 16) of row m of x, m < M.
inline void gemm_q8_sums16(const VnniActs& x, int64_t M, int64_t kw, float* out) {
  const __m128i flip = _mm_set1_epi8(char(0x80)), zero = _mm_setzero_si128();
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* q = x.q + x.row(m) * x.kp;
    float* o = out + m * (kw / 16);
    for (int64_t i = 0; i < kw / 16; ++i) {  // |codes| + 128, summed per 8, less 2 x 1024
      const __m128i v =
          _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i)), flip);
      const __m128i s = _mm_sad_epu8(v, zero);
      o[i] = float(_mm_cvtsi128_si32(s) + _mm_extract_epi32(s, 2) - 2048);
    }
  }
}

// out[(m0 + c) * ldo + 16 r + j] (c < C activation rows, r < R groups, j < 16 rows of a
// group; columns from 16 r + j >= cols not written) = the rows' sums. OFF (gemm_offset):
// cw = OFF * dw, so the block's constant term joins its integer sum exactly (the int32
// sums start at OFF * sum(q)); 0: cw a block minimum, one more FMA per block.
template <int R, int C, int SB, int OFF>
TOPG_TARGET_VNNI void vnni_tile(const uint32_t* codes, const float* dw, const float* cw,
                                int64_t gcodes, int64_t gscales, int64_t nsb, const VnniActs& x,
                                int64_t m0, float* out, int64_t ldo, int64_t cols) {
  __m512 acc[R][C];
  const int8_t* xq[C];
  const float *xd[C], *xs[C];
  for (int c = 0; c < C; ++c) {
    const int64_t row = x.row(m0 + c);
    xq[c] = x.q + row * x.kp, xd[c] = x.xd + row * x.nb;
    xs[c] = SB == 16 ? x.xs16 + (m0 + c) * nsb : x.xsum + row * x.nb;
    for (int r = 0; r < R; ++r) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < nsb; ++b) {
    __m512i ia[R][C];
    for (int c = 0; c < C; ++c) {
      const __m512i init = _mm512_set1_epi32(OFF * int(xs[c][b]));  // code sums: exact
      for (int r = 0; r < R; ++r) ia[r][c] = init;
    }
    for (int64_t s = b * (SB / 4); s < (b + 1) * (SB / 4); ++s) {
      __m512i wv[R];
      for (int r = 0; r < R; ++r) wv[r] = _mm512_load_si512(codes + r * gcodes + 16 * s);
      for (int c = 0; c < C; ++c) {
        int32_t q4;
        std::memcpy(&q4, xq[c] + 4 * s, 4);
        const __m512i xb = _mm512_set1_epi32(q4);
        for (int r = 0; r < R; ++r) ia[r][c] = _mm512_dpbusd_epi32(ia[r][c], wv[r], xb);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_load_ps(dw + r * gscales + 16 * b);
      const __m512 m = _mm512_load_ps(cw + r * gscales + 16 * b);
      for (int c = 0; c < C; ++c) {
        const float xdb = xd[c][b * SB / 32];
        const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(xdb));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r][c]), s, acc[r][c]);
        if constexpr (OFF == 0)
          acc[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(xdb * xs[c][b]), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t left = cols - 16 * r;
    if (left <= 0) break;
    const __mmask16 keep = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    for (int c = 0; c < C; ++c)
      _mm512_mask_storeu_ps(out + (m0 + c) * ldo + 16 * r, keep, acc[r][c]);
  }
}

// All M activation rows against groups [0, R) of a packed strip, 6 rows at a time.
template <int R, int SB, int OFF>
TOPG_TARGET_VNNI void vnni_strip(const uint32_t* codes, const float* dw, const float* cw,
                                 int64_t gcodes, int64_t gscales, int64_t nsb, const VnniActs& x,
                                 int64_t M, float* out, int64_t ldo, int64_t cols) {
  constexpr int C = 6;
  int64_t m = 0;
  for (; m + C <= M; m += C)
    vnni_tile<R, C, SB, OFF>(codes, dw, cw, gcodes, gscales, nsb, x, m, out, ldo, cols);
  switch (M - m) {
#define TOPG_VNNI_TAIL(n) \
  case n:                 \
    return vnni_tile<R, n, SB, OFF>(codes, dw, cw, gcodes, gscales, nsb, x, m, out, ldo, cols);
    TOPG_VNNI_TAIL(1)
    TOPG_VNNI_TAIL(2)
    TOPG_VNNI_TAIL(3)
    TOPG_VNNI_TAIL(4)
    TOPG_VNNI_TAIL(5)
#undef TOPG_VNNI_TAIL
    default:
      return;
  }
}

// out[m * ldo + j] = row j (< cols <= 32) of the packed rows at w (rb bytes apart) times
// activation row m < M, for k weights a row: the strip packed into sc, then the tiles.
// x.xs16 must be set for q6_k.
inline void gemm_q8_strip(const Format& f, const uint8_t* w, int64_t rb, int64_t k, int64_t cols,
                          const VnniActs& x, int64_t M, GemmQ8Scratch& sc, float* out,
                          int64_t ldo) {
  if (!use_vnni()) {
    if (f.fmt == Fmt::q4_k || f.fmt == Fmt::q5_k || f.fmt == Fmt::q6_k)
      return gemm_q8_strip_avx2_k(f, w, rb, k, cols, x, M, sc, out, ldo);
    return gemm_q8_strip_avx2(f, w, rb, k, cols, x, M, sc, out, ldo);
  }
  const int64_t kw = f.padded(k), sb = gemm_scale_block(f.fmt), nsb = kw / sb;
  const int64_t gcodes = (kw + 63) / 64 * 16 * 16, gscales = nsb * 16;  // per group of 16
  uint32_t* codes = sc.codes.fit<uint32_t>(2 * gcodes);
  float* dw = sc.scales.fit<float>(4 * gscales);
  float* cw = dw + 2 * gscales;
  const int R = cols > 16 ? 2 : 1;
  for (int r = 0; r < R; ++r)
    gemm_pack_group(f, w + 16 * r * rb, rb, std::min<int64_t>(16, cols - 16 * r), k,
                    codes + r * gcodes, dw + r * gscales, cw + r * gscales);
  auto run = [&](auto sb_off) {
    constexpr int SB = decltype(sb_off)::first, OFF = decltype(sb_off)::second;
    if (R == 2)
      return vnni_strip<2, SB, OFF>(codes, dw, cw, gcodes, gscales, nsb, x, M, out, ldo, cols);
    vnni_strip<1, SB, OFF>(codes, dw, cw, gcodes, gscales, nsb, x, M, out, ldo, cols);
  };
  switch (gemm_offset(f.fmt)) {
    case -32:
      return run(SbOff<16, -32>{});
    case -8:
      return run(SbOff<32, -8>{});
    case -16:
      return run(SbOff<32, -16>{});
    case -128:
      return run(SbOff<32, -128>{});
    default:
      return run(SbOff<32, 0>{});
  }
}

// emit(m, n, sum) for weight rows [n0, n1) of the packed weight w (rb bytes a row, k
// weights) and activation rows m < M: strips of 32 rows from n0, on the calling thread
// (the decode plan's and fused_moe_q's items). Callers check use_gemm_q8.
template <typename Emit>
inline void gemm_q8_rows(const Format& f, const uint8_t* w, int64_t rb, int64_t n0, int64_t n1,
                         int64_t k, VnniActs x, int64_t M, GemmQ8Scratch& sc, Emit&& emit) {
  if (n1 <= n0 || M <= 0) return;
  const int64_t kw = f.padded(k);
  if (f.fmt == Fmt::q6_k) {
    float* s16 = sc.sums16.fit<float>(M * kw / 16);
    gemm_q8_sums16(x, M, kw, s16);
    x.xs16 = s16;
  }
  float* out = sc.out.fit<float>(M * 32);
  for (int64_t n = n0; n < n1; n += 32) {
    const int64_t cols = std::min<int64_t>(32, n1 - n);
    gemm_q8_strip(f, w + n * rb, rb, k, cols, x, M, sc, out, 32);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < cols; ++j) emit(m, n + j, out[m * 32 + j]);
  }
}

// out [M, N] (fp32, row stride N) = the activations x (M rows) times the packed weight
// [N, row_bytes(K)], + bias (fp32 or null), strips of 32 weight rows over the threads.
// Callers check use_gemm_q8 (or int8_gemm, for more than 16 rows).
inline void gemm_q8_vnni(const Format& f, VnniActs x, int64_t M, int64_t K, const uint8_t* w,
                         int64_t N, const float* bias, float* out) {
  const int64_t rb = f.row_bytes(K), kw = f.padded(K);
  std::vector<float> s16;
  if (f.fmt == Fmt::q6_k) {
    s16.resize(size_t(M * kw / 16));
    gemm_q8_sums16(x, M, kw, s16.data());
    x.xs16 = s16.data();
  }
  parallel_items_with<GemmQ8Scratch>((N + 31) / 32, [&](int64_t item, GemmQ8Scratch& sc) {
    const int64_t col = 32 * item, cols = std::min<int64_t>(32, N - col);
    gemm_q8_strip(f, w + col * rb, rb, K, cols, x, M, sc, out + col, N);
    if (bias)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < cols; ++j) out[m * N + col + j] += bias[col + j];
  });
}
#else
inline void gemm_q8_vnni(const Format&, VnniActs, int64_t, int64_t, const uint8_t*, int64_t,
                         const float*, float*) {
  TORCH_CHECK(false, "linear_q: the integer GEMM is not built for this CPU");
}
template <typename Emit>
inline void gemm_q8_rows(const Format&, const uint8_t*, int64_t, int64_t, int64_t, int64_t,
                         VnniActs, int64_t, GemmQ8Scratch&, Emit&&) {
  TORCH_CHECK(false, "linear_q: the integer GEMM is not built for this CPU");
}
#endif

}  // namespace topg::quant
