"""MoE routing: ``softmax``/``sigmoid`` -> ``topk`` -> (renormalise) -> ``topg::moe_topk``.

Before (transformers ``MixtralTopKRouter``, Qwen2-MoE and copies)::

    p = F.softmax(logits.float(), dim=-1)         # or torch.sigmoid(logits)
    w, ids = torch.topk(p, k, dim=-1)
    w /= w.sum(dim=-1, keepdim=True)              # optional
    out = experts(x, ids, w)

After::

    w, ids32 = topg.moe_topk(logits, k, scoring="softmax", renormalize=True)
    ids = ids32.long()                            # the dtype the graph had
    out = experts(x, ids, w)

The experts themselves become ``topg::fused_moe`` while dynamo traces them (see
``torch_topg.compile.experts``); together the MoE block is two native calls.
Not replaced: a softmax whose probabilities are also read elsewhere (other than the
router logits output), a top-k over another dim, ``largest=False``.
"""

from __future__ import annotations

import torch

from torch_topg.compile.passes.base import F, Pass, Site, topg


class MoERouterPass(Pass):
    name = "moe_router"
    pattern = "moe_router"

    def run(self, ctx) -> list[Site]:
        graph = ctx.gm.graph
        sites = []
        for n in list(graph.nodes):
            if F.is_kind(n, "topk"):
                site = self._rewrite(graph, n)
                if site is not None:
                    sites.append(site)
        return sites

    def _rewrite(self, graph, n) -> Site | None:
        probs, k = n.args[0], F.arg(n, 1, "k")
        if not F.is_kind(probs, "softmax", "sigmoid"):
            return None
        scoring = F.kind(probs)
        if not isinstance(k, int):
            return self.site(n, False, "k is not a constant")
        if F.arg(n, 2, "dim", -1) not in (-1, 1) or F.arg(n, 3, "largest", True) is not True:
            return self.site(n, False, "top-k over another dim or smallest")
        if scoring == "softmax" and F.arg(probs, 1, "dim") not in (-1, 1):
            return self.site(n, False, "softmax over another dim")
        if len(probs.users) != 1:
            return self.site(n, False, "the probabilities are read elsewhere")
        logits = F.strip(probs.args[0], "to")
        ls = F.shape(logits)
        if ls is None or len(ls) != 2:
            return self.site(n, False, "router logits are not [T, E]")
        if F.dtype(logits) not in (torch.float32, torch.bfloat16, torch.float16):
            return self.site(n, False, f"logits dtype {F.dtype(logits)}")
        outs = {u.args[1]: u for u in n.users if F.is_kind(u, "getitem")}
        if set(outs) - {0, 1} or len(outs) != len(n.users):
            return self.site(n, False, "top-k result used other than as (values, indices)")
        vals, ids = outs.get(0), outs.get(1)
        renorm, div = False, None
        if vals is not None:
            us = list(vals.users)
            divs = [u for u in us if F.is_kind(u, "div") and u.args[0] is vals]
            if len(divs) == 1:
                s = divs[0].args[1]
                if (
                    F.is_kind(s, "sum")
                    and s.args[0] is vals
                    and F.arg(s, 1, "dim") in (-1, 1, (-1,), [-1])
                    and F.arg(s, 2, "keepdim", False) is True
                    and set(us) == {divs[0], s}
                ):
                    renorm, div = True, divs[0]
        with graph.inserting_before(n):
            r = graph.call_function(
                topg("moe_topk"), (logits, k), {"scoring": scoring, "renormalize": renorm}
            )
            w = graph.call_function(F.operator.getitem, (r, 0))
            i32 = graph.call_function(F.operator.getitem, (r, 1))
            i = graph.call_method("to", (i32, F.dtype(ids) if ids is not None else torch.int64))
        if ids is not None:
            F.copy_meta(i, ids)
            ids.replace_all_uses_with(i)
        if div is not None:
            # ``w /= sum`` is in place: later readers of ``vals`` see the normalised values.
            div.replace_all_uses_with(w)
            vals.replace_all_uses_with(w)
        elif vals is not None:
            vals.replace_all_uses_with(w)
        if F.dtype(vals) not in (None, torch.float32):
            with graph.inserting_after(w):
                cast = graph.call_method("to", (w, F.dtype(vals)))
            w.replace_all_uses_with(cast)
            cast.args = (w, F.dtype(vals))
        # The old chain is dead now; erase it explicitly: ``w /= s`` is an in-place op
        # that the generic clean-up keeps (it may write memory someone reads).
        for dead in (div, div.args[1] if div is not None else None, vals, ids, n, probs):
            if isinstance(dead, F.Node) and not dead.users:
                graph.erase_node(dead)
        return self.site(n, True, f"{scoring} top-{k}{' renormalised' if renorm else ''}")
