// CUDA kernel: topg::paged_attention (decode, or several new tokens per sequence with
// cu_seqlens_q, over a paged KV cache), split-KV.
//
// Every query row is a "virtual sequence": a decode token, or row i of the q_len new
// tokens of sequence s, which sees keys up to its position seq_len - q_len + i and reads
// the block-table row of s (found by a binary search over cu_seqlens_q; no host sync).
// Pass 1, grid (Hkv x group chunks, rows, partitions): a block takes one KV head, up to 8
// of its query heads (the GQA group: each K/V row is read once for all of them) and one
// partition of the row's visible keys (attention_core.cuh). With one partition slot the
// block writes the output; else it writes (max, sum, normalised acc) per partition and
// pass 2, grid (Hq, rows), merges the partitions of each (row, head) in order.
// A row's partitions depend only on its own visible length (part_keys), never on the
// batch, so its result is bitwise the same whatever else is in the call. The partition
// slots come from the table capacity (max_blocks_per_seq * block_size, no device sync);
// blocks past a row's last partition leave at once. Rows go in launches of at most
// kScratchBytes of partial results.
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "attention_core.cuh"
#include "common/paged_checks.h"

namespace topg::cuda {
namespace {

constexpr const char* OP = "paged_attention";
constexpr int64_t kPartMin = 256;                     // keys per partition, at least
constexpr int64_t kMaxParts = 64;                     // partitions per row, at most
constexpr int64_t kScratchBytes = int64_t(64) << 20;  // partial results per launch, at most

// Keys per partition of a row that sees `span` keys: 256, or a multiple of 256 that
// keeps the row within kMaxParts partitions. A function of the row alone.
__host__ __device__ inline int64_t part_keys(int64_t span) {
  const int64_t units = ceil_div(span, kPartMin);
  return kPartMin * (units > kMaxParts ? ceil_div(units, kMaxParts) : 1);
}

struct PagedArgs {
  const int32_t* bt;
  const int32_t* seq_lens;
  const int32_t* cu;       // cu_seqlens_q [num_seqs + 1], or null: row r is sequence r
  int64_t num_seqs, row0;  // row0: the first row of this launch
  int64_t bt_ss, q_ss, q_sh, o_ss, o_sh;
  int64_t num_blocks, block_size, cap, window;
  int hq, hkv, group, gchunks, parts;  // parts: partition slots per row (1: direct write)
  float* pm;                           // [launch rows, hq, parts] partition max (parts > 1)
  float* pl;                           // [launch rows, hq, parts] partition sum
  float* po;                           // [launch rows, hq, parts, d] partition output (normalised)
};

// C: the cache's element type (the query's, or int8_t with ks / vs: the scales of this kv
// head, [num_blocks * block_size] with stride hkv).
template <typename C>
struct PagedKV {
  const C* kc;
  const C* vc;
  const int32_t* table;                 // this sequence's row of block_tables
  int64_t block_size, num_blocks, row;  // row = Hkv * D (elements per cache token)
  const float* ks;                      // int8 caches only (else null)
  const float* vs;
  int64_t hkv;
  __device__ int64_t slot(int64_t j) const {
    int64_t id = table[j / block_size];
    id = id < 0 ? 0 : (id >= num_blocks ? num_blocks - 1 : id);  // only with checks off
    return id * block_size + j % block_size;
  }
  __device__ const C* kptr(int64_t j) const { return kc + slot(j) * row; }
  __device__ const C* vptr(int64_t j) const { return vc + slot(j) * row; }
  __device__ float kscale(int64_t j) const { return ks ? ks[slot(j) * hkv] : 1.f; }
  __device__ float vscale(int64_t j) const { return vs ? vs[slot(j) * hkv] : 1.f; }
};

// Row r: its sequence s and the keys [lo, n) it sees. Every value is clamped, so bad
// offsets or lengths (reachable only with the index checks off) cannot read out of bounds.
__device__ __forceinline__ void row_range(const PagedArgs& a, int64_t r, int64_t& s, int64_t& lo,
                                          int64_t& n) {
  if (a.cu == nullptr) {
    s = r;
    n = a.seq_lens[s];
    n = n < 0 ? 0 : (n > a.cap ? a.cap : n);
  } else {  // the last s with cu[s] <= r
    int64_t b = 0, e = a.num_seqs - 1;
    while (b < e) {
      const int64_t mid = (b + e + 1) / 2;
      if (a.cu[mid] <= r)
        b = mid;
      else
        e = mid - 1;
    }
    s = b;
    int64_t len = a.seq_lens[s];
    len = len < 0 ? 0 : (len > a.cap ? a.cap : len);
    n = len - (int64_t(a.cu[s + 1]) - r) + 1;  // the row's position + 1
    n = n < 0 ? 0 : (n > len ? len : n);
  }
  lo = a.window >= 0 ? n - 1 - a.window : 0;
  lo = lo < 0 ? 0 : lo;
}

template <typename T, typename C, int MAXND>
__global__ void __launch_bounds__(attn::kWarps * 32, attn::kMinBlocks<MAXND>)
    paged_kernel(const T* __restrict__ q, const C* __restrict__ kc, const C* __restrict__ vc,
                 const float* __restrict__ ks, const float* __restrict__ vs, T* __restrict__ o,
                 PagedArgs a, attn::Params p, bool vec) {
  const int hk = blockIdx.x / a.gchunks, g0 = (blockIdx.x % a.gchunks) * attn::kRows;
  const int64_t lr = blockIdx.y, r = a.row0 + lr, part = blockIdx.z;
  int64_t s, lo, n;
  row_range(a, r, s, lo, n);
  const int64_t size = part_keys(n - lo);
  const int64_t t0 = lo + part * size, t1 = t0 + size < n ? t0 + size : n;
  if (part > 0 && t0 >= n) return;  // past the end (partition 0 always writes: zeros if empty)
  attn::Rows rows;
  rows.nrows = a.group - g0 < attn::kRows ? a.group - g0 : attn::kRows;
  const int h0 = hk * a.group + g0;
#pragma unroll
  for (int i = 0; i < attn::kRows; ++i) {
    rows.q_off[i] = r * a.q_ss + int64_t(h0 + (i < rows.nrows ? i : 0)) * a.q_sh;
    rows.lo[i] = lo, rows.hi[i] = n - 1;
    rows.mask[i] = nullptr;
  }
  const PagedKV<C> kv{kc + int64_t(hk) * p.d, vc + int64_t(hk) * p.d, a.bt + s * a.bt_ss,
                      a.block_size,           a.num_blocks,           int64_t(a.hkv) * p.d,
                      ks ? ks + hk : nullptr, vs ? vs + hk : nullptr, a.hkv};
  const int64_t k1 = t1 > t0 ? t1 : t0;
  // One output functor (one instantiation of attend_block and of its shared memory).
  attn::attend_block<T, MAXND>(q, rows, p, kv, t0, k1, vec,
                               [&](int i, int c, float val, float m, float l) {
                                 if (a.parts == 1) {
                                   val *= attn::sink_factor(p.sinks, h0 + i, m, l);
                                   o[r * a.o_ss + (h0 + i) * a.o_sh + c] = from_float<T>(val);
                                 } else {
                                   const int64_t idx = (lr * a.hq + h0 + i) * a.parts + part;
                                   a.po[idx * p.d + c] = val;
                                   if (c == 0) a.pm[idx] = m, a.pl[idx] = l;
                                 }
                               });
}

// Pass 2: merge the partitions of one (row, head) in order: weights l_p * exp(m_p - M).
// A row with one partition takes its normalised output as it is, the value the
// direct-write path of pass 1 rounds: the same bits whatever the partition slots. The
// sink (sinks: [hq] or null) joins once, after the merge, as in the direct-write path.
template <typename T>
__global__ void paged_reduce_kernel(T* __restrict__ o, PagedArgs a, int d,
                                    const float* __restrict__ sinks) {
  const int h = blockIdx.x;
  const int64_t lr = blockIdx.y, r = a.row0 + lr;
  int64_t s, lo, n;
  row_range(a, r, s, lo, n);
  const int64_t used = n > lo ? ceil_div(n - lo, part_keys(n - lo)) : 0;
  const int64_t base = (lr * a.hq + h) * a.parts;
  float mx = -INFINITY;
  bool nan = false;  // a partition's NaN row (its l) makes the row NaN
  for (int64_t i = 0; i < used; ++i) mx = fmaxf(mx, a.pm[base + i]), nan |= isnan(a.pl[base + i]);
  float share = 1.f;  // the keys' share of the mass next to the sink
  if (sinks != nullptr && used == 1) {
    share = attn::sink_factor(sinks, h, a.pm[base], a.pl[base]);
  } else if (sinks != nullptr && !nan && mx != -INFINITY) {
    float sum = 0.f;
    for (int64_t i = 0; i < used; ++i) sum += a.pl[base + i] * __expf(a.pm[base + i] - mx);
    share = attn::sink_factor(sinks, h, mx, sum);
  }
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    float val = 0.f;
    if (used == 1) {
      val = a.po[base * d + c];
    } else if (nan) {
      val = NAN;
    } else if (mx != -INFINITY) {
      float sum = 0.f, acc = 0.f;
      for (int64_t i = 0; i < used; ++i) {
        const float w = a.pl[base + i] * __expf(a.pm[base + i] - mx);
        sum += w;
        acc += w * a.po[(base + i) * d + c];
      }
      val = sum > 0.f ? acc / sum : 0.f;
    }
    o[r * a.o_ss + h * a.o_sh + c] = from_float<T>(val * share);
  }
}

// One device pass (a few small ops) and one sync: any bad length, used block id or
// offset? If so, the messages (same wording as the CPU kernel) come from host copies.
void check_indices(const at::Tensor& bt_arg, const at::Tensor& sl_arg,
                   const std::optional<at::Tensor>& cu_arg, const at::Tensor& bt,
                   const at::Tensor& sl, const at::Tensor& cu, int64_t num_blocks,
                   int64_t block_size, int64_t rows) {
  const int64_t cap = bt.size(1) * block_size, ns = sl.size(0);
  const at::Tensor used_blocks = sl.clamp(0, cap).add(block_size - 1).div(block_size, "floor");
  const at::Tensor used =
      at::arange(bt.size(1), bt.options()).unsqueeze(0).lt(used_blocks.unsqueeze(1));
  at::Tensor bad = sl.lt(0).logical_or(sl.gt(cap)).any();
  bad = bad.logical_or(used.logical_and(bt.lt(0).logical_or(bt.ge(num_blocks))).any());
  if (cu.defined()) {
    const at::Tensor q_len = cu.slice(0, 1).sub(cu.slice(0, 0, ns));
    bad = bad.logical_or(cu[0].ne(0)).logical_or(cu[ns].ne(rows));
    bad = bad.logical_or(q_len.lt(0).any()).logical_or(q_len.gt(sl).any());
  }
  if (!bad.item<bool>()) return;
  const at::Tensor hbt = bt.to(at::kCPU).contiguous(), hsl = sl.to(at::kCPU).contiguous();
  const at::Tensor hcu = cu.defined() ? cu.to(at::kCPU).contiguous() : at::Tensor();
  paged::check_indices(OP, bt_arg, sl_arg, cu_arg.has_value() ? &*cu_arg : nullptr,
                       hbt.const_data_ptr<int32_t>(), hsl.const_data_ptr<int32_t>(),
                       hcu.defined() ? hcu.const_data_ptr<int32_t>() : nullptr, ns, bt.size(1),
                       num_blocks, block_size, rows);
}

at::Tensor paged_attention_cuda(const at::Tensor& query, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_tables_,
                                const at::Tensor& seq_lens_,
                                const std::optional<at::Tensor>& cu_seqlens_q_,
                                std::optional<double> scale, int64_t window_left, double softcap,
                                const std::optional<at::Tensor>& key_scale,
                                const std::optional<at::Tensor>& value_scale,
                                const std::optional<at::Tensor>& sinks) {
  const checks::PagedSizes sz = checks::paged_attention(
      query, key_cache, value_cache, block_tables_, seq_lens_, cu_seqlens_q_, window_left, softcap,
      key_scale, value_scale, at::kCUDA);
  const float* sink_ptr = checks::sinks(OP, sinks, query, sz.hq);
  const c10::cuda::CUDAGuard guard(query.device());
  const at::Tensor block_tables = block_tables_.contiguous(), seq_lens = seq_lens_.contiguous();
  const at::Tensor cu = cu_seqlens_q_.has_value() ? cu_seqlens_q_->contiguous() : at::Tensor();
  const int64_t num_blocks = sz.num_blocks, block_size = sz.block_size;
  const int64_t rows = sz.rows, hq = sz.hq, hkv = sz.hkv, d = sz.head_dim;
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (out.numel() == 0) return out;
  if (index_checks_enabled())
    check_indices(block_tables_, seq_lens_, cu_seqlens_q_, block_tables, seq_lens, cu, num_blocks,
                  block_size, rows);
  TOPG_CHECK(d <= 256, OP, "head_dim at most 256 on CUDA, got ", d);

  PagedArgs a{};
  a.bt = block_tables.const_data_ptr<int32_t>(), a.seq_lens = seq_lens.const_data_ptr<int32_t>();
  a.cu = cu.defined() ? cu.const_data_ptr<int32_t>() : nullptr, a.num_seqs = seq_lens.size(0);
  a.bt_ss = block_tables.size(1), a.q_ss = query.stride(0), a.q_sh = query.stride(1);
  a.o_ss = out.stride(0), a.o_sh = out.stride(1);
  a.num_blocks = num_blocks, a.block_size = block_size, a.window = window_left;
  // No blocks: every row sees nothing (zeros), as on the CPU, whose index check refuses
  // any used block id; the kernels never dereference the empty cache.
  a.cap = num_blocks > 0 ? block_tables.size(1) * block_size : 0;
  a.hq = int(hq), a.hkv = int(hkv), a.group = int(hq / hkv);
  a.gchunks = int(ceil_div(a.group, attn::kRows));
  // Partition slots: as many as the longest possible row needs (its span is at most the
  // table capacity, or the window).
  int64_t span = a.cap;
  if (window_left >= 0) span = std::min<int64_t>(span, window_left + 1);
  const int64_t parts = std::max<int64_t>(1, ceil_div(span, part_keys(span)));
  a.parts = int(parts);
  // Rows per launch: grid.y <= 65535, partial results within kScratchBytes.
  int64_t chunk = 65535;
  at::Tensor pm, pl, po;
  if (parts > 1) {
    chunk = std::clamp<int64_t>(kScratchBytes / (hq * parts * (d + 2) * 4), 1, chunk);
    chunk = std::min(chunk, rows);
    const auto f32 = query.options().dtype(at::kFloat);
    pm = at::empty({chunk, hq, parts}, f32), pl = at::empty({chunk, hq, parts}, f32);
    po = at::empty({chunk, hq, parts, d}, f32);
    a.pm = pm.data_ptr<float>(), a.pl = pl.data_ptr<float>(), a.po = po.data_ptr<float>();
  }
  attn::Params p{};
  p.d = int(d);
  p.scale = float(scale.has_value() ? *scale : 1.0 / std::sqrt(double(d)));
  p.softcap = float(softcap);
  p.sinks = sink_ptr;
  const float* ks = sz.quant ? key_scale->const_data_ptr<float>() : nullptr;
  const float* vs = sz.quant ? value_scale->const_data_ptr<float>() : nullptr;
  TOPG_CUDA_DISPATCH_FLOAT(query.scalar_type(), OP, T, [&] {
    // Cache rows start at multiples of D elements: 16-byte K loads need D % 8 == 0.
    const bool vec = d % kVec == 0 && aligned16(key_cache.const_data_ptr());
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const int64_t nr = std::min(chunk, rows - r0);
      a.row0 = r0;
      const dim3 grid(unsigned(hkv * a.gchunks), unsigned(nr), unsigned(parts));
      auto launch = [&]<int MAXND>() {
        if (sz.quant)  // int8 cache: C = int8_t, scales per token and kv head
          paged_kernel<T, int8_t, MAXND><<<grid, attn::kWarps * 32, 0, current_stream()>>>(
              cdptr<T>(query), cdptr<int8_t>(key_cache), cdptr<int8_t>(value_cache), ks, vs,
              dptr<T>(out), a, p, vec);
        else
          paged_kernel<T, T, MAXND><<<grid, attn::kWarps * 32, 0, current_stream()>>>(
              cdptr<T>(query), cdptr<T>(key_cache), cdptr<T>(value_cache), nullptr, nullptr,
              dptr<T>(out), a, p, vec);
        TOPG_CUDA_LAUNCH_CHECK();
      };
      if (d <= 128)
        launch.template operator()<4>();
      else
        launch.template operator()<8>();
      if (parts > 1) {
        paged_reduce_kernel<T><<<dim3(unsigned(hq), unsigned(nr)), 128, 0, current_stream()>>>(
            dptr<T>(out), a, int(d), sink_ptr);
        TOPG_CUDA_LAUNCH_CHECK();
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace topg::cuda

TORCH_LIBRARY_IMPL(topg, CUDA, m) {
  m.impl("_cuda_paged_attention", &topg::cuda::paged_attention_cuda);
}
