"""Quantised MoE experts: :class:`QuantizedExperts`, a transformers 5 experts module
(``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) whose weights are packed,
with ``forward(hidden_states, top_k_index, top_k_weights) = topg::fused_moe_q``.

``torch_topg.quantize`` puts one in place of every experts module ``fused_moe`` can run
(``torch_topg.ops.fused_moe.experts_supported``: no bias, a gate, ``[gate; up]`` rows, a
known activation); the others stay as they are. Being a plain module calling the op's
wrapper, it runs the same under eager, ``enable()``, ``backend="topg"`` and the engine.
"""

from __future__ import annotations

import torch

from torch_topg.formats import dequantize, get_format
from torch_topg.ops.fused_moe import experts_activation as activation_of
from torch_topg.ops.fused_moe import experts_supported
from torch_topg.quant.packing import quantize_weight


def experts_problem(
    module: torch.nn.Module, format: str, down_format: str | None = None
) -> str | None:
    """Why ``module`` cannot become a :class:`QuantizedExperts` with gate / up rows in
    ``format`` and down rows in ``down_format`` (default ``format``); None: it can."""
    why = experts_supported(module)
    if why is not None:
        return why
    _, two_i, h = module.gate_up_proj.shape
    for what, k, fmt in (("hidden size", h, format),
                         ("intermediate size", two_i // 2, down_format or format)):  # fmt: skip
        problem = get_format(fmt).k_problem(k)
        if problem is not None:
            return f"{what} {k} must be {problem}"
    return None


def experts_activation(module: torch.nn.Module) -> str:
    """``fused_moe``'s name of ``module``'s activation (``"silu"`` when not recognised:
    :func:`experts_problem` refuses those modules first)."""
    return activation_of(module) or "silu"


class QuantizedExperts(torch.nn.Module):
    """Experts with packed weights: ``forward`` is ``fused_moe_q``.

    Attributes:
        qgate_up: uint8 buffer ``[E, 2I, row_bytes(H)]`` (gate rows, then up rows).
        qdown: uint8 buffer ``[E, H, row_bytes(I)]``.
        format, down_format, activation, int8_activations: ``fused_moe_q``'s arguments
            (``down_format``: the format of ``qdown``, e.g. Q6_K in a Q4_K_M file).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_dim: int,
        intermediate_dim: int,
        format: str,
        activation: str = "silu",
        int8_activations: bool = False,
        device: torch.device | str | None = None,
        down_format: str | None = None,
    ) -> None:
        super().__init__()
        down_format = down_format or format
        f, fd = get_format(format), get_format(down_format)
        for what, k, ff in (("hidden_dim", hidden_dim, f),
                            ("intermediate_dim", intermediate_dim, fd)):  # fmt: skip
            problem = ff.k_problem(k)
            if problem is not None:
                raise ValueError(f"QuantizedExperts: {what} {k} must be {problem}")
        self.num_experts, self.hidden_dim = num_experts, hidden_dim
        self.intermediate_dim, self.format, self.down_format = intermediate_dim, format, down_format
        self.activation, self.int8_activations = activation, int8_activations
        gu = (num_experts, 2 * intermediate_dim, f.row_bytes(hidden_dim))
        down = (num_experts, hidden_dim, fd.row_bytes(intermediate_dim))
        self.register_buffer("qgate_up", torch.zeros(gu, dtype=torch.uint8, device=device))
        self.register_buffer("qdown", torch.zeros(down, dtype=torch.uint8, device=device))

    @classmethod
    def like(
        cls,
        module: torch.nn.Module,
        format: str,
        int8_activations: bool = False,
        down_format: str | None = None,
    ) -> QuantizedExperts:
        """An empty one with ``module``'s shapes and activation (loading fills it)."""
        problem = experts_problem(module, format, down_format)
        if problem is not None:
            raise ValueError(f"QuantizedExperts: cannot replace {type(module).__name__}: {problem}")
        e, two_i, h = module.gate_up_proj.shape
        return cls(e, h, two_i // 2, format, experts_activation(module), int8_activations,
                   device=module.gate_up_proj.device, down_format=down_format)  # fmt: skip

    @classmethod
    def from_experts(
        cls, module: torch.nn.Module, format: str, int8_activations: bool = False
    ) -> QuantizedExperts:
        """Quantise ``module``'s ``gate_up_proj`` / ``down_proj`` expert by expert."""
        q = cls.like(module, format, int8_activations)
        with torch.no_grad():
            for e in range(q.num_experts):
                q.qgate_up[e].copy_(quantize_weight(module.gate_up_proj[e].detach(), format))
                q.qdown[e].copy_(quantize_weight(module.down_proj[e].detach(), format))
        return q

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``."""
        return (
            dequantize(self.qgate_up, self.format, self.hidden_dim),
            dequantize(self.qdown, self.down_format, self.intermediate_dim),
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        from torch_topg.ops.fused_moe_q import fused_moe_q

        weights = top_k_weights
        if weights.dtype not in (torch.float32, hidden_states.dtype):
            weights = weights.float()
        return fused_moe_q(
            hidden_states, self.qgate_up, self.qdown, weights, top_k_index, self.format,
            down_format=self.down_format, activation=self.activation,
            int8_activations=self.int8_activations,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
            f"intermediate_dim={self.intermediate_dim}, format={self.format}, "
            + (f"down_format={self.down_format}, " if self.down_format != self.format else "")
            + f"activation={self.activation}, int8_activations={self.int8_activations}"
        )


def is_experts(module: torch.nn.Module) -> bool:
    """A transformers-style fused experts module (3-D ``gate_up_proj`` and ``down_proj``)."""
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3
