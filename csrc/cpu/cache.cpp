// CPU kernel: topg::reshape_and_cache (write new K/V rows into the paged cache: copies, or
// int8 rows and their scales).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>

#include "common/op_checks.h"
#include "dispatch.h"
#include "paged_kernels.h"

namespace topg {
namespace {

constexpr const char* OP = "reshape_and_cache";

template <typename Index>
void run(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
         at::Tensor& value_cache, const at::Tensor& slot_mapping,
         const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_scale) {
  const Index* slots = slot_mapping.const_data_ptr<Index>();
  const int64_t T = key.size(0), num_slots = key_cache.size(0) * key_cache.size(1);
  // Validate every slot before writing anything (a bad slot must not corrupt memory).
  for (int64_t t = 0; t < T; ++t)
    if (int64_t(slots[t]) >= num_slots) checks::bad_slot(slot_mapping, num_slots, slots[t], t);
  const int64_t hkv = key.size(1), d = key.size(2), esize = key.element_size();
  if (key_scale.has_value()) {  // int8 caches: quantise each (token, kv head) row
    const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, hkv * d));
    TOPG_DISPATCH_FLOAT(key.scalar_type(), OP, T_, [&] {
      at::parallel_for(0, T, grain, [&](int64_t b, int64_t e) {
        paged::cache_tokens_int8(cptr<T_>(key), cptr<T_>(value), key.stride(0), key.stride(1),
                                 value.stride(0), value.stride(1), ptr<int8_t>(key_cache),
                                 ptr<int8_t>(value_cache), ptr<float>(*key_scale),
                                 ptr<float>(*value_scale), slots, hkv, d, b, e);
      });
    });
    return;
  }
  const char* k = static_cast<const char*>(key.const_data_ptr());
  const char* v = static_cast<const char*>(value.const_data_ptr());
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
  // Pure copies: split only when there is enough to move to pay for the threads.
  const int64_t grain =
      std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(1, 2 * hkv * d * esize));
  at::parallel_for(0, T, grain, [&](int64_t b, int64_t e) {
    paged::cache_tokens(k, v, key.stride(0), key.stride(1), value.stride(0), value.stride(1), kc,
                        vc, slots, hkv, d, esize, b, e);
  });
}

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping_,
                           const std::optional<at::Tensor>& key_scale,
                           const std::optional<at::Tensor>& value_scale) {
  checks::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping_, key_scale,
                            value_scale, at::kCPU);
  const at::Tensor slot_mapping = slot_mapping_.contiguous();
  if (slot_mapping.scalar_type() == at::kLong)
    run<int64_t>(key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale);
  else
    run<int32_t>(key, value, key_cache, value_cache, slot_mapping, key_scale, value_scale);
}

}  // namespace
}  // namespace topg

TORCH_LIBRARY_IMPL(topg, CPU, m) { m.impl("reshape_and_cache", &topg::reshape_and_cache_cpu); }
