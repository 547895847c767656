"""The decode plan's dense-layer features (docs/decode-step.md), each a flag of the plan,
not a family: Granite's multipliers (embedding, residual, logits divisor, attention
scale), SmolLM3's layers without rotary, OLMo 2's post-norms (no pre-norm) with QK-norm
over the whole projection. Per family: the decode and verify steps through the plan equal
the compiled graph's bitwise (logits and every KV write) in fp32 and bf16, and the
engine's greedy text through the plan (asserted from its stats) equals transformers',
alone and in a batch."""

from __future__ import annotations

import pytest
import torch
from conftest import cover
from engine_utils import prompts
from test_decode_plan import (
    _compare_decode_and_verify,
    _engine_greedy_on_plan_equals_transformers,
    _model_runner,
)
from test_decode_plan_moe import _build

from torch_topg import _native
from torch_topg.compile.decode_plan import Unsupported, lower
from torch_topg.engine.model_runner import ModelRunner

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not _native.load(),
    reason="native library not loaded (not built, or TOPG_DISABLE_NATIVE=1): the decode plan "
    "(csrc/cpu/decode_plan.cpp) has no reference fallback",
)

_DENSE = dict(hidden_size=64, intermediate_size=96)


def _family(name: str) -> torch.nn.Module:
    if name == "granite":  # every multiplier away from 1 (x 1/3 and / 3 round differently)
        return _build("GraniteConfig", **_DENSE, embedding_multiplier=3.0,
                      residual_multiplier=0.22, attention_multiplier=0.3, logits_scaling=3.0)  # fmt: skip
    if name == "smollm3":  # layer 0 rotates q / k, layer 1 does not
        return _build("SmolLM3Config", **_DENSE, no_rope_layers=[1, 0], pad_token_id=None,
                      bos_token_id=1, eos_token_id=2)  # fmt: skip
    if name == "olmo2":  # post-norms only, QK-norm over the whole q / k projection
        return _build("Olmo2Config", **_DENSE)
    raise ValueError(name)


FAMILIES = ["granite", "smollm3", "olmo2"]


# each family in one dtype, alternating (conftest.cover; both: the thorough profile)
@pytest.mark.parametrize(
    ("family", "dtype"),
    cover(FAMILIES, [torch.float32, torch.bfloat16]),
    ids=lambda v: {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(v),
)
def test_dense_plan_equals_compiled_graph(family, dtype):
    r = _model_runner(_family(family).to(dtype))
    assert r.plan is not None, r.plan_reason
    _compare_decode_and_verify(r, 37, steps=6, verify=[[5, 6, 7, 8], [9, 10]])


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_through_the_plan_equals_transformers(family):
    """fp32, alone and in a batch: the decode steps ran on the plan (its stats say so)
    and the greedy tokens are transformers' generate."""
    model = _family(family)
    ps = prompts(41, [5, 11, 3])
    _engine_greedy_on_plan_equals_transformers(model, ps)


def _lower(model) -> None:
    r = ModelRunner(model, num_blocks=8, block_size=4, max_blocks_per_seq=4, compile=False)
    lower(r.model, r.kv_caches, block_size=4, max_positions=16)


def test_layer_structure_is_measured_not_named():
    """A norm's role comes from the layer's data flow: OLMo 2's post_attention_layernorm
    is a post-norm, Llama's the MLP's pre-norm; a layer computing something else (here a
    parallel block: attention and MLP both read the same normalised stream) is refused."""
    from torch_topg.compile.decode_plan_layer import norm_roles

    olmo = _family("olmo2").model.layers[0]
    assert norm_roles(olmo, "l", ["post_attention_layernorm", "post_feedforward_layernorm"], 64,
                      1.0) == {"post_attn": "post_attention_layernorm",
                               "post_ffw": "post_feedforward_layernorm"}  # fmt: skip
    granite = _family("granite").model.layers[0]
    roles = norm_roles(granite, "l", ["input_layernorm", "post_attention_layernorm"], 64, 0.22)
    assert roles == {"pre_attn": "input_layernorm", "pre_ffw": "post_attention_layernorm"}
    with pytest.raises(Unsupported, match="residual structure"):  # the wrong multiplier
        norm_roles(granite, "l", ["input_layernorm", "post_attention_layernorm"], 64, 1.0)

    class Parallel(torch.nn.Module):  # GPT-J / Falcon style: x + attn(n(x)) + mlp(n(x))
        def __init__(self, layer):
            super().__init__()
            self.self_attn, self.mlp = layer.self_attn, layer.mlp
            self.input_layernorm = layer.input_layernorm

        def forward(self, x, **kw):
            h = self.input_layernorm(x)
            return x + self.self_attn(h, **kw)[0] + self.mlp(h)

    with pytest.raises(Unsupported, match="the MLP reads input_layernorm"):
        norm_roles(Parallel(granite), "l", ["input_layernorm"], 64, 1.0)


def test_what_is_still_refused_is_named():
    """A rotary whose frequencies change with the length is not in the plan: the refusal
    names it."""
    model = _family("granite")
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": "dynamic"}
    with pytest.raises(Unsupported, match="rope_type 'dynamic' changes its frequencies"):
        _lower(model)
