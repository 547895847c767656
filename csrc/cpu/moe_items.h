// The work items of fused_moe's and fused_moe_q's decode paths (an expert with at most 16
// rows; packed experts with int8 activations: the integer GEMM from quant::kQ8GemmRows
// rows where use_gemm_q8 allows it, else the GEMV), shared by the ops (fused_moe.cpp,
// fused_moe_q.cpp) and the decode plan's MoE layers (decode_plan_moe.h): one definition of each
// item, so the plan's sums are the ops' sums, bitwise.
//
//   gate/up item: one expert, a block of intermediate features: h = act(x Wg^T) * (x Wu^T)
//   down item:    a block of output columns, over every hit expert in expert order:
//                 out32[tok] += weight * (h Wd^T), so each output element has one writer
//                 and its experts are added in the same order whoever runs the item.
#pragma once

#include <cstdint>

#include "gemm_kernels.h"
#include "gemm_q8_vnni.h"
#include "moe_kernels.h"
#include "quant_act.h"
#include "quant_kernels.h"
#include "quant_ops.h"

namespace topg::moe {

// Features per gate/up item and output columns per down item (dense dot path).
constexpr int64_t kDotFeatures = 64;
constexpr int64_t kDotColumns = 8 * gemm::NR;
// The same for packed experts.
constexpr int64_t kQFeatures = 32;
constexpr int64_t kQColumns = 32;

// Dense expert, dot path: h rows (fp32, [rows, I], each in the dot path's A layout for
// the down product) of one expert for features [n0, n1). x32: the hidden rows as fp32 in
// the dot path's layout (gemm::dot_a_row<T>), [tokens, H]; tok: the expert's tokens.
template <typename T>
inline void dot_gate_up(const float* x32, int64_t H, const int64_t* tok, int64_t rows, const T* wg,
                        const T* wu, int64_t I, int64_t n0, int64_t n1, Act a, float* h) {
  const float* rows_a[gemm::kDotMaxRows];
  for (int64_t r = 0; r < rows; ++r) rows_a[r] = x32 + tok[r] * H;
  gemm::dot_rows_gated(rows_a, rows, wg, wu, H, H, n0, n1,
                       [&](int64_t m, int64_t n, float g, float u) {
                         h[m * I + gemm::dot_a_index<T>(n, I)] = act(a, g) * u;
                       });
}

// Dense expert, dot path: out32[tok[m] * H + n] += rw[m] * (h_m . Wd_n) for n in [n0, n1).
template <typename T>
inline void dot_down(const float* h, int64_t I, const int64_t* tok, const float* rw, int64_t rows,
                     const T* wd, int64_t H, int64_t n0, int64_t n1, float* out32) {
  const float* rows_a[gemm::kDotMaxRows];
  for (int64_t r = 0; r < rows; ++r) rows_a[r] = h + r * I;
  gemm::dot_rows_range(rows_a, rows, wd, I, I, n0, n1,
                       [&](int64_t m, int64_t n, float s) { out32[tok[m] * H + n] += rw[m] * s; });
}

// One packed weight's kind and rows; rows of expert e start at base + e * rows_per_expert.
struct Packed {
  quant::Format f;
  const uint8_t* base;
  int64_t k, rb, rows_per_expert;
  const uint8_t* row(int64_t e, int64_t n) const { return base + (e * rows_per_expert + n) * rb; }
};

// Activation rows as the packed GEMV reads them: fp32 padded rows and, with int8
// activations, their int8 blocks (codes, scales, code sums per 32); row i at i * kp
// (codes) / i * kp / 32.
struct ActRows {
  int64_t kp = 0;
  const float* x = nullptr;
  const int8_t* q = nullptr;
  const float *d = nullptr, *s = nullptr;
};

// sums[m] = row . a[rows[m]] for m < M (M <= kGemvRows), as linear_q's GEMV computes it.
inline void gemv_rows(const Packed& w, const uint8_t* row, const ActRows& a, const int64_t* rows,
                      int64_t M, bool q8, float* sums, quant::RowsScratch& sc) {
  if (q8) {  // the row's blocks unpacked once per kActRows rows (quant_act.h)
    const int64_t nb = a.kp / 32;
    quant::dot_rows_q8(
        w.f, row, w.rb, 1, w.k, M,
        [&](int64_t m, const int8_t*& q, const float*& d, const float*& s) {
          q = a.q + rows[m] * a.kp, d = a.d + rows[m] * nb, s = a.s + rows[m] * nb;
        },
        sums, 1);
    return;
  }
  const float* xs[quant::kGemvRows];
  for (int64_t m = 0; m < M; ++m) xs[m] = a.x + rows[m] * a.kp;
  quant::dot_rows(w.f, row, w.k, xs, M, sums, sc);
}

struct QScratch {
  quant::RowsScratch sc;
  float g[quant::kGemvRows], u[quant::kGemvRows];
  quant::GemmQ8Scratch gs;                  // the integer GEMM's packed strip (use_gemm_q8)
  float gm[quant::kGemvRows * kQFeatures];  // its gate sums, [row][feature - n0]
};

// The expert's rows as the integer GEMM reads them: row m is activation row rows[m].
inline quant::VnniActs gemm_acts(const ActRows& a, const int64_t* rows) {
  return {a.q, a.d, a.s, a.kp, a.kp / 32, rows};
}

// Packed expert e, GEMV path: h rows (fp32, row stride Ip) for features [n0, n1) of its
// `rows` rows, whose tokens are tok[0..rows) (rows of xa).
inline void q_gate_up(const Packed& wgu, const ActRows& xa, bool q8, int64_t e, const int64_t* tok,
                      int64_t rows, int64_t I, int64_t Ip, int64_t n0, int64_t n1, Act a, float* h,
                      QScratch& s) {
  if (q8 && rows <= quant::kGemvRows && quant::use_gemm_q8(wgu.f.fmt, rows)) {
    // the integer GEMM over the item's gate rows, then its up rows (n1 - n0 <= kQFeatures)
    const quant::VnniActs x = gemm_acts(xa, tok);
    quant::gemm_q8_rows(wgu.f, wgu.row(e, 0), wgu.rb, n0, n1, wgu.k, x, rows, s.gs,
                        [&](int64_t m, int64_t n, float v) { s.gm[m * kQFeatures + n - n0] = v; });
    quant::gemm_q8_rows(wgu.f, wgu.row(e, I), wgu.rb, n0, n1, wgu.k, x, rows, s.gs,
                        [&](int64_t m, int64_t n, float v) {
                          h[m * Ip + n] = act(a, s.gm[m * kQFeatures + n - n0]) * v;
                        });
    return;
  }
  for (int64_t m0 = 0; m0 < rows; m0 += quant::kGemvRows) {  // > 16 rows: batch-invariant
    const int64_t M = std::min(quant::kGemvRows, rows - m0);
    for (int64_t n = n0; n < n1; ++n) {
      gemv_rows(wgu, wgu.row(e, n), xa, tok + m0, M, q8, s.g, s.sc);
      gemv_rows(wgu, wgu.row(e, I + n), xa, tok + m0, M, q8, s.u, s.sc);
      for (int64_t m = 0; m < M; ++m) h[(m0 + m) * Ip + n] = act(a, s.g[m]) * s.u[m];
    }
  }
}

// h row r (Ip values) rounded to int8 blocks (hq, hd, hs at r * Ip, r * Ip / 32; one scale
// per `group`, the down weight's act_group), and the row itself set to the rounded values
// (the fp32 paths' input), as linear_q rounds its input.
inline void q_round_h(float* h, int64_t Ip, int64_t r, int8_t* hq, float* hd, float* hs,
                      int64_t group) {
  float* hr = h + r * Ip;
  quant::quantize_act(hr, Ip, hq + r * Ip, hd + r * Ip / 32, hs + r * Ip / 32, group);
  for (int64_t i = 0; i < Ip; ++i) hr[i] = float(hq[r * Ip + i]) * hd[(r * Ip + i) / 32];
}

// Packed expert e, GEMV path: out32[tok[m] * H + n] += rw[m] * (h_{idx[m]} . Wd_n) for n in
// [n0, n1), m < rows (ha: the h rows; idx: the expert's rows' positions in it).
inline void q_down(const Packed& wd, const ActRows& ha, bool q8, int64_t e, const int64_t* idx,
                   const int64_t* tok, const float* rw, int64_t rows, int64_t H, int64_t n0,
                   int64_t n1, float* out32, QScratch& s) {
  if (q8 && quant::use_gemm_q8(wd.f.fmt, rows)) {  // each (token, column) written once
    quant::gemm_q8_rows(wd.f, wd.row(e, 0), wd.rb, n0, n1, wd.k, gemm_acts(ha, idx), rows, s.gs,
                        [&](int64_t m, int64_t n, float v) { out32[tok[m] * H + n] += rw[m] * v; });
    return;
  }
  for (int64_t m0 = 0; m0 < rows; m0 += quant::kGemvRows) {
    const int64_t M = std::min(quant::kGemvRows, rows - m0);
    for (int64_t n = n0; n < n1; ++n) {
      gemv_rows(wd, wd.row(e, n), ha, idx + m0, M, q8, s.g, s.sc);
      for (int64_t m = 0; m < M; ++m) out32[tok[m0 + m] * H + n] += rw[m0 + m] * s.g[m];
    }
  }
}

}  // namespace topg::moe
