"""What a decoder layer's norms do, measured (:mod:`torch_topg.compile.decode_plan`).

A norm's name does not say its role: Llama's ``post_attention_layernorm`` normalises the
residual stream before the MLP, OLMo 2's the attention's output before it joins the
stream. So the layer's own ``forward`` is run once on a copy of the layer whose children
are recording stubs (the model is not touched: the copy has its own child table, the
real modules never run). Each stub returns a fresh random tensor and records which tensor
it was given; from that data flow every norm gets one of four roles, and the layer's
output is checked against the decoder the plan computes with those roles::

    a = attn(pre_attn(x) or x);  s = x + (post_attn(a) or a) * m
    f = mlp(pre_ffw(s) or s);    out = s + (post_ffw(f) or f) * m

(``m``: the residual multiplier, Granite's; 1 elsewhere). A layer that computes anything
else (a parallel block, a norm on both sides of a sum, another residual) is
:class:`~torch_topg.compile.decode_plan.Unsupported`, with what was seen.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

#: The roles of a layer's norms, in the order the plan binds them (``decode_plan.h``:
#: ln_in, ln_post, post_attn_norm, post_ffw_norm).
ROLES = ("pre_attn", "pre_ffw", "post_attn", "post_ffw")


class _Stub(torch.nn.Module):
    """Records the tensor it is given, returns a fresh one (a tuple for the attention)."""

    def __init__(self, hidden: int, seed: int, pair: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.out = torch.randn(1, 1, hidden, generator=g)
        self.pair = pair
        self.seen: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor | None = None, *args: Any, **kw: Any) -> Any:
        self.seen = hidden_states if hidden_states is not None else kw.get("x")
        return (self.out, None) if self.pair else self.out


def norm_roles(layer: torch.nn.Module, name: str, norms: list[str], hidden: int,
               residual_multiplier: float) -> dict[str, str]:  # fmt: skip
    """``{role: child name}`` of the norms ``norms`` of ``layer`` (roles of :data:`ROLES`;
    an absent role is not a key), measured by running the layer's forward on stubs."""
    from torch_topg.compile.plan_errors import Unsupported

    stubs = {n: _Stub(hidden, i + 1, n == "self_attn")
             for i, n in enumerate(["self_attn", "mlp", *norms])}  # fmt: skip
    probe = copy.copy(layer)  # the real layer keeps its own children
    probe._modules = {**layer._modules, **stubs}
    x = torch.randn(1, 1, hidden, generator=torch.Generator().manual_seed(0))
    d = torch.ones(1, 1, 2)
    with torch.inference_mode():
        try:
            out = probe(x, attention_mask=None, position_ids=torch.zeros(1, 1, dtype=torch.long),
                        position_embeddings=(d, d), use_cache=False)  # fmt: skip
        except Exception as e:  # a layer that needs more than the decoder's arguments
            raise Unsupported(
                f"{name}: probing the layer failed ({type(e).__name__}: {e})"
            ) from None
    out = out[0] if isinstance(out, tuple) else out
    attn, mlp = stubs["self_attn"], stubs["mlp"]
    fed = {id(s.out): n for n, s in stubs.items()}  # output tensor -> the stub that made it

    def source(t: torch.Tensor | None) -> str:
        return "none" if t is None else "x" if t is x else fed.get(id(t), "a sum")

    roles: dict[str, str] = {}
    attn_in = source(attn.seen)
    if attn_in in norms:
        roles["pre_attn"] = attn_in
    elif attn_in != "x":
        raise Unsupported(f"{name}: the attention reads {attn_in}, not the residual stream")
    for n in norms:
        if source(stubs[n].seen) == "self_attn":
            roles["post_attn"] = n
        elif source(stubs[n].seen) == "mlp":
            roles["post_ffw"] = n
    mlp_in = source(mlp.seen)
    if mlp_in in norms and mlp_in not in roles.values():
        roles["pre_ffw"] = mlp_in
    elif mlp_in != "a sum":
        raise Unsupported(f"{name}: the MLP reads {mlp_in}, not the residual stream")
    unused = sorted(set(norms) - set(roles.values()))
    if unused or (roles.get("pre_attn") and source(stubs[roles["pre_attn"]].seen) != "x"):
        raise Unsupported(f"{name}: norms {unused or [roles['pre_attn']]} are not a pre-norm "
                          "or post-norm of a sublayer")  # fmt: skip
    m = residual_multiplier
    a = stubs[roles["post_attn"]].out if "post_attn" in roles else attn.out
    s = x + a * m
    if "pre_ffw" in roles:
        pre_in = stubs[roles["pre_ffw"]].seen
    else:
        pre_in = mlp.seen
    f = stubs[roles["post_ffw"]].out if "post_ffw" in roles else mlp.out
    if pre_in is None or not torch.equal(pre_in, s) or not torch.equal(out, s + f * m):
        raise Unsupported(f"{name}: the layer is not x + attn(...) * {m:g} + mlp(...) * {m:g} "
                          "around its norms (residual structure the plan does not compute)")  # fmt: skip
    return roles
