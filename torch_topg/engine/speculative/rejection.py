"""Verification: which proposed tokens a step accepts, and the token that follows them.

A sequence with ``n`` proposals ``d_0 .. d_{n-1}`` for positions ``P .. P+n-1`` gets
``n + 1`` target rows from one model step: row ``i`` is the target's distribution
``p_i`` at position ``P + i`` given the committed tokens and ``d_0 .. d_{i-1}``. The step
emits the accepted prefix and one more token (the resample at the first rejection, or
the bonus token after the last row), so 1 to ``n + 1`` tokens.

Two forms, both exact (the emitted tokens follow the target's distribution):

:func:`accept_coupled` (what the engine runs). Each row is drawn by the engine's own
sampler with the key the non-speculative engine would use at that position, ``x_i``
(exponential race keyed by (seed, position), ``keyed.py``), and ``d_i`` is accepted iff
``x_i == d_i``; the first ``x_i`` that differs (or ``x_n``) is the next token. For a
proposal that is a fixed token (prompt lookup: q is one-hot) this *is* the rejection
rule: ``d`` is accepted with probability ``p(d) = min(1, p(d) / q(d))``, and given a
rejection ``x`` follows ``p`` without ``d``, renormalised: the residual ``max(0, p - q)``.
A draft model's proposal is drawn with the same key from the draft's distribution ``q``
(Gumbel-max coupling: "drafter-invariant" speculative decoding, Daliri et al. 2024), so
it is accepted when both races pick the same token. Either way every emitted token is
exactly the token the non-speculative engine samples at that position: a seeded
request's output does not depend on k, on which steps speculated, or on batch-mates;
greedy rows are the argmax comparison. The price for a sampled draft: the coupling
accepts with probability below the optimum ``sum(min(p, q))`` of the textbook rule.

:func:`rejection_sample` (the textbook rule, Leviathan et al. 2023 / Chen et al. 2023):
accept ``d_i`` if ``u_i < p_i(d_i) / q_i(d_i)``; at the first rejection draw from
``normalise(max(0, p_i - q_i))``; when all are accepted draw the bonus from ``p_n``.
``u_i`` is keyed by (seed, P + i, ``SALT_ACCEPT``), the residual draw by ``SALT_RESIDUAL``
and the bonus by ``SALT_SAMPLE``, so the result depends only on the keys and the
proposals. It accepts more often than the coupling for a sampled draft, but its tokens
differ from the non-speculative engine's (same distribution, other draws), so they
depend on where proposals were made. Tested beside the coupled form; not used by the
engine.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torch_topg.engine.keyed import (
    SALT_ACCEPT,
    SALT_RESIDUAL,
    SALT_SAMPLE,
    keyed_uniform,
    sample_from_probs,
)

SALT_DRAFT = 3  # a textbook draft's own proposal draws (the coupled draft uses SALT_SAMPLE)


def accept_coupled(target: Tensor, draft: Tensor, num_draft: Tensor) -> Tensor:
    """Accepted proposals per sequence: the leading ``i < num_draft`` with ``target == draft``.

    ``target``: int64 ``[S, K + 1]``, the sampler's draw at each verified position;
    ``draft``: int64 ``[S, K]`` (padding beyond ``num_draft`` is ignored); ``num_draft``:
    int64 ``[S]``. Returns int64 ``[S]`` ``a``; sequence ``s`` emits ``target[s, : a + 1]``.
    """
    S, K1 = target.shape
    if draft.shape != (S, K1 - 1) or num_draft.shape != (S,):
        raise ValueError(
            f"accept_coupled: target [S, K+1] = {tuple(target.shape)}, draft "
            f"{tuple(draft.shape)} and num_draft {tuple(num_draft.shape)} disagree"
        )
    if K1 == 1:
        return torch.zeros(S, dtype=torch.int64, device=target.device)
    cols = torch.arange(K1 - 1, device=target.device)
    ok = (target[:, :-1] == draft) & (cols < num_draft.unsqueeze(1))
    return ok.to(torch.int64).cumprod(1).sum(1)


def rejection_sample(
    target_probs: Tensor,
    draft_tokens: Tensor,
    num_draft: Tensor,
    seeds: Tensor,
    positions: Tensor,
    draft_probs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The textbook rule, batched over sequences (see the module docstring).

    ``target_probs``: fp32 ``[S, K + 1, V]`` (rows beyond ``num_draft + 1`` unused);
    ``draft_tokens``: int64 ``[S, K]``; ``num_draft``: int64 ``[S]``; ``seeds``,
    ``positions``: int64 ``[S]`` (``positions``: the index of the first verified token);
    ``draft_probs``: fp32 ``[S, K, V]``, or None for fixed proposals (q one-hot).
    Returns ``(tokens [S, K + 1], accepted [S])``: sequence ``s`` emits
    ``tokens[s, : accepted[s] + 1]`` (the rest is -1).
    """
    S, K1, V = target_probs.shape
    K = K1 - 1
    dev = target_probs.device
    p = target_probs.float()
    if draft_tokens.shape != (S, K) or num_draft.shape != (S,):
        raise ValueError(
            f"rejection_sample: target_probs [S, K+1, V] = {tuple(p.shape)}, draft_tokens "
            f"{tuple(draft_tokens.shape)} and num_draft {tuple(num_draft.shape)} disagree"
        )
    if draft_probs is not None and draft_probs.shape != (S, K, V):
        raise ValueError(
            f"rejection_sample: draft_probs must be [S, K, V] = {(S, K, V)}, got "
            f"{tuple(draft_probs.shape)}"
        )
    d = draft_tokens.clamp(0, V - 1)
    rows = torch.arange(K1, device=dev)
    pos = positions.unsqueeze(1) + rows  # [S, K+1]
    seed_rows = seeds.unsqueeze(1).expand(S, K1)
    bonus = sample_from_probs(
        p.reshape(S * K1, V), seed_rows.reshape(-1), pos.reshape(-1), SALT_SAMPLE
    ).view(S, K1)
    if K == 0:
        return bonus, torch.zeros(S, dtype=torch.int64, device=dev)
    p_d = p[:, :K].gather(2, d.unsqueeze(2)).squeeze(2)  # [S, K]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
        q = torch.zeros_like(p[:, :K]).scatter_(2, d.unsqueeze(2), 1.0)
    else:
        q = draft_probs.float()
        q_d = q.gather(2, d.unsqueeze(2)).squeeze(2)
    u = keyed_uniform(seed_rows[:, :K].reshape(-1), pos[:, :K].reshape(-1), SALT_ACCEPT)
    accept = u.view(S, K) * q_d < p_d
    accept &= rows[:K] < num_draft.unsqueeze(1)
    a = accept.to(torch.int64).cumprod(1).sum(1)  # [S]
    residual = (p[:, :K] - q).clamp_(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q (no rejection possible): use p
    residual = torch.where(empty, p[:, :K], residual)
    resampled = sample_from_probs(
        residual.reshape(S * K, V),
        seed_rows[:, :K].reshape(-1),
        pos[:, :K].reshape(-1),
        SALT_RESIDUAL,
    ).view(S, K)
    # the token after the accepted prefix: the resample at a < n, the bonus at a == n
    nxt = torch.where(
        a < num_draft,
        resampled.gather(1, a.clamp(max=K - 1).unsqueeze(1)).squeeze(1),
        bonus.gather(1, a.unsqueeze(1)).squeeze(1),
    )
    tokens = torch.full((S, K1), -1, dtype=torch.int64, device=dev)
    tokens[:, :K] = torch.where(rows[:K] < a.unsqueeze(1), draft_tokens, -1)
    tokens.scatter_(1, a.unsqueeze(1), nxt.unsqueeze(1))
    return tokens, a
