"""Embeddings: pooled final hidden states of the engine's model, no KV kept.

:func:`embed` runs the model's decoder (``get_decoder()``: the layers and the final norm,
without the LM head) on prompts packed side by side as one row, as a step packs them,
with the attention taking the ragged causal path of ``topg::attention`` instead of the
paged cache (``topg_dense_cu_seqlens`` in :mod:`torch_topg.engine.attention`): nothing is
written to the KV cache and no block is taken from the pool.

Pooling (per prompt, over its final hidden states ``[L, H]``):

- ``"last"`` (the default): the last token's state, the convention of decoder-only
  embedding models (Qwen3-Embedding, E5-Mistral, gte-Qwen): under causal attention
  only the last position has seen the whole input;
- ``"mean"``: the mean over the prompt's positions.

With ``normalize`` (the default) each vector is L2-normalised, so a dot product is the
cosine similarity.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

POOLINGS = ("last", "mean")


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The model without its LM head (transformers' ``get_decoder()`` / ``base_model``)."""
    get = getattr(model, "get_decoder", None)
    dec = get() if callable(get) else None
    return dec if dec is not None else model.base_model


def batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Prompt indices grouped in order, each group at most ``max_tokens`` tokens (a
    longer prompt alone)."""
    out: list[list[int]] = []
    used = max_tokens
    for i, n in enumerate(lengths):
        if used + n > max_tokens:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


@torch.inference_mode()
def embed(
    model: torch.nn.Module,
    ids_list: list[list[int]],
    *,
    pooling: str = "last",
    normalize: bool = True,
    max_batch_tokens: int = 8192,
) -> torch.Tensor:
    """float32 ``[len(ids_list), hidden]`` on the CPU: one pooled vector per prompt."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    decoder = decoder_of(model)
    device = next(model.parameters()).device
    out: list[torch.Tensor] = []
    for group in batches([len(x) for x in ids_list], max_batch_tokens):
        seqs = [ids_list[i] for i in group]
        cu = [0]
        for s in seqs:
            cu.append(cu[-1] + len(s))
        ids = torch.tensor([[t for s in seqs for t in s]], device=device)
        pos = torch.tensor([[p for s in seqs for p in range(len(s))]], device=device)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
        res: Any = decoder(input_ids=ids, position_ids=pos, use_cache=False,
                           topg_dense_cu_seqlens=cu_t, topg_max_seqlen=max(map(len, seqs)))  # fmt: skip
        hidden = res.last_hidden_state[0].float()  # [T, H]
        for a, b in itertools.pairwise(cu):
            out.append(hidden[b - 1] if pooling == "last" else hidden[a:b].mean(0))
    vecs = torch.stack(out)
    if normalize:
        vecs = torch.nn.functional.normalize(vecs, dim=-1)
    return vecs.cpu()
