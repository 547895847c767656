// CPU kernel: topg::attention (prefill, dense or ragged). Checks, dtype dispatch and
// scheduling; the math is in attention_kernels.h.
#include <ATen/ops/empty.h>
#include <ATen/ops/where.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "attention_kernels.h"
#include "common/op_checks.h"
#include "dispatch.h"
#include "parallel.h"

namespace topg {
namespace {

constexpr const char* OP = "attention";

// Bool -> additive (0 / -inf) fp32, floating -> fp32; then broadcast to [B, Hq, Sq, Sk]
// (the shape was checked by checks::attention).
at::Tensor prepare_mask(const at::Tensor& mask, const at::Tensor& q, int64_t sk) {
  at::Tensor m = mask.scalar_type() == at::kBool
                     ? at::where(mask, 0.0, -std::numeric_limits<double>::infinity())
                     : mask.to(at::kFloat);
  return m.expand({q.size(0), q.size(2), q.size(1), sk});
}

at::Tensor attention_cpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         const std::optional<at::Tensor>& cu_seqlens_q,
                         const std::optional<at::Tensor>& cu_seqlens_k, bool causal,
                         std::optional<double> scale, int64_t window_left, double softcap,
                         const std::optional<at::Tensor>& mask, std::optional<int64_t> max_seqlen_q,
                         std::optional<int64_t> max_seqlen_k,
                         const std::optional<at::Tensor>& sinks) {
  const checks::AttentionSizes sz =
      checks::attention(query, key, value, cu_seqlens_q, cu_seqlens_k, window_left, softcap, mask,
                        max_seqlen_q, max_seqlen_k, at::kCPU);
  const float* sink_ptr = checks::sinks(OP, sinks, query, sz.hq);
  const bool ragged = sz.ragged;

  // Per-sequence offsets (elements) and lengths; token / head strides are shared.
  std::vector<int64_t> q_off, k_off, v_off, o_off, sq, sk;
  at::Tensor out = at::empty(query.sizes(), query.options());
  at::Tensor mask_f;
  if (ragged) {
    const auto cq = checks::cu_seqlens(*cu_seqlens_q, *cu_seqlens_q, "cu_seqlens_q", query.size(0));
    std::vector<int64_t> ck = cq;
    if (cu_seqlens_k.has_value())
      ck = checks::cu_seqlens(*cu_seqlens_k, *cu_seqlens_k, "cu_seqlens_k", key.size(0));
    checks::max_seqlen(cq, max_seqlen_q, "max_seqlen_q");
    checks::max_seqlen(ck, max_seqlen_k, "max_seqlen_k");
    for (size_t b = 0; b + 1 < cq.size(); ++b) {
      q_off.push_back(cq[b] * query.stride(0));
      k_off.push_back(ck[b] * key.stride(0));
      v_off.push_back(ck[b] * value.stride(0));
      o_off.push_back(cq[b] * out.stride(0));
      sq.push_back(cq[b + 1] - cq[b]);
      sk.push_back(ck[b + 1] - ck[b]);
    }
  } else {
    for (int64_t b = 0; b < query.size(0); ++b) {
      q_off.push_back(b * query.stride(0));
      k_off.push_back(b * key.stride(0));
      v_off.push_back(b * value.stride(0));
      o_off.push_back(b * out.stride(0));
      sq.push_back(query.size(1));
      sk.push_back(key.size(1));
    }
    if (mask.has_value()) mask_f = prepare_mask(*mask, query, key.size(1));
  }
  if (out.numel() == 0) return out;

  const int64_t hq = sz.hq, hkv = sz.hkv, d = sz.head_dim;
  TOPG_DISPATCH_FLOAT(query.scalar_type(), OP, T, [&] {
    attn::PrefillArgs<T> a{};
    a.q = cptr<T>(query), a.k = cptr<T>(key), a.v = cptr<T>(value), a.out = ptr<T>(out);
    a.q_ss = query.stride(-3), a.q_sh = query.stride(-2);
    a.k_ss = key.stride(-3), a.k_sh = key.stride(-2);
    a.v_ss = value.stride(-3), a.v_sh = value.stride(-2);
    a.o_ss = out.stride(-3), a.o_sh = out.stride(-2);
    a.q_off = q_off.data(), a.k_off = k_off.data(), a.v_off = v_off.data();
    a.o_off = o_off.data(), a.sq = sq.data(), a.sk = sk.data();
    a.hq = hq, a.hkv = hkv, a.d = d;
    a.scale = float(scale.has_value() ? *scale : 1.0 / std::sqrt(double(d)));
    a.softcap = float(softcap), a.causal = causal, a.window = window_left;
    a.sinks = sink_ptr;
    if (mask_f.defined()) {
      a.mask = mask_f.const_data_ptr<float>();
      a.m_sb = mask_f.stride(0), a.m_sh = mask_f.stride(1);
      a.m_si = mask_f.stride(2), a.m_sj = mask_f.stride(3);
    }
    attn::run_prefill(a, int64_t(sq.size()));
  });
  return out;
}

}  // namespace
}  // namespace topg

TORCH_LIBRARY_IMPL(topg, CPU, m) { m.impl("attention", &topg::attention_cpu); }
