"""Helpers for the compile-backend tests: compile with ``backend="topg"`` and collect the
sites the passes reported."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from torch_topg.compile import REPORTS, clear_reports


def compile_topg(fn: Any, *args: Any, options: dict | None = None, **kwargs: Any):
    """Runs ``fn`` eagerly and compiled (fresh dynamo state, ``fullgraph=True``) under
    ``inference_mode``; returns (eager output, compiled output, sites)."""
    torch._dynamo.reset()
    clear_reports()
    with torch.inference_mode():
        expected = fn(*args, **kwargs)
        compiled = torch.compile(fn, backend="topg", fullgraph=True, options=options)
        actual = compiled(*args, **kwargs)
    sites = [s for r in REPORTS for s in r.sites]
    errors = [e for r in REPORTS for e in r.errors]
    assert not errors, errors
    torch._dynamo.reset()
    return expected, actual, sites


def replaced(sites, pattern: str) -> tuple[int, int]:
    """(replaced, found) for ``pattern``."""
    found = Counter(s.pattern for s in sites)[pattern]
    done = sum(1 for s in sites if s.pattern == pattern and s.replaced)
    return done, found


def all_replaced(sites, pattern: str, at_least: int = 1) -> None:
    done, found = replaced(sites, pattern)
    missed = [s for s in sites if s.pattern == pattern and not s.replaced]
    assert found >= at_least and done == found, (pattern, done, found, missed)
