"""``backend="topg"`` with transformers' static cache (``torch_topg/compile/static_plan.py``):
the decode graph runs as one ``topg.DecodePlan`` call over the ``StaticCache`` tensors.

Against transformers' own (uncompiled) ``generate`` on the same static cache: the same
tokens and logits within float32 rounding, for every family the plan lowers, at batch 1
and 3, across generate calls with new caches of other lengths; a left-padded batch runs
its steps on the compiled graph; a family the plan does not lower keeps the graph with
the reason; ``options={"decode_plan": False}`` turns it off."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import cover
from engine_utils import tiny

from torch_topg import _native
from torch_topg.compile import REPORTS, clear_reports
from torch_topg.compile.options import Options

pytest.importorskip("transformers")

NATIVE = _native.load()


def _generate(model, ids: torch.Tensor, n: int, mask: torch.Tensor | None = None):
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id, gc.pad_token_id, gc.do_sample = model.config.vocab_size + 1, 0, False
    with torch.inference_mode():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids) if mask is None else mask,
            generation_config=gc,
            max_new_tokens=n,
            cache_implementation="static",
            return_dict_in_generate=True,
            output_logits=True,
        )


def _compiled(model, **options):
    m = copy.deepcopy(model)
    m.forward = torch.compile(m.forward, backend="topg", options=options or None)
    return m


def _plans() -> list[dict]:
    return [r.decode_plan for r in REPORTS if r.decode_plan]


def _same(ref, out) -> None:
    assert out.sequences.tolist() == ref.sequences.tolist()
    for a, b in zip(ref.logits, out.logits, strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def _run_two_generates(preset: str, batch: int) -> list[dict]:
    """Two generate calls (new StaticCache tensors of another length), each equal to
    transformers' own; the decode graphs' reports."""
    torch._dynamo.reset()
    model = tiny(preset).eval()
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, model.config.vocab_size, (batch, 7), generator=g)
    compiled = _compiled(model)
    clear_reports()
    for n in (9, 5):  # two generate calls: new StaticCache tensors of another length
        _same(_generate(model, ids, n), _generate(compiled, ids, n))
    return _plans()


@pytest.mark.skipif(not NATIVE, reason="native library not loaded: no topg.DecodePlan to run")
# each preset at batch 1 or 3, alternating (conftest.cover; both: the thorough profile)
@pytest.mark.parametrize(
    ("preset", "batch"), cover(["llama-tiny", "qwen2-tiny", "qwen3-tiny"], [1, 3])
)
def test_static_cache_decode_runs_on_the_plan(preset, batch):
    plans = _run_two_generates(preset, batch)
    assert plans == [{"active": True, "reason": "", "steps": 8 + 4, "fallback_steps": 0}]


def test_the_report_says_whether_the_plan_ran():
    """Both lanes: on the plan with the native library, else the graph and the reason."""
    plans = _run_two_generates("llama-tiny", 1)
    assert len(plans) == 1, plans
    if NATIVE:
        assert plans[0]["active"] is True and plans[0]["steps"] == 12, plans
    else:  # TOPG_DISABLE_NATIVE=1
        assert plans[0]["active"] is False and "native library" in plans[0]["reason"]


@pytest.mark.skipif(not NATIVE, reason="native library not loaded")
def test_wrapped_forward_without_position_ids_runs_on_the_plan():
    """A compiled forward behind ``lambda *a, **k``: ``generate`` then passes no
    ``position_ids`` and the graph takes them from the cache position."""
    torch._dynamo.reset()
    model = tiny("llama-tiny").eval()
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    compiled = copy.deepcopy(model)
    fn = torch.compile(compiled.forward, backend="topg")
    compiled.forward = lambda *a, **k: fn(*a, **k)
    clear_reports()
    _same(_generate(model, ids, 6), _generate(compiled, ids, 6))
    assert _plans() == [{"active": True, "reason": "", "steps": 5, "fallback_steps": 0}]


@pytest.mark.skipif(not NATIVE, reason="native library not loaded: no plan to fall back from")
def test_padded_batch_steps_run_on_the_graph():
    torch._dynamo.reset()
    model = tiny("llama-tiny").eval()
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding: the plan would attend to the pad positions
    compiled = _compiled(model)
    clear_reports()
    _same(_generate(model, ids, 5, mask), _generate(compiled, ids, 5, mask))
    _same(_generate(model, ids, 5), _generate(compiled, ids, 5))
    plan = _plans()[0]
    assert plan["active"] and plan["fallback_steps"] == 4 and plan["steps"] == 4, plan


@pytest.mark.parametrize(
    "preset, reason",
    [
        ("mistral-tiny", "sliding-window cache layers"),  # sliding_window < max_cache_len
    ],
)
def test_what_the_plan_does_not_run_keeps_the_graph_with_the_reason(preset, reason):
    torch._dynamo.reset()
    model = tiny(preset).eval()
    ids = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    compiled = _compiled(model)
    clear_reports()
    _same(_generate(model, ids, 4), _generate(compiled, ids, 4))
    plans = _plans()
    assert len(plans) == 1 and plans[0]["active"] is False, plans
    assert reason in plans[0]["reason"] or not NATIVE, plans


def test_moe_model_decodes_on_the_plan():
    """Mixtral (an MoE family: the plan's MoE layers) runs its static-cache decode steps
    on the plan, with transformers' greedy tokens."""
    torch._dynamo.reset()
    model = tiny("mixtral-tiny").eval()
    ids = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    compiled = _compiled(model)
    clear_reports()
    _same(_generate(model, ids, 4), _generate(compiled, ids, 4))
    plans = _plans()
    assert len(plans) == 1 and (plans[0]["active"] or not NATIVE), plans
    assert plans[0]["steps"] == 3 or not NATIVE, plans


def test_decode_plan_option_turns_it_off():
    torch._dynamo.reset()
    model = tiny("llama-tiny").eval()
    ids = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    compiled = _compiled(model, decode_plan=False)
    clear_reports()
    _same(_generate(model, ids, 4), _generate(compiled, ids, 4))
    assert _plans() == []
    with pytest.raises(ValueError, match="option 'decode_plan' expected a bool"):
        Options.parse({"decode_plan": 1})


@pytest.mark.skipif(not NATIVE, reason="native library not loaded")
def test_in_place_weight_update_is_seen_by_the_next_generate():
    torch._dynamo.reset()
    model = tiny("llama-tiny").eval()
    ids = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    compiled = _compiled(model)
    _generate(compiled, ids, 3)
    with torch.no_grad():
        for m in (model, compiled):
            m.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    _same(_generate(model, ids, 6), _generate(compiled, ids, 6))
