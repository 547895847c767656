// CUDA kernel: topg::attention (prefill, dense or ragged). Checks, the mask's view (read
// in its own dtype by the kernels) and launch. bf16 / fp16 with head_dim 64 or 128: tensor cores
// (attention_tc.cuh, 64 query rows per block); everything else: CUDA cores (attention_core.cuh, 8
// query rows of one head per block). Grid: query tiles x Hq x batch.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "attention_tc.cuh"

namespace topg::cuda {
namespace {

constexpr const char* OP = "attention";

using attn::PrefillArgs;

template <typename T>
struct DenseKV {
  const T* k;
  const T* v;
  int64_t k_ss, v_ss;
  __device__ const T* kptr(int64_t j) const { return k + j * k_ss; }
  __device__ const T* vptr(int64_t j) const { return v + j * v_ss; }
  __device__ float kscale(int64_t) const { return 1.f; }
  __device__ float vscale(int64_t) const { return 1.f; }
};

template <typename T, int MAXND>
__global__ void __launch_bounds__(attn::kWarps * 32, attn::kMinBlocks<MAXND>)
    prefill_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                   T* __restrict__ o, PrefillArgs a, attn::Params p, bool vec) {
  const attn::SeqView sv = attn::seq_view(a);
  const int64_t i0 = int64_t(blockIdx.x) * attn::kRows;
  if (i0 >= sv.sq) return;  // the whole block leaves before any barrier
  attn::Rows rows;
  rows.nrows = int(sv.sq - i0 < attn::kRows ? sv.sq - i0 : attn::kRows);
  int64_t klo = sv.sk, khi = -1;
#pragma unroll
  for (int r = 0; r < attn::kRows; ++r) {
    const int64_t i = i0 + (r < rows.nrows ? r : 0);
    int64_t lo, hi;
    attn::row_keys(a, sv, i, lo, hi);
    rows.q_off[r] = sv.qb + i * a.q_ss;
    rows.lo[r] = lo, rows.hi[r] = hi;
    rows.mask[r] = attn::mask_row(a.mask, sv.b * a.m_sb + sv.h * a.m_sh + i * a.m_si, a.m_esize);
    if (r < rows.nrows && lo <= hi) klo = lo < klo ? lo : klo, khi = hi > khi ? hi : khi;
  }
  if (khi < klo) klo = 0, khi = -1;  // nothing visible: an empty key range
  const DenseKV<T> kv{k + sv.b * a.k_sb + sv.k0 * a.k_ss + sv.hk * a.k_sh,
                      v + sv.b * a.v_sb + sv.k0 * a.v_ss + sv.hk * a.v_sh, a.k_ss, a.v_ss};
  attn::attend_block<T, MAXND>(q, rows, p, kv, klo, khi + 1, vec,
                               [&](int r, int c, float val, float m, float l) {
                                 val *= attn::sink_factor(p.sinks, sv.h, m, l);
                                 o[sv.ob + (i0 + r) * a.o_ss + c] = from_float<T>(val);
                               });
}

// Validated cumulative offsets (a host copy: one sync; the kernel reads the device tensor).
std::vector<int64_t> read_cu_seqlens(const at::Tensor& cu, const char* name, int64_t total) {
  return checks::cu_seqlens(cu.to(at::kCPU), cu, name, total);
}

// Tensor-core path (attention_tc.cuh) for bf16 / fp16 with head_dim 64 or 128 when every
// stride is a multiple of 8 elements, the pointers are 16-byte aligned and the device
// grants the shared memory (opt-in above 48 KB). Returns false to use the CUDA-core path.
// TOPG_CUDA_ATTENTION_TC=0 disables it (to compare the two paths on a GPU).
template <typename T, int D>
bool launch_tc(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
               const PrefillArgs& a, const attn::Params& p, int64_t batch, int64_t max_sq) {
  static const bool enabled = [] {
    const char* e = std::getenv("TOPG_CUDA_ATTENTION_TC");
    return e == nullptr || std::string(e) != "0";
  }();
  const int64_t strides[] = {a.q_sb, a.q_ss, a.q_sh, a.k_sb, a.k_ss,
                             a.k_sh, a.v_sb, a.v_ss, a.v_sh};
  bool ok = enabled && aligned16(q.const_data_ptr()) && aligned16(k.const_data_ptr()) &&
            aligned16(v.const_data_ptr());
  for (int64_t s : strides) ok = ok && s % kVec == 0;
  if (!ok) return false;
  using L = attn::tc::Layout<D, T>;
  int dev = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  if (size_t(optin) < L::bytes) return false;
  auto kernel = attn::tc::prefill_tc_kernel<T, D>;
  C10_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(L::bytes)));
  const dim3 grid(unsigned(ceil_div(max_sq, attn::tc::BQ)), unsigned(a.hq), unsigned(batch));
  kernel<<<grid, attn::tc::kThreads, L::bytes, current_stream()>>>(cdptr<T>(q), cdptr<T>(k),
                                                                   cdptr<T>(v), dptr<T>(out), a, p);
  TOPG_CUDA_LAUNCH_CHECK();
  return true;
}

at::Tensor attention_cuda(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const std::optional<at::Tensor>& cu_seqlens_q,
                          const std::optional<at::Tensor>& cu_seqlens_k, bool causal,
                          std::optional<double> scale, int64_t window_left, double softcap,
                          const std::optional<at::Tensor>& mask,
                          std::optional<int64_t> max_seqlen_q, std::optional<int64_t> max_seqlen_k,
                          const std::optional<at::Tensor>& sinks) {
  const checks::AttentionSizes sz =
      checks::attention(query, key, value, cu_seqlens_q, cu_seqlens_k, window_left, softcap, mask,
                        max_seqlen_q, max_seqlen_k, at::kCUDA);
  const float* sink_ptr = checks::sinks(OP, sinks, query, sz.hq);
  const bool ragged = sz.ragged;
  const c10::cuda::CUDAGuard guard(query.device());
  at::Tensor out = at::empty(query.sizes(), query.options());
  PrefillArgs a{};
  int64_t batch = 0, max_sq = 0;
  at::Tensor mask_f, cu_q, cu_k;
  if (ragged) {
    cu_q = cu_seqlens_q->contiguous();
    cu_k = cu_seqlens_k.has_value() ? cu_seqlens_k->contiguous() : cu_q;
    batch = cu_q.size(0) - 1;
    if (max_seqlen_q.has_value() && !index_checks_enabled()) {
      // As flash-attn: no host copy of the offsets, no sync. No sequence is longer than
      // the tokens (and a huge value must not wrap the grid size).
      max_sq = std::min<int64_t>(*max_seqlen_q, query.size(0));
    } else {  // the offsets on the host (one sync): validated, and the longest query taken
      const auto cq = read_cu_seqlens(*cu_seqlens_q, "cu_seqlens_q", query.size(0));
      checks::max_seqlen(cq, max_seqlen_q, "max_seqlen_q");
      if (cu_seqlens_k.has_value())
        checks::max_seqlen(read_cu_seqlens(*cu_seqlens_k, "cu_seqlens_k", key.size(0)),
                           max_seqlen_k, "max_seqlen_k");
      else
        checks::max_seqlen(cq, max_seqlen_k, "max_seqlen_k");
      for (int64_t b = 0; b < batch; ++b) max_sq = std::max(max_sq, cq[b + 1] - cq[b]);
    }
    a.cu_q = cu_q.const_data_ptr<int32_t>(), a.cu_k = cu_k.const_data_ptr<int32_t>();
    a.tq = query.size(0), a.tk = key.size(0);
  } else {
    batch = query.size(0), max_sq = query.size(1);
    a.sq = query.size(1), a.sk = key.size(1);
    a.q_sb = query.stride(0), a.k_sb = key.stride(0), a.v_sb = value.stride(0);
    a.o_sb = out.stride(0);
    if (mask.has_value()) {  // a broadcast view, read in its own dtype: no copy
      mask_f = mask->expand({query.size(0), query.size(2), query.size(1), key.size(1)});
      a.mask = mask_f.const_data_ptr();
      a.m_sb = mask_f.stride(0), a.m_sh = mask_f.stride(1), a.m_si = mask_f.stride(2);
      a.m_esize = int(mask_f.element_size());
    }
  }
  if (out.numel() == 0 || batch == 0 || max_sq == 0) return out;
  const int64_t hq = sz.hq, hkv = sz.hkv, d = sz.head_dim;
  TOPG_CHECK(d <= 256, OP, "head_dim at most 256 on CUDA, got ", d);
  TOPG_CHECK(hq <= 65535 && batch <= 65535, OP, "at most 65535 query heads and sequences");
  a.q_ss = query.stride(-3), a.q_sh = query.stride(-2);
  a.k_ss = key.stride(-3), a.k_sh = key.stride(-2);
  a.v_ss = value.stride(-3), a.v_sh = value.stride(-2);
  a.o_ss = out.stride(-3), a.o_sh = out.stride(-2);
  a.hq = int(hq), a.hkv = int(hkv), a.causal = causal, a.window = window_left;
  attn::Params p{};
  p.d = int(d);
  p.scale = float(scale.has_value() ? *scale : 1.0 / std::sqrt(double(d)));
  p.softcap = float(softcap);
  p.sinks = sink_ptr;
  p.mask_sj = mask_f.defined() ? mask_f.stride(3) : 0;
  p.mask_kind = !mask_f.defined()                       ? attn::kMaskFloat
                : mask_f.scalar_type() == at::kBool     ? attn::kMaskBool
                : mask_f.scalar_type() == at::kBFloat16 ? attn::kMaskBf16
                : mask_f.scalar_type() == at::kHalf     ? attn::kMaskHalf
                                                        : attn::kMaskFloat;
  TOPG_CUDA_DISPATCH_FLOAT(query.scalar_type(), OP, T, [&] {
    if constexpr (is_half_v<T>) {
      if (d == 64 && launch_tc<T, 64>(query, key, value, out, a, p, batch, max_sq)) return;
      if (d == 128 && launch_tc<T, 128>(query, key, value, out, a, p, batch, max_sq)) return;
    }
    const bool vec = d % kVec == 0 && a.k_ss % kVec == 0 && a.k_sh % kVec == 0 &&
                     (ragged || a.k_sb % kVec == 0) && aligned16(key.const_data_ptr());
    const dim3 grid(unsigned(ceil_div(max_sq, attn::kRows)), unsigned(hq), unsigned(batch));
    auto launch = [&]<int MAXND>() {
      prefill_kernel<T, MAXND><<<grid, attn::kWarps * 32, 0, current_stream()>>>(
          cdptr<T>(query), cdptr<T>(key), cdptr<T>(value), dptr<T>(out), a, p, vec);
      TOPG_CUDA_LAUNCH_CHECK();
    };
    if (d <= 128)
      launch.template operator()<4>();
    else
      launch.template operator()<8>();
  });
  return out;
}

}  // namespace
}  // namespace topg::cuda

TORCH_LIBRARY_IMPL(topg, CUDA, m) { m.impl("_cuda_attention", &topg::cuda::attention_cuda); }
