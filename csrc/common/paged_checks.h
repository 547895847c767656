// Value checks of topg::paged_attention's index arguments (seq_lens, block_tables,
// cu_seqlens_q) on host copies: run by the CPU kernel before any work, and by the CUDA
// binding to word the error once its device-side test has found a problem. The kernels
// rely on them: past these checks no length, offset or block id can read out of bounds.
#pragma once

#include <cstdint>
#include <string>

#include "checks.h"

namespace topg::paged {

// bt_arg / sl_arg / cu_arg: the arguments as the caller passed them (for the message);
// tab / lens / cu: their values on the host, contiguous (cu null without cu_seqlens_q).
// rows: query rows (Tq with cu_seqlens_q).
inline void check_indices(const char* op, const at::Tensor& bt_arg, const at::Tensor& sl_arg,
                          const at::Tensor* cu_arg, const int32_t* tab, const int32_t* lens,
                          const int32_t* cu, int64_t num_seqs, int64_t max_blocks,
                          int64_t num_blocks, int64_t block_size, int64_t rows) {
  using std::to_string;
  if (cu) {
    for (int64_t s = 0; s <= num_seqs; ++s) {
      const bool ok = s == 0 ? cu[0] == 0 : cu[s] >= cu[s - 1];
      if (!ok || (s == num_seqs && cu[s] != rows))
        Arg(op, "cu_seqlens_q", *cu_arg)
            .fail("non-decreasing offsets from 0 to " + to_string(rows) +
                  " (the query rows), got " + to_string(cu[s]) + " at [" + to_string(s) + "]");
    }
  }
  const int64_t cap = max_blocks * block_size;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (lens[s] < 0 || lens[s] > cap)
      Arg(op, "seq_lens", sl_arg)
          .fail("values in [0, " + to_string(cap) + "] (max_blocks_per_seq * block_size), got " +
                to_string(lens[s]) + " for sequence " + to_string(s));
    if (cu && cu[s + 1] - cu[s] > lens[s])
      Arg(op, "cu_seqlens_q", *cu_arg)
          .fail("at most seq_lens[" + to_string(s) + "] = " + to_string(lens[s]) +
                " query tokens for sequence " + to_string(s) + " (its last tokens), got " +
                to_string(cu[s + 1] - cu[s]));
    const int64_t used = (lens[s] + block_size - 1) / block_size;
    for (int64_t j = 0; j < used; ++j) {
      const int32_t id = tab[s * max_blocks + j];
      if (id < 0 || id >= num_blocks)
        Arg(op, "block_tables", bt_arg)
            .fail("block ids in [0, " + to_string(num_blocks) + "), got " + to_string(id) +
                  " at [" + to_string(s) + ", " + to_string(j) + "]");
    }
  }
}

}  // namespace topg::paged
