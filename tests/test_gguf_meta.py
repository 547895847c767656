"""The GGUF metadata cache (torch_topg/engine/gguf_meta.py): its skip-parse finds the
same byte ranges as gguf-py's reader on written files of random entries and tensors; the
digest follows the metadata and tensor names, not tensor data or the file's name; a
cached config and tokenizer equal transformers' own conversion of the file."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from torch_topg.engine import gguf_meta
from torch_topg.models import smollm2_available
from torch_topg.models.hf import gguf_path

pytestmark = pytest.mark.native_independent  # the reference lane deselects it (docs/build.md)

_SCALARS = {
    "u8": (st.integers(0, 255), gguf.GGUFValueType.UINT8),
    "i32": (st.integers(-(2**31), 2**31 - 1), gguf.GGUFValueType.INT32),
    "u64": (st.integers(0, 2**64 - 1), gguf.GGUFValueType.UINT64),
    "f32": (st.floats(-1e6, 1e6, width=32), gguf.GGUFValueType.FLOAT32),
    "bool": (st.booleans(), gguf.GGUFValueType.BOOL),
    "str": (st.text(max_size=12), gguf.GGUFValueType.STRING),
}


@st.composite
def entries(draw):
    """Metadata entries: (key, value, type, array element type or None)."""
    out = []
    for i in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(sorted(_SCALARS)))
        values, vtype = _SCALARS[kind]
        if draw(st.booleans()):
            items = draw(st.lists(values, min_size=1, max_size=40))  # gguf-py writes no empty array
            out.append((f"test.key{i}", items, gguf.GGUFValueType.ARRAY, vtype))
        else:
            out.append((f"test.key{i}", draw(values), vtype, None))
    return out


def _write(path, kv, tensors) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value, kind, sub in kv:
        w.add_key_value(key, value, kind, sub_type=sub)
    for name, array in tensors:
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _reader_spans(path) -> list[tuple[int, int]]:
    """The same ranges as gguf-py's reader finds them: the header and entries end where
    the first tensor's record starts; a record's name and dimensions are its first parts."""
    r = gguf.GGUFReader(str(path))
    kv_end = max(f.offset + sum(p.nbytes for p in f.parts) for f in r.fields.values())
    spans = [(0, kv_end)]
    for t in r.tensors:
        start = t.field.offset
        spans.append((start, start + sum(p.nbytes for p in t.field.parts[:4])))
    return spans


tensor_lists = st.lists(
    st.tuples(st.integers(1, 4), st.integers(1, 3)), max_size=4, unique_by=lambda x: x
)


@given(kv=entries(), shapes=tensor_lists, cut=st.floats(0, 1, exclude_max=True))
def test_skip_parse_matches_gguf_reader(tmp_path_factory, kv, shapes, cut):
    path = tmp_path_factory.mktemp("meta") / "f.gguf"
    tensors = [(f"blk.{i}.w{n}", np.ones((n,) * d, np.float32)) for i, (n, d) in enumerate(shapes)]
    _write(path, kv, tensors)
    data = path.read_bytes()
    spans = gguf_meta._metadata_spans(memoryview(data))
    assert spans == _reader_spans(path)
    end = spans[-1][1] + (12 if len(spans) > 1 else 0)  # last record's type and offset
    with pytest.raises(gguf_meta._Truncated):  # any cut inside the metadata says so
        gguf_meta._metadata_spans(memoryview(data[: int(cut * end)]))


def test_digest_follows_metadata_not_data_or_name(tmp_path):
    kv = [("test.a", 7, gguf.GGUFValueType.UINT32, None)]
    w = [("w", np.zeros((4, 3), np.float32))]
    _write(tmp_path / "a.gguf", kv, w)
    digest = gguf_meta.metadata_digest(tmp_path / "a.gguf")
    assert digest is not None
    shutil.copy(tmp_path / "a.gguf", tmp_path / "copy.gguf")
    _write(tmp_path / "data.gguf", kv, [("w", np.ones((4, 3), np.float32))])
    _write(tmp_path / "value.gguf", [("test.a", 8, gguf.GGUFValueType.UINT32, None)], w)
    _write(tmp_path / "name.gguf", kv, [("v", np.zeros((4, 3), np.float32))])
    _write(tmp_path / "shape.gguf", kv, [("w", np.zeros((3, 4), np.float32))])
    assert gguf_meta.metadata_digest(tmp_path / "copy.gguf") == digest
    assert gguf_meta.metadata_digest(tmp_path / "data.gguf") == digest
    for other in ("value", "name", "shape"):
        assert gguf_meta.metadata_digest(tmp_path / f"{other}.gguf") != digest, other
    (tmp_path / "junk.gguf").write_bytes(b"GGML" + bytes(100))
    assert gguf_meta.metadata_digest(tmp_path / "junk.gguf") is None
    (tmp_path / "short.gguf").write_bytes((tmp_path / "a.gguf").read_bytes()[:30])
    assert gguf_meta.metadata_digest(tmp_path / "short.gguf") is None


@pytest.mark.skipif(smollm2_available() is not None, reason=str(smollm2_available()))
def test_cached_config_and_tokenizer_equal_transformers(tmp_path, monkeypatch):
    """The shipped SmolLM2 file: converted (and saved), then loaded from the cache; both
    equal transformers' conversion (config, vocabulary, special tokens, chat template,
    encodings). With TOPG_GGUF_META_CACHE=0 nothing is written."""
    path = gguf_path()
    monkeypatch.setenv("TOPG_CACHE_DIR", str(tmp_path / "off"))
    monkeypatch.setenv("TOPG_GGUF_META_CACHE", "0")
    config, tok = gguf_meta.config_and_tokenizer(path)  # transformers' conversion
    assert not (tmp_path / "off").exists()
    monkeypatch.setenv("TOPG_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TOPG_GGUF_META_CACHE", "1")
    miss = gguf_meta.config_and_tokenizer(path)
    saved = tmp_path / "gguf-meta" / gguf_meta.metadata_digest(path)
    assert (saved / "complete").exists() and (saved / "tokenizer.json").exists()
    hit = gguf_meta.config_and_tokenizer(path)
    text = "Hello world! 日本語 <|im_start|>user\n  two  spaces\tand\ttabs 12345 ünïcödé"
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    for c, t in (miss, hit):
        assert c.to_dict() == config.to_dict()
        assert type(t) is type(tok) and t.get_vocab() == tok.get_vocab()
        assert t.special_tokens_map == tok.special_tokens_map
        assert (t.bos_token_id, t.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
        assert t.chat_template == tok.chat_template
        assert t(text).input_ids == tok(text).input_ids
        assert t.apply_chat_template(chat, tokenize=False) == tok.apply_chat_template(
            chat, tokenize=False
        )
