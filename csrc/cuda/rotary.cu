// CUDA kernel: topg::rotary_embedding (in place on query and key). One block per token;
// threads stride over (head, rotation unit). A unit is one pair, or 8 pairs (neox) / 4
// pairs (gpt-j) with 16-byte accesses when sizes, strides and pointers allow.
#include <ATen/TensorUtils.h>
#include <ATen/ops/aminmax.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "common.cuh"

namespace topg::cuda {
namespace {

constexpr const char* kOp = "rotary_embedding";

template <typename T, typename C, typename I, bool VEC>
__global__ void rotary_kernel(const I* __restrict__ pos, T* q, int64_t q_s0, int64_t q_s1, int hq,
                              T* k, int64_t k_s0, int64_t k_s1, int hk, const C* __restrict__ cache,
                              int64_t max_pos, int rot_dim, bool neox) {
  const int64_t t = blockIdx.x;
  const int64_t p = int64_t(pos[t]);
  if (p < 0 || p >= max_pos) return;  // refused on the host unless checks are off
  const C* cs = cache + p * rot_dim;
  const int half = rot_dim / 2;
  const int units = VEC ? (neox ? half / kVec : rot_dim / kVec) : half;
  for (int idx = threadIdx.x; idx < (hq + hk) * units; idx += blockDim.x) {
    const int h = idx / units, u = idx % units;
    T* x = h < hq ? q + t * q_s0 + h * q_s1 : k + t * k_s0 + (h - hq) * k_s1;
    if constexpr (VEC) {
      if (neox) {
        const int i = u * kVec;
        float a[kVec], b[kVec];
        load8(x + i, a);
        load8(x + half + i, b);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float c = to_float(cs[i + j]), s = to_float(cs[half + i + j]);
          const float x1 = a[j], x2 = b[j];
          a[j] = x1 * c - x2 * s;
          b[j] = x2 * c + x1 * s;
        }
        store8(x + i, a);
        store8(x + half + i, b);
      } else {
        const int e = u * kVec;
        float v[kVec];
        load8(x + e, v);
#pragma unroll
        for (int j = 0; j < kVec / 2; ++j) {
          const int i = e / 2 + j;
          const float c = to_float(cs[i]), s = to_float(cs[half + i]);
          const float x1 = v[2 * j], x2 = v[2 * j + 1];
          v[2 * j] = x1 * c - x2 * s;
          v[2 * j + 1] = x2 * c + x1 * s;
        }
        store8(x + e, v);
      }
    } else {
      const int i1 = neox ? u : 2 * u, i2 = neox ? u + half : 2 * u + 1;
      const float c = to_float(cs[u]), s = to_float(cs[half + u]);
      const float x1 = to_float(x[i1]), x2 = to_float(x[i2]);
      x[i1] = from_float<T>(x1 * c - x2 * s);
      x[i2] = from_float<T>(x2 * c + x1 * s);
    }
  }
}

void rotary_embedding_cuda(const at::Tensor& positions, at::Tensor& query,
                           const std::optional<at::Tensor>& key, int64_t head_size,
                           const at::Tensor& cos_sin_cache, bool is_neox) {
  const checks::RotarySizes sz =
      checks::rotary_embedding(positions, query, key, head_size, cos_sin_cache, at::kCUDA);
  const int64_t num_tokens = sz.num_tokens, rot_dim = sz.rot_dim, max_pos = sz.max_pos;
  const at::Tensor& q = sz.q;
  const at::Tensor& k = sz.k;
  if (num_tokens == 0) return;
  const c10::cuda::CUDAGuard guard(query.device());
  if (index_checks_enabled()) {
    const auto [pmin_t, pmax_t] = at::aminmax(positions);
    const int64_t pmin = pmin_t.item<int64_t>(), pmax = pmax_t.item<int64_t>();
    if (pmin < 0 || pmax >= max_pos) checks::bad_positions(positions, max_pos, pmin, pmax);
  }
  TOPG_CHECK(num_tokens <= INT32_MAX, kOp, "more than 2^31 - 1 tokens is not supported");
  const int64_t hq = q.size(1), hk = k.defined() ? k.size(1) : 0;
  TOPG_CHECK((hq + hk) * head_size <= INT32_MAX, kOp, "too many heads per token");
  const at::Tensor pos = positions.reshape({num_tokens}).contiguous();
  const at::Tensor cache = cos_sin_cache.scalar_type() == at::kFloat ||
                                   cos_sin_cache.scalar_type() == query.scalar_type()
                               ? cos_sin_cache
                               : cos_sin_cache.to(at::kFloat);
  TOPG_CUDA_DISPATCH_FLOAT(query.scalar_type(), kOp, T, [&] {
    T* qp = dptr<T>(q);
    T* kp = k.defined() ? dptr<T>(k) : nullptr;
    const int64_t k_s0 = k.defined() ? k.stride(0) : 0, k_s1 = k.defined() ? k.stride(1) : 0;
    const int64_t unit = is_neox ? rot_dim / 2 : rot_dim;
    const bool vec = unit % kVec == 0 && q.stride(0) % kVec == 0 && q.stride(1) % kVec == 0 &&
                     aligned16(qp) &&
                     (!kp || (k_s0 % kVec == 0 && k_s1 % kVec == 0 && aligned16(kp)));
    const int units = int(vec ? unit / kVec : rot_dim / 2);
    const int threads = int(std::clamp<int64_t>(ceil_div((hq + hk) * units, 32) * 32, 32, 512));
    auto launch = [&]<typename C, typename I>(const C* cs, const I* p) {
      auto kernel = vec ? rotary_kernel<T, C, I, true> : rotary_kernel<T, C, I, false>;
      kernel<<<unsigned(num_tokens), threads, 0, current_stream()>>>(
          p, qp, q.stride(0), q.stride(1), int(hq), kp, k_s0, k_s1, int(hk), cs, max_pos,
          int(rot_dim), is_neox);
      TOPG_CUDA_LAUNCH_CHECK();
    };
    auto with_pos = [&]<typename C>(const C* cs) {
      if (pos.scalar_type() == at::kLong)
        launch(cs, pos.const_data_ptr<int64_t>());
      else
        launch(cs, pos.const_data_ptr<int32_t>());
    };
    if (cache.scalar_type() == at::kFloat)
      with_pos(cdptr<float>(cache));
    else
      with_pos(cdptr<T>(cache));
  });
}

}  // namespace
}  // namespace topg::cuda

TORCH_LIBRARY_IMPL(topg, CUDA, m) {
  m.impl("rotary_embedding", &topg::cuda::rotary_embedding_cuda);
}
