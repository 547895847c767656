"""Small helpers to read and rewrite dynamo FX graphs (torch-level IR).

Dynamo records the functions a model calls: ``torch._C._nn.linear``, ``operator.mul``,
``x.pow(2)`` as a ``call_method`` and so on. Passes do not compare targets directly:
:func:`kind` maps every spelling of an operation to one canonical name (``x.pow(2)``,
``torch.pow(x, 2)`` and ``x ** 2`` are all ``"pow"``), and :func:`arg` reads an argument
by position or keyword.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

Node = fx.Node

#: Functions that write their first argument (augmented assignment, ``x[i] = v``): a
#: graph keeps them whether or not their result is used.
INPLACE_FUNCTIONS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.setitem,
}

_FUNCTIONS: dict[Any, str] = {
    torch._C._nn.linear: "linear",
    F.linear: "linear",
    F.scaled_dot_product_attention: "sdpa",
    torch._C._nn.scaled_dot_product_attention: "sdpa",
    operator.add: "add",
    torch.add: "add",
    operator.iadd: "add",
    operator.mul: "mul",
    torch.mul: "mul",
    operator.imul: "mul",
    operator.truediv: "div",
    torch.div: "div",
    operator.itruediv: "div",
    operator.neg: "neg",
    torch.neg: "neg",
    operator.pow: "pow",
    torch.pow: "pow",
    torch.rsqrt: "rsqrt",
    torch.mean: "mean",
    torch.cat: "cat",
    torch.concat: "cat",
    operator.getitem: "getitem",
    F.silu: "silu",
    F.gelu: "gelu",
    torch.sigmoid: "sigmoid",
    F.softmax: "softmax",
    torch.softmax: "softmax",
    torch.topk: "topk",
    torch.matmul: "matmul",
    operator.matmul: "matmul",
    torch.transpose: "transpose",
    torch.sum: "sum",
    F.dropout: "dropout",
    F.rms_norm: "rms_norm",
    torch.rms_norm: "rms_norm",
}
_METHODS = {
    "__add__": "add",
    "__mul__": "mul",
    "__getitem__": "getitem",
    "add_": "add",
    "div_": "div",
    "__truediv__": "div",
    "__itruediv__": "div",
    "float": "to",
    "type_as": "to",
}


def kind(node: Any) -> str | None:
    """Canonical name of the operation ``node`` performs, or None."""
    if not isinstance(node, Node):
        return None
    if node.op == "call_function":
        try:
            return _FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            return None
    if node.op == "call_method":
        return _METHODS.get(node.target, node.target)
    return None


def is_kind(node: Any, *names: str) -> bool:
    return kind(node) in names


def arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``index`` (positional, counting ``self`` of a method) or keyword ``name``."""
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def val(node: Any) -> Any:
    """The example value dynamo recorded for ``node`` (a FakeTensor), or the constant."""
    if isinstance(node, Node):
        return node.meta.get("example_value")
    return node


def shape(node: Any) -> tuple[Any, ...] | None:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype(node: Any) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def is_tensor(node: Any) -> bool:
    return isinstance(val(node), torch.Tensor)


def only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def strip(node: Any, *names: str) -> Any:
    """Follows ``node`` up through single-input no-op-like calls (``to``, ``contiguous``...)."""
    while is_kind(node, *names):
        node = node.args[0]
    return node


def scalar(x: Any) -> float | int | None:
    """A Python number (graph constants are stored inline), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return x
    return None


def operands(node: Node) -> tuple[Any, Any]:
    """The two operands of a binary call (function or method)."""
    return node.args[0], node.args[1]


def other(node: Node, this: Any) -> Any:
    a, b = operands(node)
    return b if a is this else a


def copy_meta(dst: Node, src: Node) -> Node:
    if "example_value" in src.meta:
        dst.meta["example_value"] = src.meta["example_value"]
    return dst


def hint(x: Any) -> Any:
    """A node's example int/SymInt as a plain int (its hint), or a constant as is."""
    if isinstance(x, fx.Node):
        x = x.meta.get("example_value")
    if isinstance(x, torch.SymInt):  # its hint, without guarding on it (no int(x))
        h = x.node.hint
        if h is None:
            raise ValueError("no hint")
        return h
    return x
