// Process-wide kernel modes set from Python (topg::_set_batch_invariant,
// topg::_set_index_checks).
#pragma once

namespace topg {

// Batch-invariant mode: kernels whose algorithm depends on the number of rows (the
// linear and MoE expert GEMMs: dot path for few rows, packed GEMM for many) take one
// path whatever the row count, so a row's result is bitwise independent of the others
// in its batch. Used by the engine's deterministic=True.
bool batch_invariant();

// Index checks of the CUDA kernels: validate the values of index arguments (positions,
// slots, block ids, sequence lengths, expert ids) before launching, which costs a host
// synchronisation per call. Off unless asked (TOPG_CUDA_INDEX_CHECKS=1 at start-up, or
// torch_topg.index_checks()): the kernels bound every index themselves, so a bad index
// never touches memory out of range, but without the checks it raises no error. The CPU
// kernels read indices on the host and always check them.
bool index_checks();

}  // namespace topg
