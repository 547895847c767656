// CPU kernel: topg::linear (F.linear semantics, fp32 accumulation, one rounding).
//
// Path by the number of input rows M (threshold measured in gemm_kernels.h):
//   M <= kDotMaxRows  dot path: the weight is streamed once from memory for all M rows
//                     (memory-bound; at M = 1 about the read bandwidth).
//   M >  kDotMaxRows  bf16 on CPUs with AVX-512 BF16 / AMX: aten's GEMM (oneDNN's bf16
//                     kernels; see linear_cpu). Otherwise packed GEMM (compute-bound):
//                     weights converted to fp32 while being packed, so bf16 / fp16 run
//                     at the fp32 rate.
// In batch-invariant mode (modes.h) every M takes the packed path: a row's sums then
// run in the same order (K blocks of KC, k ascending) whatever M is.
#include <ATen/Parallel.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "common/op_checks.h"
#include "dispatch.h"
#include "gemm_kernels.h"
#include "gemv_amx.h"
#include "gemv_bf16dp.h"
#include "modes.h"
#include "parallel.h"

namespace topg {
namespace {

template <typename T>
void linear_dot(const T* x, int64_t M, int64_t K, const T* w, int64_t N, const T* bias, T* out) {
  // Items of ~256K weight elements (0.5-1 MiB, a fraction of a millisecond); products
  // below one item stay on the calling thread.
  const int64_t rows = std::max<int64_t>(8, (int64_t(1) << 18) / K / 8 * 8);
#if TOPG_AMX || TOPG_BF16DP
  if constexpr (std::is_same_v<T, bf16>) {
    std::vector<const bf16*> a(static_cast<size_t>(M));  // A stays bf16 on both paths
    for (int64_t m = 0; m < M; ++m) a[m] = x + m * K;
    const auto emit = [&](int64_t m, int64_t n, float s) {
      out[m * N + n] = from_float<T>(bias ? s + to_float(bias[n]) : s);
    };
#if TOPG_AMX
    if (gemm::amx::enabled() && gemm::amx::fits(M, K)) {  // AMX tiles (gemv_amx.h)
      std::vector<bf16> b(static_cast<size_t>(M * K));
      gemm::amx::pack_b(a.data(), M, K, b.data());
      const int64_t rows32 = std::max<int64_t>(32, (int64_t(1) << 18) / K / 32 * 32);
      parallel_items(gemm::ceil_div(N, rows32), [&](int64_t item) {
        const int64_t n0 = item * rows32;
        gemm::amx::dot_rows(b.data(), M, w, K, K, n0, std::min(N, n0 + rows32), emit);
      });
      return;
    }
#endif
#if TOPG_BF16DP
    if (gemm::use_bf16dp()) {  // AVX-512 BF16 (gemv_bf16dp.h)
      parallel_items(gemm::ceil_div(N, rows), [&](int64_t item) {
        const int64_t n0 = item * rows;
        gemm::dot_rows_bf16dp(a.data(), M, w, K, K, n0, std::min(N, n0 + rows), emit);
      });
      return;
    }
#endif
  }
#endif
  // A rows as fp32 (the dot kernel's A operand): converted once, a few KiB per row.
  std::vector<float> a32;
  std::vector<const float*> a(static_cast<size_t>(M));
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t m = 0; m < M; ++m) a[m] = x + m * K;
  } else {
    a32.resize(size_t(M * K));
    for (int64_t m = 0; m < M; ++m) {
      gemm::dot_a_row<T>(x + m * K, K, a32.data() + m * K);
      a[m] = a32.data() + m * K;
    }
  }
  gemm::AlignedFloats il_buf;  // A as the dot path reads it (gemm::prepare_a_rows)
  const float* il = gemm::prepare_a_rows<T>(a.data(), M, K, il_buf);
  parallel_items(gemm::ceil_div(N, rows), [&](int64_t item) {
    const int64_t n0 = item * rows, n1 = std::min(N, n0 + rows);
    gemm::dot_rows_range(
        a.data(), M, w, K, K, n0, n1,
        [&](int64_t m, int64_t n, float s) {
          out[m * N + n] = from_float<T>(bias ? s + to_float(bias[n]) : s);
        },
        il);
  });
}

template <typename T>
void linear_packed(const T* x, int64_t M, int64_t K, const T* w, int64_t N, const T* bias, T* out) {
  using namespace gemm;
  const int64_t npanels = ceil_div(N, NR), pchunks = ceil_div(npanels, NCP);
  const int64_t nthreads = at::get_num_threads();
  // Rows per packed-A chunk: at most ~16 MiB of packed fp32 A at a time.
  const int64_t ms_max = std::max<int64_t>(MR * MCT, (int64_t(1) << 22) / K / MR * MR);
  std::vector<float> ap;
  for (int64_t m0 = 0; m0 < M; m0 += ms_max) {
    const int64_t ms = std::min(ms_max, M - m0), mt = ceil_div(ms, MR), mp = mt * MR;
    ap.resize(size_t(mp * K));
    at::parallel_for(0, mt, 4, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const T* rows[MR];
        for (int i = 0; i < MR; ++i) {
          const int64_t r = t * MR + i;
          rows[i] = r < ms ? x + (m0 + r) * K : nullptr;
        }
        pack_a_tile(rows, K, mp, t, ap.data());
      }
    });
    // Work items: (tile group, panel chunk); split rows too when N alone gives too few.
    const int64_t tgroups = std::min(mt, std::max<int64_t>(1, ceil_div(4 * nthreads, pchunks)));
    const int64_t tper = ceil_div(mt, tgroups);
    const LinearPanels<T> panels{w, N, K};
    parallel_items(tgroups * pchunks, [&](int64_t item) {
      const int64_t tg = item / pchunks, pc = item % pchunks;
      const int64_t p0 = pc * NCP, p1 = std::min(npanels, p0 + NCP);
      gemm_tiles<T>(ap.data(), mp, K, K, tg * tper, std::min(mt, (tg + 1) * tper), p0, p1, panels,
                    [&](int64_t t, int64_t p, const float* tile) {
                      const int rows = int(std::min<int64_t>(MR, ms - t * MR));
                      const int64_t n0 = p * NR;
                      for (int h = 0; h < 2; ++h) {
                        const int64_t n = n0 + h * 8;
                        const int nv = int(std::clamp<int64_t>(N - n, 0, 8));
                        if (nv == 0) break;
                        const Vec8 b = !bias     ? Vec8::zero()
                                       : nv == 8 ? Vec8::load(bias + n)
                                                 : load_partial(bias + n, nv);
                        for (int i = 0; i < rows; ++i)
                          store_n(out + (m0 + t * MR + i) * N + n,
                                  Vec8::load(tile + i * NR + h * 8) + b, nv);
                      }
                    });
    });
  }
}

at::Tensor linear_cpu(const at::Tensor& input_, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias_) {
  const char* op = "linear";
  const auto [M, K, N, out_shape] = checks::linear(input_, weight, bias_, at::kCPU);
  const at::Tensor input = input_.contiguous();
  const at::Tensor bias = bias_.has_value() ? bias_->contiguous() : at::Tensor();
  at::Tensor out = at::empty(out_shape, input.options());
  if (M == 0 || N == 0) return out;
  if (input.scalar_type() == at::kBFloat16 && M > gemm::kDotMaxRows && K > 0 &&
      !batch_invariant() && gemm::use_bf16dp()) {
    // bf16 GEMM on CPUs with AVX-512 BF16 (and AMX): aten's, which runs oneDNN's bf16
    // kernels (AMX tiles where there are), fp32 accumulation rounded once, the bias
    // inside that rounding (addmm). The packed path below runs bf16 at the fp32 FMA rate:
    // about 10x slower at [512, 2048] x [8192, 2048], 2 threads, Intel Xeon with AMX; a 1B
    // model's prefill of 2,048 tokens went from 20.8 s to 4.3 s (docs/cpu-kernels.md).
    at::Tensor o2 = out.view({M, N});
    const at::Tensor x2 = input.view({M, K});
    if (bias.defined()) {
      at::addmm_out(o2, bias, x2, weight.t());
    } else {
      at::mm_out(o2, x2, weight.t());
    }
    return out;
  }
  TOPG_DISPATCH_FLOAT(input.scalar_type(), op, T, [&] {
    const T* x = cptr<T>(input);
    const T* w = cptr<T>(weight);
    const T* b = bias.defined() ? cptr<T>(bias) : nullptr;
    T* o = ptr<T>(out);
    if (K == 0) {  // empty sum: the output is the bias (or zeros)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) o[m * N + n] = b ? b[n] : from_float<T>(0.f);
    } else if (M <= gemm::kDotMaxRows && !batch_invariant()) {
      linear_dot(x, M, K, w, N, b, o);
    } else {
      linear_packed(x, M, K, w, N, b, o);
    }
  });
  return out;
}

}  // namespace
}  // namespace topg

TORCH_LIBRARY_IMPL(topg, CPU, m) { m.impl("linear", &topg::linear_cpu); }
