"""Prompt logprobs: the log-probability of each prompt token given the tokens before it.

A step normally runs the LM head on the rows it samples only (``logits_to_keep``). A
request with ``prompt_logprobs=k`` asks, on each step that computes part of its prompt,
for the logits of *every* position of that chunk: position ``p``'s row scores prompt
token ``p + 1`` (and gives the top-``k`` alternatives); the chunk's last row is still
the one sampled when the chunk reaches the prompt's end. Other requests in the batch
keep one row each, so they pay nothing.

Prefix caching: a request that still needs prompt logprobs does not take the cached
prefix's blocks (the scheduler skips its prefix match); it computes its whole prompt,
and its blocks are offered to the cache as usual. After a preemption that drops the KV,
the recomputed positions already recorded are not recorded again.

Only the request's first sample (``seqs[0]``) computes them: the other samples of
``n > 1`` fork from its prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torch_topg.engine.outputs import TokenLogprob

if TYPE_CHECKING:
    from torch_topg.engine.scheduler import ScheduledSeq
    from torch_topg.engine.sequence import Sequence


def wants_prompt_rows(seq: Sequence) -> bool:
    """Whether ``seq`` still has prompt positions whose logprobs are not recorded."""
    return seq.wants_prompt_rows


def _chunk_rows(s: ScheduledSeq) -> bool:
    """Whether this step computes every position's logits for ``s`` (prompt logprobs)."""
    seq = s.seq
    return s.num_spec == 0 and wants_prompt_rows(seq) and seq.num_computed < seq.prompt_len


def rows_asked(s: ScheduledSeq) -> int:
    """Logits rows the step computes for ``s``: every position of the chunk while its
    prompt logprobs are wanted, else the sampled rows (``1 + num_spec`` or 0)."""
    return s.num_new if _chunk_rows(s) else (1 + s.num_spec) * s.samples


def split_rows(s: ScheduledSeq, rows: torch.Tensor | None) -> torch.Tensor | None:
    """Record the prompt logprobs in ``rows`` (when :func:`rows_asked` gave the chunk's
    rows; call before the step's tokens count as computed) and return the row the step
    samples (None when it samples none)."""
    if rows is None or not _chunk_rows(s):
        return rows
    block = rows.view(-1, rows.shape[-1])  # [num_new, V]
    record(s.seq, s.seq.num_computed, block)
    return block[-1] if s.samples else None


def record(seq: Sequence, start: int, rows: torch.Tensor) -> None:
    """Append the logprobs of prompt tokens ``start + 1 ...`` scored by ``rows`` (the
    logits of positions ``start ...``), skipping positions already recorded."""
    req = seq.request
    got = req.prompt_logprobs
    assert got is not None
    k = req.params.prompt_logprobs or 0
    first = len(got) - 1 - start  # first row whose target is not recorded yet
    last = min(rows.shape[0], seq.prompt_len - 1 - start)  # rows that score prompt tokens
    if first >= last:
        return
    lp = torch.log_softmax(rows[first:last].float(), dim=-1)  # [m, V]
    targets = torch.tensor(
        seq.request.prompt_token_ids[start + first + 1 : start + last + 1], device=lp.device
    )
    chosen = lp.gather(1, targets[:, None])[:, 0]  # [m]
    ranks = (lp > chosen[:, None]).sum(-1) + 1
    top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
    for j, (tok, v, r) in enumerate(
        zip(targets.tolist(), chosen.tolist(), ranks.tolist(), strict=True)
    ):
        top = {}
        if top_v is not None and top_i is not None:
            top = dict(zip(top_i[j].tolist(), top_v[j].tolist(), strict=True))
        got.append(TokenLogprob(tok, v, top, rank=r))
