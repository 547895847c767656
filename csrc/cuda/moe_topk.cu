// CUDA kernel: topg::moe_topk. One warp per token: scores (softmax / sigmoid) in shared
// memory, then top_k rounds of a warp arg-max. Ties go to the lower expert index (a
// stable descending sort, as in the reference and the CPU kernel).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <string_view>

#include "common.cuh"

namespace topg::cuda {
namespace {

constexpr const char* kOp = "moe_topk";

// Orders (key, expert) pairs as one integer: higher key first, then lower expert index;
// every NaN (either sign) ranks above every number, as in torch.sort / the CPU kernel.
// 0 marks an expert already taken (any real pair is > 0: its low word is >= 2^32 - E).
__device__ __forceinline__ unsigned long long pack_key(float key, int e) {
  unsigned u = isnan(key) ? 0x7fc00000u : __float_as_uint(key);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // monotonic float -> uint
  return (static_cast<unsigned long long>(u) << 32) | (0xffffffffu - unsigned(e));
}

template <typename T>
__global__ void moe_topk_kernel(const T* __restrict__ logits, const float* __restrict__ bias,
                                int64_t tokens, int E, int k, bool softmax, bool renormalize,
                                float* __restrict__ w_out, int32_t* __restrict__ id_out) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x >> 5) + warp;
  if (t >= tokens) return;  // whole warps leave; there are no block barriers below
  float* scores = smem + size_t(warp) * E;
  const T* l = logits + t * E;
  float mx = -INFINITY;
  for (int e = lane; e < E; e += 32) {
    scores[e] = to_float(l[e]);
    mx = fmaxf(mx, scores[e]);
  }
  mx = warp_max(mx);
  if (softmax) {
    float sum = 0.f;
    for (int e = lane; e < E; e += 32) sum += (scores[e] = expf(scores[e] - mx));
    const float inv = 1.f / warp_sum(sum);
    for (int e = lane; e < E; e += 32) scores[e] *= inv;
  } else {
    for (int e = lane; e < E; e += 32) scores[e] = 1.f / (1.f + expf(-scores[e]));
  }
  __syncwarp();
  // picks[j]: the j-th selected expert (top_k <= 32, checked on the host).
  int* picks = reinterpret_cast<int*>(smem + size_t(blockDim.x >> 5) * E) + warp * 32;
  float total = 0.f, mine = 0.f;
  int my_id = 0;
  for (int j = 0; j < k; ++j) {
    unsigned long long best = 0;
    for (int e = lane; e < E; e += 32) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken |= picks[i] == e;
      if (!taken) {
        const unsigned long long key = pack_key(bias ? scores[e] + bias[e] : scores[e], e);
        best = key > best ? key : best;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
      best = other > best ? other : best;
    }
    // best > 0: at least one expert is untaken (k <= E), and every untaken pair packs > 0.
    const int e = int(0xffffffffu - unsigned(best & 0xffffffffu));
    const float w = scores[e];
    total += w;
    if (lane == j) my_id = e, mine = w;
    if (lane == 0) picks[j] = e;
    __syncwarp();
  }
  const float scale = renormalize && (total > 0.f || isnan(total)) ? 1.f / total : 1.f;
  if (lane < k) {
    w_out[t * k + lane] = mine * scale;
    id_out[t * k + lane] = my_id;
  }
}

std::tuple<at::Tensor, at::Tensor> moe_topk_cuda(const at::Tensor& logits_, int64_t top_k,
                                                 c10::string_view scoring, bool renormalize,
                                                 const std::optional<at::Tensor>& bias_) {
  const checks::TopkSizes sz = checks::moe_topk(logits_, top_k, scoring, bias_, at::kCUDA);
  const int64_t tokens = sz.tokens, experts = sz.experts;
  TOPG_CHECK(top_k <= 32, kOp, "argument 'top_k' expected at most 32 on CUDA, got ", top_k);
  TOPG_CHECK(experts <= 8192, kOp, "at most 8192 experts on CUDA, got ", experts);
  const c10::cuda::CUDAGuard guard(logits_.device());
  const at::Tensor bias = bias_.has_value() ? bias_->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor logits = logits_.contiguous();
  at::Tensor weights = at::empty({tokens, top_k}, logits.options().dtype(at::kFloat));
  at::Tensor ids = at::empty({tokens, top_k}, logits.options().dtype(at::kInt));
  if (tokens == 0) return {weights, ids};
  // Warps per block: 4, fewer when the per-warp score rows would pass 48 KiB.
  const int warps = int(std::clamp<int64_t>(48000 / (experts * 4 + 128), 1, 4));
  const size_t smem = size_t(warps) * (size_t(experts) * sizeof(float) + 32 * sizeof(int));
  const int64_t blocks = ceil_div(tokens, warps);
  TOPG_CHECK(blocks <= INT32_MAX, kOp, "too many tokens");
  TOPG_CUDA_DISPATCH_FLOAT(logits.scalar_type(), kOp, T, [&] {
    moe_topk_kernel<T><<<unsigned(blocks), warps * 32, smem, current_stream()>>>(
        cdptr<T>(logits), bias.defined() ? bias.const_data_ptr<float>() : nullptr, tokens,
        int(experts), int(top_k), scoring == "softmax", renormalize, weights.data_ptr<float>(),
        ids.data_ptr<int32_t>());
    TOPG_CUDA_LAUNCH_CHECK();
  });
  return {weights, ids};
}

}  // namespace
}  // namespace topg::cuda

TORCH_LIBRARY_IMPL(topg, CUDA, m) { m.impl("moe_topk", &topg::cuda::moe_topk_cuda); }
