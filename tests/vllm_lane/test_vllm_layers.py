"""The topg plugin inside vLLM (vllm 0.33.0, ``make vllm-test``).

Loaded through vLLM's own plugin loader; each replaced layer is built by vLLM's own class
(``RMSNorm(...)`` returns ``TopgRMSNorm``) and its output is compared with that layer's
``forward_native``, vLLM's pure-PyTorch path, in float32 and bfloat16, with the
tolerances vLLM uses for its own kernels. In those comparisons a fallback to vLLM's
implementation fails the test, so they compare topg with vLLM, never vLLM with itself.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import pytest
import torch
from vllm_utils import COUNTS, compare

vllm = pytest.importorskip("vllm", reason="vllm is not installed (the vLLM lane: make vllm-test)")

from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.custom_op import op_registry_oot  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402

import torch_topg  # noqa: E402
from torch_topg.integrations import vllm_plugin  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
MAIN = ["RMSNorm", "SiluAndMul", "GeluAndMul", "RotaryEmbedding", "UnquantizedFusedMoEMethod"]
native = pytest.mark.skipif(
    not torch_topg.native_available() and os.environ.get("TOPG_REQUIRE_NATIVE") != "1",
    reason=f"topg's native kernels are not loaded: {torch_topg._native.missing_reason('cpu')} "
    "(the plugin then runs vLLM's implementation everywhere)",
)


@pytest.fixture(scope="module", autouse=True)
def plugins_loaded(request):
    load_general_plugins()  # vLLM's loader: entry points of group vllm.general_plugins
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None and COUNTS["run"]:
        with capture.global_and_fixture_disabled():  # teardown output is captured otherwise
            reporter.write_line(
                f"\nvLLM forward_native comparisons: {COUNTS['run']} run, {COUNTS['passed']} passed"
            )


@pytest.fixture
def plugin_log():
    """Messages of the plugin's logger (once vLLM has configured logging, its "vllm"
    logger does not propagate to pytest's handler)."""
    lines: list[str] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger, level = vllm_plugin.LOGGER, vllm_plugin.LOGGER.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def config(request):
    """A vLLM config whose custom ops are all on (as in eager mode), or as parametrised."""
    custom_ops = getattr(request, "param", ["all"])
    with set_current_vllm_config(
        VllmConfig(compilation_config=CompilationConfig(custom_ops=custom_ops))
    ):
        yield


def _no_fallback(layer: object) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{type(layer).__name__} fell back to vLLM's implementation")

    layer._topg_vllm_forward = fail


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- loading ------------------------------------------------------------------------------


def test_plugin_loads_through_vllm_loader():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "topg"]
    assert ep.value == "torch_topg.integrations.vllm_plugin:register"
    registered = vllm_plugin.registered()
    for name in MAIN:
        assert registered.get(name) == f"Topg{name}", (name, vllm_plugin.skipped())
        assert op_registry_oot[name].__name__ == f"Topg{name}"
        assert op_registry_oot[name]._topg_base.__name__ == name
    assert {"Llama3RotaryEmbedding", "YaRNScalingRotaryEmbedding"} <= registered.keys()
    assert "overrides forward_native" in vllm_plugin.skipped()["FourierRotaryEmbedding"]


def test_register_twice_changes_nothing():
    before = {name: op_registry_oot[name] for name in MAIN}
    vllm_plugin.register()
    assert {name: op_registry_oot[name] for name in MAIN} == before


def test_disabled_by_environment():
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.model_executor.custom_op import op_registry_oot\n"
        "load_general_plugins()\n"
        "print(sorted(n for n, c in op_registry_oot.items() if c.__name__.startswith('Topg')))\n"
    )
    env = dict(os.environ, TOPG_VLLM_PLUGIN="0")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@native
@pytest.mark.parametrize(
    "custom_ops, mode, topg",
    [(["all"], "1", True), (["none"], "1", False), (["none", "+rms_norm"], "1", True),
     (["all", "-rms_norm"], "1", False), (["none"], "all", True)],
)  # fmt: skip
def test_follows_vllm_custom_ops(monkeypatch, custom_ops, mode, topg):
    from vllm.model_executor.layers.layernorm import RMSNorm

    monkeypatch.setenv("TOPG_VLLM_PLUGIN", mode)
    with set_current_vllm_config(
        VllmConfig(compilation_config=CompilationConfig(custom_ops=custom_ops))
    ):
        layer = RMSNorm(32)
    assert type(layer).__name__ == "TopgRMSNorm"
    assert (layer._forward_method == layer._topg_forward) is topg


@native
def test_traces_in_one_graph(config):
    """vLLM compiles its models with dynamo: the topg path must trace without breaks."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    norm, act = RMSNorm(64), SiluAndMul()

    def step(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        y, r = norm(x, r)
        return act(torch.cat([y, r], -1))

    x, r = torch.randn(3, 64, generator=_gen(5)), torch.randn(3, 64, generator=_gen(6))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x.clone(), r.clone()), step(x.clone(), r.clone()))


# --- RMSNorm ------------------------------------------------------------------------------


@native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fp32_weight", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (7, 1000), (2, 5, 128)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(config, dtype, fp32_weight, shape, residual):
    from vllm.model_executor.layers.layernorm import RMSNorm

    g = _gen(0)
    hidden = shape[-1]
    layer = RMSNorm(hidden, eps=1e-5, dtype=torch.float32 if fp32_weight else dtype)
    assert type(layer).__name__ == "TopgRMSNorm" and isinstance(layer, RMSNorm)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(hidden, generator=g) + 0.5)
    _no_fallback(layer)
    x = torch.randn(shape, generator=g).to(dtype)
    if not residual:
        compare(layer(x), layer.forward_native(x))
        return
    r = torch.randn(shape, generator=g).to(dtype)
    want_x, want_r = layer.forward_native(x.clone(), r.clone())
    got_x, got_r = layer(x.clone(), r.clone())
    compare(got_r, want_r)
    compare(got_x, want_x)


def test_rms_norm_falls_back_with_reason(config, plugin_log):
    from vllm.model_executor.layers.layernorm import RMSNorm

    layer = RMSNorm(64, var_hidden_size=32)  # variance over the first 32 of 64
    x = torch.randn(4, 64)
    expected = layer.forward_native(x)
    for _ in range(2):
        compare(layer(x), expected)
    lines = [m for m in plugin_log if "RMSNorm runs vLLM's implementation" in m]
    assert lines == ["torch_topg: RMSNorm runs vLLM's implementation: var_hidden_size=32 "
                     "(variance over part of the hidden size)"]  # fmt: skip


# --- gated activations --------------------------------------------------------------------


@native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 64), (9, 2 * 344), (2, 3, 2 * 96)])
@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh"])
def test_gated_activation(config, dtype, shape, kind):
    from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul

    if kind == "silu":
        layer = SiluAndMul()
    else:
        layer = GeluAndMul(approximate="tanh" if kind == "gelu_tanh" else "none")
    name = "SiluAndMul" if kind == "silu" else "GeluAndMul"
    assert type(layer).__name__ == f"Topg{name}"
    _no_fallback(layer)
    x = torch.randn(shape, generator=_gen(1)).to(dtype)
    compare(layer(x), layer.forward_native(x))


def test_activation_falls_back_with_reason(config, plugin_log):
    from vllm.model_executor.layers.activation import SiluAndMul

    layer = SiluAndMul()
    x = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(layer(x), layer.forward_native(x), atol=0, rtol=0)
    assert any(
        "SiluAndMul runs vLLM's implementation: input dtype torch.float64" in m for m in plugin_log
    )


# --- rotary embedding ---------------------------------------------------------------------

ROPES = {
    "default": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "partial": {"partial_rotary_factor": 0.5},
}  # fmt: skip


@native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("layout", ["flat", "qkv_slice", "no_key"])
def test_rotary_embedding(config, dtype, neox, rope, layout):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    head, hq, hkv, tokens, max_pos = 64, 4, 2, 11, 256
    params = dict(ROPES[rope] or {}, rope_theta=10000.0)
    layer = get_rope(head, max_pos, is_neox_style=neox, rope_parameters=params, dtype=dtype)
    assert type(layer).__name__.startswith("Topg"), type(layer)
    _no_fallback(layer)
    g = _gen(2)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head, generator=g).to(dtype)
    if layout == "qkv_slice":  # q and k are column slices of the fused projection
        q, k, _ = qkv.split([hq * head, hkv * head, hkv * head], dim=-1)
    else:
        q, k = qkv[:, : hq * head].clone(), qkv[:, hq * head : (hq + hkv) * head].clone()
    if layout == "no_key":
        k = None
    want_q, want_k = layer.forward_native(positions, q.clone(), None if k is None else k.clone())
    got_q, got_k = layer(positions, q, k)
    assert got_q is q and got_k is k  # rotated in place, like vLLM's kernel
    # In bf16, forward_native rounds x1 * cos and x2 * sin before subtracting: where they
    # cancel, its error is an ulp of the products (2^-6 at |x| ~ 2); topg rounds once.
    atol = 2**-6 if dtype == torch.bfloat16 else None
    compare(got_q, want_q, atol=atol)
    if k is not None:
        compare(got_k, want_k, atol=atol)


# --- fused-MoE experts --------------------------------------------------------------------


def _moe_method(experts: int, hidden: int, inter: int, topk: int, dtype: torch.dtype):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    moe = FusedMoEConfig(
        num_experts=experts,
        experts_per_token=topk,
        hidden_dim=hidden,
        intermediate_size=inter,
        num_local_experts=experts,
        num_logical_experts=experts,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=dtype,
    )
    return UnquantizedFusedMoEMethod(moe)


def _moe_inputs(dtype, experts=6, hidden=96, inter=40, tokens=9, topk=2, activation="silu"):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    g = _gen(3)
    layer = types.SimpleNamespace(
        w13_weight=(torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype),
        w2_weight=(torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype),
        activation=MoEActivation(activation),
        apply_router_weight_on_input=False,
        expert_map=None,
        global_num_experts=experts,
    )
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    scores = torch.randn(tokens, experts, generator=g).softmax(-1)
    weights, ids = scores.topk(topk, dim=-1)
    return layer, x, (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


def _vllm_experts_math(layer, x, weights, ids):
    """The experts' sum with vLLM's own activation ``forward_native`` for act-and-mul."""
    from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul

    act = layer.activation.value
    act_and_mul = (
        SiluAndMul.forward_native if act == "silu"
        else GeluAndMul(approximate="tanh" if act == "gelu_tanh" else "none").forward_native
    )  # fmt: skip
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:  # a padding row's slot: routed nowhere
                continue
            h = act_and_mul(x[t].float() @ layer.w13_weight[e].float().t())
            out[t] += weights[t, j] * (h @ layer.w2_weight[e].float().t())
    return out.to(x.dtype)


@native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("padding", [False, True])
def test_fused_moe_experts(config, dtype, activation, padding):
    method = _moe_method(6, 96, 40, 2, dtype)
    assert type(method).__name__ == "TopgUnquantizedFusedMoEMethod"
    _no_fallback(method)
    layer, x, weights, ids = _moe_inputs(dtype, activation=activation)
    if padding:  # VLLM_MOE_SKIP_PADDING (vLLM's default): padding rows get id -1
        ids[-2:] = -1
    got = method.apply(layer, x, weights, ids, None, None)
    # bf16: vLLM's reference rounds the activation to bf16 between the two GEMMs.
    compare(
        got,
        _vllm_experts_math(layer, x, weights, ids),
        scale=1.0 if dtype == torch.float32 else 2.0,
    )


def test_fused_moe_forward_native_here(config):
    """vLLM 0.33's experts ``forward_native`` is its modular kernel, not PyTorch: Triton
    (CUDA) or the CPU kernels of a vLLM CPU build. Run it where it runs; say why not here."""
    method = _moe_method(6, 96, 40, 2, torch.float32)
    layer, x, weights, ids = _moe_inputs(torch.float32)
    try:
        layer.moe_config = method.moe
        layer._expert_routing_tables = lambda: None  # no expert parallelism
        method._init_moe_kernel(layer)
        method.moe_kernel.fused_experts.process_weights_after_loading(layer)
        expected = method.forward_native(layer, x, weights, ids, None, None)
    except Exception as exc:
        pytest.skip(
            f"vLLM's UnquantizedFusedMoEMethod.forward_native cannot run here "
            f"(backend {method.unquantized_backend.value}, module "
            f"{method.experts_cls.__module__ if method.experts_cls else '?'}): "
            f"{type(exc).__name__}: {str(exc)[:200]}"
        )
    compare(method.apply(layer, x, weights, ids, None, None), expected)


@pytest.mark.parametrize(
    "change, reason",
    [({"activation": "relu2"}, "activation 'relu2'"),
     ({"expert_map": torch.arange(6)}, "expert parallelism (expert_map)"),
     ({"apply_router_weight_on_input": True}, "apply_router_weight_on_input=True")],
)  # fmt: skip
def test_fused_moe_falls_back_with_reason(config, plugin_log, change, reason):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    method = _moe_method(6, 96, 40, 2, torch.float32)
    layer, x, weights, ids = _moe_inputs(torch.float32)
    for key, value in change.items():
        setattr(layer, key, MoEActivation(value) if key == "activation" else value)
    calls = []
    method._topg_vllm_forward = lambda *args, **kwargs: calls.append(args or kwargs) or "vllm"
    assert method.apply(layer, x, weights, ids, None, None) == "vllm"
    assert len(calls) == 1
    assert any(
        m.startswith(f"torch_topg: UnquantizedFusedMoEMethod runs vLLM's implementation: {reason}")
        for m in plugin_log
    ), plugin_log
