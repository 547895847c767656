// CUDA kernel: topg::reshape_and_cache (write new K/V rows into the paged cache).
// One block per token; raw copies (16-byte words when every row start allows it), or, into
// int8 caches, one warp per (token, kv head, K or V) row that quantises it.
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

// int8 caches: block = 8 warps; warp w of block b takes row (b * 8 + w) of the T x Hkv x 2
// rows (K then V of each kv head). torch_topg.reference.quantize_kv bit for bit: fp32
// scale = max|x| / 127 (NaN if the row holds one), q = rint(x / scale) (half to even)
// clamped to [-127, 127], 0 where the quotient is NaN; IEEE divisions (__fdiv_rn).
constexpr int kQuantWarps = 8;

template <typename T, typename I>
__global__ void quant_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                   int64_t k_s0, int64_t k_s1, int64_t v_s0, int64_t v_s1,
                                   int8_t* __restrict__ kc, int8_t* __restrict__ vc,
                                   float* __restrict__ ks, float* __restrict__ vs,
                                   const I* __restrict__ slots, int64_t num_slots, int64_t T_,
                                   int hkv, int d) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kQuantWarps + (threadIdx.x >> 5);
  if (row >= T_ * hkv * 2) return;  // warp-uniform
  const int64_t t = row / (2 * hkv);
  const int h = int(row / 2 % hkv), is_v = int(row % 2);
  const int64_t s = int64_t(slots[t]);
  if (s < 0 || s >= num_slots) return;  // padding (or, with checks off, a bad slot): skip
  const T* x = is_v ? value + t * v_s0 + h * v_s1 : key + t * k_s0 + h * k_s1;
  float m = 0.f;
  bool nan = false;
  for (int e = lane; e < d; e += 32) {
    const float a = fabsf(to_float(x[e]));
    nan |= isnan(a);
    m = fmaxf(m, a);
  }
  m = warp_max(m);
  nan = __any_sync(0xffffffffu, nan);
  const float scale = nan ? NAN : __fdiv_rn(m, 127.f);
  const int64_t i = s * hkv + h;
  int8_t* q = (is_v ? vc : kc) + i * d;
  for (int e = lane; e < d; e += 32) {
    const float r = __fdiv_rn(to_float(x[e]), scale);
    q[e] = isnan(r) ? int8_t(0) : int8_t(rintf(fminf(fmaxf(r, -127.f), 127.f)));
  }
  if (lane == 0) (is_v ? vs : ks)[i] = scale;
}

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping_,
                            const std::optional<at::Tensor>& key_scale,
                            const std::optional<at::Tensor>& value_scale) {
  const checks::CacheSizes sz = checks::reshape_and_cache(
      key, value, key_cache, value_cache, slot_mapping_, key_scale, value_scale, at::kCUDA);
  const int64_t T = sz.tokens, hkv = sz.kv_heads, d = sz.head_dim;
  if (T == 0 || hkv == 0 || d == 0) return;
  const c10::cuda::CUDAGuard guard(key.device());
  const at::Tensor slot_mapping = slot_mapping_.contiguous();
  const int64_t num_slots = sz.num_slots;
  if (index_checks_enabled()) {
    const int64_t mx = at::max(slot_mapping).item<int64_t>();
    if (mx >= num_slots) {
      const int64_t t = at::nonzero(slot_mapping.ge(num_slots))[0][0].item<int64_t>();
      checks::bad_slot(slot_mapping_, num_slots, slot_mapping[t].item<int64_t>(), t);
    }
  }
  TOPG_CHECK(T <= INT32_MAX && hkv * d <= INT32_MAX, OP, "too many tokens or heads");
  if (sz.quant) {
    const int64_t blocks = ceil_div(T * hkv * 2, kQuantWarps);
    TOPG_CHECK(blocks <= INT32_MAX, OP, "too many tokens or heads");
    TOPG_CUDA_DISPATCH_FLOAT(key.scalar_type(), OP, E, [&] {
      auto run = [&]<typename I>(const I* slots) {
        quant_cache_kernel<E, I><<<unsigned(blocks), kQuantWarps * 32, 0, current_stream()>>>(
            cdptr<E>(key), cdptr<E>(value), key.stride(0), key.stride(1), value.stride(0),
            value.stride(1), dptr<int8_t>(key_cache), dptr<int8_t>(value_cache),
            dptr<float>(*key_scale), dptr<float>(*value_scale), slots, num_slots, T, int(hkv),
            int(d));
        TOPG_CUDA_LAUNCH_CHECK();
      };
      if (slot_mapping.scalar_type() == at::kLong)
        run(slot_mapping.const_data_ptr<int64_t>());
      else
        run(slot_mapping.const_data_ptr<int32_t>());
    });
    return;
  }
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
