"""fused_moe against its reference and against transformers' Mixtral experts."""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES, assert_close, requires_kernel
from hypothesis import example, given
from hypothesis import strategies as st

import torch_topg
from torch_topg import reference

ACTS = ["silu", "gelu", "gelu_tanh"]


def _moe_inputs(t, e, k, h, i, dtype, ids_dtype=torch.int64, f32_weights=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w_gate_up = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w_down = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    # random ids: repeats inside a row and experts never hit both happen
    ids = torch.randint(0, e, (t, k), generator=g).to(ids_dtype)
    weights = torch.rand(t, k, generator=g)
    return x, w_gate_up, w_down, weights if f32_weights else weights.to(dtype), ids


def _check(args, activation):
    got = torch_topg.ops.fused_moe(*args, activation=activation)
    expected = reference.fused_moe(*args, activation=activation)
    h, i = args[0].shape[1], args[2].shape[2]
    assert_close(got, expected, scale=max(1.0, (h + i) ** 0.5 / 8))


@requires_kernel("fused_moe")
@given(
    t=st.sampled_from([1, 3, 64, 300]),
    e=st.sampled_from([1, 3, 8]),
    k=st.sampled_from([1, 2, 3]),
    h=st.sampled_from([24, 40, 100]) | st.integers(1, 64),
    i=st.sampled_from([24, 40, 100]) | st.integers(1, 64),
    dtype=st.sampled_from(DTYPES),
    act=st.sampled_from(ACTS),
    ids32=st.booleans(),
    f32_weights=st.booleans(),
)
@example(t=1, e=8, k=2, h=100, i=40, dtype=torch.bfloat16, act="silu", ids32=True, f32_weights=True)
@example(
    t=64, e=3, k=3, h=300, i=260, dtype=torch.float32, act="gelu", ids32=False, f32_weights=True
)
@example(
    t=300, e=8, k=2, h=40, i=24, dtype=torch.float16, act="gelu_tanh", ids32=True, f32_weights=False
)
@example(t=3, e=1, k=1, h=7, i=1, dtype=torch.float32, act="silu", ids32=False, f32_weights=False)
def test_fused_moe(t, e, k, h, i, dtype, act, ids32, f32_weights):
    k = min(k, e)
    args = _moe_inputs(t, e, k, h, i, dtype, torch.int32 if ids32 else torch.int64, f32_weights)
    _check(args, act)


@requires_kernel("fused_moe")
@pytest.mark.parametrize("t", [2, 40])  # dot path and packed path
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_repeated_expert_in_row(t, dtype):
    x, w_gate_up, w_down, weights, _ = _moe_inputs(t, 4, 3, 40, 24, dtype)
    ids = torch.tensor([[2, 2, 1]] * t)  # the same token twice in expert 2's rows
    _check((x, w_gate_up, w_down, weights, ids), "silu")


@requires_kernel("fused_moe")
def test_fused_moe_matches_mixtral_experts():
    """topg fused_moe == transformers 5 MixtralExperts for the same routing (fp32).

    The compile backend relies on exactly this: gate_up_proj / down_proj are passed as
    w_gate_up / w_down unchanged.
    """
    pytest.importorskip("transformers")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(
        hidden_size=64, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2
    )
    experts = MixtralExperts(config)
    x, w_gate_up, w_down, weights, ids = _moe_inputs(33, 4, 2, 64, 40, torch.float32)
    with torch.no_grad():
        experts.gate_up_proj.copy_(w_gate_up)
        experts.down_proj.copy_(w_down)
    got = torch_topg.ops.fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    for impl in ("eager", "grouped_mm"):
        config._experts_implementation = impl
        with torch.no_grad():
            expected = experts(x, ids, weights)
        assert_close(got, expected)


def test_fused_moe_opcheck():
    for t in (2, 40):
        args = _moe_inputs(t, 3, 2, 24, 40, torch.float32)
        torch.library.opcheck(torch.ops.topg.fused_moe.default, args)
        torch.library.opcheck(torch.ops.topg.fused_moe.default, args, {"activation": "gelu"})


def test_fused_moe_compile_fullgraph():
    def block(x, w_gate_up, w_down, router):
        weights, ids = torch.topk(torch.softmax(x @ router, -1), 2)
        return torch_topg.ops.fused_moe(x, w_gate_up, w_down, weights, ids) + x

    x, w_gate_up, w_down, _, _ = _moe_inputs(9, 4, 2, 32, 24, torch.float32)
    router = torch.randn(32, 4)
    expected = block(x, w_gate_up, w_down, router)
    got = torch.compile(block, fullgraph=True, backend="aot_eager")(x, w_gate_up, w_down, router)
    assert_close(got, expected)


def _bad_cases():
    x, wgu, wd, tw, ids = _moe_inputs(4, 3, 2, 16, 8, torch.float32)
    return [
        ((x.half(), wgu, wd, tw, ids), "argument 'w_gate_up'.*expected dtype float16"),
        ((x, wgu[:, :, :15], wd, tw, ids), "argument 'w_gate_up'.*size 16 at dim 2"),
        ((x, wgu.transpose(1, 2).contiguous().transpose(1, 2), wd, tw, ids), "'w_gate_up'.*contig"),
        ((x, wgu, wd[:, :, :7], tw, ids), "argument 'w_down'.*size 8 at dim 2"),
        ((x, wgu, wd[:2], tw, ids), "argument 'w_down'.*size 3 at dim 0"),
        ((x, wgu, wd, tw[:, :1], ids), "argument 'topk_ids'.*size 1 at dim 1"),
        ((x, wgu, wd, tw[:3], ids), "argument 'topk_weights'.*size 4 at dim 0"),
        ((x, wgu, wd, tw, ids.float()), "argument 'topk_ids'.*expected dtype int32 or int64"),
        ((x, wgu, wd, tw.half(), ids), "argument 'topk_weights'.*expected dtype float32"),
        ((x[0], wgu, wd, tw, ids), "argument 'hidden_states'.*2 dimensions"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_fused_moe_bad_input(case):
    args, match = _bad_cases()[case]
    with pytest.raises(RuntimeError, match=match):
        torch_topg.ops.fused_moe(*args)
    with pytest.raises(RuntimeError, match=match):  # the fake kernel checks the same
        with torch._subclasses.FakeTensorMode() as mode:
            torch_topg.ops.fused_moe(*(mode.from_tensor(a) for a in args))


@pytest.mark.parametrize("bad_id", [3, -1, 100])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_fused_moe_ids_out_of_range(bad_id, ids_dtype):
    """Data-dependent: checked by the native kernel and the reference (not the fake)."""
    x, wgu, wd, tw, ids = _moe_inputs(4, 3, 2, 16, 8, torch.float32, ids_dtype)
    ids[2, 1] = bad_id
    with pytest.raises(RuntimeError, match="argument 'topk_ids'.*expert id"):
        torch_topg.ops.fused_moe(x, wgu, wd, tw, ids)
    with pytest.raises(RuntimeError, match="argument 'topk_ids'.*expert id"):
        reference.fused_moe(x, wgu, wd, tw, ids)


def test_fused_moe_bad_activation():
    args = _moe_inputs(2, 3, 2, 16, 8, torch.float32)
    with pytest.raises(RuntimeError, match="activation 'relu' is not one of"):
        torch_topg.ops.fused_moe(*args, activation="relu")
