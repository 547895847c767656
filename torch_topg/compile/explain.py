"""``torch_topg.explain(model, *args, **kwargs)``: what the ``topg`` backend does to a model.

Reports dynamo's graph and graph-break counts (``torch._dynamo.explain``) and, per
pattern site found by the passes, whether it was replaced and why not, and, for calls on
CUDA tensors, which implementation the dispatch ran for each op and why
(``torch_topg.dispatch_report``). It resets
dynamo's caches before and after (compiled functions elsewhere in the process compile
again on their next call).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_topg.compile.backend import GraphReport, topg_backend
from torch_topg.compile.passes.base import Site
from torch_topg.ops.dispatch import dispatch_report

#: The pattern families explain reports, in the order of the summary.
PATTERNS = ("attention", "rotary", "rms_norm", "add_rms_norm", "mlp", "linear", "moe_router")


@dataclass
class ExplainResult:
    graph_count: int
    graph_break_count: int
    break_reasons: list[str]
    reports: list[GraphReport] = field(default_factory=list)
    fused_moe_calls: int = 0
    #: The dispatch's decisions that ran calls during the compiled run (CUDA only).
    dispatch: list[str] = field(default_factory=list)

    @property
    def sites(self) -> list[Site]:
        return [s for r in self.reports for s in r.sites]

    def counts(self) -> dict[str, tuple[int, int]]:
        """pattern -> (replaced, found)."""
        found, done = Counter(), Counter()
        for s in self.sites:
            found[s.pattern] += 1
            done[s.pattern] += s.replaced
        return {p: (done[p], found[p]) for p in found}

    def not_replaced(self) -> list[Site]:
        return [s for s in self.sites if not s.replaced]

    def summary(self) -> str:
        lines = [
            f"graphs: {self.graph_count}, graph breaks: {self.graph_break_count}",
        ]
        lines += [f"  break: {r}" for r in self.break_reasons]
        counts = self.counts()
        order = [p for p in PATTERNS if p in counts] + sorted(set(counts) - set(PATTERNS))
        lines.append(f"{'pattern':<14}{'replaced':>9}{'found':>7}")
        for p in order:
            done, found = counts[p]
            lines.append(f"{p:<14}{done:>9}{found:>7}")
        moe = self.fused_moe_calls or sum(r.topg_ops.get("fused_moe", 0) for r in self.reports)
        if moe:
            lines.append(f"{'experts':<14}{moe:>9}{'':>7}  (fused_moe, substituted while tracing)")
        nodes_b = sum(r.nodes_before for r in self.reports)
        nodes_a = sum(r.nodes_after for r in self.reports)
        secs = sum(r.seconds for r in self.reports)
        lines.append(f"graph nodes: {nodes_b} -> {nodes_a}; passes took {secs:.2f} s")
        for r in self.reports:
            for name, err in r.errors:
                lines.append(f"  pass {name} failed and was skipped: {err}")
            if r.skipped:
                lines.append(f"  graph not rewritten: {r.skipped}")
        missed = self.not_replaced()
        if missed:
            lines.append("not replaced:")
            lines += [f"  {s.pattern:<12} {s.where}: {s.detail}" for s in missed]
        if self.dispatch:
            lines.append("dispatch (CUDA):")
            lines += ["  " + d.replace("\n", "\n  ") for d in self.dispatch]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def explain(
    model: Any, *args: Any, options: dict[str, Any] | None = None, **kwargs: Any
) -> ExplainResult:
    """Compiles ``model`` with the topg backend on ``args``/``kwargs`` (under
    ``torch.no_grad``) and reports what was replaced; see :class:`ExplainResult`."""
    reports: list[GraphReport] = []

    def backend(gm, example_inputs):
        fn = topg_backend(gm, example_inputs, options=options)
        from torch_topg.compile.backend import REPORTS

        reports.append(REPORTS[-1] if REPORTS else GraphReport())
        return fn

    torch._dynamo.reset()
    with torch.no_grad():
        ex = torch._dynamo.explain(model)(*args, **kwargs)
    torch._dynamo.reset()
    before = {id(d): d.calls for d in dispatch_report().decisions}
    try:
        with torch.no_grad():
            torch.compile(model, backend=backend)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    ran = [d.describe() for d in dispatch_report().decisions if d.calls > before.get(id(d), 0)]
    moe = torch.ops.topg.fused_moe.default
    calls = 0
    for g in ex.graphs:
        calls += sum(1 for n in g.graph.nodes if n.op == "call_function" and n.target is moe)
    reasons = [str(getattr(b, "reason", b)).splitlines()[0] for b in ex.break_reasons]
    return ExplainResult(ex.graph_count, ex.graph_break_count, reasons, reports, calls, ran)
