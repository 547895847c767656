"""torch_topg.offload on the CPU: bitwise equality with the all-resident model for every
depth and source, bounded residency, resident layers, tied weights, MoE experts,
learned order (repeats, skips, reversed), torch.compile, and argument errors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from offload_utils import Scripted, bounded, eventually, logits, quiet_offload, tiny

import torch_topg
from torch_topg.offload.source import read_safetensors, write_safetensors


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize("source", ["cpu", "disk"])
def test_bitwise_equal_llama(depth: int, source: str) -> None:
    ref = tiny()
    expected = logits(ref)
    model = tiny()
    h = quiet_offload(model, source=source, prefetch_depth=depth)
    for _ in range(3):  # first forward learns the order; later ones reuse slots
        assert torch.equal(bounded(lambda: logits(model)), expected)
    s = h.stats()
    assert s["peak_resident_bytes"] <= s["bound_bytes"] == (depth + 1) * s["largest_layer_bytes"]
    assert s["bytes_moved"] > 0 and s["order"] == list(range(6)) and s["order_learned"]
    if depth > 0:
        # one layer computing, `depth` read ahead: later forwards never miss
        assert s["sync_fetches"] <= 1
    h.close()
    assert torch.equal(logits(model), expected)  # closed: an ordinary model again


@pytest.mark.parametrize("depth", [0, 2])
def test_bitwise_equal_moe_experts(depth: int) -> None:
    """transformers 5 Mixtral experts are 3-D parameters of the layer: streamed too."""
    ref = tiny("mixtral-tiny", layers=4)
    expected = logits(ref)
    model = tiny("mixtral-tiny", layers=4)
    h = quiet_offload(model, source="disk", prefetch_depth=depth)
    experts = model.model.layers[3].mlp.experts.gate_up_proj
    assert experts.untyped_storage().nbytes() < 64  # a placeholder between uses
    assert torch.equal(bounded(lambda: logits(model)), expected)
    assert torch.equal(bounded(lambda: logits(model)), expected)
    assert h.stats()["peak_resident_bytes"] <= h.stats()["bound_bytes"]
    h.close()


def test_source_path_checkpoint(tmp_path) -> None:
    """An existing safetensors checkpoint (a folder written by save_pretrained)."""
    ref = tiny()
    expected = logits(ref)
    ref.save_pretrained(tmp_path)
    model = tiny()
    with quiet_offload(model, source=tmp_path, prefetch_depth=2) as h:
        assert torch.equal(bounded(lambda: logits(model)), expected)
        assert h.stats()["bytes_moved"] > 0
    assert h.closed


def test_source_path_single_file_and_mismatch(tmp_path) -> None:
    model = tiny(layers=3)
    expected = logits(model)
    sd = {k: v for k, v in model.state_dict().items() if ".layers." in k}
    write_safetensors(tmp_path / "w.safetensors", sd)
    back = read_safetensors(tmp_path / "w.safetensors")
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    with quiet_offload(model, source=tmp_path / "w.safetensors") as h:
        assert torch.equal(logits(model), expected)
        # layer 0 is read again at the end: the next forward's first layer, prefetched
        # in the background (counted once its copy completes, so wait for it, bounded)
        assert eventually(lambda: h.stats()["fetches"] == {0: 2, 1: 1, 2: 1}), h.stats()
    sd["model.layers.1.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"][:3]
    write_safetensors(tmp_path / "bad.safetensors", sd)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        quiet_offload(tiny(layers=3), source=tmp_path / "bad.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    write_safetensors(tmp_path / "missing.safetensors", sd)
    with pytest.raises(ValueError, match="has no tensor named 'model.layers.1.mlp.up_proj"):
        quiet_offload(tiny(layers=3), source=tmp_path / "missing.safetensors")


def test_disk_cache_dir_keeps_file(tmp_path) -> None:
    model = tiny(layers=2)
    expected = logits(model)
    with quiet_offload(model, source="disk", cache_dir=tmp_path) as h:
        assert torch.equal(logits(model), expected)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1 and h.closed


def test_resident_layers() -> None:
    ref = tiny()
    expected = logits(ref)
    model = tiny()
    h = quiet_offload(model, source="disk", prefetch_depth=1, resident_layers=2)
    assert h.layers == [2, 3, 4, 5]
    assert torch.equal(
        model.model.layers[0].mlp.up_proj.weight, ref.model.layers[0].mlp.up_proj.weight
    )
    assert torch.equal(logits(model), expected)
    s = h.stats()
    resident = sum(p.numel() * 4 for p in model.model.layers[:2].parameters())
    assert s["bound_bytes"] == 2 * s["largest_layer_bytes"] + resident
    assert resident < s["peak_resident_bytes"] <= s["bound_bytes"]
    assert set(s["fetches"]) == {2, 3, 4, 5}
    h.close()


@pytest.mark.parametrize("depth", [1, 2])
def test_learned_order_repeats_skips_reversed(depth: int) -> None:
    seq = [5, 4, 1, 1, 3, 0, 5]  # reversed-ish, layer 1 twice, layer 2 never, 5 twice
    ref = Scripted(6, seq)
    x = torch.randn(3, 32)
    with torch.no_grad():
        expected = ref(x)
    model = copy.deepcopy(ref)
    h = quiet_offload(model, layers="blocks", source="disk", prefetch_depth=depth)
    with torch.no_grad():
        assert torch.equal(bounded(lambda: model(x)), expected)  # guessed module order
        first = h.stats()
        assert first["sync_fetches"] > 0 and first["order"] == seq
        h.reset_stats()
        for _ in range(2):
            assert torch.equal(bounded(lambda: model(x)), expected)
    s = h.stats()
    assert s["sync_fetches"] == 0  # the learned order predicts every use
    assert s["fetches"][2] == 0  # the skipped layer is never read again
    assert s["peak_resident_bytes"] <= s["bound_bytes"]
    h.close()


def test_tied_weights_stay_resident() -> None:
    """A tensor shared with a resident module, or by two layers, is never offloaded."""
    ref = Scripted(4, [0, 1, 2, 3])
    ref.blocks[3].lin.weight = ref.head.weight  # shared with a resident module
    ref.blocks[2].lin.bias = ref.blocks[1].lin.bias  # shared by two layers
    x = torch.randn(3, 32)
    with torch.no_grad():
        expected = ref(x)
    model = copy.deepcopy(ref)
    assert model.blocks[3].lin.weight is model.head.weight
    h = quiet_offload(model, layers="blocks", source="disk", prefetch_depth=1)
    assert torch.equal(model.head.weight, ref.head.weight)  # not a placeholder
    assert torch.equal(model.blocks[1].lin.bias, ref.blocks[1].lin.bias)
    assert torch.isnan(model.blocks[1].lin.weight).all()  # offloaded: placeholder
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), expected)
    h.close()


def test_tied_embeddings_llama() -> None:
    ref = tiny(tie_word_embeddings=True)
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    expected = logits(ref)
    model = tiny(tie_word_embeddings=True)
    with quiet_offload(model, source="disk", prefetch_depth=2):
        assert torch.equal(logits(model), expected)


def test_custom_loop_prefetch_wait_release() -> None:
    model = Scripted(3, [0, 1, 2])
    x = torch.randn(2, 32)
    with torch.no_grad():
        expected = model(x)
    h = quiet_offload(model, layers="blocks", source="disk", prefetch_depth=1)
    with torch.no_grad():
        y = x
        h.prefetch(0)
        for i in range(3):
            h.wait(i)  # binds; the layer's own forward wrapper sees it bound
            if i + 1 < 3:
                h.prefetch(i + 1)
            y = _call_bound(model, i, y)
            h.release(i)
        assert torch.equal(model.head(y), expected)
        with pytest.raises(ValueError, match="layer 7 is not offloaded"):
            h.wait(7)
    h.close()
    with pytest.raises(RuntimeError, match="closed handle"):
        h.wait(0)


def _call_bound(model: Scripted, i: int, y: torch.Tensor) -> torch.Tensor:
    block = model.blocks[i]
    return y + torch.tanh(block.lin(y))  # the block's math with its bound weights


def test_torch_compile_topg_backend() -> None:
    ref = tiny(layers=3)
    expected = logits(ref)
    model = tiny(layers=3)
    h = quiet_offload(model, source="disk", prefetch_depth=1)
    compiled = torch.compile(model, backend="topg")
    for _ in range(2):
        out = bounded(lambda: logits(compiled), timeout=120)  # no_grad inside the thread
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    s = h.stats()
    assert s["fetches"] and all(v >= 1 for v in s["fetches"].values())
    h.close()


def test_warns_when_nothing_is_saved() -> None:
    model = tiny(layers=2)
    with pytest.warns(UserWarning, match="source='cpu' on device='cpu'"):
        h = torch_topg.offload(model, device="cpu", source="cpu")
    h.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_topg.offload(model, device="cpu", source="disk").close()


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(prefetch_depth=-1), ValueError, "prefetch_depth"),
        (dict(prefetch_depth=1.5), ValueError, "prefetch_depth"),
        (dict(prefetch_depth=True), ValueError, "prefetch_depth"),
        (dict(resident_layers=7), ValueError, r"resident_layers must be an int in \[0, 6\]"),
        (dict(layers="model.nope"), ValueError, "layers='model.nope'"),
        (dict(layers="model.norm"), ValueError, "layers='model.norm'"),
        (dict(layers=3), TypeError, "layers must be"),
        (dict(source=3), TypeError, "source must be"),
        (dict(source="/nonexistent/ckpt"), ValueError, "source must be"),
        (dict(read_bandwidth=0), ValueError, "read_bandwidth"),
        (dict(device="meta"), ValueError, "device must be"),
        (dict(device="not a device"), ValueError, "device"),
    ],
)
def test_bad_arguments(kwargs, exc, match) -> None:  # type: ignore[no-untyped-def]
    model = tiny()
    with pytest.raises(exc, match=match):
        quiet_offload(model, **kwargs)
    assert "_topg_offload" not in model.__dict__


def test_bad_model_and_double_offload() -> None:
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        torch_topg.offload("model")  # type: ignore[arg-type]
    model = tiny(layers=2)
    h = quiet_offload(model)
    with pytest.raises(RuntimeError, match="already offloaded"):
        quiet_offload(model)
    h.close()
    quiet_offload(model).close()  # closed: may be offloaded again


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_device_without_cuda() -> None:
    with pytest.raises(RuntimeError, match="no CUDA device"):
        torch_topg.offload(tiny(layers=2), device="cuda")


def test_offload_again_after_close() -> None:
    """After close() the layers are views of one memory map (one storage); offloading
    that model again must still move every layer (sharing is by byte range, not by
    storage)."""
    ref = tiny(layers=3)
    expected = logits(ref)
    model = tiny(layers=3)
    quiet_offload(model, source="disk").close()
    with quiet_offload(model, source="disk", prefetch_depth=1) as h:
        assert torch.equal(logits(model), expected)
        assert h.stats()["bytes_moved"] >= h.info["offloaded_bytes"] > 0


def test_changed_order_fetched_synchronously_then_relearned() -> None:
    """A forward that departs from the learned order is still exact (the missing layers
    are read at their use, never stale), and the next forward predicts the new order."""
    ref = Scripted(6, list(range(6)))
    x = torch.randn(3, 32)
    model = copy.deepcopy(ref)
    h = quiet_offload(model, layers="blocks", source="disk", prefetch_depth=2)
    new = [5, 3, 1, 0, 2, 4]
    with torch.no_grad():
        for seq, missed in ((list(range(6)), None), (new, True), (new, False)):
            ref.sequence = model.sequence = seq
            h.reset_stats()
            assert torch.equal(bounded(lambda: model(x)), ref(x))
            if missed is not None:
                assert (h.stats()["sync_fetches"] > 0) is missed
        assert h.stats()["order"] == new
    h.close()
