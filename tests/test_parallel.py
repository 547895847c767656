"""Tensor parallelism: split math (in process), and sharded models in spawned 2-process
gloo groups against the single-process model (each job bounded by a timeout)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from tp_utils import assert_ok, run_ranks

from torch_topg.parallel import split_heads, split_size, split_units, tensor_parallel
from torch_topg.parallel.sharding import normalize_ratios

FALLBACK = os.environ.get("TOPG_DISABLE_NATIVE", "") == "1"
native_only = pytest.mark.skipif(
    FALLBACK,
    reason="native kernels disabled (TOPG_DISABLE_NATIVE=1): the model jobs run in the "
    "native pass; sharding does not depend on the kernels (CI time)",
)


# --- split math ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("units", "ratios", "expected"),
    [
        (4, [0.5, 0.5], [2, 2]),
        (3, [0.5, 0.5], [2, 1]),  # SmolLM2's 3 KV heads: ties go to the lower rank
        (5, [0.6, 0.4], [3, 2]),
        (10, [0.25, 0.25, 0.5], [3, 2, 5]),
        (4, [0.9, 0.1], [3, 1]),  # every rank keeps one unit
        (8, [0.96, 0.02, 0.02], [6, 1, 1]),
    ],
)
def test_split_units(units, ratios, expected):
    assert split_units(units, ratios) == expected
    assert sum(expected) == units


@pytest.mark.parametrize(
    ("size", "ratios", "expected"),
    [
        (3072, [0.5, 0.5], [1536, 1536]),
        (160, [0.5, 0.5], [80, 80]),  # align 16: 64 / 32 would give 96 + 64
        (3072, [0.6, 0.4], [1856, 1216]),  # align 64, within 5% of 1843 / 1229
        (1536, [0.5, 0.5], [768, 768]),
        (49152, [0.5, 0.5], [24576, 24576]),
        (256, [0.7, 0.3], [176, 80]),
        (7, [0.5, 0.5], [4, 3]),  # a prime: align 1
    ],
)
def test_split_size(size, ratios, expected):
    sizes = split_size(size, ratios)
    assert sizes == expected and sum(sizes) == size


@given(
    size=st.integers(1, 20000),
    ratios=st.lists(st.floats(0.01, 1.0), min_size=1, max_size=4),
)
def test_split_size_properties(size, ratios):
    """Shards cover the size exactly, each non-empty and a multiple of a power of two
    (the same one for all shards); impossible only with fewer elements than ranks."""
    ratios = normalize_ratios(ratios, len(ratios))
    if size < len(ratios):
        with pytest.raises(ValueError, match="split_ratios"):
            split_size(size, ratios)
        return
    sizes = split_size(size, ratios)
    assert sum(sizes) == size and min(sizes) >= 1
    align = max(a for a in (64, 32, 16, 8, 4, 2, 1) if all(s % a == 0 for s in sizes))
    assert size % align == 0
    # largest remainder: within one unit (<= 64 elements) of the ideal, plus one unit per
    # rank that had to be given its first unit by the largest shard
    bound = 64 * len(ratios)
    assert all(abs(s - size * r) <= bound for s, r in zip(sizes, ratios, strict=True))


def test_split_heads_moves_q_with_kv_groups():
    s = split_heads(9, 3, 64, [0.5, 0.5])  # SmolLM2-135M
    assert s.kv == (2, 1) and s.q == (6, 3)
    assert s.q_range(0) == (0, 384) and s.q_range(1) == (384, 576)
    assert s.kv_range(0) == (0, 128) and s.kv_range(1) == (128, 192)
    s = split_heads(32, 8, 128, [0.75, 0.25])
    assert s.kv == (6, 2) and s.q == (24, 8)


def test_impossible_splits_name_split_ratios():
    with pytest.raises(
        ValueError, match=r"split_ratios.*at least one of the 2 KV heads.*at most 2 ranks"
    ):
        split_heads(4, 2, 16, [1 / 3] * 3)
    with pytest.raises(ValueError, match=r"split_ratios .*cannot split 3 elements"):
        split_size(3, [0.25] * 4)
    with pytest.raises(ValueError, match=r"split_ratios \[0.5\] has 1 entries for 2 ranks"):
        normalize_ratios([0.5], 2)
    with pytest.raises(ValueError, match=r"split_ratios .* must all be > 0"):
        normalize_ratios([1.0, 0.0], 2)
    assert normalize_ratios([3, 1], 2) == [0.75, 0.25]


def test_needs_torch_distributed():
    from torch_topg.models import build_model

    # every in-process group of the suite is destroyed after use: a leaked one fails here
    assert not dist.is_initialized(), "a process group leaked from an earlier test"
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        tensor_parallel(build_model("llama-tiny"))


def test_world_of_one(tmp_path):
    """A 1-rank group: the sharded model is the model (plumbing, errors, meta models)."""
    from torch_topg.models import build_model
    from torch_topg.parallel import empty_model

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        ref = build_model("qwen2-tiny")
        ids = torch.randint(0, 256, (1, 5))
        model = tensor_parallel(build_model("qwen2-tiny"), tp_size=1)
        with torch.inference_mode():
            torch.testing.assert_close(model(ids).logits, ref(ids).logits)
        with pytest.raises(ValueError, match="already sharded"):
            tensor_parallel(model)
        with pytest.raises(ValueError, match="tp_size=2 but the process group has 1 ranks"):
            tensor_parallel(build_model("llama-tiny"), tp_size=2)
        with pytest.raises(ValueError, match="meta device"):
            tensor_parallel(empty_model(ref.config))  # no weights given
        sd = {k: v for k, v in ref.state_dict().items() if "q_proj" not in k}
        with pytest.raises(KeyError, match="q_proj.weight' is missing from state_dict"):
            tensor_parallel(empty_model(ref.config), state_dict=sd)
        bad = build_model("llama-tiny")
        bad.config.model_type = "gpt2"
        with pytest.raises(ValueError, match="no sharding plan for model_type 'gpt2'"):
            tensor_parallel(bad)
    finally:
        dist.destroy_process_group()


# --- 2-process jobs (tests/tp_worker.py) ---------------------------------------------------
@native_only
def test_models_match_one_process(tmp_path):
    """Llama, Mixtral, Qwen2-MoE, Mistral, Qwen3-MoE and a 3-KV-head Llama, even and
    uneven splits: prefill and decode logits equal the single-process model's; greedy
    generate gives the same tokens; shards load from a safetensors checkpoint (one file
    and sharded with an index) and from a state dict."""
    results = run_ranks("models", tmp_path, timeout=150)
    assert_ok(results)
    for r in results:
        assert len(r.lines("OK ")) == 20, r.output


@native_only
def test_compiled_topg_fuses_all_reduce(tmp_path):
    """backend="topg", fullgraph (no graph break): every all-reduce before a norm becomes
    ``fused_all_reduce_add_rms_norm``; logits equal eager TP and one process."""
    results = run_ranks("compiled", tmp_path, timeout=150)
    assert_ok(results)
    for r in results:
        assert len(r.lines("OK ")) == 4, r.output


def test_failing_rank_stops_the_others(tmp_path):
    """Rank 1 raises before the first collective: rank 0 fails at its all-reduce with rank
    1's error in the message (published by ``failure_guard``), and nothing hangs."""
    t0 = time.monotonic()
    results = run_ranks("fail", tmp_path, timeout=90)
    assert time.monotonic() - t0 < 90
    r0, r1 = results
    assert r1.returncode not in (0, None) and "boom on purpose" in r1.output
    assert r0.returncode not in (0, None), r0.output
    assert "another rank failed (rank 1: ValueError: boom on purpose)" in r0.output, r0.output


@pytest.mark.parametrize("preset", ["mixtral-tiny", "qwen2moe-tiny"])
def test_checkpoint_per_expert_tensors_read_as_fused_slices(tmp_path, preset):
    """A per-expert checkpoint (what transformers 5 saves, and the Hub's MoE layout) read
    as slices of the fused ``gate_up_proj`` / ``down_proj`` and Mixtral's renamed router."""
    from torch_topg.models import build_model
    from torch_topg.parallel.loading import CheckpointSource, Slice

    model = build_model(preset)
    model.save_pretrained(tmp_path)
    moe = model.model.layers[1].mlp
    gu, down = moe.experts.gate_up_proj.detach(), moe.experts.down_proj.detach()
    inter = down.shape[2]
    name = "model.layers.1.mlp"
    src = CheckpointSource(tmp_path)
    try:
        rows = ((3, 17), (inter + 3, inter + 17))
        got = src.read(Slice(f"{name}.experts.gate_up_proj", 1, rows))
        assert torch.equal(got, torch.cat([gu[:, 3:17], gu[:, inter + 3 : inter + 17]], 1))
        assert torch.equal(src.read(Slice(f"{name}.experts.gate_up_proj")), gu)
        straddle = src.read(Slice(f"{name}.experts.gate_up_proj", 1, ((inter - 2, inter + 2),)))
        assert torch.equal(straddle, gu[:, inter - 2 : inter + 2])
        got = src.read(Slice(f"{name}.experts.down_proj", 2, ((5, 20),)))
        assert torch.equal(got, down[:, :, 5:20])
        assert torch.equal(src.read(Slice(f"{name}.gate.weight")), moe.gate.weight.detach())
        with pytest.raises(KeyError, match="missing from checkpoint"):
            src.read(Slice("model.layers.1.mlp.experts.nothing"))
    finally:
        src.close()
