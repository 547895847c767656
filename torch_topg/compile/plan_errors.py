"""The decode plan's two errors, in a module of their own: decode_plan.py and
decode_plan_moe.py (which decode_plan.py calls) both raise them."""

from __future__ import annotations


class Unsupported(Exception):
    """Why a model (or an engine configuration) does not lower; the engine keeps the text."""


class StalePlan(RuntimeError):
    """A weight the plan holds was converted, resized or moved since it was lowered
    (``model.to(dtype)``, a new storage through ``.data``): lower the model again."""
