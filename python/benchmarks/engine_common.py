"""The engine benchmark's settings, prompts and small helpers (engine.py and its
report and llama.cpp modules share them)."""

from __future__ import annotations

import os
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


def _status_mb(field: str, pid: int | str = "self") -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rss_mb(pid: int | str = "self") -> float | None:
    return _status_mb("VmRSS", pid)


def peak_rss_mb(pid: int | str = "self") -> float | None:
    return _status_mb("VmHWM", pid)


def resident_mb(tensors) -> float | None:
    """Bytes of ``tensors``' memory that is resident (mincore), in MB: how much of the
    engine's KV pool (torch.empty, committed as blocks are first written) is in RSS."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
        total = 0
        for t in tensors:
            start = t.data_ptr() // page * page
            end = t.data_ptr() + t.numel() * t.element_size()
            n = -(-(end - start) // page)
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
                return None
            total += sum(v & 1 for v in vec) * page
        return total / 2**20
    except (OSError, AttributeError):
        return None


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

    from torch_topg.models.hf import smollm2_folder

    c = AutoConfig.from_pretrained(smollm2_folder())
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    h, i, kv, q = c.hidden_size, c.intermediate_size, c.num_key_value_heads, c.num_attention_heads
    per_layer = h * q * hd + 2 * h * kv * hd + q * hd * h + 3 * h * i + 2 * h  # attn, mlp, norms
    non_emb = c.num_hidden_layers * per_layer + h  # + final norm; tied LM head not counted
    return {
        "layers": c.num_hidden_layers,
        "hidden": h,
        "heads": q,
        "kv_heads": kv,
        "head_dim": hd,
        "vocab": c.vocab_size,
        "params_non_embedding": non_emb,
        "params_embedding": c.vocab_size * h,
        "tied": bool(getattr(c, "tie_word_embeddings", False)),
    }


def round_flops(shape: dict, prompt_lens: list[int], new_tokens: int) -> float:
    """FLOPs of one round: per request, every prompt token and every generated token but
    the last passes the model once (T = P + G - 1 positions):
    2 * N_non_emb * T + 4 * L * H_q * d_head * sum_{t=1..T} t (QK^T and PV, causal)."""
    n, attn = (
        shape["params_non_embedding"],
        4 * shape["layers"] * shape["heads"] * shape["head_dim"],
    )
    total = 0.0
    for p in prompt_lens:
        t = p + new_tokens - 1
        total += 2 * n * t + attn * t * (t + 1) / 2
    return total
