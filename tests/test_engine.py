"""torch_topg.Engine on tiny transformers models: greedy outputs equal transformers'
``generate`` alone and under continuous batching (chunked prefill, late arrivals,
preemption), nothing compiles while serving, requests end cleanly (stop, EOS, length,
abort, errors) and the KV pool is whole after every test."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from engine_utils import hf_greedy, prompts, tiny, wait_idle, whole_pool

import torch_topg
from torch_topg.engine import Engine, QueueFull

pytest.importorskip("transformers")

FAMILIES = [
    "llama-tiny",
    "mistral-tiny",
    "qwen2-tiny",
    "qwen3-tiny",
    "gemma2-tiny",
    "mixtral-tiny",
    "qwen2moe-tiny",
]
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.mark.parametrize("preset", FAMILIES)
def test_greedy_matches_transformers_alone_and_batched(preset):
    ref = tiny(preset)
    ps = prompts(1, [9, 23, 4, 17])
    want = [hf_greedy(ref, p, 12) for p in ps]
    with Engine.from_model(tiny(preset), max_num_batched_tokens=16, block_size=4) as eng:
        with whole_pool(eng):
            alone = eng.generate([ps[0]], max_new_tokens=12, **GREEDY)[0]
            assert alone.token_ids == want[0]
            assert alone.finish_reason == "length" and alone.prompt_tokens == 9
            # Late arrivals: each request joins while the previous ones are decoding.
            handles, streams = [], []
            for p in ps:
                handles.append(eng.submit(p, max_new_tokens=12, **GREEDY))
                streams.append(iter(handles[-1]))
                next(streams[-1])  # its first token is out (keep the stream: no abort)
            got = [h.result().token_ids for h in handles]
        assert got == want
        st = eng.stats()
        assert st["compile"]["while_serving"] == 0, st["compile"]
        assert max(st["steps"]["batch_sizes"]) > 1


def test_compiled_once_nothing_while_serving():
    with Engine.from_model(tiny("llama-tiny"), compile=True, block_size=4) as eng:
        assert eng.runner.wait_compiled(timeout=600)  # the multi-token class, in the background
        ready = eng.stats()["compile"]["compilations"]
        assert ready >= 1
        ps = prompts(2, [1, 2, 3, 30, 5, 64])
        eng.generate(ps, max_new_tokens=5, **GREEDY)
        eng.generate(ps[:1], max_new_tokens=3, **GREEDY)
        assert eng.stats()["compile"]["compilations"] == ready


def _held_compile(monkeypatch) -> tuple[list[int], threading.Event]:
    """The background compile held until the returned event is set, and the token counts of
    the steps that run the model un-compiled (model_step) recorded in the returned list."""
    from torch_topg.engine import model_runner

    eager_calls, release = [], threading.Event()
    step, compile_step = model_runner.model_step, model_runner.ModelRunner._compile_in_background

    def counted(*args):
        eager_calls.append(args[1].shape[1])
        return step(*args)

    def held(self, b):
        release.wait(600)
        compile_step(self, b)

    monkeypatch.setattr(model_runner, "model_step", counted)
    monkeypatch.setattr(model_runner.ModelRunner, "_compile_in_background", held)
    return eager_calls, release


def test_background_compile_serves_on_the_plan_until_compiled(monkeypatch):
    """background_compile: the engine is ready before its multi-token graph compiles;
    until then every step fits the decode plan (a prompt longer than the plan's steps in
    chunks: ModelRunner.step_token_cap) and runs there, none un-compiled; the compiled
    graph takes over after, and greedy outputs equal transformers' throughout. The
    compile thread is held until the first requests are done, so the capped steps surely
    run; deterministic=True keeps the warm-up synchronous."""
    from torch_topg.engine import model_runner

    eager_calls, release = _held_compile(monkeypatch)
    ref = tiny("llama-tiny")
    ps = prompts(3, [9, 23, 40])  # 23 and 40: more than one plan step (15 tokens)
    want = [hf_greedy(ref, p, 8) for p in ps]
    eng = Engine.from_model(tiny("llama-tiny"), block_size=4)
    try:
        if not eng.stats()["decode_plan"]["active"]:  # no native plan (the reference lane):
            assert eng.stats()["compile"]["background"] == "off"
            assert eng.runner.step_token_cap is None
            return
        assert eng.stats()["compile"]["background"] == "compiling"
        assert eng.runner.step_token_cap == model_runner.PLAN_MAX_TOKENS - 1
        plan_steps = eng.runner.plan_steps
        got = [r.token_ids for r in eng.generate(ps, max_new_tokens=8, **GREEDY)]
        assert got == want and eager_calls == []  # nothing ran un-compiled
        assert eng.runner.plan_steps - plan_steps >= 3 + 8  # the chunks and the decodes
        release.set()
        assert eng.runner.wait_compiled(timeout=600)
        assert eng.stats()["compile"]["background"] == "done"  # before any step adopts it
        assert eng.runner.step_token_cap is None
        n = len(eager_calls)  # (the compile traced model_step once)
        got = [r.token_ids for r in eng.generate(ps, max_new_tokens=8, **GREEDY)]
        assert got == want and len(eager_calls) == n  # the compiled graph from here on
        st = eng.stats()["compile"]
        assert st["background"] == "done" and st["compilations"] >= 1, st
        assert st["while_serving"] == 0, st
    finally:
        release.set()  # (a failed check must not leave the compile thread held)
        eng.shutdown()
    with Engine.from_model(tiny("llama-tiny"), block_size=4, deterministic=True) as eng:
        assert eng.stats()["compile"]["background"] == "off"


def test_background_compile_steps_run_uncompiled_without_a_plan(monkeypatch):
    """Where the decode plan drops while the graph compiles (its weights moved and it no
    longer lowers), the cap lifts and a long prefill runs the model un-compiled, as
    before the cap; outputs still equal transformers'."""
    from torch_topg.engine import model_runner

    eager_calls, release = _held_compile(monkeypatch)
    ref = tiny("llama-tiny")
    ps = prompts(2, [30])
    want = [hf_greedy(ref, p, 4) for p in ps]
    eng = Engine.from_model(tiny("llama-tiny"), block_size=4)
    try:
        if eng.stats()["compile"]["background"] != "compiling":
            pytest.skip(
                "the native decode plan is not loaded (reference lane): no background compile"
            )
        eng.runner.plan, eng.runner._plan_wanted = None, "dropped by the test"
        assert eng.runner.step_token_cap is None
        got = [r.token_ids for r in eng.generate(ps, max_new_tokens=4, **GREEDY)]
        assert got == want and max(eager_calls) > model_runner.PLAN_MAX_TOKENS
    finally:
        release.set()  # before the shut-down, which waits for the compile thread
        eng.shutdown()


def test_chunked_prefill_and_preemption_keep_outputs():
    ref = tiny("llama-tiny")
    ps = prompts(3, [30, 25, 20, 28])
    want = [hf_greedy(ref, p, 20) for p in ps]
    # 4 sequences need 4 x 13 blocks of 4 tokens at the end; the pool has 24: the
    # newest are preempted and recomputed, and still produce the same tokens.
    per_block = 2 * 2 * 4 * 2 * 16 * 4  # k+v, layers, block, kv heads, head_dim, fp32
    with Engine.from_model(
        tiny("llama-tiny"), block_size=4, kv_cache_memory=24 * per_block, max_num_batched_tokens=8
    ) as eng:
        assert eng.pool.num_blocks == 24
        with whole_pool(eng):
            got = eng.generate(ps, max_new_tokens=20, **GREEDY)
        assert [o.token_ids for o in got] == want
        assert eng.stats()["requests"]["preemptions"] > 0


def test_stream_iterators_and_cancel_free_blocks():
    with Engine.from_model(tiny("llama-tiny"), block_size=4) as eng:
        p = prompts(4, [10])[0]
        full = eng.generate([p], max_new_tokens=16, **GREEDY)[0].token_ids
        with whole_pool(eng):
            ids = [t for d in eng.submit(p, max_new_tokens=16, **GREEDY) for t in d.token_ids]
            assert ids == full
            h = eng.submit(p, max_new_tokens=200, **GREEDY)
            for i, _ in enumerate(h):
                if i == 3:
                    break  # leaving the loop aborts the request
            out = h.result()
            assert out.finish_reason == "abort" and len(out.token_ids) < 200

        async def consume():
            ids = []
            async for d in eng.submit(p, max_new_tokens=16, **GREEDY):
                ids += d.token_ids
            return ids

        with whole_pool(eng):
            assert asyncio.run(consume()) == full

        async def cancel():
            n = 0
            async for _ in eng.submit(p, max_new_tokens=300, **GREEDY):
                n += 1
                if n == 2:
                    break

        with whole_pool(eng):
            asyncio.run(cancel())


def test_concurrent_asyncio_tasks():
    ref = tiny("llama-tiny")
    ps = prompts(19, [4, 9, 6, 12])
    want = [hf_greedy(ref, p, 7) for p in ps]
    with Engine.from_model(tiny("llama-tiny"), block_size=4, compile=False) as eng:

        async def one(p):
            ids = []
            async for d in eng.submit(p, max_new_tokens=7, **GREEDY):
                ids += d.token_ids
            return ids

        async def main():
            return await asyncio.gather(*(one(p) for p in ps))

        with whole_pool(eng):
            assert asyncio.run(main()) == want


def test_abort_by_id_and_shutdown_with_work_in_flight():
    eng = Engine.from_model(tiny("llama-tiny"), block_size=4)
    p = prompts(5, [8])[0]
    h = eng.submit(p, max_new_tokens=500, **GREEDY)
    stream = iter(h)
    next(stream)
    eng.abort(h.request_id)
    assert h.result(timeout=30).finish_reason == "abort"
    wait_idle(eng)
    eng.pool.check_whole()
    h2 = eng.submit(p, max_new_tokens=500, **GREEDY)
    eng.shutdown()
    assert h2.result(timeout=30).finish_reason == "abort"
    eng.pool.check_whole()
    with pytest.raises(RuntimeError, match="after shutdown"):
        eng.submit(p)
    eng.shutdown()  # idempotent


def test_many_threads_submit_at_once():
    ref = tiny("qwen2-tiny")
    ps = prompts(6, [3, 7, 11, 5, 9, 13, 2, 6])
    want = [hf_greedy(ref, p, 6) for p in ps]
    got: dict[int, list[int]] = {}
    with Engine.from_model(tiny("qwen2-tiny"), block_size=4, max_batch_size=4) as eng:
        with whole_pool(eng):

            def worker(i):
                got[i] = eng.generate([ps[i]], max_new_tokens=6, **GREEDY)[0].token_ids

            ts = [threading.Thread(target=worker, args=(i,)) for i in range(len(ps))]
            for t in ts:
                t.start()
            for t in ts:
                t.join(60)
        assert [got[i] for i in range(len(ps))] == want
        assert max(eng.stats()["steps"]["batch_sizes"]) <= 4


def test_finish_reasons_eos_length_stop_tokens():
    model = tiny("llama-tiny")
    p = prompts(7, [6])[0]
    with Engine.from_model(model, block_size=4) as eng, whole_pool(eng):
        free = eng.generate([p], max_new_tokens=10, **GREEDY)[0].token_ids
        stop_tok = free[4]
        first = free.index(stop_tok)
        out = eng.generate([p], max_new_tokens=10, temperature=0, stop_token_ids=[stop_tok])[0]
        assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
        # EOS: the model's eos id ends the sequence unless ignore_eos.
        eng._eos = frozenset({stop_tok})
        out = eng.generate([p], max_new_tokens=10, temperature=0)[0]
        assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
        out = eng.generate([p], max_new_tokens=10, temperature=0, ignore_eos=True)[0]
        assert out.token_ids == free and out.finish_reason == "length"
        # max_length counts the prompt (transformers' meaning).
        out = eng.generate([p], max_length=9, **GREEDY)[0]
        assert out.token_ids == free[:3] and out.finish_reason == "length"


def test_n_samples_and_seeded_sampling_reproducible():
    with Engine.from_model(tiny("llama-tiny"), block_size=4, seed=0) as eng, whole_pool(eng):
        p = prompts(8, [7])[0]
        a = eng.generate([p], n=3, temperature=1.0, seed=123, max_new_tokens=12)[0]
        assert len(a.outputs) == 3 and a.completion_tokens == 36
        assert len({tuple(o.token_ids) for o in a.outputs}) > 1
        # Same seed, other batch-mates: the same draws.
        hs = [eng.submit(q, temperature=1.0, max_new_tokens=12) for q in prompts(9, [5, 9])]
        b = eng.generate([p], n=3, temperature=1.0, seed=123, max_new_tokens=12)[0]
        for h in hs:
            h.result()
        assert [o.token_ids for o in b.outputs] == [o.token_ids for o in a.outputs]


@pytest.mark.parametrize("prompt_len", [8, 9])  # ends on a block boundary / inside a block
def test_n_samples_fork_from_the_prompt_blocks(prompt_len):
    ref = tiny("llama-tiny")
    p = prompts(18, [prompt_len])[0]
    want = hf_greedy(ref, p, 10)
    with Engine.from_model(tiny("llama-tiny"), block_size=4, compile=False) as eng, whole_pool(eng):
        forks = []
        real = eng.scheduler.fork
        eng.scheduler.fork = lambda parent, children: (
            forks.append(real(parent, children)) or forks[-1]
        )
        out = eng.generate([p], n=3, max_new_tokens=10, **GREEDY)[0]
        # Greedy samples forked from the shared prompt blocks (and the copied partial
        # block) continue exactly as one sequence would.
        assert [o.token_ids for o in out.outputs] == [want] * 3
        # Full blocks shared; a partial last block copied once per other sample.
        started, copies = forks[0]
        assert len(forks) == 1 and len(started) == 2
        assert len(copies) == (0 if prompt_len % 4 == 0 else 2)


def test_n_samples_fork_within_max_batch_size():
    """The samples that do not fit under max_batch_size wait and prefill on their own
    (from the prefix cache); every step stays within the limit, the answers are the same."""
    ref = tiny("llama-tiny")
    p = prompts(19, [9])[0]
    want = hf_greedy(ref, p, 6)
    with Engine.from_model(tiny("llama-tiny"), block_size=4, compile=False) as eng, whole_pool(eng):
        eng.configure(max_batch_size=2)
        out = eng.generate([p], n=4, max_new_tokens=6, **GREEDY)[0]
        assert [o.token_ids for o in out.outputs] == [want] * 4
        assert max(eng.stats()["steps"]["batch_sizes"]) <= 2
        assert out.outputs[3].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(tempurature=1.0), "tempurature"),
        (dict(max_length=3), "max_length"),
    ],
)
def test_bad_sampling_parameters_raise_naming_them(kwargs, name):
    with Engine.from_model(tiny("llama-tiny"), block_size=4, compile=False) as eng:
        running = eng.submit(prompts(10, [5])[0], max_new_tokens=30, **GREEDY)
        with pytest.raises(ValueError, match=name):
            eng.submit(prompts(11, [5])[0], **kwargs)
        assert len(running.result().token_ids) == 30  # the others keep running


@pytest.mark.parametrize(
    ("prompt", "match"),
    [("", "prompt"), ([], "prompt"), ([1, 2, 999], "prompt"), (3.5, "prompt")],
)
def test_bad_prompts_raise(prompt, match):
    with Engine.from_model(tiny("llama-tiny"), block_size=4, compile=False) as eng:
        with pytest.raises(ValueError, match=match):
            eng.submit(prompt)


def test_prompt_longer_than_context_and_options():
    with Engine.from_model(tiny("llama-tiny"), max_model_len=32, compile=False) as eng:
        with pytest.raises(ValueError, match="max_model_len"):
            eng.submit(list(range(3, 40)))
        out = eng.generate([list(range(3, 20))], max_new_tokens=100, **GREEDY)[0]
        assert out.finish_reason == "length" and out.prompt_tokens + out.completion_tokens == 32
    for bad, name in [
        (dict(max_batch_size=0), "max_batch_size"),
        (dict(block_size=-4), "block_size"),
        (dict(kv_cache_memory="abc"), "kv_cache_memory"),
        (dict(kv_cache_memory=10), "kv_cache_memory"),
        (dict(batch_timeout=-1), "batch_timeout"),
        (dict(max_queue=0), "max_queue"),
        (dict(bogus=1), "bogus"),
    ]:
        with pytest.raises(ValueError, match=name):
            Engine.from_model(tiny("llama-tiny"), compile=False, **bad)


def test_failing_step_fails_only_its_request(monkeypatch):
    with Engine.from_model(tiny("llama-tiny"), block_size=4, compile=False) as eng:
        ps = prompts(12, [6, 7])
        want = eng.generate(ps[:1], max_new_tokens=8, **GREEDY)[0].token_ids
        poison = 255
        real = eng.runner.execute

        def execute(batch):
            if bool((batch.input_ids == poison).any()):
                raise RuntimeError("injected failure")
            return real(batch)

        monkeypatch.setattr(eng.runner, "execute", execute)
        with whole_pool(eng):
            good = eng.submit(ps[0], max_new_tokens=8, **GREEDY)
            bad = eng.submit(ps[1] + [poison], max_new_tokens=8, **GREEDY)
            with pytest.raises(RuntimeError, match="injected"):
                bad.result(timeout=30)
            assert good.result(timeout=30).token_ids == want
        assert eng.stats()["requests"]["failed"] == 1


def test_queue_limit_and_configure():
    with Engine.from_model(tiny("llama-tiny"), block_size=4, compile=False, max_queue=2) as eng:
        eng.configure(max_batch_size=1, batch_timeout=0)
        p = prompts(13, [5])[0]
        hs = []
        with pytest.raises(QueueFull, match="max_queue"):
            for _ in range(50):
                hs.append(eng.submit(p, max_new_tokens=50, **GREEDY))
        for h in hs:
            h.abort()
        with pytest.raises(ValueError, match="max_batch_size"):
            eng.configure(max_batch_size=0)
        wait_idle(eng)
        eng.pool.check_whole()


def test_batch_timeout_gathers_companions():
    with Engine.from_model(tiny("llama-tiny"), block_size=4, compile=False) as eng:
        eng.configure(batch_timeout=300)
        ps = prompts(14, [5, 6, 7])
        hs = [eng.submit(p, max_new_tokens=2, **GREEDY) for p in ps]
        for h in hs:
            h.result()
        assert eng.stats()["steps"]["batch_sizes"].get(3, 0) >= 1


def test_stats_sections():
    with Engine.from_model(tiny("llama-tiny"), block_size=4, compile=False) as eng:
        eng.generate(prompts(15, [5, 9]), max_new_tokens=4, **GREEDY)
        st = eng.stats()
        assert {"requests", "tokens", "steps", "kv", "time", "compile"} <= set(st)
        assert st["tokens"]["generated"] == 8 and st["requests"]["finished"] == 2
        assert st["kv"]["blocks_total"] == eng.pool.num_blocks


def test_model_errors_name_what_works(tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(
        T5Config(num_layers=1, d_model=32, d_kv=8, num_heads=2, d_ff=32)
    )
    with pytest.raises(ValueError, match="encoder-decoder"):  # the feature, not a list
        Engine.from_model(t5)
    with pytest.raises(ValueError, match="local Hugging Face cache"):
        Engine.from_pretrained("no-such-owner/no-such-model-xyz")
    with pytest.raises(ValueError, match="GGUF"):
        Engine.from_pretrained(tmp_path / "missing.gguf")


@pytest.mark.skipif(
    not torch_topg.native_available(),
    reason="needs the native CPU kernels (not built, or TOPG_DISABLE_NATIVE=1)",
)
@pytest.mark.parametrize("preset", ["llama-tiny", "mixtral-tiny"])
def test_logits_independent_of_batch_mates_deterministic(preset):
    """deterministic=True: a sequence's greedy tokens and logprobs are bitwise the same
    alone and in a batch with others of different lengths."""
    with Engine.from_model(tiny(preset), block_size=4, deterministic=True) as eng:
        p = prompts(16, [11])[0]
        alone = eng.generate([p], max_new_tokens=10, logprobs=0, **GREEDY)[0]
        others = [eng.submit(q, max_new_tokens=30, **GREEDY) for q in prompts(17, [3, 40, 8])]
        batched = eng.generate([p], max_new_tokens=10, logprobs=0, **GREEDY)[0]
        for h in others:
            h.result()
        assert batched.token_ids == alone.token_ids
        a = torch.tensor([lp.logprob for lp in alone.outputs[0].logprobs])
        b = torch.tensor([lp.logprob for lp in batched.outputs[0].logprobs])
        assert torch.equal(a, b)
