// CPU kernel: topg::fused_moe_q, fused_moe over packed weight-only quantised experts
// (formats: torch_topg/formats.py; block math: quant_kernels.h).
//
//   1. counting sort of the T * k (token, slot) assignments by expert (moe_kernels.h);
//   2. gate/up per hit expert: h[r] = act(x Wg^T) * (x Wu^T) over its gathered rows, in
//      fp32, rows padded with zeros to the down format's padded(I); with
//      int8_activations the rows of x and of h are rounded to int8 per block of 32
//      first, as linear_q does for its input;
//   3. down: out[tok[r]] += weight[r] * h[r] Wd^T into an fp32 output.
// An expert with at most kGemvRows rows (decode) takes work items (moe_items.h) split over
// intermediate features (gate/up) and output columns (down), so every output element has
// one writer; in an item, linear_q's choice for the expert's row count: the integer GEMM
// on its strip of weight rows (int8 activations, quant::use_gemm_q8: VNNI, at least
// kQ8GemmRows rows) or the GEMV, each packed row read once for all its rows. An expert
// with more rows (prefill) runs linear_q's GEMM over the whole expert (int8 activations
// on VNNI: gemm_q8_vnni, every format) or de-quantises its weights in chunks and
// multiplies with at::mm (quant::gemm_dequant), one expert at a time. In batch-invariant
// mode every expert takes the GEMV (a row's sums then do not depend on how many rows
// share its expert). Experts not hit are never read.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "common/checks.h"
#include "common/quant_checks.h"
#include "dispatch.h"
#include "gemm_q8_vnni.h"
#include "modes.h"
#include "moe_items.h"
#include "moe_kernels.h"
#include "parallel.h"
#include "quant_act.h"
#include "quant_kernels.h"
#include "quant_ops.h"

namespace topg {
namespace {

using quant::Format;

using moe::ActRows;
using moe::Packed;

struct Expert {
  int64_t e, row0, rows;
  bool gemv;
};

void moe_q(const Packed& wgu, const Packed& wd, const ActRows& xa, bool a8,
           const moe::Routing& route, int64_t E, int64_t H, int64_t I, moe::Act act, float* out32) {
  const int64_t n_rows = int64_t(route.tok.size()), Ip = wd.f.padded(I);
  const int64_t* tok = route.tok.data();
  const float* rw = route.weight.data();
  std::vector<Expert> hit;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = route.offset[e + 1] - route.offset[e];
    if (rows > 0)
      hit.push_back({e, route.offset[e], rows, rows <= quant::kGemvRows || batch_invariant()});
  }
  // h: one fp32 row of Ip per sorted assignment (zeros past I); int8 blocks of it with a8.
  std::vector<float> h(size_t(n_rows * Ip), 0.f), hd, hs;
  std::vector<int8_t> hq;
  const bool q8_gu = a8, q8_d = a8;

  // --- gate/up ----------------------------------------------------------------------
  for (const Expert& ex : hit) {  // many rows: de-quantise and multiply, expert by expert
    if (ex.gemv) continue;
    at::Tensor gu = at::empty({ex.rows, 2 * I}, at::kFloat);
    if (q8_gu && quant::use_gemm_q8(wgu.f.fmt, ex.rows)) {  // int8 blocks, gathered
      const int64_t kp = xa.kp, nb = kp / 32;
      std::vector<int8_t> q(size_t(ex.rows * kp));
      std::vector<float> d(size_t(ex.rows * nb)), s(size_t(ex.rows * nb));
      for (int64_t r = 0; r < ex.rows; ++r) {
        const int64_t t = tok[ex.row0 + r];
        std::copy_n(xa.q + t * kp, kp, q.data() + r * kp);
        std::copy_n(xa.d + t * nb, nb, d.data() + r * nb);
        std::copy_n(xa.s + t * nb, nb, s.data() + r * nb);
      }
      const quant::VnniActs acts{q.data(), d.data(), s.data(), kp, nb};
      quant::gemm_q8_vnni(wgu.f, acts, ex.rows, H, wgu.row(ex.e, 0), 2 * I, nullptr,
                          gu.data_ptr<float>());
    } else {
      at::Tensor xg = at::empty({ex.rows, xa.kp}, at::kFloat);
      float* xgp = xg.data_ptr<float>();
      for (int64_t r = 0; r < ex.rows; ++r)
        std::copy_n(xa.x + tok[ex.row0 + r] * xa.kp, xa.kp, xgp + r * xa.kp);
      quant::gemm_dequant(wgu.f, xg, H, wgu.row(ex.e, 0), 2 * I, at::Tensor(), gu);
    }
    const float* g = gu.data_ptr<float>();
    at::parallel_for(0, ex.rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t n = 0; n < I; ++n)
          h[size_t((ex.row0 + r) * Ip + n)] =
              moe::act(act, g[r * 2 * I + n]) * g[r * 2 * I + I + n];
    });
  }
  struct Item {
    int ex;
    int64_t n0, n1;
  };
  std::vector<Item> items;  // GEMV experts: (expert, block of intermediate features)
  constexpr int64_t kFeat = moe::kQFeatures;
  for (size_t i = 0; i < hit.size(); ++i)
    if (hit[i].gemv)
      for (int64_t n = 0; n < I; n += kFeat) items.push_back({int(i), n, std::min(I, n + kFeat)});
  parallel_items_with<moe::QScratch>(int64_t(items.size()), [&](int64_t it, moe::QScratch& s) {
    const Expert& ex = hit[size_t(items[it].ex)];
    moe::q_gate_up(wgu, xa, q8_gu, ex.e, tok + ex.row0, ex.rows, I, Ip, items[it].n0, items[it].n1,
                   act, h.data() + ex.row0 * Ip, s);
  });

  // h rounded to int8 blocks, and h itself to the rounded values (the fp32 paths' input)
  ActRows ha{Ip, h.data()};
  if (a8) {
    hq.resize(h.size()), hd.resize(h.size() / 32), hs.resize(h.size() / 32);
    at::parallel_for(0, n_rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        moe::q_round_h(h.data(), Ip, r, hq.data(), hd.data(), hs.data(),
                       quant::act_group(wd.f.fmt));
    });
    ha.q = hq.data(), ha.d = hd.data(), ha.s = hs.data();
  }

  // --- down -------------------------------------------------------------------------
  for (const Expert& ex : hit) {
    if (ex.gemv) continue;
    at::Tensor y = at::empty({ex.rows, H}, at::kFloat);
    if (q8_d && quant::use_gemm_q8(wd.f.fmt, ex.rows)) {  // h rows consecutive
      const int64_t nb = Ip / 32;
      const quant::VnniActs acts{hq.data() + ex.row0 * Ip, hd.data() + ex.row0 * nb,
                                 hs.data() + ex.row0 * nb, Ip, nb};
      quant::gemm_q8_vnni(wd.f, acts, ex.rows, I, wd.row(ex.e, 0), H, nullptr, y.data_ptr<float>());
    } else {
      at::Tensor hx = at::from_blob(h.data() + ex.row0 * Ip, {ex.rows, Ip}, at::kFloat);
      quant::gemm_dequant(wd.f, hx, I, wd.row(ex.e, 0), H, at::Tensor(), y);
    }
    const float* yp = y.data_ptr<float>();
    at::parallel_for(0, H, 256, [&](int64_t c0, int64_t c1) {
      for (int64_t r = 0; r < ex.rows; ++r) {
        float* o = out32 + tok[ex.row0 + r] * H;
        const float wr = rw[ex.row0 + r];
        for (int64_t n = c0; n < c1; ++n) o[n] += wr * yp[r * H + n];
      }
    });
  }
  // GEMV experts: items own output columns; an expert's rows index h by sorted position
  std::vector<int64_t> ident(static_cast<size_t>(n_rows));
  for (int64_t r = 0; r < n_rows; ++r) ident[size_t(r)] = r;
  constexpr int64_t kCols = moe::kQColumns;
  parallel_items_with<moe::QScratch>((H + kCols - 1) / kCols, [&](int64_t c, moe::QScratch& s) {
    const int64_t n0 = c * kCols, n1 = std::min(H, n0 + kCols);
    for (const Expert& ex : hit)
      if (ex.gemv)
        moe::q_down(wd, ha, q8_d, ex.e, ident.data() + ex.row0, tok + ex.row0, rw + ex.row0,
                    ex.rows, H, n0, n1, out32, s);
  });
}

template <typename Id>
void check_ids(const Id* ids, int64_t n, int64_t E) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= E) checks::bad_expert_id(int64_t(ids[i]), i, E, "fused_moe_q");
}

at::Tensor fused_moe_q_cpu(const at::Tensor& hidden, const at::Tensor& w_gate_up,
                           const at::Tensor& w_down, const at::Tensor& topk_weights_,
                           const at::Tensor& topk_ids_, c10::string_view format,
                           const std::optional<c10::string_view>& down_format_,
                           c10::string_view activation, bool int8_activations) {
  const char* op = "fused_moe_q";
  const quant::MoeQSizes sz =
      quant::fused_moe_q(hidden, w_gate_up, w_down, topk_weights_, topk_ids_, format, down_format_,
                         activation, at::kCPU);
  const Format fgu = sz.fgu, fd = sz.fd;
  const int64_t ntok = sz.tokens, H = sz.hidden, E = sz.experts, I = sz.inter;
  const moe::Act act = sz.act == checks::MoeAct::gelu        ? moe::Act::gelu
                       : sz.act == checks::MoeAct::gelu_tanh ? moe::Act::gelu_tanh
                                                             : moe::Act::silu;
  const int64_t k = topk_ids_.size(1);
  const at::Tensor ids = topk_ids_.contiguous(), tw = topk_weights_.contiguous();
  const at::Tensor xc = hidden.contiguous();
  at::Tensor out = at::empty({ntok, H}, xc.options());
  if (ntok == 0 || H == 0) return out;
  TOPG_DISPATCH_FLOAT(xc.scalar_type(), op, T, [&] {
    moe::Routing route;
    auto sort = [&]<typename Id>(const Id* id) {
      check_ids(id, ntok * k, E);
      route = tw.scalar_type() == at::kFloat ? moe::sort_by_expert(id, cptr<float>(tw), ntok, k, E)
                                             : moe::sort_by_expert(id, cptr<T>(tw), ntok, k, E);
    };
    if (ids.scalar_type() == at::kInt)
      sort(cptr<int32_t>(ids));
    else
      sort(cptr<int64_t>(ids));
    std::vector<float> out32(size_t(ntok * H), 0.f);
    if (I > 0) {
      const quant::Rows xr = quant::prepare_rows(cptr<T>(xc), ntok, H, fgu.padded(H),
                                                 int8_activations, quant::act_group(fgu.fmt));
      ActRows xa{xr.Kp, xr.x32.data()};
      if (int8_activations) xa.q = xr.xq.data(), xa.d = xr.xd.data(), xa.s = xr.xsum.data();
      const Packed wgu{fgu, cptr<uint8_t>(w_gate_up), H, fgu.row_bytes(H), 2 * I};
      const Packed wd{fd, cptr<uint8_t>(w_down), I, fd.row_bytes(I), H};
      moe_q(wgu, wd, xa, int8_activations, route, E, H, I, act, out32.data());
    }
    T* o = ptr<T>(out);
    for (int64_t i = 0; i < ntok * H; ++i) o[i] = from_float<T>(out32[size_t(i)]);
  });
  return out;
}

}  // namespace
}  // namespace topg

TORCH_LIBRARY_IMPL(topg, CPU, m) { m.impl("fused_moe_q", &topg::fused_moe_q_cpu); }
