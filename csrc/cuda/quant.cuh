// Device side of the packed weight formats (common/quant_formats.h; layouts in
// torch_topg/quant/formats.py): runs of 32 weights de-quantised in registers with the
// reference's float operations (cpu/quant_kernels.h: dequant_block), the activation rows
// the kernels read, and their int8 rounding (linear_q's int8_activations).
#pragma once

#include "common.cuh"
#include "common/quant_formats.h"

namespace topg::cuda::q {

using quant::Fmt;
using quant::Format;

// Unaligned little-endian reads (block offsets are not multiples of 4 in general).
__device__ __forceinline__ float half_at(const uint8_t* p) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(p[0] | (p[1] << 8))));
}
__device__ __forceinline__ float f32_at(const uint8_t* p) {
  return __uint_as_float(unsigned(p[0]) | (unsigned(p[1]) << 8) | (unsigned(p[2]) << 16) |
                         (unsigned(p[3]) << 24));
}

// Weights [32 su, 32 su + 32) of a packed row of k weights (su < f.padded(k) / 32), exactly
// as the CPU de-quantiser computes them (no contraction into FMAs). int8 rows give 0 past
// k; an int4 row's padded group gives its codes' values (the activations there are 0).
__device__ __forceinline__ void load_run(const Format& f, const uint8_t* row, int64_t k, int64_t su,
                                         float (&w)[32]) {
  switch (f.fmt) {
    case Fmt::q8_0: {
      const uint8_t* b = row + su * 34;
      const float d = half_at(b);
#pragma unroll
      for (int i = 0; i < 32; ++i) w[i] = __fmul_rn(float(int8_t(b[2 + i])), d);
      break;
    }
    case Fmt::q4_0: {
      const uint8_t* b = row + su * 18;
      const float d = half_at(b);
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const int q = b[2 + i];
        w[i] = __fmul_rn(d, float((q & 15) - 8));
        w[16 + i] = __fmul_rn(d, float((q >> 4) - 8));
      }
      break;
    }
    case Fmt::q5_0:
    case Fmt::q5_1: {  // qh: bit i of the little-endian word is element i's 5th bit
      const bool one = f.fmt == Fmt::q5_1;
      const uint8_t* b = row + su * (one ? 24 : 22);
      const float d = half_at(b), m = one ? half_at(b + 2) : 0.f;
      const uint8_t* qh = b + (one ? 4 : 2);
      const unsigned hb = unsigned(qh[0]) | (unsigned(qh[1]) << 8) | (unsigned(qh[2]) << 16) |
                          (unsigned(qh[3]) << 24);
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int v = (i < 16 ? qh[4 + i] & 15 : qh[4 + i - 16] >> 4) | (((hb >> i) & 1) << 4);
        w[i] = one ? __fadd_rn(__fmul_rn(d, float(v)), m) : __fmul_rn(d, float(v - 16));
      }
      break;
    }
    case Fmt::q4_1:
    case Fmt::int4: {
      const int64_t g = f.block, per = g / 32;
      const uint8_t* b = row + (su / per) * f.block_bytes;
      const float d = half_at(b), m = half_at(b + 2);
      const uint8_t* q = b + 4;
      const int64_t e0 = 32 * (su % per), half = g / 2;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int64_t e = e0 + i;
        const int v = e < half ? (q[e] & 15) : (q[e - half] >> 4);
        w[i] = __fadd_rn(__fmul_rn(d, float(v)), m);
      }
      break;
    }
    case Fmt::q4_k: {
      const uint8_t* b = row + (su / 8) * 144;
      const int j = int(su % 8);
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* s = b + 4;
      const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
      const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
      const float scale = __fmul_rn(d, float(sc)), off = __fmul_rn(dmin, float(mn));
      const uint8_t* q = b + 16 + 32 * (j / 2);
      const bool high = j & 1;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int v = high ? q[i] >> 4 : q[i] & 15;
        w[i] = __fsub_rn(__fmul_rn(scale, float(v)), off);
      }
      break;
    }
    case Fmt::q5_k: {  // q4_k's layout with qh (32 bytes) before the nibbles
      const uint8_t* b = row + (su / 8) * 176;
      const int j = int(su % 8);
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* s = b + 4;
      const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
      const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
      const float scale = __fmul_rn(d, float(sc)), off = __fmul_rn(dmin, float(mn));
      const uint8_t* qh = b + 16;
      const uint8_t* q = b + 48 + 32 * (j / 2);
      const bool high = j & 1;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int v = (high ? q[i] >> 4 : q[i] & 15) | (((qh[i] >> j) & 1) << 4);
        w[i] = __fsub_rn(__fmul_rn(scale, float(v)), off);
      }
      break;
    }
    case Fmt::q6_k: {
      const uint8_t* b = row + (su / 8) * 210;
      const int j = int(su % 8), h = j / 4, r = j % 4;
      const float d = half_at(b + 208);
      const uint8_t* ql = b + 64 * h + (r & 1 ? 32 : 0);
      const uint8_t* qh = b + 128 + 32 * h;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int lo = r < 2 ? ql[i] & 15 : ql[i] >> 4;
        const int v = lo | (((qh[i] >> (2 * r)) & 3) << 4);
        const int e = 128 * h + 32 * r + i;
        w[i] = __fmul_rn(__fmul_rn(d, float(int8_t(b[192 + e / 16]))), float(v - 32));
      }
      break;
    }
    case Fmt::int8: {
      const float s = f32_at(row);
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int64_t e = 32 * su + i;
        w[i] = e < k ? __fmul_rn(float(int8_t(row[4 + e])), s) : 0.f;
      }
      break;
    }
  }
}

// sum over i < 32 of w[i] * x[i]; x 16-byte aligned.
__device__ __forceinline__ float dot32(const float (&w)[32], const float* x) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 32; i += 4) {
    const float4 v = *reinterpret_cast<const float4*>(x + i);
    s = fmaf(w[i], v.x, s);
    s = fmaf(w[i + 1], v.y, s);
    s = fmaf(w[i + 2], v.z, s);
    s = fmaf(w[i + 3], v.w, s);
  }
  return s;
}

// Activation rows as the kernels read them: out [rows, kp] fp32, zeros past k; with
// `group` (32 or 256: act_group of the weight's format; 0: not rounded) each group rounded
// to int8 as the reference's quantize_activations (scale amax / 127, round half to even, a
// group holding NaN / inf all NaN), stored as q * d. One warp per group (kp is a multiple
// of it), lane i holding elements i, i + 32, ...
template <typename T, int G>
__global__ void rows_kernel(const T* __restrict__ x, int64_t rows, int64_t k, int64_t kp,
                            float* __restrict__ out) {
  constexpr int kPer = G == 0 ? 1 : G / 32;
  const int lane = threadIdx.x & 31;
  const int64_t grp = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int64_t groups = kp / (32 * kPer);
  if (grp >= rows * groups) return;  // whole warp
  const int64_t r = grp / groups, e0 = 32 * kPer * (grp % groups) + lane;
  float v[kPer];
  bool fin = true;
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t e = e0 + 32 * i;
    v[i] = e < k ? to_float(x[r * k + e]) : 0.f;
    fin = fin && isfinite(v[i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  if (G != 0) {
    const bool finite = __all_sync(0xffffffffu, fin);
    const float d = warp_max(amax) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const float q = rintf(fminf(127.f, fmaxf(-127.f, v[i] * id)));
      v[i] = finite ? __fmul_rn(q, d) : __int_as_float(0x7fc00000);
    }
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) out[r * kp + e0 + 32 * i] = v[i];
}

// group: act_group(format) with int8 activations, else 0.
template <typename T>
inline at::Tensor prepare_rows(const T* x, int64_t rows, int64_t k, int64_t kp, int64_t group,
                               const at::TensorOptions& opts) {
  at::Tensor out = at::empty({rows, kp}, opts.dtype(at::kFloat));
  const int64_t warps = rows * (kp / (group == 256 ? 256 : 32));
  if (warps == 0) return out;
  constexpr int kWarps = 8;
  TOPG_CHECK(ceil_div(warps, kWarps) <= INT32_MAX, "linear_q", "too many activation rows");
  const unsigned blocks = unsigned(ceil_div(warps, kWarps));
  float* o = out.data_ptr<float>();
  if (group == 256)
    rows_kernel<T, 256><<<blocks, kWarps * 32, 0, current_stream()>>>(x, rows, k, kp, o);
  else if (group == 32)
    rows_kernel<T, 32><<<blocks, kWarps * 32, 0, current_stream()>>>(x, rows, k, kp, o);
  else
    rows_kernel<T, 0><<<blocks, kWarps * 32, 0, current_stream()>>>(x, rows, k, kp, o);
  TOPG_CUDA_LAUNCH_CHECK();
  return out;
}

// rows [n0, n0 + n) of a packed weight de-quantised into out [n, kp] fp32: one thread per
// run of 32. (A template only so that every file including this header may define it.)
template <int = 0>
__global__ void dequant_rows_kernel(const uint8_t* __restrict__ w, int64_t rb, Format f, int64_t k,
                                    int64_t kp, int64_t n0, int64_t n, float* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, runs = kp / 32;
  if (i >= n * runs) return;
  const int64_t r = i / runs, su = i % runs;
  float v[32];
  load_run(f, w + (n0 + r) * rb, k, su, v);
  float* o = out + r * kp + 32 * su;
#pragma unroll
  for (int j = 0; j < 32; j += 4)
    *reinterpret_cast<float4*>(o + j) = make_float4(v[j], v[j + 1], v[j + 2], v[j + 3]);
}

}  // namespace topg::cuda::q
