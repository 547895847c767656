// One 64 x 64 output tile of C = A . B^T over K (A rows and B rows gathered through
// per-row pointers, so the same code serves linear and the grouped expert GEMMs of
// fused_moe). bf16 / fp16: tensor cores through nvcuda::wmma (16x16x16, fp32 accumulate);
// fp32: plain FMA on a 4 x 8 register micro-tile. Result: fp32 in shared memory (Cs).
//
// Block: 128 threads (4 warps, 2 x 2 over the tile). K steps of 32: global loads for the
// next step are issued into registers before the current step is computed (one shared
// buffer, register double-buffering). vec: 8-element (16-byte / 2 x 16-byte) loads; the
// caller guarantees K % 8 == 0 and 16-byte aligned rows; else element loads with bounds.
#pragma once

#include <mma.h>

#include "common.cuh"

namespace topg::cuda::gemm {

constexpr int BM = 64, BN = 64, BK = 32, kThreads = 128;
constexpr int LDS =
    BK + 8;  // tile row pitch in elements: 16-byte aligned rows, fewer bank conflicts
constexpr int LDC = BN + 4;  // fp32 result pitch

template <typename T>
struct alignas(16) Unit {
  T v[kVec];
};

template <typename T>
struct Smem {
  alignas(128) T a[BM][LDS];
  alignas(128) T b[BN][LDS];
  alignas(128) float c[BM][LDC];
  const T* arow[BM];
  const T* brow[BN];
};

// vec (block-uniform, run time): K % 8 == 0 and 16-byte aligned rows, so a unit is one
// 16-byte (bf16/fp16) or two (fp32) loads, all in or all out of range.
template <typename T>
__device__ __forceinline__ void load_unit(const T* row, int64_t k, int64_t K, bool vec,
                                          Unit<T>& u) {
  if (vec && row && k < K) {
    u = *reinterpret_cast<const Unit<T>*>(row + k);
    return;
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) u.v[i] = (row && k + i < K) ? row[k + i] : from_float<T>(0.f);
}

// Each thread moves 2 units of A and 2 of B per K step: unit u -> row u / 4, column (u % 4) * 8.
template <typename T>
__device__ __forceinline__ void load_step(const Smem<T>& s, int64_t k0, int64_t K, bool vec,
                                          Unit<T> (&ra)[2], Unit<T> (&rb)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int u = threadIdx.x + i * kThreads, r = u >> 2, c = (u & 3) * kVec;
    load_unit<T>(s.arow[r], k0 + c, K, vec, ra[i]);
    load_unit<T>(s.brow[r], k0 + c, K, vec, rb[i]);
  }
}

template <typename T>
__device__ __forceinline__ void store_step(Smem<T>& s, const Unit<T> (&ra)[2],
                                           const Unit<T> (&rb)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int u = threadIdx.x + i * kThreads, r = u >> 2, c = (u & 3) * kVec;
    *reinterpret_cast<Unit<T>*>(&s.a[r][c]) = ra[i];
    *reinterpret_cast<Unit<T>*>(&s.b[r][c]) = rb[i];
  }
}

// Computes s.c = A_tile . B_tile^T. Before the call the caller fills s.arow / s.brow
// (nullptr = a row of zeros) and syncs; after it, s.c is complete and visible to all.
template <typename T>
__device__ void tile_gemm(Smem<T>& s, int64_t K, bool vec) {
  using namespace nvcuda;
  const int warp = threadIdx.x >> 5, wm = warp >> 1, wn = warp & 1;
  constexpr bool kTensor = is_half_v<T>;
  // fp32 micro-tile: rows tr + 16 i, columns tc + 8 j (interleaved: conflict-light reads)
  const int tr = threadIdx.x >> 3, tc = threadIdx.x & 7;
  float acc[4][8];
  using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  FragC fc[2][2];
  if constexpr (kTensor) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(fc[i][j], 0.f);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
  }

  Unit<T> ra[2], rb[2];
  load_step<T>(s, 0, K, vec, ra, rb);
  for (int64_t k0 = 0; k0 < K; k0 += BK) {
    store_step(s, ra, rb);
    __syncthreads();
    if (k0 + BK < K) load_step<T>(s, k0 + BK, K, vec, ra, rb);  // in flight during the math
    if constexpr (kTensor) {
      using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
      using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
#pragma unroll
      for (int kk = 0; kk < BK; kk += 16) {
        FragA fa[2];
        FragB fb[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], &s.a[wm * 32 + i * 16][kk], LDS);
        // B stored [n][k] is B^T in column-major order: element (k, n) at n * LDS + k.
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(fb[j], &s.b[wn * 32 + j * 16][kk], LDS);
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int j = 0; j < 2; ++j) wmma::mma_sync(fc[i][j], fa[i], fb[j], fc[i][j]);
      }
    } else {
#pragma unroll 4
      for (int kk = 0; kk < BK; ++kk) {
        float a[4], b[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = to_float(s.a[tr + 16 * i][kk]);
#pragma unroll
        for (int j = 0; j < 8; ++j) b[j] = to_float(s.b[tc + 8 * j][kk]);
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[i][j] += a[i] * b[j];
      }
    }
    __syncthreads();  // the tile buffers are overwritten by the next step
  }
  if constexpr (kTensor) {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::store_matrix_sync(&s.c[wm * 32 + i * 16][wn * 32 + j * 16], fc[i][j], LDC,
                                wmma::mem_row_major);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) s.c[tr + 16 * i][tc + 8 * j] = acc[i][j];
  }
  __syncthreads();
}

}  // namespace topg::cuda::gemm
