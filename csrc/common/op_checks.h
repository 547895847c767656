// One argument check per op, shared by the CPU bindings (csrc/cpu) and the CUDA bindings
// (csrc/cuda): shapes, dtypes, devices and layouts. Each returns the sizes the kernel
// needs, validated. The Python checks of the fakes and references (torch_topg/ops/) say
// the same thing in the same words; tests/test_check_wording.py holds them together.
//
// What stays in a binding: value checks that read tensor contents (token positions,
// slots, block ids, cu_seqlens, expert ids; the CPU reads them directly, CUDA checks
// them only when asked, see csrc/cuda/common.cuh) and device limits (CUDA grid sizes).
// `dev` is the device type of the binding: the first tensor argument must live there.
#pragma once

#include <ATen/TensorUtils.h>
#include <c10/util/string_view.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "common/checks.h"

namespace topg::checks {

// ---------------------------------------------------------------- norm
struct RowSizes {
  int64_t rows = 0, hidden = 0;
};

inline RowSizes rms_norm(const char* op, const at::Tensor& input, const at::Tensor& weight,
                         c10::DeviceType dev) {
  Arg(op, "input", input).min_dim(1).floating().device(dev);
  Arg(op, "weight", weight)
      .dim(1)
      .floating()
      .same_device(input, "input")
      .contiguous()
      .size(0, input.size(-1), "the hidden size of 'input'");
  const int64_t n = input.size(-1);
  return {n ? input.numel() / n : 0, n};
}

inline RowSizes fused_add_rms_norm(const at::Tensor& input, const at::Tensor& residual,
                                   const at::Tensor& weight, c10::DeviceType dev) {
  const char* op = "fused_add_rms_norm";
  const RowSizes s = rms_norm(op, input, weight, dev);
  Arg(op, "input", input).contiguous();
  Arg(op, "residual", residual).same_dtype(input, "input").same_device(input, "input").contiguous();
  TOPG_CHECK(residual.sizes() == input.sizes(), op, "argument 'residual' ", describe(residual),
             " expected the shape of 'input' ", input.sizes());
  return s;
}

// ---------------------------------------------------------------- activations
// silu_and_mul / gelu_and_mul: [..., 2 * d] -> [..., d].
inline RowSizes gated(const char* op, const at::Tensor& input, c10::DeviceType dev) {
  Arg(op, "input", input).min_dim(1).floating().device(dev);
  if (input.size(-1) % 2 != 0) Arg(op, "input", input).fail("an even last dimension (gate | up)");
  const int64_t d = input.size(-1) / 2;
  return {input.size(-1) ? input.numel() / input.size(-1) : 0, d};
}

// gelu_and_mul's `approximate`: true for "tanh", false for "none" (erf).
inline bool gelu_tanh(c10::string_view approximate) {
  if (approximate == "none") return false;
  TOPG_CHECK(approximate == "tanh", "gelu_and_mul",
             "argument 'approximate' expected 'none' or 'tanh', got '", std::string(approximate),
             "'");
  return true;
}

// ---------------------------------------------------------------- linear
struct LinearSizes {
  int64_t M = 0, K = 0, N = 0;
  std::vector<int64_t> out_shape;
};

inline LinearSizes linear(const at::Tensor& input, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, c10::DeviceType dev) {
  const char* op = "linear";
  Arg(op, "input", input).min_dim(1).floating().device(dev);
  Arg(op, "weight", weight).dim(2).same_dtype(input, "input").same_device(input, "input");
  Arg(op, "weight", weight).size(1, input.size(-1), "the last dim of 'input'").contiguous();
  if (bias.has_value())
    Arg(op, "bias", *bias)
        .dim(1)
        .same_dtype(input, "input")
        .same_device(input, "input")
        .size(0, weight.size(0), "the output features of 'weight'");
  LinearSizes s;
  s.K = input.size(-1), s.N = weight.size(0), s.M = 1;
  for (int64_t d = 0; d + 1 < input.dim(); ++d) {
    s.M *= input.size(d);
    s.out_shape.push_back(input.size(d));
  }
  s.out_shape.push_back(s.N);
  return s;
}

// ---------------------------------------------------------------- rotary
struct RotarySizes {
  int64_t num_tokens = 0, rot_dim = 0, max_pos = 0;
  at::Tensor q, k;  // [num_tokens, heads, head_size] views of query / key (k undefined if None)
};

// [tokens..., heads * head_size] or [tokens..., heads, head_size] viewed as
// [num_tokens, heads, head_size] without a copy (the op writes in place).
inline at::Tensor rotary_view(const at::Tensor& t, const char* name, int64_t token_dims,
                              int64_t num_tokens, int64_t head_size) {
  const char* op = "rotary_embedding";
  Arg(op, name, t).floating().last_dim_contiguous();
  if (t.dim() != token_dims + 1 && t.dim() != token_dims + 2)
    Arg(op, name, t)
        .fail(std::to_string(token_dims + 1) + " or " + std::to_string(token_dims + 2) +
              " dimensions (the token dims of 'positions', then heads)");
  const int64_t width = t.dim() == token_dims + 1 ? t.size(-1) : t.size(-1) * t.size(-2);
  if (t.dim() == token_dims + 2) Arg(op, name, t).size(-1, head_size, "head_size");
  if (head_size <= 0 || width % head_size != 0)
    Arg(op, name, t)
        .fail("a last dimension that is a multiple of head_size " + std::to_string(head_size));
  // The token dims must collapse into one stride (true for contiguous tensors and for
  // column slices of a fused qkv buffer); otherwise an in-place update is impossible.
  const std::vector<int64_t> shape = {num_tokens, width / head_size, head_size};
  if (!at::detail::computeStride(t.sizes(), t.strides(), c10::IntArrayRef(shape)).has_value())
    Arg(op, name, t).fail("token dims that can be viewed as one (it is updated in place)");
  return t.view(shape);
}

inline RotarySizes rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                    const std::optional<at::Tensor>& key, int64_t head_size,
                                    const at::Tensor& cos_sin_cache, c10::DeviceType dev) {
  const char* op = "rotary_embedding";
  Arg(op, "positions", positions).index().device(dev);
  Arg(op, "query", query).same_device(positions, "positions");
  Arg(op, "cos_sin_cache", cos_sin_cache)
      .dim(2)
      .floating()
      .contiguous()
      .same_device(query, "query");
  TOPG_CHECK(head_size > 0, op, "argument 'head_size' expected a positive value, got ", head_size);
  RotarySizes s;
  const int64_t token_dims = positions.dim();
  s.num_tokens = positions.numel();
  for (int64_t d = 0; d < token_dims; ++d)
    Arg(op, "query", query).size(d, positions.size(d), "the token dims of 'positions'");
  s.q = rotary_view(query, "query", token_dims, s.num_tokens, head_size);
  if (key.has_value()) {
    Arg(op, "key", *key).same_dtype(query, "query").same_device(query, "query");
    for (int64_t d = 0; d < token_dims; ++d)
      Arg(op, "key", *key).size(d, positions.size(d), "the token dims of 'positions'");
    s.k = rotary_view(*key, "key", token_dims, s.num_tokens, head_size);
  }
  s.rot_dim = cos_sin_cache.size(1), s.max_pos = cos_sin_cache.size(0);
  if (s.rot_dim % 2 != 0 || s.rot_dim > head_size || s.rot_dim == 0)
    Arg(op, "cos_sin_cache", cos_sin_cache)
        .fail("an even rotary dimension (size at dim 1) in [2, head_size=" +
              std::to_string(head_size) + "]");
  return s;
}

// The message for positions outside the cache (min / max found by the binding).
[[noreturn]] inline void bad_positions(const at::Tensor& positions, int64_t max_pos, int64_t pmin,
                                       int64_t pmax) {
  Arg("rotary_embedding", "positions", positions)
      .fail("values in [0, " + std::to_string(max_pos) + ") (rows of 'cos_sin_cache'), got [" +
            std::to_string(pmin) + ", " + std::to_string(pmax) + "]");
}

// ---------------------------------------------------------------- paged KV cache
// `key_cache`: the dtype of `like` (the query or the key), or int8 (a quantised cache).
inline void cache_dtype(const char* op, const at::Tensor& kc, const at::Tensor& like,
                        const char* like_name) {
  if (kc.scalar_type() != like.scalar_type() && kc.scalar_type() != at::kChar)
    Arg(op, "key_cache", kc)
        .fail("dtype " + dtype_name(like.scalar_type()) + " (the dtype of '" + like_name +
              "') or int8 (with 'key_scale' and 'value_scale')");
}

// int8 caches need both scales, float32 [num_blocks, block_size, Hkv]; other caches none.
// Returns whether the cache is quantised.
inline bool kv_scales(const char* op, const at::Tensor& kc, const std::optional<at::Tensor>& ks,
                      const std::optional<at::Tensor>& vs) {
  const bool quant = kc.scalar_type() == at::kChar;
  for (auto [name, s] : {std::pair{"key_scale", &ks}, std::pair{"value_scale", &vs}}) {
    if (!s->has_value()) {
      TOPG_CHECK(!quant, op, "argument '", name,
                 "' expected a float32 tensor [num_blocks, block_size, kv_heads] with int8 "
                 "caches, got None");
      continue;
    }
    const Arg a(op, name, **s);
    if (!quant)
      a.fail("None with " + dtype_name(kc.scalar_type()) + " caches (scales go with int8)");
    a.dim(3).dtype(at::kFloat).same_device(kc, "key_cache").contiguous();
    for (int64_t d = 0; d < 3; ++d) a.size(d, kc.size(d), "the shape of 'key_cache'");
  }
  return quant;
}

struct CacheSizes {
  int64_t tokens = 0, kv_heads = 0, head_dim = 0, num_slots = 0;
  bool quant = false;  // int8 caches with scales
};

inline CacheSizes reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                                    const at::Tensor& key_cache, const at::Tensor& value_cache,
                                    const at::Tensor& slot_mapping,
                                    const std::optional<at::Tensor>& key_scale,
                                    const std::optional<at::Tensor>& value_scale,
                                    c10::DeviceType dev) {
  const char* op = "reshape_and_cache";
  Arg(op, "key", key).dim(3).floating().device(dev).last_dim_contiguous();
  Arg(op, "value", value)
      .dim(3)
      .same_dtype(key, "key")
      .same_device(key, "key")
      .last_dim_contiguous();
  for (int64_t d = 0; d < 3; ++d)
    Arg(op, "value", value).size(d, key.size(d), "the shape of 'key'");
  Arg(op, "key_cache", key_cache).dim(4);
  cache_dtype(op, key_cache, key, "key");
  Arg(op, "key_cache", key_cache).contiguous();
  Arg(op, "value_cache", value_cache).dim(4).same_dtype(key_cache, "key_cache").contiguous();
  for (auto [name, t] :
       {std::pair{"key_cache", &key_cache}, std::pair{"value_cache", &value_cache}}) {
    Arg(op, name, *t).same_device(key, "key");
    Arg(op, name, *t)
        .size(2, key.size(1), "kv heads of 'key'")
        .size(3, key.size(2), "head_dim of 'key'");
  }
  for (int64_t d = 0; d < 2; ++d)
    Arg(op, "value_cache", value_cache).size(d, key_cache.size(d), "the shape of 'key_cache'");
  Arg(op, "slot_mapping", slot_mapping).dim(1).index().same_device(key, "key");
  Arg(op, "slot_mapping", slot_mapping).size(0, key.size(0), "tokens of 'key'");
  const bool quant = kv_scales(op, key_cache, key_scale, value_scale);
  return {key.size(0), key.size(1), key.size(2), key_cache.size(0) * key_cache.size(1), quant};
}

[[noreturn]] inline void bad_slot(const at::Tensor& slot_mapping, int64_t num_slots, int64_t slot,
                                  int64_t token) {
  Arg("reshape_and_cache", "slot_mapping", slot_mapping)
      .fail("slots below " + std::to_string(num_slots) + " (num_blocks * block_size), got " +
            std::to_string(slot) + " for token " + std::to_string(token));
}

struct PagedSizes {
  int64_t rows = 0, num_seqs = 0, hq = 0, hkv = 0, head_dim = 0;
  int64_t num_blocks = 0, block_size = 0, max_blocks = 0;
  bool ragged = false;
  bool quant = false;  // int8 caches with scales
};

inline PagedSizes paged_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                                  const at::Tensor& bt, const at::Tensor& sl,
                                  const std::optional<at::Tensor>& cu, int64_t window_left,
                                  double softcap, const std::optional<at::Tensor>& key_scale,
                                  const std::optional<at::Tensor>& value_scale,
                                  c10::DeviceType dev) {
  const char* op = "paged_attention";
  Arg(op, "query", q).dim(3).floating().device(dev).last_dim_contiguous();
  Arg(op, "key_cache", kc).dim(4);
  cache_dtype(op, kc, q, "query");
  Arg(op, "key_cache", kc).same_device(q, "query");
  Arg(op, "key_cache", kc).size(3, q.size(2), "head_dim of 'query'").contiguous();
  Arg(op, "value_cache", vc).dim(4).same_dtype(kc, "key_cache").same_device(q, "query");
  Arg(op, "value_cache", vc).size(3, q.size(2), "head_dim of 'query'").contiguous();
  for (int64_t d = 0; d < 3; ++d)
    Arg(op, "value_cache", vc).size(d, kc.size(d), "the shape of 'key_cache'");
  if (kc.size(1) <= 0)
    Arg(op, "key_cache", kc).fail("a block size (size at dim 1) of at least one token");
  const int64_t hq = q.size(1), hkv = kc.size(2);
  TOPG_CHECK(hkv > 0 && hq % hkv == 0, op, "query heads (", hq,
             ") must be a multiple of key/value heads (", hkv, ")");
  Arg(op, "block_tables", bt).dim(2).dtype(at::kInt).same_device(q, "query");
  Arg(op, "seq_lens", sl).dim(1).dtype(at::kInt).same_device(q, "query");
  if (!cu.has_value()) {
    Arg(op, "block_tables", bt).size(0, q.size(0), "num_seqs of 'query'");
    Arg(op, "seq_lens", sl).size(0, q.size(0), "num_seqs of 'query'");
  } else {
    Arg(op, "block_tables", bt).size(0, sl.size(0), "num_seqs of 'seq_lens'");
    Arg(op, "cu_seqlens_q", *cu).dim(1).dtype(at::kInt).same_device(q, "query");
    Arg(op, "cu_seqlens_q", *cu).size(0, sl.size(0) + 1, "num_seqs + 1, from 'seq_lens'");
    if (sl.size(0) == 0 && q.size(0) > 0)  // no sequence to own the rows (a shape fact)
      Arg(op, "cu_seqlens_q", *cu)
          .fail("non-decreasing offsets from 0 to " + std::to_string(q.size(0)) +
                " (the query rows), got no sequence");
  }
  TOPG_CHECK(window_left >= -1, op, "window_left must be >= -1, got ", window_left);
  TOPG_CHECK(softcap >= 0, op, "softcap must be >= 0, got ", softcap);
  PagedSizes s;
  s.quant = kv_scales(op, kc, key_scale, value_scale);
  s.rows = q.size(0), s.num_seqs = sl.size(0), s.hq = hq, s.hkv = hkv, s.head_dim = q.size(2);
  s.num_blocks = kc.size(0), s.block_size = kc.size(1), s.max_blocks = bt.size(1);
  s.ragged = cu.has_value();
  return s;
}

// Attention sinks (attention, paged_attention): None, or contiguous float32 [hq] on the
// query's device. Returns the pointer the kernels read (null: no sink).
inline const float* sinks(const char* op, const std::optional<at::Tensor>& sinks,
                          const at::Tensor& q, int64_t hq) {
  if (!sinks.has_value()) return nullptr;
  Arg(op, "sinks", *sinks).dim(1).dtype(at::kFloat).same_device(q, "query");
  Arg(op, "sinks", *sinks).size(0, hq, "the query heads of 'query'").contiguous();
  return sinks->const_data_ptr<float>();
}

// ---------------------------------------------------------------- attention (prefill)
struct AttentionSizes {
  bool ragged = false;
  int64_t hq = 0, hkv = 0, head_dim = 0;
};

// Structure only: the values of cu_seqlens_q / cu_seqlens_k and the mask's broadcast
// are checked by the bindings (the CPU reads the offsets; CUDA takes them on the device).
inline AttentionSizes attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& cu_q,
                                const std::optional<at::Tensor>& cu_k, int64_t window_left,
                                double softcap, const std::optional<at::Tensor>& mask,
                                std::optional<int64_t> max_seqlen_q,
                                std::optional<int64_t> max_seqlen_k, c10::DeviceType dev) {
  const char* op = "attention";
  AttentionSizes s;
  s.ragged = cu_q.has_value();
  const int64_t nd = s.ragged ? 3 : 4;
  Arg(op, "query", q).dim(nd).floating().device(dev).last_dim_contiguous();
  Arg(op, "key", k).dim(nd).same_dtype(q, "query").same_device(q, "query").last_dim_contiguous();
  Arg(op, "key", k).size(nd - 1, q.size(-1), "head_dim of 'query'");
  Arg(op, "value", v).dim(nd).same_dtype(q, "query").same_device(q, "query").last_dim_contiguous();
  for (int64_t d = 0; d < nd - 1; ++d) Arg(op, "value", v).size(d, k.size(d), "the shape of 'key'");
  Arg(op, "value", v).size(nd - 1, q.size(-1), "head_dim of 'query'");
  s.hq = q.size(-2), s.hkv = k.size(-2), s.head_dim = q.size(-1);
  TOPG_CHECK(s.hkv > 0 && s.hq % s.hkv == 0, op, "query heads (", s.hq,
             ") must be a multiple of key/value heads (", s.hkv, ")");
  TOPG_CHECK(window_left >= -1, op, "window_left must be >= -1, got ", window_left);
  TOPG_CHECK(softcap >= 0, op, "softcap must be >= 0, got ", softcap);
  if (s.ragged) {
    if (mask.has_value()) Arg(op, "mask", *mask).fail("None with ragged (cu_seqlens) input");
    Arg(op, "cu_seqlens_q", *cu_q).dim(1).dtype(at::kInt).same_device(q, "query");
    if (cu_q->size(0) == 0 || (cu_q->size(0) == 1 && q.size(0) > 0))  // a shape fact
      Arg(op, "cu_seqlens_q", *cu_q)
          .fail("non-decreasing offsets from 0 to " + std::to_string(q.size(0)) +
                " (the token count)");
    if (cu_k.has_value()) {
      Arg(op, "cu_seqlens_k", *cu_k)
          .dim(1)
          .dtype(at::kInt)
          .same_device(q, "query")
          .size(0, cu_q->size(0), "batch + 1, the size of 'cu_seqlens_q'");
    } else {
      TOPG_CHECK(k.size(0) == q.size(0), op, "argument 'key' ", describe(k), " expected ",
                 q.size(0), " tokens (the tokens of 'query', as 'cu_seqlens_k' is None)");
    }
    for (auto [name, v] : {std::pair{"max_seqlen_q", max_seqlen_q}, {"max_seqlen_k", max_seqlen_k}})
      TOPG_CHECK(!v.has_value() || *v >= 0, op, "argument '", name, "' expected a value >= 0, got ",
                 v.value_or(0));
  } else {
    if (cu_k.has_value()) Arg(op, "cu_seqlens_k", *cu_k).fail("None without 'cu_seqlens_q'");
    for (auto [name, v] : {std::pair{"max_seqlen_q", max_seqlen_q}, {"max_seqlen_k", max_seqlen_k}})
      TOPG_CHECK(!v.has_value(), op, "argument '", name, "' expected None without 'cu_seqlens_q'");
    Arg(op, "key", k).size(0, q.size(0), "the batch of 'query'");
    if (mask.has_value()) {
      Arg a(op, "mask", *mask);
      a.same_device(q, "query");
      if (mask->scalar_type() != at::kBool) a.floating();
      if (mask->dim() > 4) a.fail("at most 4 dimensions (broadcastable to [B, Hq, Sq, Sk])");
      const int64_t full[4] = {q.size(0), q.size(2), q.size(1), k.size(1)};
      for (int64_t d = 1; d <= mask->dim(); ++d) {
        const int64_t got = mask->size(-d), want = full[4 - d];
        TOPG_CHECK(got == 1 || got == want, op, "argument 'mask' (shape ", mask->sizes(),
                   ") expected a shape broadcastable to [B, Hq, Sq, Sk] = [", full[0], ", ",
                   full[1], ", ", full[2], ", ", full[3], "]");
      }
    }
  }
  return s;
}

// The offsets of a ragged batch, validated: `host` holds the values of the argument
// `arg` (itself on the CPU, or its copy from the device).
inline std::vector<int64_t> cu_seqlens(const at::Tensor& host, const at::Tensor& arg,
                                       const char* name, int64_t total) {
  const at::Tensor c = host.contiguous();
  const int32_t* p = c.const_data_ptr<int32_t>();
  std::vector<int64_t> out(p, p + c.numel());
  bool ok = !out.empty() && out.front() == 0 && out.back() == total;
  for (size_t i = 1; ok && i < out.size(); ++i) ok = out[i - 1] <= out[i];
  if (!ok)
    Arg("attention", name, arg)
        .fail("non-decreasing offsets from 0 to " + std::to_string(total) + " (the token count)");
  return out;
}

// A caller's max_seqlen_q / max_seqlen_k against the offsets read on the host.
inline void max_seqlen(const std::vector<int64_t>& cu, std::optional<int64_t> given,
                       const char* name) {
  int64_t longest = 0;
  for (size_t b = 1; b < cu.size(); ++b) longest = std::max(longest, cu[b] - cu[b - 1]);
  TOPG_CHECK(!given.has_value() || *given >= longest, "attention", "argument '", name,
             "' expected at least the longest sequence (", longest, "), got ", given.value_or(0));
}

// ---------------------------------------------------------------- mixture of experts
enum class MoeAct { silu, gelu, gelu_tanh };

// The routing arguments of a fused MoE op (fused_moe, fused_moe_q): topk_weights and
// topk_ids, one row per token of `hidden` ([tokens, H]), and the activation's name.
inline MoeAct moe_routing(const char* op, const at::Tensor& hidden, const at::Tensor& topk_weights,
                          const at::Tensor& topk_ids, c10::string_view activation) {
  const int64_t tokens = hidden.size(0);
  Arg(op, "topk_weights", topk_weights).dim(2).size(0, tokens, "the tokens of 'hidden_states'");
  if (topk_weights.scalar_type() != at::kFloat)
    Arg(op, "topk_weights", topk_weights).same_dtype(hidden, "hidden_states");
  Arg(op, "topk_weights", topk_weights).same_device(hidden, "hidden_states");
  Arg(op, "topk_ids", topk_ids)
      .dim(2)
      .index()
      .same_device(hidden, "hidden_states")
      .size(0, tokens, "the tokens of 'hidden_states'")
      .size(1, topk_weights.size(1), "the top-k of 'topk_weights'");
  if (activation == "gelu") return MoeAct::gelu;
  if (activation == "gelu_tanh") return MoeAct::gelu_tanh;
  TOPG_CHECK(activation == "silu", op, "activation '", std::string(activation),
             "' is not one of 'silu', 'gelu', 'gelu_tanh'");
  return MoeAct::silu;
}

struct MoeSizes {
  int64_t tokens = 0, hidden = 0, experts = 0, inter = 0, top_k = 0;
  MoeAct act = MoeAct::silu;
};

inline MoeSizes fused_moe(const at::Tensor& hidden, const at::Tensor& w_gate_up,
                          const at::Tensor& w_down, const at::Tensor& topk_weights,
                          const at::Tensor& topk_ids, c10::string_view activation,
                          c10::DeviceType dev) {
  const char* op = "fused_moe";
  Arg(op, "hidden_states", hidden).dim(2).floating().device(dev);
  MoeSizes s;
  s.tokens = hidden.size(0), s.hidden = hidden.size(1);
  Arg(op, "w_gate_up", w_gate_up).dim(3).same_dtype(hidden, "hidden_states");
  Arg(op, "w_gate_up", w_gate_up)
      .same_device(hidden, "hidden_states")
      .size(2, s.hidden, "the hidden size of 'hidden_states'")
      .contiguous();
  TOPG_CHECK(w_gate_up.size(1) % 2 == 0, op, "argument 'w_gate_up' ", describe(w_gate_up),
             " expected an even size at dim 1 ([gate; up] rows)");
  s.experts = w_gate_up.size(0), s.inter = w_gate_up.size(1) / 2;
  Arg(op, "w_down", w_down).dim(3).same_dtype(hidden, "hidden_states");
  Arg(op, "w_down", w_down)
      .same_device(hidden, "hidden_states")
      .size(0, s.experts, "the experts of 'w_gate_up'")
      .size(1, s.hidden, "the hidden size of 'hidden_states'")
      .size(2, s.inter, "half of dim 1 of 'w_gate_up'")
      .contiguous();
  s.act = moe_routing(op, hidden, topk_weights, topk_ids, activation);
  s.top_k = topk_ids.size(1);
  return s;
}

// An expert id out of range, found by a kernel while it reads topk_ids.
[[noreturn]] inline void bad_expert_id(int64_t id, int64_t flat_index, int64_t experts,
                                       const char* op = "fused_moe") {
  TOPG_CHECK(false, op, "argument 'topk_ids' holds expert id ", id, " at flat index ", flat_index,
             ", expected ids in [0, ", experts, ") (the experts of 'w_gate_up')");
}

struct TopkSizes {
  int64_t tokens = 0, experts = 0;
  bool softmax = true;
};

inline TopkSizes moe_topk(const at::Tensor& logits, int64_t top_k, c10::string_view scoring,
                          const std::optional<at::Tensor>& bias, c10::DeviceType dev) {
  const char* op = "moe_topk";
  Arg(op, "router_logits", logits).dim(2).floating().device(dev);
  TopkSizes s;
  s.tokens = logits.size(0), s.experts = logits.size(1);
  TOPG_CHECK(top_k >= 1 && top_k <= s.experts, op, "argument 'top_k' expected a value in [1, ",
             s.experts, "] (the number of experts), got ", top_k);
  TOPG_CHECK(scoring == "softmax" || scoring == "sigmoid", op,
             "argument 'scoring' expected 'softmax' or 'sigmoid', got '", std::string(scoring),
             "'");
  if (bias.has_value())
    Arg(op, "correction_bias", *bias)
        .dim(1)
        .floating()
        .same_device(logits, "router_logits")
        .size(0, s.experts, "the number of experts");
  s.softmax = scoring == "softmax";
  return s;
}

}  // namespace topg::checks
