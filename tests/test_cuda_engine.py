"""The engine on CUDA, its decode steps as CUDA graphs (``torch_topg/engine/cuda_graphs.py``).

Runs in the GPU suite's ``capture`` stage (test names with "capture"): greedy tokens of
an engine replaying captured decode steps equal those of the same engine on the
compiled graph (``decode_plan=False``) and transformers' own ``generate``; batches of
several sizes land in several buckets. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch
from conftest import NEEDS_CUDA
from engine_utils import hf_greedy, prompts, tiny

from torch_topg.engine import Engine

pytestmark = NEEDS_CUDA
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_cuda_engine_decode_capture_matches_graph_and_transformers(compile):
    model = tiny("llama-tiny")
    ps = prompts(7, [5, 9, 13])
    # transformers' tokens first: the engine swaps the model's attention for its paged
    # attention, which runs only inside the engine.
    expected = hf_greedy(model, ps[0], 12)
    outs = {}
    for graphs in (True, False) if not compile else (True,):
        with Engine.from_model(model, device="cuda", dtype=torch.float32, block_size=16,
                               compile=compile, decode_plan=graphs) as eng:  # fmt: skip
            runs = [eng.generate(ps[:n], max_new_tokens=12, **GREEDY) for n in (1, 3)]
            outs[graphs] = [[o.outputs[0].token_ids for o in r] for r in runs]
            dp = eng.stats()["decode_plan"]
            if graphs:
                assert dp["active"] and dp["reason"] == "" and dp["steps"] > 0, dp
                assert dp["kind"] == "cuda_graphs"
                assert sorted(eng.runner.plan.graphs) == [1, 4], eng.runner.plan.graphs
            else:
                assert dp["active"] is False and dp["reason"] == "decode_plan=False"
    if not compile:
        assert outs[True] == outs[False]
    assert [r[0] for r in outs[True]] == [expected] * 2
