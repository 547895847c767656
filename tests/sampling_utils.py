"""Shared by the sampling tests: inputs, and the target distributions computed
independently (numpy, float64) from the rules torch_topg.engine.sampling documents (vLLM's
order: penalties, temperature, min-p, top-k, top-p)."""

from __future__ import annotations

import math

import numpy as np
import torch

from torch_topg.engine.sampling import SamplingParams


def logits_for(B: int, V: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * scale


def keys_for(B: int, seed: int = 1234, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((B,), seed, dtype=torch.int64), torch.arange(start, start + B)


# --------------------------------------------------------------------------- reference


def ref_penalised(
    logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int]
) -> np.ndarray:
    """vLLM's penalties, one row, written out plainly."""
    x = logits.astype(np.float64).copy()
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        c = output.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def ref_processed(
    logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int], banned: list[int]
) -> np.ndarray:
    """The penalties, then ``logit_bias`` added, then the banned ids at -inf; one row."""
    x = ref_penalised(logits, p, prompt, output)
    for t, b in (p.logit_bias or {}).items():
        if t < len(x):
            x[t] += b
    for t in banned:
        if 0 <= t < len(x):
            x[t] = -np.inf
    return x


def ref_probs(x: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, float]:
    """The final distribution of one (penalised) row, and the smallest relative margin of
    any keep/drop decision (to skip cases that rounding could decide either way)."""
    V = x.shape[0]
    if p.greedy:
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1.0
        return out, math.inf
    z = x / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    keep = np.ones(V, dtype=bool)
    margin = math.inf
    if p.min_p > 0:
        thr = p.min_p * probs.max()
        keep &= probs >= thr
        margin = min(margin, np.min(np.abs(probs - thr)) / probs.max())
    if 0 < p.top_k < V:
        masked = np.where(keep, z, -np.inf)
        kth = np.sort(masked)[::-1][p.top_k - 1]
        keep &= masked >= kth
    if p.top_p < 1:
        q = np.where(keep, probs, 0.0)
        q /= q.sum()
        order = np.argsort(-np.where(keep, z, -np.inf), kind="stable")
        before = np.cumsum(q[order]) - q[order]
        n_keep = max(int(np.sum(before < p.top_p)), 1)
        cut = z[order[n_keep - 1]]
        keep &= z >= cut
        live = before[q[order] > 0]
        margin = min(margin, float(np.min(np.abs(live - p.top_p))))
    out = np.where(keep, probs, 0.0)
    return out / out.sum(), margin


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs`` (support only)."""
    n = counts.sum()
    sup = probs > 0
    assert counts[~sup].sum() == 0, f"drew tokens outside the support: {counts}, {probs}"
    exp = n * probs[sup]
    assert exp.min() >= 5, "test set-up: an expected count below 5"
    stat = float(((counts[sup] - exp) ** 2 / exp).sum())
    df = int(sup.sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


#: one row of each kind: plain, truncated, greedy, penalised, with logprobs
MIXED = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02),
    SamplingParams(
        temperature=0.8, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2
    ),
    SamplingParams(temperature=1.1, logprobs=3, top_p=0.95),
]
