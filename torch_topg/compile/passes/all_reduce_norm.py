"""All-reduce -> residual add -> RMSNorm -> ``topg::fused_all_reduce_add_rms_norm``.

In a tensor-parallel decoder (``torch_topg.parallel``) the attention output and MLP down
projections end in ``topg::all_reduce``; the decoder layer then adds the residual and
normalises. Runs after ``add_rms_norm``, so the usual input is already half fused.

Before (form A: after the ``add_rms_norm`` pass)::

    x = linear(h, w_o)                          # this rank's partial sum
    s = topg.all_reduce(x, group)
    topg.fused_add_rms_norm(s, residual, w, eps)   # residual <- s + residual; s <- norm
    # later uses of s read the normalised sum

Before (form B: ``add_rms_norm`` disabled or not applicable)::

    s = topg.all_reduce(x, group)
    h = residual + s
    y = topg.rms_norm(h, w, eps)

After (both)::

    topg.fused_all_reduce_add_rms_norm(x, residual, w, eps, group)
    # residual <- all_reduce(x) + residual ; x <- rms_norm(residual)
    # uses of s / y read x, uses of h read residual

Only when ``x`` is a private temporary read by nothing but the all-reduce (it is
overwritten in place), and, for form B, under the ``add_rms_norm`` pass's own conditions
on the residual (a private temporary whose last reader is the add).
"""

from __future__ import annotations

from torch_topg.compile.passes.base import F, Pass, Site, dies_at, fresh, same_shape, topg


def _is_all_reduce(node) -> bool:
    return (
        isinstance(node, F.Node)
        and node.op == "call_function"
        and node.target is topg("all_reduce")
        and len(node.args) == 2
        and not node.kwargs
    )


class AllReduceNormPass(Pass):
    name = "all_reduce_norm"
    pattern = "all_reduce_norm"

    def run(self, ctx) -> list[Site]:
        graph = ctx.gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        fused, rms = topg("fused_add_rms_norm"), topg("rms_norm")
        sites = []
        for n in list(graph.nodes):
            if n.op != "call_function":
                continue
            if n.target is fused and _is_all_reduce(n.args[0]):
                sites.append(self._form_a(graph, n, order))
            elif n.target is rms and F.is_kind(n.args[0], "add"):
                h = n.args[0]
                if h.op == "call_function" and len(h.args) == 2 and not h.kwargs:
                    if any(_is_all_reduce(a) for a in h.args):
                        sites.append(self._form_b(graph, n, h, order))
        return sites

    def _input_ok(self, ar) -> str | None:
        x = ar.args[0]
        if not F.is_tensor(x) or F.dtype(x) != F.dtype(ar):
            return "the all-reduce input is not a tensor of the output's dtype"
        if not fresh(x) or len(x.users) != 1:
            return "the all-reduce input is not a private temporary"
        return None

    def _form_a(self, graph, n, order) -> Site:
        ar, residual, w, eps = n.args
        why = self._input_ok(ar)
        if why is None and any(u is not n and order[u] < order[n] for u in ar.users):
            why = "the reduced sum is read before the norm"
        if why is None and any(u.op == "output" for u in ar.users):
            why = "the reduced sum is a graph output"
        if why:
            return self.site(n, False, why)
        x, group = ar.args
        with graph.inserting_before(n):
            graph.call_function(topg("fused_all_reduce_add_rms_norm"), (x, residual, w, eps, group))
        ar.replace_all_uses_with(x)  # the in-place norm output now lives in x
        graph.erase_node(n)
        graph.erase_node(ar)
        return self.site(n, True, "all_reduce -> fused_add_rms_norm")

    def _form_b(self, graph, n, h, order) -> Site:
        a, b = h.args
        ar, residual = (a, b) if _is_all_reduce(a) else (b, a)
        why = self._input_ok(ar)
        if why is None:
            if len(ar.users) != 1 or any(u.op == "output" for u in h.users):
                why = "the reduced sum or the add is read elsewhere (or is a graph output)"
            elif not same_shape(F.shape(ar), F.shape(residual)) or not (
                F.dtype(ar) == F.dtype(residual) == F.dtype(h)
            ):
                why = "operands differ in shape or dtype (broadcast / promotion)"
            elif not (fresh(residual) and dies_at(residual, h, order)):
                why = "the residual is not a private temporary the add reads last"
            elif any(isinstance(v, F.Node) and order.get(v, -1) > order[h] for v in n.args[1:]):
                why = "the weight is computed after the add"
        if why:
            return self.site(n, False, why)
        x, group = ar.args
        _, w, eps = n.args
        with graph.inserting_before(h):
            graph.call_function(topg("fused_all_reduce_add_rms_norm"), (x, residual, w, eps, group))
        n.replace_all_uses_with(x)
        h.replace_all_uses_with(residual)
        for node in (n, h, ar):
            graph.erase_node(node)
        return self.site(n, True, "all_reduce -> add -> rms_norm")
