// Prefill attention on tensor cores (bf16 / fp16, head_dim 64 or 128): a flash-attention
// style block of 64 query rows of one head, 4 warps of 16 rows, over 64-key tiles.
//
// Per key tile: K and V tiles go to shared memory (all threads); each warp computes its
// 16 x 64 scores with nvcuda::wmma (fp32 accumulate) into shared memory, applies the score
// transform, visibility and mask and the online softmax there (two lanes per row), writes
// P in the input dtype, and accumulates O += P V with wmma into accumulator fragments held
// in registers. When some row's running max moved (alpha != 1) the warp rescales its O
// rows through shared memory (store, scale, reload): only documented wmma calls, no
// assumption on the fragment layout. Also PrefillArgs and the per-row key range, shared
// with the CUDA-core kernel in attention.cu.
#pragma once

#include <mma.h>

#include "attention_core.cuh"

namespace topg::cuda::attn {

struct PrefillArgs {
  int64_t q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, o_sb, o_ss, o_sh;
  int64_t sq, sk;              // dense lengths
  const int32_t *cu_q, *cu_k;  // ragged offsets (device) or nullptr
  int64_t tq, tk;              // ragged: the token counts (offsets are clamped to them)
  int hq, hkv;
  bool causal;
  int64_t window;
  const void* mask;  // expanded to [B, Hq, Sq, Sk] strides, read in its dtype (Params)
  int64_t m_sb, m_sh, m_si;
  int m_esize;  // bytes per mask element
};

// The block's sequence (blockIdx.z), query head (blockIdx.y) and their offsets.
struct SeqView {
  int64_t b, q0, k0, sq, sk, qb, ob;
  int h, hk;
};

__device__ __forceinline__ SeqView seq_view(const PrefillArgs& a) {
  SeqView s;
  s.b = blockIdx.z, s.h = blockIdx.y, s.hk = s.h / (a.hq / a.hkv);
  s.q0 = 0, s.k0 = 0, s.sq = a.sq, s.sk = a.sk;
  if (a.cu_q) {  // clamped: offsets unchecked on the host never reach outside q / k / v
    auto clamp = [](int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; };
    s.q0 = clamp(a.cu_q[s.b], 0, a.tq), s.sq = clamp(a.cu_q[s.b + 1], s.q0, a.tq) - s.q0;
    s.k0 = clamp(a.cu_k[s.b], 0, a.tk), s.sk = clamp(a.cu_k[s.b + 1], s.k0, a.tk) - s.k0;
  }
  s.qb = s.b * a.q_sb + s.q0 * a.q_ss + s.h * a.q_sh;
  s.ob = s.b * a.o_sb + s.q0 * a.o_ss + s.h * a.o_sh;
  return s;
}

// Keys [lo, hi] visible from query i (bottom-right aligned causal / window); lo > hi: none.
__device__ __forceinline__ void row_keys(const PrefillArgs& a, const SeqView& s, int64_t i,
                                         int64_t& lo, int64_t& hi) {
  const int64_t pos = i + s.sk - s.sq;
  lo = a.window >= 0 ? pos - a.window : 0;
  hi = a.causal ? pos : s.sk - 1;
  lo = lo < 0 ? 0 : lo;
  hi = hi > s.sk - 1 ? s.sk - 1 : hi;
}

namespace tc {

constexpr int BQ = 64, BKV = 64, kThreads = 128;

template <int D, typename T>
struct Layout {
  static constexpr int LDT = D + 8;    // Q / K / V tile pitch (elements of T)
  static constexpr int LDS = BKV + 4;  // scores pitch (fp32)
  static constexpr int LDP = BKV + 8;  // probabilities pitch (T)
  static constexpr int LDO = D + 4;    // output pitch (fp32)
  // Every region size is a multiple of 32 bytes (wmma pointers must be 32-byte aligned).
  static constexpr size_t q = 0;
  static constexpr size_t k = q + size_t(BQ) * LDT * sizeof(T);
  static constexpr size_t v = k + size_t(BKV) * LDT * sizeof(T);
  static constexpr size_t s = v + size_t(BKV) * LDT * sizeof(T);
  static constexpr size_t p = s + size_t(BQ) * LDS * sizeof(float);
  static constexpr size_t o = p + size_t(BQ) * LDP * sizeof(T);
  static constexpr size_t rows = o + size_t(BQ) * LDO * sizeof(float);  // m, l, alpha
  static constexpr size_t bytes = rows + 3 * BQ * sizeof(float);
};

// Rows [r0, r0 + n) of a tile from global rows base + (start + r) * stride (D contiguous
// elements each, 16-byte aligned), zeros past n.
template <typename T, int D, int LDT>
__device__ __forceinline__ void load_tile(T* dst, const T* base, int64_t stride, int64_t start,
                                          int n, int rows) {
  constexpr int units = D / kVec;
  for (int u = threadIdx.x; u < rows * units; u += kThreads) {
    const int r = u / units, c = (u % units) * kVec;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r < n) val = *reinterpret_cast<const uint4*>(base + (start + r) * stride + c);
    *reinterpret_cast<uint4*>(dst + r * LDT + c) = val;
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    prefill_tc_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                      T* __restrict__ o, PrefillArgs a, Params p) {
  using namespace nvcuda;
  using L = Layout<D, T>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem + L::q);
  T* Ks = reinterpret_cast<T*>(smem + L::k);
  T* Vs = reinterpret_cast<T*>(smem + L::v);
  float* S = reinterpret_cast<float*>(smem + L::s);
  T* P = reinterpret_cast<T*>(smem + L::p);
  float* Os = reinterpret_cast<float*>(smem + L::o);
  float* row_m = reinterpret_cast<float*>(smem + L::rows);
  float* row_l = row_m + BQ;
  float* row_a = row_l + BQ;

  const SeqView sv = seq_view(a);
  const int64_t i0 = int64_t(blockIdx.x) * BQ;
  if (i0 >= sv.sq) return;  // block-uniform, before any barrier
  const int nrows = int(sv.sq - i0 < BQ ? sv.sq - i0 : BQ);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  load_tile<T, D, L::LDT>(Qs, q + sv.qb, a.q_ss, i0, nrows, BQ);
  for (int r = threadIdx.x; r < BQ; r += kThreads) row_m[r] = -INFINITY, row_l[r] = 0.f;
  // Key range of the block: lo and hi grow with the query index.
  int64_t klo, khi, lo_last, hi_first;
  row_keys(a, sv, i0, klo, hi_first);
  row_keys(a, sv, i0 + nrows - 1, lo_last, khi);
  (void)lo_last, (void)hi_first;
  const T* kb = k + sv.b * a.k_sb + sv.k0 * a.k_ss + int64_t(sv.hk) * a.k_sh;
  const T* vb = v + sv.b * a.v_sb + sv.k0 * a.v_ss + int64_t(sv.hk) * a.v_sh;

  using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  FragC ofr[D / 16];
#pragma unroll
  for (int j = 0; j < D / 16; ++j) wmma::fill_fragment(ofr[j], 0.f);
  const bool active = warp * 16 < nrows;      // warp-uniform: the warp has a real row
  const int rr = lane >> 1, half = lane & 1;  // softmax: two lanes per row, 32 columns each
  const int r = warp * 16 + rr;
  const int64_t i = i0 + r;
  int64_t lo_r = 0, hi_r = -1;
  if (r < nrows) row_keys(a, sv, i, lo_r, hi_r);
  const void* mrow =
      r < nrows ? mask_row(a.mask, sv.b * a.m_sb + sv.h * a.m_sh + i * a.m_si, a.m_esize) : nullptr;
  __syncthreads();

  for (int64_t kt = klo; kt <= khi; kt += BKV) {
    const int nk = int(khi + 1 - kt < BKV ? khi + 1 - kt : BKV);
    load_tile<T, D, L::LDT>(Ks, kb, a.k_ss, kt, nk, BKV);
    load_tile<T, D, L::LDT>(Vs, vb, a.v_ss, kt, nk, BKV);
    __syncthreads();
    if (active) {
      // S = Q K^T for this warp's 16 rows
      FragC sfr[BKV / 16];
#pragma unroll
      for (int j = 0; j < BKV / 16; ++j) wmma::fill_fragment(sfr[j], 0.f);
#pragma unroll
      for (int kk = 0; kk < D; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::load_matrix_sync(fa, Qs + warp * 16 * L::LDT + kk, L::LDT);
#pragma unroll
        for (int j = 0; j < BKV / 16; ++j) {
          // K stored [key][d] = B^T: column-major B, element (d, key) at key * LDT + d
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, Ks + j * 16 * L::LDT + kk, L::LDT);
          wmma::mma_sync(sfr[j], fa, fb, sfr[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < BKV / 16; ++j)
        wmma::store_matrix_sync(S + warp * 16 * L::LDS + j * 16, sfr[j], L::LDS,
                                wmma::mem_row_major);
      __syncwarp();
      // online softmax of row r over columns [32 half, 32 half + 32)
      float* srow = S + r * L::LDS;
      float mx = -INFINITY;
      int nan = 0;  // a NaN score makes the row NaN, as softmax does (fmaxf drops it)
      for (int c = half * 32; c < half * 32 + 32; ++c) {
        const int64_t j = kt + c;
        float val = -INFINITY;
        if (c < nk && j >= lo_r && j <= hi_r) {
          val = transform(srow[c], p);
          if (mrow) val += mask_at(mrow, j, p);
        }
        srow[c] = val;
        mx = fmaxf(mx, val);
        nan |= isnan(val);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      nan |= __shfl_xor_sync(0xffffffffu, nan, 1);
      const float m_old = row_m[r];
      const float m_new = fmaxf(m_old, mx);
      const float alpha = m_new == -INFINITY ? 1.f : __expf(m_old - m_new);
      float sum = 0.f;
      T* prow = P + r * L::LDP;
      for (int c = half * 32; c < half * 32 + 32; ++c) {
        const float e = m_new == -INFINITY ? 0.f : __expf(srow[c] - m_new);
        prow[c] = from_float<T>(e);
        sum += e;
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      __syncwarp();  // both lanes of a row read row_m before it changes
      if (half == 0)
        row_m[r] = m_new, row_l[r] = nan ? NAN : row_l[r] * alpha + sum, row_a[r] = alpha;
      // Rescale O through shared memory only when a running max moved.
      if (__any_sync(0xffffffffu, alpha != 1.f)) {
        float* orows = Os + warp * 16 * L::LDO;
#pragma unroll
        for (int j = 0; j < D / 16; ++j)
          wmma::store_matrix_sync(orows + j * 16, ofr[j], L::LDO, wmma::mem_row_major);
        __syncwarp();
        for (int idx = lane; idx < 16 * D; idx += 32) {
          const int rr2 = idx / D, c = idx % D;
          orows[rr2 * L::LDO + c] *= row_a[warp * 16 + rr2];
        }
        __syncwarp();
#pragma unroll
        for (int j = 0; j < D / 16; ++j)
          wmma::load_matrix_sync(ofr[j], orows + j * 16, L::LDO, wmma::mem_row_major);
      }
      __syncwarp();  // P complete before the P.V product reads it
                     // O += P V
#pragma unroll
      for (int kk = 0; kk < BKV; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fp;
        wmma::load_matrix_sync(fp, P + warp * 16 * L::LDP + kk, L::LDP);
#pragma unroll
        for (int j = 0; j < D / 16; ++j) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fv;
          wmma::load_matrix_sync(fv, Vs + kk * L::LDT + j * 16, L::LDT);
          wmma::mma_sync(ofr[j], fp, fv, ofr[j]);
        }
      }
    }
    __syncthreads();  // K / V tiles are overwritten by the next step
  }
  if (active) {
#pragma unroll
    for (int j = 0; j < D / 16; ++j)
      wmma::store_matrix_sync(Os + warp * 16 * L::LDO + j * 16, ofr[j], L::LDO,
                              wmma::mem_row_major);
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < nrows * D; idx += kThreads) {
    const int rr2 = idx / D, c = idx % D;
    const float l = row_l[rr2];
    float val = isnan(l) ? NAN : l > 0.f ? Os[rr2 * L::LDO + c] / l : 0.f;
    val *= sink_factor(p.sinks, sv.h, row_m[rr2], l);
    o[sv.ob + (i0 + rr2) * a.o_ss + c] = from_float<T>(val);
  }
}

}  // namespace tc
}  // namespace topg::cuda::attn
