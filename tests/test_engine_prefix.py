"""Prefix reuse and the KV tiers in the engine: outputs with a cache hit equal those
without prefix caching (greedy, fp32), for a shared system prompt, a multi-turn
conversation and prefixes ending inside a block; demoted blocks come back from the host
and disk tiers; a corrupted disk record is recomputed; bad configurations fail early."""

from __future__ import annotations

import os

import pytest
from engine_utils import prompts, tiny, wait_idle, whole_pool

from torch_topg.engine import Engine
from torch_topg.engine.model_runner import ModelRunner

BS = 4
GREEDY = dict(max_new_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny("llama-tiny")


def engine(model, **kw):
    kw = {"block_size": BS, "compile": False, **kw}
    return Engine.from_model(model, **kw)


def outputs(eng, reqs, **kw):
    return [o.outputs[0].token_ids for o in eng.generate(reqs, **GREEDY, **kw)]


def reference(model, reqs):
    with engine(model, prefix_caching=False) as eng:
        got = outputs(eng, reqs)
        assert eng.stats()["kv"]["hit_tokens"] == 0
        return got


def test_shared_system_prompt(model):
    system = prompts(1, [37])[0]
    reqs = [system + p for p in prompts(2, [5, 9, 1, 12])]
    want = reference(model, reqs)
    with engine(model) as eng, whole_pool(eng):
        first = eng.generate(reqs[0], **GREEDY)[0]
        assert first.cached_prompt_tokens == 0
        rest = eng.generate(reqs[1:], **GREEDY)
        assert [first.outputs[0].token_ids] + [o.outputs[0].token_ids for o in rest] == want
        # every later request reuses the system prompt's full blocks (36 of 37 tokens)
        assert [o.cached_prompt_tokens for o in rest] == [36, 36, 36]
        kv = eng.stats()["kv"]
        assert kv["hit_tokens"] == 3 * 36 and kv["queries"] == 4


@pytest.mark.parametrize("prefix_len", [8, 10, 13])
def test_prefix_ending_inside_a_block(model, prefix_len):
    base = prompts(3, [prefix_len])[0]
    reqs = [base, [*base, 7, 8, 9]]
    want = reference(model, reqs)
    with engine(model) as eng, whole_pool(eng):
        got = [eng.generate(r, **GREEDY)[0] for r in reqs]
        assert [o.outputs[0].token_ids for o in got] == want
        # the shared prompt is reused up to its last full block (the first request's
        # output differs from [7, 8, 9])
        assert got[1].cached_prompt_tokens == prefix_len // BS * BS


def test_multi_turn_conversation_reuses_its_history(model):
    turns = prompts(4, [11, 6, 9, 3])
    with engine(model, prefix_caching=False) as ref, engine(model) as eng, whole_pool(eng):
        hist_ref, hist = [], []
        for t, user in enumerate(turns):
            hist_ref += user
            hist += user
            want = ref.generate(list(hist_ref), **GREEDY)[0].outputs[0].token_ids
            out = eng.generate(list(hist), session_id="chat-1", **GREEDY)[0]
            assert out.outputs[0].token_ids == want
            if t:  # the whole previous turn (prompt + answer) is reused, in full blocks
                assert out.cached_prompt_tokens == (len(hist) - len(user) - 1) // BS * BS
            hist_ref += want
            hist += out.outputs[0].token_ids
        st = eng.stats()["kv"]["sessions"]["chat-1"]
        assert st["requests"] == 4 and st["hit_tokens"] > 0
        eng.close_session("chat-1")
        wait_idle(eng)
        eng.generate([1, 2, 3], **GREEDY)  # the loop processed the close
        assert "chat-1" not in eng.stats()["kv"]["sessions"]


def tiered(model, tmp_path, device_blocks, host_blocks=6, disk_blocks=40, **kw):
    per = ModelRunner.bytes_per_block(
        model.config, BS, next(model.parameters()).dtype,
        kv_cache_dtype=kw.get("kv_cache_dtype", "auto"),
    )  # fmt: skip
    return engine(
        model, kv_cache_memory=device_blocks * per, host_kv_memory=host_blocks * per,
        disk_kv_path=tmp_path, disk_kv_memory=disk_blocks * per, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_demoted_blocks_come_back_from_host_and_disk(model, tmp_path, kv_dtype):
    """Records hold every cache tensor of a block (an int8 cache's scales too)."""
    reqs = prompts(5, [17, 21, 14, 19, 23, 18])
    with engine(model, prefix_caching=False, kv_cache_dtype=kv_dtype) as ref:
        want = outputs(ref, reqs)
    with tiered(model, tmp_path, 10, kv_cache_dtype=kv_dtype) as eng, whole_pool(eng):
        assert outputs(eng, reqs) == want  # each one evicts the ones before
        again = eng.generate(reqs, **GREEDY)
        assert [o.outputs[0].token_ids for o in again] == want
        assert all(o.cached_prompt_tokens > 0 for o in again)
        t = eng.stats()["kv"]["tiers"]
        assert t["device"]["evicted"] > 0 and t["host"]["stored"] > 0
        assert t["disk"]["stored"] > 0 and t["disk"]["promoted"] > 0
        assert t["host"]["promoted"] + t["disk"]["promoted"] > 0
        assert t["host"]["blocks_used"] <= 6 and t["disk"]["blocks_used"] <= 40
        eng.kv.check()
    assert os.listdir(tmp_path) == []  # the disk tier's file is removed at shutdown


def test_corrupt_disk_records_are_recomputed(model, tmp_path):
    reqs = prompts(6, [17, 21, 14, 19, 23, 18])
    want = reference(model, reqs)
    with tiered(model, tmp_path, device_blocks=10, host_blocks=1) as eng, whole_pool(eng):
        assert outputs(eng, reqs) == want
        disk = eng.kv.stores["disk"]
        assert eng.stats()["kv"]["tiers"]["disk"]["stored"] > 0
        os.pwrite(disk.fd, b"\x5a" * disk.nbytes, 0)  # every record corrupted
        assert outputs(eng, reqs) == want
        assert eng.stats()["kv"]["tiers"]["disk"]["errors"] > 0


def test_sessions_keep_their_blocks_on_the_device(model):
    """Device-only pool too small for everyone: a session's history survives the
    traffic of others, LRU alone would have evicted it."""
    chat = prompts(7, [30])[0]
    others = prompts(8, [25, 27, 29, 31])
    per = ModelRunner.bytes_per_block(model.config, BS, next(model.parameters()).dtype)
    for session, kept in ((None, False), ("s", True)):
        with engine(model, kv_cache_memory=24 * per, session_kv_share=0.5) as eng:
            eng.generate(chat, session_id=session, **GREEDY)
            for p in others:
                eng.generate(p, **GREEDY)
            out = eng.generate([*chat, 5], session_id=session, **GREEDY)[0]
            assert (out.cached_prompt_tokens > 0) == kept, (session, out.cached_prompt_tokens)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"host_kv_memory": 10}, "host_kv_memory: 10 bytes hold no KV block"),
        ({"disk_kv_path": "/nonexistent/kv"}, "disk_kv_path: '/nonexistent/kv' is not"),
        ({"disk_kv_memory": 1 << 20}, "disk_kv_memory: needs disk_kv_path"),
        ({"prefix_caching": False, "host_kv_memory": 1 << 20}, "need prefix_caching=True"),
        ({"prefix_caching": "yes"}, "prefix_caching: expected True or False"),
        ({"session_ttl": 0}, "session_ttl: expected seconds > 0"),
        ({"session_kv_share": 1.5}, r"session_kv_share: expected a fraction in \[0, 1\]"),
        ({"host_kv_memory": "lots"}, "host_kv_memory: expected bytes or a percentage"),
    ],
)
def test_bad_tier_options(model, kw, match):
    with pytest.raises(ValueError, match=match):
        engine(model, **kw)


def test_unwritable_disk_path(model, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    os.chmod(tmp_path, 0o500)
    try:
        with pytest.raises(ValueError, match="disk_kv_path: cannot create files"):
            engine(model, disk_kv_path=tmp_path)
    finally:
        os.chmod(tmp_path, 0o700)


def test_bad_session_id(model):
    with engine(model) as eng, pytest.raises(ValueError, match="session_id: expected a string"):
        eng.submit([1, 2, 3], session_id=7)
