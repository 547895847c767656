"""The engine's decode on CUDA (run by gpu_suite.sh, mode ``profile``): ms per token with the
decode step replayed as CUDA graphs (``decode_plan=True``, the default) against the same
step run without them (``decode_plan=False``: the step's Python and its kernel launches
every token), side by side in one process, and transformers' own ``generate`` on the same
weights.

    python3 python/benchmarks/gpu/engine_decode.py [--quick] [--md engine.md] [--device cuda]

Model: the ``llama-150m`` preset (random weights, bf16 on CUDA): nothing is downloaded on
the GPU machine. Each engine decodes ``--tokens`` greedy tokens after a ``--context``-token
prompt, for batch 1 and batch 8; a token's time is a sequence's mean gap between
consecutive tokens (``token_times``, first to last), the median over the sequences and
rounds. Rounds alternate between the engines so a slow period of the machine hits both. ``--device cpu`` runs the
same rows on the CPU (the plan instead of graphs): the smoke test in
``tests/test_gpu_suite.py`` uses it.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics

import torch

from torch_topg.bench import Stopwatch, wall_clock
from torch_topg.engine import Engine
from torch_topg.models import build_model

GREEDY = {"temperature": 0, "ignore_eos": True}


def token_ms(outputs) -> list[float]:  # type: ignore[no-untyped-def]
    """Each sequence's mean gap between consecutive tokens, ms."""
    gaps = []
    for o in outputs:
        tt = o.outputs[0].token_times
        gaps.append((tt[-1] - tt[0]) / (len(tt) - 1) * 1e3)
    return gaps


def hf_ms(model, prompt: list[int], tokens: int, device: str) -> float:  # type: ignore[no-untyped-def]
    """transformers ``generate`` (DynamicCache), ms per new token, prompt excluded."""
    ids = torch.tensor([prompt], device=device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)

    sw = Stopwatch(clock=wall_clock(device))

    def run(n: int) -> float:
        with sw.lap(), torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        return sw.last

    run(2)
    return (run(tokens + 1) - run(1)) / tokens * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--md", default="")
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", default="llama-150m")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    if a.quick:
        a.tokens, a.rounds = min(a.tokens, 24), 1
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    rng = random.Random(0)
    model = build_model(a.preset, dtype=torch.float32)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(a.context)] for _ in range(8)]
    # transformers first: the engines switch the model's attention to their paged one
    hf = hf_ms(model.to(a.device, dtype), prompts[0], a.tokens, a.device)
    names = {"on": True, "off": False}  # decode_plan
    engines = {  # a model each: an engine rewrites the model it is given
        n: Engine.from_model(copy.deepcopy(model), device=a.device, dtype=dtype, decode_plan=on,
                             max_batch_size=8, max_model_len=a.context + a.tokens + 16)
        for n, on in names.items()
    }  # fmt: skip
    ms: dict[tuple[str, int], list[float]] = {}
    try:
        for eng in engines.values():  # warm-up: compiles, and captures buckets 1 and 8
            for b in (1, 8):
                eng.generate(prompts[:b], max_new_tokens=4, **GREEDY)
        for _ in range(a.rounds):
            for b in (1, 8):
                for n, eng in engines.items():
                    outs = eng.generate(prompts[:b], max_new_tokens=a.tokens, **GREEDY)
                    ms.setdefault((n, b), []).extend(token_ms(outs))
        kinds = {n: e.stats()["decode_plan"] for n, e in engines.items()}
    finally:
        for eng in engines.values():
            eng.shutdown()
    med = {k: statistics.median(v) for k, v in ms.items()}
    plan = ", ".join(f"{n}: {k['kind'] if k['active'] else k['reason']}" for n, k in kinds.items())
    lines = [
        f"Engine decode, {a.preset} (random weights, {str(dtype).split('.')[-1]}), "
        f"{a.device}, context {a.context}, {a.tokens} tokens, {a.rounds} rounds; "
        f"decode_plan: {plan}",
        "",
        "| batch | decode_plan on, ms/token | off | on / off | transformers generate, ms/token |",
        "|---|---|---|---|---|",
    ]
    for b in (1, 8):
        g, ng = med[("on", b)], med[("off", b)]
        lines.append(f"| {b} | {g:.3f} | {ng:.3f} | {g / ng:.2f} | {hf:.3f} (batch 1) |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
