"""One answer to "can ``fused_moe`` run this transformers experts module?":
:func:`torch_topg.ops.fused_moe.experts_supported`, used by eager interception, the
compile backend's experts substitution and ``torch_topg.quantize``."""

from __future__ import annotations

import pytest
import torch
from transformers import activations
from transformers.integrations.moe import use_experts_implementation

from torch_topg.compile import experts as compile_experts
from torch_topg.eager import hf as eager_hf
from torch_topg.ops.fused_moe import experts_activation, experts_supported
from torch_topg.quant import experts as quant_experts

E, H, INTER = 4, 32, 32


class _Config:
    _experts_implementation = "eager"


def _experts(act: torch.nn.Module | None = None, **flags) -> torch.nn.Module:
    """A transformers 5 experts module (decorated as the model files do)."""

    @use_experts_implementation(**flags)
    class Experts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * INTER, H) * 0.1)
            self.down_proj = torch.nn.Parameter(torch.randn(E, H, INTER) * 0.1)
            self.act_fn = act if act is not None else activations.SiLUActivation()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden_states)
            for e in top_k_index.unique().tolist():
                token, slot = torch.where(top_k_index == e)
                gate, up = (hidden_states[token] @ self.gate_up_proj[e].T).chunk(2, dim=-1)
                h = self._apply_gate(torch.cat([gate, up], -1)) @ self.down_proj[e].T
                out.index_add_(0, token, h * top_k_weights[token, slot, None])
            return out

    return Experts(_Config())


ACTIVATIONS = [
    (activations.SiLUActivation(), "silu"),
    (torch.nn.SiLU(), "silu"),
    (activations.GELUActivation(), "gelu"),
    (activations.GELUActivation(use_gelu_python=True), "gelu"),
    (activations.GELUTanh(), "gelu_tanh"),
    (activations.GELUTanh(use_gelu_tanh_python=True), "gelu_tanh"),
    (activations.NewGELUActivation(), "gelu_tanh"),
    (activations.FastGELUActivation(), "gelu_tanh"),
]
if hasattr(activations, "PytorchGELUTanh"):
    ACTIVATIONS.append((activations.PytorchGELUTanh(), "gelu_tanh"))


@pytest.mark.parametrize(("act", "name"), ACTIVATIONS, ids=lambda a: type(a).__name__)
def test_supported_activations_compute_fused_moe(act, name):
    module = _experts(act)
    assert experts_supported(module) is None
    assert experts_activation(module) == name
    # the module's own math and fused_moe with that activation agree
    torch.manual_seed(0)
    x = torch.randn(6, H)
    ids = torch.randint(0, E, (6, 2))
    w = torch.rand(6, 2)
    with torch.no_grad():
        want = module.forward.__wrapped__(module, x, ids, w)
        got = eager_hf.topg_experts_forward(module, x, ids, w)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "act", [activations.QuickGELUActivation(), torch.nn.ReLU(), torch.nn.GELU()]
)
def test_other_activations_are_refused(act):
    module = _experts(act)
    assert experts_activation(module) is None
    assert experts_supported(module) == f"activation {type(act).__name__}"


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        (dict(has_bias=True), "experts with bias"),
        (dict(has_gate=False), "experts without a gate projection"),
        (dict(is_transposed=True), "transposed expert weights"),
        (dict(is_concatenated=False), "interleaved gate/up weights"),
        (dict(has_post_expert_norm=True), "post-expert norm"),
    ],
)
def test_layouts_fused_moe_does_not_cover(flags, reason):
    assert experts_supported(_experts(**flags)) == reason


def test_bias_tensors_custom_gate_expert_parallel_and_shapes():
    m = _experts()
    m.down_proj_bias = torch.nn.Parameter(torch.zeros(E, H))  # flag unset, bias present
    assert experts_supported(m) == "experts with bias"
    m = _experts()
    m._is_expert_parallel = True
    assert experts_supported(m) == "expert parallel"
    m = _experts()
    type(m)._apply_gate = lambda self, gate_up: gate_up[..., :INTER] * gate_up[..., INTER:]
    assert experts_supported(m) == "custom gate function"
    m = _experts()
    m.down_proj = torch.nn.Parameter(torch.randn(E, H, INTER + 1))
    assert experts_supported(m) == "expert weights are not [E, 2I, H] / [E, H, I]"
    assert experts_supported(torch.nn.Linear(4, 4)) == "no gate_up_proj / down_proj tensors"


@pytest.mark.parametrize(
    ("act", "flags"),
    [
        (activations.NewGELUActivation(), {}),
        (activations.QuickGELUActivation(), {}),
        (None, dict(has_bias=True)),
    ],
)
def test_eager_compile_and_quant_give_the_same_answer(act, flags):
    module = _experts(act, **flags)
    why = experts_supported(module)
    x, ids = torch.randn(3, H), torch.zeros(3, 1, dtype=torch.long)
    with torch.no_grad():
        eager = eager_hf._call_activation(module, x, ids)
    assert (eager is None) == (why is not None)
    assert quant_experts.experts_problem(module, "q8_0") == why
    # the compile substitution runs fused_moe exactly when the check passes
    assert compile_experts.experts_supported is experts_supported
