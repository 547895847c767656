"""Gated MLP: ``act(x @ Wg^T) * (x @ Wu^T)`` -> one projection + ``topg::silu_and_mul``.

Before (transformers ``LlamaMLP`` and copies)::

    g = F.linear(x, Wg)
    u = F.linear(x, Wu)
    h = F.silu(g) * u            # or F.gelu(g, approximate=...) * u

After (``Wgu = cat(Wg, Wu)`` made once at compile time; ``Wg``/``Wu`` are re-pointed at
its two halves, so the weights stay resident once)::

    h = topg.silu_and_mul(topg.linear(x, Wgu))      # or gelu_and_mul

Not replaced: projections with a bias, weights that are not the model's parameters
(nothing to concatenate once), outputs read elsewhere.
"""

from __future__ import annotations

import torch

from torch_topg.compile.passes.base import F, Pass, Site, topg

_ACTS = {"silu": "silu_and_mul", "gelu": "gelu_and_mul"}


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
                if F.kind(act) in _ACTS and F.is_kind(up, "linear"):
                    break
            else:
                continue
            gate = act.args[0]
            if not F.is_kind(gate, "linear"):
                continue
            sites.append(self._rewrite(ctx, graph, n, act, gate, up))
        return sites

    def _rewrite(self, ctx, graph, n, act, gate, up) -> Site:
        x = gate.args[0]
        if up.args[0] is not x:
            return self.site(n, False, "gate and up read different inputs")
        if F.arg(gate, 2, "bias") is not None or F.arg(up, 2, "bias") is not None:
            return self.site(n, False, "projection with bias")
        if len(act.users) != 1 or len(gate.users) != 1 or len(up.users) != 1:
            return self.site(n, False, "an intermediate is read elsewhere")
        approx = "none"
        if F.kind(act) == "gelu":
            approx = F.arg(act, 1, "approximate", "none")
            if approx not in ("none", "tanh"):
                return self.site(n, False, f"gelu approximate={approx!r}")
        elif act.kwargs.get("inplace") or (len(act.args) > 1 and act.args[1] is True):
            return self.site(n, False, "in-place activation")
        wg, wu = ctx.parameter(F.arg(gate, 1, "weight")), ctx.parameter(F.arg(up, 1, "weight"))
        if wg is None or wu is None:
            return self.site(n, False, "weights are not model parameters")
        if wg.shape != wu.shape or wg.dtype != wu.dtype or wg.device != wu.device:
            return self.site(n, False, "gate and up weights differ in shape/dtype/device")
        if F.dtype(x) != wg.dtype or wg.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return self.site(n, False, f"dtype {F.dtype(x)} with weight {wg.dtype}")
        w = ctx.fuse_weights([wg, wu], "gate_up")
        with graph.inserting_before(n):
            y = graph.call_function(topg("linear"), (x, w, None))
            if F.kind(act) == "silu":
                h = graph.call_function(topg("silu_and_mul"), (y,))
            else:
                h = graph.call_function(topg("gelu_and_mul"), (y,), {"approximate": approx})
        F.copy_meta(h, n)
        n.replace_all_uses_with(h)
        graph.erase_node(n)
        return self.site(n, True, f"{F.kind(act)}(gate) * up, gate/up fused")
