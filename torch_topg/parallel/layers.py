"""Tensor-parallel layers. Each holds one rank's shard; the communication is a
``topg::all_reduce`` (a graph op the compile backend can fuse with the next norm).

* :class:`ColumnParallelLinear` - rows ``[start, end)`` of the output features (q/k/v,
  gate/up): no communication, the output is this rank's slice.
* :class:`RowParallelLinear` - columns ``[start, end)`` of the input features (o, down):
  a partial sum, all-reduced (bias added once, after the reduction).
* :class:`VocabParallelEmbedding` - rows ``[start, end)`` of the vocabulary: tokens of
  other shards look up zeros, then all-reduce.
* :class:`ParallelLMHead` - logits of this rank's vocabulary rows, padded to the full
  vocabulary with zeros and all-reduced: every rank ends with the full logits (exact:
  each position has one non-zero term). An all-reduce moves ``tp`` times the bytes of an
  all-gather, but it is the one collective op (and schema) the graph needs; the LM head
  runs on the last position only in ``generate()``.
* :func:`reduce_output` - a MoE block whose experts (and shared expert) each hold a slice
  of the intermediate size: its output is a partial sum, reduced once per block.

All keep ``nn.Linear``'s ``F.linear`` call (so the compile passes that fuse q/k/v and
gate/up still see it) and the parameter names of the module they replace.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torch_topg.ops.collectives import all_reduce
from torch_topg.ops.linear_q import linear_q
from torch_topg.quant.modules import QuantizedLinear


class ColumnParallelLinear(nn.Linear):
    """``nn.Linear`` holding output features ``[start, end)`` of ``full_out_features``."""

    def __init__(
        self,
        in_features: int,
        full_out_features: int,
        shard: tuple[int, int],
        bias: bool = False,
        *,
        device: Any = "meta",
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, shard[1] - shard[0], bias, device=device, dtype=dtype)
        self.full_out_features, self.shard = full_out_features, shard

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, shard={self.shard} of {self.full_out_features}"


class RowParallelLinear(nn.Linear):
    """``nn.Linear`` holding input features ``[start, end)``; the output is summed over
    the group (``reduce=False``: left as this rank's partial sum, for a block that
    reduces once for several projections)."""

    def __init__(
        self,
        full_in_features: int,
        out_features: int,
        shard: tuple[int, int],
        group_name: str,
        bias: bool = False,
        *,
        reduce: bool = True,
        device: Any = "meta",
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(shard[1] - shard[0], out_features, bias, device=device, dtype=dtype)
        self.full_in_features, self.shard = full_in_features, shard
        self.group_name, self.reduce = group_name, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce:
            y = all_reduce(y, self.group_name)
        if self.bias is not None:
            y = y + self.bias  # once, after the sum (not once per rank)
        return y

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, shard={self.shard} of {self.full_in_features}, "
            f"reduce={self.reduce}"
        )

    def quantized(self, format: str, int8_activations: bool = False) -> QuantizedLinear:
        """This shard packed in ``format`` (``torch_topg.quantize`` calls it): the same
        sum over the group, the bias added once after it."""
        return QuantizedRowParallelLinear.from_row(self, format, int8_activations)


class QuantizedRowParallelLinear(QuantizedLinear):
    """A :class:`RowParallelLinear` whose shard is packed: ``linear_q`` over this rank's
    input features, the partial sums reduced over the group, then the bias."""

    @classmethod
    def from_row(
        cls, row: RowParallelLinear, format: str, int8_activations: bool = False
    ) -> QuantizedRowParallelLinear:
        q = cls.from_linear(row, format, int8_activations)
        q.full_in_features, q.shard = row.full_in_features, row.shard
        q.group_name, q.reduce = row.group_name, row.reduce
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear_q(x, self.qweight, self.format, int8_activations=self.int8_activations)
        if self.reduce:
            y = all_reduce(y, self.group_name)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, shard={self.shard} of {self.full_in_features}, "
            f"reduce={self.reduce}"
        )


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, end)`` of a ``[vocab, hidden]`` embedding; output reduced."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        shard: tuple[int, int],
        group_name: str,
        *,
        device: Any = "meta",
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.shard, self.group_name = shard, group_name
        rows = shard[1] - shard[0]
        self.weight = nn.Parameter(
            torch.empty(rows, embedding_dim, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        start, end = self.shard
        mine = (input_ids >= start) & (input_ids < end)
        local = torch.where(mine, input_ids - start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(out, self.group_name)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, shard={self.shard}"


class ParallelLMHead(nn.Module):
    """Logits of vocabulary rows ``[start, end)``, gathered to ``[..., vocab]`` on every
    rank. ``weight`` may be the (tied) :class:`VocabParallelEmbedding` weight."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        shard: tuple[int, int],
        group_name: str,
        weight: nn.Parameter | None = None,
        *,
        device: Any = "meta",
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = hidden_size, vocab_size
        self.shard, self.group_name = shard, group_name
        if weight is None:
            weight = nn.Parameter(
                torch.empty(shard[1] - shard[0], hidden_size, device=device, dtype=dtype),
                requires_grad=False,
            )
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight)  # [..., end - start]
        start, end = self.shard
        full = F.pad(local, (start, self.out_features - end))
        return all_reduce(full, self.group_name)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, shard={self.shard}"


_REDUCED: dict[type, type] = {}


def reduce_output(module: nn.Module, group_name: str) -> nn.Module:
    """Makes ``module`` all-reduce its output (in place: its class becomes a subclass
    whose forward reduces; names, parameters and attributes are unchanged)."""
    cls = type(module)
    if getattr(cls, "_topg_reduces_output", False):
        module.topg_group_name = group_name
        return module
    sub = _REDUCED.get(cls)
    if sub is None:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            out = super(sub, self).forward(*args, **kwargs)
            if isinstance(out, tuple):  # (hidden_states, router_logits, ...)
                return (all_reduce(out[0], self.topg_group_name), *out[1:])
            return all_reduce(out, self.topg_group_name)

        sub = type(
            f"TensorParallel{cls.__name__}",
            (cls,),
            {"forward": forward, "_topg_reduces_output": True, "__module__": __name__},
        )
        _REDUCED[cls] = sub
    module.__class__ = sub
    module.topg_group_name = group_name
    return module
