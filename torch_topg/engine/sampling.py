"""Sampling for the engine: per-request parameters, applied to a packed batch on the device.

:class:`SamplingParams` (``sampling_params.py``) carries vLLM's names and meanings. :class:`Sampler` turns one step's
logits ``[B, V]`` into tokens, each row with its own parameters, in vLLM's order:

1. penalties on the fp32 logits: repetition on prompt + output tokens (a positive logit is
   divided by the penalty, a negative one multiplied), then frequency (times the count) and
   presence (once) subtracted for output tokens; then ``logit_bias`` added, and the ids of
   ``banned`` (the engine's EOS and stop ids of a row short of ``min_tokens``) set to -inf;
2. greedy rows (``temperature < 1e-5``) take the argmax here (ties: the lowest id);
3. temperature (logits / T);
4. min-p: tokens with ``prob < min_p * max_prob`` dropped;
5. top-k: tokens below the k-th largest logit dropped (ties with it kept);
6. top-p on the renormalised survivors: in descending order a token is kept while the mass
   *before* it is below ``top_p`` (the top token always survives; ties with the last survivor
   are all kept, where vLLM keeps an arbitrary subset depending on its sort).

Keyed randomness. A row's random numbers are a hash of (request seed, position of the token
being sampled, salt, vocabulary id): splitmix64 mixes the first three into a 64-bit row key
(vectorised int64 ops), a 32-bit lowbias32 mix of (row key, id) gives each token a uniform.
Nothing depends on batch-mates, batch order, device or a generator's state, so a seeded
request reproduces under any load, after a preemption and on CPU or CUDA alike.

Gumbel-max (the exponential race). With ``u_v`` iid uniform, ``E_v = -log u_v`` is iid Exp(1)
and ``G_v = -log E_v`` iid standard Gumbel. The token is ``argmax_v(l_v + G_v)`` over the final
logits ``l`` (dropped tokens at -inf), the same as ``argmax_v(p_v / E_v)``: ``E_v / p_v`` is
exponential with rate ``p_v``, the arrival time of token ``v``, and the first of independent
exponential arrivals is ``v`` with probability ``p_v / sum(p)`` (P(E_v/p_v < all others) =
integral of p_v exp(-p_v t) prod_w exp(-p_w t) dt = p_v / sum(p)). So the draw follows
``softmax(l)`` exactly, with no normalisation, cumulative sum or sort, and with the noise of
a token keyed by its id, the draw is the same whether a row is raced over the whole
vocabulary or over a candidate set. The only approximation is the noise's resolution
(31-bit uniforms rounded to float32), well below the float32 rounding of the logits.

Cost. Random rows are raced over the whole vocabulary only when they truncate nothing;
truncating rows are raced over a small candidate set: every token at or above a per-row
lower bound of the survivors (the min-p bound; the k-th largest logit from ``topk``; for
top-p, tokens with ``prob < (1 - top_p) / V`` together hold less than ``1 - top_p``, so
top-p never reaches them), packed with ``nonzero`` and sorted only there. Every tie is a
candidate. CPU scratch buffers are reused between steps (fresh multi-MB temporaries
page-fault under glibc: that was half the time). Measured on this project's 2-core CPU VM
(torch 2.13 CPU build, one thread, thread CPU time, best of 30 x 10 calls, other jobs
running), a batch of 16 rows x 49152 vocabulary of real SmolLM2-135M logits, fp32:

    all greedy (the fast path: one argmax; bf16 logits 0.74 ms) ........... 0.67 ms
    temperature 0.7, top_k 50 ............................................. 1.6 ms
    temperature 1.0, min_p 0.05 ........................................... 1.5 ms
    temperature 0.7, top_k 50, top_p 0.95 ................................. 2.4 ms
    temperature 0.7, top_p 0.9 (~15-800 candidates per row) .............. 3.2 ms
    temperature 1.0, nothing truncated (a race over all 49152) ............ 4.0 ms
    top_p 0.9 + repetition/presence/frequency (250 tokens per row) ........ 4.8 ms
    top_p 0.9 + logprobs=5 on every row ................................... 5.1 ms

A single argmax over the batch costs 0.65 ms on that machine, so the sampler adds about
1-3 ms to it; the full-vocabulary race is two transcendental passes (log1p, log) and a
32-bit integer hash over ``B x V``. On CUDA each step is a few dozen small batched kernels;
a truncating group syncs with the host for its candidate count (``nonzero``) and the top-k
tie check; the greedy fast path never does.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from torch_topg.engine.keyed import (
    SALT_ACCEPT,
    SALT_RESIDUAL,
    SALT_SAMPLE,
    _ids_mix,
    _key32,
    _race_scores,
    _Scratch,
    keyed_gumbel,
    keyed_uniform,
    sample_from_probs,
    seed_tensor,
)
from torch_topg.engine.sampling_params import GREEDY_EPS, MAX_LOGPROBS, SamplingParams
from torch_topg.engine.structured import apply_bitmask

__all__ = [
    "GREEDY_EPS",
    "MAX_LOGPROBS",
    "SALT_ACCEPT",
    "SALT_RESIDUAL",
    "SALT_SAMPLE",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "keyed_gumbel",
    "keyed_uniform",
    "sample_from_probs",
    "seed_tensor",
]

# Salts keep independent uses of one (seed, position) apart (defined in keyed.py). The
# sampler races with SALT_SAMPLE; a speculative verifier can draw its acceptance uniform
# with SALT_ACCEPT and race the residual distribution with SALT_RESIDUAL.


# --------------------------------------------------------------------------- the sampler


@dataclass
class SamplerOutput:
    """One step's draws.

    ``tokens``: int64 ``[B]``. ``logprobs``: fp32 ``[B]``, the sampled token's log-probability
    under the raw logits (NaN on rows that did not ask); None when no row asked.
    ``top_logprobs``: (values fp32 ``[B, K]``, ids int64 ``[B, K]``), ``K`` the largest
    ``logprobs`` asked; row ``i``'s first ``params[i].logprobs`` columns are its
    alternatives in descending order, the rest padding (-inf, id -1).
    """

    tokens: Tensor
    logprobs: Tensor | None = None
    top_logprobs: tuple[Tensor, Tensor] | None = None


TokenLists = Sequence[Sequence[int] | Tensor]


class _Rows:
    """Per-row parameter tensors ``[R, 1]`` for the random (non-greedy) rows."""

    def __init__(self, params: Sequence[SamplingParams], vocab: int, device: torch.device):
        self.top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        self.any_top_k = any(self.top_k)
        self.any_top_p = any(p.top_p < 1.0 for p in params)
        self.any_min_p = any(p.min_p > 0.0 for p in params)
        self.truncated = self.any_top_k or self.any_top_p or self.any_min_p
        self.scaled = any(p.temperature != 1.0 for p in params)
        f = torch.tensor(
            [[p.temperature, p.top_p, p.min_p] for p in params], dtype=torch.float32
        ).to(device, non_blocking=True)
        self.temperature, self.top_p, self.min_p = (c.unsqueeze(1) for c in f.unbind(1))
        self.k = torch.tensor(self.top_k, dtype=torch.int64).to(device).unsqueeze(1)


class Sampler:
    """Batched sampling with per-row :class:`SamplingParams` and keyed randomness.

    Any batch, any mix of parameters. It keeps a per-(vocabulary, device) id cache and CPU
    scratch buffers reused from call to call: one instance per thread.
    ``logits``: ``[B, V]`` in any float dtype (the maths is fp32; the input is never
    modified). ``seeds``, ``positions``: int64 ``[B]`` (:func:`seed_tensor`); a position is
    the index in the sequence (prompt + output) of the token being sampled, i.e. the
    sequence's length before it. ``prompt_tokens`` / ``output_tokens``: ``B`` lists (or
    1-D int tensors) of ids, needed only for rows with penalties (repetition reads both,
    presence and frequency the output). Ids outside ``[0, V)`` are ignored.
    """

    def __init__(self) -> None:
        self._ids_cache: dict[tuple[int, torch.device], Tensor] = {}
        self._scratch = _Scratch()
        self.mask_s = 0.0  # the last call's time applying structured-output masks

    # -- public API ------------------------------------------------------------------

    def __call__(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        seeds: Tensor | Sequence[int],
        positions: Tensor | Sequence[int],
        prompt_tokens: TokenLists | None = None,
        output_tokens: TokenLists | None = None,
        banned: TokenLists | None = None,
        bitmask: tuple[Tensor, list[int]] | None = None,
    ) -> SamplerOutput:
        """Sample one token per row: ``logits [B, V]`` -> :class:`SamplerOutput`.
        ``banned``: per row, ids that must not be drawn (None: none). ``bitmask``:
        ``(words int32 [R, ceil(V / 32)], rows)``, the structured-output masks of ``R``
        rows (xgrammar's packing): their forbidden tokens are set to -inf first, before
        everything else (the logprobs are then those of the constrained rows)."""
        B, V = _check(logits, params)
        if bitmask is not None:
            t0 = time.perf_counter()
            logits = apply_bitmask(logits, *bitmask, self._scratch)
            self.mask_s = time.perf_counter() - t0  # read by the engine's figures
        dev = logits.device
        seeds = seed_tensor(seeds, dev)
        positions = seed_tensor(positions, dev)
        if seeds.shape != (B,) or positions.shape != (B,):
            raise ValueError(
                f"seeds and positions must be [B] = [{B}], got {tuple(seeds.shape)} "
                f"and {tuple(positions.shape)}"
            )
        greedy = [p.greedy for p in params]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if plain_greedy(params):
            return SamplerOutput(_argmax(logits))  # the fast path: no copy, no noise

        x = self._penalised(logits, params, prompt_tokens, output_tokens, banned)
        rand = [i for i in range(B) if not greedy[i]]
        if not rand:
            tokens = _argmax(x)
        else:
            tokens = torch.empty(B, dtype=torch.int64, device=dev)
            if len(rand) < B:
                g = [i for i in range(B) if greedy[i]]
                tokens[torch.tensor(g, device=dev)] = _argmax(_take(x, g, B))
            for group in _groups(params, rand, V):
                keys = _key32(_take(seeds, group, B), _take(positions, group, B), SALT_SAMPLE)
                vals, ids = self._final_logits(_take(x, group, B), [params[i] for i in group])
                if ids is None:  # the full vocabulary, in id order
                    scores = _race_scores(vals, keys, self._ids_mix(V, dev), self._scratch)
                    drawn = _argmax(scores)
                else:
                    j = _argmax(_race_scores(vals, keys, _ids_mix(ids), self._scratch))
                    drawn = ids.gather(1, j.unsqueeze(1)).squeeze(1)
                if len(group) == B:
                    tokens = drawn
                else:
                    tokens[torch.tensor(group, device=dev)] = drawn
        if not lp_rows:
            return SamplerOutput(tokens)
        return SamplerOutput(tokens, *self._logprobs(logits, params, lp_rows, tokens))

    def processed_probs(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        prompt_tokens: TokenLists | None = None,
        output_tokens: TokenLists | None = None,
        banned: TokenLists | None = None,
    ) -> Tensor:
        """The distribution each row samples from: fp32 ``[B, V]``, rows summing to 1.

        After penalties, temperature, min-p, top-k and top-p; a greedy row is the one-hot
        of its argmax. For a speculative verifier (with :meth:`uniform` and
        :func:`sample_from_probs`).
        """
        B, V = _check(logits, params)
        dev = logits.device
        x = self._penalised(logits, params, prompt_tokens, output_tokens, banned)
        out = torch.zeros(B, V, dtype=torch.float32, device=dev)
        greedy = [i for i in range(B) if params[i].greedy]
        if greedy:
            g = _argmax(_take(x, greedy, B))
            out[torch.tensor(greedy, device=dev), g] = 1.0
        rand = [i for i in range(B) if not params[i].greedy]
        for group in _groups(params, rand, V):
            vals, ids = self._final_logits(_take(x, group, B), [params[i] for i in group])
            p = vals.softmax(-1)
            if ids is not None:
                # scatter_add: padding entries (id 0, probability 0) add nothing
                p = torch.zeros(len(group), V, device=dev).scatter_add_(1, ids, p)
            out[torch.tensor(group, device=dev)] = p
        return out

    @staticmethod
    def uniform(
        seeds: Tensor | Sequence[int],
        positions: Tensor | Sequence[int],
        salt: int = SALT_ACCEPT,
    ) -> Tensor:
        """Keyed uniforms, float32 ``[B]`` in (0, 1): see :func:`keyed_uniform`."""
        dev = seeds.device if isinstance(seeds, Tensor) else None
        return keyed_uniform(seed_tensor(seeds, dev), seed_tensor(positions, dev), salt)

    # -- steps -----------------------------------------------------------------------

    def _ids_mix(self, V: int, device: torch.device) -> Tensor:
        key = (V, device)
        t = self._ids_cache.get(key)
        if t is None:
            t = self._ids_cache[key] = _ids_mix(torch.arange(V, device=device))
        return t

    def _penalised(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        prompt_tokens: TokenLists | None,
        output_tokens: TokenLists | None,
        banned: TokenLists | None = None,
    ) -> Tensor:
        """fp32 ``[B, V]`` logits with the penalties, the biases and the bans applied (the
        input is never written; a copy is made when anything changes).

        Sparse: only the (row, id) pairs of the rows' prompt / output tokens, biases and
        bans are read and written, so the cost follows their counts, not the vocabulary.
        """
        x = self._penalties(logits, params, prompt_tokens, output_tokens)
        rows, ids, vals = [], [], []
        for i, p in enumerate(params):
            for t, b in (p.logit_bias or {}).items():
                rows.append(i), ids.append(t), vals.append(float(b))
        banned = banned if banned is not None and any(banned) else None
        if not rows and banned is None:
            return x
        if x is logits:  # fp32 logits without penalties: never write the caller's tensor
            x = x.clone()
        dev = x.device
        if rows:
            idx = (torch.tensor(rows, device=dev), torch.tensor(ids, device=dev))
            x.index_put_(idx, torch.tensor(vals, dtype=torch.float32, device=dev), accumulate=True)
        if banned is not None:
            keys = _token_keys(banned, list(range(len(banned))), x.shape[1], dev)
            x.view(-1)[keys] = float("-inf")
        return x

    def _penalties(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        prompt_tokens: TokenLists | None,
        output_tokens: TokenLists | None,
    ) -> Tensor:
        """fp32 logits with the repetition, frequency and presence penalties of the rows
        (``logits`` itself when fp32 and nothing changes)."""
        x = logits.float()
        pen = [i for i, p in enumerate(params) if p.has_penalties]
        if not pen:
            return x
        B, V = x.shape
        dev = x.device
        if output_tokens is None or len(output_tokens) != B:
            raise ValueError("penalties need output_tokens: one list of ids per row")
        coef = torch.tensor(
            [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
            dtype=torch.float32,
        ).to(dev)
        rep, freq, pres = coef.unbind(1)
        # keys row * V + id: the output's with their counts, then every seen one
        out_keys, out_counts = _token_keys(output_tokens, pen, V, dev).unique(return_counts=True)
        keys = out_keys
        if any(params[i].repetition_penalty != 1.0 for i in pen):
            if prompt_tokens is None or len(prompt_tokens) != B:
                raise ValueError("repetition_penalty needs prompt_tokens: one list per row")
            keys = torch.cat([_token_keys(prompt_tokens, pen, V, dev), out_keys]).unique()
        if keys.numel() == 0:
            return x
        counts = torch.zeros(keys.shape, dtype=torch.float32, device=dev)
        if out_keys.numel():
            at = torch.searchsorted(out_keys, keys).clamp(max=out_keys.numel() - 1)
            counts = torch.where(out_keys[at] == keys, out_counts[at].float(), counts)
        r, c = keys // V, keys % V
        v = x[r, c]
        # repetition (1: exact no-op), then frequency and presence (0: exact no-ops)
        v = torch.where(v > 0, v / rep[r], v * rep[r])
        v = v - freq[r] * counts - pres[r] * (counts > 0)
        if x is logits:
            x = self._scratch("penalised", tuple(x.shape), torch.float32, dev).copy_(x)
        x[r, c] = v
        return x

    def _final_logits(
        self, x: Tensor, params: Sequence[SamplingParams]
    ) -> tuple[Tensor, Tensor | None]:
        """Temperature, min-p, top-k, top-p on random rows ``x [R, V]`` (fp32, penalised).

        ``params``: all truncating (top-k, top-p or min-p) or none (see :func:`_groups`).
        Returns ``(vals [R, V], None)`` in id order when none truncates, else
        ``(vals [R, C], ids [R, C])``: each row's candidates in descending order, a
        superset of its survivors; dropped tokens are at -inf.
        """
        R, V = x.shape
        dev, f32, b8, inf = x.device, torch.float32, torch.bool, float("inf")
        rows = _Rows(params, V, dev)
        if rows.scaled:
            x = torch.div(x, rows.temperature, out=self._scratch("scaled", (R, V), f32, dev))
        if not rows.truncated:
            return x, None
        neg_inf = torch.tensor(float("-inf"), device=x.device)
        # t0: a lower bound on each row's survivors. Never below the lowest finite float,
        # so -inf logits are never candidates.
        t0 = torch.full((R, 1), torch.finfo(torch.float32).min, device=x.device)
        if rows.any_min_p:
            # min-p relative to the max probability: log p_v < log(min_p) + log p_max.
            bound = x.amax(-1, keepdim=True) + rows.min_p.log()  # log(0) = -inf: off
            t0 = torch.maximum(t0, bound)
            if rows.any_top_p:  # top-p's mass is over the min-p survivors
                if not rows.scaled:  # x is still the caller's
                    x = self._scratch("scaled", (R, V), f32, dev).copy_(x)
                drop = torch.lt(x, bound, out=self._scratch("mask", (R, V), b8, dev))
                x.masked_fill_(drop, -inf)
        top = top_ids = None
        if rows.any_top_k:
            # The k-th largest, of the min-p survivors: when it is below the min-p bound,
            # t0 is the bound either way. One column more shows ties past the largest k.
            top, top_ids = x.topk(max(rows.top_k) + 1, dim=-1)
            kth = top.gather(1, (rows.k - 1).clamp(min=0))
            t0 = torch.maximum(t0, torch.where(rows.k > 0, kth, neg_inf))
        lse = None
        if rows.any_top_p:
            # log(sum(exp(x))) as max - log(max prob): a fused softmax is the cheapest pass.
            m = x.amax(-1, keepdim=True)
            probs = torch.softmax(x, -1, out=self._scratch("probs", (R, V), f32, dev))
            lse = m - probs.amax(-1, keepdim=True).log()
            # Tokens with prob < (1 - p) / V hold less than 1 - p together, so top-p never
            # reaches them (rows without top-k; top-k rows are bounded by their k-th value).
            bound = lse + torch.log((1 - rows.top_p) / V)  # p = 1: -inf
            t0 = torch.maximum(t0, torch.where(rows.k > 0, neg_inf, bound))
        # Candidates: every token >= t0 (so every tie), in descending order when top-p
        # needs the order.
        if top is not None and all(rows.top_k) and not bool((top[:, -1:] >= t0).any()):
            vals, ids = top[:, :-1], top_ids[:, :-1]  # sorted, and no ties past them
        else:
            keep = torch.ge(x, t0, out=self._scratch("mask", (R, V), b8, dev))
            r, c = keep.nonzero(as_tuple=True)  # row-major: each row's ids in order
            vals, ids = _compact(x, r, c)
            if rows.any_top_p:
                vals, order = vals.sort(-1, descending=True)
                ids = ids.gather(1, order)
        vals = torch.where(vals < t0, neg_inf, vals)  # min-p and top-k, exactly
        if rows.any_top_p:
            # Probabilities over the survivors so far: top-k rows hold all of them among
            # the candidates, the others are normalised over the whole row.
            norm = torch.where(rows.k > 0, vals.logsumexp(-1, keepdim=True), lse)
            q = (vals - norm).exp()
            before = q.cumsum(-1) - q  # the mass before each token
            n_keep = (before < rows.top_p).sum(-1, keepdim=True).clamp(min=1)
            cut = vals.gather(1, n_keep - 1)
            cut = torch.where(rows.top_p < 1, cut, neg_inf)
            vals = torch.where(vals < cut, neg_inf, vals)
        return vals, ids

    def _logprobs(
        self,
        logits: Tensor,
        params: Sequence[SamplingParams],
        rows: list[int],
        tokens: Tensor,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Raw-logit log-probabilities of the sampled tokens and the top alternatives."""
        B = logits.shape[0]
        dev = logits.device
        x = _take(logits, rows, B).float()
        # log_softmax(x)_v = x_v - lse, lse = max - log(max prob) from one fused softmax;
        # only the gathered entries are formed.
        probs = torch.softmax(x, -1, out=self._scratch("probs", tuple(x.shape), x.dtype, dev))
        lse = x.amax(-1, keepdim=True) - probs.amax(-1, keepdim=True).log()
        idx = torch.tensor(rows, device=dev)
        sampled = torch.full((B,), float("nan"), device=dev)
        sampled[idx] = (x.gather(1, tokens[idx].unsqueeze(1)) - lse).squeeze(1)
        ks = [params[i].logprobs for i in rows]
        K = max(ks)
        values = torch.full((B, K), float("-inf"), device=dev)
        ids = torch.full((B, K), -1, dtype=torch.int64, device=dev)
        if K > 0:
            tv, ti = x.topk(K, dim=-1)
            tv = tv - lse
            keep = torch.arange(K, device=dev) < torch.tensor(ks, device=dev).unsqueeze(1)
            values[idx] = torch.where(keep, tv, float("-inf"))
            ids[idx] = torch.where(keep, ti, -1)
        return sampled, (values, ids)


# --------------------------------------------------------------------------- helpers


def _check(logits: Tensor, params: Sequence[SamplingParams]) -> tuple[int, int]:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a float [B, V] tensor, got {tuple(logits.shape)} {logits.dtype}"
        )
    B, V = logits.shape
    if len(params) != B:
        raise ValueError(f"{len(params)} SamplingParams for {B} rows of logits")
    return B, V


def _groups(params: Sequence[SamplingParams], rows: list[int], vocab: int) -> list[list[int]]:
    """Split random rows into those without truncation (raced over the whole vocabulary)
    and those with top-k, top-p or min-p (raced over candidates); empty groups dropped."""
    cut = [
        i
        for i in rows
        if 0 < params[i].top_k < vocab or params[i].top_p < 1.0 or params[i].min_p > 0.0
    ]
    in_cut = set(cut)
    plain = [i for i in rows if i not in in_cut]
    return [g for g in (plain, cut) if g]


def _take(t: Tensor, rows: list[int], n: int) -> Tensor:
    """``t[rows]`` (a no-op when ``rows`` is every row in order)."""
    if len(rows) == n:
        return t
    return t.index_select(0, torch.tensor(rows, device=t.device))


def plain_greedy(params: Sequence[SamplingParams]) -> bool:
    """Whether every row is greedy without logprobs or penalties: the sampler's answer is
    then the bare row-wise argmax (no seeds, positions or token history needed)."""
    return all(p.greedy and p.logprobs is None and not p.has_processors for p in params)


def argmax_rows(x: Tensor) -> Tensor:
    """The sampler's greedy choice per row (:func:`plain_greedy` rows), int64 ``[R]``."""
    return _argmax(x)


def _argmax(x: Tensor) -> Tensor:
    """Row-wise argmax, int64 ``[R]``; ties go to the lowest index (as ``torch.argmax``)."""
    if x.device.type == "cpu":
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()  # exact, and 4x faster than a half-precision argmax on the CPU
        # max's indices: the same rule (the first maximal value; NaN counts as the
        # largest), 2.4x faster than argmax on the CPU (a SmolLM2 row of 49152 fp32: 26
        # against 62 us, 2 threads)
        return x.max(-1).indices
    return x.argmax(-1)


def _compact(x: Tensor, r: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """Pack entries ``x[r, c]`` (row-major order) to the left of their rows.

    Returns (vals fp32 ``[R, C]``, ids int64 ``[R, C]``), ``C`` the most entries of a row
    (at least 1); padding: value -inf, id 0.
    """
    R = x.shape[0]
    count = torch.bincount(r, minlength=R)
    C = max(int(count.max()), 1) if r.numel() else 1
    start = count.cumsum(0) - count
    j = torch.arange(r.numel(), device=x.device) - start[r]
    vals = torch.full((R, C), float("-inf"), device=x.device)
    ids = torch.zeros((R, C), dtype=torch.int64, device=x.device)
    vals[r, j] = x[r, c]
    ids[r, j] = c
    return vals, ids


def _token_keys(
    lists: Sequence[Sequence[int] | Tensor], rows: list[int], V: int, device: torch.device
) -> Tensor:
    """int64 keys ``row * V + id`` of the tokens of ``rows`` (ids outside ``[0, V)`` dropped)."""
    parts = [lists[r] for r in rows]
    parts = [t.reshape(-1).tolist() if isinstance(t, Tensor) else t for t in parts]
    ids = torch.tensor(list(itertools.chain.from_iterable(parts)), dtype=torch.int64)
    lengths = torch.tensor([len(t) for t in parts], dtype=torch.int64)
    owner = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    keys = owner * V + ids
    return keys[(ids >= 0) & (ids < V)].to(device)


def rows_of(logits: torch.Tensor, samples: Sequence[int]) -> list[torch.Tensor | None]:
    """The runner's logits split per sequence: None, one row ``[V]``, or ``[m, V]``."""
    rows: list[torch.Tensor | None] = []
    r = 0
    for m in samples:
        rows.append(None if m == 0 else logits[r] if m == 1 else logits[r : r + m])
        r += m
    return rows


def joined_rows(views: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[m_i, V]`` row blocks as one ``[sum m_i, V]`` tensor: a view when they are
    consecutive rows of one contiguous tensor (the runner's logits split by
    :func:`rows_of`, the usual case), else ``torch.cat``. The copy cost the engine's
    batch-8 step 0.5 ms of ~14 (bf16, SmolLM2, 2026-12-05: sampling 1.03 -> 0.52 ms)."""
    v0 = views[0]
    if len(views) == 1:
        return v0
    width, base = v0.shape[-1], v0.untyped_storage().data_ptr()
    offset, ok = v0.storage_offset(), True
    for v in views:
        if (
            not v.is_contiguous()
            or v.shape[-1] != width
            or v.dtype != v0.dtype
            or v.untyped_storage().data_ptr() != base
            or v.storage_offset() != offset
        ):
            ok = False
            break
        offset += v.shape[0] * width
    if not ok:
        return torch.cat(list(views))
    rows = (offset - v0.storage_offset()) // width
    return v0.as_strided((rows, width), (width, 1), v0.storage_offset())
