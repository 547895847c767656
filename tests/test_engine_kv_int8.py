"""The engine with ``kv_cache_dtype="int8"``: the cache layout other KV code relies on,
the budget (scales counted), bad options, a tiny model against its float-KV run, and
SmolLM2's greedy text against bf16 KV (the agreement is printed; docs/engine.md)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import prompts, tiny, whole_pool

import torch_topg
from torch_topg.engine import Engine
from torch_topg.engine.model_runner import ModelRunner
from torch_topg.models import smollm2_available


def test_int8_layout_and_budget():
    model = tiny("llama-tiny")
    budget = 1 << 20
    with (
        Engine.from_model(model, kv_cache_memory=budget, block_size=4, compile=False) as f,
        Engine.from_model(
            model, kv_cache_memory=budget, block_size=4, compile=False, kv_cache_dtype="int8"
        ) as q,
    ):
        layers = model.config.num_hidden_layers
        assert f.runner.kv_tensors_per_layer == 2 and len(f.runner.kv_caches) == 2 * layers
        assert q.runner.kv_tensors_per_layer == 4 and len(q.runner.kv_caches) == 4 * layers
        nb = q.config.num_blocks
        for i, t in enumerate(q.runner.kv_caches):  # [k, v, ks, vs] per layer, blocks first
            assert t.shape[0] == nb and t.shape[1] == 4
            assert t.dtype == (torch.int8 if i % 4 < 2 else torch.float32)
            assert t.shape[2:] == q.runner.kv_caches[i - i % 4].shape[2 : 4 - i % 4 // 2]
        # The budget holds more int8 blocks, scales counted in the bytes.
        assert q.stats()["kv"]["bytes"] <= budget and f.stats()["kv"]["bytes"] <= budget
        per_block = ModelRunner.bytes_per_block(model.config, 4, model.dtype, None, "int8")
        assert q.stats()["kv"]["bytes"] == nb * per_block
        assert nb > f.config.num_blocks


def test_bad_kv_cache_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of \\['auto', 'int8'\\]"):
        Engine.from_model(tiny("llama-tiny"), kv_cache_dtype="fp8", compile=False)


@pytest.mark.parametrize("compile", [False, True])
def test_int8_tiny_greedy_close_to_float_kv(compile):
    # A float32 tiny model: int8 KV changes the logits a little, not the run's shape.
    model = tiny("llama-tiny")
    ps = prompts(0, [5, 17, 33])
    kw = dict(max_new_tokens=12, temperature=0, ignore_eos=True)
    with Engine.from_model(model, block_size=4, compile=False) as eng:
        want = [o.token_ids for o in eng.generate(ps, **kw)]
    with Engine.from_model(model, block_size=4, compile=compile, kv_cache_dtype="int8") as eng:
        with whole_pool(eng):
            got = [o.token_ids for o in eng.generate(ps, **kw)]
        if compile:
            assert eng.stats()["compile"]["while_serving"] == 0
    assert all(len(g) == 12 for g in got)
    same = sum(a == b for w, g in zip(want, got, strict=True) for a, b in zip(w, g, strict=True))
    assert [g[0] for g in got] == [w[0] for w in want]  # first tokens: one prefill apart
    assert same >= 0.5 * 36, (want, got)


def _agreement(want: list[int], got: list[int]) -> tuple[int, int]:
    """(tokens equal before the first difference, tokens equal at the same position)."""
    prefix = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), len(want))
    return prefix, sum(a == b for a, b in zip(want, got, strict=True))


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
]


@pytest.mark.skipif(smollm2_available() is not None, reason=str(smollm2_available()))
@pytest.mark.skipif(
    not torch_topg.native_available(),
    reason="needs the native CPU kernels (a 135M model on the reference is too slow)",
)
def test_smollm2_int8_greedy_agrees_with_bf16_kv():
    # SmolLM2-135M-Instruct in bf16, 64 greedy tokens per question: int8 KV against bf16
    # KV (the model's own dtype). Printed: the agreement; asserted: no garbage.
    # The first question's first token is a near tie in bf16 (float32 margin 0.08, one
    # bf16 step 0.125: docs/engine.md), so which side wins depends on rounding (kernel
    # path, KV dtype): no per-question assertion on the first token.
    msgs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    kw = dict(max_new_tokens=64, temperature=0, ignore_eos=True)
    opts = dict(dtype="bfloat16", max_batch_size=4, max_model_len=512, seed=0, compile=False)
    texts = {}
    for kv in ("auto", "int8"):
        with Engine.from_pretrained(**opts, kv_cache_dtype=kv) as eng:
            texts[kv] = eng.generate(msgs, **kw)
    total_prefix = total_same = 0
    for q, a, b in zip(QUESTIONS, texts["auto"], texts["int8"], strict=True):
        prefix, same = _agreement(a.token_ids, b.token_ids)
        total_prefix, total_same = total_prefix + prefix, total_same + same
        print(f"\n{q!r}: {prefix}/64 tokens before the first difference, {same}/64 equal")
        print(f"  bf16 KV: {a.text!r}\n  int8 KV: {b.text!r}")
    print(f"int8 vs bf16 KV: {total_prefix}/192 leading tokens, {total_same}/192 equal")
    # Loose (greedy bf16 text of a 135M model forks at near ties, and the attention
    # kernels' rounding decides them): garbage fails these, a fork does not.
    for out in texts["int8"]:
        text = out.text
        letters = sum(c.isalpha() or c.isspace() for c in text) / max(1, len(text))
        assert len(text) > 40 and letters > 0.8, text
    assert "Paris" in texts["int8"][0].text, texts["int8"][0].text
