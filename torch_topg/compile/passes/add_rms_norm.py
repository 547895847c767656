"""Residual add + RMSNorm -> ``topg::fused_add_rms_norm`` (in place, vLLM semantics).

Before (every decoder layer: the residual stream is added, then normalised)::

    h = a + b                  # h is also the next residual
    y = topg.rms_norm(h, w, eps)

After::

    topg.fused_add_rms_norm(b, a, w, eps)   # a <- a + b ; b <- rms_norm(a + b)
    # uses of h read a, uses of y read b

Runs after the RMSNorm pass. Only when ``a`` and ``b`` are private temporaries that the
add is the last reader of (so overwriting them is invisible), of the same shape and
dtype (no broadcasting or promotion), and not graph inputs or outputs.
"""

from __future__ import annotations

from torch_topg.compile.passes.base import F, Pass, Site, dies_at, fresh, same_shape, topg


class AddRMSNormPass(Pass):
    name = "add_rms_norm"
    pattern = "add_rms_norm"

    def run(self, ctx) -> list[Site]:
        graph = ctx.gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        rms = topg("rms_norm")
        sites = []
        for n in list(graph.nodes):
            if n.op != "call_function" or n.target is not rms:
                continue
            h = n.args[0]
            if not F.is_kind(h, "add") or h.op != "call_function" or len(h.args) != 2:
                continue
            if h.kwargs or any(u.op == "output" for u in h.users):
                sites.append(self.site(n, False, "the sum is a graph output or has alpha"))
                continue
            a, b = h.args
            why = None
            if not (F.is_tensor(a) and F.is_tensor(b)):
                why = "not a tensor + tensor add"
            elif not same_shape(F.shape(a), F.shape(b)) or not (
                F.dtype(a) == F.dtype(b) == F.dtype(h)
            ):
                why = "operands differ in shape or dtype (broadcast / promotion)"
            elif not (fresh(a) and fresh(b)):
                why = "an operand is not a private temporary"
            elif not (dies_at(a, h, order) and dies_at(b, h, order)):
                why = "an operand is read after the add"
            elif any(isinstance(x, F.Node) and order.get(x, -1) > order[h] for x in n.args[1:]):
                why = "the weight is computed after the add (e.g. Gemma's 1 + w)"
            if why:
                sites.append(self.site(n, False, why))
                continue
            _, w, eps = n.args
            with graph.inserting_before(h):
                graph.call_function(topg("fused_add_rms_norm"), (b, a, w, eps))
            n.replace_all_uses_with(b)
            h.replace_all_uses_with(a)
            graph.erase_node(n)
            graph.erase_node(h)
            sites.append(self.site(n, True, "h = a + b; rms_norm(h)"))
        return sites
