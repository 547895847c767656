// The packed GEMM path of gemm_kernels.h (many rows of A): A packed into fp32 MR-row
// tiles, the weight per (KC x NR) panel into fp32 k-major, a 6 x 16 FMA micro-kernel, the
// finished tiles handed to a caller epilogue. Used by topg::linear and topg::fused_moe.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemm_kernels.h"

namespace topg::gemm {

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
  alignas(32) float tile[MR * NR];
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    const bool first = k0 == 0, last = k0 + kc >= K;
    for (int64_t p = p0; p < p1; ++p) {
      const auto [g0, g1] = panel(p);
      pack_b_panel<T>(g0, g1, ldw, k0, kc, bp + (p - p0) * kc * NR);
    }
    for (int64_t tb = t0; tb < t1; tb += MCT) {
      const int64_t te = std::min(t1, tb + MCT);
      for (int64_t p = p0; p < p1; ++p) {
        const float* b = bp + (p - p0) * kc * NR;
        for (int64_t t = tb; t < te; ++t) {
          micro_6x16(kc, ap + k0 * mp + t * kc * MR, b, tile);
          float* c = cs ? cs + (t - t0) * MR * ldc + (p - p0) * NR : nullptr;
          if (!first)
            for (int i = 0; i < MR; ++i)
              for (int j = 0; j < NR; j += 8)
                (Vec8::load(tile + i * NR + j) + Vec8::load(c + i * ldc + j))
                    .store(tile + i * NR + j);
          if (last) {
            epi(t, p, static_cast<const float*>(tile));
          } else {
            for (int i = 0; i < MR; ++i)
              for (int j = 0; j < NR; j += 8) Vec8::load(tile + i * NR + j).store(c + i * ldc + j);
          }
        }
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
