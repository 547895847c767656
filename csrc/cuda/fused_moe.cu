// CUDA kernel: topg::fused_moe (grouped expert MLPs with the activation fused).
//
//   1. align (one block): counting sort of the T * k assignments by expert, each expert's
//      rows padded to a multiple of 64 (a GEMM tile); tile -> expert table, tile count;
//   2. gate/up GEMM, grid (I / 32, tiles): a block computes 32 gate and the matching 32 up
//      columns for 64 rows of one expert (tensor cores for bf16 / fp16), then
//      h = act(gate) * up in the dtype of the input;
//   3. down GEMM, grid (H / 64, tiles): y[assignment] = h . Wd^T in fp32;
//   4. combine, grid T: out[t] = sum_j topk_weights[t, j] * y[t * k + j], rounded once.
// Tiles past the device-side tile count leave at once (the grid is sized by the upper
// bound ceil(T * k / 64) + min(E, T * k): no device sync). Experts not hit are never read.
#include <ATen/ops/aminmax.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <string>

#include "gemm.cuh"

namespace topg::cuda {
namespace {

using gemm::BM;
using gemm::BN;

template <typename Id>
__global__ void moe_align_kernel(const Id* __restrict__ ids, int64_t n, int E, int32_t* sorted,
                                 int64_t sorted_len, int32_t* tile_expert, int32_t* num_tiles) {
  extern __shared__ int32_t sm[];
  int32_t* count = sm;       // [E]
  int32_t* offset = sm + E;  // [E]
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  for (int64_t i = threadIdx.x; i < sorted_len; i += blockDim.x) sorted[i] = -1;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t e = int64_t(ids[i]);
    if (e >= 0 && e < E) atomicAdd(&count[e], 1);  // bad ids (checks off) are dropped
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t tiles = 0;
    for (int e = 0; e < E; ++e) {
      offset[e] = tiles * BM;
      const int32_t nt = (count[e] + BM - 1) / BM;
      for (int32_t t = 0; t < nt; ++t) tile_expert[tiles + t] = e;
      tiles += nt;
      count[e] = 0;  // reused as the fill cursor
    }
    *num_tiles = tiles;
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t e = int64_t(ids[i]);
    if (e >= 0 && e < E) sorted[offset[e] + atomicAdd(&count[e], 1)] = int32_t(i);
  }
}

struct MoeArgs {
  const int32_t* sorted;       // [tiles_max * BM] assignment index or -1
  const int32_t* tile_expert;  // [tiles_max]
  const int32_t* num_tiles;    // [1]
  int64_t H, I, k;
  Act act;
};

template <typename T>
__global__ void __launch_bounds__(gemm::kThreads)
    moe_gate_up_kernel(const T* __restrict__ x, const T* __restrict__ wgu, T* __restrict__ h,
                       MoeArgs a, bool vec) {
  __shared__ gemm::Smem<T> s;
  const int64_t tile = blockIdx.y;
  if (tile >= *a.num_tiles) return;  // uniform per block, before any barrier
  const int64_t e = a.tile_expert[tile], n0 = int64_t(blockIdx.x) * (BN / 2);
  const T* we = wgu + e * 2 * a.I * a.H;
  for (int i = threadIdx.x; i < BM; i += blockDim.x) {
    const int32_t idx = a.sorted[tile * BM + i];
    s.arow[i] = idx >= 0 ? x + (idx / a.k) * a.H : nullptr;
    // B rows 0..31: gate features n0.., rows 32..63: the matching up features
    const int64_t f = n0 + (i % (BN / 2));
    s.brow[i] = f < a.I ? we + ((i < BN / 2 ? 0 : a.I) + f) * a.H : nullptr;
  }
  __syncthreads();
  gemm::tile_gemm<T>(s, a.H, vec);
  for (int i = threadIdx.x; i < BM * (BN / 2); i += blockDim.x) {
    const int r = i / (BN / 2), c = i % (BN / 2);
    if (n0 + c < a.I)
      h[(tile * BM + r) * a.I + n0 + c] =
          from_float<T>(act_apply(a.act, s.c[r][c]) * s.c[r][c + BN / 2]);
  }
}

template <typename T>
__global__ void __launch_bounds__(gemm::kThreads)
    moe_down_kernel(const T* __restrict__ h, const T* __restrict__ wd, float* __restrict__ y,
                    MoeArgs a, bool vec) {
  __shared__ gemm::Smem<T> s;
  const int64_t tile = blockIdx.y;
  if (tile >= *a.num_tiles) return;
  const int64_t e = a.tile_expert[tile], n0 = int64_t(blockIdx.x) * BN;
  const T* we = wd + e * a.H * a.I;
  for (int i = threadIdx.x; i < BM; i += blockDim.x) {
    s.arow[i] = a.sorted[tile * BM + i] >= 0 ? h + (tile * BM + i) * a.I : nullptr;
    s.brow[i] = n0 + i < a.H ? we + (n0 + i) * a.I : nullptr;
  }
  __syncthreads();
  gemm::tile_gemm<T>(s, a.I, vec);
  for (int i = threadIdx.x; i < BM * BN; i += blockDim.x) {
    const int r = i / BN, c = i % BN;
    const int32_t idx = a.sorted[tile * BM + r];
    if (idx >= 0 && n0 + c < a.H) y[int64_t(idx) * a.H + n0 + c] = s.c[r][c];
  }
}

template <typename T, typename W, typename Id>
__global__ void moe_combine_kernel(const float* __restrict__ y, const W* __restrict__ tw,
                                   const Id* __restrict__ ids, int64_t k, int64_t H, int64_t E,
                                   T* __restrict__ out) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    float acc = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = int64_t(ids[t * k + j]);
      if (e >= 0 && e < E) acc += to_float(tw[t * k + j]) * y[(t * k + j) * H + c];
    }
    out[t * H + c] = from_float<T>(acc);
  }
}

at::Tensor fused_moe_cuda(const at::Tensor& hidden, const at::Tensor& w_gate_up,
                          const at::Tensor& w_down, const at::Tensor& topk_weights_,
                          const at::Tensor& topk_ids_, c10::string_view activation) {
  const char* op = "fused_moe";
  const checks::MoeSizes sz =
      checks::fused_moe(hidden, w_gate_up, w_down, topk_weights_, topk_ids_, activation, at::kCUDA);
  const int64_t ntok = sz.tokens, H = sz.hidden, E = sz.experts, I = sz.inter;
  const Act act = sz.act == checks::MoeAct::silu   ? Act::silu
                  : sz.act == checks::MoeAct::gelu ? Act::gelu
                                                   : Act::gelu_tanh;

  const c10::cuda::CUDAGuard guard(hidden.device());
  const int64_t k = topk_ids_.size(1), n = ntok * k;
  const at::Tensor ids = topk_ids_.contiguous(), tw = topk_weights_.contiguous();
  const at::Tensor x = hidden.contiguous();
  if (ntok == 0 || H == 0) return at::empty({ntok, H}, x.options());
  if (I == 0 || k == 0 || E == 0) return at::zeros({ntok, H}, x.options());
  TOPG_CHECK(E <= 4096, op, "at most 4096 experts on CUDA, got ", E);
  if (index_checks_enabled()) {
    const auto [mn, mx] = at::aminmax(ids);
    if (mn.item<int64_t>() < 0 || mx.item<int64_t>() >= E) {
      const at::Tensor bad =
          at::nonzero(ids.reshape({-1}).lt(0).logical_or(ids.reshape({-1}).ge(E)));
      const int64_t i = bad[0][0].item<int64_t>();
      checks::bad_expert_id(ids.reshape({-1})[i].item<int64_t>(), i, E);
    }
  }
  const int64_t tiles_max = ceil_div(n, BM) + std::min(E, n);
  TOPG_CHECK(tiles_max <= 65535 && n <= INT32_MAX, op, "too many tokens for one call (", ntok,
             " x top-k ", k, ")");
  const auto i32 = x.options().dtype(at::kInt);
  at::Tensor sorted = at::empty({tiles_max * BM}, i32);
  at::Tensor tile_expert = at::empty({tiles_max}, i32);
  at::Tensor num_tiles = at::empty({1}, i32);
  at::Tensor h = at::empty({tiles_max * BM, I}, x.options());
  at::Tensor y = at::empty({n, H}, x.options().dtype(at::kFloat));
  at::Tensor out = at::empty({ntok, H}, x.options());
  const cudaStream_t stream = current_stream();

  auto align = [&]<typename Id>(const Id* id) {
    moe_align_kernel<Id><<<1, 1024, 2 * E * sizeof(int32_t), stream>>>(
        id, n, int(E), sorted.data_ptr<int32_t>(), tiles_max * BM, tile_expert.data_ptr<int32_t>(),
        num_tiles.data_ptr<int32_t>());
    TOPG_CUDA_LAUNCH_CHECK();
  };
  if (ids.scalar_type() == at::kLong)
    align(ids.const_data_ptr<int64_t>());
  else
    align(ids.const_data_ptr<int32_t>());

  MoeArgs a{sorted.const_data_ptr<int32_t>(),
            tile_expert.const_data_ptr<int32_t>(),
            num_tiles.const_data_ptr<int32_t>(),
            H,
            I,
            k,
            act};
  TOPG_CUDA_DISPATCH_FLOAT(x.scalar_type(), op, T, [&] {
    const bool vec1 =
        H % kVec == 0 && aligned16(x.const_data_ptr()) && aligned16(w_gate_up.const_data_ptr());
    const bool vec2 =
        I % kVec == 0 && aligned16(h.const_data_ptr()) && aligned16(w_down.const_data_ptr());
    const dim3 g1(unsigned(ceil_div(I, BN / 2)), unsigned(tiles_max));
    moe_gate_up_kernel<T>
        <<<g1, gemm::kThreads, 0, stream>>>(cdptr<T>(x), cdptr<T>(w_gate_up), dptr<T>(h), a, vec1);
    TOPG_CUDA_LAUNCH_CHECK();
    const dim3 g2(unsigned(ceil_div(H, BN)), unsigned(tiles_max));
    moe_down_kernel<T><<<g2, gemm::kThreads, 0, stream>>>(cdptr<T>(h), cdptr<T>(w_down),
                                                          y.data_ptr<float>(), a, vec2);
    TOPG_CUDA_LAUNCH_CHECK();
    auto combine = [&]<typename W, typename Id>(const W* w, const Id* id) {
      moe_combine_kernel<T, W, Id><<<unsigned(ntok), 256, 0, stream>>>(y.const_data_ptr<float>(), w,
                                                                       id, k, H, E, dptr<T>(out));
      TOPG_CUDA_LAUNCH_CHECK();
    };
    auto with_ids = [&]<typename W>(const W* w) {
      if (ids.scalar_type() == at::kLong)
        combine(w, ids.const_data_ptr<int64_t>());
      else
        combine(w, ids.const_data_ptr<int32_t>());
    };
    if (tw.scalar_type() == at::kFloat)
      with_ids(tw.const_data_ptr<float>());
    else
      with_ids(cdptr<T>(tw));
  });
  return out;
}

}  // namespace
}  // namespace topg::cuda

TORCH_LIBRARY_IMPL(topg, CUDA, m) { m.impl("_cuda_fused_moe", &topg::cuda::fused_moe_cuda); }
