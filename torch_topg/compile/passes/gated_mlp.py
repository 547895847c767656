"""Gated MLP: ``act(x @ Wg^T) * (x @ Wu^T)`` -> one projection + ``topg::silu_and_mul``.

Before (transformers ``LlamaMLP`` and copies)::

    g = F.linear(x, Wg)
    u = F.linear(x, Wu)
    h = F.silu(g) * u            # or F.gelu(g, approximate=...) * u

After (``Wgu = cat(Wg, Wu)`` made once at compile time; ``Wg``/``Wu`` are re-pointed at
its two halves, so the weights stay resident once)::

    h = topg.silu_and_mul(topg.linear(x, Wgu))      # or gelu_and_mul

Quantised projections (``topg.linear_q``, :class:`~torch_topg.quant.QuantizedLinear`)
of one format are fused the same way: their packed rows concatenated, one
``linear_q(x, Wgu_packed, format)``, then the activation op. Each output row's sum is
the same as unfused (the kernel dots each packed row on its own), and the activation is
the kernel the decode plan runs, so the plan matches this graph bitwise.

Not replaced: projections with a bias, weights that are not the model's parameters
(nothing to concatenate once), outputs read elsewhere.
"""

from __future__ import annotations

import torch

from torch_topg.compile.passes.base import F, Pass, Site, topg

_ACTS = {"silu": "silu_and_mul", "gelu": "gelu_and_mul"}


def _is_linear_q(node) -> bool:
    return getattr(node, "op", None) == "call_function" and node.target is topg("linear_q")


class GatedMLPPass(Pass):
    name = "gated_mlp"
    pattern = "mlp"

    def run(self, ctx) -> list[Site]:
        graph = ctx.gm.graph
        sites = []
        for n in list(graph.nodes):
            if not F.is_kind(n, "mul") or len(n.args) != 2:
                continue
            for act, up in (n.args, n.args[::-1]):
                if F.kind(act) in _ACTS and (F.is_kind(up, "linear") or _is_linear_q(up)):
                    break
            else:
                continue
            gate = act.args[0]
            if F.is_kind(gate, "linear") and F.is_kind(up, "linear"):
                sites.append(self._rewrite(ctx, graph, n, act, gate, up))
            elif _is_linear_q(gate) and _is_linear_q(up):
                sites.append(self._rewrite_q(ctx, graph, n, act, gate, up))
        return sites

    def _refusal(self, n, act, gate, up, bias_at: int) -> tuple[str, Site | None]:
        """(gelu's approximate, the refusal or None): what both projection kinds need."""
        if up.args[0] is not gate.args[0]:
            return "none", self.site(n, False, "gate and up read different inputs")
        if F.arg(gate, bias_at, "bias") is not None or F.arg(up, bias_at, "bias") is not None:
            return "none", self.site(n, False, "projection with bias")
        if len(act.users) != 1 or len(gate.users) != 1 or len(up.users) != 1:
            return "none", self.site(n, False, "an intermediate is read elsewhere")
        if F.kind(act) == "gelu":
            approx = F.arg(act, 1, "approximate", "none")
            if approx not in ("none", "tanh"):
                return approx, self.site(n, False, f"gelu approximate={approx!r}")
            return approx, None
        if act.kwargs.get("inplace") or (len(act.args) > 1 and act.args[1] is True):
            return "none", self.site(n, False, "in-place activation")
        return "none", None

    def _replace(
        self, graph, n, act, approx: str, op: str, args: tuple, kwargs: dict, detail: str
    ) -> Site:
        """``n`` becomes ``act_and_mul(op(*args, **kwargs))``."""
        with graph.inserting_before(n):
            y = graph.call_function(topg(op), args, kwargs)
            if F.kind(act) == "silu":
                h = graph.call_function(topg("silu_and_mul"), (y,))
            else:
                h = graph.call_function(topg("gelu_and_mul"), (y,), {"approximate": approx})
        F.copy_meta(h, n)
        n.replace_all_uses_with(h)
        graph.erase_node(n)
        return self.site(n, True, f"{F.kind(act)}(gate) * up, gate/up fused{detail}")

    def _rewrite_q(self, ctx, graph, n, act, gate, up) -> Site:
        """``act(linear_q(x, Qg, f)) * linear_q(x, Qu, f)`` -> one ``linear_q`` + act op."""
        approx, refused = self._refusal(n, act, gate, up, bias_at=3)
        if refused is not None:
            return refused
        fmt, act8 = F.arg(gate, 2, "format"), F.arg(gate, 4, "int8_activations", False)
        if F.arg(up, 2, "format") != fmt or F.arg(up, 4, "int8_activations", False) != act8:
            return self.site(n, False, "gate and up quantised differently")
        qg, qu = ctx.buffer(F.arg(gate, 1, "weight")), ctx.buffer(F.arg(up, 1, "weight"))
        if qg is None or qu is None:
            return self.site(n, False, "packed weights are not module buffers")
        if qg.shape != qu.shape or qg.dtype != qu.dtype or qg.device != qu.device:
            return self.site(n, False, "gate and up packed weights differ in shape/device")
        w = ctx.fuse_weights([qg, qu], "gate_up_q")
        return self._replace(graph, n, act, approx, "linear_q", (gate.args[0], w, fmt, None),
                             {"int8_activations": act8}, f" ({fmt})")  # fmt: skip

    def _rewrite(self, ctx, graph, n, act, gate, up) -> Site:
        approx, refused = self._refusal(n, act, gate, up, bias_at=2)
        if refused is not None:
            return refused
        x = gate.args[0]
        wg, wu = ctx.parameter(F.arg(gate, 1, "weight")), ctx.parameter(F.arg(up, 1, "weight"))
        if wg is None or wu is None:
            return self.site(n, False, "weights are not model parameters")
        if wg.shape != wu.shape or wg.dtype != wu.dtype or wg.device != wu.device:
            return self.site(n, False, "gate and up weights differ in shape/dtype/device")
        if F.dtype(x) != wg.dtype or wg.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return self.site(n, False, f"dtype {F.dtype(x)} with weight {wg.dtype}")
        w = ctx.fuse_weights([wg, wu], "gate_up")
        return self._replace(graph, n, act, approx, "linear", (x, w, None), {}, "")
