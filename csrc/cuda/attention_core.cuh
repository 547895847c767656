// The attention block kernel shared by topg::attention (prefill) and topg::paged_attention
// (decode, split-KV): up to kRows query rows against a range of keys, online softmax in
// fp32, CUDA cores, any head_dim <= 256.
//
// Block: 4 warps. The block's key range is cut into chunks of 32 keys, chunk c going to
// warp c % 4. Within a chunk, lane j owns key j for the scores (one K row read per lane,
// 16-byte loads when allowed; the query rows come from shared memory as broadcasts),
// then the warp walks the 32 keys for P.V with the lanes splitting head_dim (coalesced V
// reads). Each warp keeps its own (max, sum, acc) per row; the four are merged at the end
// through shared memory. Rows share the K/V reads: the GQA group of a KV head in decode.
#pragma once

#include <cfloat>

#include "common.cuh"

namespace topg::cuda::attn {

constexpr int kRows = 8;    // query rows per block
constexpr int kWarps = 4;   // warps per block
constexpr int kChunk = 32;  // keys per warp step

// Blocks per SM the register budget is sized for (__launch_bounds__): 4 for head_dim <= 128
// (<= 128 registers per thread), 2 for the wide variant.
template <int MAXND>
inline constexpr int kMinBlocks = MAXND <= 4 ? 4 : 2;

// What a block computes. Row r (< nrows) reads q_row[r], sees keys [lo[r], hi[r]] (both
// inclusive) within the block's range [k0, k1), plus an optional additive fp32 mask row.
struct Rows {
  int nrows;
  int64_t q_off[kRows];  // element offset of the query row
  int64_t lo[kRows], hi[kRows];
  const void* mask[kRows];  // mask row (read with mask_at) or nullptr
};

// The mask is read in its own dtype (no fp32 copy per call): bool (True = may attend)
// or an additive float32 / bfloat16 / float16.
enum MaskKind : int { kMaskFloat = 0, kMaskBool = 1, kMaskBf16 = 2, kMaskHalf = 3 };

struct Params {
  int d;  // head_dim
  float scale, softcap;
  int64_t mask_sj;  // key stride of the mask (elements)
  int mask_kind;
  const float* sinks;  // [hq] attention sinks, or null
};

// Attention sinks: the factor that turns head h's output normalised over its keys
// (running max m, sum l) into the output of the softmax that also holds the logit
// sinks[h] with no value: l e^(m - M) / (l e^(m - M) + e^(sink - M)), M = max(m, sink).
// 1 without sinks or when the row saw no key (its output is already 0); a NaN sink gives
// NaN, as the softmax would.
__device__ __forceinline__ float sink_factor(const float* sinks, int h, float m, float l) {
  if (sinks == nullptr || !(l > 0.f)) return 1.f;
  const float sink = sinks[h], mx = fmaxf(m, sink);
  const float kept = l * __expf(m - mx);
  return kept / (kept + __expf(sink - mx));
}

// Additive mask value of key j in a mask row.
__device__ __forceinline__ float mask_at(const void* row, int64_t j, const Params& p) {
  const int64_t e = j * p.mask_sj;
  switch (p.mask_kind) {
    case kMaskBool:
      return static_cast<const bool*>(row)[e] ? 0.f : -INFINITY;
    case kMaskBf16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(row)[e]);
    case kMaskHalf:
      return __half2float(static_cast<const __half*>(row)[e]);
    default:
      return static_cast<const float*>(row)[e];
  }
}

// The mask row of (sequence b, head h, query i): a byte pointer into the mask's storage.
__device__ __forceinline__ const void* mask_row(const void* mask, int64_t elem_off, int esize) {
  return mask ? static_cast<const char*>(mask) + elem_off * esize : nullptr;
}

// Score transform shared by every path: scale, then softcap, then mask/visibility.
__device__ __forceinline__ float transform(float dot, const Params& p) {
  float s = dot * p.scale;
  if (p.softcap > 0.f) s = p.softcap * tanhf(s / p.softcap);
  return s;
}

// Block result per row: m (max), l (sum of exp) and acc / l in `o` (fp32), or zeros and
// l = 0 when the row saw no key. Loader: kptr(j) / vptr(j) give key j's K / V row (in T,
// or int8 for a quantised cache), kscale(j) / vscale(j) their scales (1 unless int8): a
// score is kscale(j) * (q . k_j), a V row is read as vscale(j) * v_j.
// vec: K rows may be read with 16-byte loads (D % 8 == 0, aligned rows); a run-time,
// block-uniform flag (one variant less to compile per dtype and width).
template <typename T, int MAXND, typename Loader, typename Out>
__device__ void attend_block(const T* __restrict__ q, const Rows& rows, const Params& p,
                             const Loader& kv, int64_t k0, int64_t k1, bool vec, Out&& out) {
  constexpr int DMAX = MAXND * 32;
  __shared__ __align__(16) float qs[kRows][DMAX];
  __shared__ __align__(16) float ps[kWarps][kRows][kChunk];
  __shared__ float wm[kWarps][kRows], wl[kWarps][kRows];
  __shared__ float wacc[kWarps][kRows][DMAX];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int d = p.d, nrows = rows.nrows;
  // r unrolled: `rows` stays in registers (a run-time index would put it in local memory)
#pragma unroll
  for (int r = 0; r < kRows; ++r)
    for (int c = threadIdx.x; c < DMAX; c += blockDim.x)
      qs[r][c] = (r < nrows && c < d) ? to_float(q[rows.q_off[r] + c]) : 0.f;
  __syncthreads();

  float m[kRows], l[kRows], acc[kRows][MAXND];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY, l[r] = 0.f;
#pragma unroll
    for (int i = 0; i < MAXND; ++i) acc[r][i] = 0.f;
  }

  for (int64_t c0 = k0 + int64_t(warp) * kChunk; c0 < k1; c0 += int64_t(kWarps) * kChunk) {
    // --- scores: lane owns key j ---------------------------------------------------------
    const int64_t j = c0 + lane;
    float s[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) s[r] = 0.f;
    if (j < k1) {
      const auto* krow = kv.kptr(j);
      if (vec) {
#pragma unroll 4
        for (int c = 0; c < d; c += kVec) {
          float kf[kVec];
          load8(krow + c, kf);
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            if (r >= nrows) break;  // block-uniform: a GQA group of 4 computes 4 rows
            const float4 a = *reinterpret_cast<const float4*>(&qs[r][c]);
            const float4 b = *reinterpret_cast<const float4*>(&qs[r][c + 4]);
            s[r] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] + b.x * kf[4] +
                    b.y * kf[5] + b.z * kf[6] + b.w * kf[7];
          }
        }
      } else {
        for (int c = 0; c < d; ++c) {
          const float kf = to_float(krow[c]);
#pragma unroll
          for (int r = 0; r < kRows; ++r)
            if (r < nrows) s[r] += qs[r][c] * kf;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= nrows) break;  // block-uniform, so the warp reductions below stay converged
      float v = -INFINITY;
      if (j < k1 && j >= rows.lo[r] && j <= rows.hi[r]) {
        v = transform(s[r] * kv.kscale(j), p);
        if (rows.mask[r]) v += mask_at(rows.mask[r], j, p);
      }
      // online softmax update for this chunk (all lanes take part in the reductions); a
      // NaN score makes the row NaN, as softmax does (max reductions would drop it)
      const bool nan = __any_sync(0xffffffffu, isnan(v));
      const float cmax = warp_max(v);
      const float m_new = fmaxf(m[r], cmax);
      const float e = m_new == -INFINITY ? 0.f : __expf(v - m_new);
      const float alpha = m_new == -INFINITY ? 1.f : __expf(m[r] - m_new);
      l[r] = nan ? NAN : l[r] * alpha + warp_sum(e);
      m[r] = m_new;
#pragma unroll
      for (int i = 0; i < MAXND; ++i) acc[r][i] *= alpha;
      ps[warp][r][lane] = e;
    }
    __syncwarp();
    // --- P.V: the warp walks the chunk's keys, lanes split head_dim ----------------------
    const int nk = int(k1 - c0 < kChunk ? k1 - c0 : kChunk);
#pragma unroll 8
    for (int jj = 0; jj < nk; ++jj) {
      const auto* vrow = kv.vptr(c0 + jj);
      const float vscale = kv.vscale(c0 + jj);
      float vv[MAXND];
#pragma unroll
      for (int i = 0; i < MAXND; ++i) {
        const int c = lane + 32 * i;
        vv[i] = c < d ? to_float(vrow[c]) * vscale : 0.f;
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r >= nrows) break;  // ps rows past nrows are never written
        const float pr = ps[warp][r][jj];
#pragma unroll
        for (int i = 0; i < MAXND; ++i) acc[r][i] += pr * vv[i];
      }
    }
    __syncwarp();  // ps is rewritten by the next chunk
  }

  // --- merge the four warps ----------------------------------------------------------------
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (lane == 0) wm[warp][r] = m[r], wl[warp][r] = l[r];
#pragma unroll
    for (int i = 0; i < MAXND; ++i) {
      const int c = lane + 32 * i;
      if (c < DMAX) wacc[warp][r][c] = acc[r][i];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nrows * d; i += blockDim.x) {
    const int r = i / d, c = i % d;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, wm[w][r]);
    float sum = 0.f, o = 0.f;
    bool nan = false;  // a warp's NaN row (its l) makes the merged row NaN
#pragma unroll
    for (int w = 0; w < kWarps; ++w) nan |= isnan(wl[w][r]);
    if (nan) {
      sum = o = NAN;
    } else if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = __expf(wm[w][r] - mx);  // a warp that saw nothing has l = 0
        sum += wl[w][r] * f;
        o += wacc[w][r][c] * f;
      }
    }
    out(r, c, nan ? NAN : sum > 0.f ? o / sum : 0.f, mx, sum);
  }
}

}  // namespace topg::cuda::attn
