"""Pipeline parallelism across nodes (``nnodes``; processes as nodes on the loopback
network): greedy tokens equal one process's for ``nnodes=2`` and ``nnodes=2 x
tp_size=2`` (a tiny Llama whose 3 layers split 1 + 2 and whose 3 KV heads split 2 + 1),
with late arrivals, a fork (``n=2``: a block copy on every stage) and a prefix reuse;
a node that does not join in time is an error naming it; a stage is the model cut, read
from only its own tensors (against the whole model's logits)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from cluster_utils import free_port, save_pp_llama
from engine_utils import prompts, whole_pool

from torch_topg.engine import Engine
from torch_topg.engine.errors import ParameterError
from torch_topg.models import build_model

pytestmark = [
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="torch.distributed with gloo is not available",
    ),
    pytest.mark.above_ops,  # the reference lane deselects it (docs/build.md)
]

GREEDY = dict(temperature=0, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[1]
OPTS = dict(block_size=4, max_num_batched_tokens=16, dist_timeout=120.0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Llama (no tokenizer), 3 layers, 6 query / 3 KV heads, untied LM head."""
    return save_pp_llama(tmp_path_factory.mktemp("llama-pp"))


@pytest.fixture(scope="module")
def reference(llama):
    """One process's greedy tokens (the prompts, and n=2 of the first)."""
    ps = prompts(1, [5, 23, 2, 40, 11, 17])
    with Engine.from_pretrained(llama, compile=False, **OPTS) as eng:
        return ps, [o.token_ids for o in eng.generate(ps, max_new_tokens=12, **GREEDY)]


@pytest.fixture(scope="module")
def node1(llama):
    """Node 1: one process joining both tests' engines in turn (tp_size 1, then 2)."""
    runs = [dict(OPTS, master_port=free_port(), tp_size=tp) for tp in (1, 2)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "pp_node.py"), str(llama), json.dumps(runs)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    yield proc, runs
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def _run_pipeline(llama, reference, node1, index: int, **node0: Any) -> None:
    """``node0``: node 0's own options (``pp_layers`` is read there only)."""
    ps, want = reference
    proc, runs = node1
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    threads = torch.get_num_threads()
    eng = Engine.from_pretrained(llama, nnodes=2, compile=index == 0, **runs[index], **node0)
    procs = list(eng.runner.group.procs)
    # by bytes: 2 layers + 1 layer and the LM head (a third of a layer here); by hand: 1 + 2
    split = [[0, 2], [2, 3]] if "pp_layers" not in node0 else [[0, 1], [1, 3]]
    try:
        assert eng.runner.stage.layers == range(*split[0])
        held = [c.numel() > 0 for c in eng.runner.kv_caches]  # K and V of each layer
        assert held == [True] * 2 * split[0][1] + [False] * 2 * (3 - split[0][1])
        with whole_pool(eng):
            handles, streams = [], []
            for p in ps:  # late arrivals: each joins while the others decode
                handles.append(eng.submit(p, max_new_tokens=12, **GREEDY))
                streams.append(iter(handles[-1]))
                next(streams[-1])  # its first token is out (keep the stream: no abort)
            got = [h.result(timeout=120).token_ids for h in handles]
            two = eng.generate(ps[0], n=2, max_new_tokens=12, **GREEDY)[0]
            again = eng.generate(ps[3], max_new_tokens=12, **GREEDY)[0]
        assert got == want
        assert [o.token_ids for o in two.outputs] == [want[0], want[0]]
        assert again.token_ids == want[3] and again.cached_prompt_tokens == 36
        st = eng.stats()
        assert max(st["steps"]["batch_sizes"]) > 1
        assert st["decode_plan"]["reason"].startswith("nnodes > 1")
        figures = eng.runner.pipeline_stats()["stages"]
        assert [f["layers"] for f in figures] == split
        assert all(f["steps"] == figures[0]["steps"] > 0 for f in figures)
    finally:
        eng.shutdown()
    deadline = time.monotonic() + 60
    out = ""
    while f"NODE DONE {index}" not in out and time.monotonic() < deadline:
        out += proc.stdout.readline()
    assert f"NODE DONE {index}" in out, out[-3000:]
    assert torch.get_num_threads() == threads
    assert not dist.is_initialized()
    assert not any(p.is_alive() for p in procs) and mp.active_children() == []


def test_nnodes2_pipeline_equals_one_process(llama, reference, node1):
    """Two process-nodes, the step compiled on each (backend="topg")."""
    _run_pipeline(llama, reference, node1, 0)


def test_nnodes2_tp2_equals_one_process(llama, reference, node1):
    """Two nodes of two tensor-parallel ranks each (4 processes)."""
    _run_pipeline(llama, reference, node1, 1, pp_layers=[1, 2])
    node1[0].wait(60)
    assert node1[0].returncode == 0


def test_node_that_does_not_join_is_named(llama):
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"node_rank 1 did not join within 1 s .*127\.0\.0\.1:{port}"):  # fmt: skip
        Engine.from_pretrained(llama, nnodes=2, master_port=port, dist_timeout=1.0, compile=False)
    assert time.monotonic() - t0 < 30
    assert not dist.is_initialized() and mp.active_children() == []
    # and a node whose node 0 is not there says where it looked
    with pytest.raises(TimeoutError, match=rf"node_rank 1 could not reach node 0 at 127\.0\.0\.1:{port} within 1 s"):  # fmt: skip
        Engine.from_pretrained(llama, nnodes=2, node_rank=1, master_port=port, dist_timeout=1.0)


def test_options_are_checked_and_are_serve_flags(llama):
    with pytest.raises(ParameterError, match="node_rank.*nnodes=2"):
        Engine.from_pretrained(llama, nnodes=2, node_rank=2)
    with pytest.raises(ParameterError, match="speculative.*nnodes=2"):
        Engine.from_pretrained(llama, nnodes=2, speculative={"method": "ngram"})
    with pytest.raises(ParameterError, match="master_port"):
        Engine.from_pretrained(llama, nnodes=2, master_port=70000)
    with pytest.raises(ParameterError, match=r"pp_layers: expected one layer count per node \(nnodes=2\), got 3"):  # fmt: skip
        Engine.from_pretrained(llama, nnodes=2, pp_layers=[1, 1, 1])
    with pytest.raises(ParameterError, match=r"pp_layers: expected a list of layer counts >= 1.*\[2, 0\]"):  # fmt: skip
        Engine.from_pretrained(llama, nnodes=2, pp_layers=[2, 0])
    with pytest.raises(ParameterError, match=r"pp_layers: \[2, 2\] sums to 4 layers; the model has 3"):  # fmt: skip
        Engine.from_pretrained(llama, nnodes=2, pp_layers=[2, 2], master_port=free_port())
    from torch_topg.engine.options import from_cli_args
    from torch_topg.serve.cli import parser

    argv = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port",
            "29600", "--dist-timeout", "30", "--pp-layers", "19,11"]  # fmt: skip
    got = from_cli_args(parser().parse_args(argv))
    assert got == dict(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29600,
                       dist_timeout=30.0, pp_layers=[19, 11])  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_stages_read_only_their_tensors_and_chain_to_the_model(tmp_path, tied):
    """The pure reference: the stages' forwards chained equal the whole model's logits,
    and each stage read only its own tensors from the checkpoint."""
    from torch_topg.parallel import empty_model
    from torch_topg.parallel import loading as pl
    from torch_topg.parallel.pipeline import load_stage, pipeline_stage, split_layers

    full = build_model("llama-tiny", num_hidden_layers=5, tie_word_embeddings=tied)
    full.save_pretrained(tmp_path)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    stages = split_layers(5, 3)
    assert [(s.start, s.end) for s in stages] == [(0, 1), (1, 3), (3, 5)]
    read: list[str] = []
    original = pl.CheckpointSource.read

    def spy(self, s):
        read.append(s.name)
        return original(self, s)

    pl.CheckpointSource.read = spy
    try:
        with torch.inference_mode():
            hidden, names = None, []
            for st in stages:
                read.clear()
                m = load_stage(pipeline_stage(empty_model(full.config), st), tmp_path,
                               torch.float32, "cpu")  # fmt: skip
                names.append(set(read))
                kw = dict(input_ids=ids) if st.first else dict(inputs_embeds=hidden)
                hidden = m(**kw).logits if st.last else m.model(**kw).last_hidden_state
            expected = full(ids).logits
    finally:
        pl.CheckpointSource.read = original
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    layer = lambda n: int(n.split(".")[2]) if n.startswith("model.layers.") else None  # noqa: E731
    for st, got in zip(stages, names, strict=True):
        assert {layer(n) for n in got} - {None} == set(st.layers)
        assert ("model.embed_tokens.weight" in got) == (st.first or (st.last and tied))
        assert ("model.norm.weight" in got) == st.last
        assert ("lm_head.weight" in got) == (st.last and not tied)
    with pytest.raises(ValueError, match="cannot be split"):
        split_layers(2, 3)


def _best_by_brute_force(sizes: list[int], head: int, stages: int) -> tuple[int, int]:
    """The reference: every split into consecutive non-empty stages; the least largest
    stage, and the least sum of squares among the splits that reach it."""
    import itertools

    best = None
    for cuts in itertools.combinations(range(1, len(sizes)), stages - 1):
        bounds = [0, *cuts, len(sizes)]
        costs = [sum(sizes[a:b]) for a, b in itertools.pairwise(bounds)]
        costs[-1] += head
        key = (max(costs), sum(c * c for c in costs))
        best = key if best is None else min(best, key)
    return best


def test_stages_balanced_by_bytes_llama_1b_shape():
    """Llama-3.2-1B's shapes (16 layers, hidden 2048, MLP 8192, 8 KV heads of 64, a tied
    128256-row head) in bf16: the LM head weighs 4.3 layers, so the last stage gets 6
    layers and the first 10; the table is the hand count and the split the best of every
    possible split."""
    from transformers import LlamaConfig

    from torch_topg.parallel import empty_model
    from torch_topg.parallel.pipeline import balance_layers, byte_table, split_layers

    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      tie_word_embeddings=True)  # fmt: skip
    layers, head = byte_table(empty_model(cfg, torch.bfloat16))
    h, kv, mlp = 2048, 8 * 64, 8192
    layer = 2 * (2 * h * h + 2 * h * kv + 3 * h * mlp + 2 * h)  # q, o, k, v, MLP, 2 norms
    assert layers == [layer] * 16 and head == 2 * (128256 * h + h)  # + the final norm
    stages = balance_layers(layers, head, 2)
    assert [(s.start, s.end) for s in stages] == [(0, 10), (10, 16)]
    for n in (2, 3, 4):  # the split's worst stage and evenness equal the exhaustive best
        got = balance_layers(layers, head, n)
        costs = [sum(layers[s.start : s.end]) for s in got]
        costs[-1] += head
        assert (max(costs), sum(c * c for c in costs)) == _best_by_brute_force(layers, head, n)
    # uneven layers (a quantised layer is smaller), and the old count rule as a special case
    sizes = [5, 9, 1, 7, 3, 3, 8, 2]
    for n in (2, 3, 5):
        got = balance_layers(sizes, 6, n)
        assert [g.start for g in got] == [0] + [g.end for g in got[:-1]]
        assert got[-1].end == len(sizes) and all(g.end > g.start for g in got)
        costs = [sum(sizes[s.start : s.end]) for s in got]
        costs[-1] += 6
        assert (max(costs), sum(c * c for c in costs)) == _best_by_brute_force(sizes, 6, n)
    assert [(s.start, s.end) for s in split_layers(5, 2)] == [(0, 2), (2, 5)]
    with pytest.raises(ValueError, match="cannot be split"):
        balance_layers([1, 1], 0, 3)
