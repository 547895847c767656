"""A GGUF file's config and tokenizer, read once and kept on disk by content.

transformers builds a GGUF file's config and its tokenizer each from a full
``gguf.GGUFReader`` pass, which parses every metadata entry element by element: for a
49,152-token vocabulary with its merges that is 6-8 s a pass on two cores, and
``Engine.from_pretrained`` needs both (~14 s before a weight is read). (For the
architectures transformers' reader refuses, ``olmoe`` among them, both are built from the
metadata instead: ``torch_topg/quant/gguf_arch.py``, ``engine/gguf_tokenizer.py``; they
are cached the same way.) Both are read off the file's header, its metadata entries and its tensor names (``tie_word_embeddings``
is whether ``output.weight`` is among them), never off tensor data. So the digest here
is SHA-256 over those bytes and the tensors' dimensions (found by a skip-parse of the
file's start: 0.05 s), plus transformers' version; the converted config and tokenizer are
saved under ``$TOPG_CACHE_DIR/gguf-meta/<digest>`` (default ``~/.cache/torch_topg``) by
``save_pretrained`` and loaded from there on every later load of a file with the same
metadata (0.5 s): the same file again, a copy or a move of it. A file the skip-parse
does not read (not little-endian GGUF v2/v3) is converted the slow way, uncached.
``TOPG_GGUF_META_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# GGUF metadata value types: fixed sizes; 8 is a string (u64 length + bytes), 9 an array
# (u32 element type, u64 count, elements).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_FORMAT = 2  # this cache's layout; part of the digest (2: llama3 RoPE from rope_freqs)


class _Truncated(ValueError):
    pass


def _metadata_spans(buf: memoryview) -> list[tuple[int, int]]:
    """The byte ranges of ``buf`` (the first bytes of a little-endian GGUF, version 2
    or 3) that a file's config and tokenizer are read from: the header with the metadata
    entries, then each tensor's name and dimensions (not its type or data offset, so the
    same model quantised another way has the same spans' bytes). Raises ValueError if
    ``buf`` is not such a file, _Truncated if it ends before the tensor list does."""
    if len(buf) < 24:
        raise _Truncated
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"not a little-endian GGUF v2/v3 (magic {magic!r}, version {version})")
    u32, u64 = struct.Struct("<I"), struct.Struct("<Q")
    end = len(buf)
    pos = 24

    def need(n: int) -> None:
        if pos + n > end:
            raise _Truncated

    def skip_string() -> None:
        nonlocal pos
        need(8)
        (n,) = u64.unpack_from(buf, pos)
        need(8 + n)
        pos += 8 + n

    def skip_value(kind: int) -> None:
        nonlocal pos
        if kind in _FIXED:
            need(_FIXED[kind])
            pos += _FIXED[kind]
        elif kind == _STRING:
            skip_string()
        elif kind == _ARRAY:
            need(12)
            (sub,) = u32.unpack_from(buf, pos)
            (count,) = u64.unpack_from(buf, pos + 4)
            pos += 12
            if sub in _FIXED:
                need(count * _FIXED[sub])
                pos += count * _FIXED[sub]
            elif sub == _STRING:  # vocabularies and merges: 10^5 strings, kept tight
                for _ in range(count):
                    if pos + 8 > end:
                        raise _Truncated
                    pos += 8 + u64.unpack_from(buf, pos)[0]
                if pos > end:
                    raise _Truncated
            else:
                for _ in range(count):
                    skip_value(sub)
        else:
            raise ValueError(f"unknown GGUF value type {kind} at byte {pos}")

    for _ in range(n_kv):
        skip_string()
        need(4)
        (kind,) = u32.unpack_from(buf, pos)
        pos += 4
        skip_value(kind)
    spans = [(0, pos)]
    for _ in range(n_tensors):
        start = pos
        skip_string()
        need(4)
        (dims,) = u32.unpack_from(buf, pos)
        need(4 + 8 * dims + 12)
        pos += 4 + 8 * dims
        spans.append((start, pos))
        pos += 12  # type (u32), data offset (u64)
    return spans


def metadata_digest(path: str | os.PathLike[str]) -> str | None:
    """SHA-256 (hex) of the bytes of ``path`` that its config and tokenizer are read from
    (:func:`_metadata_spans`) with transformers' version, or None where the file is not
    a GGUF this parse reads."""
    import transformers

    size = 1 << 20
    with open(path, "rb") as f:
        while True:
            f.seek(0)
            head = f.read(size)
            try:
                spans = _metadata_spans(memoryview(head))
                break
            except _Truncated:
                if len(head) < size:
                    return None  # the file ends inside its own metadata
                size *= 4
            except ValueError as e:
                log.debug("GGUF metadata cache: %s: %s", path, e)
                return None
    h = hashlib.sha256()
    for start, stop in spans:
        h.update(head[start:stop])
    h.update(f"|transformers {transformers.__version__}|format {_FORMAT}".encode())
    return h.hexdigest()


def _cache_root() -> Path:
    root = os.environ.get("TOPG_CACHE_DIR") or Path.home() / ".cache" / "torch_topg"
    return Path(root) / "gguf-meta"


def _convert(folder: Path, name: str) -> tuple[Any, Any]:
    """(config, tokenizer) of ``folder / name``: built from its metadata here for the
    architectures transformers' GGUF reader does not read (``quant/gguf_arch.py``,
    ``engine/gguf_tokenizer.py``), else as transformers converts them."""
    from transformers import AutoConfig, AutoTokenizer

    from torch_topg.engine.gguf_tokenizer import tokenizer_from_metadata
    from torch_topg.quant.gguf_arch import (
        config_from_metadata,
        file_architecture,
        read_file,
        read_metadata,
    )
    from torch_topg.quant.gguf_rope import apply_rope_freqs

    try:
        metadata, names = read_metadata(folder / name)
    except ValueError as e:  # transformers' reader says what is wrong with the file
        log.debug("GGUF metadata: %s", e)
        metadata, names = {}, []
    if file_architecture(metadata) is not None:
        config = config_from_metadata(metadata, names)
        config._name_or_path = str(folder)  # as transformers names a GGUF's config
        return config, tokenizer_from_metadata(metadata)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # Llama 3's RoPE scaling is stored as a tensor transformers' reader drops
    config = apply_rope_freqs(config, read_file(folder / name)[1])
    return config, AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _save(dest: Path, config: Any, tok: Any) -> None:
    """``config`` and ``tok`` into ``dest``: written into a temporary folder beside it,
    then renamed into place (a concurrent reader sees all of it or nothing)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp"))
    try:
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "complete").write_text("")  # written last: the folder is whole
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def config_and_tokenizer(path: str | os.PathLike[str]) -> tuple[Any, Any]:
    """(config, tokenizer) of the GGUF file ``path``, as transformers converts them (or as
    :func:`_convert` builds them for an architecture transformers does not read): from
    the cache when a file with the same metadata was converted before, else converted
    and saved there (a cache that cannot be written is skipped, with a debug log)."""
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path)
    off = os.environ.get("TOPG_GGUF_META_CACHE", "1") == "0"
    digest = None if off else metadata_digest(path)
    if digest is None:
        return _convert(path.parent, path.name)
    dest = _cache_root() / digest
    if (dest / "complete").exists():
        config = AutoConfig.from_pretrained(dest)
        config._name_or_path = str(path.parent)  # as transformers names a GGUF's config
        return config, AutoTokenizer.from_pretrained(dest)
    config, tok = _convert(path.parent, path.name)
    try:
        _save(dest, config, tok)
    except OSError as e:  # read-only or full cache; another process won the rename
        if not (dest / "complete").exists():
            log.debug("GGUF metadata cache: could not save %s: %s", dest, e)
    return config, tok
