// CPU kernels: topg::linear_q and topg::embedding_q over packed weight-only quantised
// weights (formats: torch_topg/formats.py; block math: quant_kernels.h).
//
// linear_q, by the number of input rows M:
//   int8_activations, M >= quant::kQ8GemmRows (4) on a CPU with AVX-512 VNNI: the
//                       integer GEMM (gemm_q8_vnni.h): strips of 32 weight rows unpacked
//                       per work item into a lanes layout, then every input row over
//                       them. Its rows do not depend on M either, but it sums in another
//                       order than the GEMV, so the choice depends on M;
//   otherwise M <= kQuantDotRows (16): GEMV: each packed weight row is read once
//                       (memory-bound) and dotted with the M rows: fp32 activations
//                       against the row made fp32 once (quant::dot_rows), or with
//                       int8_activations integer dot products against activations
//                       rounded to int8 per block of 32. Each row's sum does not depend
//                       on M;
//   larger M            rows of the weight are de-quantised to fp32 in chunks and
//                       multiplied with at::mm (the de-quantisation is amortised over M;
//                       int8_activations: the rounded activations as fp32).
// The decode plan (plan_gemv.h) makes the same choice for the same M with the same
// functions, so its sums are the compiled graph's. In batch-invariant mode every M takes
// the GEMV (quant::use_gemm_q8 is off): a row's sum then does not depend on M.
// Accumulation is fp32, rounded once to the input dtype.
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "common/checks.h"
#include "dispatch.h"
#include "gemm_q8_vnni.h"
#include "modes.h"
#include "parallel.h"
#include "quant_act.h"
#include "quant_kernels.h"
#include "quant_ops.h"

namespace topg {
namespace {

using quant::check_packed;
using quant::Fmt;
using quant::Format;
using quant::pads;
using quant::parse_format;
using quant::prepare_rows;
using quant::Rows;

constexpr int64_t kQuantDotRows = quant::kGemvRows;

template <typename T>
void linear_q_dot(const Format& f, const Rows& x, int64_t K, const uint8_t* w, int64_t N,
                  const T* bias, T* out) {
  const int64_t rb = f.row_bytes(K);
  const bool q8 = !x.xq.empty();  // integer dot products
  std::vector<const float*> xs(size_t(x.M));
  for (int64_t m = 0; m < x.M; ++m) xs[size_t(m)] = x.x(m);
  struct Scratch {
    quant::RowsScratch rows;
    std::vector<float> sums;
  };
  // Items of ~128 KiB of packed weights; small products stay on the calling thread.
  const int64_t rows = std::max<int64_t>(8, (int64_t(1) << 17) / std::max<int64_t>(rb, 1));
  parallel_items_with<Scratch>((N + rows - 1) / rows, [&](int64_t item, Scratch& sc) {
    const int64_t n0 = item * rows, n1 = std::min(N, n0 + rows);
    if (q8) {  // kQ8Rows weight rows at a time against each activation row
      quant::gemv_q8(f, w, rb, n0, n1, K, x.xq.data(), x.xd.data(), x.xsum.data(), x.Kp, x.M,
                     [&](int64_t m, int64_t n, float s) {
                       out[m * N + n] = from_float<T>(bias ? s + to_float(bias[n]) : s);
                     });
      return;
    }
    sc.sums.resize(size_t(x.M));
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * rb;
      const float b = bias ? to_float(bias[n]) : 0.f;
      quant::dot_rows(f, row, K, xs.data(), x.M, sc.sums.data(), sc.rows);
      for (int64_t m = 0; m < x.M; ++m) {
        const float s = sc.sums[size_t(m)];
        out[m * N + n] = from_float<T>(bias ? s + b : s);
      }
    }
  });
}

at::Tensor linear_q_cpu(const at::Tensor& input_, const at::Tensor& weight, c10::string_view format,
                        const std::optional<at::Tensor>& bias_, bool int8_activations) {
  const char* op = "linear_q";
  const quant::LinearQSizes sz = quant::linear_q(input_, weight, format, bias_, at::kCPU);
  const Format f = sz.f;
  const int64_t M = sz.M, K = sz.K, N = sz.N;
  at::Tensor out = at::empty(sz.out_shape, input_.options());
  if (M == 0 || N == 0) return out;
  const at::Tensor input = input_.contiguous();
  const at::Tensor bias = bias_.has_value() ? bias_->contiguous() : at::Tensor();
  TOPG_DISPATCH_FLOAT(input.scalar_type(), op, T, [&] {
    const T* b = bias.defined() ? cptr<T>(bias) : nullptr;
    T* o = ptr<T>(out);
    if (K == 0) {  // empty sum: the output is the bias (or zeros)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) o[m * N + n] = b ? b[n] : from_float<T>(0.f);
      return;
    }
    const int64_t Kp = f.padded(K);
    const bool igemm = int8_activations && quant::use_gemm_q8(f.fmt, M);
    const bool gemv = !igemm && (M <= kQuantDotRows || batch_invariant());
    Rows rows =
        prepare_rows(cptr<T>(input), M, K, Kp, int8_activations, quant::act_group(f.fmt), !igemm);
    const uint8_t* w = cptr<uint8_t>(weight);
    if (gemv) {
      linear_q_dot(f, rows, K, w, N, b, o);
    } else if (igemm) {
      std::vector<float> b32(b ? size_t(N) : 0);
      for (size_t n = 0; n < b32.size(); ++n) b32[n] = to_float(b[n]);
      at::Tensor o32 =
          std::is_same_v<T, float> ? out : at::empty(sz.out_shape, out.options().dtype(at::kFloat));
      const quant::VnniActs acts{rows.xq.data(), rows.xd.data(), rows.xsum.data(), Kp, Kp / 32};
      quant::gemm_q8_vnni(f, acts, M, K, w, N, b ? b32.data() : nullptr, o32.data_ptr<float>());
      if (!std::is_same_v<T, float>) out.copy_(o32);
    } else {
      at::Tensor xt =
          at::from_blob(rows.x32.data(), {M, Kp}, at::TensorOptions().dtype(at::kFloat));
      at::Tensor out2d = out.view({M, N});
      quant::gemm_dequant(f, xt, K, w, N, bias, out2d);
    }
  });
  return out;
}

at::Tensor embedding_q_cpu(const at::Tensor& input_, const at::Tensor& weight,
                           c10::string_view format, int64_t embedding_dim, at::ScalarType dtype) {
  const char* op = "embedding_q";
  const Format f = quant::embedding_q(input_, weight, format, embedding_dim, dtype, at::kCPU);
  std::vector<int64_t> out_shape(input_.sizes().begin(), input_.sizes().end());
  out_shape.push_back(embedding_dim);
  at::Tensor out = at::empty(out_shape, input_.options().dtype(dtype));
  const at::Tensor ids = input_.contiguous().to(at::kLong);
  const int64_t T_ = ids.numel(), rows = weight.size(0), D = embedding_dim;
  const int64_t* id = ids.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t)
    TOPG_CHECK(id[t] >= 0 && id[t] < rows, op, "argument 'input' holds an id outside [0, ", rows,
               ") (the rows of 'weight')");
  if (T_ == 0 || D == 0) return out;
  const uint8_t* w = cptr<uint8_t>(weight);
  const int64_t rb = f.row_bytes(D), Dp = f.padded(D);
  TOPG_DISPATCH_FLOAT(dtype, op, T, [&] {
    T* o = ptr<T>(out);
    struct Row {
      std::vector<float> v;
    };
    parallel_items_with<Row>(T_, [&](int64_t t, Row& buf) {
      buf.v.resize(size_t(Dp));
      quant::dequant_row(f, w + id[t] * rb, D, buf.v.data());
      for (int64_t i = 0; i < D; ++i) o[t * D + i] = from_float<T>(buf.v[size_t(i)]);
    });
  });
  return out;
}

}  // namespace
}  // namespace topg

TORCH_LIBRARY_IMPL(topg, CPU, m) {
  m.impl("linear_q", &topg::linear_q_cpu);
  m.impl("embedding_q", &topg::embedding_q_cpu);
}
