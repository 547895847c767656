// Process-wide kernel modes set from Python (topg::_set_batch_invariant).
#pragma once

namespace topg {

// Batch-invariant mode: kernels whose algorithm depends on the number of rows (the
// linear and MoE expert GEMMs: dot path for few rows, packed GEMM for many) take one
// path whatever the row count, so a row's result is bitwise independent of the others
// in its batch. Used by the engine's deterministic=True.
bool batch_invariant();

}  // namespace topg
