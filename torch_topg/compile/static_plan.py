"""``backend="topg"`` with transformers' static cache: the decode graph runs as one plan call.

``model.generate(..., cache_implementation="static")`` on a model compiled with
``backend="topg"`` gives dynamo one graph for the prefill and one for the decode steps.
The decode graph (every sequence one new token, writing its K / V into the
``StaticCache`` tensors with ``index_copy_``) is the step the engine runs on its
:mod:`~torch_topg.compile.decode_plan`. :func:`build` recognises it and returns a
callable that runs the step as one ``topg.DecodePlan`` call over the static cache itself
(``cache_layout="bhsd"``: each batch row is one block of ``max_cache_len`` tokens), with
the compiled graph kept for the steps the plan does not compute (a padded batch).

What the graph must be, checked from its placeholders' dynamo sources and its nodes (the
reason is kept otherwise and the compiled graph runs, ``report.decode_plan``):

- inputs ``input_ids`` ``[B, 1]`` (B <= 16) and ``position_ids`` ``[B, 1]`` (or none:
  then every row's position is the write position p); the model
  itself reachable from the parameters' sources (``L['self']._modules[...]``) and
  lowerable (:func:`~torch_topg.compile.decode_plan.lower`);
- the only writes to graph inputs: ``keys.index_copy_(2, idx, k)`` and
  ``values.index_copy_(2, idx, v)`` per layer (``[B, kv_heads, max_len, head_dim]``),
  and optionally ``counter.add_(c)`` on small integer tensors (transformers 5's
  ``StaticLayer.cumulative_length``); ``idx`` computed from small inputs only;
- one output, the logits ``[B, 1, vocab]``.

Per step the callable computes ``idx`` (the write position p, from the graph's own
nodes), checks the attention mask lets each row see exactly keys ``0..p`` (else the
step runs on the compiled graph: left padding), runs the plan with ``positions =
position_ids``, applies the counters' ``add_`` and returns the logits in the model
dtype. Decision: match the decode graph's inputs and writes, not its ~700 nodes: the
plan's own lowering (module by module) decides what the model computes, as in the engine.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from torch_topg.compile.decode_plan import StalePlan
from torch_topg.compile.decode_plan import run as run_plan
from torch_topg.compile.fx import INPLACE_FUNCTIONS, hint

_MODULES = "._modules['"
#: the plan's largest step (``kMaxTokens`` in ``csrc/cpu/decode_plan.h``).
MAX_ROWS = 16


class NotPlanned(Exception):
    """Why a graph does not run on the plan (kept in ``GraphReport.decode_plan``)."""


def _source(n: fx.Node) -> str:
    ga = n.meta.get("grapharg")
    src = getattr(ga, "source", None)
    if src is None:
        return ""
    name = src.name
    return name() if callable(name) else str(name)


def _flat(args: Any) -> list[Any]:
    out: list[Any] = []
    for a in args:
        if isinstance(a, (tuple, list)):
            out += _flat(a)
        elif isinstance(a, dict):
            out += _flat(list(a.values()))
        else:
            out.append(a)
    return out


def _writes(n: fx.Node, ph: set[fx.Node]) -> fx.Node | None:
    """The placeholder ``n`` writes in place, if any."""
    if n.op == "call_method" and n.target.endswith("_") and n.args and n.args[0] in ph:
        return n.args[0]
    if n.op == "call_function":
        if n.target in INPLACE_FUNCTIONS and n.args and n.args[0] in ph:
            return n.args[0]
        schema = getattr(n.target, "_schema", None)
        if schema is not None:
            for i, a in enumerate(schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    v = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
                    if v in ph:
                        return v
    return None


def _cone(gm: fx.GraphModule, out: fx.Node, ph_index: dict[fx.Node, int]) -> tuple[Any, list[int]]:
    """A small GraphModule computing ``out`` from placeholders, and their indices."""
    need: set[fx.Node] = set()
    todo = [out]
    while todo:
        n = todo.pop()
        if n in need:
            continue
        need.add(n)
        if n.op == "get_attr" or n.op == "call_module":
            raise NotPlanned(f"the write position depends on {n.op} {n.target}")
        if n.op == "placeholder":
            ex = n.meta.get("grapharg")
            ex = getattr(ex, "example", None)
            if not isinstance(ex, torch.Tensor) or ex.numel() > MAX_ROWS or ex.is_floating_point():
                raise NotPlanned(f"the write position depends on {_source(n) or n.name}")
            continue
        todo += [a for a in _flat([*n.args, *n.kwargs.values()]) if isinstance(a, fx.Node)]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = []
    for n in gm.graph.nodes:
        if n not in need:
            continue
        if n.op == "placeholder":
            env[n] = g.placeholder(n.name)
            inputs.append(ph_index[n])
        else:
            env[n] = g.node_copy(n, lambda x: env[x])
    g.output(env[out])
    return fx.GraphModule(torch.nn.Module(), g), inputs


def _root_object(expr: str) -> Any:
    """Evaluates a dynamo source (``L['args'][0]``) in the frame being compiled."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except Exception as e:
        raise NotPlanned(f"no frame to find the model in ({type(e).__name__})") from e
    if not expr.startswith("L["):
        raise NotPlanned(f"the model comes from {expr}, not the frame's locals")
    try:
        return eval(expr, {"__builtins__": {}}, {"L": tx.f_locals})
    except Exception as e:
        raise NotPlanned(f"cannot resolve {expr} ({type(e).__name__})") from e


class StaticDecode:
    """The decode graph's replacement: ``__call__(*graph_args)`` runs the step on a
    ``DecodePlan`` over the static cache, or on the compiled graph ``graph_fn``."""

    def __init__(self, graph_fn: Callable[..., Any], model: torch.nn.Module, spec: dict[str, Any],
                 stats: dict[str, Any]) -> None:  # fmt: skip
        self.graph_fn = graph_fn
        self.model = weakref.ref(model)
        self.stats = stats
        self.__dict__.update(spec)
        self.plan: Any = None
        self.key: tuple[Any, ...] = ()
        self.shape = (0, 0)  # (batch, max_len) the step tensors below are for

    def _lower(self, args: tuple[Any, ...]) -> None:
        from torch_topg.compile.decode_plan import Unsupported, lower

        model = self.model()
        if model is None:
            raise NotPlanned("the model is gone")
        kv = [args[i] for i in self.kv]
        b, n = kv[0].size(0), kv[0].size(2)
        try:
            self.plan = lower(model, kv, block_size=n, max_positions=n, cache_layout="bhsd")
        except (Unsupported, RuntimeError) as e:
            raise NotPlanned(str(e)) from e
        self.key = self._key(args)
        if self.shape != (b, n):  # per step: row b's block is b, its slot b * n + p
            self.shape = (b, n)
            self.block_tables = torch.arange(b, dtype=torch.int32).view(b, 1)
            self.cu = torch.arange(b + 1, dtype=torch.int32)
            self.rows = torch.arange(b)
            self.base = self.rows * n
            self.seq_lens = torch.empty(b, dtype=torch.int32)

    def _key(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        k = args[self.kv[0]]
        return (k.size(0), k.size(2), *(args[i].data_ptr() for i in self.kv))

    def _off(self, reason: str) -> None:
        self.plan = None
        self.stats.update(active=False, reason=reason)

    def __call__(self, *args: Any) -> Any:
        if not self.stats["active"]:
            return self.graph_fn(*args)
        if self._key(args) != self.key:  # a new StaticCache (another generate call)
            if args[self.ids].size(0) != args[self.kv[0]].size(0):
                self.stats["fallback_steps"] += 1
                return self.graph_fn(*args)
            try:
                self._lower(args)
            except NotPlanned as e:
                self._off(str(e))
                return self.graph_fn(*args)
        idx = self.index_fn(*[args[i] for i in self.index_inputs])
        if idx.numel() != 1:
            self.stats["fallback_steps"] += 1
            return self.graph_fn(*args)
        p = int(idx)
        if not 0 <= p < self.shape[1] or (self.mask is not None and not self._causal(args, p)):
            self.stats["fallback_steps"] += 1
            return self.graph_fn(*args)
        slots = self.base + p
        self.seq_lens.fill_(p + 1)
        ids = args[self.ids].reshape(-1)
        # No position_ids input (a forward whose signature hides it from generate): the
        # model takes them from the cache position, p for every row (no padding, checked).
        pos = args[self.pos].reshape(-1) if self.pos is not None else self.rows * 0 + p
        run = (ids, pos, slots, self.block_tables, self.seq_lens, self.cu, self.rows)
        try:
            logits = run_plan(self.plan, *run)
        except StalePlan:
            try:  # weights converted or re-pointed since: bind them again
                self._lower(args)
                logits = run_plan(self.plan, *run)
            except (NotPlanned, RuntimeError) as e2:
                self._off(f"relowering after a stale plan failed: {e2}")
                return self.graph_fn(*args)
        for c, ts in self.counters:
            torch._foreach_add_([args[i] for i in ts], c)
        self.stats["steps"] += 1
        out = logits.view(self.shape[0], 1, -1)
        return (out if out.dtype == self.dtype else out.to(self.dtype),)

    def _causal(self, args: tuple[Any, ...], p: int) -> bool:
        """Whether every row sees exactly keys ``0..p`` (no padding: the plan's rule)."""
        m = args[self.mask]
        if m.size(-1) <= p:
            return False
        keep = m if m.dtype == torch.bool else m == 0
        return bool(keep[..., : p + 1].all()) and not bool(keep[..., p + 1 :].any())


def build(gm: fx.GraphModule, example_inputs: list[Any], graph_fn: Callable[..., Any],
          stats: dict[str, Any]) -> Callable[..., Any] | None:  # fmt: skip
    """``graph_fn``'s replacement when ``gm`` is a static-cache decode step the plan runs,
    else None. For a static-cache decode graph (a candidate) ``stats`` gets ``active`` /
    ``reason`` (and ``steps`` while running); for any other graph it stays empty."""
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ph_index = {n: i for i, n in enumerate(ph)}
    inputs = set(ph)
    writes = [(n, w) for n in gm.graph.nodes if (w := _writes(n, inputs)) is not None]
    if not any(n.op == "call_method" and n.target == "index_copy_" for n, _ in writes):
        return None  # no static cache: not a candidate, nothing to report
    stats.update(active=False, reason="", steps=0, fallback_steps=0)
    try:
        spec = _match(gm, example_inputs, ph, ph_index, writes)
    except NotPlanned as e:
        stats["reason"] = str(e)
        return None
    model = spec.pop("model")
    fn = StaticDecode(graph_fn, model, spec, stats)
    stats["active"] = True
    try:
        fn._lower(tuple(example_inputs))
    except NotPlanned as e:
        stats.update(active=False, reason=str(e))
        return None
    return fn


def _match(gm: fx.GraphModule, example_inputs: list[Any], ph: list[fx.Node],
           ph_index: dict[fx.Node, int], writes: list[tuple[fx.Node, fx.Node]]) -> dict[str, Any]:  # fmt: skip
    if len(ph) != len(example_inputs):
        raise NotPlanned("placeholders and inputs differ in number")
    src = {n: _source(n) for n in ph}
    if any("cumulative_length_int" in v for v in src.values()):
        raise NotPlanned(
            "sliding-window cache layers (transformers' StaticSlidingWindowLayer: a ring "
            "that rolls once full) run on the compiled graph"
        )

    def find(suffix: str) -> int | None:
        hits = [ph_index[n] for n in ph if src[n].endswith(suffix)]
        return hits[0] if len(hits) == 1 else None

    ids, pos, mask = find("['input_ids']"), find("['position_ids']"), find("['attention_mask']")
    if ids is None:
        raise NotPlanned("no input_ids input")
    x = example_inputs[ids]
    if x.dim() != 2 or x.size(1) != 1 or x.dtype != torch.long:
        raise NotPlanned(f"input_ids {tuple(x.shape)}: not a one-token step")
    b = x.size(0)
    if b > MAX_ROWS:
        raise NotPlanned(f"batch {b}: the plan runs at most {MAX_ROWS} rows")
    if pos is not None and (
        tuple(example_inputs[pos].shape) != (b, 1) or example_inputs[pos].dtype != torch.long
    ):
        t = example_inputs[pos]
        raise NotPlanned(f"position_ids {t.dtype} {tuple(t.shape)}: expected int64 [{b}, 1]")
    if mask is not None and not isinstance(example_inputs[mask], torch.Tensor):
        mask = None
    kv, counters, index = [], {}, None
    for n, w in writes:
        name = src[w] or w.name
        if n.op == "call_method" and n.target == "index_copy_":
            if len(n.args) != 4 or n.args[1] not in (2, -2) or not isinstance(n.args[2], fx.Node):
                raise NotPlanned(f"{name}: index_copy_ not along the sequence dim")
            if index is None:
                index = n.args[2]
            kv.append(ph_index[w])
        elif n.op == "call_method" and n.target == "add_" and len(n.args) == 2 and not n.kwargs:
            c, t = n.args[1], example_inputs[ph_index[w]]
            if not isinstance(c, int) or t.is_floating_point() or t.numel() > MAX_ROWS:
                raise NotPlanned(f"the graph adds {c!r} to {name} in place")
            counters.setdefault(c, []).append(ph_index[w])
        else:
            raise NotPlanned(f"the graph writes {name} ({n.target})")
    if len(kv) % 2 or any(
        "key" not in src[ph[kv[i]]] or "value" not in src[ph[kv[i + 1]]]
        for i in range(0, len(kv), 2)
    ):
        raise NotPlanned("the cache writes are not (keys, values) pairs per layer")
    k0 = example_inputs[kv[0]]
    if k0.dim() != 4 or k0.size(0) != b:
        raise NotPlanned(f"cache tensors {tuple(k0.shape)}: expected [{b}, kv_heads, len, dim]")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    index_fn, index_inputs = _cone(gm, index, ph_index)
    for n, w in writes:  # the position is read before any counter moves
        if n.target == "add_" and ph_index[w] in index_inputs and order[n] < order[index]:
            raise NotPlanned("the write position is read after its counter moved")
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if not isinstance(out, (tuple, list)) or len(out) != 1 or not isinstance(out[0], fx.Node):
        raise NotPlanned("the graph returns more than the logits")
    ev = out[0].meta.get("example_value")
    try:
        one_token = isinstance(ev, torch.Tensor) and ev.dim() == 3 and hint(ev.shape[1]) == 1
    except ValueError:  # a symbolic size without a hint
        one_token = False
    if not one_token:
        raise NotPlanned("the graph's output is not logits [batch, 1, vocab]")
    params = [n for n in ph if _MODULES in src[n] and isinstance(example_inputs[ph_index[n]],
                                                                  torch.nn.Parameter)]  # fmt: skip
    if not params:
        raise NotPlanned("no module parameters among the inputs")
    first = src[params[0]]
    model = _root_object(first[: first.index(_MODULES)])
    if (
        not isinstance(model, torch.nn.Module)
        or _root_object(first) is not example_inputs[ph_index[params[0]]]
    ):
        raise NotPlanned("the model found is not the one traced")
    return {
        "model": model,
        "ids": ids,
        "pos": pos,
        "mask": mask,
        "kv": kv,
        "counters": sorted(counters.items()),
        "index_fn": index_fn,
        "index_inputs": index_inputs,
        "dtype": ev.dtype,
    }
