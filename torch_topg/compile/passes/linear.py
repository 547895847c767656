"""Linears: projections of one input fused (q/k/v), then every ``F.linear`` -> ``topg::linear``.

Before::

    q = F.linear(x, Wq)
    k = F.linear(x, Wk)
    v = F.linear(x, Wv)
    y = F.linear(z, Wo)

After (``Wqkv = cat(Wq, Wk, Wv)`` once; the parameters are re-pointed at its slices)::

    qkv = topg.linear(x, Wqkv)
    q, k, v = qkv[..., :Nq], qkv[..., Nq:Nq+Nk], qkv[..., Nq+Nk:]
    y = topg.linear(z, Wo)

``topg.linear`` is a GEMV below 16 rows (decode) and a packed GEMM above; it measured
faster than ``F.linear`` at every size of ``python/benchmarks/bench_ops.py`` on the CPU.
The q/k/v slices are strided views; a ``.view`` reading one becomes ``.reshape``
(the same result; a copy only if the strides require one).
"""

from __future__ import annotations

import torch

from torch_topg.compile.passes.base import F, Pass, Site, topg

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


class LinearPass(Pass):
    name = "linear"
    pattern = "linear"

    def run(self, ctx) -> list[Site]:
        graph = ctx.gm.graph
        sites: list[Site] = []
        self._fuse_siblings(ctx, graph, sites)
        for n in list(graph.nodes):
            if not F.is_kind(n, "linear"):
                continue
            x, w, b = n.args[0], F.arg(n, 1, "weight"), F.arg(n, 2, "bias")
            why = None
            if F.dtype(x) not in _FLOAT or F.dtype(w) != F.dtype(x):
                why = f"dtype {F.dtype(x)} with weight {F.dtype(w)}"
            elif b is not None and F.dtype(b) != F.dtype(x):
                why = "bias dtype differs"
            elif F.shape(w) is None or len(F.shape(w)) != 2:
                why = "weight is not 2-d"
            elif not F.val(w).is_contiguous():
                why = "weight is not contiguous"
            if why:
                sites.append(self.site(n, False, why))
                continue
            with graph.inserting_before(n):
                new = graph.call_function(topg("linear"), (x, w, b))
            F.copy_meta(new, n)
            n.replace_all_uses_with(new)
            graph.erase_node(n)
            sites.append(self.site(new, True, "F.linear"))
        return sites

    def _fuse_siblings(self, ctx, graph, sites) -> None:
        groups: dict = {}
        for n in graph.nodes:
            if not F.is_kind(n, "linear"):
                continue
            p = ctx.parameter(F.arg(n, 1, "weight"))
            b = F.arg(n, 2, "bias")
            bp = ctx.parameter(b) if b is not None else None
            if b is not None and (bp is None or bp.dtype != getattr(p, "dtype", None)):
                continue
            if p is not None and p.dim() == 2 and p.dtype in _FLOAT and p.is_contiguous():
                groups.setdefault((n.args[0], b is None), []).append((n, p, bp))
        for (x, _), members in groups.items():
            if len(members) < 2:
                continue
            p0 = members[0][1]
            if any(p.dtype != p0.dtype or p.shape[1] != p0.shape[1] for _, p, _ in members):
                continue
            if F.dtype(x) != p0.dtype or any(F.shape(n)[-1] != p.shape[0] for n, p, _ in members):
                continue
            # Only projections that are reshaped into heads (q/k/v): a strided slice is
            # then as good as a contiguous output.
            if not all(
                u.op == "call_method" and u.target in ("view", "reshape")
                for n, _, _ in members
                for u in n.users
            ):
                continue
            w = ctx.fuse_weights([p for _, p, _ in members], "proj")
            b = None
            if members[0][2] is not None:
                b = ctx.fuse_weights([bp for _, _, bp in members], "proj_bias")
            first = members[0][0]
            with graph.inserting_before(first):
                y = graph.call_function(topg("linear"), (x, w, b))
                start = 0
                for n, p, _ in members:
                    stop = start + p.shape[0]
                    part = graph.call_function(
                        F.operator.getitem, (y, (Ellipsis, slice(start, stop)))
                    )
                    F.copy_meta(part, n)
                    start = stop
                    n.replace_all_uses_with(part)
                    for u in list(part.users):
                        if u.op == "call_method" and u.target == "view":
                            u.target = "reshape"
            for n, _, _ in members:
                graph.erase_node(n)
            names = ", ".join(n.name for n, _, _ in members)
            sites.append(self.site(first, True, f"{len(members)} projections fused: {names}"))
