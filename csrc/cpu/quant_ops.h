// Host-side pieces shared by the quantised-weight ops (linear_q.cpp, fused_moe_q.cpp):
// format names, packed-weight checks, activation rows in the kernels' layouts, and the
// de-quantise-and-multiply path for many rows.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/checks.h"
#include "common/quant_checks.h"
#include "dispatch.h"
#include "parallel.h"
#include "quant_act.h"

namespace topg::quant {

// The GEMV's row limit: the decode plan's steps (gemm::kDotMaxRows, 16), so the plan and
// linear_q run the same kernel (and agree bitwise) on every step the plan takes; more rows
// take gemm_dequant.
inline constexpr int64_t kGemvRows = 16;

// The kernels' inputs from the activations [M, K]: fp32 rows [M, padded(K)] (zeros past
// K), and with int8_activations the int8 codes, scales and code sums
// per 32, one scale per `group` (the weight format's act_group: quant::quantize_act); the
// fp32 rows then hold the rounded values (q * d), or,
// with keep_fp32 false (the integer GEMM reads only the int8 blocks), are not kept.
struct Rows {
  int64_t M = 0, Kp = 0;
  std::vector<float> x32, xd, xsum;
  std::vector<int8_t> xq;
  const float* x(int64_t m) const { return x32.data() + m * Kp; }
};

template <typename T>
Rows prepare_rows(const T* x, int64_t M, int64_t K, int64_t Kp, bool int8_activations,
                  int64_t group, bool keep_fp32 = true) {
  Rows r;
  r.M = M, r.Kp = Kp;
  const int64_t nb = Kp / 32;
  keep_fp32 = keep_fp32 || !int8_activations;
  if (keep_fp32) r.x32.resize(size_t(M * Kp));
  if (int8_activations) {
    r.xq.resize(size_t(M * Kp));
    r.xd.resize(size_t(M * nb));
    r.xsum.resize(size_t(M * nb));
  }
  // Rows are independent; a prefill's 512 rows are worth two threads (~0.1 ms each).
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(Kp, 1));
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    std::vector<float> row(keep_fp32 ? 0 : size_t(Kp));
    for (int64_t m = m0; m < m1; ++m) {
      float* xr = keep_fp32 ? r.x32.data() + m * Kp : row.data();
      for (int64_t i = 0; i < K; ++i) xr[i] = to_float(x[m * K + i]);
      std::fill(xr + K, xr + Kp, 0.f);
      if (!int8_activations) continue;
      int8_t* q = r.xq.data() + m * Kp;
      float* d = r.xd.data() + m * nb;
      quant::quantize_act(xr, Kp, q, d, r.xsum.data() + m * nb, group);
      if (keep_fp32)
        for (int64_t i = 0; i < Kp; ++i) xr[i] = float(q[i]) * d[i / 32];
    }
  });
  return r;
}

// out2d[M, N] (fp32) = x32 [M, padded(K)] times the packed weight's N rows de-quantised,
// in chunks of ~4 MiB of fp32 weights (the de-quantisation is amortised over M), + bias.
inline void gemm_dequant(const Format& f, const at::Tensor& x32, int64_t K, const uint8_t* w,
                         int64_t N, const at::Tensor& bias, at::Tensor& out2d) {
  const int64_t Kp = f.padded(K), rb = f.row_bytes(K);
  const int64_t chunk = std::max<int64_t>(64, (int64_t(1) << 22) / (Kp * 4));  // ~4 MiB fp32
  at::Tensor wf = at::empty({std::min(chunk, N), Kp}, x32.options());
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t nc = std::min(chunk, N - n0);
    float* dst = wf.data_ptr<float>();
    parallel_items(nc,
                   [&](int64_t r) { quant::dequant_row(f, w + (n0 + r) * rb, K, dst + r * Kp); });
    at::Tensor y = at::mm(x32, wf.narrow(0, 0, nc).t());
    if (bias.defined()) y.add_(bias.narrow(0, n0, nc).to(at::kFloat));
    out2d.narrow(1, n0, nc).copy_(y);
  }
}

}  // namespace topg::quant
