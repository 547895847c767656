"""The graph passes of the ``topg`` backend, in the order the pass manager runs them.

Order matters: attention and rotary run before the linear pass fuses q/k/v (they read
the per-projection view chains); RMSNorm runs before the residual-add fusion that
consumes its output, and the all-reduce fusion (tensor parallel) after that one (it
absorbs the ``fused_add_rms_norm`` that follows an all-reduce); the gated-MLP fusion
claims gate/up before the generic linear pass turns the remaining ``F.linear`` calls into ``topg::linear``.
"""

from __future__ import annotations

from torch_topg.compile.passes.add_rms_norm import AddRMSNormPass
from torch_topg.compile.passes.all_reduce_norm import AllReduceNormPass
from torch_topg.compile.passes.attention import AttentionPass
from torch_topg.compile.passes.base import Context, Pass, Site
from torch_topg.compile.passes.gated_mlp import GatedMLPPass
from torch_topg.compile.passes.linear import LinearPass
from torch_topg.compile.passes.moe import MoERouterPass
from torch_topg.compile.passes.rms_norm import RMSNormPass
from torch_topg.compile.passes.rotary import RotaryPass

#: Every pass, in run order. ``options={"disable": ["rotary", ...]}`` turns passes off by name.
PASSES: list[type[Pass]] = [
    AttentionPass,
    RotaryPass,
    RMSNormPass,
    AddRMSNormPass,
    AllReduceNormPass,
    MoERouterPass,
    GatedMLPPass,
    LinearPass,
]
PASS_NAMES = [p.name for p in PASSES]

__all__ = ["PASSES", "PASS_NAMES", "Context", "Pass", "Site"]
