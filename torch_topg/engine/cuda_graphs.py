"""The engine's decode step on CUDA as one CUDA graph per batch-size bucket.

On the CPU a decode batch runs as one ``topg.DecodePlan`` call (decode_plan.py). On CUDA
the same job, the whole step without a host round trip between its ~300 kernels, is a
CUDA graph: the compiled step (``ModelRunner.execute_graph``) is captured once per
bucket of sequences (1, 2, 4, 8, 16) over static input buffers, and each decode step
copies its inputs into the bucket's buffers and replays the graph.

- **Padding.** A batch of n sequences runs in the smallest bucket >= n. The pad rows
  are one-token sequences: token 0 at position 0, slot -1 (``reshape_and_cache`` skips
  negative slots, so they write no KV), ``seq_len`` 1 over an all-zero block table row
  (they read block 0's first slot, valid memory whatever it holds); every op of the step
  computes a row on its own, so what they compute stays in their rows, which are
  dropped.
- **What is captured:** decode batches only (each sequence one new token, one sampled
  row: ``PackedBatch.decode``). Verify steps, prefill chunks and larger batches run the
  compiled graph as before.
- **Invalidation.** The graph reads the weights and the KV cache at the addresses they
  had at capture. Values updated in place are seen; a parameter whose storage moved
  (``model.to``, a re-pointed ``.data``) is caught before each replay (the parameters'
  addresses are compared) and the graphs are captured again.
- **Capture.** As PyTorch documents for ``torch.cuda.graph``: two warm-up runs on a side
  stream, then the capture, all buckets in one memory pool. The kernels take no host
  sync while a capture is under way (their host-side index checks step aside:
  ``csrc/cuda/common.cuh``).

``capture`` is a parameter so the bucketing and padding are tested on the CPU with
:func:`eager_capture` (a "graph" that re-runs the step into the same output tensor);
the real capture runs on a GPU (the GPU suite's ``capture`` stage).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from torch_topg.engine.batch import PackedBatch

#: Batch-size buckets, one graph each (the largest is the decode plan's row limit).
BUCKETS = (1, 2, 4, 8, 16)

#: ``capture(fn, pool) -> (replay, out)``: ``out`` is ``fn()``'s result, which each
#: ``replay()`` recomputes in place from the same input buffers.
Capture = Callable[[Callable[[], torch.Tensor], Any], tuple[Callable[[], None], torch.Tensor]]


def cuda_capture(fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], Any]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # allocator and lazy-init work happens outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out


def eager_capture(fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], Any]:
    """The CPU stand-in: replay runs ``fn`` again and writes into ``out``."""
    out = fn()

    def replay() -> None:
        with torch.inference_mode():
            out.copy_(fn())

    return replay, out


class Runner(Protocol):
    """What the graphs need of the model runner (``ModelRunner``, which owns them)."""

    model: torch.nn.Module
    device: torch.device
    max_blocks_per_seq: int

    def execute_graph(self, b: PackedBatch) -> torch.Tensor: ...


class CaptureFailed(RuntimeError):
    """A capture raised; the runner drops the graphs and keeps the reason."""


class DecodeGraphs:
    """Decode steps of ``runner`` as replays of one captured step per bucket."""

    def __init__(self, runner: Runner, capture: Capture | None = None) -> None:
        self.runner = runner
        self.capture = capture or cuda_capture
        self.pool: Any = None
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor, PackedBatch]] = {}
        self.captures = 0
        self.replays = 0
        self._weights = self._addresses()

    def _addresses(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.runner.model.parameters())

    @staticmethod
    def bucket(n: int) -> int | None:
        return next((b for b in BUCKETS if b >= n), None)

    def _buffers(self, n: int) -> PackedBatch:
        r, dev = self.runner, self.runner.device
        return PackedBatch(
            input_ids=torch.zeros(1, n, dtype=torch.long, device=dev),
            positions=torch.zeros(1, n, dtype=torch.long, device=dev),
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=dev),
            block_tables=torch.zeros(n, r.max_blocks_per_seq, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(n, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=dev),
            logits_indices=torch.arange(n, dtype=torch.long, device=dev),
            fits_plan=True,
            decode=True,
        )

    def _capture(self, n: int) -> tuple[Callable[[], None], torch.Tensor, PackedBatch]:
        if self.pool is None and self.capture is cuda_capture:
            self.pool = torch.cuda.graph_pool_handle()
        buf = self._buffers(n)
        replay, out = self.capture(lambda: self.runner.execute_graph(buf), self.pool)
        self.captures += 1
        self.graphs[n] = (replay, out, buf)
        return self.graphs[n]

    def run(self, b: PackedBatch) -> torch.Tensor | None:
        """Float32 logits ``[n, vocab]`` of decode batch ``b``, or None (not a decode batch
        of at most 16 sequences: the caller runs the compiled graph)."""
        n = b.input_ids.shape[1]
        bucket = self.bucket(n)
        if not b.decode or bucket is None:
            return None
        with torch.inference_mode():  # the buffers and outputs are inference tensors
            return self._run(b, n, bucket)

    def _run(self, b: PackedBatch, n: int, bucket: int) -> torch.Tensor:
        addresses = self._addresses()
        if addresses != self._weights:  # storage moved: the graphs read stale addresses
            self.graphs.clear()
            self._weights = addresses
        entry = self.graphs.get(bucket)
        if entry is None:
            try:
                entry = self._capture(bucket)
            except Exception as e:  # the runner keeps the compiled graph, with the reason
                raise CaptureFailed(f"CUDA graph capture of the batch-{bucket} step failed: "
                                    f"{type(e).__name__}: {e}") from e  # fmt: skip
        replay, out, buf = entry
        buf.input_ids[:, :n].copy_(b.input_ids)
        buf.positions[:, :n].copy_(b.positions)
        buf.slot_mapping[:n].copy_(b.slot_mapping)
        buf.block_tables[:n].copy_(b.block_tables)
        buf.seq_lens[:n].copy_(b.seq_lens)
        if n < bucket:  # pad rows (a previous, larger batch may have filled them)
            buf.input_ids[:, n:].zero_()
            buf.positions[:, n:].zero_()
            buf.slot_mapping[n:].fill_(-1)
            buf.block_tables[n:].zero_()
            buf.seq_lens[n:].fill_(1)
        replay()
        self.replays += 1
        return out[:n].clone()  # the next replay overwrites out
