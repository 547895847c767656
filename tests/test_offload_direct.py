"""offload(io=...): O_DIRECT reads into the pool. Bitwise equality of direct, mmap and
resident for depths 0-3 (llama and Mixtral), the auto probe and its fallbacks, bad
``io``, the slot layout (page-aligned regions, coalescing), close() with a direct read
in flight, and an I/O error (the file truncated after offload()) raised at the use."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import struct
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from offload_utils import bounded, logits, quiet_offload, tiny

from torch_topg.offload import direct
from torch_topg.offload.source import SafetensorsSource, write_safetensors


@pytest.fixture
def disk_dir():  # type: ignore[no-untyped-def]
    """A folder on a file system that accepts O_DIRECT (/tmp may be a tmpfs, which does
    not): tried under the system temp dir, then ~/.cache; skips if neither does."""
    tried = []
    for base in (None, Path.home() / ".cache"):
        if base is not None:
            base.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="topg-odirect-", dir=base))
        probe = folder / "probe"
        probe.write_bytes(bytes(direct.PAGE))
        why = direct.probe(probe)
        probe.unlink()
        if why is None:
            yield folder
            shutil.rmtree(folder, ignore_errors=True)
            return
        shutil.rmtree(folder, ignore_errors=True)
        tried.append(why)
    pytest.skip(f"O_DIRECT unavailable: {'; '.join(tried)}")


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize("preset", ["llama-tiny", "mixtral-tiny"])
def test_direct_mmap_resident_bitwise(disk_dir: Path, preset: str, depth: int) -> None:
    expected = logits(tiny(preset, layers=4))
    for io in ("direct", "mmap"):
        model = tiny(preset, layers=4)
        h = quiet_offload(
            model, source="disk", cache_dir=disk_dir / io, prefetch_depth=depth, io=io
        )
        assert h.stats()["io"] == io
        for _ in range(2):
            assert torch.equal(bounded(lambda m=model: logits(m)), expected)
        s = h.stats()
        assert s["bytes_moved"] > 0 and s["peak_resident_bytes"] <= s["bound_bytes"]
        h.close()
        assert torch.equal(logits(model), expected)  # closed: views of the mapped file


def test_auto_picks_direct_on_disk(disk_dir: Path) -> None:
    model = tiny(layers=2)
    with quiet_offload(model, source="disk", cache_dir=disk_dir) as h:  # the default
        assert h.stats()["io"] == "mmap" and h.stats()["io_reason"] == "io='mmap'"
    with quiet_offload(tiny(layers=2), source="disk", cache_dir=disk_dir, io="auto") as h:
        assert h.stats()["io"] == "direct" and h.stats()["io_reason"] == ""
    with quiet_offload(tiny(layers=2), source="cpu") as h:
        assert h.stats()["io"] == "memory"


def test_auto_falls_back_when_probe_fails(disk_dir: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(direct, "probe", lambda path: f"{path}: refuses O_DIRECT (test)")
    expected = logits(tiny(layers=3))
    model = tiny(layers=3)
    with quiet_offload(model, source="disk", cache_dir=disk_dir, prefetch_depth=1, io="auto") as h:
        assert h.stats()["io"] == "mmap" and "refuses O_DIRECT" in h.stats()["io_reason"]
        assert torch.equal(bounded(lambda: logits(model)), expected)
    with pytest.raises(ValueError, match="io='direct'.*refuses O_DIRECT"):
        quiet_offload(tiny(layers=2), source="disk", cache_dir=disk_dir, io="direct")


def test_probe_real_file_systems(disk_dir: Path) -> None:
    f = disk_dir / "x"
    f.write_bytes(bytes(3 * direct.PAGE + 5))
    assert direct.probe(f) is None
    if Path("/dev/shm").is_dir():  # tmpfs: O_DIRECT refused (a reason, not an exception)
        with tempfile.NamedTemporaryFile(dir="/dev/shm") as t:
            why = direct.probe(t.name)
            assert why is None or "O_DIRECT" in why


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"io": "fast"}, "io must be 'auto', 'mmap' or 'direct'"),
        ({"io": None}, "io must be"),
        ({"io": "direct", "source": "cpu"}, "io='direct' needs a file source"),
    ],
)
def test_bad_io(kwargs, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        quiet_offload(tiny(layers=2), **kwargs)


def test_unaligned_checkpoint_falls_back(tmp_path: Path, disk_dir: Path) -> None:
    """A checkpoint whose tensors are not at 64-byte offsets is read through the map."""
    ref = tiny(layers=2)
    expected = logits(ref)
    ref.save_pretrained(disk_dir)  # HF files align tensors to 8 bytes at best
    model = tiny(layers=2)
    src = SafetensorsSource(sorted(disk_dir.glob("*.safetensors")))
    named = [(k, torch.empty(0)) for k in src.names() if ".layers." in k]
    why = direct.misaligned(named, src.extent)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        h = quiet_offload(model, source=disk_dir, io="direct")
    assert h.stats()["io"] == ("mmap" if why else "direct")
    assert bool(why) == any("falls back to 'mmap'" in str(x.message) for x in w)
    assert torch.equal(bounded(lambda: logits(model)), expected)
    h.close()


def test_writer_pads_to_64_without_holes(disk_dir: Path) -> None:
    ts = {
        "a": torch.arange(3, dtype=torch.float16),
        "b": torch.arange(5, dtype=torch.float32),
        "c": torch.arange(7, dtype=torch.uint8),
        "d": torch.ones(2, 3, dtype=torch.bfloat16),
    }
    write_safetensors(disk_dir / "p.safetensors", ts)
    src = SafetensorsSource([disk_dir / "p.safetensors"])
    assert src.names() == set(ts)
    for k, t in ts.items():
        assert torch.equal(src.tensor(k), t)
        assert src.extent(k)[1] % 64 == 0
    raw = (disk_dir / "p.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    spans = sorted(v["data_offsets"] for v in header.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert 8 + n + spans[-1][1] == len(raw)  # packed: valid for any safetensors reader


def test_layout_regions_and_coalescing() -> None:
    P = direct.PAGE
    t = torch.empty(100, dtype=torch.float32)  # 400 bytes
    ext = {"x": (0, 64, 400), "y": (0, 512, 400), "z": (0, 3 * P + 128, 400), "w": (1, 0, 400)}
    lay = direct.layout([(k, t) for k in ("z", "w", "x", "y")], ext.__getitem__)
    reads = [(r.file, r.file_offset, r.slot_offset, r.nbytes, r.needed) for r in lay.reads]
    # x and y share a page: one region; z is two pages further on: its own; w another file
    assert reads == [(0, 0, 0, P, 912), (0, 3 * P, P, P, 528), (1, 0, 2 * P, P, 400)]
    offs = {e.name: e.offset for e in lay.entries}
    assert [e.name for e in lay.entries] == ["z", "w", "x", "y"]
    assert offs == {"x": 64, "y": 512, "z": P + 128, "w": 2 * P}
    assert lay.nbytes == 3 * P and lay.payload == 1600


def test_close_with_direct_read_in_flight(disk_dir: Path) -> None:
    model = tiny(layers=4)
    # a few kB/s: the first read is still paced when close() comes
    h = quiet_offload(
        model, source="disk", cache_dir=disk_dir, prefetch_depth=2, read_bandwidth=2e3, io="direct"
    )
    assert h.stats()["io"] == "direct"
    deadline = time.time() + 10
    while not any(s.copying for s in h._engine.pool.slots) and time.time() < deadline:
        time.sleep(0.001)
    t0 = time.perf_counter()
    bounded(h.close, timeout=10)
    assert time.perf_counter() - t0 < 5 and h.closed
    assert not h._engine.reader.thread.is_alive() and h._engine.backend.fds == []


def test_io_error_raised_at_use(disk_dir: Path) -> None:
    """The file is truncated after offload(): the size check before the copy fails the
    layer (and, past that check, the short O_DIRECT read would); that layer's use raises
    (naming the layer), never garbage."""
    model = tiny(layers=3)
    h = quiet_offload(model, source="disk", cache_dir=disk_dir, prefetch_depth=0, io="direct")
    (file,) = disk_dir.glob("*.safetensors")
    with open(file, "r+b") as f:
        os.ftruncate(f.fileno(), 4096)
    with pytest.raises(RuntimeError, match=r"layer 0 .*failed: SafetensorsError: .*truncated"):
        bounded(lambda: logits(model))
    for info in h._engine.layers.values():
        info.check = None  # a truncation racing the check: the read itself comes up short
    with pytest.raises(RuntimeError, match=r"layer 0 .*failed: OSError: short read"):
        bounded(lambda: logits(model))
    h._engine.close()  # the map now lies past the file's end: do not touch its views
