// CUDA kernel: topg::paged_attention (decode over a paged KV cache), split-KV.
//
// Pass 1, grid (Hkv x group chunks, num_seqs, partitions): a block takes one KV head, up
// to 8 of its query heads (the GQA group: each K/V row is read once for all of them) and
// one partition of the sequence's visible keys (attention_core.cuh). With one partition
// the block writes the output; else it writes (max, sum, normalised acc) per partition
// and pass 2, grid (Hq, num_seqs), merges the partitions of each (sequence, head).
// The partition count comes from the table capacity (max_blocks_per_seq * block_size,
// no device sync); blocks past a sequence's end leave at once.
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "attention_core.cuh"

namespace topg::cuda {
namespace {

constexpr const char* OP = "paged_attention";

struct PagedArgs {
  const int32_t* bt;
  const int32_t* seq_lens;
  int64_t bt_ss, q_ss, q_sh, o_ss, o_sh;
  int64_t num_blocks, block_size, cap, window, part;
  int hq, hkv, group, gchunks, parts;
  float* pm;  // [ns, hq, parts] partition max (parts > 1)
  float* pl;  // [ns, hq, parts] partition sum
  float* po;  // [ns, hq, parts, d] partition output (normalised)
};

template <typename T>
struct PagedKV {
  const T* kc;
  const T* vc;
  const int32_t* table;                 // this sequence's row of block_tables
  int64_t block_size, num_blocks, row;  // row = Hkv * D (elements per cache token)
  __device__ int64_t token(int64_t j) const {
    int64_t id = table[j / block_size];
    id = id < 0 ? 0 : (id >= num_blocks ? num_blocks - 1 : id);  // only with checks off
    return (id * block_size + j % block_size) * row;
  }
  __device__ const T* kptr(int64_t j) const { return kc + token(j); }
  __device__ const T* vptr(int64_t j) const { return vc + token(j); }
};

__device__ __forceinline__ void visible_range(const PagedArgs& a, int64_t s, int64_t& lo,
                                              int64_t& n) {
  n = a.seq_lens[s];
  n = n < 0 ? 0 : (n > a.cap ? a.cap : n);  // only with checks off
  lo = a.window >= 0 ? n - 1 - a.window : 0;
  lo = lo < 0 ? 0 : lo;
}

template <typename T, int MAXND>
__global__ void __launch_bounds__(attn::kWarps * 32, attn::kMinBlocks<MAXND>)
    paged_kernel(const T* __restrict__ q, const T* __restrict__ kc, const T* __restrict__ vc,
                 T* __restrict__ o, PagedArgs a, attn::Params p, bool vec) {
  const int hk = blockIdx.x / a.gchunks, g0 = (blockIdx.x % a.gchunks) * attn::kRows;
  const int64_t s = blockIdx.y, part = blockIdx.z;
  int64_t lo, n;
  visible_range(a, s, lo, n);
  const int64_t t0 = lo + part * a.part, t1 = t0 + a.part < n ? t0 + a.part : n;
  if (part > 0 && t0 >= n) return;  // past the end (partition 0 always writes: zeros if empty)
  attn::Rows rows;
  rows.nrows = a.group - g0 < attn::kRows ? a.group - g0 : attn::kRows;
  const int h0 = hk * a.group + g0;
#pragma unroll
  for (int r = 0; r < attn::kRows; ++r) {
    rows.q_off[r] = s * a.q_ss + int64_t(h0 + (r < rows.nrows ? r : 0)) * a.q_sh;
    rows.lo[r] = lo, rows.hi[r] = n - 1;
    rows.mask[r] = nullptr;
  }
  const PagedKV<T> kv{kc + int64_t(hk) * p.d, vc + int64_t(hk) * p.d, a.bt + s * a.bt_ss,
                      a.block_size,           a.num_blocks,           int64_t(a.hkv) * p.d};
  const int64_t k1 = t1 > t0 ? t1 : t0;
  // One output functor (one instantiation of attend_block and of its shared memory).
  attn::attend_block<T, MAXND>(q, rows, p, kv, t0, k1, vec,
                               [&](int r, int c, float val, float m, float l) {
                                 if (a.parts == 1) {
                                   o[s * a.o_ss + (h0 + r) * a.o_sh + c] = from_float<T>(val);
                                 } else {
                                   const int64_t idx = (s * a.hq + h0 + r) * a.parts + part;
                                   a.po[idx * p.d + c] = val;
                                   if (c == 0) a.pm[idx] = m, a.pl[idx] = l;
                                 }
                               });
}

// Pass 2: merge the partitions of one (sequence, head): weights l_p * exp(m_p - M).
template <typename T>
__global__ void paged_reduce_kernel(T* __restrict__ o, PagedArgs a, int d) {
  const int h = blockIdx.x;
  const int64_t s = blockIdx.y;
  int64_t lo, n;
  visible_range(a, s, lo, n);
  const int64_t used = n > lo ? ceil_div(n - lo, a.part) : 0;
  const int64_t base = (s * a.hq + h) * a.parts;
  float mx = -INFINITY;
  for (int64_t i = 0; i < used; ++i) mx = fmaxf(mx, a.pm[base + i]);
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    float sum = 0.f, acc = 0.f;
    if (mx != -INFINITY) {
      for (int64_t i = 0; i < used; ++i) {
        const float w = a.pl[base + i] * __expf(a.pm[base + i] - mx);
        sum += w;
        acc += w * a.po[(base + i) * d + c];
      }
    }
    o[s * a.o_ss + h * a.o_sh + c] = from_float<T>(sum > 0.f ? acc / sum : 0.f);
  }
}

void check_args(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                const at::Tensor& bt, const at::Tensor& sl, int64_t window_left, double softcap) {
  Arg(OP, "query", q).dim(3).floating().device(at::kCUDA).last_dim_contiguous();
  for (auto [name, t] : {std::pair{"key_cache", &kc}, std::pair{"value_cache", &vc}}) {
    Arg(OP, name, *t).dim(4).same_dtype(q, "query").same_device(q, "query");
    Arg(OP, name, *t).size(3, q.size(2), "head_dim of 'query'").contiguous();
  }
  for (int64_t d = 0; d < 3; ++d)
    Arg(OP, "value_cache", vc).size(d, kc.size(d), "the shape of 'key_cache'");
  const int64_t hq = q.size(1), hkv = kc.size(2);
  TOPG_CHECK(hkv > 0 && hq % hkv == 0, OP, "query heads (", hq,
             ") must be a multiple of key/value heads (", hkv, ")");
  Arg(OP, "block_tables", bt).dim(2).dtype(at::kInt).same_device(q, "query");
  Arg(OP, "block_tables", bt).size(0, q.size(0), "num_seqs of 'query'");
  Arg(OP, "seq_lens", sl).dim(1).dtype(at::kInt).same_device(q, "query");
  Arg(OP, "seq_lens", sl).size(0, q.size(0), "num_seqs of 'query'");
  TOPG_CHECK(window_left >= -1, OP, "window_left must be >= -1, got ", window_left);
  TOPG_CHECK(softcap >= 0, OP, "softcap must be >= 0, got ", softcap);
}

// Host-side messages (same wording as the CPU kernel); run only after the device-side
// test below found a problem, on host copies.
void explain_bad_indices(const at::Tensor& bt_, const at::Tensor& sl_, int64_t num_blocks,
                         int64_t block_size) {
  const at::Tensor bt = bt_.to(at::kCPU).contiguous(), sl = sl_.to(at::kCPU).contiguous();
  const int32_t* lens = sl.const_data_ptr<int32_t>();
  const int32_t* tab = bt.const_data_ptr<int32_t>();
  const int64_t max_blocks = bt.size(1), cap = max_blocks * block_size;
  for (int64_t s = 0; s < sl.size(0); ++s) {
    if (lens[s] < 0 || lens[s] > cap)
      Arg(OP, "seq_lens", sl_)
          .fail("values in [0, " + std::to_string(cap) +
                "] (max_blocks_per_seq * block_size), got " + std::to_string(lens[s]) +
                " for sequence " + std::to_string(s));
    const int64_t used = (lens[s] + block_size - 1) / block_size;
    for (int64_t j = 0; j < used; ++j) {
      const int32_t id = tab[s * max_blocks + j];
      if (id < 0 || id >= num_blocks)
        Arg(OP, "block_tables", bt_)
            .fail("block ids in [0, " + std::to_string(num_blocks) + "), got " +
                  std::to_string(id) + " at [" + std::to_string(s) + ", " + std::to_string(j) +
                  "]");
    }
  }
}

// One device pass (a few small ops) and one sync: any bad length or used block id?
void check_indices(const at::Tensor& bt, const at::Tensor& sl, int64_t num_blocks,
                   int64_t block_size) {
  const int64_t cap = bt.size(1) * block_size;
  const at::Tensor bad_len = sl.lt(0).logical_or(sl.gt(cap));
  const at::Tensor used_blocks = sl.clamp(0, cap).add(block_size - 1).div(block_size, "floor");
  const at::Tensor used =
      at::arange(bt.size(1), bt.options()).unsqueeze(0).lt(used_blocks.unsqueeze(1));
  const at::Tensor bad_id = used.logical_and(bt.lt(0).logical_or(bt.ge(num_blocks)));
  if (bad_len.any().logical_or(bad_id.any()).item<bool>())
    explain_bad_indices(bt, sl, num_blocks, block_size);
}

at::Tensor paged_attention_cuda(const at::Tensor& query, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_tables_,
                                const at::Tensor& seq_lens_, std::optional<double> scale,
                                int64_t window_left, double softcap) {
  check_args(query, key_cache, value_cache, block_tables_, seq_lens_, window_left, softcap);
  const c10::cuda::CUDAGuard guard(query.device());
  const at::Tensor block_tables = block_tables_.contiguous(), seq_lens = seq_lens_.contiguous();
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t ns = query.size(0), hq = query.size(1), hkv = key_cache.size(2);
  const int64_t d = query.size(2);
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (out.numel() == 0) return out;
  TOPG_CHECK(block_size > 0 && num_blocks > 0, OP, "argument 'key_cache' ", describe(key_cache),
             " expected at least one block of at least one token");
  if (index_checks_enabled()) check_indices(block_tables, seq_lens, num_blocks, block_size);
  TOPG_CHECK(d <= 256, OP, "head_dim at most 256 on CUDA, got ", d);
  TOPG_CHECK(ns <= 65535, OP, "at most 65535 sequences per call on CUDA, got ", ns);

  PagedArgs a{};
  a.bt = block_tables.const_data_ptr<int32_t>(), a.seq_lens = seq_lens.const_data_ptr<int32_t>();
  a.bt_ss = block_tables.size(1), a.q_ss = query.stride(0), a.q_sh = query.stride(1);
  a.o_ss = out.stride(0), a.o_sh = out.stride(1);
  a.num_blocks = num_blocks, a.block_size = block_size, a.window = window_left;
  a.cap = block_tables.size(1) * block_size;
  a.hq = int(hq), a.hkv = int(hkv), a.group = int(hq / hkv);
  a.gchunks = int(ceil_div(a.group, attn::kRows));
  // Partitions: enough blocks to fill the GPU (~4 per SM) when the batch alone does not,
  // each at least 256 keys (its merge costs a partial row); at most 65535.
  int64_t span = a.cap;
  if (window_left >= 0) span = std::min<int64_t>(span, window_left + 1);
  const int64_t base_blocks = ns * hkv * a.gchunks;
  const int64_t want = ceil_div(4 * num_sms(), base_blocks);
  int64_t part =
      std::max<int64_t>(256, ceil_div(ceil_div(span, std::max<int64_t>(want, 1)), 256) * 256);
  int64_t parts = std::max<int64_t>(1, ceil_div(span, part));
  if (parts > 65535) parts = 65535, part = ceil_div(span, parts);
  a.part = part, a.parts = int(parts);
  at::Tensor pm, pl, po;
  if (parts > 1) {
    const auto f32 = query.options().dtype(at::kFloat);
    pm = at::empty({ns, hq, parts}, f32), pl = at::empty({ns, hq, parts}, f32);
    po = at::empty({ns, hq, parts, d}, f32);
    a.pm = pm.data_ptr<float>(), a.pl = pl.data_ptr<float>(), a.po = po.data_ptr<float>();
  }
  attn::Params p{};
  p.d = int(d);
  p.scale = float(scale.has_value() ? *scale : 1.0 / std::sqrt(double(d)));
  p.softcap = float(softcap);
  const dim3 grid(unsigned(hkv * a.gchunks), unsigned(ns), unsigned(parts));
  TOPG_CUDA_DISPATCH_FLOAT(query.scalar_type(), OP, T, [&] {
    // Cache rows start at multiples of D elements: 16-byte K loads need D % 8 == 0.
    const bool vec = d % kVec == 0 && aligned16(key_cache.const_data_ptr());
    auto launch = [&]<int MAXND>() {
      paged_kernel<T, MAXND><<<grid, attn::kWarps * 32, 0, current_stream()>>>(
          cdptr<T>(query), cdptr<T>(key_cache), cdptr<T>(value_cache), dptr<T>(out), a, p, vec);
      TOPG_CUDA_LAUNCH_CHECK();
    };
    if (d <= 128)
      launch.template operator()<4>();
    else
      launch.template operator()<8>();
    if (parts > 1) {
      paged_reduce_kernel<T>
          <<<dim3(unsigned(hq), unsigned(ns)), 128, 0, current_stream()>>>(dptr<T>(out), a, int(d));
      TOPG_CUDA_LAUNCH_CHECK();
    }
  });
  return out;
}

}  // namespace
}  // namespace topg::cuda

TORCH_LIBRARY_IMPL(topg, CUDA, m) { m.impl("paged_attention", &topg::cuda::paged_attention_cuda); }
