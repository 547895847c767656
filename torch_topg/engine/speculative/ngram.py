"""Prompt lookup (n-gram) proposals: continue the sequence the way it went on the last
time its current suffix occurred.

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``: the last ``n`` tokens
are the pattern; the latest earlier occurrence of it (ending before the last token) is
the match, and the up to ``k`` tokens that followed it are the proposal. The longest ``n``
with a match wins.

:class:`NgramIndex` keeps, per sequence and per ``n``, a dict from each n-gram to the
latest position it ended at, extended incrementally as tokens are committed (a
sequence's tokens only ever grow: proposals are never written into it, only accepted
tokens). A lookup is then ``nmax - nmin + 1`` dict probes, whatever the length; a new
token costs as many dict writes. :func:`propose_ngram_numpy` is the stateless form
(sliding windows compared with numpy) and :func:`propose_ngram_reference` the plain
loop both are tested against. Measured in ``tests/test_speculative_ngram.py``'s
benchmark helper (docs/speculative.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram_reference(tokens: Sequence[int], k: int, nmin: int, nmax: int) -> list[int]:
    """The rule, as a plain loop (the tests' reference)."""
    L = len(tokens)
    for n in range(nmax, nmin - 1, -1):
        if L < n + 1:
            continue
        pattern = list(tokens[L - n :])
        for e in range(L - 2, n - 2, -1):  # e: the end of an earlier occurrence
            if list(tokens[e - n + 1 : e + 1]) == pattern:
                return list(tokens[e + 1 : e + 1 + k])
    return []


def propose_ngram_numpy(
    tokens: Sequence[int] | np.ndarray, k: int, nmin: int, nmax: int
) -> list[int]:
    """The rule with numpy: every window of the sequence compared with the suffix at once."""
    a = np.asarray(tokens, dtype=np.int64)
    L = a.shape[0]
    for n in range(nmax, nmin - 1, -1):
        if L < n + 1:
            continue
        # windows ending at e = n-1 .. L-2
        win = np.lib.stride_tricks.sliding_window_view(a[: L - 1], n)
        hits = np.flatnonzero((win == a[L - n :]).all(axis=1))
        if hits.size:
            e = int(hits[-1]) + n - 1
            return a[e + 1 : e + 1 + k].tolist()
    return []


class NgramIndex:
    """The incremental index of one sequence (see the module docstring)."""

    __slots__ = ("_maps", "_upto", "nmax", "nmin")

    def __init__(self, nmin: int, nmax: int) -> None:
        if not 1 <= nmin <= nmax:
            raise ValueError(f"NgramIndex: need 1 <= nmin <= nmax, got {nmin}, {nmax}")
        self.nmin, self.nmax = nmin, nmax
        # keys: hash(n-gram) (ints: no objects for the garbage collector to walk; a
        # collision is caught by comparing the tokens at lookup)
        self._maps: list[dict[int, int]] = [{} for _ in range(nmax - nmin + 1)]
        self._upto = 0  # n-grams ending at positions < _upto are indexed

    def _extend(self, tokens: Sequence[int]) -> None:
        end = len(tokens) - 1  # index ends e <= L - 2
        if end <= self._upto:
            return
        nmin = self.nmin
        for j, m in enumerate(self._maps):
            n = nmin + j
            for e in range(max(self._upto, n - 1), end):
                m[hash(tuple(tokens[e - n + 1 : e + 1]))] = e
        self._upto = end

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` proposed next tokens for ``tokens`` (this sequence's, grown only)."""
        return self.lookup(tokens, k)[0]

    def lookup(self, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        """:meth:`propose` and the length ``n`` of the suffix that matched (0: none).
        The engine keeps acceptance per sequence and ``n``: a proposal after a one-token
        match is accepted less often than one after a four-token match."""
        if self._upto and len(tokens) < self._upto + 1:
            raise ValueError("NgramIndex: the token list shrank (one index per sequence)")
        self._extend(tokens)
        L = len(tokens)
        for j in range(len(self._maps) - 1, -1, -1):
            n = self.nmin + j
            if L < n + 1:
                continue
            pattern = tuple(tokens[L - n :])
            e = self._maps[j].get(hash(pattern))
            if e is not None and tuple(tokens[e - n + 1 : e + 1]) == pattern:
                return list(tokens[e + 1 : e + 1 + k]), n
        return [], 0
