"""Units of the offload package that need no model: the learned order, the slot layout,
the safetensors reader/writer (zero-copy views, malformed files)."""

from __future__ import annotations

import struct

import pytest
import torch

from torch_topg.offload.order import LayerOrder
from torch_topg.offload.pool import SlotLayout
from torch_topg.offload.source import checkpoint_files, read_safetensors, write_safetensors


def test_order_guess_then_learned_with_repeats_and_skips() -> None:
    o = LayerOrder(4, [0, 1, 2, 3])
    assert o.upcoming(2) == [0, 1]  # module order until a forward completes
    o.begin_forward()
    for layer in [3, 1, 1, 0]:
        o.enter(layer)
    o.end_forward()
    assert o.learned and o.sequence == [3, 1, 1, 0]
    o.begin_forward()
    assert o.upcoming(3) == [3, 1, 0]  # distinct, in order
    assert o.enter(3) and o.enter(1)
    assert o.upcoming(2) == [1, 0]  # the repeat of 1 comes next
    assert not o.enter(0)  # skipped the second 1: resynchronised at 0
    assert o.upcoming(2) == [3, 1]  # wraps into the next forward
    assert not o.enter(2)  # never seen: the cursor stays
    assert o.upcoming(1) == [3]


def test_order_failed_forward_keeps_previous() -> None:
    o = LayerOrder(3, [0, 1, 2])
    o.begin_forward()
    o.enter(2)
    o.begin_forward()  # the previous forward raised: its recording is dropped
    o.end_forward()
    assert o.sequence == [0, 1, 2] and not o.learned


def test_layout_alignment_and_views() -> None:
    a = torch.arange(3, dtype=torch.float32)
    b = torch.arange(10, dtype=torch.bfloat16).view(2, 5)
    lay = SlotLayout.of([("a", a), ("b", b)], align=64)
    assert [e.offset for e in lay.entries] == [0, 64]
    assert lay.payload == 12 + 20 and lay.nbytes == 64 + 20
    buf = torch.zeros(lay.nbytes, dtype=torch.uint8)
    va, vb = lay.views(buf)
    va.copy_(a)
    vb.copy_(b)
    assert torch.equal(lay.views(buf)[1], b) and va.data_ptr() % 64 == buf.data_ptr() % 64


def test_safetensors_round_trip_zero_copy(tmp_path) -> None:
    ts = {
        "x": torch.randn(3, 7),
        "y": torch.randn(5).to(torch.float16),
        "z": torch.arange(6, dtype=torch.int64).view(2, 3).t(),  # non-contiguous
        "e": torch.empty(0, 4),
    }
    write_safetensors(tmp_path / "m.safetensors", ts)
    back = read_safetensors(tmp_path / "m.safetensors")
    for k, v in ts.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)
    base = back["x"].untyped_storage().data_ptr()
    assert back["y"].untyped_storage().data_ptr() == base  # one map, views into it
    assert (back["z"].data_ptr() - base) % 64 == 0  # written first (8-byte dtype): aligned
    # the safetensors library reads our file too
    safetensors = pytest.importorskip("safetensors.torch")
    lib = safetensors.load_file(str(tmp_path / "m.safetensors"))
    assert all(torch.equal(lib[k], v) for k, v in ts.items())


def test_safetensors_malformed(tmp_path) -> None:
    (tmp_path / "short.safetensors").write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_safetensors(tmp_path / "short.safetensors")
    (tmp_path / "long.safetensors").write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(ValueError, match="header length 1000 exceeds"):
        read_safetensors(tmp_path / "long.safetensors")
    (tmp_path / "json.safetensors").write_bytes(struct.pack("<Q", 3) + b"{x}" + b"\0" * 8)
    with pytest.raises(ValueError, match="not JSON"):
        read_safetensors(tmp_path / "json.safetensors")
    hdr = b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
    (tmp_path / "trunc.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 8)
    with pytest.raises(ValueError, match="'w' lies outside the file"):
        read_safetensors(tmp_path / "trunc.safetensors")
    with pytest.raises(ValueError, match="holds no"):
        checkpoint_files(tmp_path / "empty_dir" if (tmp_path / "empty_dir").mkdir() is None else "")
