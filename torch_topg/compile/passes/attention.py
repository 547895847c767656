"""Attention: ``scaled_dot_product_attention`` and hand-written eager attention -> ``topg::attention``.

Before (SDPA, transformers ``sdpa``; GQA through ``enable_gqa`` or ``repeat_kv``)::

    k = repeat_kv(k)            # optional: x[:, :, None].expand(...).reshape(...)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c, scale=s)

Before (transformers ``eager``)::

    w = torch.matmul(q, repeat_kv(k).transpose(2, 3)) * s
    w = w + m                   # optional additive mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=0.0, training=False)
    o = torch.matmul(w, repeat_kv(v))

After (``[B, H, S, D]`` in and out, as the graph had it; kv heads not repeated)::

    o = topg.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                       causal=c, scale=s, mask=m).transpose(1, 2)

Not replaced: dropout, a causal SDPA whose query and key lengths are not provably equal
(SDPA's ``is_causal`` is top-left aligned, topg's bottom-right: they agree only then).
"""

from __future__ import annotations

import math

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from torch_topg.compile.passes.base import F, Pass, Site, topg


def _unrepeat(node):
    """``repeat_kv(x)`` -> x (``x[:, :, None].expand(b, h, n, s, d).reshape(b, h*n, s, d)``)."""
    if F.is_kind(node, "reshape", "view"):
        e = node.args[0]
        if F.is_kind(e, "expand"):
            g = e.args[0]
            if F.is_kind(g, "getitem"):
                idx = g.args[1]
                if (
                    isinstance(idx, tuple)
                    and len(idx) == 3
                    and idx[2] is None
                    and all(isinstance(s, slice) and s == slice(None) for s in idx[:2])
                ):
                    return g.args[0]
    return node


def _same(a, b) -> bool:
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def _emit(graph, anchor, q, k, v, causal, scale, mask):
    with graph.inserting_before(anchor):
        qt = graph.call_method("transpose", (q, 1, 2))
        kt = graph.call_method("transpose", (k, 1, 2))
        vt = graph.call_method("transpose", (v, 1, 2))
        out = graph.call_function(
            topg("attention"), (qt, kt, vt), {"causal": causal, "scale": scale, "mask": mask}
        )
        return graph.call_method("transpose", (out, 1, 2))


def _meta(out, n) -> None:
    """Example values for the emitted nodes: the output keeps the replaced node's; the
    ``topg::attention`` node under it gets its ``[B, S, H, D]`` shape."""
    F.copy_meta(out, n)
    v = F.val(n)
    if isinstance(v, torch.Tensor) and v.dim() == 4:
        out.args[0].meta["example_value"] = v.transpose(1, 2)


def _check_heads(q, k, v, gqa_ok: bool) -> str | None:
    qs, ks, vs = F.shape(q), F.shape(k), F.shape(v)
    if qs is None or ks is None or vs is None or len(qs) != 4 or len(ks) != 4:
        return "query/key/value are not 4-d [B, H, S, D]"
    if F.dtype(q) != F.dtype(k) or F.dtype(q) != F.dtype(v):
        return "query/key/value dtypes differ"
    if F.dtype(q) not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {F.dtype(q)}"
    hq, hk = qs[1], ks[1]
    if not _same(hk, vs[1]):
        return "key and value head counts differ"
    if not _same(hq, hk):
        if not gqa_ok:
            return "query and key head counts differ without enable_gqa"
        if not (isinstance(hq, int) and isinstance(hk, int) and hq % hk == 0):
            return f"query heads {hq} not a multiple of kv heads {hk}"
    return None


class AttentionPass(Pass):
    name = "attention"
    pattern = "attention"

    def run(self, ctx) -> list[Site]:
        graph = ctx.gm.graph
        sites: list[Site] = []
        for n in list(graph.nodes):
            if F.is_kind(n, "sdpa"):
                sites.append(self._sdpa(graph, n))
            elif F.is_kind(n, "matmul"):
                site = self._eager(graph, n)
                if site is not None:
                    sites.append(site)
        return sites

    def _sdpa(self, graph, n) -> Site:
        q, k, v = n.args[0], F.arg(n, 1, "key"), F.arg(n, 2, "value")
        mask = F.arg(n, 3, "attn_mask")
        dropout = F.arg(n, 4, "dropout_p", 0.0)
        causal = F.arg(n, 5, "is_causal", False)
        scale = n.kwargs.get("scale", n.args[6] if len(n.args) > 6 else None)
        gqa = n.kwargs.get("enable_gqa", n.args[7] if len(n.args) > 7 else False)
        if dropout != 0.0:
            return self.site(n, False, f"dropout_p={dropout}")
        if not isinstance(causal, bool) or not isinstance(gqa, bool):
            return self.site(n, False, "is_causal/enable_gqa not constant")
        if scale is not None and F.scalar(scale) is None:
            return self.site(n, False, "scale is not a constant")
        k0, v0 = _unrepeat(k), _unrepeat(v)
        if k0 is not k and v0 is not v:
            k, v, gqa = k0, v0, True
        why = _check_heads(q, k, v, gqa)
        if why:
            return self.site(n, False, why)
        if mask is not None:
            if causal:
                return self.site(n, False, "both attn_mask and is_causal")
            if F.dtype(mask) not in (torch.bool, F.dtype(q), torch.float32):
                return self.site(n, False, f"mask dtype {F.dtype(mask)}")
            ms = F.shape(mask)
            if ms is None or len(ms) > 4:
                return self.site(n, False, "mask is not a tensor of at most 4 dims")
        if causal and not _same(F.shape(q)[2], F.shape(k)[2]):
            return self.site(n, False, "is_causal with query/key lengths not provably equal")
        out = _emit(graph, n, q, k, v, causal, scale, mask)
        _meta(out, n)
        n.replace_all_uses_with(out)
        graph.erase_node(n)
        return self.site(n, True, f"sdpa{' causal' if causal else ''}{' masked' if mask else ''}")

    def _eager(self, graph, n) -> Site | None:
        """``matmul(softmax(matmul(q, k^T) * s [+ m]), v)``; None when ``n`` is not one."""
        p, v = n.args[0], n.args[1]
        p = F.strip(p, "to")
        if F.is_kind(p, "dropout"):
            if F.arg(p, 1, "p", 0.5) != 0.0 and F.arg(p, 2, "training", True) is not False:
                return None
            p = F.strip(p.args[0], "to")
        if not F.is_kind(p, "softmax"):
            return None
        dim = F.arg(p, 1, "dim")
        if dim not in (-1, 3):
            return None
        s = p.args[0]
        mask = None
        if F.is_kind(s, "add"):
            a, b = F.operands(s)
            if F.is_kind(a, "mul", "div") or F.is_kind(a, "matmul"):
                s, mask = a, b
            else:
                s, mask = b, a
        scale = 1.0
        if F.is_kind(s, "mul", "div"):
            a, b = F.operands(s)
            if F.is_tensor(a) and F.scalar(b) is not None:
                t, c = a, F.scalar(b)
            elif F.is_kind(s, "mul") and F.is_tensor(b) and F.scalar(a) is not None:
                t, c = b, F.scalar(a)
            else:
                return self.site(n, False, "score scale is not a constant")
            scale = c if F.is_kind(s, "mul") else 1.0 / c
            s = t
        if not F.is_kind(s, "matmul"):
            return None
        q, kt = s.args[0], s.args[1]
        dims = kt.args[1:3] if F.is_kind(kt, "transpose") else ()
        if (
            len(dims) != 2
            or not all(isinstance(x, int) for x in dims)
            or sorted(x % 4 for x in dims) != [2, 3]
        ):
            return self.site(n, False, "key is not transposed on its last two dims")
        k = kt.args[0]
        k0, v0 = _unrepeat(k), _unrepeat(v)
        if (k0 is k) != (v0 is v):
            return self.site(n, False, "key and value are repeated differently")
        k, v = k0, v0
        why = _check_heads(q, k, v, True)
        if why:
            return self.site(n, False, why)
        if mask is not None and (F.shape(mask) is None or len(F.shape(mask)) > 4):
            return self.site(n, False, "mask is not a tensor of at most 4 dims")
        d = F.shape(q)[3]
        if isinstance(d, int) and math.isclose(scale, 1.0 / math.sqrt(d), rel_tol=1e-6):
            scale = None
        out = _emit(graph, n, q, k, v, False, scale, mask)
        _meta(out, n)
        n.replace_all_uses_with(out)
        graph.erase_node(n)
        return self.site(n, True, f"eager matmul-softmax-matmul{' masked' if mask else ''}")
