"""The decode plan (``topg.DecodePlan``, docs/decode-step.md): the engine's decode step as
one native call. Its logits and KV writes equal the compiled graph's (bitwise: the same
kernels, the same roundings) for every family it lowers, at batch 1 and 8 over 32 steps
with growing context and new blocks; it refuses what it does not compute, with the reason;
stale weights make it lower again; its thread team survives thread-count changes and
fork; bad inputs get clear errors."""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest
import torch
from conftest import cover
from engine_utils import Seqs, hf_greedy, prompts, tiny
from hypothesis import given
from hypothesis import strategies as st

from torch_topg import _native
from torch_topg.compile.decode_plan import (
    StalePlan,
    Unsupported,
    lower,
    profile,
)
from torch_topg.compile.decode_plan import run as run_plan
from torch_topg.engine import Engine
from torch_topg.engine.model_runner import ModelRunner

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not _native.load(),
    reason="native library not loaded (not built, or TOPG_DISABLE_NATIVE=1): the decode plan "
    "(csrc/cpu/decode_plan.cpp) has no reference fallback",
)

LOWERED = ["llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny"]
#: preset -> (config overrides, the feature the plan names when it refuses it: a probe, not
#: a family list)
NOT_LOWERED = {"gemma2-tiny": ({"hidden_activation": "relu"}, "is not SiLU, GELU or tanh GELU")}


def _runner(preset: str, dtype: torch.dtype, num_blocks: int = 160, block_size: int = 4):
    return _model_runner(tiny(preset).to(dtype), num_blocks, block_size)


def _model_runner(model, num_blocks: int = 160, block_size: int = 4) -> ModelRunner:
    max_blocks = max(40, 64 // block_size)  # room for 64 tokens
    r = ModelRunner(model, num_blocks=num_blocks, block_size=block_size,
                    max_blocks_per_seq=max_blocks, decode_plan=True)  # fmt: skip
    r.warmup()
    return r


def _quantised_runner(preset: str, fmt: str, dtype: torch.dtype) -> ModelRunner:
    """``preset`` with its projections in ``fmt``, its LM head in q8_0 and the input
    embedding a QuantizedEmbedding over q8_0 rows (as the shipped GGUF file has them)."""
    from torch_topg.quant import quantize
    from torch_topg.quant.modules import QuantizedEmbedding
    from torch_topg.quant.packing import quantize_weight

    model = tiny(preset)
    quantize(model, fmt)
    quantize(model, "q8_0", skip=[n for n, _ in model.named_modules() if n != "lm_head"],
             lm_head=True)  # fmt: skip
    emb = model.model.embed_tokens
    packed = quantize_weight(emb.weight.detach(), "q8_0")
    model.model.embed_tokens = QuantizedEmbedding(packed, "q8_0", emb.embedding_dim)
    return _model_runner(model.to(dtype))


def _engine_greedy_on_plan_equals_transformers(model, ps: list[list[int]]) -> None:
    """fp32, alone and in a batch: the engine's decode steps ran on the plan (its stats say
    so, not assumed) and its greedy tokens are transformers' generate (8 new tokens)."""
    want = [hf_greedy(model, p, 8) for p in ps]
    with Engine.from_model(model, block_size=4) as eng:
        alone = eng.generate([ps[0]], max_new_tokens=8, temperature=0, ignore_eos=True)
        batch = eng.generate(ps, max_new_tokens=8, temperature=0, ignore_eos=True)
        dp = eng.stats()["decode_plan"]
    assert dp["active"] and dp["reason"] == "", dp
    assert dp["steps"] >= 14, dp  # 7 decode steps for each generate call
    assert alone[0].token_ids == want[0]
    assert [o.token_ids for o in batch] == want


def _compare_decode_and_verify(r: ModelRunner, seed: int, steps: int, verify: list[list[int]]):
    """Decode steps at batch 1 and 8, then one verify step of ``verify`` tokens for two
    sequences, every row sampled; each compared with _compare."""
    assert r.plan is not None, r.plan_reason
    for batch in (1, 8):
        seqs = Seqs(r, prompts(seed, [3 + 5 * i for i in range(batch)]), seed=batch)
        seqs.prefill()
        _compare_steps(r, seqs, steps=steps)
    seqs = Seqs(r, prompts(seed + 1, [9, 4]), seed=9)
    seqs.prefill()
    _compare(r, seqs.ragged_batch(verify, [len(v) for v in verify]))


def _plan_step(r: ModelRunner, b):
    return r.plan.run(b.input_ids, b.positions, b.slot_mapping, b.block_tables, b.seq_lens,
                      b.cu_seqlens_q, b.logits_indices)  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bits (unwritten cache slots are torch.empty's garbage, NaN != NaN)."""
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def _compare(r: ModelRunner, b, step: int = 0) -> torch.Tensor:
    """The graph on a copy of the cache, then the plan: logits and every cache tensor
    bitwise equal. Returns the plan's logits."""
    assert b.fits_plan
    before = [c.clone() for c in r.kv_caches]
    want = r.execute_graph(b)
    want_kv = [c.clone() for c in r.kv_caches]
    for c, c0 in zip(r.kv_caches, before, strict=True):
        c.copy_(c0)
    got = _plan_step(r, b)
    assert torch.equal(got, want), (step, (got - want).abs().max().item())
    for i, (c, w) in enumerate(zip(r.kv_caches, want_kv, strict=True)):
        assert torch.equal(_bits(c), _bits(w)), f"step {step}: KV tensor {i} differs"
    return got


def _compare_steps(r: ModelRunner, seqs: Seqs, steps: int) -> None:
    """Decode steps compared with _compare; the next tokens are the plan's argmax."""
    nxt = [t[-1] for t in seqs.toks]
    for step in range(steps):
        nxt = _compare(r, seqs.decode_batch(nxt), step).argmax(-1).tolist()


def _id(v) -> str | None:
    return (
        {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(v)
        if isinstance(v, torch.dtype)
        else None
    )


DTYPES = [torch.float32, torch.bfloat16]


# Each family at batch 1 and 8 and in both dtypes, each batch in both dtypes (conftest.cover;
# the whole product with the thorough profile)
@pytest.mark.parametrize(("preset", "batch", "dtype"), cover(LOWERED, [1, 8], DTYPES), ids=_id)
def test_plan_equals_compiled_graph(preset, batch, dtype):
    r = _runner(preset, dtype)
    assert r.plan is not None, r.plan_reason
    seqs = Seqs(r, prompts(3, [5 + 7 * i for i in range(batch)]), seed=batch)
    seqs.prefill()
    _compare_steps(r, seqs, steps=32)


# each format in one dtype, the dtypes alternating (the whole product: thorough profile)
QUANTISED = [("llama-tiny", "q4_1"), ("llama-tiny", "int4_g64"), ("qwen2-tiny", "q8_0"),
             ("qwen3-tiny", "int8"), ("mistral-tiny", "q4_0")]  # fmt: skip


@pytest.mark.parametrize(
    ("preset", "fmt", "dtype"), [(*c, d) for c, d in cover(QUANTISED, DTYPES)], ids=_id
)
def test_quantised_model_plan_equals_compiled_graph(preset, fmt, dtype):
    """Packed projections (int4_g64: K = 160 pads its last group), a q8_0 LM head and a
    q8_0 embedding: the plan runs linear_q's kernel per row, so logits and KV stay
    bitwise the graph's, at batch 1 and 8, and on a verify step of several tokens."""
    r = _quantised_runner(preset, fmt, dtype)
    _compare_decode_and_verify(r, 5, steps=12, verify=[[5, 6, 7, 8, 9], [10, 11]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_activation_linears_plan_equals_compiled_graph(dtype):
    """Linears with int8_activations (the LM head with fp32 ones): the plan rounds each
    GEMV's input to int8 blocks once and runs linear_q's integer dot per row."""
    from torch_topg.quant import quantize

    r = _model_runner(quantize(tiny("qwen2-tiny"), "q4_1", int8_activations=True).to(dtype))
    _compare_decode_and_verify(r, 15, steps=8, verify=[[5, 6, 7, 8, 9, 10, 11], [10, 11]])


def _random_k_quant(lin: torch.nn.Linear, fmt: str, int8_activations: bool):
    """A QuantizedLinear of ``lin``'s shape in a K-quant (read from GGUF files only, so
    random blocks: random codes and sub-scales, half-precision scales of 2^-10)."""
    from torch_topg.formats import FORMATS
    from torch_topg.quant import QuantizedLinear

    q = QuantizedLinear(lin.in_features, lin.out_features, fmt, bias=False,
                        int8_activations=int8_activations)  # fmt: skip
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(lin.out_features * 7 + lin.in_features)
    raw = torch.randint(0, 256, (q.qweight.numel() // f.block_bytes, f.block_bytes),
                        dtype=torch.uint8, generator=g)  # fmt: skip
    half = torch.tensor([2.0**-10], dtype=torch.float16).view(torch.uint8)
    for at in {"q4_k": (0, 2), "q6_k": (208,)}[fmt]:  # d (and dmin)
        raw[:, at : at + 2] = half
    q.qweight.copy_(raw.view(q.qweight.shape))
    return q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_activations_with_k_quant_formats_plan_equals_compiled_graph(dtype):
    """A Q4_K_M-like mix with int8_activations: q4_k / q6_k have no integer dot products,
    so their GEMVs take the rounded rows in fp32 (as linear_q does) and q8_0 the integer
    dot; the model lowers (each tensor's format picks its path) and stays bitwise."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from torch_topg.quant import QuantizedLinear

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    m = LlamaForCausalLM(cfg).eval()
    for mod in list(m.modules()):
        for child, lin in list(mod.named_children()):
            if not isinstance(lin, torch.nn.Linear):
                continue
            if child == "v_proj":  # an integer-dot format beside the K-quants
                q = QuantizedLinear.from_linear(lin, "q8_0", int8_activations=True)
            else:  # Q4_K_M's mix: q6_k down projections and head, q4_k the rest
                fmt = "q6_k" if child in ("down_proj", "lm_head") else "q4_k"
                q = _random_k_quant(lin, fmt, int8_activations=child != "lm_head")
            setattr(mod, child, q)
    r = _model_runner(m.to(dtype))
    assert r.plan is not None, r.plan_reason
    _compare_decode_and_verify(r, 15, steps=6, verify=[[5, 6, 7, 8, 9], [10, 11]])


@pytest.mark.parametrize(("preset", "dtype"), cover(["llama-tiny", "qwen2-tiny"], DTYPES), ids=_id)
def test_plan_equals_graph_on_verify_steps_and_short_chunks(preset, dtype):
    """Steps of several tokens a sequence: speculative verify steps (k + 1 rows, all
    sampled), a short prefill chunk beside decodes, one sequence alone with 15 tokens."""
    r = _runner(preset, dtype)
    seqs = Seqs(r, prompts(11, [5, 13, 2]), seed=7)
    seqs.prefill()
    g = random.Random(3)
    for step in range(6):
        n = [g.randint(1, 5) for _ in range(3)]
        new = [[g.randrange(3, 256) for _ in range(k)] for k in n]
        _compare(r, seqs.ragged_batch(new, n), step)
    _compare(r, seqs.ragged_batch([[7], [8] * 9, [9]], [1, 0, 1]))  # a 9-token chunk
    one = Seqs(r, prompts(12, [4]), seed=8)
    one.free = seqs.free
    one.prefill()
    b = one.ragged_batch([list(range(3, 18))], [2])  # 15 tokens, padded to two sequences
    assert b.seq_lens.numel() == 2
    _compare(r, b)
    b16 = one.ragged_batch([list(range(3, 19))], [1])  # 16: the graph's dense kernel
    assert not b16.fits_plan


@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 3, 4, 16]),
)
def test_plan_equals_graph_awkward_sizes(lengths, block_size):
    r = _RUNNERS.get(block_size) or _RUNNERS.setdefault(
        block_size, _runner("llama-tiny", torch.float32, num_blocks=400, block_size=block_size)
    )
    seqs = Seqs(r, prompts(len(lengths), lengths), seed=sum(lengths))
    seqs.prefill()
    _compare_steps(r, seqs, steps=3)


_RUNNERS: dict[int, ModelRunner] = {}


@pytest.mark.parametrize("preset", sorted(NOT_LOWERED))
def test_unlowered_families_fall_back_with_the_reason(preset):
    overrides, why = NOT_LOWERED[preset]
    with Engine.from_model(tiny(preset, **overrides), block_size=4) as eng:
        eng.generate([[5, 6, 7]], max_new_tokens=4, temperature=0)
        dp = eng.stats()["decode_plan"]
    assert dp["active"] is False and dp["steps"] == 0
    assert why in dp["reason"], dp


def test_engine_runs_decode_steps_on_the_plan():
    with Engine.from_model(tiny("llama-tiny"), block_size=4) as eng:
        out = eng.generate(prompts(4, [3, 9, 17]), max_new_tokens=6, temperature=0, ignore_eos=True)
        dp = eng.stats()["decode_plan"]
    assert dp["active"] and dp["reason"] == ""
    assert dp["steps"] >= 5, dp  # the first token comes from prefill
    assert all(len(o.token_ids) == 6 for o in out)


@pytest.mark.parametrize(
    ("options", "reason"),
    [(dict(decode_plan=False), "decode_plan=False"), (dict(deterministic=True), "deterministic")],
)
def test_engine_options_that_keep_the_graph(options, reason):
    with Engine.from_model(tiny("llama-tiny"), block_size=4, **options) as eng:
        eng.generate([[5, 6, 7]], max_new_tokens=3, temperature=0)
        dp = eng.stats()["decode_plan"]
    assert not dp["active"] and reason in dp["reason"] and dp["steps"] == 0


def test_decode_plan_option_is_checked():
    with pytest.raises(ValueError, match="decode_plan: expected True or False"):
        Engine.from_model(tiny("llama-tiny"), decode_plan="yes")


def test_in_place_weight_update_is_seen():
    r = _runner("llama-tiny", torch.float32)
    seqs = Seqs(r, prompts(5, [6, 11]))
    seqs.prefill()
    with torch.no_grad():
        r.model.model.layers[1].mlp.down_proj.weight.mul_(-0.5)
        r.model.lm_head.weight.add_(0.01)
    _compare_steps(r, seqs, steps=2)


def test_moved_weights_make_the_plan_stale_and_it_lowers_again():
    r = _runner("llama-tiny", torch.float32)
    seqs = Seqs(r, prompts(6, [6, 11]))
    seqs.prefill()
    old = r.plan
    w = r.model.model.layers[0].self_attn.q_proj.weight
    w.data = w.data.clone()  # same values, new storage
    b = seqs.decode_batch([1, 2])
    with pytest.raises(RuntimeError, match="DecodePlan is stale: layers.0.wq changed"):
        _plan_step(r, b)
    assert "layers.0.wq changed" in old.stale()
    args = (b.input_ids, b.positions, b.slot_mapping, b.block_tables, b.seq_lens,
            b.cu_seqlens_q, b.logits_indices)  # fmt: skip
    with pytest.raises(StalePlan, match="layers.0.wq changed"):  # typed: no text to match
        run_plan(old, *args)
    with pytest.raises(RuntimeError) as e:  # another refusal is not a StalePlan
        run_plan(lower(r.model, r.kv_caches, block_size=4, max_positions=16), *args[:-1], args[0])
    assert not isinstance(e.value, StalePlan)
    got = r.execute(b)  # refuses, lowers again, runs
    assert r.plan.stale() == ""
    assert r.plan is not None and r.plan is not old
    assert r.plan_steps == 1
    # a converted weight: lowering refuses it and the step returns to the graph's hands
    w.data = w.data.to(torch.bfloat16)
    assert r._run_plan(b) is None and r.plan is None
    assert "not contiguous torch.float32" in r.plan_reason
    assert got.shape == (2, r.model.config.vocab_size)


def test_lower_refuses_int8_kv_and_names_it():
    r = ModelRunner(tiny("llama-tiny"), num_blocks=8, block_size=4, max_blocks_per_seq=4,
                    compile=False, kv_cache_dtype="int8")  # fmt: skip
    with pytest.raises(Unsupported, match="KV cache dtype differs"):
        lower(r.model, r.kv_caches, block_size=4, max_positions=16)


def test_lower_refuses_attention_sinks():
    """The plan's attention has no sink term: a model with sinks stays on the graph."""
    r = ModelRunner(tiny("llama-tiny"), num_blocks=8, block_size=4, max_blocks_per_seq=4,
                    compile=False)  # fmt: skip
    heads = r.model.config.num_attention_heads
    r.model.model.layers[1].self_attn.sinks = torch.nn.Parameter(torch.zeros(heads))
    with pytest.raises(Unsupported, match=r"layers\.1\.self_attn\.sinks \(attention sinks\)"):
        lower(r.model, r.kv_caches, block_size=4, max_positions=16)


def test_thread_count_changes_and_profile(monkeypatch):
    monkeypatch.setenv("TOPG_PROFILE", "1")
    r = _runner("llama-tiny", torch.float32)
    seqs = Seqs(r, prompts(7, [4, 9, 30]))
    seqs.prefill()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            b = seqs.decode_batch([1, 2, 3])
            want = r.execute_graph(b)
            assert torch.equal(_plan_step(r, b), want)
            assert r.plan.last_members() == n
    finally:
        torch.set_num_threads(threads)
    prof = profile(r.plan)
    assert prof["steps"] == 3 and sum(prof["seconds"].values()) > 0


def _child(conn) -> None:
    r = _FORK["runner"]
    b = _FORK["batch"]
    conn.send(_plan_step(r, b).tolist())  # plain lists: a tensor would go through shm


_FORK: dict = {}


def test_plan_runs_in_a_forked_child():
    r = _runner("llama-tiny", torch.float32)
    seqs = Seqs(r, prompts(8, [4, 9]))
    seqs.prefill()
    b = seqs.decode_batch([1, 2])
    want = _plan_step(r, b)  # the parent's team has run before the fork
    _FORK.update(runner=r, batch=b)
    ctx = mp.get_context("fork")
    a, z = ctx.Pipe()
    p = ctx.Process(target=_child, args=(z,))
    p.start()
    p.join(timeout=120)
    if p.is_alive():
        p.kill()
        pytest.fail("the decode plan hung in a forked child")
    assert p.exitcode == 0
    assert torch.equal(torch.tensor(a.recv()), want)


def test_bad_inputs_get_clear_errors():
    r = _runner("llama-tiny", torch.float32)
    seqs = Seqs(r, prompts(9, [4]))
    seqs.prefill()
    b = seqs.decode_batch([1])
    args = [b.input_ids, b.positions, b.slot_mapping, b.block_tables, b.seq_lens, b.cu_seqlens_q,
            b.logits_indices]  # fmt: skip

    def run(i, t, match):
        bad = list(args)
        bad[i] = t
        with pytest.raises(RuntimeError, match=match):
            r.plan.run(*bad)

    run(0, torch.tensor([[999]]), r"input_ids\[0\] = 999 outside the vocabulary \[0, 256\)")
    run(1, b.positions.int(), "positions expected contiguous Long")
    run(1, torch.tensor([[10**6]]), r"positions\[0\] = 1000000 outside the rotary table")
    run(2, torch.tensor([r.num_blocks * r.block_size]), r"slot_mapping\[0\]")
    run(3, b.block_tables.long(), "block_tables expected int32")
    run(4, torch.tensor([10**6], dtype=torch.int32), r"seq_lens\[0\] = 1000000 outside \[1, ")
    run(5, torch.tensor([0, 2], dtype=torch.int32), "cu_seqlens_q expected to run from 0 to 1")
    run(6, torch.tensor([3]), r"logits_indices\[0\] = 3 outside \[0, 1\)")
    many = torch.arange(17).view(1, 17)
    bad = [many, many, many, b.block_tables, b.seq_lens, torch.tensor([0, 17], dtype=torch.int32),
           torch.tensor([16])]  # fmt: skip
    with pytest.raises(RuntimeError, match="17 tokens; the plan runs steps of at most 16"):
        r.plan.run(*bad)
    bt = b.block_tables.clone()
    bt[0, 0] = r.num_blocks
    run(3, bt, r"block_tables\[0, 0\]")
    p5 = [1e-6, 1.0, 1.0, 1.0, 1.0]
    with pytest.raises(RuntimeError, match="expected 26 weight tensors, got 0"):
        torch.classes.topg.DecodePlan(
            [], [], [], torch.zeros(4, 2), [1, 1, 1, 2, 4, -1, 0, 0, 1], p5, "paged"
        )
    with pytest.raises(
        RuntimeError, match=r"expected 4 per-layer dims \(window, top_k, flags, rot"
    ):
        torch.classes.topg.DecodePlan(
            [], [], [], torch.zeros(4, 2), [1, 1, 1, 2, 4, -1], p5, "paged"
        )
    with pytest.raises(RuntimeError, match=r"params expected \[eps, scale, embedding multiplier"):
        torch.classes.topg.DecodePlan(
            [], [], [], torch.zeros(4, 2), [1, 1, 1, 2, 4, -1, 0, 0, 1], [1e-6, 1.0], "paged"
        )
    with pytest.raises(RuntimeError, match="cache_layout expected 'paged' or 'bhsd', got 'x'"):
        torch.classes.topg.DecodePlan(
            [], [], [], torch.zeros(4, 2), [1, 1, 1, 2, 4, -1], [1e-6, 1.0], "x"
        )
