// The decode plan's GEMV operand (decode_plan.cpp): a weight of any kind the plan binds
// (model dtype, packed, packed with int8 activations) and one member's copy of the A
// rows in the layouts those kernels read. Each weight row is summed by the very kernel
// topg::linear / topg::linear_q runs for the same shapes, so the plan and the compiled
// graph agree bitwise.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "dispatch.h"
#include "gemm_kernels.h"
#include "gemm_q8_vnni.h"
#include "gemv_amx.h"
#include "gemv_bf16dp.h"
#include "quant_act.h"

namespace topg::plan {

// A weight matrix [N, K]: in the model dtype, or packed in a quantised format
// (torch_topg/formats.py; one uint8 row of f->row_bytes(K) per output).
struct Lin {
  at::Tensor t;
  const quant::Format* f = nullptr;  // nullptr: the model dtype
  bool a8 = false;                   // int8 activations (linear_q's int8_activations)
  int64_t rb = 0;                    // bytes per row
  // t's data, taken once when the plan binds t: dot() runs once per chunk of rows, and
  // const_data_ptr()'s checks there were ~1.3% of the batch-1 bf16 step.
  const void* p = nullptr;
  template <typename T>
  const T* data() const {
    return static_cast<const T*>(p);
  }
};

// A packed weight's activations: rows padded to a multiple of 256 (every format's block).
inline int64_t padded_k(int64_t K) { return (K + 255) / 256 * 256; }

// One member's A rows: `rows` rows of K values, as fp32 in the AVX2 dot path's layout
// (a / ap), as stored (src: the AVX-512 BF16 dot products), in AMX's B layout (bp:
// gemv_amx.h, where the rows and K fit its tiles), and with packed weights as
// fp32 padded with zeros (aq / aqp: linear_q's operand) and, with int8 activations, as
// int8 blocks of 32 (xq codes, xd scales, xs code sums: quant::quantize_act), one set per
// activation group (32, and 256 for the K-quants: quant::act_group), each made from aq when
// a weight first asks for it after a load (a member's weights may mix the two).
struct GemvInput {
  std::vector<float> a, aq, qsum;
  std::vector<float> xd[2], xs[2];
  std::vector<const float*> ap, aqp;
  std::vector<const void*> src;
  std::vector<int8_t> xq[2];
  bool a8_fresh[2] = {false, false};
  int64_t rows_ = 0, kp_ = 0;
  std::vector<bf16> bp;
  quant::RowsScratch qs;
  quant::GemmQ8Scratch gs;     // the integer GEMM's packed strip (use_gemm_q8)
  gemm::AlignedFloats il_buf;  // the rows as the dot path reads them (gemm::prepare_a_rows)
  const float* il = nullptr;
  bool packed = false, a8 = false, dp = false, amx = false;

  void fit(int64_t rows, int64_t kmax, bool packed_, bool a8_, bool dp_, bool amx_) {
    packed = packed_, a8 = a8_, dp = dp_, amx = amx_;
    a.resize(size_t(rows * kmax)), ap.resize(size_t(rows)), src.resize(size_t(rows));
    if (amx) bp.resize(size_t(rows * kmax));
    if (packed) {
      aq.resize(size_t(rows * padded_k(kmax)));
      aqp.resize(size_t(rows)), qsum.resize(size_t(rows));
    }
    if (a8)
      for (int g = 0; g < 2; ++g)
        xq[g].resize(aq.size()), xd[g].resize(aq.size() / 32), xs[g].resize(aq.size() / 32);
  }

  // The int8 set of activation group `group` for the loaded rows: set 0 for 32, 1 for 256.
  int a8_set(int64_t group) {
    const int g = group == 256 ? 1 : 0;
    if (!a8_fresh[g]) {
      for (int64_t r = 0; r < rows_; ++r)
        quant::quantize_act(aq.data() + r * kp_, kp_, xq[g].data() + r * kp_,
                            xd[g].data() + r * kp_ / 32, xs[g].data() + r * kp_ / 32, group);
      a8_fresh[g] = true;
    }
    return g;
  }

  // Row r is src + (idx ? idx[r] : r) * K.
  template <typename T>
  void load(const T* src_, int64_t K, int64_t rows, const int64_t* idx) {
    const int64_t Kp = padded_k(K);
    rows_ = rows, kp_ = Kp, a8_fresh[0] = a8_fresh[1] = false;
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = src_ + (idx ? idx[r] : r) * K;
      src[r] = row;
      if (packed) {
        float* dst = aq.data() + r * Kp;
        for (int64_t i = 0; i < K; ++i) dst[i] = to_float(row[i]);
        std::fill(dst + K, dst + Kp, 0.f);
        aqp[r] = dst;
      }
      if (dp) continue;
      gemm::dot_a_row<T>(row, K, a.data() + r * K);
      ap[r] = a.data() + r * K;
    }
    if constexpr (std::is_same_v<T, bf16>) {
      if (amx && gemm::amx::fits(rows, K))
        gemm::amx::pack_b(reinterpret_cast<const bf16* const*>(src.data()), rows, K, bp.data());
    }
    il = dp ? nullptr : gemm::prepare_a_rows<T>(ap.data(), rows, K, il_buf);
  }

  // emit(r, n, sum) for weight rows [n0, n1) of w against the loaded rows.
  template <typename T, typename Emit>
  void dot(const Lin& w, int64_t K, int64_t rows, int64_t n0, int64_t n1, Emit&& emit) {
    if (w.f && w.a8 && quant::use_gemm_q8(w.f->fmt, rows)) {  // linear_q's integer GEMM
      const int64_t kp = padded_k(K);
      const int g = a8_set(quant::act_group(w.f->fmt));
      const quant::VnniActs acts{xq[g].data(), xd[g].data(), xs[g].data(), kp, kp / 32};
      quant::gemm_q8_rows(*w.f, w.data<uint8_t>(), w.rb, n0, n1, K, acts, rows, gs, emit);
      return;
    }
    if (w.f && w.a8) {  // linear_q's integer GEMV
      const int g = a8_set(quant::act_group(w.f->fmt));
      quant::gemv_q8(*w.f, w.data<uint8_t>(), w.rb, n0, n1, K, xq[g].data(), xd[g].data(),
                     xs[g].data(), padded_k(K), rows, emit);
      return;
    }
    if (w.f) {  // linear_q's fp32-activation GEMV: each packed row made fp32 once
      const uint8_t* base = w.data<uint8_t>();
      const float* const* x = aqp.data();
      for (int64_t n = n0; n < n1; ++n) {
        quant::dot_rows(*w.f, base + n * w.rb, K, x, rows, qsum.data(), qs);
        for (int64_t r = 0; r < rows; ++r) emit(r, n, qsum[r]);
      }
      return;
    }
#if TOPG_AMX
    if constexpr (std::is_same_v<T, bf16>) {
      if (amx && gemm::amx::fits(rows, K)) {
        gemm::amx::dot_rows(bp.data(), rows, w.data<T>(), K, K, n0, n1, emit);
        return;
      }
    }
#endif
#if TOPG_BF16DP
    if constexpr (std::is_same_v<T, bf16>) {
      if (dp) {
        gemm::dot_rows_bf16dp(reinterpret_cast<const bf16* const*>(src.data()), rows, w.data<T>(),
                              K, K, n0, n1, emit);
        return;
      }
    }
#endif
    gemm::dot_rows_range(ap.data(), rows, w.data<T>(), K, K, n0, n1, emit, il);
  }
};

}  // namespace topg::plan
