// The decode plan's MoE layer (decode_plan.h): what the compiled graph runs as a router
// topg::linear, topg::moe_topk, topg::fused_moe (or fused_moe_q over packed experts) and,
// with a shared expert (Qwen2-MoE), its gated MLP scaled by sigmoid(x . gate), as three
// phases of the plan's team:
//
//   4. router logits; the shared expert's gate/up + SiLU and its gate; the experts' input
//      rows (fused_moe's fp32 rows, or fused_moe_q's padded / int8 rows)
//   5. every member routes every token itself (moe_topk's routine: a few hundred flops,
//      and no barrier); experts' gate/up items (moe_items.h, the ops' own items); the
//      shared expert's down projection
//   6. (int8 activations: h rounded to int8 blocks, then a barrier) experts' down items
//      over output columns, each column summed over the hit experts in expert order as
//      fused_moe does; then rounded to the model dtype and, with a shared expert, the
//      graph's sigmoid(g) * shared (rounded) added (rounded).
// Included by decode_plan_step.cpp only.
#pragma once

#include <ATen/ops/from_blob.h>
#include <ATen/ops/sigmoid.h>

#include <algorithm>
#include <numeric>

#include "activation_kernels.h"
#include "decode_plan.h"
#include "moe_items.h"

namespace topg::plan {

// x as it is: keeps the compiler from contracting a product and a sum into one FMA where
// the graph runs them as two ops (aten mul, then aten add).
inline float opaque(float x) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  asm volatile("" : "+x"(x));
#endif
  return x;
}

template <typename T>
void DecodePlan::moe_buffers(int64_t B) {
  int64_t E = 0, k = 0, Ip = 0;
  bool a8 = false;
  for (const Layer& y : layers_) {
    if (!y.moe) continue;
    const MoeLayer& m = y.m;
    E = std::max(E, m.E), k = std::max(k, m.k), a8 = a8 || m.a8;
    Ip = std::max(Ip, m.fd ? m.fd->padded(m.I) : m.I);
  }
  logits_.resize(size_t(B * E) * sizeof(T)), sgate_.resize(size_t(B) * sizeof(T));
  sdown_.resize(size_t(B * H_) * sizeof(T));
  x32_.resize(size_t(B * H_)), out32_.resize(size_t(B * H_)), h_.resize(size_t(B * k * Ip));
  if (a8) h8q_.resize(h_.size()), h8d_.resize(h_.size() / 32), h8s_.resize(h_.size() / 32);
  ident_.resize(size_t(B * k));
  std::iota(ident_.begin(), ident_.end(), int64_t(0));
}

template <typename T, typename Sync>
void DecodePlan::moe_layer(const Layer& y, Member& m, team::Counter* c, const T* x, T* delta,
                           int64_t B, int me, Sync&& sync) {
  const MoeLayer& e = y.m;
  const int64_t H = H_, E = e.E, K = e.k, I = e.I, Is = e.Is;
  const int64_t Ip = e.fd ? e.fd->padded(I) : I;
  T* logits = reinterpret_cast<T*>(logits_.data());
  T* sg = reinterpret_cast<T*>(sgate_.data());
  T* sdown = reinterpret_cast<T*>(sdown_.data());
  T* gu = reinterpret_cast<T*>(gu_.data());
  T* act = reinterpret_cast<T*>(act_.data());
  float* h = h_.data();
  // fn(u0, u1) over chunks of `chunk` units taken from the shared counter.
  const auto share = [&](team::Counter& ctr, int64_t units, int64_t chunk, auto&& fn) {
    const int64_t n = gemm::ceil_div(units, chunk);
    for (int64_t i = ctr.take(); i < n; i = ctr.take())
      fn(i * chunk, std::min(units, (i + 1) * chunk));
  };
  // out[r * ldo + n] = T(A_r . w_n) for weight rows [n0, n1): topg::linear / linear_q.
  const auto gemv = [&](const Lin& w, int64_t Kin, int64_t n0, int64_t n1, T* out, int64_t ldo) {
    m.in.dot<T>(w, Kin, B, n0, n1,
                [&](int64_t r, int64_t n, float v) { out[r * ldo + n] = from_float<T>(v); });
  };

  // --- 4. router, shared expert's gate/up and gate, the experts' input rows ----------
  share(c[cRouter], gemm::ceil_div(E, 8), 1,
        [&](int64_t u0, int64_t u1) { gemv(e.router, H, u0 * 8, std::min(E, u1 * 8), logits, E); });
  if (e.shared) {
    const int64_t step = rows_per_item(e.sg, e.sg.rb + e.su.rb);
    share(c[cGateUp], gemm::ceil_div(Is, 8), step / 8, [&](int64_t u0, int64_t u1) {
      const int64_t n0 = u0 * 8, n1 = std::min(Is, u1 * 8);
      gemv(e.sg, H, n0, n1, gu, 2 * Is);  // the graph's fused [gate; up] linear, row by row
      gemv(e.su, H, n0, n1, gu + Is, 2 * Is);
      for (int64_t b = 0; b < B; ++b) act::gated_span<act::Silu>(gu, 2 * Is, act, Is, b, n0, n1);
    });
    if (c[cSharedGate].take() == 0) {
      gemv(e.sgate, H, 0, 1, sg, 1);
      // aten's own sigmoid, as the graph calls it on the [B, 1] gate (B values: inline)
      at::Tensor g = at::from_blob(sg, {B, 1}, at::TensorOptions().dtype(dtype_));
      at::sigmoid_(g);
    }
  }
  if (c[cPrep].take() == 0) {
    if (e.fgu) {  // fused_moe_q's rows: fp32 padded, int8 blocks with int8 activations
      xr_ = quant::prepare_rows(x, B, H, e.fgu->padded(H), e.a8, quant::act_group(e.fgu->fmt));
      std::fill(h, h + B * K * Ip, 0.f);  // h's padding past I stays zero
    } else {                              // fused_moe's: fp32 in the dot path's layout
      for (int64_t b = 0; b < B; ++b) gemm::dot_a_row<T>(x + b * H, H, x32_.data() + b * H);
    }
  }
  sync(kGateUp);

  // --- 5. routing (every member), experts' gate/up, shared expert's down --------------
  m.scores.resize(size_t(E)), m.tw.resize(size_t(B * K)), m.ids.resize(size_t(B * K));
  for (int64_t b = 0; b < B; ++b)
    moe::route_token(logits + b * E, nullptr, E, K, true, e.renorm, m.scores.data(),
                     m.tw.data() + b * K, m.ids.data() + b * K);
  if (e.round_w)  // the router returns its weights in the model dtype
    for (float& w : m.tw) w = to_float(from_float<T>(w));
  moe::sort_into(m.route, m.ids.data(), m.tw.data(), B, K, E);
  const int64_t* off = m.route.offset.data();
  const int64_t* tok = m.route.tok.data();
  const float* rw = m.route.weight.data();
  m.hit.clear();
  for (int64_t x_ = 0; x_ < E; ++x_)
    if (off[x_ + 1] > off[x_]) m.hit.push_back(x_);
  const int64_t nh = int64_t(m.hit.size());
  const moe::Packed wgu = e.fgu ? moe::Packed{*e.fgu, static_cast<const uint8_t*>(e.gu_p), H,
                                              e.fgu->row_bytes(H), 2 * I}
                                : moe::Packed{};
  const moe::Packed wdn =
      e.fd ? moe::Packed{*e.fd, static_cast<const uint8_t*>(e.dn_p), I, e.fd->row_bytes(I), H}
           : moe::Packed{};
  moe::ActRows xa{xr_.Kp, xr_.x32.data()};
  if (e.a8) xa.q = xr_.xq.data(), xa.d = xr_.xd.data(), xa.s = xr_.xsum.data();
  const int64_t F = e.fgu ? moe::kQFeatures : moe::kDotFeatures, blocks = gemm::ceil_div(I, F);
  for (int64_t it = c[cExperts].take(); it < nh * blocks; it = c[cExperts].take()) {
    const int64_t ex = m.hit[size_t(it / blocks)], n0 = it % blocks * F;
    const int64_t n1 = std::min(I, n0 + F), row0 = off[ex], rows = off[ex + 1] - row0;
    if (e.fgu) {
      moe::q_gate_up(wgu, xa, e.a8, ex, tok + row0, rows, I, Ip, n0, n1, e.act, h + row0 * Ip,
                     m.qs);
    } else {
      const T* wg = static_cast<const T*>(e.gu_p) + ex * 2 * I * H;
      moe::dot_gate_up<T>(x32_.data(), H, tok + row0, rows, wg, wg + I * H, I, n0, n1, e.act,
                          h + row0 * I);
    }
  }
  if (e.shared) {
    m.in.load(act, Is, B, nullptr);
    const int64_t step = rows_per_item(e.sd, e.sd.rb);
    share(c[cSharedDown], gemm::ceil_div(H, 8), step / 8,
          [&](int64_t u0, int64_t u1) { gemv(e.sd, Is, u0 * 8, std::min(H, u1 * 8), sdown, H); });
  }
  sync(kExperts);

  // --- 6. experts' down (+ the gated shared expert) -----------------------------------
  moe::ActRows ha{Ip, h};
  if (e.a8) {  // fused_moe_q rounds h to int8 blocks once, for every down item
    for (int64_t r = c[cRound].take(); r < B * K; r = c[cRound].take())
      moe::q_round_h(h, Ip, r, h8q_.data(), h8d_.data(), h8s_.data(), quant::act_group(e.fd->fmt));
    ha.q = h8q_.data(), ha.d = h8d_.data(), ha.s = h8s_.data();
    sync(kExperts);
  }
  float* out32 = out32_.data();
  const int64_t cols = e.fgu ? moe::kQColumns : moe::kDotColumns;
  share(c[cDown], gemm::ceil_div(H, cols), 1, [&](int64_t u0, int64_t) {
    const int64_t n0 = u0 * cols, n1 = std::min(H, n0 + cols);
    for (int64_t b = 0; b < B; ++b) std::fill(out32 + b * H + n0, out32 + b * H + n1, 0.f);
    for (const int64_t ex : m.hit) {
      const int64_t row0 = off[ex], rows = off[ex + 1] - row0;
      if (e.fgu) {
        moe::q_down(wdn, ha, e.a8, ex, ident_.data() + row0, tok + row0, rw + row0, rows, H, n0, n1,
                    out32, m.qs);
      } else {
        const T* wd = static_cast<const T*>(e.dn_p) + ex * H * I;
        moe::dot_down<T>(h + row0 * I, I, tok + row0, rw + row0, rows, wd, H, n0, n1, out32);
      }
    }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t n = n0; n < n1; ++n) {
        T v = from_float<T>(out32[b * H + n]);
        if (e.shared) {
          const T gated = from_float<T>(opaque(to_float(sg[b]) * to_float(sdown[b * H + n])));
          v = from_float<T>(to_float(v) + to_float(gated));
        }
        delta[b * H + n] = v;
      }
  });
  (void)me;
  sync(kDown);
}

}  // namespace topg::plan
