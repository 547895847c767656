"""One step's packed inputs: what the scheduler hands the model runner.

Its own module so that the runner and what runs a step for it (``cuda_graphs.py``, the
tensor-parallel followers in ``tp.py``) share the type without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    """One step's inputs. ``T`` tokens of ``S`` sequences; ``R`` rows sampled."""

    input_ids: torch.Tensor  # int64 [1, T]
    positions: torch.Tensor  # int64 [1, T]
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    seq_lens: torch.Tensor  # int32 [S]: cached tokens after the step
    cu_seqlens_q: torch.Tensor  # int32 [S + 1]
    logits_indices: torch.Tensor  # int64 [R]: rows of the packed batch to sample
    fits_plan: bool = False  # at most PLAN_MAX_TOKENS tokens: the decode plan's steps
    decode: bool = False  # every sequence one new token, sampled once (CUDA graphs' steps)
