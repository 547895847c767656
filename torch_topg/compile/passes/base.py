"""What every pass shares: the :class:`Site` record, the :class:`Pass` base and the
:class:`Context` a pass reads real tensors and adds constants through."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from torch_topg.compile import fx as F
from torch_topg.ops import OPS
from torch_topg.utils import hugepages


@dataclass
class Site:
    """One occurrence of a pattern in a graph, replaced or not (and why)."""

    pattern: str
    where: str
    replaced: bool
    detail: str = ""


def where(node: fx.Node) -> str:
    """The module path a node came from (``model.layers.3.self_attn``), else its name."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        for prefix in ("L['self'].", "L['self']", "L['fn']."):
            if path.startswith(prefix):
                path = path[len(prefix) :]
        return f"{path or 'model'} ({node.name})"
    return node.name


@dataclass
class Context:
    """Per-graph state shared by the passes of one compile."""

    gm: fx.GraphModule
    example_inputs: list[Any]
    options: Any
    placeholders: dict[fx.Node, Any] = field(default_factory=dict)
    _n_consts: int = 0

    def __post_init__(self) -> None:
        phs = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        self.placeholders = dict(zip(phs, self.example_inputs, strict=False))

    def parameter(self, node: Any) -> torch.nn.Parameter | None:
        """The real ``nn.Parameter`` a placeholder carries (a model weight), else None."""
        if isinstance(node, fx.Node) and node.op == "placeholder":
            t = self.placeholders.get(node)
            if isinstance(t, torch.nn.Parameter):
                return t
        return None

    def buffer(self, node: Any) -> torch.Tensor | None:
        """The real module buffer a placeholder carries (a packed weight), else None."""
        if isinstance(node, fx.Node) and node.op == "placeholder":
            arg = node.meta.get("grapharg")
            source = getattr(getattr(arg, "source", None), "name", "")
            t = self.placeholders.get(node)
            if "._buffers[" in str(source) and isinstance(t, torch.Tensor):
                return t
        return None

    def constant(self, tensor: torch.Tensor, hint: str) -> fx.Node:
        """A ``get_attr`` node holding ``tensor``, placed before the first non-input node."""
        name = f"_topg_{hint}_{self._n_consts}"
        self._n_consts += 1
        self.gm.register_buffer(name, tensor, persistent=False)
        graph = self.gm.graph
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with graph.inserting_before(first):
            node = graph.get_attr(name)
        node.meta["example_value"] = tensor
        return node

    def fuse_weights(self, params: list[torch.Tensor], hint: str) -> fx.Node:
        """One buffer holding ``params`` concatenated along dim 0; each parameter's data is
        re-pointed at its slice of it, so the weights stay resident once (not twice) and
        in-place updates of a parameter (``load_state_dict``) reach the fused buffer."""
        fused = _adjacent(params)
        if fused is not None:  # fused by an earlier compile (another graph): share it
            return self.constant(fused, hint)
        out = None
        if params[0].device.type == "cpu":  # streamed every step: in huge pages
            shape = (sum(p.shape[0] for p in params), *params[0].shape[1:])
            out = hugepages.empty(shape, params[0].dtype)
        fused = torch.cat([p.detach() for p in params], dim=0, out=out)
        offset = 0
        for p in params:
            n = p.shape[0]
            p.data = fused[offset : offset + n]
            offset += n
        return self.constant(fused, hint)


def _adjacent(params: list[torch.nn.Parameter]) -> torch.Tensor | None:
    """A view spanning ``params`` when they already lie back to back, in order, in one
    storage (each contiguous, same dtype and trailing shape); else None."""
    p0 = params[0]
    storage = p0.untyped_storage()
    offset = p0.storage_offset()
    rows = 0
    for p in params:
        if (
            p.untyped_storage().data_ptr() != storage.data_ptr()
            or p.dtype != p0.dtype
            or p.shape[1:] != p0.shape[1:]
            or not p.is_contiguous()
            or p.storage_offset() != offset
        ):
            return None
        offset += p.numel()
        rows += p.shape[0]
    view = torch.empty(0, dtype=p0.dtype, device=p0.device)
    stride = p0.detach().stride()
    view.set_(storage, p0.storage_offset(), (rows, *p0.shape[1:]), stride)
    return view


class Pass:
    """A graph rewrite. Subclasses set ``name`` / ``pattern`` and implement ``run``.

    ``run`` must either finish its rewrite or raise before changing the graph is
    unsafe: the pass manager restores the graph it had before the pass on any error.
    """

    name: ClassVar[str]
    #: The pattern family the sites are reported under (explain).
    pattern: ClassVar[str]

    def run(self, ctx: Context) -> list[Site]:
        raise NotImplementedError

    # helpers -------------------------------------------------------------------------
    def site(self, node: fx.Node, replaced: bool, detail: str = "") -> Site:
        return Site(self.pattern, where(node), replaced, detail)


def topg(name: str) -> Any:
    """``torch.ops.topg.<name>.default``; a ``KeyError`` for an op not in the registry."""
    return OPS[name].overload


# Producers whose output is a fresh tensor (never a view of something else).
_FRESH_KINDS = {"linear", "add", "mul", "sdpa", "matmul"}


def fresh(node: Any) -> bool:
    """``node`` makes a new tensor that nothing else aliases (a private temporary if it
    has one reader): a fresh-result aten kind, or a ``topg`` op whose registry entry
    says it returns a new tensor, possibly behind a view/reshape nobody else reads."""
    if not isinstance(node, F.Node) or node.op in ("placeholder", "get_attr"):
        return False
    if F.is_kind(node, "view", "reshape"):  # a reshaped temporary nobody else reads
        src = node.args[0]
        return isinstance(src, F.Node) and len(src.users) == 1 and fresh(src)
    if F.kind(node) in _FRESH_KINDS:
        return True
    if F.kind(node) is None and node.op == "call_function":
        t = node.target
        if getattr(t, "namespace", None) == "topg":
            spec = OPS.get(t._opname)
            return spec is not None and spec.returns_new_tensor
        name = getattr(t, "__name__", "")
        return name in ("embedding",)
    return False


def same_shape(x: Any, y: Any) -> bool:
    """Provably equal shapes, without adding guards on symbolic sizes."""
    if x is None or y is None or len(x) != len(y):
        return False
    return all(statically_known_true(a == b) for a, b in zip(x, y, strict=True))


def dies_at(node: fx.Node, at: fx.Node, order: dict[fx.Node, int]) -> bool:
    """``node`` is read by no one after ``at`` and is not a graph output."""
    for u in node.users:
        if u.op == "output" or (u is not at and order.get(u, -1) > order[at]):
            return False
    return True


__all__ = [
    "Context",
    "F",
    "Pass",
    "Site",
    "dies_at",
    "fresh",
    "same_shape",
    "topg",
    "where",
]
