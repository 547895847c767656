// CPU kernel: topg::paged_attention (decode over a paged KV cache). Checks, index
// validation, partitioning and scheduling; the math is in paged_kernels.h.
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "checks.h"
#include "dispatch.h"
#include "paged_kernels.h"
#include "parallel.h"

namespace topg {
namespace {

constexpr const char* OP = "paged_attention";

void check_args(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                const at::Tensor& bt, const at::Tensor& sl, int64_t window_left, double softcap) {
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
  Arg(OP, "block_tables", bt).size(0, q.size(0), "num_seqs of 'query'");
  Arg(OP, "seq_lens", sl).dim(1).dtype(at::kInt).same_device(q, "query");
  Arg(OP, "seq_lens", sl).size(0, q.size(0), "num_seqs of 'query'");
  TOPG_CHECK(window_left >= -1, OP, "window_left must be >= -1, got ", window_left);
  TOPG_CHECK(softcap >= 0, OP, "softcap must be >= 0, got ", softcap);
}

// Every length within the table and every block id a sequence uses within the cache:
// one cheap scalar pass before the parallel kernel (which then cannot go out of bounds).
void check_indices(const at::Tensor& bt, const at::Tensor& sl, int64_t num_blocks,
                   int64_t block_size) {
  const int32_t* lens = sl.const_data_ptr<int32_t>();
  const int32_t* tab = bt.const_data_ptr<int32_t>();
  const int64_t max_blocks = bt.size(1), cap = max_blocks * block_size;
  for (int64_t s = 0; s < sl.size(0); ++s) {
    if (lens[s] < 0 || lens[s] > cap)
      Arg(OP, "seq_lens", sl)
          .fail("values in [0, " + std::to_string(cap) +
                "] (max_blocks_per_seq * block_size), got " + std::to_string(lens[s]) +
                " for sequence " + std::to_string(s));
    const int64_t used = (lens[s] + block_size - 1) / block_size;
    for (int64_t j = 0; j < used; ++j) {
      const int32_t id = tab[s * max_blocks + j];
      if (id < 0 || id >= num_blocks)
        Arg(OP, "block_tables", bt)
            .fail("block ids in [0, " + std::to_string(num_blocks) + "), got " +
                  std::to_string(id) + " at [" + std::to_string(s) + ", " + std::to_string(j) +
                  "]");
    }
  }
}

at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& block_tables_,
                               const at::Tensor& seq_lens_, std::optional<double> scale,
                               int64_t window_left, double softcap) {
  check_args(query, key_cache, value_cache, block_tables_, seq_lens_, window_left, softcap);
  const at::Tensor block_tables = block_tables_.contiguous(), seq_lens = seq_lens_.contiguous();
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  check_indices(block_tables, seq_lens, num_blocks, block_size);

  const int64_t ns = query.size(0), hq = query.size(1), hkv = key_cache.size(2);
  const int64_t d = query.size(2);
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (out.numel() == 0) return out;

  // Partitioning: one item = (sequence, partition), all heads. Aim for >= 4 items per
  // thread (balance); partitions of at least 128 tokens amortise their merge, at most
  // 512 bound the score buffer (Hq x 512 floats).
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  int64_t max_len = 0;
  for (int64_t s = 0; s < ns; ++s) max_len = std::max<int64_t>(max_len, lens[s]);
  if (window_left >= 0) max_len = std::min<int64_t>(max_len, window_left + 1);
  const int64_t threads = at::get_num_threads();
  int64_t parts = std::min((4 * threads + ns - 1) / ns, (max_len + 127) / 128);
  parts = std::max<int64_t>({parts, (max_len + 511) / 512, 1});
  const int64_t part_size =
      paged::round_up(std::max<int64_t>((max_len + parts - 1) / parts, 1), 16);

  const int64_t rs = paged::part_stride(d);
  std::vector<float> res(size_t(ns * parts * hq * rs));
  TOPG_DISPATCH_FLOAT(query.scalar_type(), OP, T, [&] {
    paged::PagedArgs<T> a{};
    a.q = cptr<T>(query), a.q_ss = query.stride(0), a.q_sh = query.stride(1);
    a.kc = cptr<T>(key_cache), a.vc = cptr<T>(value_cache);
    a.bt = block_tables.const_data_ptr<int32_t>(), a.bt_ss = block_tables.size(1);
    a.seq_lens = lens;
    a.hq = hq, a.hkv = hkv, a.d = d, a.block_size = block_size;
    a.scale = float(scale.has_value() ? *scale : 1.0 / std::sqrt(double(d)));
    a.softcap = float(softcap), a.window = window_left, a.part_size = part_size;

    // Items (sequence, partition), longest partitions first.
    struct Item {
      int64_t tokens, seq, p;
    };
    std::vector<Item> work;
    for (int64_t s = 0; s < ns; ++s) {
      const int64_t lo = a.first_key(lens[s]);
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t t0 = lo + p * part_size, t1 = std::min<int64_t>(lens[s], t0 + part_size);
        work.push_back({std::max<int64_t>(0, t1 - t0), s, p});
      }
    }
    std::stable_sort(work.begin(), work.end(),
                     [](const Item& x, const Item& y) { return x.tokens > y.tokens; });
    parallel_items_with<paged::Workspace>(
        int64_t(work.size()), [&](int64_t i, paged::Workspace& ws) {
          const Item& it = work[i];
          const int64_t t0 = a.first_key(lens[it.seq]) + it.p * part_size;
          paged::partition(a, it.seq, t0, std::min<int64_t>(lens[it.seq], t0 + part_size), ws,
                           res.data() + (it.seq * parts + it.p) * hq * rs);
        });
    T* o = ptr<T>(out);
    at::parallel_for(0, ns, std::max<int64_t>(1, 16 / parts), [&](int64_t b, int64_t e) {
      for (int64_t s = b; s < e; ++s)
        paged::combine(res.data() + s * parts * hq * rs, parts, hq, d, o + s * hq * d, d);
    });
  });
  return out;
}

}  // namespace
}  // namespace topg

TORCH_LIBRARY_IMPL(topg, CPU, m) { m.impl("paged_attention", &topg::paged_attention_cpu); }
