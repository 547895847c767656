"""The engine's CUDA-graph decode step (``torch_topg/engine/cuda_graphs.py``), its
bucketing and padding tested on the CPU: the "graph" is ``eager_capture`` (each replay
re-runs the compiled step over the bucket's static buffers, as a CUDA graph replays its
kernels over them). Each decode batch, run padded to its bucket, gives the logits and the
KV cache of the same batch run directly, bitwise (the CPU kernels of a row do not depend
on the rows beside it), whatever ran in the bucket before. The real capture runs on a
GPU: ``tests/test_cuda_engine.py`` (the GPU suite's ``capture`` stage)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import Seqs, prompts, tiny

from torch_topg import _native
from torch_topg.engine.cuda_graphs import BUCKETS, DecodeGraphs, eager_capture
from torch_topg.engine.model_runner import ModelRunner

pytest.importorskip("transformers")


def _runner() -> ModelRunner:
    r = ModelRunner(tiny("llama-tiny"), num_blocks=200, block_size=4, max_blocks_per_seq=16,
                    decode_plan=False)  # fmt: skip
    r.warmup()
    return r


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


@pytest.mark.skipif(
    not _native.load(),
    reason="native library not loaded: the reference fallback's matmul is not row-independent "
    "(a padded batch changes the rows' bits), which the bitwise comparison needs",
)
def test_padded_replays_equal_the_direct_step():
    r = _runner()
    graphs = DecodeGraphs(r, capture=eager_capture)
    # 5 sequences: batches of 5 (bucket 8), then 3 of them (bucket 4), 1 (bucket 1), 5
    seqs = Seqs(r, prompts(4, [3, 9, 14, 6, 21]), seed=1)
    seqs.prefill()
    nxt = [t[-1] for t in seqs.toks]
    for step, n in enumerate([5, 5, 3, 1, 5, 3]):
        sub = Seqs.__new__(Seqs)  # the first n sequences, sharing their blocks
        sub.r, sub.toks, sub.free, sub.blocks = r, seqs.toks[:n], seqs.free, seqs.blocks[:n]
        b = sub.decode_batch(nxt[:n])
        assert b.decode and b.fits_plan
        before = [c.clone() for c in r.kv_caches]
        want = r.execute_graph(b)
        want_kv = [c.clone() for c in r.kv_caches]
        for c, c0 in zip(r.kv_caches, before, strict=True):
            c.copy_(c0)
        got = graphs.run(b)
        assert got.shape == want.shape and torch.equal(_bits(got), _bits(want)), step
        for i, (c, w) in enumerate(zip(r.kv_caches, want_kv, strict=True)):
            assert torch.equal(_bits(c), _bits(w)), f"step {step}: KV tensor {i} differs"
        nxt[:n] = got.argmax(-1).tolist()
    assert sorted(graphs.graphs) == [1, 4, 8] and graphs.captures == 3 and graphs.replays == 6


def test_what_is_not_a_decode_batch_runs_on_the_graph():
    r = _runner()
    graphs = DecodeGraphs(r, capture=eager_capture)
    seqs = Seqs(r, prompts(4, [5, 7]), seed=2)
    seqs.prefill()
    verify = seqs.ragged_batch([[3, 4, 5], [6]], [3, 1])  # a speculative verify step
    assert not verify.decode and graphs.run(verify) is None
    many = Seqs(r, prompts(5, [2] * (BUCKETS[-1] + 1)), seed=3)
    many.prefill()
    big = many.decode_batch([1] * (BUCKETS[-1] + 1))
    assert big.decode is False and graphs.run(big) is None  # 17 rows: not a plan step
    assert graphs.captures == 0


def test_moved_weights_are_captured_again():
    r = _runner()
    graphs = DecodeGraphs(r, capture=eager_capture)
    seqs = Seqs(r, prompts(6, [4, 6]), seed=4)
    seqs.prefill()
    graphs.run(seqs.decode_batch([1, 2]))
    w = r.model.model.layers[0].mlp.down_proj.weight
    w.data = w.data.clone()  # same values, new storage: the captured graph reads the old
    graphs.run(seqs.decode_batch([3, 4]))
    assert graphs.captures == 2


def test_engine_on_cuda_would_use_graphs_and_cpu_the_plan():
    from torch_topg.engine.config import EngineConfig
    from torch_topg.engine.options import EngineArgs
    from torch_topg.engine.setup import decode_plan_wanted as _decode_plan_wanted

    def config(device: str) -> EngineConfig:
        return EngineConfig(EngineArgs(), torch.device(device), torch.float32, 64, 512, 8)

    assert _decode_plan_wanted(config("cuda")) is True
    assert "no decode plan" in _decode_plan_wanted(config("meta"))
