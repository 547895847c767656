// CPU kernel: topg::paged_attention (decode, or ragged new tokens with cu_seqlens_q, over a
// paged KV cache). Checks, index validation, partitioning and scheduling; the math is in
// paged_kernels.h, the index checks in paged_checks.h.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "checks.h"
#include "dispatch.h"
#include "paged_checks.h"
#include "paged_kernels.h"
#include "parallel.h"

namespace topg {
namespace {

constexpr const char* OP = "paged_attention";

void check_args(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                const at::Tensor& bt, const at::Tensor& sl, const std::optional<at::Tensor>& cu,
                int64_t window_left, double softcap) {
  Arg(OP, "query", q).dim(3).floating().device(at::kCPU).last_dim_contiguous();
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
  Arg(OP, "seq_lens", sl).dim(1).dtype(at::kInt).same_device(q, "query");
  if (!cu.has_value()) {
    Arg(OP, "block_tables", bt).size(0, q.size(0), "num_seqs of 'query'");
    Arg(OP, "seq_lens", sl).size(0, q.size(0), "num_seqs of 'query'");
  } else {
    Arg(OP, "block_tables", bt).size(0, sl.size(0), "num_seqs of 'seq_lens'");
    Arg(OP, "cu_seqlens_q", *cu).dim(1).dtype(at::kInt).same_device(q, "query");
    Arg(OP, "cu_seqlens_q", *cu).size(0, sl.size(0) + 1, "num_seqs + 1, from 'seq_lens'");
  }
  TOPG_CHECK(window_left >= -1, OP, "window_left must be >= -1, got ", window_left);
  TOPG_CHECK(softcap >= 0, OP, "softcap must be >= 0, got ", softcap);
}

// Partition results held at once (floats): rows are processed in waves within this,
// so a long ragged query (a prefill chunk) does not allocate rows x partitions x Hq x D.
constexpr int64_t kWaveFloats = int64_t(4) << 20;

at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& block_tables_,
                               const at::Tensor& seq_lens_,
                               const std::optional<at::Tensor>& cu_seqlens_q_,
                               std::optional<double> scale, int64_t window_left, double softcap) {
  check_args(query, key_cache, value_cache, block_tables_, seq_lens_, cu_seqlens_q_, window_left,
             softcap);
  const at::Tensor block_tables = block_tables_.contiguous(), seq_lens = seq_lens_.contiguous();
  const bool ragged = cu_seqlens_q_.has_value();
  const at::Tensor cu_seqlens_q = ragged ? cu_seqlens_q_->contiguous() : at::Tensor();
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t ns = seq_lens.size(0), rows = query.size(0);
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const int32_t* cu = ragged ? cu_seqlens_q.const_data_ptr<int32_t>() : nullptr;
  paged::check_indices(OP, block_tables_, seq_lens_, ragged ? &*cu_seqlens_q_ : nullptr,
                       block_tables.const_data_ptr<int32_t>(), lens, cu, ns, block_tables.size(1),
                       num_blocks, block_size, rows);

  const int64_t hq = query.size(1), hkv = key_cache.size(2), d = query.size(2);
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (out.numel() == 0) return out;

  // Every query row as a virtual sequence: its sequence (block-table row) and the
  // length up to and including its own position.
  std::vector<int32_t> row_seq(rows), row_len(rows);
  for (int64_t s = 0; s < ns; ++s) {
    const int64_t r0 = ragged ? cu[s] : s, r1 = ragged ? cu[s + 1] : s + 1;
    for (int64_t r = r0; r < r1; ++r) row_seq[r] = int32_t(s), row_len[r] = lens[s] - (r1 - r) + 1;
  }

  const int64_t rs = paged::part_stride(d);
  TOPG_DISPATCH_FLOAT(query.scalar_type(), OP, T, [&] {
    paged::PagedArgs<T> a{};
    a.q = cptr<T>(query), a.q_ss = query.stride(0), a.q_sh = query.stride(1);
    a.kc = cptr<T>(key_cache), a.vc = cptr<T>(value_cache);
    a.bt = block_tables.const_data_ptr<int32_t>(), a.bt_ss = block_tables.size(1);
    a.row_seq = row_seq.data();
    a.hq = hq, a.hkv = hkv, a.d = d, a.block_size = block_size;
    a.scale = float(scale.has_value() ? *scale : 1.0 / std::sqrt(double(d)));
    a.softcap = float(softcap), a.window = window_left;

    // Items (row, partition): a row's keys [lo, len) cut into partitions of
    // part_tokens(len - lo) tokens (a function of the row alone: batch invariance).
    struct Item {
      int64_t tokens, row, t0, t1, res;  // res: offset of its result, in partitions
    };
    std::vector<Item> work;
    std::vector<int64_t> first(rows + 1);  // partitions of row r: first[r] .. first[r + 1]
    std::vector<float> res;
    T* o = ptr<T>(out);
    for (int64_t w0 = 0; w0 < rows;) {  // a wave of rows [w0, w1)
      work.clear();
      int64_t w1 = w0, nparts = 0;
      for (; w1 < rows; ++w1) {
        const int64_t n = row_len[w1], lo = a.first_key(n), span = n - lo;
        const int64_t size = paged::part_tokens(span);
        const int64_t parts = std::max<int64_t>(1, (span + size - 1) / size);
        if (w1 > w0 && (nparts + parts) * hq * rs > kWaveFloats) break;
        first[w1] = nparts;
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t t0 = lo + p * size, t1 = std::min(n, t0 + size);
          work.push_back({std::max<int64_t>(0, t1 - t0), w1, t0, t1, nparts + p});
        }
        nparts += parts;
      }
      first[w1] = nparts;
      res.resize(size_t(nparts * hq * rs));
      // Longest partitions first (the shorter ones fill the gaps at the end).
      std::stable_sort(work.begin(), work.end(),
                       [](const Item& x, const Item& y) { return x.tokens > y.tokens; });
      parallel_items_with<paged::Workspace>(
          int64_t(work.size()), [&](int64_t i, paged::Workspace& ws) {
            const Item& it = work[i];
            paged::partition(a, it.row, it.t0, it.t1, ws, res.data() + it.res * hq * rs);
          });
      const int64_t grain = std::max<int64_t>(1, 16 * (w1 - w0) / nparts);
      at::parallel_for(w0, w1, grain, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r)
          paged::combine(res.data() + first[r] * hq * rs, first[r + 1] - first[r], hq, d,
                         o + r * hq * d, d);
      });
      w0 = w1;
    }
  });
  return out;
}

}  // namespace
}  // namespace topg

TORCH_LIBRARY_IMPL(topg, CPU, m) { m.impl("paged_attention", &topg::paged_attention_cpu); }
