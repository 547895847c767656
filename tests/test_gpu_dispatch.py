"""The CUDA dispatch (torch_topg.ops.dispatch) on the CPU: the decision with synthetic
tables and stand-in candidates, the shape classes, the tuning loop with a synthetic
clock, and every candidate that runs on CPU tensors against the op's reference.

What needs a GPU (topg's CUDA kernels, cuDNN / memory-efficient SDPA, grouped_mm on CUDA,
the Triton kernels compiled, real timings) is tests/test_cuda_dispatch.py.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import assert_close
from hypothesis import given
from hypothesis import strategies as st

import torch_topg
from torch_topg import _native, modes, reference
from torch_topg.bench.timing import Budget, HostClock
from torch_topg.ops import dispatch
from torch_topg.ops._schemas import DISPATCHED_ON_CUDA, INTERNAL_SCHEMAS, SCHEMAS
from torch_topg.ops.dispatch import candidates as cands
from torch_topg.ops.dispatch import table as tables
from torch_topg.ops.dispatch import tune
from torch_topg.ops.dispatch.classes import bucket, classify

GPU = ("NVIDIA H200", (9, 0))
OPS = DISPATCHED_ON_CUDA


def fake(name: str, op: str = "linear", refuse: str | None = None, calls: list | None = None):
    """A stand-in candidate: the reference's result; refuses every call with ``refuse``."""

    def run(*args, **kwargs):
        if calls is not None:
            calls.append(name)
        return getattr(reference, op)(*args, **kwargs)

    def supports(*args, **kwargs):
        return refuse

    return dispatch.Candidate(name, op, run, supports)


def dispatcher(tmp_path: Path, table: dict | str | None, cand_list, deterministic=lambda: False):
    """A dispatcher for ``linear`` with stand-ins and, if given, a table file."""
    path = tmp_path / "table.json"
    if table is not None:
        path.write_text(table if isinstance(table, str) else json.dumps(table))
    return dispatch.Dispatcher(
        {"linear": [*cand_list, fake("reference")]},
        device_info=lambda device: GPU,
        paths=lambda name: [("test", path)],
        deterministic=deterministic,
    )


def linear_table(times: dict[str, float], cls: str = "fp32 m4", **header) -> dict:
    data = tables.new_table(*GPU, commit="test", **header)
    pick = min(times, key=times.get)
    data["entries"] = [{"op": "linear", "class": cls, "times_us": times, "pick": pick}]
    return data


X, W = torch.randn(4, 32), torch.randn(8, 32)


def test_internal_schemas_mirror_the_public_ones():
    for op in OPS:
        assert INTERNAL_SCHEMAS[f"_cuda_{op}"] == f"_cuda_{SCHEMAS[op]}"
        assert getattr(torch.ops.topg, f"_cuda_{op}").default._schema.name == f"topg::_cuda_{op}"


def test_picks_the_fastest_supported_candidate(tmp_path):
    calls: list[str] = []
    d = dispatcher(tmp_path, linear_table({"topg": 30.0, "fast": 10.0, "mid": 20.0}),
                   [fake("topg", calls=calls), fake("mid", calls=calls), fake("fast", calls=calls)])  # fmt: skip
    out = d.call("linear", (X, W), {})
    assert_close(out, reference.linear(X, W))
    dec = d.decision("linear", (X, W), {})
    assert (dec.candidate.name, dec.source, dec.cls) == ("fast", "table", "fp32 m4")
    assert dec.times_us == {"topg": 30.0, "fast": 10.0, "mid": 20.0}
    assert calls == ["fast"] and not dec.skipped
    assert "fast 10.0 us" in dec.describe() and str(tmp_path / "table.json") in dec.why


@pytest.mark.parametrize("reason", ["softcap", "sliding window", "mask", "dtype float32"])
def test_skips_a_candidate_that_cannot_take_the_call_and_says_why(tmp_path, reason):
    d = dispatcher(tmp_path, linear_table({"fast": 10.0, "mid": 20.0, "topg": 30.0}),
                   [fake("topg"), fake("fast", refuse=reason), fake("mid")])  # fmt: skip
    dec = d.decision("linear", (X, W), {})
    assert dec.candidate.name == "mid"
    assert dec.skipped == [("fast", reason)]
    assert f"skipped fast: {reason}" in str(d.report())


def test_unmeasured_candidates_follow_in_the_fixed_order(tmp_path):
    d = dispatcher(tmp_path, linear_table({"torch_linear": 10.0}),
                   [fake("topg"), fake("torch_linear", refuse="dtype float32")])  # fmt: skip
    dec = d.decision("linear", (X, W), {})
    assert dec.candidate.name == "topg"  # the table's pick refused, topg never measured
    assert dec.skipped == [("torch_linear", "dtype float32")]


def test_without_a_table_the_fixed_order_runs_and_says_so(tmp_path):
    d = dispatcher(tmp_path, None, [fake("topg"), fake("torch_linear")])
    dec = d.decision("linear", (X, W), {})
    assert (dec.candidate.name, dec.source) == ("torch_linear", "fixed order")
    assert "no tuning table for NVIDIA H200" in dec.why and "1.2-1.4x" in dec.why
    # a table without this class: the fixed order too
    d = dispatcher(
        tmp_path, linear_table({"topg": 1.0}, cls="fp32 m64"), [fake("topg"), fake("torch_linear")]
    )
    dec = d.decision("linear", (X, W), {})
    assert dec.candidate.name == "torch_linear" and "has no entry for this class" in dec.why


def _bad_tables() -> dict[str, tuple[object, str]]:
    good = linear_table({"topg": 1.0})
    other_gpu = {**good, "gpu": {"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0]}}
    other_cap = {**good, "gpu": {"name": "NVIDIA H200", "capability": [8, 0]}}
    no_pick = {**good, "entries": [{**good["entries"][0], "pick": "nothing"}]}
    negative = {**good, "entries": [{**good["entries"][0], "times_us": {"topg": -1}}]}
    return {
        "corrupt": ('{"format": "torch_topg.tuning", "version": 1, "gpu": ', "not valid JSON"),
        "other gpu": (
            other_gpu,
            "measured on NVIDIA H100 80GB HBM3 (sm_90), this GPU is NVIDIA H200",
        ),
        "other capability": (other_cap, "measured on NVIDIA H200 (sm_80)"),
        "version": ({**good, "version": 99}, "format version 99; this torch_topg reads version 1"),
        "format": ({**good, "format": "other"}, "'format' is 'other'"),
        "no entries": ({k: v for k, v in good.items() if k != "entries"}, "no 'entries' list"),
        "bad pick": (no_pick, "entry 0: pick 'nothing' has no time"),
        "bad time": (negative, "time of 'topg' is not a positive number"),
        "unknown op": (
            {**good, "entries": [{**good["entries"][0], "op": "rms_norm"}]},
            "op 'rms_norm'",
        ),
    }


@pytest.mark.parametrize("case", list(_bad_tables()))
def test_a_bad_table_is_refused_once_and_the_fixed_order_runs(tmp_path, case):
    data, reason = _bad_tables()[case]
    data = data if isinstance(data, str) else json.dumps(data)
    path = tmp_path / "table.json"
    with pytest.warns(RuntimeWarning) as caught:
        d = dispatcher(tmp_path, data, [fake("topg"), fake("torch_linear")])
        dec = d.decision("linear", (X, W), {})
    msg = str(caught[0].message)
    assert str(path) in msg and reason in msg and "fixed order" in msg, msg
    assert (dec.candidate.name, dec.source) == ("torch_linear", "fixed order")
    assert reason in dec.why
    with warnings.catch_warnings():  # once per file and reason, not per dispatcher
        warnings.simplefilter("error")
        dispatcher(tmp_path, data, [fake("topg")]).decision("linear", (X, W), {})


def test_table_lookup_order(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TOPG_TUNING_TABLE", raising=False)
    sources = [s for s, _ in tables.table_paths("NVIDIA H200")]
    assert sources == ["user cache", "package"]
    paths = [p for _, p in tables.table_paths("NVIDIA H200")]
    assert paths[0] == tmp_path / "cache" / "torch_topg" / "tuning" / "nvidia-h200.json"
    assert paths[1] == tables.TABLES_DIR / "nvidia-h200.json"
    monkeypatch.setenv("TOPG_TUNING_TABLE", str(tmp_path / "mine.json"))
    assert tables.table_paths("NVIDIA H200")[0] == ("TOPG_TUNING_TABLE", tmp_path / "mine.json")
    assert tables.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_no_measured_table_is_shipped():
    """Tables come from a GPU run only (docs/gpu.md); whatever is shipped must load."""
    for path in tables.TABLES_DIR.glob("*.json"):
        data = json.loads(path.read_text())
        gpu = data["gpu"]
        t = tables.load_table(path, gpu["name"], tuple(gpu["capability"]), OPS)
        assert t.entries and data.get("commit") and data.get("date"), path


def test_deterministic_mode_is_fixed_and_batch_independent(tmp_path):
    on = [True]
    d = dispatcher(tmp_path, linear_table({"torch_linear": 1.0, "topg": 50.0}),
                   [fake("topg"), fake("torch_linear")], deterministic=lambda: on[0])  # fmt: skip
    picks = set()
    for m in (1, 2, 3, 7, 16, 64, 300):
        dec = d.decision("linear", (torch.randn(m, 32), W), {})
        picks.add((dec.candidate.name, dec.source))
    assert picks == {("topg", "deterministic")}
    on[0] = False
    assert d.decision("linear", (X, W), {}).candidate.name == "torch_linear"


def test_batch_invariant_mode_sets_the_flag_the_dispatch_reads():
    assert not modes.batch_invariant_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # without native kernels it warns
        restore = modes.batch_invariant_mode()
    try:
        assert modes.batch_invariant_enabled()
    finally:
        restore()
    assert not modes.batch_invariant_enabled()


def test_the_decision_is_cached_per_class_and_features(tmp_path):
    asked: list[str] = []

    def counting(name):
        c = fake(name)
        return dispatch.Candidate(name, "linear", c.run, lambda *a, **k: asked.append(name))

    d = dispatcher(tmp_path, None, [counting("topg"), counting("torch_linear")])
    for _ in range(3):
        d.call("linear", (X, W), {})
    assert asked == ["torch_linear"]
    d.call("linear", (X, W, torch.randn(8)), {})  # bias: another feature key
    d.call("linear", (torch.randn(64, 32), W), {})  # another class
    assert asked == ["torch_linear"] * 3
    assert [dec.calls for dec in d.report().decisions] == [3, 1, 1]


def test_forced_candidates(tmp_path, monkeypatch):
    monkeypatch.setenv("TOPG_DISPATCH", "linear=topg")
    d = dispatcher(
        tmp_path, None, [fake("topg"), fake("torch_linear"), fake("slow", refuse="softcap")]
    )
    dec = d.decision("linear", (X, W), {})
    assert (dec.candidate.name, dec.source) == ("topg", "forced")
    d.force("slow")
    with pytest.raises(RuntimeError, match="asks for 'slow', which cannot take this call: softcap"):
        d.decision("linear", (X, W), {})
    d.force("nothing")
    with pytest.raises(ValueError, match="'nothing', not one of"):
        d.decision("linear", (X, W), {})
    with pytest.raises(ValueError, match="'norm' is not a dispatched op"):
        d.force("norm=topg")


def test_bad_input_gets_the_ops_error_whichever_candidate_runs(tmp_path):
    d = dispatcher(tmp_path, None, [fake("topg"), fake("torch_linear")])
    with pytest.raises(
        RuntimeError, match="topg::linear: argument 'weight'.*expected size 32 at dim 1"
    ):
        d.call("linear", (X, torch.randn(8, 31)), {})
    d.call("linear", (X, W), {})  # decided: torch_linear checks on every call
    with pytest.raises(RuntimeError, match="topg::linear: argument 'weight'.*contiguous"):
        d.call("linear", (X, torch.randn(32, 8).T), {})


def test_cpu_calls_never_reach_the_dispatch():
    """CPU tensors run the CPU keys as before; the CUDA keys get the dispatch only where
    the native library registered topg's CUDA kernels (never in a CPU build)."""
    before = len(dispatch.dispatch_report().decisions)
    out = torch_topg.ops.linear(X, W)
    assert_close(out, reference.linear(X, W))
    q = torch.randn(1, 5, 4, 16)
    assert_close(
        torch_topg.ops.attention(q, q, q, causal=True), reference.attention(q, q, q, causal=True)
    )
    assert len(dispatch.dispatch_report().decisions) == before
    for op in OPS:
        has_cuda_kernel = _native.has_kernel(f"_cuda_{op}", "CUDA")
        assert (op in dispatch.INSTALLED) == has_cuda_kernel
        assert _native.has_kernel(op, "CUDA") == has_cuda_kernel
        if _native.is_loaded():
            assert _native.has_kernel(op, "CPU")


# --- shape classes ------------------------------------------------------------------


def test_bucket():
    assert [bucket(n) for n in (-1, 0, 1, 2, 3, 5, 1024, 1025)] == [0, 0, 1, 2, 4, 8, 1024, 2048]


def test_classes_on_awkward_shapes():
    bf = torch.bfloat16
    q = torch.empty(2, 0, 32, 128, dtype=bf)
    kv = torch.empty(2, 7, 8, 128, dtype=bf)
    cls, feats = classify("attention", (q, kv, kv), {"causal": True})
    assert cls == "bf16 d128 g4 s0" and feats[7] is True  # empty
    rq = torch.empty(37, 6, 80)
    cls, feats = classify(
        "attention", (rq, rq[:, :1], rq[:, :1]), {"cu_seqlens_q": torch.tensor([0, 37])}
    )
    assert cls == "fp32 d80 g6 s64" and feats[1] is True  # ragged: the tokens, no max_seqlen
    cls, _ = classify(
        "attention", (rq, rq, rq), {"cu_seqlens_q": torch.tensor([0, 37]), "max_seqlen_q": 5}
    )
    assert cls == "fp32 d80 g1 s8"
    # paged: capacity from the block table, rows per sequence when ragged
    pq, cache = torch.empty(9, 8, 64, dtype=bf), torch.empty(10, 16, 2, 64, dtype=torch.int8)
    bt, sl = torch.empty(3, 5, dtype=torch.int32), torch.empty(3, dtype=torch.int32)
    cls, _ = classify(
        "paged_attention", (pq, cache, cache, bt, sl), {"cu_seqlens_q": torch.empty(4)}
    )
    assert cls == "bf16 kvint8 d64 g4 b4 ctx128 q4"
    cls, _ = classify("paged_attention", (pq[:3], cache, cache, bt, sl), {})
    assert cls == "bf16 kvint8 d64 g4 b4 ctx128 q1"
    x = torch.empty(0, 64, dtype=torch.float16)
    args = (x, torch.empty(8, 96, 64, dtype=torch.float16), torch.empty(8, 64, 48, dtype=torch.float16),
            torch.empty(0, 2), torch.empty(0, 2, dtype=torch.int32))  # fmt: skip
    cls, feats = classify("fused_moe", args, {})
    assert cls == "fp16 e8 k2 i64 t0" and feats[1] == "silu" and feats[4] is True
    assert classify("linear", (torch.empty(3, 0, 5), torch.empty(2, 5)), {})[0] == "fp32 m0"
    assert classify("linear", (torch.empty(3, 7, 5), torch.empty(2, 5)), {})[0] == "fp32 m32"


# --- candidates that run on CPU tensors, against the reference ------------------------

SDPA_CPU = {
    "sdpa_flash": cands.sdpa_candidate("sdpa_flash", "FLASH_ATTENTION", "can_use_flash_attention"),
    "sdpa_math": cands.sdpa_candidate("sdpa_math", "MATH"),  # the same glue, any dtype
}


@given(
    b=st.integers(1, 2),
    s=st.integers(1, 17),
    heads=st.sampled_from([(1, 1), (4, 1), (8, 2), (6, 6)]),
    d=st.sampled_from([16, 64]),
    causal=st.booleans(),
    scale=st.sampled_from([None, 0.3]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    name=st.sampled_from(list(SDPA_CPU)),
)
def test_sdpa_candidates_match_the_reference(b, s, heads, d, causal, scale, dtype, name):
    hq, hkv = heads
    q = torch.randn(b, s, hq, d).to(dtype)
    k, v = torch.randn(b, s, hkv, d).to(dtype), torch.randn(b, s, hkv, d).to(dtype)
    kw = {"causal": causal, "scale": scale}
    c = SDPA_CPU[name]
    if name == "sdpa_flash" and dtype == torch.float32:
        assert c.supports(q, k, v, **kw) == "dtype float32 (fp16 / bf16 only)"
        c = SDPA_CPU["sdpa_math"]
    assert c.supports(q, k, v, **kw) is None
    out = c.run(q, k, v, **kw)
    assert out.shape == q.shape and out.is_contiguous()
    assert_close(out, reference.attention(q, k, v, **kw), scale=2.0)


def test_sdpa_candidates_say_what_they_cannot_take():
    bf = torch.bfloat16
    q, kv = torch.randn(1, 4, 8, 64, dtype=bf), torch.randn(1, 6, 2, 64, dtype=bf)
    cases = {
        "softcap": {"softcap": 30.0},
        "attention sinks": {"sinks": torch.zeros(8)},
        "sliding window": {"window_left": 3},
        "mask": {"mask": torch.ones(4, 6, dtype=torch.bool)},
        "causal with Sq != Sk": {"causal": True},
    }
    for name in cands.SDPA_BACKENDS:
        c = cands.sdpa_candidate(name, *cands.SDPA_BACKENDS[name])
        for reason, kw in cases.items():
            assert c.supports(q, kv, kv, **kw).startswith(reason), (name, reason)
        rq = torch.randn(4, 8, 64, dtype=bf)
        assert c.supports(rq, rq, rq, cu_seqlens_q=torch.tensor([0, 4])) == "varlen (cu_seqlens)"
        assert c.supports(q[:, :0], kv, kv) == "empty input"
    eff = cands.sdpa_candidate("sdpa_efficient", *cands.SDPA_BACKENDS["sdpa_efficient"])
    assert eff.supports(q, kv, kv).startswith("GQA 8/2")
    flash = cands.sdpa_candidate("sdpa_flash", *cands.SDPA_BACKENDS["sdpa_flash"])
    wide = torch.randn(1, 4, 2, 320, dtype=bf)
    assert flash.supports(wide, wide, wide).startswith("head_dim 320")


@given(
    t=st.integers(0, 9),
    e=st.integers(1, 6),
    k=st.integers(1, 3),
    hi=st.sampled_from([(8, 8), (16, 24), (24, 16)]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    activation=st.sampled_from(["silu", "gelu", "gelu_tanh"]),
    name=st.sampled_from(["grouped_mm", "expert_loop"]),
)
def test_moe_candidates_match_the_reference(t, e, k, hi, dtype, activation, name):
    h, inter = hi
    k = min(k, e)
    x = torch.randn(t, h).to(dtype)
    wgu, wd = (
        (torch.randn(e, 2 * inter, h) * 0.3).to(dtype),
        (torch.randn(e, h, inter) * 0.3).to(dtype),
    )
    w, ids = torch.rand(t, e).softmax(-1).topk(k, dim=-1)
    args = (x, wgu, wd, w, ids.to(torch.int32))
    c = cands.grouped_mm_candidate() if name == "grouped_mm" else cands.expert_loop_candidate()
    if c.supports(*args, activation=activation) == "empty input":
        assert t == 0 and name == "grouped_mm"
        return
    assert c.supports(*args, activation=activation) is None
    out = c.run(*args, activation=activation)
    # the intermediate act(gate) * up is rounded to the dtype (as GPU engines do)
    assert_close(out, reference.fused_moe(*args, activation=activation), scale=2.0)


def test_moe_candidates_on_bad_expert_ids():
    x, wgu, wd = torch.randn(3, 8), torch.randn(4, 16, 8), torch.randn(4, 8, 8)
    ids, w = torch.tensor([[0, 5], [1, 2], [-1, 3]]), torch.rand(3, 2)
    with pytest.raises(RuntimeError, match=r"'topk_ids' holds an expert id outside \[0, 4\)"):
        cands.expert_loop_candidate().run(x, wgu, wd, w, ids)
    # grouped_mm drops them (no host read), as topg's CUDA kernel does with checks off
    out = cands.grouped_mm_candidate().run(x, wgu, wd, w, ids)
    keep = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    assert_close(out, reference.fused_moe(x, wgu, wd, w * keep, ids.clamp(0, 3)))


@given(
    lead=st.sampled_from([(1,), (5,), (2, 3), (0,)]),
    nk=st.sampled_from([(1, 1), (7, 13), (64, 32)]),
    bias=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_torch_linear_matches_the_reference(lead, nk, bias, dtype):
    n, k = nk
    x, w = torch.randn(*lead, k).to(dtype), torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    assert_close(cands.torch_linear_candidate().run(x, w, b), reference.linear(x, w, b), scale=2.0)


def test_every_op_has_its_candidates_and_a_fixed_order():
    for op in OPS:
        names = [c.name for c in cands.candidates(op)]
        assert names[0] == "topg" and names[-1] == "reference"
        for cls in ("bf16 e8 k2 i16384 t1", "bf16 e128 k8 i1024 t64", "bf16 m4"):
            order, why = dispatch.fixed_order(op, cls)
            assert order[-1] == "reference" and set(order) <= set(names) and why
            assert set(names) - {"reference"} <= set(order), (op, names, order)
        assert dispatch.DETERMINISTIC[op] in names
    topg = cands.topg_candidate("linear")
    assert topg.supports(X, W) == "device cpu (a CUDA kernel)"
    if not _native.has_kernel("_cuda_linear", "CUDA"):
        assert "no native kernel topg::_cuda_linear" in topg.unavailable()


def test_a_missing_triton_module_makes_the_candidate_unavailable():
    c = cands.triton_candidate("paged_attention", module="torch_topg.triton_kernels.no_such_kernel")
    assert "torch_topg.triton_kernels.no_such_kernel cannot be imported" in c.unavailable()
    c = cands.triton_candidate("paged_attention", module="torch_topg.triton_kernels")
    assert c.unavailable() == "torch_topg.triton_kernels has no paged_attention / supports"


# --- tune: the measuring loop with a synthetic clock -----------------------------------


def test_tune_loop_writes_a_table_the_loader_accepts(tmp_path):
    now = [0.0]

    def timed(name, cost_s, wrong=False):
        def run(*args, **kwargs):
            now[0] += cost_s
            out = reference.linear(*args, **kwargs)
            return out + 1 if wrong else out

        return dispatch.Candidate(name, "linear", run)

    pool = {"linear": [timed("topg", 3e-5), timed("torch_linear", 1e-5),
                       timed("broken", 1e-7, wrong=True), fake("reference")]}  # fmt: skip
    cases = [
        tune.Case("linear", "m1", tune.linear_call(1, 64, 32, torch.float32), torch.float32),
        tune.Case("linear", "m2000", tune.linear_call(2000, 64, 32, torch.float32), torch.float32),
        tune.Case("linear", "m1 again", tune.linear_call(1, 16, 32, torch.float32), torch.float32),
    ]
    lines: list[str] = []
    entries, left = tune.measure(
        cases, pool, device=torch.device("cpu"), clock=HostClock(lambda: now[0]),
        budget=Budget(warmup=1, min_rounds=3, max_rounds=3, budget_s=0.0), log=lines.append,
    )  # fmt: skip
    assert [e["class"] for e in entries] == ["fp32 m1", "fp32 m2048"]
    assert left == ["linear m1 again: class [fp32 m1] already measured"]
    for e in entries:
        assert e["pick"] == "torch_linear"
        assert e["times_us"] == pytest.approx({"topg": 30.0, "torch_linear": 10.0})
        assert e["excluded"]["broken"].startswith("disagrees with the reference: max error 1")
    data = tables.new_table(*GPU, commit="abc", torch=torch.__version__, triton=None, cuda=None)
    data["entries"] = entries
    path = tables.write_table(data, tmp_path / "t.json")
    t = tables.load_table(path, *GPU, OPS)
    assert t.entry("linear", "fp32 m2048").pick == "torch_linear"
    d = dispatch.Dispatcher({"linear": pool["linear"]}, device_info=lambda d: GPU,
                            paths=lambda n: [("test", path)])  # fmt: skip
    dec = d.decision("linear", (X, W), {})
    assert dec.candidate.name == "torch_linear"
    dec = d.decision("linear", (torch.randn(1, 32), W), {})
    assert dec.candidate.name == "torch_linear" and ("broken", dec.skipped[0][1]) == dec.skipped[0]
    assert "excluded by tune" in dec.skipped[0][1]


def test_tune_stops_at_its_time_budget():
    ticks = iter(range(100))
    cases = [tune.Case("linear", "m1", tune.linear_call(1, 8, 8, torch.float32), torch.float32)]
    entries, left = tune.measure(cases, {"linear": [fake("reference")]}, device=torch.device("cpu"),
                                 clock=HostClock(), time_budget_s=0.5,
                                 timer=lambda: float(next(ticks)))  # fmt: skip
    assert entries == [] and left == ["linear m1: over the 0 s budget"]


def test_tune_command_line(capsys):
    from torch_topg.__main__ import main

    assert main(["tune", "--dry-run", "--quick", "--ops", "linear,fused_moe"]) == 0
    out = capsys.readouterr().out
    assert "[bf16 m2048]" in out and "[bf16 e128 k8 i1024 t256]" in out and "attention" not in out
    assert all(len(c.label) < 40 for c in tune.CASES)
    if not torch.cuda.is_available():
        assert main(["tune", "--quick"]) == 2
        assert "torch.cuda.is_available() is False" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--ops", "rms_norm", "--dry-run"])
