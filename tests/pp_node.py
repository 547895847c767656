"""Node 1 of the pipeline-parallel tests (``tests/test_engine_pp.py``): one process that
joins node 0's engines one after the other (a process start costs seconds).

    python tests/pp_node.py <model folder> <json: list of from_pretrained options>

Each engine's options include its ``master_port``; ``from_pretrained`` returns (None)
when node 0 shuts that engine down. Prints ``NODE JOINING <i>`` before and
``NODE DONE <i>`` after each."""

from __future__ import annotations

import json
import sys

if __name__ == "__main__":  # its own ranks are spawned: they import this file again
    import torch

    from torch_topg.engine import Engine

    torch.set_num_threads(1)
    folder, runs = sys.argv[1], json.loads(sys.argv[2])
    for i, options in enumerate(runs):
        print(f"NODE JOINING {i}", flush=True)  # imports done: joins within milliseconds
        out = Engine.from_pretrained(folder, nnodes=2, node_rank=1, **options)
        assert out is None, out
        print(f"NODE DONE {i}", flush=True)
