"""RMSNorm -> ``topg::rms_norm``.

Before (transformers ``LlamaRMSNorm`` and its copies in Mistral, Qwen2, Mixtral...)::

    x32 = x.to(torch.float32)
    v = x32.pow(2).mean(-1, keepdim=True)
    y = x32 * torch.rsqrt(v + eps)
    out = weight * y.to(x.dtype)

or ``F.rms_norm(x, (H,), weight, eps)``, or the weight applied in float32 and the
product rounded once (OLMo 2; Gemma's ``(1 + w)``, the weight a float32 expression)::

    out = (weight * y).to(x.dtype)      # y = x32 * rsqrt(...), float32

which is what topg rounds: once, to the input dtype.

After::

    out = topg.rms_norm(x, weight, eps)

Not replaced: a weight that is not a 1-d tensor of the hidden size, an output dtype that
is not the input's (topg rounds once to the input dtype), a norm over another dim.
"""

from __future__ import annotations

import torch

from torch_topg.compile.passes.base import F, Pass, Site, topg


def _mean_last(node) -> bool:
    dim = F.arg(node, 1, "dim")
    keep = F.arg(node, 2, "keepdim", False)
    shp = F.shape(node.args[0])
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return keep is True and shp is not None and dim in (-1, len(shp) - 1)


class RMSNormPass(Pass):
    name = "rms_norm"
    pattern = "rms_norm"

    def run(self, ctx) -> list[Site]:
        graph = ctx.gm.graph
        sites = []
        for n in list(graph.nodes):
            if F.is_kind(n, "rsqrt"):
                site = self._composed(graph, n)
            elif F.is_kind(n, "rms_norm"):
                site = self._functional(graph, n)
            else:
                continue
            if site is not None:
                sites.append(site)
        return sites

    def _replace(self, graph, out, x, weight, eps, what: str) -> Site:
        ws, xs = F.shape(weight), F.shape(x)
        if ws is None or len(ws) != 1 or xs is None or str(ws[0]) != str(xs[-1]):
            return self.site(out, False, "weight is not a 1-d tensor of the hidden size")
        if F.dtype(out) != F.dtype(x):
            return self.site(out, False, f"output dtype {F.dtype(out)} != input {F.dtype(x)}")
        if F.dtype(x) not in (torch.float32, torch.bfloat16, torch.float16):
            return self.site(out, False, f"dtype {F.dtype(x)}")
        if F.dtype(weight) not in (F.dtype(x), torch.float32):
            return self.site(out, False, f"weight dtype {F.dtype(weight)}")
        with graph.inserting_before(out):
            new = graph.call_function(topg("rms_norm"), (x, weight, float(eps)))
        F.copy_meta(new, out)
        out.replace_all_uses_with(new)
        graph.erase_node(out)
        return self.site(out, True, what)

    def _composed(self, graph, r) -> Site | None:
        add = r.args[0]
        if not F.is_kind(add, "add"):
            return None
        a, b = F.operands(add)
        mean, eps = (a, F.scalar(b)) if F.is_tensor(a) else (b, F.scalar(a))
        if eps is None or not F.is_kind(mean, "mean") or not _mean_last(mean):
            return None
        sq = mean.args[0]
        if not (F.is_kind(sq, "pow") and F.arg(sq, 1, "exponent") == 2):
            if not (F.is_kind(sq, "mul") and sq.args[0] is sq.args[1]):
                return None
        x32 = sq.args[0]
        x = F.strip(x32, "to")
        # y = x32 * rsqrt(...), then optional cast, then weight * y
        y = F.only_user(r)
        if not F.is_kind(y, "mul") or F.other(y, r) is not x32:
            return None
        z = y
        while F.is_kind(F.only_user(z), "to"):
            z = F.only_user(z)
        out = F.only_user(z)
        if not F.is_kind(out, "mul"):
            return None
        weight = F.other(out, z)
        if not F.is_tensor(weight):
            return None
        if not (x32 is x or F.dtype(x32) == torch.float32):
            return None
        cast = F.only_user(out)
        if (
            F.dtype(out) == torch.float32
            and F.dtype(x) != torch.float32
            and F.is_kind(cast, "to")
            and F.dtype(cast) == F.dtype(x)
        ):  # (w * y) in float32, rounded once to x's dtype: the op's own rounding
            site = self._replace(
                graph, cast, x, weight, eps, "(x * rsqrt(mean(x^2) + eps) * w).to()"
            )
            if not out.users:
                graph.erase_node(out)
            return site
        return self._replace(graph, out, x, weight, eps, "x * rsqrt(mean(x^2) + eps) * w")

    def _functional(self, graph, n) -> Site:
        x, shape, weight = n.args[0], F.arg(n, 1, "normalized_shape"), F.arg(n, 2, "weight")
        eps = F.arg(n, 3, "eps")
        if weight is None or eps is None or F.scalar(eps) is None:
            return self.site(n, False, "F.rms_norm without weight or constant eps")
        if not isinstance(shape, (list, tuple)) or len(shape) != 1:
            return self.site(n, False, "normalized over more than the last dim")
        return self._replace(graph, n, x, weight, eps, "F.rms_norm")
