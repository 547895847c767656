// Shared by every CUDA binding/kernel file: dtype mapping and conversion, 16-byte vector
// loads, warp/block reductions, the launch helpers and the dtype dispatch.
//
// Only light headers: ATen/core/Tensor.h and c10/cuda (stream, guard, launch check).
// ATen/cuda/CUDAContext.h is avoided on purpose: it pulls in cuBLAS / cuSPARSE headers
// that a minimal CUDA toolkit (the CI build machine's) does not ship.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "common/op_checks.h"
#include "cpu/modes.h"

namespace topg::cuda {

using bf16 = __nv_bfloat16;
using fp16 = __half;

template <typename T>
inline constexpr bool is_half_v = std::is_same_v<T, bf16> || std::is_same_v<T, fp16>;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(fp16 x) { return __half2float(x); }
__device__ __forceinline__ float to_float(int8_t x) { return float(x); }  // int8 KV cache

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ fp16 from_float<fp16>(float x) {
  return __float2half_rn(x);
}

// --- 8-element vectors: one 16-byte access for bf16/fp16, two for fp32, 8 bytes for int8 -
// The callers check alignment (16 bytes) and that element offsets are multiples of 8.
constexpr int kVec = 8;

template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[kVec]) {
  if constexpr (std::is_same_v<T, float>) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else if constexpr (std::is_same_v<T, int8_t>) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const int8_t* b = reinterpret_cast<const int8_t*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = float(b[i]);
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = to_float(h[i]);
  }
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&v)[kVec]) {
  if constexpr (std::is_same_v<T, float>) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint4 raw;
    T* h = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < kVec; ++i) h[i] = from_float<T>(v[i]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
}

// Host side: may `p` (+ element offsets that are multiples of kVec) use load8/store8?
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// --- reductions --------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024). Every thread of the
// block must call it (it has barriers); every thread gets the total.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // `part` may still be read by a previous call
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < nwarps ? part[lane] : 0.f;
  return warp_sum(v);
}

// --- activations (fp32) ------------------------------------------------------------------
enum class Act : int { silu = 0, gelu = 1, gelu_tanh = 2 };

__device__ __forceinline__ float act_apply(Act a, float x) {
  switch (a) {
    case Act::silu:
      return x / (1.f + __expf(-x));
    case Act::gelu:
      return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
    default:
      return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
  }
}

// --- host helpers --------------------------------------------------------------------------
__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Multiprocessors of the current device (cached per device; devices are few).
inline int num_sms() {
  static int cached[64] = {};
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) dev = 0;
  if (cached[dev] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    cached[dev] = n > 0 ? n : 1;
  }
  return cached[dev];
}

// Host-side index validation (block ids, slots, positions, expert ids) costs one device
// sync, so it runs only when asked (topg::index_checks(), cpu/modes.h: TOPG_CUDA_INDEX_CHECKS=1
// or torch_topg.index_checks()), and never while a CUDA graph is being captured (a sync
// there is illegal). The kernels bound every index themselves, so a bad index never
// touches memory out of range (that row is skipped, or an id is clamped into range and
// reads valid but wrong data); without the checks it raises no error.
inline bool index_checks_enabled() {
  if (!topg::index_checks()) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(current_stream(), &status));
  return status == cudaStreamCaptureStatusNone;
}

}  // namespace topg::cuda

// TOPG_CUDA_DISPATCH_FLOAT(dtype, op, T, body): `body` with T = float, __nv_bfloat16 or
// __half; any other dtype is a clear error naming the op.
#define TOPG_CUDA_DISPATCH_FLOAT(dtype, op, T, ...)                     \
  [&] {                                                                 \
    switch (dtype) {                                                    \
      case at::kFloat: {                                                \
        using T = float;                                                \
        return __VA_ARGS__();                                           \
      }                                                                 \
      case at::kBFloat16: {                                             \
        using T = ::topg::cuda::bf16;                                   \
        return __VA_ARGS__();                                           \
      }                                                                 \
      case at::kHalf: {                                                 \
        using T = ::topg::cuda::fp16;                                   \
        return __VA_ARGS__();                                           \
      }                                                                 \
      default:                                                          \
        TORCH_CHECK(false, "topg::", op, ": unsupported dtype ", dtype, \
                    " (expected float32, bfloat16 or float16)");        \
    }                                                                   \
  }()

#define TOPG_CUDA_LAUNCH_CHECK() C10_CUDA_KERNEL_LAUNCH_CHECK()

namespace topg::cuda {
template <typename T>
inline T* dptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}
template <typename T>
inline const T* cdptr(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.const_data_ptr());
}
}  // namespace topg::cuda
