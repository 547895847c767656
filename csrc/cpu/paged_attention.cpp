// CPU kernel: topg::paged_attention (decode, or ragged new tokens with cu_seqlens_q, over a
// paged KV cache in the query's dtype or int8 with per-token scales). Checks, index validation,
// partitioning and scheduling; the math is in paged_kernels.h, the index checks in paged_checks.h.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "attention_kernels.h"
#include "common/op_checks.h"
#include "common/paged_checks.h"
#include "dispatch.h"
#include "modes.h"
#include "paged_kernels.h"
#include "parallel.h"

namespace topg {
namespace {

constexpr const char* OP = "paged_attention";

// Partition results held at once (floats): rows are processed in waves within this,
// so a long ragged query (a prefill chunk) does not allocate rows x partitions x Hq x D.
constexpr int64_t kWaveFloats = int64_t(4) << 20;

// The sequences `dense` (their query rows [cu[s], cu[s + 1]) against all their keys),
// on attn::prefill_block over their keys gathered into one contiguous buffer.
template <typename T>
void dense_rows(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                const int32_t* bt, int64_t bt_ss, const int32_t* lens, const int32_t* cu,
                const std::vector<int64_t>& dense, at::Tensor& out, const checks::PagedSizes& sz,
                float scale, int64_t window_left, float softcap, const float* sinks) {
  const int64_t hkv = sz.hkv, d = sz.head_dim, bs = sz.block_size, row = hkv * d;
  const int64_t nd = int64_t(dense.size());
  std::vector<int64_t> q_off(nd), k_off(nd), o_off(nd), sq(nd), sk(nd);
  int64_t keys = 0;
  for (int64_t i = 0; i < nd; ++i) {
    const int64_t s = dense[i];
    q_off[i] = cu[s] * query.stride(0), o_off[i] = cu[s] * out.stride(0);
    k_off[i] = keys * row, sq[i] = cu[s + 1] - cu[s], sk[i] = lens[s];
    keys += lens[s];
  }
  at::Tensor kbuf = at::empty({keys, hkv, d}, query.options());
  at::Tensor vbuf = at::empty({keys, hkv, d}, query.options());
  T* kb = ptr<T>(kbuf);
  T* vb = ptr<T>(vbuf);
  const T* kc = cptr<T>(key_cache);
  const T* vc = cptr<T>(value_cache);
  // Gather: one item per (sequence, block).
  std::vector<std::pair<int64_t, int64_t>> copies;
  for (int64_t i = 0; i < nd; ++i)
    for (int64_t j = 0; j * bs < sk[i]; ++j) copies.emplace_back(i, j);
  parallel_items(int64_t(copies.size()), [&](int64_t c) {
    const auto [i, j] = copies[c];
    const int64_t blk = bt[dense[i] * bt_ss + j], n = std::min(bs, sk[i] - j * bs);
    const size_t bytes = size_t(n * row) * sizeof(T);
    std::memcpy(kb + k_off[i] + j * bs * row, kc + blk * bs * row, bytes);
    std::memcpy(vb + k_off[i] + j * bs * row, vc + blk * bs * row, bytes);
  });
  attn::PrefillArgs<T> a{};
  a.q = cptr<T>(query), a.k = kb, a.v = vb, a.out = ptr<T>(out);
  a.q_ss = query.stride(0), a.q_sh = query.stride(1);
  a.k_ss = row, a.k_sh = d, a.v_ss = row, a.v_sh = d;
  a.o_ss = out.stride(0), a.o_sh = out.stride(1);
  a.q_off = q_off.data(), a.k_off = k_off.data(), a.v_off = k_off.data();
  a.o_off = o_off.data(), a.sq = sq.data(), a.sk = sk.data();
  a.hq = sz.hq, a.hkv = hkv, a.d = d, a.scale = scale, a.softcap = softcap;
  a.causal = true, a.window = window_left;  // bottom-right aligned, as the paged rows
  a.sinks = sinks;
  attn::run_prefill(a, nd);
}

at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& block_tables_,
                               const at::Tensor& seq_lens_,
                               const std::optional<at::Tensor>& cu_seqlens_q_,
                               std::optional<double> scale, int64_t window_left, double softcap,
                               const std::optional<at::Tensor>& key_scale,
                               const std::optional<at::Tensor>& value_scale,
                               const std::optional<at::Tensor>& sinks_) {
  const checks::PagedSizes sz = checks::paged_attention(
      query, key_cache, value_cache, block_tables_, seq_lens_, cu_seqlens_q_, window_left, softcap,
      key_scale, value_scale, at::kCPU);
  const float* sinks = checks::sinks(OP, sinks_, query, sz.hq);
  const at::Tensor block_tables = block_tables_.contiguous(), seq_lens = seq_lens_.contiguous();
  const bool ragged = sz.ragged;
  const at::Tensor cu_seqlens_q = ragged ? cu_seqlens_q_->contiguous() : at::Tensor();
  const int64_t num_blocks = sz.num_blocks, block_size = sz.block_size;
  const int64_t ns = sz.num_seqs, rows = sz.rows;
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* cu = ragged ? cu_seqlens_q.const_data_ptr<int32_t>() : nullptr;
  paged::check_indices(OP, block_tables_, seq_lens_, ragged ? &*cu_seqlens_q_ : nullptr,
                       block_tables.const_data_ptr<int32_t>(), lens, cu, ns, sz.max_blocks,
                       num_blocks, block_size, rows);

  const int64_t hq = sz.hq, hkv = sz.hkv, d = sz.head_dim;
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (out.numel() == 0) return out;

  // Every query row as a virtual sequence: its sequence (block-table row) and the
  // length up to and including its own position.
  std::vector<int32_t> row_seq(rows), row_len(rows);
  for (int64_t s = 0; s < ns; ++s) {
    const int64_t r0 = ragged ? cu[s] : s, r1 = ragged ? cu[s + 1] : s + 1;
    for (int64_t r = r0; r < r1; ++r) row_seq[r] = int32_t(s), row_len[r] = lens[s] - (r1 - r) + 1;
  }
  // Long query runs go to the dense kernel (dense_rows, after the paged pass, which
  // writes zeros for their rows: row_len 0). Not for int8 caches, and not in
  // batch-invariant mode: a sequence's chunk size depends on its batch-mates' share of
  // the step's token budget, and the two kernels round differently.
  std::vector<int64_t> dense;
  if (ragged && !sz.quant && !batch_invariant())
    for (int64_t s = 0; s < ns; ++s)
      if (cu[s + 1] - cu[s] >= paged::kDenseRows && lens[s] > 0) {
        dense.push_back(s);
        for (int64_t r = cu[s]; r < cu[s + 1]; ++r) row_len[r] = 0;
      }

  const int64_t rs = paged::part_stride(d);
  // C: the cache's storage type (T, or int8_t with scales).
  const auto body = [&]<typename T, typename C>() {
    paged::PagedArgs<T, C> a{};
    a.q = cptr<T>(query), a.q_ss = query.stride(0), a.q_sh = query.stride(1);
    a.kc = cptr<C>(key_cache), a.vc = cptr<C>(value_cache);
    if (sz.quant) a.ks = cptr<float>(*key_scale), a.vs = cptr<float>(*value_scale);
    a.bt = block_tables.const_data_ptr<int32_t>(), a.bt_ss = block_tables.size(1);
    a.row_seq = row_seq.data();
    a.hq = hq, a.hkv = hkv, a.d = d, a.block_size = block_size;
    a.scale = float(scale.has_value() ? *scale : 1.0 / std::sqrt(double(d)));
    a.softcap = float(softcap), a.window = window_left;

    // A row's keys [lo, n) meet the partitions [k * P, (k + 1) * P) with P =
    // part_tokens(n - lo): a function of the row alone (batch invariance), aligned to the
    // sequence start so that rows of one ragged query with the same P share partitions.
    // Work item: one partition of one sequence for up to kItemRows of its rows.
    struct Item {
      int64_t cost, r0, r1, k, size;  // rows [r0, r1), partition k of `size` tokens
    };
    std::vector<Item> work;
    std::vector<int64_t> lo(rows), size(rows), first(rows + 1);  // first: result slots
    std::vector<float> res;
    const std::unique_ptr<std::atomic<int32_t>[]> pending(new std::atomic<int32_t>[rows]);
    T* o = ptr<T>(out);
    const auto k0 = [&](int64_t r) { return lo[r] / size[r]; };  // a row's first partition
    for (int64_t w0 = 0; w0 < rows;) {                           // a wave of rows [w0, w1)
      int64_t w1 = w0, nparts = 0;
      for (; w1 < rows; ++w1) {
        const int64_t n = row_len[w1];
        lo[w1] = a.first_key(n), size[w1] = paged::part_tokens(n - lo[w1]);
        const int64_t parts = n > lo[w1] ? (n + size[w1] - 1) / size[w1] - k0(w1) : 1;
        if (w1 > w0 && (nparts + parts) * hq * rs > kWaveFloats) break;
        first[w1] = nparts;
        nparts += parts;
      }
      first[w1] = nparts;
      res.resize(size_t(nparts * hq * rs));
      work.clear();
      for (int64_t g0 = w0; g0 < w1;) {  // groups: rows of one sequence with one P
        int64_t g1 = g0 + 1;
        while (g1 < w1 && g1 - g0 < paged::kItemRows && row_seq[g1] == row_seq[g0] &&
               size[g1] == size[g0] && row_len[g0] > 0)
          ++g1;
        const int64_t P = size[g0], last = (row_len[g1 - 1] + P - 1) / P;
        if (row_len[g1 - 1] == 0) work.push_back({0, g0, g1, 0, P});  // empty: zeros
        // lo and n grow with the row: the rows that see keys in partition k are a range.
        for (int64_t k = k0(g0), r0 = g0, r1 = g0; k < last; ++k) {
          while (row_len[r0] <= k * P) ++r0;
          while (r1 < g1 && lo[r1] < (k + 1) * P) ++r1;
          const int64_t tokens = std::min<int64_t>(row_len[r1 - 1], (k + 1) * P) - k * P;
          work.push_back({tokens * (r1 - r0 + 1), r0, r1, k, P});
        }
        g0 = g1;
      }
      // Costliest items first (the cheaper ones fill the gaps at the end).
      std::stable_sort(work.begin(), work.end(),
                       [](const Item& x, const Item& y) { return x.cost > y.cost; });
      // A row is merged by whichever thread finishes its last partition (the merge reads
      // the partitions in order: the same result whichever thread it is).
      for (int64_t r = w0; r < w1; ++r)
        pending[r].store(int32_t(first[r + 1] - first[r]), std::memory_order_relaxed);
      parallel_items_with<paged::Workspace>(int64_t(work.size()), [&](int64_t i,
                                                                      paged::Workspace& ws) {
        const Item& it = work[i];
        paged::RowPart rp[paged::kItemRows];
        for (int64_t r = it.r0; r < it.r1; ++r)
          rp[r - it.r0] = {r, lo[r], row_len[r], res.data() + (first[r] + it.k - k0(r)) * hq * rs};
        const int64_t t0 = it.k * it.size;
        paged::partition(a, rp, it.r1 - it.r0, t0,
                         std::min<int64_t>(row_len[it.r1 - 1], t0 + it.size), ws);
        for (int64_t r = it.r0; r < it.r1; ++r)
          if (pending[r].fetch_sub(1, std::memory_order_acq_rel) == 1)
            paged::combine(res.data() + first[r] * hq * rs, first[r + 1] - first[r], hq, d,
                           o + r * hq * d, d, sinks);
      });
      w0 = w1;
    }
  };
  TOPG_DISPATCH_FLOAT(query.scalar_type(), OP, T, [&] {
    if (sz.quant)
      body.template operator()<T, int8_t>();
    else
      body.template operator()<T, T>();
    if (!dense.empty())
      dense_rows<T>(query, key_cache, value_cache, block_tables.const_data_ptr<int32_t>(),
                    block_tables.size(1), lens, cu, dense, out, sz,
                    float(scale.has_value() ? *scale : 1.0 / std::sqrt(double(d))), window_left,
                    float(softcap), sinks);
  });
  return out;
}

}  // namespace
}  // namespace topg

TORCH_LIBRARY_IMPL(topg, CPU, m) { m.impl("paged_attention", &topg::paged_attention_cpu); }
