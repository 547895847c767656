"""The Triton fused_moe kernel (torch_topg/triton_kernels/fused_moe.py) against the reference,
on CPU tensors under Triton's interpreter.

``TRITON_INTERPRET=1`` is set here, before ``triton`` is imported: ``triton.jit`` decides
at decoration time whether a kernel is compiled or interpreted. bfloat16 is not tested
here: the interpreter's ``tl.dot`` gives wrong bfloat16 results, so bf16 is checked on a
GPU (the kernel refuses bf16 under the interpreter, which is tested).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (see the docstring)

import pytest
import torch
from conftest import assert_close
from hypothesis import example, given, settings
from hypothesis import strategies as st
from op_bad_inputs import bad_inputs, special_inputs

from torch_topg import reference

triton_moe = importlib.import_module("torch_topg.triton_kernels.fused_moe")
if not triton_moe.INTERPRETED:
    # imported earlier in this process without the interpreter: rebuild its kernels for it
    triton_moe = importlib.reload(triton_moe)

ACTS = ["silu", "gelu", "gelu_tanh"]
DTYPES = [torch.float32, torch.float16]  # bf16: see the module docstring
CONFIGS = [
    None,  # default_config
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16},  # several K steps, N blocks, M blocks
    {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16},
]


def _inputs(t, e, k, h, i, dtype, *, ids_dtype=torch.int64, f32_weights=True, hit=None, seed=0):
    """Random MoE inputs; ``hit``: the ids are drawn from the first ``hit`` experts only."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w_gate_up = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    w_down = (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)
    ids = torch.randint(0, hit or e, (t, k), generator=g).to(ids_dtype)
    weights = torch.rand(t, k, generator=g)
    return x, w_gate_up, w_down, weights if f32_weights else weights.to(dtype), ids


def _check(args, activation="silu", config=None):
    got = triton_moe.fused_moe(*args, activation=activation, config=config)
    expected = reference.fused_moe(*args, activation=activation)
    assert got.dtype == expected.dtype == args[0].dtype
    assert got.shape == expected.shape
    h, i = args[0].shape[1], args[2].shape[2]
    assert_close(got, expected, scale=max(1.0, (h + i) ** 0.5 / 8))


@settings(max_examples=5 * settings().max_examples)  # ci profile: 60
@given(
    t=st.sampled_from([0, 1, 3, 17, 64]),
    e=st.sampled_from([1, 4, 8]),
    k=st.sampled_from([1, 2, "E"]),
    h=st.sampled_from([20, 48, 72]),
    i=st.sampled_from([20, 48, 72]),
    dtype=st.sampled_from(DTYPES),
    act=st.sampled_from(ACTS),
    ids32=st.booleans(),
    f32_weights=st.booleans(),
    half_hit=st.booleans(),
    config=st.sampled_from(CONFIGS),
)
@example(t=17, e=8, k="E", h=72, i=20, dtype=torch.float16, act="gelu", ids32=True, f32_weights=False, half_hit=False, config=CONFIGS[1])  # fmt: skip
@example(t=64, e=8, k=2, h=48, i=72, dtype=torch.float32, act="gelu_tanh", ids32=False, f32_weights=True, half_hit=True, config=None)  # fmt: skip
@example(t=3, e=4, k=1, h=20, i=48, dtype=torch.float32, act="silu", ids32=False, f32_weights=True, half_hit=True, config=CONFIGS[2])  # fmt: skip
@example(t=0, e=4, k=2, h=20, i=20, dtype=torch.float16, act="silu", ids32=True, f32_weights=True, half_hit=False, config=None)  # fmt: skip
@example(t=1, e=1, k=1, h=72, i=72, dtype=torch.float16, act="silu", ids32=False, f32_weights=True, half_hit=False, config=CONFIGS[1])  # fmt: skip
def test_matches_reference(t, e, k, h, i, dtype, act, ids32, f32_weights, half_hit, config):
    """Random routing (repeats in a row, experts never hit); ``half_hit``: only the first
    half of the experts get tokens."""
    k = e if k == "E" else min(k, e)
    hit = max(1, e // 2) if half_hit else None
    ids_dtype = torch.int32 if ids32 else torch.int64
    args = _inputs(t, e, k, h, i, dtype, ids_dtype=ids_dtype, f32_weights=f32_weights, hit=hit)
    _check(args, act, config)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_repeated_expert_in_row(dtype, act):
    """The reference counts each slot: the same expert twice in a row counts twice."""
    x, w_gate_up, w_down, weights, _ = _inputs(5, 4, 3, 48, 20, dtype)
    ids = torch.tensor([[2, 2, 1], [0, 0, 0], [3, 1, 3], [2, 2, 1], [1, 0, 2]])
    _check((x, w_gate_up, w_down, weights, ids), act, CONFIGS[1])


def test_strided_hidden_states():
    _, w_gate_up, w_down, weights, ids = _inputs(9, 4, 2, 40, 24, torch.float32)
    x_strided = torch.randn(40, 9).t()  # [9, 40], stride (1, 9)
    _check((x_strided, w_gate_up, w_down, weights, ids), "silu", CONFIGS[1])


def test_no_experts_used_and_empty_dims():
    """k = 0: zeros; I = 0: zeros; H = 0 or T = 0: empty."""
    x, w_gate_up, w_down, weights, ids = _inputs(3, 4, 2, 20, 20, torch.float32)
    _check((x, w_gate_up, w_down, weights[:, :0], ids[:, :0]))
    _check((x, w_gate_up[:, :0], w_down[:, :, :0], weights, ids))
    _check((x[:, :0], w_gate_up[:, :, :0], w_down[:, :0], weights, ids))


def test_bf16_refused_under_interpreter():
    """bf16 needs a GPU: under the interpreter ``supports`` says why and the kernel refuses
    instead of returning wrong values."""
    args = _inputs(3, 4, 2, 20, 20, torch.bfloat16)
    assert triton_moe.supports(*args) == "bf16 under the Triton interpreter"
    with pytest.raises(RuntimeError, match="cannot run this call: bf16 under the Triton interp"):
        triton_moe.fused_moe(*args)


def test_supports():
    args = _inputs(3, 4, 2, 20, 20, torch.float32)
    assert triton_moe.supports(*args) is None
    assert triton_moe.supports(*_inputs(3, 4, 2, 20, 20, torch.float16)) is None
    assert triton_moe.supports(*args, activation="relu") == "activation 'relu'"
    x64 = (args[0].double(), *args[1:])
    assert triton_moe.supports(*x64) == "dtype float64"
    meta = tuple(a.to("meta") for a in args)
    assert triton_moe.supports(*meta) is None  # the interpreter takes any device's tensors


def test_supports_without_interpreter(monkeypatch):
    args = _inputs(3, 4, 2, 20, 20, torch.float32)
    monkeypatch.setattr(triton_moe, "INTERPRETED", False)
    assert triton_moe.supports(*args) == "device cpu without TRITON_INTERPRET"
    assert triton_moe.supports(*(a.to("meta") for a in args)) == "device meta"
    bf16 = _inputs(3, 4, 2, 20, 20, torch.bfloat16)
    assert triton_moe.supports(*bf16) == "device cpu without TRITON_INTERPRET"


@pytest.mark.parametrize("case", bad_inputs("fused_moe", "cpu"), ids=lambda c: c.desc)
def test_bad_input(case):
    """The op's table of bad inputs: refused in the op's words (tests/op_bad_inputs.py)."""
    with pytest.raises(RuntimeError, match=r"topg::fused_moe: " + case.match):
        triton_moe.fused_moe(*case.args, **case.kwargs)


@pytest.mark.parametrize("bad_id", [4, -1, 100])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_ids_out_of_range(bad_id, ids_dtype):
    x, w_gate_up, w_down, weights, ids = _inputs(
        5, 4, 2, 20, 20, torch.float32, ids_dtype=ids_dtype
    )
    ids[3, 1] = bad_id
    match = (
        rf"argument 'topk_ids' holds expert id {bad_id} at flat index 7, expected ids in \[0, 4\)"
    )
    with pytest.raises(RuntimeError, match=match):
        triton_moe.fused_moe(x, w_gate_up, w_down, weights, ids)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on inf
@pytest.mark.parametrize("case", special_inputs("fused_moe", "cpu"), ids=lambda c: c.desc)
def test_nan_inf_empty(case):
    """NaN / inf / empty inputs: NaN exactly where the reference has NaN."""
    got = triton_moe.fused_moe(*case.args, **case.kwargs)
    expected = reference.fused_moe(*case.args, **case.kwargs)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4, equal_nan=True)


def test_config():
    args = _inputs(17, 4, 2, 48, 20, torch.float32)
    for config in ({"BLOCK_M": 64, "num_warps": 8, "num_stages": 2}, {"BLOCK_K": 32}):
        _check(args, "silu", config)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['BLOCK_Q'\]"):
        triton_moe.fused_moe(*args, config={"BLOCK_Q": 16})
    with pytest.raises(ValueError, match="BLOCK_N must be a power of two >= 16, got 24"):
        triton_moe.fused_moe(*args, config={"BLOCK_N": 24})
    with pytest.raises(ValueError, match="num_warps must be a positive int, got 0"):
        triton_moe.fused_moe(*args, config={"num_warps": 0})


def test_default_config():
    decode = triton_moe.default_config(1, 2, 8, 4096, 14336)
    assert decode == {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    assert triton_moe.default_config(256, 2, 8, 4096, 14336)["BLOCK_M"] == 32
    assert triton_moe.default_config(4096, 2, 8, 4096, 14336)["BLOCK_M"] == 64
    small = triton_moe.default_config(4096, 2, 8, 20, 48)
    assert (small["BLOCK_N"], small["BLOCK_K"]) == (32, 32)
    assert triton_moe.default_config(0, 1, 0, 8, 8)["BLOCK_N"] == 16


@pytest.mark.parametrize("block_m", [16, 32])
def test_moe_align(block_m):
    """Each assignment once, grouped by expert in flat order, segments padded to
    ``block_m``, one expert per block, -1 past the end; bad ids dropped."""
    e = 5
    ids = torch.tensor([[3, 1], [3, 3], [0, 7], [1, -2], [3, 0]] * 7)  # expert 2, 4: no rows
    n = ids.numel()
    align = triton_moe.moe_align(ids, e, block_m)
    sorted_ids, expert_ids = align.sorted_ids.long(), align.expert_ids.long()
    assert align.sorted_ids.dtype == align.expert_ids.dtype == torch.int32
    assert expert_ids.numel() == -(-n // block_m) + min(e, n)
    assert sorted_ids.numel() == expert_ids.numel() * block_m
    flat = ids.reshape(-1)
    pos = 0
    for expert in range(e):
        rows = torch.nonzero(flat == expert).reshape(-1)  # flat order
        padded = -(-rows.numel() // block_m) * block_m
        assert torch.equal(sorted_ids[pos : pos + rows.numel()], rows)
        assert (sorted_ids[pos + rows.numel() : pos + padded] == n).all()  # sentinel
        assert (expert_ids[pos // block_m : (pos + padded) // block_m] == expert).all()
        pos += padded
    assert int(align.num_tokens_post_padded) == pos
    assert (sorted_ids[pos:] == n).all()
    assert (expert_ids[pos // block_m :] == -1).all()


def test_compiles_for_cuda():
    """The compiled path, which the interpreter does not take (constexpr specialisation,
    layouts, the pipeliner), builds for sm_90 with triton's own ptxas: no GPU needed.
    In a child process, where TRITON_INTERPRET is unset (tests/triton_aot.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("triton_aot.py")
    run = subprocess.run(
        [sys.executable, str(script), "fused_moe", "--arch", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard, not a timing check
    )
    if run.returncode == 77:
        pytest.skip(f"cannot compile Triton for CUDA here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stdout + run.stderr
    for kernel in ("_gate_up_kernel", "_down_kernel", "_sum_slots_kernel"):
        for dtype in ("fp16", "bf16", "fp32"):
            assert f"{kernel} [{dtype}" in run.stdout, run.stdout
