"""The requests of ``python -m torch_topg bench serve``: lists of chat ``messages``.

- ``chat``: a fixed list of varied short prompts (questions, instructions, code, maths),
  taken in turn.
- ``random``: seeded random word-like text of ``input_len`` words (roughly 1.5 tokens
  each with a BPE tokenizer), one user turn, nothing shared between requests.
- ``shared-prefix``: one long system prompt of ``prefix_len`` words shared by every
  request, then a varied user turn: what a prefix cache is for.

Everything is deterministic for a given seed, so two servers get the same requests.
"""

from __future__ import annotations

import random

Messages = list[dict[str, str]]

DATASETS = ("chat", "random", "shared-prefix")

CHAT_PROMPTS = (
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a cat watching the rain.",
    "Give me three tips for writing clear technical documentation.",
    "What is the difference between a list and a tuple in Python?",
    "Translate 'Good morning, how are you?' into Spanish and German.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "What are the main causes of inflation?",
    "How do I reverse a linked list? Explain step by step.",
    "Suggest a name for a bakery that specialises in sourdough bread.",
    "What is 17 times 23? Show your working.",
    "Describe the water cycle to a ten-year-old.",
    "List five healthy breakfast ideas.",
    "Why do we have leap years?",
    "Write a short, polite email declining a meeting invitation.",
    "What does a compiler do, in simple terms?",
    "Compare cats and dogs as pets in a few bullet points.",
    "How does a hash table work?",
    "Write a limerick about a programmer who never sleeps.",
    "What is photosynthesis?",
    "Give me a packing list for a weekend hiking trip.",
    "Explain what a prime number is and list the first ten.",
    "What are some good habits for learning a new language?",
)

USER_TURNS = (
    "Summarize the document above in one paragraph.",
    "List the three most important points of the document.",
    "What questions does the document leave open?",
    "Rewrite the first part of the document for a child.",
    "Which part of the document is the least clear, and why?",
    "Give the document a short title.",
    "What would a critic say about the document?",
    "Turn the document into five bullet points.",
)

_SYLLABLES = (
    "ka", "lo", "mi", "ten", "ra", "su", "vel", "po", "dri", "an", "es", "tor", "mun", "qi",
    "bel", "zo", "nar", "fi", "gu", "hes", "ol", "pre", "sta", "wen", "yu", "xi", "cor", "da",
)  # fmt: skip


def random_text(rng: random.Random, words: int) -> str:
    """``words`` word-like tokens of 1-3 syllables, with a full stop every ~12 words."""
    out = []
    for i in range(words):
        w = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
        out.append(w + ("." if i % 12 == 11 else ""))
    return " ".join(out)


def make_requests(
    name: str,
    n: int,
    *,
    seed: int = 0,
    input_len: int = 128,
    prefix_len: int = 512,
) -> list[Messages]:
    """``n`` chat requests of dataset ``name`` (one of ``DATASETS``)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}: one of {', '.join(DATASETS)}")
    if n < 0 or input_len < 1 or prefix_len < 1:
        raise ValueError("n >= 0, input_len >= 1 and prefix_len >= 1")
    rng = random.Random(seed)
    if name == "chat":
        return [
            [{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}] for i in range(n)
        ]
    if name == "random":
        return [[{"role": "user", "content": random_text(rng, input_len)}] for _ in range(n)]
    system = "You are a careful assistant. Read this document:\n" + random_text(rng, prefix_len)
    return [
        [
            {"role": "system", "content": system},
            {"role": "user", "content": f"({i}) {USER_TURNS[i % len(USER_TURNS)]}"},
        ]
        for i in range(n)
    ]
