"""The adaptive rule: how many tokens each sequence proposes in a step, from measurements.

Model (Leviathan et al. 2023). A sequence whose proposals are accepted with probability
``a`` each (estimated per sequence) emits ``E(k) = 1 + a + a^2 + ... + a^k`` tokens from
a verify step with ``k`` proposals; the ``j``-th proposal adds ``a^j`` expected tokens.
A step that computes ``T`` tokens takes ``t(T)`` seconds, measured (:class:`CostModel`:
every step the engine runs updates it; a warm-up profile seeds it). For a step whose
non-speculative form computes ``T0`` tokens and emits one token for each of ``B``
decoding sequences, proposals add ``N`` tokens and ``sum a_i^j`` expected tokens, plus
the draft's own steps (``t_d``, for draft models). The rule takes the proposals in
order of expected gain ``a_i^j`` (highest first) and keeps the prefix ``N`` that maximises

    (B + sum of the first N gains) / (t(T0 + N) + draft time)   relative to   B / t(T0),

and speculates only when that ratio exceeds ``1 + min_gain`` (``1 + closed_min_gain`` in a
closed batch, below). So a sequence whose
acceptance is low gets k = 0 (speculation off for it), and a batch large enough that a
step's time grows with its tokens (compute-bound) gets k = 0 everywhere. A sequence
left at 0 for ``probe_every`` steps becomes due for a probe (``probe_k`` proposals):
otherwise neither its acceptance nor the cost of a longer step would ever be measured
again, and one pessimistic measurement (a neighbour's burst during the start-up profile)
would switch speculation off for good. Probes are rationed engine-wide: at most one per
step (the sequence idle longest), and only while the extra time the cost curve predicts
for all probes so far stays within ``probe_budget`` of the time of every step observed.
(Per-sequence probes every 16 steps made a third of the steps of a batch of 8 carry a
probe that the rule itself priced as a loss: open-ended chat ran at 0.87-0.96x.) Prompt lookup also scores its unused proposals
against the tokens that follow (:meth:`AdaptiveController.set_shadow`), at no cost:
with coupled verification, a proposal is accepted exactly when the tokens that follow
equal it.

A closed batch (several sequences, no request waiting to join) ends with its slowest
sequence: tokens accepted for the others only let them leave early, so the rule's
throughput gain is realised only in part there (open-ended chat at batch 8, bf16: 96 and
97 steps with and without speculation, 0.93-0.94x of the plain engine at the 2% margin).
Its margin is ``closed_min_gain`` (10%): same process, bf16, 4 alternating rounds, batch-8
chat 0.933x / 0.962x / 0.972x of plain at 2% / 6% / 10%, the input-grounded batch 1.325x /
1.310x / 1.312x (docs/speculative.md). (Valuing tokens by whether they shorten the batch,
from the requests' token limits, was tried and dropped: summaries end with EOS long before
their limit, and the grounded batch fell to 1.13x.)

Acceptance estimate: discounted counts per sequence, ``a = (s + w a_g) / (n + w)``
with ``s`` accepted tokens, ``n`` trials (accepted tokens plus one per rejection: the
truncated-geometric estimate), ``a_g`` the engine-wide rate of the method and ``w``
pseudo-trials of it, so a new sequence starts from what the method achieves overall.
A key ``(owner, group)`` takes ``a_g`` from the keys of its group: prompt lookup keys
``(sequence, n)`` by the length of the suffix that matched, since a proposal after a
one-token match is accepted less often than one after a four-token match (open-ended
chat, batch 8, fp32: one estimate per sequence for both ran at 0.97x of the plain engine,
one per match length at 1.00x; docs/speculative.md).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field


class CostModel:
    """Seconds of a step by the number of tokens it computes, ``t(T)``, measured.

    Two sources. The start-up profile (:meth:`seed`) times every shape the rule prices
    under the same conditions (short context, best of a few runs), so its points compare
    with each other but not with the steps the engine runs later, whose time also grows
    with the context their attention reads. Every step the engine runs
    (:meth:`observe`) is a measurement of now. A count measured within the last
    ``horizon`` steps takes the median of those measurements (the last ``window`` at
    most: a step slowed by a neighbour's burst on a shared CPU moves it only if half of
    them are). The profile gives every count a prior, its shape at today's level:
    ``t(A) * p(T) / p(A)``, with ``A`` the count measured most often lately (the plain
    step) and ``p`` the profile's curve. A count's value is its recent median pulled
    towards that prior as ``prior_weight`` measurements would pull it (one measurement
    of a rare count is noisier than the few percent a proposal adds to a batch-8 step);
    a count not measured lately takes the prior. Without a profile, a count keeps its
    measurements, however old.

    Why not every count from its own measurements: a count seen every step (the plain
    step of a batch) and one seen three times in a run (the plain batch plus one
    proposal, or its profile point from the start) were measured at other contexts and
    with other sample sizes. With a lower quartile per count (before 2026-12-02), batch-8
    chat in bf16 fitted ``t(9) = t(8)``: a proposal looked free, and one with acceptance
    0.26 passed the rule (0.89x of the plain engine).

    Bounded work: a count not measured lately and not in the profile only restated the
    prior, so it is left out of the fit; at most ``max_counts`` counts keep measurements
    (the one measured longest ago goes first). Every distinct prefill size is a count: a
    server that had seen 600 of them refitted in 0.53 ms a step (the plain batch-8 bf16
    step takes ~14 ms). A refit after a step walks the counts once, each count's recent
    median cached until it is measured again or its oldest recent measurement leaves the
    horizon (:meth:`_fit_reference` is the fit from scratch; the tests hold the two equal):
    the speculator's planning at batch-8 chat (bf16, 2-core Zen 3; one process, 8 rounds
    alternating with the fit from scratch) 0.33 -> 0.30 ms a step, though in a loop of its
    own the refit costs about the same either way (21 us): between model steps the
    measurements it no longer walks are out of the cache.

    Through the points: the best non-decreasing fit (pool-adjacent-violators, each point
    weighted by its number of measurements: a step never gets cheaper with more tokens),
    interpolated linearly, extrapolated along the last segment, held below the smallest
    count. Unmeasured: ``t(T) = 1`` (a memory-bound step).
    """

    def __init__(
        self,
        window: int = 16,
        horizon: int = 128,
        prior_weight: float = 4.0,
        max_counts: int = 64,
    ) -> None:
        self.window = window
        self.horizon = horizon
        self.prior_weight = prior_weight
        self.max_counts = max_counts
        self._clock = 0  # steps observed
        self._obs: dict[int, list[tuple[int, float]]] = {}  # T -> [(clock, seconds)]
        self._seed: dict[int, list[float]] = {}
        self._prof: tuple[list[int], list[float]] | None = None
        self._curve: tuple[list[int], list[float]] | None = None
        # per count: (recent measurements, their median, the clock at which the oldest
        # of them leaves the horizon), kept until the count is measured again or that
        # clock comes
        self._recent: dict[int, tuple[int, float, int]] = {}

    def seed(self, tokens: int, seconds: float) -> None:
        """A start-up profile point (see the class docstring)."""
        if tokens >= 1 and seconds > 0:
            self._seed.setdefault(tokens, []).append(seconds)
            self._prof = self._curve = None

    def observe(self, tokens: int, seconds: float) -> None:
        """A step the engine ran."""
        if tokens < 1 or not seconds > 0:
            return
        self._clock += 1
        obs = self._obs.setdefault(tokens, [])
        obs.append((self._clock, seconds))
        if len(obs) > self.window:
            del obs[0]
        self._recent.pop(tokens, None)
        if len(self._obs) > self.max_counts:  # the count measured longest ago goes
            gone = min(self._obs, key=lambda t: self._obs[t][-1][0])
            del self._obs[gone]
            self._recent.pop(gone, None)
        self._curve = None

    @staticmethod
    def _monotone(points: list[tuple[int, float, float]]) -> tuple[list[int], list[float]]:
        """Pool-adjacent-violators over ``(T, value, weight)`` sorted by T."""
        blocks: list[list[float]] = []  # [value, weight, count of points]
        for _, v, w in points:
            blocks.append([v, w, 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                v2, w2, c2 = blocks.pop()
                v1, w1, c1 = blocks[-1]
                blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
        return [t for t, _, _ in points], [v for v, _, c in blocks for _ in range(int(c))]

    @staticmethod
    def _interp(curve: tuple[list[int], list[float]], tokens: int) -> float:
        ts, v = curve
        if not ts:
            return 1.0
        i = bisect.bisect_left(ts, tokens)
        if i < len(ts) and ts[i] == tokens:
            return v[i]
        if i == 0:
            return v[0]
        if i == len(ts):
            if len(ts) == 1:
                return v[0]
            slope = (v[-1] - v[-2]) / (ts[-1] - ts[-2])
            return v[-1] + slope * (tokens - ts[-1])
        w = (tokens - ts[i - 1]) / (ts[i] - ts[i - 1])
        return v[i - 1] + w * (v[i] - v[i - 1])

    def _profile(self) -> tuple[list[int], list[float]]:
        if self._prof is None:  # the profile's own curve changes only with seed()
            self._prof = self._monotone(
                [(t, statistics.median(x), 1.0) for t, x in sorted(self._seed.items())]
            )
        return self._prof

    def _recent_of(self, t: int) -> tuple[int, float, int]:
        """Count ``t``'s measurements within the horizon: how many, their median (0.0 if
        none), and the clock at which that changes without a new measurement."""
        r = self._recent.get(t)
        if r is None or self._clock >= r[2]:
            since = self._clock - self.horizon
            obs = self._obs[t]
            i = 0
            while i < len(obs) and obs[i][0] <= since:
                i += 1
            if i == len(obs):
                r = (0, 0.0, 1 << 62)  # none lately: only a new measurement changes that
            else:
                r = (len(obs) - i, statistics.median(x for _, x in obs[i:]),
                     obs[i][0] + self.horizon)  # fmt: skip
            self._recent[t] = r
        return r

    def _fit(self) -> tuple[list[int], list[float]]:
        """The fitted curve (the class docstring), refitted after a new measurement from
        what each count's cached recent median says: the work of a refit is then a pass
        over the counts, not over every measurement (:meth:`_fit_reference` is the same
        fit from scratch; the tests compare the two)."""
        if self._curve is None:
            prof = self._profile()
            recent = {t: r for t in self._obs if (r := self._recent_of(t))[0]}
            anchor, level = 0, 0.0
            if recent and prof[0]:
                anchor = max(recent, key=lambda t: (recent[t][0], t))
                level = recent[anchor][1] / self._interp(prof, anchor)
            pw = self.prior_weight
            pts: list[tuple[int, float, float]] = []
            for t in sorted(set(self._obs) | set(self._seed)):  # as in _fit_reference
                prior = level * self._interp(prof, t) if anchor else None
                r = recent.get(t)
                if r is not None:
                    n, v = r[0], r[1]
                    if prior is not None:
                        v = (n * v + pw * prior) / (n + pw)
                    pts.append((t, v, float(n)))
                elif prior is not None:
                    if t in self._seed:
                        pts.append((t, prior, 1.0))
                elif t in self._obs:
                    pts.append((t, statistics.median(x for _, x in self._obs[t]), 1.0))
                else:
                    pts.append((t, self._interp(prof, t), 1.0))
            self._curve = self._monotone(pts)
        return self._curve

    def _fit_reference(self) -> tuple[list[int], list[float]]:
        """The fit from every measurement, recomputed (what :meth:`_fit` must equal)."""
        prof = self._profile()
        since = self._clock - self.horizon
        recent: dict[int, list[float]] = {}
        for t, obs in self._obs.items():
            r = [x for c, x in obs if c > since]
            if r:
                recent[t] = r
        # anchor: the count measured most often lately; level: its median over the
        # profile's value there (the profile's curve times level is the prior)
        anchor, level = 0, 0.0
        if recent and prof[0]:
            anchor = max(recent, key=lambda t: (len(recent[t]), t))
            level = statistics.median(recent[anchor]) / self._interp(prof, anchor)
        pts: list[tuple[int, float, float]] = []
        for t in sorted(set(self._obs) | set(self._seed)):
            prior = level * self._interp(prof, t) if anchor else None
            if t in recent:
                n, v = len(recent[t]), statistics.median(recent[t])
                if prior is not None:  # pulled towards the prior
                    v = (n * v + self.prior_weight * prior) / (n + self.prior_weight)
                pts.append((t, v, float(n)))
            elif prior is not None:
                if t in self._seed:  # an unseeded count not measured lately: the prior
                    pts.append((t, prior, 1.0))  # restated, left to the interpolation
            elif t in self._obs:
                pts.append((t, statistics.median(x for _, x in self._obs[t]), 1.0))
            else:
                pts.append((t, self._interp(prof, t), 1.0))
        return self._monotone(pts)

    def __call__(self, tokens: int) -> float:
        return self._interp(self._fit(), tokens)

    def at(self, tokens: Iterable[int]) -> list[float]:
        """``[t(T) for T in tokens]`` from one fit (the rule prices every prefix)."""
        curve = self._fit()
        return [self._interp(curve, t) for t in tokens]

    def points(self) -> dict[int, float]:
        """The fitted curve at the measured token counts ``{tokens: seconds}``."""
        ts, v = self._fit()
        return dict(zip(ts, v, strict=True))


@dataclass
class _Seq:
    succ: float = 0.0
    trials: float = 0.0
    idle: int = 0  # steps in a row planned at k = 0
    shadow: tuple[list[int], int] | None = None  # (unused proposal, index it starts at)


@dataclass
class AdaptiveController:
    """Per-sequence k from measured acceptance and step costs (module docstring)."""

    k_max: int
    cost: CostModel = field(default_factory=CostModel)
    draft_cost: CostModel | None = None  # the draft model's step, t_d(sequences)
    adaptive: bool = True
    disable_by_batch_size: int | None = None
    min_gain: float = 0.02
    closed_min_gain: float = 0.10  # the margin in a closed batch (module docstring)
    probe_every: int = 16  # a sequence left at k = 0 this many steps is due for a probe
    probe_k: int = 1  # proposals of a probe (0: its cap, e.g. prompt lookup's whole match)
    probe_budget: float = 0.02  # probes' predicted extra time / all step time, at most
    prior_weight: float = 2.0
    discount: float = 0.95
    _seqs: dict[Hashable, _Seq] = field(default_factory=dict)
    _succ: float = 1.0  # engine-wide discounted counts (prior 1 of 2: a = 0.5)
    _trials: float = 2.0
    _groups: dict[Hashable, list[float]] = field(default_factory=dict)  # [succ, trials]
    _elapsed: float = 0.0  # seconds of every step observed
    _probe_spent: float = 0.0  # the cost curve's extra seconds for the probes so far

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step of ``tokens`` tokens took ``seconds``: the cost curve and the probe
        budget."""
        self.cost.observe(tokens, seconds)
        if seconds > 0:
            self._elapsed += seconds

    # --- acceptance ----------------------------------------------------------------
    @property
    def global_acceptance(self) -> float:
        return self._succ / self._trials

    @staticmethod
    def _group(key: Hashable) -> Hashable:
        return key[1] if isinstance(key, tuple) and len(key) == 2 else None

    def group_acceptance(self, group: Hashable) -> float:
        """The pooled rate of ``group``'s keys (the engine-wide rate before any)."""
        c = self._groups.get(group)
        return self.global_acceptance if c is None else c[0] / c[1]

    def acceptance(self, key: Hashable) -> float:
        s = self._seqs.get(key)
        w, g = self.prior_weight, self.group_acceptance(self._group(key))
        if s is None:
            return g
        return (s.succ + w * g) / (s.trials + w)

    def observe(self, key: Hashable, proposed: int, accepted: int) -> None:
        """A verify step of ``key``: ``accepted`` of ``proposed`` tokens kept."""
        if proposed <= 0:
            return
        trials = accepted + (1 if accepted < proposed else 0)
        s = self._seqs.setdefault(key, _Seq())
        s.succ = self.discount * s.succ + accepted
        s.trials = self.discount * s.trials + trials
        d = self.discount**0.25  # the pooled rates move slower
        group = self._group(key)
        if group is not None:
            c = self._groups.setdefault(group, [self._succ, self._trials])
            c[0], c[1] = d * c[0] + accepted, d * c[1] + trials
        self._succ = d * self._succ + accepted
        self._trials = d * self._trials + trials

    def set_shadow(self, key: Hashable, proposal: Sequence[int], start: int) -> None:
        """An unused proposal for tokens ``start ..``: scored by :meth:`check_shadow`."""
        if proposal:
            self._seqs.setdefault(key, _Seq()).shadow = (list(proposal), start)

    def check_shadow(self, key: Hashable, tokens: Sequence[int]) -> bool:
        """Score ``key``'s pending unused proposal against its committed ``tokens``;
        whether one is still pending (not decided by the tokens so far)."""
        s = self._seqs.get(key)
        if s is None or s.shadow is None:
            return False
        prop, start = s.shadow
        got = tokens[start : start + len(prop)]
        a = 0
        while a < len(got) and got[a] == prop[a]:
            a += 1
        if a < len(got) or len(got) == len(prop):  # decided: a mismatch, or all seen
            s.shadow = None
            self.observe(key, len(prop), a)
            return False
        return True

    def forget(self, key: Hashable) -> None:
        self._seqs.pop(key, None)

    # --- the plan ------------------------------------------------------------------
    def plan(
        self, cands: Sequence[tuple[Hashable, int]], base_tokens: int, closed: bool = False
    ) -> list[int]:
        """Proposals per candidate: ``cands`` are ``(key, cap)`` of the decoding sequences
        that may speculate (``cap``: the most proposals each can take); ``base_tokens``:
        what the step computes without speculation (decodes and prefill chunks);
        ``closed``: a batch of several sequences that no request waits to join (the
        margin is then ``closed_min_gain``)."""
        B = len(cands)
        ks = [0] * B
        if B == 0 or (self.disable_by_batch_size and B >= self.disable_by_batch_size):
            return ks
        caps = [max(0, min(c, self.k_max)) for _, c in cands]
        if not self.adaptive:
            return caps
        if any(caps):  # else nothing to propose (prompt lookup found no match): no pricing
            ks = self._priced(cands, caps, base_tokens, closed)
        due = -1  # the candidate idle longest, when it is due for a probe
        for i, (key, _) in enumerate(cands):
            s = self._seqs.setdefault(key, _Seq())
            if ks[i]:
                s.idle = 0
                continue
            s.idle += 1
            if self.probe_every and s.idle >= self.probe_every and caps[i] > 0:
                if due < 0 or s.idle > self._seqs[cands[due][0]].idle:
                    due = i
        if due >= 0:
            kp = min(caps[due], self.probe_k or caps[due])
            t = base_tokens + sum(ks)
            extra = max(0.0, self.cost(t + kp) - self.cost(t))
            if self._probe_spent + extra <= self.probe_budget * self._elapsed:
                self._probe_spent += extra
                ks[due], self._seqs[cands[due][0]].idle = kp, 0
        return ks

    def _priced(
        self,
        cands: Sequence[tuple[Hashable, int]],
        caps: list[int],
        base_tokens: int,
        closed: bool = False,
    ) -> list[int]:
        """The rule's proposals per candidate (module docstring), before probes."""
        B = len(cands)
        ks = [0] * B
        acc = [self.acceptance(key) for key, _ in cands]
        gains = sorted(
            ((acc[i] ** j, i) for i in range(B) for j in range(1, caps[i] + 1)), reverse=True
        )
        cost = self.cost.at(range(base_tokens, base_tokens + len(gains) + 1))
        t0 = cost[0]
        base_rate = B / t0
        best, best_n = 1.0 + (self.closed_min_gain if closed else self.min_gain), 0
        emitted, per_step = float(B), [0] * (self.k_max + 1)  # per_step[j]: seqs with k >= j
        draft_t = 0.0
        counts = [0] * B
        for n, (g, i) in enumerate(gains, start=1):
            emitted += g
            counts[i] += 1
            if self.draft_cost is not None:
                j = counts[i]
                c = per_step[j]
                draft_t += self.draft_cost(c + 1) - (self.draft_cost(c) if c else 0.0)
                per_step[j] = c + 1
            rate = emitted / (cost[n] + draft_t)
            if rate / base_rate > best:
                best, best_n = rate / base_rate, n
        for _, i in gains[:best_n]:
            ks[i] += 1
        return ks

    def expected_speedup(self, acceptance: float, k: int, base_tokens: int = 1) -> float:
        """The model's speed-up of one sequence with ``k`` proposals (docs, benchmarks)."""
        e = sum(acceptance**j for j in range(k + 1))
        t = self.cost(base_tokens + k)
        if self.draft_cost is not None and k:
            t += k * self.draft_cost(1)
        return e / t * self.cost(base_tokens)
