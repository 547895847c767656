"""The KV events against vLLM's own (vllm 0.33.0, ``make vllm-test``): a batch as
torch_topg puts it on the wire decodes, with vLLM's msgspec decoder, to the
``KVEventBatch`` of vLLM's structs with the same fields, and vLLM's encoding of that
batch decodes to torch_topg's. ``tests/test_cluster_kv_publisher.py`` holds the same
against bytes made here, where vLLM is not installed."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (the vLLM lane: make vllm-test)")
msgspec = pytest.importorskip("msgspec")

from vllm.distributed import kv_events as vk  # noqa: E402

from torch_topg.engine import kv_events as tk  # noqa: E402

H1, H2 = b"\x01" * 16, b"\x02" * 16


def _pair() -> tuple[tk.KVEventBatch, vk.KVEventBatch]:
    ours = tk.KVEventBatch(1.5, [
        tk.BlockStored([H1, H2], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU"),
        tk.BlockStored([H2], H1, [], 4, None, "DISK"),
        tk.BlockRemoved([H1], "CPU"),
        tk.AllBlocksCleared(),
    ], 0)  # fmt: skip
    theirs = vk.KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
        vk.BlockStored(block_hashes=[H1, H2], parent_block_hash=None,
                       token_ids=[1, 2, 3, 4, 5, 6, 7, 8], block_size=4, lora_id=None,
                       medium="GPU", lora_name=None),
        vk.BlockStored(block_hashes=[H2], parent_block_hash=H1, token_ids=[], block_size=4,
                       lora_id=None, medium="DISK", lora_name=None),
        vk.BlockRemoved(block_hashes=[H1], medium="CPU"),
        vk.AllBlocksCleared(),
    ])  # fmt: skip
    return ours, theirs


def test_our_wire_format_decodes_with_vllms_decoder():
    ours, theirs = _pair()
    wire = msgspec.msgpack.encode(tk.to_wire(ours))
    assert msgspec.msgpack.Decoder(vk.KVEventBatch).decode(wire) == theirs
    # the same msgpack values as vLLM's own encoding (map headers may differ in width)
    assert msgspec.msgpack.decode(wire) == msgspec.msgpack.decode(msgspec.msgpack.encode(theirs))


def test_vllms_encoding_decodes_to_ours():
    ours, theirs = _pair()
    assert tk.from_wire(msgspec.msgpack.decode(msgspec.msgpack.encode(theirs))) == ours
