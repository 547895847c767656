"""A node of a pipeline-parallel engine lost while node 0 serves (processes as nodes on
the loopback network): node 1's process is killed (``SIGKILL``) or stopped (``SIGSTOP``,
a node that hangs) with requests in flight. Every request in flight ends with an error
naming the lost node, none hangs; the engine then refuses new requests
(``EngineDeadError``, naming the node; the server answers 503 and ``/health`` 503), and
shuts down cleanly. Before the loss the pipeline answers as one process does (the
reference)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from cluster_utils import free_port, save_pp_llama
from engine_utils import prompts

from torch_topg.engine import Engine
from torch_topg.engine.errors import EngineDeadError

pytestmark = [
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()),
        reason="torch.distributed with gloo is not available",
    ),
    pytest.mark.above_ops,  # the reference lane deselects it (docs/build.md)
]

GREEDY = dict(temperature=0, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_pp_llama(tmp_path_factory.mktemp("llama-pp-failures"))


def _node1(llama: Path, options: dict) -> subprocess.Popen:
    """Node 1's process, once it is about to join (its imports done)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "pp_node.py"), str(llama), json.dumps([options])],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    out = ""
    while "NODE JOINING 0" not in out:
        line = proc.stdout.readline()
        assert line, f"node 1 exited before joining:\n{out[-3000:]}"
        out += line
    return proc


@pytest.fixture(scope="module")
def reference(llama) -> list[list[int]]:
    with Engine.from_pretrained(llama, compile=False, block_size=4) as eng:
        return [o.token_ids for o in eng.generate(PROMPTS[:2], max_new_tokens=6, **GREEDY)]


PROMPTS = prompts(1, [5, 9, 3, 7, 6, 4])


@pytest.mark.parametrize("how", ["killed", "hangs"])
def test_node_lost_mid_step_fails_requests_and_refuses_new_ones(llama, reference, how) -> None:
    from fastapi.testclient import TestClient

    from torch_topg.serve import create_app

    port = free_port()
    # node 0 waits dist_timeout for a node's answer: a killed node is seen at once (its
    # connection closes), a hung one after dist_timeout (short here, but it also bounds
    # node 1's join, which starts its rank's process: 4 s once ran out on a loaded machine)
    timeout = 60.0 if how == "killed" else 10.0
    node1 = _node1(llama, dict(block_size=4, master_port=port, dist_timeout=60.0))
    eng = None
    try:
        eng = Engine.from_pretrained(llama, nnodes=2, compile=False, block_size=4,
                                     master_port=port, dist_timeout=timeout)  # fmt: skip
        ps = PROMPTS
        got = [o.token_ids for o in eng.generate(ps[:2], max_new_tokens=6, **GREEDY)]
        assert got == reference  # the pipeline works, before the loss
        handles = [eng.submit(p, max_new_tokens=4000, **GREEDY) for p in ps]
        streams = [iter(h) for h in handles]
        for s in streams[:2]:  # decoding, the pipeline full: then node 1 goes
            next(s)
        os.kill(node1.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        errors = []
        for h in handles:  # every request in flight (or queued) ends, with the reason
            with pytest.raises(RuntimeError) as e:
                h.result(timeout=max(30.0, 3 * timeout))
            errors.append(str(e.value))
        lost = "is lost: its connection closed" if how == "killed" else "did not answer within 10 s (dist_timeout)"  # fmt: skip
        for err in errors:
            assert f"node_rank 1 (rank 1) {lost}" in err, err
        # new requests are refused at once, by name; the server says so too
        with pytest.raises(EngineDeadError, match=r"the engine is dead: .*node_rank 1 \(rank 1\)"):
            eng.submit(ps[0], max_new_tokens=2)
        with TestClient(create_app(eng, "m")) as c:
            r = c.post("/v1/completions", json={"model": "m", "prompt": ps[0], "max_tokens": 2})
            assert r.status_code == 503 and "node_rank 1" in r.json()["error"]["message"]
            h = c.get("/health")
            assert h.status_code == 503 and "node_rank 1" in h.json()["error"]
    finally:
        if eng is not None:
            eng.shutdown()  # clean: returns, and leaves nothing behind
        node1.kill()
        node1.wait(30)
    assert not dist.is_initialized() and mp.active_children() == []
