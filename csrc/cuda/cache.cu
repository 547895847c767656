// CUDA kernel: topg::reshape_and_cache (write new K/V rows into the paged cache).
// One block per token; raw copies (16-byte words when every row start allows it).
#include <ATen/ops/max.h>
#include <ATen/ops/nonzero.h>
#include <torch/library.h>

#include "common.cuh"

namespace topg::cuda {
namespace {

constexpr const char* OP = "reshape_and_cache";

// U: the copy word (uint4, uint32_t or uint16_t). Strides and row sizes are in words.
template <typename U, typename I>
__global__ void cache_kernel(const U* __restrict__ key, const U* __restrict__ value, int64_t k_s0,
                             int64_t k_s1, int64_t v_s0, int64_t v_s1, U* __restrict__ kc,
                             U* __restrict__ vc, const I* __restrict__ slots, int64_t num_slots,
                             int hkv, int row_words) {
  const int64_t t = blockIdx.x;
  const int64_t s = int64_t(slots[t]);
  if (s < 0 || s >= num_slots) return;  // padding (or, with checks off, a bad slot): skip
  const int64_t dst = s * hkv * row_words;
  for (int i = threadIdx.x; i < hkv * row_words; i += blockDim.x) {
    const int h = i / row_words, w = i % row_words;
    kc[dst + i] = key[t * k_s0 + h * k_s1 + w];
    vc[dst + i] = value[t * v_s0 + h * v_s1 + w];
  }
}

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping_) {
  Arg(OP, "key", key).dim(3).floating().device(at::kCUDA).last_dim_contiguous();
  Arg(OP, "value", value)
      .dim(3)
      .same_dtype(key, "key")
      .same_device(key, "key")
      .last_dim_contiguous();
  for (int64_t d = 0; d < 3; ++d)
    Arg(OP, "value", value).size(d, key.size(d), "the shape of 'key'");
  for (auto [name, t] :
       {std::pair{"key_cache", &key_cache}, std::pair{"value_cache", &value_cache}}) {
    Arg(OP, name, *t).dim(4).same_dtype(key, "key").same_device(key, "key").contiguous();
    Arg(OP, name, *t)
        .size(2, key.size(1), "kv heads of 'key'")
        .size(3, key.size(2), "head_dim of 'key'");
  }
  for (int64_t d = 0; d < 2; ++d)
    Arg(OP, "value_cache", value_cache).size(d, key_cache.size(d), "the shape of 'key_cache'");
  Arg(OP, "slot_mapping", slot_mapping_).dim(1).index().same_device(key, "key");
  Arg(OP, "slot_mapping", slot_mapping_).size(0, key.size(0), "tokens of 'key'");
  const int64_t T = key.size(0), hkv = key.size(1), d = key.size(2);
  if (T == 0 || hkv == 0 || d == 0) return;
  const c10::cuda::CUDAGuard guard(key.device());
  const at::Tensor slot_mapping = slot_mapping_.contiguous();
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  if (index_checks_enabled()) {
    const int64_t mx = at::max(slot_mapping).item<int64_t>();
    if (mx >= num_slots) {
      const int64_t t = at::nonzero(slot_mapping.ge(num_slots))[0][0].item<int64_t>();
      Arg(OP, "slot_mapping", slot_mapping_)
          .fail("slots below " + std::to_string(num_slots) + " (num_blocks * block_size), got " +
                std::to_string(mx) + " (first bad token " + std::to_string(t) + ")");
    }
  }
  TOPG_CHECK(T <= INT32_MAX && hkv * d <= INT32_MAX, OP, "too many tokens or heads");
  const int64_t esize = key.element_size(), row_bytes = d * esize;
  auto ok = [](int64_t bytes, int64_t w) { return bytes % w == 0; };
  auto launch = [&]<typename U>() {
    constexpr int64_t w = sizeof(U);
    const int row_words = int(row_bytes / w);
    const int threads = int(std::clamp<int64_t>(ceil_div(hkv * row_words, 32) * 32, 32, 256));
    auto run = [&]<typename I>(const I* slots) {
      cache_kernel<U, I><<<unsigned(T), threads, 0, current_stream()>>>(
          static_cast<const U*>(key.const_data_ptr()),
          static_cast<const U*>(value.const_data_ptr()), key.stride(0) * esize / w,
          key.stride(1) * esize / w, value.stride(0) * esize / w, value.stride(1) * esize / w,
          static_cast<U*>(key_cache.data_ptr()), static_cast<U*>(value_cache.data_ptr()), slots,
          num_slots, int(hkv), row_words);
      TOPG_CUDA_LAUNCH_CHECK();
    };
    if (slot_mapping.scalar_type() == at::kLong)
      run(slot_mapping.const_data_ptr<int64_t>());
    else
      run(slot_mapping.const_data_ptr<int32_t>());
  };
  // Word size: 16 bytes when every row start (pointers, strides, row size) is 16-aligned.
  const bool w16 = ok(row_bytes, 16) && ok(key.stride(0) * esize, 16) &&
                   ok(key.stride(1) * esize, 16) && ok(value.stride(0) * esize, 16) &&
                   ok(value.stride(1) * esize, 16) && aligned16(key.const_data_ptr()) &&
                   aligned16(value.const_data_ptr()) && aligned16(key_cache.data_ptr()) &&
                   aligned16(value_cache.data_ptr());
  if (w16)
    launch.template operator()<uint4>();
  else if (esize == 4)
    launch.template operator()<uint32_t>();
  else
    launch.template operator()<uint16_t>();
}

}  // namespace
}  // namespace topg::cuda

TORCH_LIBRARY_IMPL(topg, CUDA, m) {
  m.impl("reshape_and_cache", &topg::cuda::reshape_and_cache_cuda);
}
