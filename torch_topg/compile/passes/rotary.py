"""Rotary position embedding (transformers ``apply_rotary_pos_emb``) -> ``topg::rotary_embedding``.

Before (per layer; ``cos``/``sin`` ``[B, S, D]`` are computed once per forward by the
model's rotary module, ``cat((freqs, freqs), -1).cos()``, times the attention scaling)::

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q_embed = q * c + torch.cat((-q[..., D/2:], q[..., :D/2]), -1) * s
    k_embed = k * c + torch.cat((-k[..., D/2:], k[..., :D/2]), -1) * s

After (once per forward; then one in-place call per layer for q and k)::

    cache = torch.cat((cos[..., :D/2], sin[..., :D/2]), -1).reshape(-1, D)   # [B*S, D]
    pos = torch.arange(B*S).view(B, S)
    topg.rotary_embedding(pos, q.transpose(1, 2), k.transpose(1, 2), D, cache, True)
    q_embed, k_embed = q, k          # rotated in place

``q``/``k`` are rotated in place when they are private to the pattern (the usual
projection-output view); otherwise a copy is rotated. Not replaced: cos/sin whose two
halves are not provably equal (not ``cat((f, f), -1)``), partial or interleaved rotary.
"""

from __future__ import annotations

import torch

from torch_topg.compile.passes.base import F, Pass, Site, topg

_VIEWS = ("transpose", "view", "reshape", "unsqueeze", "getitem", "contiguous")


def _sides(add):
    """``q * c + rot(q) * s`` -> (q, c, s) or None."""
    if not F.is_kind(add, "add") or len(add.args) != 2:
        return None
    for m1, m2 in (add.args, add.args[::-1]):
        if not (F.is_kind(m1, "mul") and F.is_kind(m2, "mul")):
            continue
        for cat, s in (m2.args, m2.args[::-1]):
            if not F.is_kind(cat, "cat"):
                continue
            parts, dim = cat.args[0], F.arg(cat, 1, "dim", 0)
            if dim != -1 or not isinstance(parts, (list, tuple)) or len(parts) != 2:
                continue
            neg, x1 = parts
            if not F.is_kind(neg, "neg"):
                continue
            x2 = neg.args[0]
            if not (F.is_kind(x1, "getitem") and F.is_kind(x2, "getitem")):
                continue
            q = x1.args[0]
            if x2.args[0] is not q:
                continue
            for a, c in (m1.args, m1.args[::-1]):
                if a is q:
                    d = F.shape(q)[-1] if F.shape(q) else None
                    if not isinstance(d, int) or d % 2:
                        return None
                    half = d // 2
                    ok1 = x1.args[1] == (Ellipsis, slice(None, half, None))
                    ok2 = x2.args[1] == (Ellipsis, slice(half, None, None))
                    if ok1 and ok2:
                        return q, c, s, (m1, m2, cat, neg, x1, x2)
    return None


def _base(node, trig: str):
    """``node`` = unsqueeze(1)/to/scale of ``cat((f, f), -1).<trig>()`` -> the [B, S, D] tensor."""
    if not F.is_kind(node, "unsqueeze") or F.arg(node, 1, "dim") != 1:
        return None
    base = node.args[0]
    t = base
    while True:
        if F.is_kind(t, "to"):
            t = t.args[0]
        elif F.is_kind(t, "mul") and any(F.scalar(a) is not None for a in t.args):
            t = next(a for a in t.args if F.is_tensor(a))
        else:
            break
    if not F.is_kind(t, trig):
        return None
    cat = t.args[0]
    if not F.is_kind(cat, "cat") or F.arg(cat, 1, "dim", 0) != -1:
        return None
    parts = cat.args[0]
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or parts[0] is not parts[1]:
        return None
    return base if F.shape(base) is not None and len(F.shape(base)) == 3 else None


def _private(q, pattern_nodes) -> bool:
    """``q`` and the views it is made of are read only by the rotary pattern."""
    if any(u not in pattern_nodes for u in q.users):
        return False
    t = q
    while F.is_kind(t, *_VIEWS):
        t = t.args[0]
        if len(t.users) != 1:
            return False
    return isinstance(t, F.Node) and t.op == "call_function" and F.kind(t) != "getitem"


class RotaryPass(Pass):
    name = "rotary"
    pattern = "rotary"

    def run(self, ctx) -> list[Site]:
        graph = ctx.gm.graph
        sites: list[Site] = []
        found = []  # (embed node, q, cos base, sin base, pattern nodes)
        for n in list(graph.nodes):
            m = _sides(n)
            if m is None:
                continue
            q, c, s, nodes = m
            cb, sb = _base(c, "cos"), _base(s, "sin")
            if cb is None or sb is None:
                sites.append(self.site(n, False, "cos/sin are not cat((f, f), -1).cos()/.sin()"))
                continue
            qs = F.shape(q)
            if qs is None or len(qs) != 4 or F.shape(cb)[-1] != qs[-1]:
                sites.append(self.site(n, False, "query is not [B, H, S, D] with full rotary"))
                continue
            if F.dtype(cb) not in (F.dtype(q), torch.float32) or F.dtype(sb) != F.dtype(cb):
                sites.append(self.site(n, False, f"cos/sin dtype {F.dtype(cb)}"))
                continue
            found.append((n, q, cb, sb, set(nodes)))
        caches: dict[tuple, tuple] = {}
        self._expanded: dict = {}
        order = {n: i for i, n in enumerate(graph.nodes)}
        i = 0
        while i < len(found):
            first = found[i]
            pair = None
            if i + 1 < len(found):
                second = found[i + 1]
                if second[2:4] == first[2:4]:
                    late = max(first[0], second[0], key=order.get)
                    early_users = [
                        u for e in (first[0], second[0]) for u in e.users if order[u] < order[late]
                    ]
                    if not early_users:
                        pair = second
            group = [first] if pair is None else [first, pair]
            i += len(group)
            key = first[2:4]
            if key not in caches:
                caches[key] = self._cache(graph, *key)
            self._rewrite(graph, group, caches[key], order)
            sites.extend(self.site(g[0], True, "q*cos + rotate_half(q)*sin") for g in group)
        return sites

    def _cache(self, graph, cb, sb):
        d = F.shape(cb)[-1]
        later = sb if list(graph.nodes).index(sb) > list(graph.nodes).index(cb) else cb
        with graph.inserting_before(later.next):
            c = graph.call_function(F.operator.getitem, (cb, (Ellipsis, slice(None, d // 2))))
            s = graph.call_function(F.operator.getitem, (sb, (Ellipsis, slice(None, d // 2))))
            cat = graph.call_function(torch.cat, ((c, s), -1))
            cache = graph.call_method("reshape", (cat, -1, d))
            b = graph.call_method("size", (cb, 0))
            sq = graph.call_method("size", (cb, 1))
            rows = graph.call_method("size", (cache, 0))
            ar = graph.call_function(torch.arange, (rows,), {"device": F.val(cb).device})
            pos = graph.call_method("view", (ar, b, sq))
        return cache, pos

    def _rewrite(self, graph, group, cache_pos, order) -> None:
        cache, pos = cache_pos
        late = max((g[0] for g in group), key=order.get)
        private = [_private(q, nodes) for _, q, _, _, nodes in group]  # before adding users
        with graph.inserting_before(late):
            rotated = []
            for (_, q, *_), in_place in zip(group, private, strict=True):
                qb = graph.call_method("transpose", (q, 1, 2))
                if not in_place:
                    qb = graph.call_method(
                        "clone", (qb,), {"memory_format": torch.contiguous_format}
                    )
                rotated.append(qb)
            p = self._expanded.get(pos)
            if p is None:  # once per forward: every layer has the same batch
                bq = graph.call_method("size", (rotated[0], 0))
                p = self._expanded[pos] = graph.call_method("expand", (pos, bq, -1))
            d = F.shape(group[0][1])[-1]
            key = rotated[1] if len(rotated) > 1 else None
            graph.call_function(topg("rotary_embedding"), (p, rotated[0], key, d, cache, True))
            for (embed, *_), qb in zip(group, rotated, strict=True):
                out = graph.call_method("transpose", (qb, 1, 2))
                F.copy_meta(out, embed)
                embed.replace_all_uses_with(out)
        for embed, *_ in group:
            graph.erase_node(embed)
