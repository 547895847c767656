"""The engine benchmark's settings, prompts and small helpers (engine.py and its
report and llama.cpp modules share them); the generic ones (memory, FLOPs) are in
torch_topg.bench."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

THREADS = 2
CONCURRENCY = 16
NEW_TOKENS = 128
MAX_MODEL_LEN = 1024  # the engine's context limit: sizes its KV pool (16 slots x 1024 tokens)
DECODE_CONTEXT = 256
DECODE_TOKENS = 64
TTFT_PROMPT = 512
HF_PAGE_SIZE = 256
HF_NUM_BLOCKS = 64  # 64 x 256 tokens: the same token capacity as the engine's pool

# 16 varied user questions; with SmolLM2's chat template (default system prompt) they
# render to 35-60 tokens.
QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about autumn leaves falling on a quiet lake.",
    "How do I reverse a list in Python?",
    "What are the main differences between a virus and a bacterium, and how does each "
    "one make people sick?",
    "Give me three tips for sleeping better.",
    "Why is the sky blue during the day but red at sunset?",
    "Summarize the plot of Romeo and Juliet for a ten-year-old.",
    "What is 17 times 23? Show your steps.",
    "Suggest a name for a small bakery that sells sourdough bread and cinnamon rolls in "
    "a seaside town.",
    "How does a refrigerator keep food cold?",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "What should I pack for a three-day hiking trip in the mountains in early spring, "
    "when nights are still cold?",
    "Explain step by step how a bill becomes a law in the United States, including "
    "what happens after a veto.",
    "Is it better to rent or buy a home? List pros and cons of each.",
    "Write a short, friendly email asking my neighbour to return the ladder I lent him last month.",
]
DTYPES = ("fp32", "bf16")


# --- shared helpers -------------------------------------------------------------------
def chats() -> list[list[dict]]:
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


def prompt_ids(tokenizer) -> list[list[int]]:
    """The token ids every system gets: the chat template rendered, then encoded (as the
    engine does for chat messages)."""
    out = []
    for m in chats():
        text = tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _setup_torch():
    import torch

    torch.set_num_threads(THREADS)
    return torch


def med(xs: list[float]) -> dict:
    """Repeated measurements summarised by ``torch_topg.bench.summarize`` (median and
    spread: lo-hi), with min, max and the values (the tables print min-max)."""
    from torch_topg.bench import summarize

    return {**summarize(xs).to_dict(), "min": min(xs), "max": max(xs), "values": xs}


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of a distribution (e.g. TTFT p90), not a spread."""
    from torch_topg.bench import quantile

    return quantile(xs, q) if xs else float("nan")


def model_shape() -> dict:
    """Sizes from SmolLM2's config (for the FLOP count)."""
    from transformers import AutoConfig

    from torch_topg.bench.models import decoder_shape
    from torch_topg.models.hf import smollm2_folder

    return decoder_shape(AutoConfig.from_pretrained(smollm2_folder()))
