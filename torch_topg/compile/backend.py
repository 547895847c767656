"""The ``topg`` torch.compile backend: run the passes over dynamo's graph, then execute it.

``torch.compile(model, backend="topg")`` finds this function through the
``torch_dynamo_backends`` entry point (no ``import torch_topg`` needed). Dynamo hands it
a torch-level FX graph and the example inputs (the real tensors, parameters included).
The pass manager runs the passes of ``torch_topg.compile.passes`` in order; each pass
either completes or leaves the graph exactly as it found it (a snapshot is restored and
a warning given once; ``strict=True`` raises instead). The rewritten graph runs as
generated Python calling native ops (or, with ``inductor=True``, goes to Inductor).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from torch_topg.compile import experts
from torch_topg.compile.fx import INPLACE_FUNCTIONS, hint
from torch_topg.compile.options import Options
from torch_topg.compile.passes import PASSES, Context, Site

_warned: set[tuple[str, str]] = set()


@dataclass
class GraphReport:
    """What the backend did to one graph (explain reads these)."""

    sites: list[Site] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    seconds: float = 0.0
    skipped: str = ""
    #: topg op name -> calls in the final graph (``fused_moe`` comes from tracing).
    topg_ops: dict[str, int] = field(default_factory=dict)
    #: a static-cache decode graph (``static_plan``): ``active``, ``reason``, ``steps``
    #: (on the plan) and ``fallback_steps`` (on the graph); empty for other graphs.
    decode_plan: dict[str, Any] = field(default_factory=dict)


def _warn_once(key: tuple[str, str], message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _snapshot(gm: fx.GraphModule) -> fx.Graph:
    return _snapshot_of(gm.graph, gm)


def _snapshot_of(graph: fx.Graph, gm: fx.GraphModule) -> fx.Graph:
    g = fx.Graph(owning_module=gm)
    g.output(g.graph_copy(graph, {}))
    return g


def dce(graph: fx.Graph) -> None:
    """Removes unused nodes, keeping anything that may write memory (in-place methods,
    augmented assignment, mutating ops): FX's own DCE treats ``call_method`` as pure."""
    for n in reversed(list(graph.nodes)):
        if n.users or n.op in ("placeholder", "output", "get_attr", "call_module"):
            continue
        if n.op == "call_method" and n.target.endswith("_"):
            continue
        if n.op == "call_function" and (n.target in INPLACE_FUNCTIONS or n.is_impure()):
            continue
        graph.erase_node(n)


def simplify(graph: fx.Graph) -> None:
    """Peephole clean-up after the passes: ``x.transpose(a, b).transpose(a, b)`` -> ``x``
    (the passes leave such pairs where a ``[B, S, H, D]`` op meets ``[B, H, S, D]`` code).
    Every node left is one Python call per step in decode, so this is measurable."""
    for n in list(graph.nodes):
        if n.op == "call_method" and n.target == "transpose" and len(n.args) == 3 and not n.kwargs:
            src = n.args[0]
            if (
                isinstance(src, fx.Node)
                and src.op == "call_method"
                and src.target == "transpose"
                and len(src.args) == 3
                and not src.kwargs
                and sorted(src.args[1:]) == sorted(n.args[1:])
            ):
                n.replace_all_uses_with(src.args[0])
                graph.erase_node(n)
    _collapse_view_chains(graph)
    dce(graph)


_CHAIN = ("transpose", "reshape", "view", "contiguous")


def _collapse_view_chains(graph: fx.Graph) -> None:
    """``a.transpose(1, 2).reshape(...).transpose(1, 2).contiguous().reshape(s)`` ->
    ``a.reshape(s)`` when ``a`` is a topg op's (contiguous) output and the chain keeps
    the elements in ``a``'s memory order. transformers' attention output takes six such
    calls per layer after ``topg::attention``; each is a Python call per decode step.

    The order is checked by replaying the chain on ``arange`` at the example sizes."""
    for n in list(graph.nodes):
        if not (n.op == "call_function" and getattr(n.target, "namespace", None) == "topg"):
            continue
        v = n.meta.get("example_value")
        if not isinstance(v, torch.Tensor) or len(n.users) != 1:
            continue
        chain, t = [], n
        while len(t.users) == 1:
            u = next(iter(t.users))
            if u.op != "call_method" or u.target not in _CHAIN or u.args[0] is not t or u.kwargs:
                break
            chain.append(u)
            t = u
        shaped = [i for i, c in enumerate(chain) if c.target in ("reshape", "view")]
        if not shaped or len(chain) < 2:
            continue
        last = chain[shaped[-1]]
        try:
            shape = [hint(s) for s in v.shape]
            x = torch.arange(int(torch.tensor(shape).prod()) if shape else 1).view(shape)
            for c in chain[: shaped[-1] + 1]:
                args = [hint(a) for a in c.args[1:]]
                if len(args) == 1 and isinstance(args[0], (tuple, list)):
                    args = [hint(a) for a in args[0]]
                x = getattr(x, c.target)(*args)
            if not torch.equal(x.flatten(), torch.arange(x.numel())):
                continue
        except Exception:  # unknown hints or shapes: leave the chain alone
            continue
        with graph.inserting_before(last):
            new = graph.call_method("reshape", (n, *last.args[1:]))
        new.meta.update(last.meta)
        last.replace_all_uses_with(new)
        # contiguous() right after a reshape of a contiguous tensor returns it as is
        for c in chain[shaped[-1] + 1 :]:
            if c.target == "contiguous" and c.args[0] is not None:
                src = c.args[0]
                c.replace_all_uses_with(src)


def rewrite(gm: fx.GraphModule, example_inputs: list[Any], opts: Options) -> GraphReport:
    """Runs the enabled passes over ``gm`` in place; returns what each found.

    One snapshot of the graph is taken first. When a pass raises, the graph is restored
    from it and the passes run again without the failing one, so a failure costs a
    re-run and the normal case one copy (a copy per pass was most of the pass time)."""
    t0 = time.perf_counter()
    report = GraphReport(nodes_before=len(gm.graph.nodes))
    original = _snapshot(gm)
    skip = set(opts.disable)
    with torch.inference_mode(False), torch.no_grad():
        while True:
            ctx = Context(gm, list(example_inputs), opts)
            sites: list[Site] = []
            current = ""
            try:
                for cls in PASSES:
                    if cls.name in skip:
                        continue
                    current = cls.name
                    sites.extend(cls().run(ctx))
                    dce(gm.graph)
                    gm.graph.lint()  # a pass that breaks the graph is the one that failed
                if "simplify" not in skip:
                    current = "simplify"
                    simplify(gm.graph)
                    gm.graph.lint()
                break
            except Exception as e:
                if opts.strict:
                    raise RuntimeError(f"topg backend: pass '{current}' failed: {e}") from e
                report.errors.append((current, f"{type(e).__name__}: {e}"))
                _warn_once(
                    (current, type(e).__name__),
                    f"topg backend: pass '{current}' failed ({type(e).__name__}: {e}); "
                    "the graph runs without it. options={'strict': True} raises.",
                )
                gm.graph = _snapshot_of(original, gm)
                if not current or current in skip:  # not a pass's fault: run unchanged
                    sites = []
                    break
                skip.add(current)
    report.sites = sites
    if opts.verbose:
        for site in report.sites:
            print(
                f"[topg] {site.pattern:<12} {'yes' if site.replaced else 'no ':<3} "
                f"{site.where}: {site.detail}"
            )
    gm.recompile()
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "topg":
            name = n.target._opname
            report.topg_ops[name] = report.topg_ops.get(name, 0) + 1
    report.nodes_after = len(gm.graph.nodes)
    report.seconds = time.perf_counter() - t0
    return report


#: Reports of the graphs compiled since the last ``clear_reports()`` (explain, tests).
REPORTS: list[GraphReport] = []
_MAX_REPORTS = 256


def clear_reports() -> None:
    REPORTS.clear()


def _needs_grad(example_inputs: list[Any]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
    )


def topg_backend(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    *,
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The ``topg`` backend (``torch.compile(model, backend="topg", options={...})``).

    ``options`` are :class:`~torch_topg.compile.options.Options` fields. ``mode`` is
    accepted for compatibility and ignored.
    """
    opts = Options.parse(options)
    if opts.experts:
        experts.install()  # experts classes imported since: covered from the next trace
    if _needs_grad(example_inputs):
        # topg kernels have no backward. Training or autograd through the model keeps the
        # traced graph as is (correct, not fused); inference (no_grad) is rewritten.
        report = GraphReport(nodes_before=len(gm.graph.nodes), skipped="grad mode")
        report.nodes_after = report.nodes_before
        _warn_once(
            ("backend", "grad"),
            "topg backend: grad mode is on and inputs require grad, so this graph runs "
            "unfused (topg kernels are inference-only). Call the model under "
            "torch.no_grad() or torch.inference_mode() (generate() does).",
        )
    else:
        report = rewrite(gm, example_inputs, opts)
    if len(REPORTS) < _MAX_REPORTS:
        REPORTS.append(report)
    growing = _growing_outputs(gm)
    if opts.inductor:
        from torch._inductor.compile_fx import compile_fx

        fn = compile_fx(gm, example_inputs)
    else:
        fn = gm.forward
    if opts.decode_plan and not report.skipped:
        from torch_topg.compile import static_plan

        fn = static_plan.build(gm, example_inputs, fn, report.decode_plan) or fn
    return _mark_growing(fn, growing) if growing else fn


def _growing_outputs(gm: fx.GraphModule) -> list[int]:
    """Output positions that are KV-cache-like: ``torch.cat([past, new], dim=-2)`` of 4-d
    ``[B, H, S, D]`` tensors (transformers' ``DynamicCache`` update)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    results = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    idx = []
    for i, r in enumerate(results):
        if (
            isinstance(r, fx.Node)
            and r.op == "call_function"
            and r.target in (torch.cat, torch.concat)
            and (r.kwargs.get("dim", r.args[1] if len(r.args) > 1 else 0) in (-2, 2))
        ):
            v = r.meta.get("example_value")
            if isinstance(v, torch.Tensor) and v.dim() == 4:
                idx.append(i)
    return idx


def _mark_growing(fn: Callable[..., Any], idx: list[int]) -> Callable[..., Any]:
    """Marks the sequence dim of KV-cache outputs as dynamic, so that the next call (the
    first decode step) compiles once for every context length instead of once for
    this length and again when it changes (dynamo's automatic dynamic shapes would)."""
    mark = torch._dynamo.maybe_mark_dynamic

    def run(*args: Any) -> Any:
        outs = fn(*args)
        for i in idx:
            t = outs[i]
            if t.size(2) > 1:
                mark(t, 2)
        return outs

    return run
