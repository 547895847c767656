"""The ``topg`` torch.compile backend.

``torch.compile(model, backend="topg")`` works in any process where torch_topg is
installed (entry point ``torch_dynamo_backends``). Importing this module registers the
backend name explicitly too and substitutes transformers' experts implementations with
``topg::fused_moe`` for tracing (see :mod:`torch_topg.compile.experts`).
"""

from __future__ import annotations

from torch_topg.compile import experts
from torch_topg.compile.backend import REPORTS, GraphReport, clear_reports, topg_backend
from torch_topg.compile.explain import ExplainResult, explain
from torch_topg.compile.options import Options
from torch_topg.compile.passes import PASS_NAMES, PASSES

experts.install()

__all__ = [
    "PASSES",
    "PASS_NAMES",
    "REPORTS",
    "ExplainResult",
    "GraphReport",
    "Options",
    "clear_reports",
    "explain",
    "topg_backend",
]
