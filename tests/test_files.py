"""Files and paths: truncated and corrupt safetensors (at open and after it), the weight
index confined to its checkpoint folder, the writer's temporary file, the SmolLM2 cache
manifest, and one safetensors reader behind offload and tensor parallel."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from offload_utils import quiet_offload, tiny

from torch_topg.models import hf
from torch_topg.offload import source as offload_source
from torch_topg.parallel.loading import CheckpointSource, Slice
from torch_topg.utils import safetensors_file as stf
from torch_topg.utils.safetensors_file import (
    SafetensorsError,
    SafetensorsSource,
    read_safetensors,
    write_safetensors,
)

TESTS = Path(__file__).parent


def _file(path: Path, header: dict, data: bytes = b"") -> Path:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def _w(dtype: str = "F32", shape: list | None = None, offsets: list | None = None) -> dict:
    return {"dtype": dtype, "shape": [4] if shape is None else shape,
            "data_offsets": [0, 16] if offsets is None else offsets}  # fmt: skip


# --- 1. truncated or corrupt files: an error naming the file and the tensor --------------
def test_header_only_truncation_is_an_error(tmp_path) -> None:
    """Cut right after the header: the old reader returned uninitialised tensors."""
    f = _file(tmp_path / "cut.safetensors", {"w": _w()})
    with pytest.raises(SafetensorsError, match=r"cut\.safetensors: tensor 'w' lies outside"):
        read_safetensors(f)


def test_truncated_written_file_names_the_last_tensor(tmp_path) -> None:
    f = tmp_path / "m.safetensors"
    write_safetensors(f, {"a": torch.ones(64), "b": torch.ones(3, 5)})
    size = f.stat().st_size
    for cut in (1, 20, 60):  # into b, then into a's pages too (b is first: same dtype)
        os.truncate(f, size - cut)
        with pytest.raises(SafetensorsError, match=r"m\.safetensors: tensor '.' lies outside"):
            read_safetensors(f)
    os.truncate(f, 3)
    with pytest.raises(SafetensorsError, match="not a safetensors file"):
        read_safetensors(f)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (_w(shape=[3]), r"tensor 'w': data_offsets \[0, 16\] hold 16 bytes, its shape \[3\]"),
        (_w(dtype="F4"), "tensor 'w' has unsupported dtype 'F4'"),
        (_w(shape=[-4]), "tensor 'w': shape"),
        (_w(offsets=[16, 0]), "tensor 'w': data_offsets"),
        (_w(offsets=[0]), "tensor 'w': data_offsets"),
        ({"dtype": "F32", "shape": [4]}, "tensor 'w': the entry needs"),
        ([1, 2], "tensor 'w': the entry needs"),
    ],
)
def test_corrupt_header_entries(tmp_path, entry, match) -> None:
    f = _file(tmp_path / "bad.safetensors", {"w": entry}, bytes(16))
    with pytest.raises(SafetensorsError, match=r"bad\.safetensors: " + match):
        read_safetensors(f)


def test_header_not_an_object(tmp_path) -> None:
    (tmp_path / "list.safetensors").write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(SafetensorsError, match="not a JSON object"):
        read_safetensors(tmp_path / "list.safetensors")


@pytest.mark.parametrize("loader", ["offload", "tensor_parallel"])
def test_one_reader_behind_offload_and_tensor_parallel(tmp_path, loader) -> None:
    """6. both loaders go through the shared reader: the same validation, the same error."""
    model = tiny(layers=2)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    f = tmp_path / "model.safetensors"
    write_safetensors(f, sd)
    os.truncate(f, f.stat().st_size - 4)
    with pytest.raises(SafetensorsError, match=r"model\.safetensors: tensor '.+' lies outside"):
        if loader == "offload":
            quiet_offload(tiny(layers=2), source=f)
        else:
            CheckpointSource(tmp_path)
    assert offload_source.SafetensorsSource is SafetensorsSource


# --- 2. a file truncated after it was opened ----------------------------------------------
def test_check_after_truncation(tmp_path) -> None:
    f = tmp_path / "m.safetensors"
    write_safetensors(f, {"a": torch.ones(1000), "b": torch.ones(10, dtype=torch.int8)})
    src = SafetensorsSource([f])
    src.check(["a", "b"])
    _, b_off, _ = src.extent("b")
    os.truncate(f, b_off)  # a intact (written first: 4-byte dtype), b gone
    src.check(["a"])
    with pytest.raises(SafetensorsError, match=r"m\.safetensors is now .* tensor 'b' ends"):
        src.check(["a", "b"])
    src.close()


_TRUNCATE_DURING_RUN = """
import os, pathlib, time
from offload_utils import logits, quiet_offload, tiny
model = tiny(layers=4)
h = quiet_offload(model, source="disk", cache_dir={cache!r}, io="mmap", prefetch_depth=1)
logits(model)
eng = h._engine
deadline = time.monotonic() + 30  # the reader idle: no copy is reading the map now
while eng.reader.jobs or any(s.copying for s in eng.pool.slots):
    assert time.monotonic() < deadline
    time.sleep(0.01)
(f,) = pathlib.Path({cache!r}).glob("*.safetensors")
os.truncate(f, 64)
try:
    logits(model)
except RuntimeError as e:
    print("ERROR", e)
else:
    print("NO ERROR")
"""


def test_truncated_after_open_is_an_error_not_sigbus(tmp_path) -> None:
    """Copying a layer out of a map whose file shrank ends the process with SIGBUS; the
    reader checks the size first, so the layer's use raises instead (in a subprocess:
    the test process must survive the failure this guards against)."""
    script = textwrap.dedent(_TRUNCATE_DURING_RUN).format(cache=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"exit {r.returncode} (-7 is SIGBUS):\n{out}"
    assert "ERROR offload: reading the weights of layer" in out, out
    assert "(model.layers." in out and "truncated after it was opened" in out, out
    assert ".safetensors is now 64 bytes but tensor 'model.layers." in out, out


# --- 3. the weight index cannot name files outside the checkpoint --------------------------
def _sharded(folder: Path, names: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    index = {"metadata": {}, "weight_map": names}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("name", ["../outside.safetensors", "ABS", "sub/../../outside.safetensors"])
def test_index_cannot_escape_the_folder(tmp_path, name) -> None:
    write_safetensors(tmp_path / "outside.safetensors", {"w": torch.ones(2)})
    if name == "ABS":
        name = str(tmp_path / "outside.safetensors")
    _sharded(tmp_path / "ckpt", {"w": name})
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        CheckpointSource(tmp_path / "ckpt")


def test_index_cannot_escape_through_a_linked_folder(tmp_path) -> None:
    (tmp_path / "elsewhere").mkdir()
    write_safetensors(tmp_path / "elsewhere" / "w.safetensors", {"w": torch.ones(2)})
    _sharded(tmp_path / "ckpt", {"w": "sub/w.safetensors"})
    (tmp_path / "ckpt" / "sub").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        CheckpointSource(tmp_path / "ckpt")


def test_index_files_may_be_links_as_in_the_hub_cache(tmp_path) -> None:
    """A Hugging Face snapshot's files are links into ../../blobs: accepted."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    write_safetensors(blobs / "abc", {"w": torch.arange(6.0).view(2, 3)})
    write_safetensors(blobs / "def", {"v": torch.ones(3)})
    snap = tmp_path / "snapshots" / "rev"
    _sharded(snap, {"w": "a.safetensors", "v": "b.safetensors"})
    (snap / "a.safetensors").symlink_to(blobs / "abc")
    (snap / "b.safetensors").symlink_to(blobs / "def")
    src = CheckpointSource(snap)
    full = torch.arange(6.0).view(2, 3)
    assert torch.equal(src.read(Slice("w", 1, ((0, 1), (2, 3)))), full[:, [0, 2]])
    assert torch.equal(src.read(Slice("v")), torch.ones(3))
    src.close()


def test_index_must_match_the_files(tmp_path) -> None:
    ckpt = tmp_path / "ckpt"
    _sharded(ckpt, {"w": "a.safetensors", "v": "a.safetensors"})
    write_safetensors(ckpt / "a.safetensors", {"w": torch.ones(2)})
    with pytest.raises(ValueError, match="puts 'v' in a.safetensors, which does not hold it"):
        CheckpointSource(ckpt)


def test_tensor_parallel_loads_a_sharded_checkpoint(tmp_path) -> None:
    """World of one: the merged reader feeds tensor_parallel (slices copied, not views)."""
    from safetensors.torch import save_file

    from torch_topg.parallel import empty_model, tensor_parallel

    ref = tiny("qwen2-tiny", layers=2)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    names = sorted(sd)
    half = len(names) // 2
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({k: sd[k] for k in names[:half]}, str(ckpt / "model-1.safetensors"))
    save_file({k: sd[k] for k in names[half:]}, str(ckpt / "model-2.safetensors"))
    wm = {
        k: "model-1.safetensors" if i < half else "model-2.safetensors" for i, k in enumerate(names)
    }
    _sharded(ckpt, wm)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model = tensor_parallel(empty_model(ref.config), checkpoint=ckpt, tp_size=1)
        for k, v in model.state_dict().items():
            assert torch.equal(v, sd[k]), k
        ids = torch.randint(0, 256, (1, 5))
        with torch.inference_mode():
            torch.testing.assert_close(model(ids).logits, ref(ids).logits)
    finally:
        dist.destroy_process_group()


# --- 4. the writer's temporary file --------------------------------------------------------
def test_writer_never_writes_through_a_link(tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    target = tmp_path / "w.safetensors"
    # the name the old writer used, planted as a link to the victim
    (tmp_path / f"w.safetensors.tmp{os.getpid()}").symlink_to(victim)
    # and a link at the target itself: replaced, not followed
    target.symlink_to(victim)
    write_safetensors(target, {"x": torch.arange(4.0)})
    assert victim.read_bytes() == b"precious"
    assert not target.is_symlink() and torch.equal(read_safetensors(target)["x"], torch.arange(4.0))
    assert (target.stat().st_mode & 0o777) == 0o666 & ~stf.current_umask()


def test_writer_fsyncs_then_renames_and_cleans_up(tmp_path, monkeypatch) -> None:
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(
        os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b))[1]
    )
    write_safetensors(tmp_path / "w.safetensors", {"x": torch.ones(2)})
    assert calls[:2] == ["fsync", "replace"]
    monkeypatch.undo()
    with pytest.raises(NotImplementedError):  # fails after the header is written
        write_safetensors(tmp_path / "z.safetensors", {"m": torch.empty(4, device="meta")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]  # no leftovers


# --- 5. the SmolLM2 cache is checked against its manifest ---------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch):
    """smollm2_folder() over a stand-in conversion (two small files) in tmp_path."""
    monkeypatch.setenv("TOPG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hf, "smollm2_available", lambda: None)
    builds: list[Path] = []

    def convert(folder: Path, progress: bool) -> None:
        builds.append(folder)
        (folder / "config.json").write_text('{"model_type": "llama"}')
        write_safetensors(folder / "model.safetensors", {"w": torch.arange(100.0)})

    monkeypatch.setattr(hf, "_write_conversion", convert)
    return builds


def test_cache_built_once_with_a_manifest(cache) -> None:
    dest = hf.smollm2_folder()
    assert len(cache) == 1 and hf.smollm2_folder() == dest and len(cache) == 1
    manifest = json.loads((dest / hf.MANIFEST).read_text())["files"]
    assert set(manifest) == {"config.json", "model.safetensors"}
    assert manifest["model.safetensors"]["size"] == (dest / "model.safetensors").stat().st_size
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".")]  # no temp left


@pytest.mark.parametrize("damage", ["truncate", "same_size_edit", "manifest", "extra", "missing"])
def test_damaged_cache_is_rebuilt(cache, caplog, damage) -> None:
    dest = hf.smollm2_folder()
    f = dest / "model.safetensors"
    if damage == "truncate":
        os.truncate(f, f.stat().st_size - 8)
    elif damage == "same_size_edit":  # size kept, mtime moves: caught by the hash
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    elif damage == "manifest":
        (dest / hf.MANIFEST).unlink()
    elif damage == "extra":
        (dest / "model.safetensors.index.json").write_text("{}")
    else:
        (dest / "config.json").unlink()
    with caplog.at_level(logging.WARNING, logger="torch_topg.models.hf"):
        assert hf.smollm2_folder() == dest
    assert len(cache) == 2, "not rebuilt"
    assert "rebuilding it" in caplog.text
    assert torch.equal(read_safetensors(dest / "model.safetensors")["w"], torch.arange(100.0))
    assert hf._cache_problem(dest) is None
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".")]


def test_touched_but_identical_cache_is_hashed_once(cache, monkeypatch) -> None:
    dest = hf.smollm2_folder()
    f = dest / "model.safetensors"
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    hashed: list[Path] = []
    real = hf._sha256
    monkeypatch.setattr(hf, "_sha256", lambda p: (hashed.append(p), real(p))[1])
    hf.smollm2_folder()
    hf.smollm2_folder()
    assert hashed == [f] and len(cache) == 1  # hashed once, the new mtime recorded
