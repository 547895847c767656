// CPU kernels: topg::linear_q and topg::embedding_q over packed weight-only quantised
// weights (formats: torch_topg/quant/formats.py; block math: quant_kernels.h).
//
// linear_q, by the number of input rows M:
//   M <= kQuantDotRows  GEMV: each packed weight row is read once (memory-bound) and
//                       dotted with the M rows: fp32 activations against the row made
//                       fp32 once (quant::dot_rows), or with int8_activations integer dot
//                       products against activations rounded to int8 per block of 32.
//                       Each row's sum does not depend on M, and the decode plan calls
//                       the same functions;
//   larger M            rows of the weight are de-quantised to fp32 in chunks and
//                       multiplied with at::mm (the de-quantisation is amortised over M;
//                       int8_activations: the rounded activations as fp32).
// In batch-invariant mode every M takes the GEMV path (a row's sum then does not depend
// on M). Accumulation is fp32, rounded once to the input dtype.
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "common/checks.h"
#include "dispatch.h"
#include "modes.h"
#include "parallel.h"
#include "quant_kernels.h"

namespace topg {
namespace {

using quant::Fmt;
using quant::Format;

// The GEMV's row limit: the decode plan's steps (gemm::kDotMaxRows, 16), so the plan and
// this op run the same kernel (and agree bitwise) on every step the plan takes.
constexpr int64_t kQuantDotRows = 16;

using quant::pads;

Format parse_format(const char* op, c10::string_view name) {
  if (const Format* f = quant::find_format(std::string(name))) return *f;
  std::string known;
  for (const auto& nf : quant::kFormats)
    known += std::string(known.empty() ? "" : ", ") + "'" + nf.name + "'";
  TOPG_CHECK(false, op, "format '", std::string(name), "' is not one of ", known);
}

// The packed weight [rows, row_bytes(k)]: 2-D uint8, on the device of `ref`, contiguous.
void check_packed(const char* op, const at::Tensor& weight, const at::Tensor& ref, const Format& f,
                  c10::string_view format, int64_t k) {
  const Arg w(op, "weight", weight);
  w.dim(2).dtype(at::kByte).same_device(ref, "input");
  const std::string what =
      "the bytes of a " + std::string(format) + " row of " + std::to_string(k) + " weights";
  w.size(1, f.row_bytes(k), what.c_str()).contiguous();
}

// The kernels' inputs from the activations [M, K]: fp32 rows [M, padded(K)] (zeros past
// K), and with int8_activations the int8 codes, scales and code sums
// per 32 (quant::quantize_act); the fp32 rows then hold the rounded values (q * d).
struct Rows {
  int64_t M = 0, Kp = 0;
  std::vector<float> x32, xd, xsum;
  std::vector<int8_t> xq;
  const float* x(int64_t m) const { return x32.data() + m * Kp; }
};

template <typename T>
Rows prepare_rows(const T* x, int64_t M, int64_t K, int64_t Kp, bool int8_activations) {
  Rows r;
  r.M = M, r.Kp = Kp;
  const int64_t nb = Kp / 32;
  r.x32.assign(size_t(M * Kp), 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < K; ++i) r.x32[size_t(m * Kp + i)] = to_float(x[m * K + i]);
  if (int8_activations) {
    r.xq.resize(size_t(M * Kp));
    r.xd.resize(size_t(M * nb));
    r.xsum.resize(size_t(M * nb));
    for (int64_t m = 0; m < M; ++m) {
      quant::quantize_act(r.x32.data() + m * Kp, Kp, r.xq.data() + m * Kp, r.xd.data() + m * nb,
                          r.xsum.data() + m * nb);
      for (int64_t i = 0; i < Kp; ++i)
        r.x32[size_t(m * Kp + i)] = float(r.xq[size_t(m * Kp + i)]) * r.xd[size_t(m * nb + i / 32)];
    }
  }
  return r;
}

template <typename T>
void linear_q_dot(const Format& f, const Rows& x, int64_t K, const uint8_t* w, int64_t N,
                  const T* bias, T* out) {
  const int64_t rb = f.row_bytes(K), nb = x.Kp / 32;
  const bool q8 = !x.xq.empty() && quant::int8_dot(f.fmt);  // integer dot products
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
    sc.sums.resize(size_t(x.M));
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * rb;
      const float b = bias ? to_float(bias[n]) : 0.f;
      if (q8) {
        for (int64_t m = 0; m < x.M; ++m)
          sc.sums[size_t(m)] = quant::dot_row_q8(f, row, K, x.xq.data() + m * x.Kp,
                                                 x.xd.data() + m * nb, x.xsum.data() + m * nb);
      } else {
        quant::dot_rows(f, row, K, xs.data(), x.M, sc.sums.data(), sc.rows);
      }
      for (int64_t m = 0; m < x.M; ++m) {
        const float s = sc.sums[size_t(m)];
        out[m * N + n] = from_float<T>(bias ? s + b : s);
      }
    }
  });
}

void linear_q_gemm(const Format& f, const at::Tensor& x32, int64_t K, const uint8_t* w, int64_t N,
                   const at::Tensor& bias, at::Tensor& out2d) {
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

at::Tensor linear_q_cpu(const at::Tensor& input_, const at::Tensor& weight, c10::string_view format,
                        const std::optional<at::Tensor>& bias_, bool int8_activations) {
  const char* op = "linear_q";
  const Arg x(op, "input", input_);
  x.min_dim(1).floating();
  const Format f = parse_format(op, format);
  const int64_t K = input_.size(-1);
  if (f.block != 0 && !pads(f) && K % f.block != 0)
    x.fail("a last dimension that is a multiple of " + std::to_string(f.block) + " (the block of " +
           std::string(format) + ")");
  check_packed(op, weight, input_, f, format, K);
  const int64_t N = weight.size(0);
  if (bias_.has_value())
    Arg(op, "bias", *bias_)
        .dim(1)
        .same_dtype(input_, "input")
        .same_device(input_, "input")
        .size(0, N, "the output features of 'weight'");
  std::vector<int64_t> out_shape(input_.sizes().begin(), input_.sizes().end());
  out_shape.back() = N;
  at::Tensor out = at::empty(out_shape, input_.options());
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < input_.dim(); ++d) M *= input_.size(d);
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
    Rows rows = prepare_rows(cptr<T>(input), M, K, Kp, int8_activations);
    const uint8_t* w = cptr<uint8_t>(weight);
    if (M <= kQuantDotRows || batch_invariant()) {
      linear_q_dot(f, rows, K, w, N, b, o);
    } else {
      at::Tensor xt =
          at::from_blob(rows.x32.data(), {M, Kp}, at::TensorOptions().dtype(at::kFloat));
      at::Tensor out2d = out.view({M, N});
      linear_q_gemm(f, xt, K, w, N, bias, out2d);
    }
  });
  return out;
}

at::Tensor embedding_q_cpu(const at::Tensor& input_, const at::Tensor& weight,
                           c10::string_view format, int64_t embedding_dim, at::ScalarType dtype) {
  const char* op = "embedding_q";
  Arg(op, "input", input_).index();
  const Format f = parse_format(op, format);
  TOPG_CHECK(is_float_dtype(dtype), op, "dtype ", dtype_name(dtype),
             " is not one of float32, bfloat16, float16");
  TOPG_CHECK(embedding_dim >= 0, op, "embedding_dim ", embedding_dim, " is negative");
  TOPG_CHECK(f.block == 0 || pads(f) || embedding_dim % f.block == 0, op, "embedding_dim ",
             embedding_dim, " is not a multiple of ", f.block, " (the block of ",
             std::string(format), ")");
  check_packed(op, weight, input_, f, format, embedding_dim);
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
