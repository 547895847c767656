"""Speculative decoding for the engine: proposals (prompt lookup, a draft model, the
target's own first layers) verified in one multi-token step. See docs/speculative.md.

- ``config``: the ``speculative=`` option, parsed and checked;
- ``ngram``: prompt-lookup proposals (an incremental n-gram index per sequence);
- ``rejection``: which proposals a step accepts (coupled keyed draws; the textbook rule);
- ``adaptive``: per-sequence k from measured acceptance and step costs;
- ``stats``: proposals, acceptances, acceptance per position, mean accepted length.
"""

from __future__ import annotations

from torch_topg.engine.speculative.adaptive import AdaptiveController, CostModel
from torch_topg.engine.speculative.config import SpeculativeConfig, parse_speculative
from torch_topg.engine.speculative.ngram import NgramIndex, propose_ngram_numpy
from torch_topg.engine.speculative.rejection import accept_coupled, rejection_sample
from torch_topg.engine.speculative.stats import SpecStats

__all__ = [
    "AdaptiveController",
    "CostModel",
    "NgramIndex",
    "SpecStats",
    "SpeculativeConfig",
    "accept_coupled",
    "parse_speculative",
    "propose_ngram_numpy",
    "rejection_sample",
]
