"""Sharding plans of the transformers decoder families, and the shard of every parameter.

A :class:`Plan` names the modules of one family (they are the same attribute names in
Llama, Mistral, Qwen2/3, Mixtral and Qwen2/3-MoE). Per decoder layer:

* attention: ``q_proj`` / ``k_proj`` / ``v_proj`` column-parallel by whole KV groups,
  ``o_proj`` row-parallel (all-reduce); per-head norms (Qwen3 ``q_norm`` / ``k_norm``)
  replicated;
* dense MLP: ``gate_proj`` / ``up_proj`` column-parallel, ``down_proj`` row-parallel;
* MoE block (an ``experts`` child with 3-d ``gate_up_proj [E, 2I, H]`` and
  ``down_proj [E, H, I]``): every expert split along its intermediate size (the router is
  replicated); a shared expert (Qwen2-MoE) split the same way without its own
  reduction; the block's output is all-reduced once;
* norms replicated; embedding vocab-parallel; LM head vocab-parallel (tied: shares the
  embedding's shard).

:func:`shard_specs` maps each parameter of the sharded model to the :class:`Slice` of
the full checkpoint tensor it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from torch_topg.parallel.loading import Slice
from torch_topg.parallel.sharding import HeadSplit, shard_range, split_heads, split_size


@dataclass(frozen=True)
class Plan:
    family: str
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    lm_head: str = "lm_head"
    attention: str = "self_attn"
    qkv: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj")
    out: str = "o_proj"
    mlp: str = "mlp"
    gate_up: tuple[str, str] = ("gate_proj", "up_proj")
    down: str = "down_proj"
    experts: str = "experts"
    shared_expert: str | None = None


#: ``config.model_type`` -> plan.
PLANS: dict[str, Plan] = {
    "llama": Plan("Llama"),
    "mistral": Plan("Mistral"),
    "qwen2": Plan("Qwen2"),
    "qwen3": Plan("Qwen3"),
    "mixtral": Plan("Mixtral"),
    "qwen2_moe": Plan("Qwen2-MoE", shared_expert="shared_expert"),
    "qwen3_moe": Plan("Qwen3-MoE"),
}


def plan_for(model: nn.Module) -> Plan:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    plan = PLANS.get(model_type)  # type: ignore[arg-type]
    if plan is None:
        raise ValueError(
            f"tensor_parallel: no sharding plan for model_type {model_type!r}; "
            f"supported: {sorted(PLANS)}"
        )
    return plan


@dataclass
class Layout:
    """The realised split of one model on one rank (also kept as ``model.topg_tp``)."""

    rank: int
    tp_size: int
    group_name: str
    ratios: list[float]
    heads: HeadSplit
    vocab: list[int]
    #: intermediate size -> shard sizes (dense MLPs, experts and shared experts)
    intermediate: dict[int, list[int]] = field(default_factory=dict)

    def inter(self, size: int) -> tuple[int, int]:
        if size not in self.intermediate:
            self.intermediate[size] = split_size(size, self.ratios, "intermediate features")
        return shard_range(self.intermediate[size], self.rank)

    def describe(self) -> str:
        h = self.heads
        return (
            f"rank {self.rank}/{self.tp_size}: {h.q[self.rank]} query / {h.kv[self.rank]} KV "
            f"heads (all ranks {list(h.q)} / {list(h.kv)}), vocab {self.vocab}, "
            f"intermediate {self.intermediate}"
        )


def make_layout(
    model: nn.Module, rank: int, tp_size: int, group_name: str, ratios: list[float]
) -> Layout:
    cfg: Any = model.config
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    return Layout(
        rank,
        tp_size,
        group_name,
        ratios,
        split_heads(n_heads, n_kv, head_dim, ratios),
        split_size(cfg.vocab_size, ratios, "vocabulary rows"),
    )


def _linear_spec(prefix: str, lin: nn.Linear, dim: int, rng: tuple[int, int]) -> dict[str, Slice]:
    specs = {f"{prefix}.weight": Slice(f"{prefix}.weight", dim, (rng,))}
    if lin.bias is not None:  # column-parallel bias is sharded; row-parallel replicated
        specs[f"{prefix}.bias"] = Slice(f"{prefix}.bias", 0, (rng,) if dim == 0 else ())
    return specs


def plan_layer(
    plan: Plan, prefix: str, layer: nn.Module, lay: Layout
) -> tuple[dict[str, tuple[str, Any]], dict[str, Slice]]:
    """What to build for one decoder layer: ``{module path: (kind, args)}`` and the
    slices of its sharded parameters (checkpoint name -> Slice)."""
    r = lay.rank
    mods: dict[str, tuple[str, Any]] = {}
    specs: dict[str, Slice] = {}
    attn = getattr(layer, plan.attention)
    a = f"{prefix}.{plan.attention}"
    q_rng, kv_rng = lay.heads.q_range(r), lay.heads.kv_range(r)
    for name, rng in zip(plan.qkv, (q_rng, kv_rng, kv_rng), strict=True):
        lin = getattr(attn, name)
        mods[f"{a}.{name}"] = ("column", (lin, rng))
        specs.update(_linear_spec(f"{a}.{name}", lin, 0, rng))
    o = getattr(attn, plan.out)
    mods[f"{a}.{plan.out}"] = ("row", (o, q_rng, True))
    specs.update(_linear_spec(f"{a}.{plan.out}", o, 1, q_rng))
    mods[a] = ("attention", (lay.heads.q[r], lay.heads.kv[r]))

    mlp = getattr(layer, plan.mlp)
    m = f"{prefix}.{plan.mlp}"
    experts = getattr(mlp, plan.experts, None)
    if experts is None:  # dense MLP
        _plan_mlp(plan, m, mlp, lay, mods, specs, reduce=True)
        return mods, specs
    gu, down = experts.gate_up_proj, experts.down_proj
    if gu.dim() != 3 or down.dim() != 3 or gu.shape[1] != 2 * down.shape[2]:
        raise ValueError(
            f"tensor_parallel: {m}.{plan.experts} weights are {tuple(gu.shape)} / "
            f"{tuple(down.shape)}, expected [E, 2I, H] / [E, H, I] (transformers 5 layout)"
        )
    inter = down.shape[2]
    s, e = lay.inter(inter)
    ex = f"{m}.{plan.experts}"
    specs[f"{ex}.gate_up_proj"] = Slice(f"{ex}.gate_up_proj", 1, ((s, e), (inter + s, inter + e)))
    specs[f"{ex}.down_proj"] = Slice(f"{ex}.down_proj", 2, ((s, e),))
    mods[ex] = ("experts", (e - s,))
    if plan.shared_expert and getattr(mlp, plan.shared_expert, None) is not None:
        shared = getattr(mlp, plan.shared_expert)
        _plan_mlp(plan, f"{m}.{plan.shared_expert}", shared, lay, mods, specs, reduce=False)
    mods[m] = ("reduce_output", ())
    return mods, specs


def _plan_mlp(
    plan: Plan,
    m: str,
    mlp: nn.Module,
    lay: Layout,
    mods: dict[str, tuple[str, Any]],
    specs: dict[str, Slice],
    reduce: bool,
) -> None:
    down = getattr(mlp, plan.down)
    rng = lay.inter(down.in_features)
    for name in plan.gate_up:
        lin = getattr(mlp, name)
        mods[f"{m}.{name}"] = ("column", (lin, rng))
        specs.update(_linear_spec(f"{m}.{name}", lin, 0, rng))
    mods[f"{m}.{plan.down}"] = ("row", (down, rng, reduce))
    specs.update(_linear_spec(f"{m}.{plan.down}", down, 1, rng))
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size = rng[1] - rng[0]
