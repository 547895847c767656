"""Where a decode step's time goes, per phase of the one-call decode step, on one
GGUF file: the plan's own timers (``TOPG_PROFILE=1``), and each phase's weight bytes (from
the file's tensors) over its time, so a phase that streams below the read limit stands
out as compute-bound. The engine as ``real_size.py`` runs it (int8 activations, 2
threads); each round decodes 64 tokens after a random prompt (``--prompt-len``, 256), for
``--batch`` sequences at once (default 1; the first sequence's token times then include the
others' prefills, while the phases are the plan's decode steps alone).

    python python/benchmarks/decode_phases.py FILE.gguf [--rounds 2] [--fp32-activations]
        [--batch 16 --prompt-len 32] [--dtype bfloat16]

docs/real-size-cpus.md ("Figures on a Zen 3") has a run.
"""

from __future__ import annotations

import argparse
import os
import random

os.environ["TOPG_PROFILE"] = "1"  # the plan reads it when it is built

import torch

from torch_topg.compile.decode_plan import PHASES, profile

# Each phase's weights (the plan's phase names, in its order): tensor-name prefixes after
# ``blk.N.`` (or whole names). Attention and the MoE experts read no dense weight here.
_QKV, _ATTENTION, _O_PROJ, _GATE_UP, _EXPERTS, _DOWN, _LM_HEAD = PHASES
PHASE_TENSORS = {
    _QKV: ("attn_q.", "attn_k.", "attn_v."),
    _O_PROJ: ("attn_output.",),
    _GATE_UP: ("ffn_gate.", "ffn_up."),
    _DOWN: ("ffn_down.",),
    _LM_HEAD: ("output.weight",),
}


def phase_weights(path: str) -> dict[str, tuple[int, set[str]]]:
    """Per phase: the bytes and the formats of its weight tensors in the file."""
    from torch_topg.quant.gguf_arch import read_file

    _, tensors = read_file(path)
    out: dict[str, tuple[int, set[str]]] = {k: (0, set()) for k in PHASE_TENSORS}

    def add(phase: str, t) -> None:
        n, f = out[phase]
        out[phase] = (n + t.data.nbytes, f | {t.tensor_type.name})

    names = {t.name for t in tensors}
    for t in tensors:
        short = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
        for phase, prefixes in PHASE_TENSORS.items():
            if t.name.endswith("weight") and any(short.startswith(p) for p in prefixes):
                add(phase, t)
        if t.name == "token_embd.weight" and "output.weight" not in names:  # tied LM head
            add(_LM_HEAD, t)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fp32-activations", action="store_true")
    p.add_argument(
        "--batch", type=int, default=1, help="sequences decoded together (a step's rows)"
    )
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument(
        "--dtype", default="float32", help="the engine's dtype (bfloat16 for a BF16 file's weights)"
    )
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    from torch_topg.engine import Engine

    weights = phase_weights(a.file)
    q = {"method": "gguf", "int8_activations": not a.fp32_activations}
    eng = Engine.from_pretrained(a.file, quantization=q, dtype=getattr(torch, a.dtype),
                                 max_batch_size=a.batch, max_model_len=1024,
                                 prefix_caching=False)  # fmt: skip
    try:
        eng.wait_warm()
        rng = random.Random(0)
        ids = lambda n: [rng.randrange(10, 40000) for _ in range(n)]  # noqa: E731
        kw = dict(temperature=0, ignore_eos=True)
        warm = [ids(a.prompt_len) for _ in range(a.batch)]
        eng.generate(warm, max_new_tokens=8, **kw)  # warm-up
        plan = eng.runner.plan
        for r in range(a.rounds):
            plan.reset_profile()
            prompts = [ids(a.prompt_len) for _ in range(a.batch)]
            tt = eng.generate(prompts, max_new_tokens=64, **kw)[0].outputs[0].token_times
            prof = profile(plan)
            steps = prof["steps"]
            ms = {k: s / steps * 1e3 for k, s in prof["seconds"].items()}
            # the first sequence's times: with batch > 1 the others' prefills too
            token_ms = (tt[-1] - tt[0]) / (len(tt) - 1) * 1e3
            print(f"\nround {r + 1} ({plan.last_members()} team members): decode "
                  f"{token_ms:.1f} ms a step of {a.batch}, the plan's phases "
                  f"{sum(ms.values()):.1f} ms a step ({steps} steps)\n")  # fmt: skip
            print("| phase | formats | MB | ms a step | GB/s |\n|---|---|---|---|---|")
            for k, t in ms.items():
                n, fmts = weights.get(k, (0, set()))
                if n and t:
                    print(f"| {k} | {', '.join(sorted(fmts))} | {n / 1e6:.1f} | {t:.2f} | "
                          f"{n / t / 1e6:.1f} |")  # fmt: skip
                elif t:  # attention, and phases of other models (MoE experts)
                    print(f"| {k} | | | {t:.2f} | |")
    finally:
        eng.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
