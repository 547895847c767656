// linear_q's int8-activation GEMM (M > quant::kGemvRows: prefill, long verify steps) on
// CPUs with AVX-512 VNNI.
//
// The math, per block of 32 along K. The weights are written w = dw * u + cw with u an
// unsigned code (the 4-bit formats' nibbles; q8_0 / int8 codes + 128, so cw = -128 dw;
// q4_0 cw = -8 dw; q4_1 / int4 cw = the block's minimum), the activations x = xd * q (q
// int8, quant::quantize_act). Then
//   sum(w * x) = dw * xd * sum(u * q) + cw * xd * sum(q),
// and sum(u * q) is what vpdpbusd computes (unsigned x signed bytes, four products to an
// int32 lane, no saturation: |sum| <= 32 * 255 * 127). The result equals the reference's
// (weights de-quantised, activations rounded per block) up to fp32 rounding: the products
// are exact in int32, the block terms are summed in fp32.
//
// The layout. The weight's rows are repacked per call in groups of 16: for every 4 codes
// along K, 64 bytes holding those 4 codes of each of the 16 rows. One vpdpbusd with 4 codes
// of an activation row broadcast to the 16 lanes ({1to16}) then adds 4 products to each
// row's int32 sum, 8 of them finish a block, and the block's scales cost one convert, one
// multiply and two FMAs for 16 rows x 1 activation row (512 products). The block scales
// are stored per group as 16 lanes too. A tile is 2 groups (32 rows) x 6 activation rows:
// 12 int32 and 12 fp32 accumulators and 2 weight registers (GCC 12 keeps the int32 sums
// and the weights in registers and the fp32 sums, touched once a block, on the stack).
// Measured, q8_0 x 512 activation rows, 2 threads: [1536, 576] 320-360, [576, 1536] about
// 300 G multiply-adds/s (the fp32 path: about 80, the FMA peak).
//
// Work items: 32 weight rows each, over all M activation rows (the tile's weights stay in
// L1 while the activations stream from L2). The repacking costs N * padded(K) bytes once
// per call, amortised over M (the caller takes this path only for M > 16).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <cstring>

#include "gemv_avx512.h"
#include "parallel.h"
#include "quant_act.h"

namespace topg::quant {

// The activations of the GEMM (quant::quantize_act's output): int8 codes [M][kp], and
// per block of 32 the scale xd and the code sum xsum.
struct VnniActs {
  const int8_t* q;
  const float *xd, *xsum;
  int64_t kp, nb;
};

#if defined(__x86_64__) && defined(__GNUC__) && TOPG_AVX2
// Block b (32 codes along K) of a packed row of k weights: its unsigned codes u and its
// (dw, cw) as in the header comment. Codes past k (the int8 format's last block) are 128,
// the zero weight; their activations are zero anyway.
inline void vnni_block(const Format& f, const uint8_t* row, int64_t k, int64_t b, uint8_t* u,
                       float& dw, float& cw) {
  switch (f.fmt) {
    case Fmt::q8_0: {
      const uint8_t* p = row + 34 * b;
      dw = half_at(p), cw = -128.f * dw;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u),
                          _mm256_xor_si256(load32(p + 2), _mm256_set1_epi8(char(0x80))));
      return;
    }
    case Fmt::q4_0: {
      const uint8_t* p = row + 18 * b;
      dw = half_at(p), cw = -8.f * dw;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), unpack16(p + 2));
      return;
    }
    case Fmt::q4_1: {
      const uint8_t* p = row + 20 * b;
      dw = half_at(p), cw = half_at(p + 2);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), unpack16(p + 4));
      return;
    }
    case Fmt::q5_0: {
      const uint8_t* p = row + 22 * b;
      dw = half_at(p), cw = -16.f * dw;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), unpack_q5(p + 2, p + 6));
      return;
    }
    case Fmt::q5_1: {
      const uint8_t* p = row + 24 * b;
      dw = half_at(p), cw = half_at(p + 2);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), unpack_q5(p + 4, p + 8));
      return;
    }
    case Fmt::int4: {
      const int64_t sub = f.block / 32, c = b % sub;  // the block's place in its group
      const uint8_t* p = row + f.block_bytes * (b / sub);
      dw = half_at(p), cw = half_at(p + 2);
      if (sub == 1) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), unpack16(p + 4));
        return;
      }
      // Larger groups: runs of 32 bytes, the low nibbles block c, the high ones c + sub / 2.
      const int64_t half = sub / 2;
      const uint8_t* run = p + 4 + 32 * (c % half);
      const int shift = c < half ? 0 : 4;
      for (int i = 0; i < 32; ++i) u[i] = (run[i] >> shift) & 15;
      return;
    }
    case Fmt::int8: {
      std::memcpy(&dw, row, 4);
      cw = -128.f * dw;
      for (int64_t i = 0; i < 32; ++i) {
        const int64_t j = 32 * b + i;
        u[i] = j < k ? uint8_t(row[4 + j] ^ 0x80) : uint8_t(0x80);
      }
      return;
    }
    default:
      TORCH_CHECK(false, "linear_q: no int8 GEMM for this format");  // callers check int8_gemm
  }
}

// Rows [16 g, 16 g + 16) of the packed weight (rows past n: zero codes and scales) into
// codes [kp / 4][16] (uint32: 4 codes) and dw, cw [kp / 32][16].
inline void vnni_pack_group(const Format& f, const uint8_t* w, int64_t rb, int64_t n, int64_t k,
                            int64_t kp, int64_t g, uint32_t* codes, float* dw, float* cw) {
  alignas(32) uint8_t u[32];
  const int64_t nb = kp / 32;
  for (int64_t r = 0; r < 16; ++r) {
    const int64_t row = 16 * g + r;
    for (int64_t b = 0; b < nb; ++b) {
      float d = 0.f, c = 0.f;
      if (row < n)
        vnni_block(f, w + row * rb, k, b, u, d, c);
      else
        std::memset(u, 0, 32);
      for (int64_t s = 0; s < 8; ++s) std::memcpy(codes + (8 * b + s) * 16 + r, u + 4 * s, 4);
      dw[b * 16 + r] = d, cw[b * 16 + r] = c;
    }
  }
}

// out[c][16 r + j] (c < C activation rows, r < R groups, j < 16 rows of a group; columns
// from 16 r + j >= cols not written) = the rows' sums + bias.
template <int R, int C>
TOPG_TARGET_VNNI void vnni_tile(const uint32_t* codes, const float* dw, const float* cw,
                                int64_t gcodes, int64_t gscales, const VnniActs& x, int64_t m0,
                                const float* bias, float* out, int64_t ldo, int64_t cols) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int8_t* xq = x.q + m0 * x.kp;
  for (int64_t b = 0; b < x.nb; ++b) {
    __m512i ia[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) ia[r][c] = _mm512_setzero_si512();
    for (int64_t s = 8 * b; s < 8 * b + 8; ++s) {
      __m512i wv[R];
      for (int r = 0; r < R; ++r) wv[r] = _mm512_load_si512(codes + r * gcodes + 16 * s);
      for (int c = 0; c < C; ++c) {
        int32_t q4;
        std::memcpy(&q4, xq + c * x.kp + 4 * s, 4);
        const __m512i xb = _mm512_set1_epi32(q4);
        for (int r = 0; r < R; ++r) ia[r][c] = _mm512_dpbusd_epi32(ia[r][c], wv[r], xb);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_load_ps(dw + r * gscales + 16 * b);
      const __m512 m = _mm512_load_ps(cw + r * gscales + 16 * b);
      for (int c = 0; c < C; ++c) {
        const int64_t xb = (m0 + c) * x.nb + b;
        const __m512 s = _mm512_mul_ps(d, _mm512_set1_ps(x.xd[xb]));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r][c]), s, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.xd[xb] * x.xsum[xb]), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t left = cols - 16 * r;
    if (left <= 0) break;
    const __mmask16 keep = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + 16 * r) : _mm512_setzero_ps();
    for (int c = 0; c < C; ++c)
      _mm512_mask_storeu_ps(out + (m0 + c) * ldo + 16 * r, keep, _mm512_add_ps(acc[r][c], bv));
  }
}

// All M activation rows against groups [g, g + R) of the repacked weight.
template <int R>
TOPG_TARGET_VNNI void vnni_strip(const uint32_t* codes, const float* dw, const float* cw,
                                 int64_t gcodes, int64_t gscales, const VnniActs& x, int64_t M,
                                 const float* bias, float* out, int64_t ldo, int64_t cols) {
  constexpr int C = 6;
  int64_t m = 0;
  for (; m + C <= M; m += C)
    vnni_tile<R, C>(codes, dw, cw, gcodes, gscales, x, m, bias, out, ldo, cols);
  switch (M - m) {
#define TOPG_VNNI_TAIL(n) \
  case n:                 \
    return vnni_tile<R, n>(codes, dw, cw, gcodes, gscales, x, m, bias, out, ldo, cols);
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

// out [M, N] (fp32, row stride N) = the activations x (M rows) times the packed weight
// [N, row_bytes(K)], + bias (fp32 or null). Callers check use_vnni() and int8_gemm(f.fmt).
inline void gemm_q8_vnni(const Format& f, const VnniActs& x, int64_t M, int64_t K, const uint8_t* w,
                         int64_t N, const float* bias, float* out) {
  const int64_t kp = x.kp, nb = x.nb, groups = (N + 15) / 16;
  const int64_t gcodes = kp / 4 * 16, gscales = nb * 16;  // uint32 / floats per group
  auto opts = at::TensorOptions().dtype(at::kFloat);      // 64-byte aligned by c10's allocator
  at::Tensor codes = at::empty({groups * gcodes}, opts.dtype(at::kInt));
  at::Tensor scales = at::empty({2, groups * gscales}, opts);
  uint32_t* cp = reinterpret_cast<uint32_t*>(codes.data_ptr<int32_t>());
  float *dw = scales[0].data_ptr<float>(), *cw = scales[1].data_ptr<float>();
  const int64_t rb = f.row_bytes(K);
  parallel_items(groups, [&](int64_t g) {
    vnni_pack_group(f, w, rb, N, K, kp, g, cp + g * gcodes, dw + g * gscales, cw + g * gscales);
  });
  parallel_items((groups + 1) / 2, [&](int64_t item) {
    const int64_t g = 2 * item, col = 16 * g;
    const float* b = bias ? bias + col : nullptr;
    if (g + 1 < groups)
      vnni_strip<2>(cp + g * gcodes, dw + g * gscales, cw + g * gscales, gcodes, gscales, x, M, b,
                    out + col, N, N - col);
    else
      vnni_strip<1>(cp + g * gcodes, dw + g * gscales, cw + g * gscales, gcodes, gscales, x, M, b,
                    out + col, N, N - col);
  });
}
#else
inline void gemm_q8_vnni(const Format&, const VnniActs&, int64_t, int64_t, const uint8_t*, int64_t,
                         const float*, float*) {
  TORCH_CHECK(false, "linear_q: the VNNI GEMM is not built for this CPU");
}
#endif

}  // namespace topg::quant
