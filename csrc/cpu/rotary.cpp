// CPU kernel: topg::rotary_embedding (in place on query and key).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "common/op_checks.h"
#include "dispatch.h"
#include "rotary_kernels.h"

namespace topg {
namespace {

constexpr const char* kOp = "rotary_embedding";

void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& query,
                          const std::optional<at::Tensor>& key, int64_t head_size,
                          const at::Tensor& cos_sin_cache, bool is_neox) {
  const auto [num_tokens, rot_dim, max_pos, q, k] =
      checks::rotary_embedding(positions, query, key, head_size, cos_sin_cache, at::kCPU);
  if (num_tokens == 0) return;
  // A plain loop, not at::aminmax: at decode sizes the reduction machinery costs more
  // than the rotation itself.
  const at::Tensor pos = positions.reshape({num_tokens}).to(at::kLong).contiguous();
  const int64_t* p = pos.const_data_ptr<int64_t>();
  int64_t pmin = p[0], pmax = p[0];
  for (int64_t i = 1; i < num_tokens; ++i) {
    pmin = std::min(pmin, p[i]);
    pmax = std::max(pmax, p[i]);
  }
  if (pmin < 0 || pmax >= max_pos) checks::bad_positions(positions, max_pos, pmin, pmax);
  const at::Tensor cache = cos_sin_cache.scalar_type() == at::kFloat ||
                                   cos_sin_cache.scalar_type() == query.scalar_type()
                               ? cos_sin_cache
                               : cos_sin_cache.to(at::kFloat);

  TOPG_DISPATCH_FLOAT(query.scalar_type(), kOp, T, [&] {
    auto run = [&]<typename C>(const C* cs) {
      T* qp = ptr<T>(q);
      T* kp = k.defined() ? ptr<T>(k) : nullptr;
      const int64_t hq = q.size(1), hk = k.defined() ? k.size(1) : 0;
      const int64_t grain = std::max<int64_t>(1, 4096 / ((hq + hk) * head_size));
      at::parallel_for(0, num_tokens, grain, [&](int64_t b, int64_t e) {
        std::vector<float> cos(rot_dim), sin(rot_dim);
        for (int64_t t = b; t < e; ++t) {
          rotary::load_cos_sin(cs + p[t] * rot_dim, rot_dim, is_neox, cos.data(), sin.data());
          rotary::rotate_heads(qp + t * q.stride(0), hq, q.stride(1), cos.data(), sin.data(),
                               rot_dim, is_neox);
          if (kp)
            rotary::rotate_heads(kp + t * k.stride(0), hk, k.stride(1), cos.data(), sin.data(),
                                 rot_dim, is_neox);
        }
      });
    };
    if (cache.scalar_type() == at::kFloat)
      run(cptr<float>(cache));
    else
      run(cptr<T>(cache));
  });
}

}  // namespace
}  // namespace topg

TORCH_LIBRARY_IMPL(topg, CPU, m) { m.impl("rotary_embedding", &topg::rotary_embedding_cpu); }
