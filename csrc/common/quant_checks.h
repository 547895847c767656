// Argument checks of the quantised-weight ops (linear_q, embedding_q, fused_moe_q), shared
// by the CPU and CUDA bindings; wording as torch_topg/ops/{linear_q,embedding_q,
// fused_moe_q}.py so the native kernels and the reference fallback fail the same way.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "common/checks.h"
#include "common/op_checks.h"
#include "common/quant_formats.h"

namespace topg::quant {

inline Format parse_format(const char* op, c10::string_view name) {
  if (const Format* f = find_format(std::string(name))) return *f;
  std::string known;
  for (const auto& nf : kFormats)
    known += std::string(known.empty() ? "" : ", ") + "'" + nf.name + "'";
  TOPG_CHECK(false, op, "format '", std::string(name), "' is not one of ", known);
}

// The packed weight [rows, row_bytes(k)]: 2-D uint8, on the device of `ref`, contiguous.
inline void check_packed(const char* op, const at::Tensor& weight, const at::Tensor& ref,
                         const Format& f, c10::string_view format, int64_t k) {
  const Arg w(op, "weight", weight);
  w.dim(2).dtype(at::kByte).same_device(ref, "input");
  const std::string what =
      "the bytes of a " + std::string(format) + " row of " + std::to_string(k) + " weights";
  w.size(1, f.row_bytes(k), what.c_str()).contiguous();
}

struct LinearQSizes {
  Format f;
  int64_t M = 1, K = 0, N = 0;
  std::vector<int64_t> out_shape;
};

inline LinearQSizes linear_q(const at::Tensor& input, const at::Tensor& weight,
                             c10::string_view format, const std::optional<at::Tensor>& bias,
                             c10::DeviceType dev) {
  const char* op = "linear_q";
  const Arg x(op, "input", input);
  x.min_dim(1).floating().device(dev);
  LinearQSizes s{parse_format(op, format)};
  s.K = input.size(-1);
  if (s.f.block != 0 && !pads(s.f) && s.K % s.f.block != 0)
    x.fail("a last dimension that is a multiple of " + std::to_string(s.f.block) +
           " (the block of " + std::string(format) + ")");
  check_packed(op, weight, input, s.f, format, s.K);
  s.N = weight.size(0);
  if (bias.has_value())
    Arg(op, "bias", *bias)
        .dim(1)
        .same_dtype(input, "input")
        .same_device(input, "input")
        .size(0, s.N, "the output features of 'weight'");
  s.out_shape.assign(input.sizes().begin(), input.sizes().end());
  s.out_shape.back() = s.N;
  for (int64_t d = 0; d + 1 < input.dim(); ++d) s.M *= input.size(d);
  return s;
}

inline Format embedding_q(const at::Tensor& input, const at::Tensor& weight,
                          c10::string_view format, int64_t embedding_dim, at::ScalarType dtype,
                          c10::DeviceType dev) {
  const char* op = "embedding_q";
  Arg(op, "input", input).index().device(dev);
  const Format f = parse_format(op, format);
  TOPG_CHECK(is_float_dtype(dtype), op, "dtype ", dtype_name(dtype),
             " is not one of float32, bfloat16, float16");
  TOPG_CHECK(embedding_dim >= 0, op, "embedding_dim ", embedding_dim, " is negative");
  TOPG_CHECK(f.block == 0 || pads(f) || embedding_dim % f.block == 0, op, "embedding_dim ",
             embedding_dim, " is not a multiple of ", f.block, " (the block of ",
             std::string(format), ")");
  check_packed(op, weight, input, f, format, embedding_dim);
  return f;
}

struct MoeQSizes {
  Format fgu, fd;
  int64_t tokens = 0, hidden = 0, experts = 0, inter = 0, top_k = 0;
  checks::MoeAct act = checks::MoeAct::silu;
};

// A packed expert stack [E, rows, row_bytes(k)]: 3-D uint8 on the device of `ref`, contiguous.
inline void check_stack(const char* op, const char* name, const at::Tensor& w,
                        const at::Tensor& ref, const Format& f, c10::string_view format,
                        int64_t k) {
  const Arg a(op, name, w);
  a.dim(3).dtype(at::kByte).same_device(ref, "hidden_states");
  const std::string what =
      "the bytes of a " + std::string(format) + " row of " + std::to_string(k) + " weights";
  a.size(2, f.row_bytes(k), what.c_str()).contiguous();
}

inline MoeQSizes fused_moe_q(const at::Tensor& hidden, const at::Tensor& w_gate_up,
                             const at::Tensor& w_down, const at::Tensor& topk_weights,
                             const at::Tensor& topk_ids, c10::string_view format,
                             const std::optional<c10::string_view>& down_format,
                             c10::string_view activation, c10::DeviceType dev) {
  const char* op = "fused_moe_q";
  Arg(op, "hidden_states", hidden).dim(2).floating().device(dev);
  MoeQSizes s{parse_format(op, format)};
  const c10::string_view down_name = down_format.has_value() ? *down_format : format;
  s.fd = parse_format(op, down_name);
  s.tokens = hidden.size(0), s.hidden = hidden.size(1);
  auto whole_blocks = [&](const Format& f, c10::string_view name, int64_t k, const char* what) {
    TOPG_CHECK(f.block == 0 || pads(f) || k % f.block == 0, op, what, " ", k,
               " is not a multiple of ", f.block, " (the block of ", std::string(name), ")");
  };
  whole_blocks(s.fgu, format, s.hidden, "the hidden size");
  Arg(op, "w_gate_up", w_gate_up).dim(3);
  TOPG_CHECK(w_gate_up.size(1) % 2 == 0, op, "argument 'w_gate_up' ", describe(w_gate_up),
             " expected an even size at dim 1 ([gate; up] rows)");
  check_stack(op, "w_gate_up", w_gate_up, hidden, s.fgu, format, s.hidden);
  s.experts = w_gate_up.size(0), s.inter = w_gate_up.size(1) / 2;
  whole_blocks(s.fd, down_name, s.inter, "the intermediate size");
  check_stack(op, "w_down", w_down, hidden, s.fd, down_name, s.inter);
  Arg(op, "w_down", w_down)
      .size(0, s.experts, "the experts of 'w_gate_up'")
      .size(1, s.hidden, "the hidden size of 'hidden_states'");
  s.act = checks::moe_routing(op, hidden, topk_weights, topk_ids, activation);
  s.top_k = topk_ids.size(1);
  return s;
}

}  // namespace topg::quant
