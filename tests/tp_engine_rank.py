"""One rank of a tensor-parallel engine under torchrun (``tests/test_engine_tp.py``).

    torchrun --standalone --nproc-per-node 2 tests/tp_engine_rank.py <model folder> <prompts json>

Rank 0 builds the engine on the process group torchrun started and prints
``TOKENS <json>`` (greedy token ids per prompt); the other ranks call
``torch_topg.engine.tp.follow()`` until rank 0 shuts the engine down.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

import torch_topg.parallel as tp
from torch_topg.engine import Engine
from torch_topg.engine.tp import follow


def main() -> None:
    folder, prompts = sys.argv[1], json.loads(sys.argv[2])
    tp.init_distributed("gloo", timeout_s=60)
    try:
        if dist.get_rank() == 0:
            eng = Engine.from_pretrained(
                folder, tp_size=dist.get_world_size(), compile=False, block_size=4
            )
            with eng:
                outs = eng.generate(prompts, temperature=0, ignore_eos=True, max_new_tokens=12)
            print("TOKENS", json.dumps([o.token_ids for o in outs]), flush=True)
        else:
            follow()
    finally:
        dist.destroy_process_group()
    # Skip the interpreter's teardown, as the engine's spawned workers do: once, under
    # load, rank 0 aborted there ("terminate called without an active exception", a
    # native thread still joinable at exit) after printing the right tokens.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
