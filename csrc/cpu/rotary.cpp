// CPU kernel: topg::rotary_embedding (in place on query and key).
#include <ATen/Parallel.h>
#include <ATen/TensorUtils.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "checks.h"
#include "dispatch.h"
#include "rotary_kernels.h"

namespace topg {
namespace {

constexpr const char* kOp = "rotary_embedding";

// [tokens..., heads * head_size] or [tokens..., heads, head_size] viewed as
// [num_tokens, heads, head_size] without a copy (the op writes in place).
at::Tensor as_token_head_view(const at::Tensor& t, const char* name, int64_t token_dims,
                              int64_t num_tokens, int64_t head_size) {
  Arg(kOp, name, t).floating().last_dim_contiguous();
  if (t.dim() != token_dims + 1 && t.dim() != token_dims + 2)
    Arg(kOp, name, t)
        .fail(std::to_string(token_dims + 1) + " or " + std::to_string(token_dims + 2) +
              " dimensions (the token dims of 'positions', then heads)");
  const int64_t width = t.dim() == token_dims + 1 ? t.size(-1) : t.size(-1) * t.size(-2);
  if (t.dim() == token_dims + 2) Arg(kOp, name, t).size(-1, head_size, "head_size");
  if (head_size <= 0 || width % head_size != 0)
    Arg(kOp, name, t)
        .fail("a last dimension that is a multiple of head_size " + std::to_string(head_size));
  // The token dims must collapse into one stride (true for contiguous tensors and for
  // column slices of a fused qkv buffer); otherwise an in-place update is impossible.
  const std::vector<int64_t> shape = {num_tokens, width / head_size, head_size};
  if (!at::detail::computeStride(t.sizes(), t.strides(), c10::IntArrayRef(shape)).has_value())
    Arg(kOp, name, t).fail("token dims that can be viewed as one (it is updated in place)");
  return t.view(shape);
}

void rotary_embedding_cpu(const at::Tensor& positions, at::Tensor& query,
                          const std::optional<at::Tensor>& key, int64_t head_size,
                          const at::Tensor& cos_sin_cache, bool is_neox) {
  Arg(kOp, "positions", positions).index().device(at::kCPU);
  Arg(kOp, "query", query).same_device(positions, "positions");
  Arg(kOp, "cos_sin_cache", cos_sin_cache)
      .dim(2)
      .floating()
      .contiguous()
      .same_device(query, "query");
  const int64_t token_dims = positions.dim(), num_tokens = positions.numel();
  for (int64_t d = 0; d < token_dims; ++d)
    Arg(kOp, "query", query).size(d, positions.size(d), "the token dims of 'positions'");
  const at::Tensor q = as_token_head_view(query, "query", token_dims, num_tokens, head_size);
  at::Tensor k;
  if (key.has_value()) {
    Arg(kOp, "key", *key).same_dtype(query, "query").same_device(query, "query");
    for (int64_t d = 0; d < token_dims; ++d)
      Arg(kOp, "key", *key).size(d, positions.size(d), "the token dims of 'positions'");
    k = as_token_head_view(*key, "key", token_dims, num_tokens, head_size);
  }
  const int64_t rot_dim = cos_sin_cache.size(1), max_pos = cos_sin_cache.size(0);
  if (rot_dim % 2 != 0 || rot_dim > head_size || rot_dim == 0)
    Arg(kOp, "cos_sin_cache", cos_sin_cache)
        .fail("an even rotary dimension (size at dim 1) in [2, head_size=" +
              std::to_string(head_size) + "]");
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
  if (pmin < 0 || pmax >= max_pos)
    Arg(kOp, "positions", positions)
        .fail("values in [0, " + std::to_string(max_pos) + ") (rows of 'cos_sin_cache'), got [" +
              std::to_string(pmin) + ", " + std::to_string(pmax) + "]");
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
