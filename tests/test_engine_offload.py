"""``Engine.from_pretrained(folder, prefetch_depth=k)``: the decoder layers stream from the
checkpoint (``torch_topg.offload``), eager and compiled, with the greedy outputs of the
all-resident engine; shutdown closes the offload handle."""

from __future__ import annotations

import pytest
from engine_utils import prompts, whole_pool

from torch_topg.engine import Engine
from torch_topg.models import build_model

pytest.importorskip("transformers")

GREEDY = dict(temperature=0, ignore_eos=True, max_new_tokens=12)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama checkpoint with 5 layers (depth 2 keeps 3 of them in the pool)."""
    path = tmp_path_factory.mktemp("llama5")
    build_model("llama-tiny", num_hidden_layers=5).save_pretrained(path)
    return path


def _generate(eng):
    ps = prompts(21, [5, 27, 2, 13])
    with whole_pool(eng):
        handles = [eng.submit(p, **GREEDY) for p in ps]
        return [h.result(timeout=120).token_ids for h in handles]


@pytest.mark.parametrize("compile", [False, True])
def test_prefetch_depth_2_equals_resident(folder, compile):
    opts = dict(block_size=4, max_num_batched_tokens=16, compile=compile)
    with Engine.from_pretrained(folder, **opts) as eng:
        assert "_topg_offload" not in eng.model.__dict__
        want = _generate(eng)
    eng = Engine.from_pretrained(folder, prefetch_depth=2, **opts)
    handle = eng.model._topg_offload
    try:
        got = _generate(eng)
        st = handle.stats()
    finally:
        eng.shutdown()
    assert got == want
    assert handle.layers == [0, 1, 2, 3, 4]
    assert st["pool_bytes"] == 3 * st["largest_layer_bytes"]  # depth + 1 slots
    assert st["bytes_moved"] > 5 * st["largest_layer_bytes"]  # layers re-read every step
    assert st["order_learned"]
    assert handle.closed and "_topg_offload" not in eng.model.__dict__
    if compile:
        assert eng.stats()["compile"]["while_serving"] == 0


@pytest.mark.parametrize("quantization", ["int4", {"method": "int8", "int8_activations": True}])
def test_prefetch_depth_with_quantised_layers(folder, quantization):
    """Packed layers (``QuantizedLinear`` buffers) stream like float ones: from the
    offloader's disk copy of the quantised model, with the all-resident outputs."""
    opts = dict(block_size=4, max_num_batched_tokens=16, quantization=quantization)
    with Engine.from_pretrained(folder, **opts) as eng:
        want = _generate(eng)
    eng = Engine.from_pretrained(folder, prefetch_depth=1, **opts)
    handle = eng.model._topg_offload
    try:
        assert type(eng.model.model.layers[0].mlp.up_proj).__name__ == "QuantizedLinear"
        got = _generate(eng)
        st = handle.stats()
    finally:
        eng.shutdown()
    assert got == want
    assert st["pool_bytes"] == 2 * st["largest_layer_bytes"]
    assert st["bytes_moved"] > 5 * st["largest_layer_bytes"]
